"""Property tests (hypothesis) for the slot mapping, the kernels and the KV write.

For random DCP sizes N (1..8), interleaves I (1..4), batches B (0..6), top-k widths K (0..40),
slot ranges S (1..200) and ``-1`` patterns (all-``-1`` rows included):

- ``topk_remap`` partitions each row's valid slots over the ranks: counts add up, each valid slot
  lands on exactly one rank (its owner) at ``local_row(s)``, in the row's order, tail ``-1``;
- ``lse_combine`` of a split equals attention over the union: a top-k set partitioned over N
  shards, each shard's ``(out, lse)`` from ``sparse_mla``, combined, equals ``sparse_mla`` of the
  whole set, including all-empty rows, empty shards (``lse = -inf``) whose ``out`` holds garbage
  (NaN included), and a NaN in a named KV row or in a query, which the merge shows exactly where
  the whole-set attention shows it;
- ``lse_combine`` of any LSEs (finite, +-inf, NaN) and outputs (garbage in every empty shard, NaN
  or inf in some others) is its formula: only ``-inf`` is empty, NaN and ``+inf`` propagate;
- ``kv_store`` equals a Python loop, and the DCP-localized writes store every valid token exactly
  once over the ranks' caches, at its owner's local row; attention over those local caches, merged,
  equals attention over the global cache, NaN in a named KV row included;
- ``sparse_mla`` never returns a NaN from KV rows it was not asked to read, whatever they hold.

Each property runs on the torch references and on the Triton kernels (under the interpreter on
CPU, so shapes stay tiny). Profiles (``tests/conftest.py``): ``ci`` (default, derandomized) and
``soak``: ``HYPOTHESIS_PROFILE=soak python -m pytest tests/test_properties.py``.
"""

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsa_dcp.slots import local_cache_rows, local_row, localize_slots, owner  # noqa: E402
import checks  # noqa: E402
from triton_env import (  # noqa: E402
    DEVICE,
    NEEDS_FRESH_PROCESS,
    SKIP_REASON,
    kv_store_mod,
    lse_combine_mod,
    rerun_in_fresh_interpreter,
    sparse_mla_mod,
    topk_remap_mod,
)

IMPLS = ["reference", "triton"]


@pytest.fixture(autouse=True)
def _triton_runs_here(request):
    callspec = getattr(request.node, "callspec", None)
    impl = callspec.params.get("impl") if callspec else None
    if NEEDS_FRESH_PROCESS and (impl == "triton" or request.node.originalname.endswith("_triton")):
        pytest.skip(SKIP_REASON)


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the interpreter works in this process")
def test_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__, "-k", "triton")


def examples(fraction: float) -> int:
    """A share of the profile's ``max_examples`` (for properties whose examples cost more)."""
    return max(5, int(settings.default.max_examples * fraction))


def impl_fn(op: str, impl: str):
    mod = {"topk_remap": topk_remap_mod, "lse_combine": lse_combine_mod,
           "sparse_mla": sparse_mla_mod, "kv_store": kv_store_mod}[op]  # fmt: skip
    return getattr(mod, f"{op}_{impl}")


def assert_close(actual, expected, rtol, what, nan=False):
    """``checks.assert_close`` relative to max(|e|, 1); ``nan``: NaN allowed where ``expected`` has it."""
    checks.assert_close(actual, expected, rtol, what, scale_floor=1.0, nan=nan)


# ---------------------------------------------------------------------------------------------
# strategies

dcp_sizes = st.integers(1, 8)
interleaves = st.integers(1, 4)
no_slot = st.integers(-3, -1)  # any negative id is "no slot"; shrinks to -1


@st.composite
def topk_tables(draw, max_b=6, max_k=40, max_s=200, distinct=False):
    """``(topk[B, K], S)``: slots in ``[0, S)`` and negatives, row by row all-negative, all-valid or
    mixed. ``distinct``: no slot twice in a row (attention's top-k; ``topk_remap`` takes repeats)."""
    S = draw(st.integers(1, max_s))
    B = draw(st.integers(0, max_b))
    K = draw(st.integers(0, max_k))
    slot = st.integers(0, S - 1)
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(["empty", "full", "mixed"]))
        cell = {"empty": no_slot, "full": slot, "mixed": st.one_of(no_slot, slot)}[kind]
        row = draw(st.lists(cell, min_size=K, max_size=K))
        if distinct:
            seen = set()
            row = [s if s < 0 or s not in seen and not seen.add(s) else -1 for s in row]
        rows.append(row)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    topk = torch.tensor(rows, dtype=dtype) if B else torch.empty((0, K), dtype=dtype)
    return topk, S


def random_tensor(seed: int, shape, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------
# the slot mapping itself


@given(N=dcp_sizes, I=interleaves, S=st.integers(0, 400))
def test_slot_mapping_is_a_bijection_onto_the_local_caches(N, I, S):
    s = torch.arange(S)
    o, lrow, rows = owner(s, N, I), local_row(s, N, I), local_cache_rows(S, N, I)
    assert o.tolist() == [(x // I) % N for x in range(S)]  # DESIGN.md's formulas
    assert lrow.tolist() == [(x // (N * I)) * I + x % I for x in range(S)]
    assert ((o >= 0) & (o < N)).all() and ((lrow >= 0) & (lrow < max(rows, 1))).all()
    assert len(set(zip(o.tolist(), lrow.tolist()))) == S, "two slots share a rank's row"
    # whole interleave blocks: no more than I - 1 rows beyond the highest row in use
    used = int(lrow.max()) + 1 if S else 0
    assert used <= rows < used + I or S == 0
    if I == 1:
        assert rows == -(-S // N)  # DESIGN.md: ceil(S / N) rows, never the global cache
    for r in range(N):
        loc = localize_slots(torch.cat([s, torch.tensor([-1, -2])]), N, r, I)
        assert loc[-2:].tolist() == [-1, -1]
        mine = o == r
        assert torch.equal(loc[:S][mine], lrow[mine]) and (loc[:S][~mine] == -1).all()


# ---------------------------------------------------------------------------------------------
# topk_remap


def check_remap_partition(remap, topk: torch.Tensor, N: int, I: int) -> None:
    B, K = topk.shape
    rows = topk.tolist()
    total = torch.zeros(B, dtype=torch.int64)
    owners = owner(topk.long().clamp(min=0), N, I).tolist()
    lrows = local_row(topk.long().clamp(min=0), N, I).tolist()
    recovered = [[] for _ in range(B)]
    for r in range(N):
        local, count = remap(topk.to(DEVICE), N, r, I)
        assert local.dtype == count.dtype == torch.int32, "int32 results"
        assert local.shape == (B, K) and count.shape == (B,)
        local, count = local.cpu(), count.cpu()
        for b in range(B):
            c = int(count[b])
            kept = [lrows[b][j] for j in range(K) if rows[b][j] >= 0 and owners[b][j] == r]
            assert local[b, :c].tolist() == kept, f"rank {r} row {b}: owned slots as local rows, in order"
            assert (local[b, c:] == -1).all(), f"rank {r} row {b}: tail must be -1"
            # invert local_row on rank r: the global slots this rank reads
            recovered[b] += [(x // I) * N * I + r * I + x % I for x in kept]
        total += count.long()
    valid = (topk >= 0).sum(dim=1)
    assert torch.equal(total, valid), "counts over all ranks != valid entries per row"
    for b in range(B):
        assert sorted(recovered[b]) == sorted(s for s in rows[b] if s >= 0), f"row {b}: a slot lost or doubled"


@pytest.mark.parametrize("impl", IMPLS)
@given(table=topk_tables(), N=dcp_sizes, I=interleaves)
def test_topk_remap_partitions_each_row_over_the_ranks(impl, table, N, I):
    topk, _ = table
    check_remap_partition(impl_fn("topk_remap", impl), topk, N, I)


# ---------------------------------------------------------------------------------------------
# sparse_mla + lse_combine: a split of the top-k merges back to attention over the union


@st.composite
def attention_cases(draw, max_n=8, max_h=3, poison=False):
    """A top-k table, queries and KV in fp64, N shards. ``poison``: maybe one NaN in a KV row the
    top-k names, or in one query (``case["poison"]`` says which: "none", "kv" or "query")."""
    topk, S = draw(topk_tables(distinct=True))
    B, K = topk.shape
    N = draw(st.integers(1, max_n))
    H, Dc, Dr = draw(st.integers(1, max_h)), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    sm_scale = draw(st.sampled_from([0.1, 0.35, 1.0]))
    # which shard each top-k entry goes to
    shard = torch.tensor(draw(st.lists(st.integers(0, N - 1), min_size=B * K, max_size=B * K))).view(B, K)
    seed = draw(seeds)
    q_nope = random_tensor(seed, (B, H, Dc), dtype=torch.float64)
    q_pe = random_tensor(seed + 1, (B, H, Dr), dtype=torch.float64)
    kv = random_tensor(seed + 2, (S, Dc + Dr), dtype=torch.float64)
    # what garbage the out of an empty shard holds
    garbage = draw(st.sampled_from(["nan", "inf", "noise"]))
    kind = draw(st.sampled_from(["none", "kv", "query"])) if poison else "none"
    named = topk[topk >= 0].long()
    if kind == "kv" and named.numel():
        row = int(named[draw(st.integers(0, named.numel() - 1))])
        kv[row, draw(st.integers(0, Dc + Dr - 1))] = float("nan")
    elif kind == "query" and B:
        q = q_nope if draw(st.booleans()) else q_pe
        q[draw(st.integers(0, B - 1)), draw(st.integers(0, H - 1)), draw(st.integers(0, q.shape[2] - 1))] = float("nan")
    return dict(topk=topk, S=S, N=N, shard=shard, q_nope=q_nope, q_pe=q_pe, kv=kv, sm_scale=sm_scale,
                garbage=garbage, seed=seed, poison=kind)  # fmt: skip


def corrupt_empty_shards(out, lse, garbage, seed):
    """Fill the out of each empty shard (``lse = -inf``) with garbage. Must not matter."""
    out = out.clone()
    fill = {"nan": float("nan"), "inf": float("inf")}
    noise = random_tensor(seed + 3, out.shape, scale=1e3, dtype=out.dtype).to(out.device)
    empty = torch.isneginf(lse)
    out[empty] = fill[garbage] if garbage in fill else noise[empty]
    return out


def check_split_merge(case, impl):
    topk, N, shard = case["topk"], case["N"], case["shard"]
    qn, qp, kv, scale = case["q_nope"], case["q_pe"], case["kv"], case["sm_scale"]
    exp_out, exp_lse = sparse_mla_mod.sparse_mla_reference(qn, qp, kv, topk, scale, compute_dtype=torch.float64)
    parts = [torch.where(shard == r, topk, torch.full_like(topk, -1)) for r in range(N)]
    if impl == "reference":  # fp64 partials, merged by the reference
        partial = [
            sparse_mla_mod.sparse_mla_reference(qn, qp, kv, p, scale, compute_dtype=torch.float64) for p in parts
        ]
        combine, rtol = lse_combine_mod.lse_combine_reference, 1e-5
    else:  # the Triton path end to end, in fp32
        args = [t.float().to(DEVICE) for t in (qn, qp, kv)]
        partial = [sparse_mla_mod.sparse_mla_triton(*args, p.to(DEVICE), scale) for p in parts]
        combine, rtol = lse_combine_mod.lse_combine_triton, 1e-4
    out = torch.stack([o for o, _ in partial])
    lse = torch.stack([lz for _, lz in partial])
    if case["poison"] == "none":
        for o, lz in partial:
            assert not torch.isnan(o).any() and not torch.isnan(lz).any(), "sparse_mla returned NaN"
    out = corrupt_empty_shards(out, lse, case["garbage"], case["seed"])
    res, res_lse = combine(out, lse)
    assert res.dtype == out.dtype and res_lse.dtype == torch.float32
    # NaN exactly where the whole-set attention has it (a NaN row's LSE too): never hidden, never added
    assert_close(res, exp_out, rtol, f"{impl}: merged out", nan=True)
    assert_close(res_lse, exp_lse, rtol, f"{impl}: merged lse", nan=True)
    empty_rows = (topk < 0).all(dim=1)
    assert (res.cpu()[empty_rows] == 0).all() and torch.isneginf(res_lse.cpu()[empty_rows]).all(), "empty rows"


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=examples(0.4))  # a sparse_mla and a combine launch per example, interpreted
@given(case=attention_cases(poison=True))
def test_lse_combine_of_a_split_equals_attention_over_the_union(impl, case):
    check_split_merge(case, impl)


@pytest.mark.parametrize("impl", IMPLS)
@given(
    N=st.integers(0, 8),
    B=st.integers(0, 4),
    H=st.integers(0, 3),
    D=st.integers(1, 9),
    data=st.data(),
)
def test_lse_combine_follows_its_formula_on_any_values(impl, N, B, H, D, data):
    """Any LSE (finite, +-inf, NaN), garbage in the out of every empty shard, NaN or inf in the out
    of some others: the result is the brute force's, NaN exactly where it has NaN; a (b, h) whose
    every LSE is -inf (or N = 0) gives exactly (0, -inf); one without NaN or +inf anywhere it reads
    gives no NaN."""
    lse_values = st.one_of(st.floats(-50, 50), st.sampled_from([float("-inf"), float("inf"), float("nan")]))
    lse = torch.tensor(data.draw(st.lists(lse_values, min_size=N * B * H, max_size=N * B * H)), dtype=torch.float32)
    lse = lse.view(N, B, H)
    out = random_tensor(data.draw(seeds), (N, B, H, D))
    empty = torch.isneginf(lse)
    out[empty] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    sometimes = st.sampled_from([False, False, False, False, True])
    bad = torch.tensor(data.draw(st.lists(sometimes, min_size=N * B * H, max_size=N * B * H)), dtype=torch.bool)
    bad = bad.view(N, B, H)
    out[bad, 0] = data.draw(st.sampled_from([float("nan"), float("inf")]))
    res, res_lse = impl_fn("lse_combine", impl)(out.to(DEVICE), lse.to(DEVICE))
    res, res_lse = res.cpu(), res_lse.cpu()
    exp_out, exp_lse = checks.brute_lse_combine(out, lse)
    assert_close(res, exp_out, 1e-5, f"{impl}: out", nan=True)
    assert_close(res_lse, exp_lse, 1e-5, f"{impl}: lse", nan=True)
    none = empty.all(dim=0) if N else torch.ones((B, H), dtype=torch.bool)
    assert torch.equal(torch.isneginf(res_lse), none)
    assert (res[none] == 0).all()
    read = ~empty[..., None] & ~torch.isfinite(out)  # non-finite values a non-empty shard contributes
    clean = ~(lse.isnan() | torch.isposinf(lse) | read.any(-1)).any(dim=0) if N else none
    assert not res[clean].isnan().any() and not res_lse[clean].isnan().any()


@pytest.mark.parametrize("impl", IMPLS)
@given(case=attention_cases(max_n=1), poison=st.sampled_from(["nan", "inf", "-inf"]), data=st.data())
def test_sparse_mla_reads_only_the_rows_it_is_given(impl, case, poison, data):
    """KV rows not named by any top-k entry (an unwritten cache, say) may hold anything."""
    topk, kv, scale = case["topk"], case["kv"], case["sm_scale"]
    exp_out, exp_lse = sparse_mla_mod.sparse_mla_reference(
        case["q_nope"], case["q_pe"], kv, topk, scale, compute_dtype=torch.float64
    )
    named = torch.zeros(kv.shape[0], dtype=torch.bool)
    named[topk[topk >= 0].long()] = True
    bad = kv.clone()
    bad[~named] = float(poison)
    args = [t.float().to(DEVICE) for t in (case["q_nope"], case["q_pe"], bad)]
    kwargs = {}
    if impl == "triton":  # the tile shapes and K splits it may run with
        block = data.draw(st.sampled_from([(None, None), (2, 4), (4, 8), (16, 16)]))
        kwargs = dict(block_h=block[0], block_k=block[1], num_splits=data.draw(st.integers(1, 3)))
    out, lse = impl_fn("sparse_mla", impl)(*args, topk.to(DEVICE), scale, **kwargs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close(out, exp_out, 1e-4, f"{impl}: out")
    assert_close(lse, exp_lse, 1e-4, f"{impl}: lse")
    empty = (topk < 0).all(dim=1)
    assert (out.cpu()[empty] == 0).all() and torch.isneginf(lse.cpu()[empty]).all(), "a row with no slot"


@settings(max_examples=examples(0.25))  # two interpreted launches per example; the soak profile runs many
@given(case=attention_cases(max_n=1), data=st.data())
def test_slots_past_the_cache_are_skipped_triton(case, data):
    """A slot >= S breaks the contract; the Triton kernels skip it rather than touch memory past
    the cache (the caches here are views with NaN rows after them), the references raise."""
    topk, S, kv, scale = case["topk"], case["S"], case["kv"].float(), case["sm_scale"]
    B, K = topk.shape
    past = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * K, max_size=B * K)), dtype=torch.bool)
    past = past.view(B, K)
    wild = torch.where(past, S + (torch.arange(B * K).view(B, K) % 3), topk)  # S, S+1, S+2
    wild = wild.to(topk.dtype)
    exp_out, exp_lse = sparse_mla_mod.sparse_mla_reference(
        case["q_nope"], case["q_pe"], case["kv"], torch.where(past, -1, topk), scale, compute_dtype=torch.float64
    )
    big = torch.full((S + 3, kv.shape[1]), float("nan"))
    big[:S] = kv
    q = [case[k].float().to(DEVICE) for k in ("q_nope", "q_pe")]
    out, lse = sparse_mla_mod.sparse_mla_triton(*q, big.to(DEVICE)[:S], wild.to(DEVICE), scale)
    assert_close(out, exp_out, 1e-4, "out")
    assert_close(lse, exp_lse, 1e-4, "lse")
    # kv_store: the rows past the cache stay NaN, the rows in it are written as by the loop
    near_or_past = st.one_of(st.integers(-1, S - 1), st.integers(S, S + 2))
    slots = torch.tensor(data.draw(st.lists(near_or_past, unique=True, max_size=6)), dtype=torch.int64)
    rows = random_tensor(case["seed"], (len(slots), kv.shape[1]))
    big = torch.full((S + 3, kv.shape[1]), float("nan"))
    dev = big.clone().to(DEVICE)
    kv_store_mod.kv_store_triton(dev[:S], slots.to(DEVICE), rows.to(DEVICE))
    expected = loop_store(big, torch.where(slots < S, slots, -1), rows)
    got = dev.cpu()
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
    if bool(past.any()):
        with pytest.raises((IndexError, RuntimeError)):
            sparse_mla_mod.sparse_mla_reference(*[case[k] for k in ("q_nope", "q_pe", "kv")], wild, scale)


# ---------------------------------------------------------------------------------------------
# kv_store: single cache, and localized over the DCP ranks


@st.composite
def kv_writes(draw, max_b=6, max_s=200):
    """``(S, slots[B], rows[B, D], dtype)``: distinct valid slots, negatives at random places."""
    S = draw(st.integers(1, max_s))
    B = draw(st.integers(0, max_b))
    valid = draw(st.lists(st.integers(0, S - 1), unique=True, max_size=min(B, S)))
    cells = valid + draw(st.lists(no_slot, min_size=B - len(valid), max_size=B - len(valid)))
    order = draw(st.permutations(range(B)))
    slots = torch.tensor([cells[i] for i in order], dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    D = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    rows = random_tensor(draw(seeds), (B, D), dtype=dtype)
    return S, slots, rows, dtype


def loop_store(cache, slots, rows):
    expected = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s] = rows[i]
    return expected


@pytest.mark.parametrize("impl", IMPLS)
@given(write=kv_writes())
def test_kv_store_equals_a_python_loop(impl, write):
    S, slots, rows, dtype = write
    cache = random_tensor(7, (S, rows.shape[1]), dtype=dtype)
    expected = loop_store(cache, slots, rows)
    got = cache.clone().to(DEVICE)
    impl_fn("kv_store", impl)(got, slots.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), expected)  # bit-exact: same dtype, nothing rounded


@pytest.mark.parametrize("impl", IMPLS)
@given(write=kv_writes(), N=dcp_sizes, I=interleaves)
def test_localized_kv_writes_store_each_token_once_at_its_owner(impl, write, N, I):
    S, slots, rows, dtype = write
    B, D = rows.shape
    store = impl_fn("kv_store", impl)
    n_rows = local_cache_rows(S, N, I)
    caches = []
    for r in range(N):
        cache = torch.full((n_rows, D), float("nan"), dtype=dtype, device=DEVICE)  # NaN: never written
        local = localize_slots(slots.to(DEVICE), N, r, I)
        assert local.dtype == slots.dtype and ((local >= -1) & (local < n_rows)).all(), "a local row off the cache"
        store(cache, local, rows.to(DEVICE))
        caches.append(cache.cpu())
    written = torch.stack([~torch.isnan(c).any(dim=1) for c in caches])  # [N, rows]
    valid = [(i, s) for i, s in enumerate(slots.tolist()) if s >= 0]
    assert int(written.sum()) == len(valid), "tokens stored != valid tokens (one copy each, over all ranks)"
    for i, s in valid:
        r = (s // I) % N
        lrow = (s // (N * I)) * I + s % I
        assert torch.equal(caches[r][lrow], rows[i]), f"token {i} (slot {s}) not at rank {r} row {lrow}"
    # gathering the ranks' rows back by slot gives the single-cache write
    glob = loop_store(torch.full((S, D), float("nan"), dtype=dtype), slots, rows)
    s = torch.arange(S)
    gathered = torch.stack([caches[o][lr] for o, lr in zip(owner(s, N, I).tolist(), local_row(s, N, I).tolist())])
    assert torch.equal(gathered.isnan(), glob.isnan()) and torch.equal(gathered.nan_to_num(), glob.nan_to_num())


# ---------------------------------------------------------------------------------------------
# the DCP step end to end: localized writes, remap, local attention, merge == one device


def check_dcp_step(case, I, impl):
    topk, S, N = case["topk"], case["S"], case["N"]
    scale = case["sm_scale"]
    qn, qp, kv = case["q_nope"].float(), case["q_pe"].float(), case["kv"].float()
    exp_out, exp_lse = sparse_mla_mod.sparse_mla_reference(
        case["q_nope"], case["q_pe"], case["kv"], topk, scale, compute_dtype=torch.float64
    )
    mla, remap, combine = (impl_fn(op, impl) for op in ("sparse_mla", "topk_remap", "lse_combine"))
    store = impl_fn("kv_store", impl)
    slots = torch.arange(S)
    outs, lses = [], []
    for r in range(N):
        # this rank's cache: only the tokens it owns were written; the other rows were never set
        cache = torch.full((local_cache_rows(S, N, I), kv.shape[1]), float("nan"), device=DEVICE)
        store(cache, localize_slots(slots, N, r, I).to(DEVICE), kv.to(DEVICE))
        local, _ = remap(topk.to(DEVICE), N, r, I)
        o, lz = mla(qn.to(DEVICE), qp.to(DEVICE), cache, local, scale)
        outs.append(o)
        lses.append(lz)
    out, lse = combine(torch.stack(outs), torch.stack(lses))
    assert_close(out, exp_out, 1e-4, f"{impl}: out", nan=True)
    assert_close(lse, exp_lse, 1e-4, f"{impl}: lse", nan=True)


@given(case=attention_cases(poison=True), I=interleaves)
def test_dcp_attention_over_local_caches_equals_one_device_reference(case, I):
    check_dcp_step(case, I, "reference")


# N launches of each kernel per example, interpreted: the slowest property. Each kernel's own
# property above covers its inputs (N up to 8, every -1 pattern) with more examples; this one checks
# that they compose, which the reference twin above checks on the profile's full count.
@settings(max_examples=examples(0.125))
@given(case=attention_cases(poison=True), I=interleaves)
def test_dcp_attention_over_local_caches_equals_one_device_triton(case, I):
    check_dcp_step(case, I, "triton")
