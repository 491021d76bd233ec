"""FP8 E4M3 KV end to end: kv_store's quantization (torch reference and Triton kernel, against a
brute force over the E4M3 values), the attention reading it, and the reference model with FP8 KV
and FP8 index keys under DCP on gloo ranks against the single-rank model with the same FP8 caches.
"""

import math

import pytest
import torch

from dsa_dcp.kernels import kv_store as kv_store_mod
from dsa_dcp.kernels import sparse_mla as sparse_mla_mod
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.slots import local_cache_rows, local_row, owner


pytestmark = pytest.mark.usefixtures("kept_ranks")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' device (interpreted on CPU)
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- brute force


def _e4m3_brute(values: torch.Tensor) -> torch.Tensor:
    """Bytes of the nearest E4M3 value to each fp64 value (ties: the even byte), saturating at
    +-448, NaN to 0x7F (0xFF with its sign bit): by search over the 254 finite E4M3 values, independent of any cast."""
    finite = [(float(v), b) for b, v in enumerate(E4M3.double().tolist()) if math.isfinite(v)]
    out = []
    for x in values.double().reshape(-1).tolist():
        if math.isnan(x):  # E4M3's NaN, with the value's sign bit
            out.append(0xFF if math.copysign(1.0, x) < 0 else 0x7F)
            continue
        x = max(-448.0, min(448.0, x))
        best = min(finite, key=lambda vb: (abs(vb[0] - x), vb[1] & 1, vb[1]))
        if best[0] == 0:  # zero keeps the value's sign: 0x00 or 0x80
            best = (0.0, 0x80 if math.copysign(1.0, x) < 0 else 0x00)
        out.append(best[1])
    return torch.tensor(out, dtype=torch.int32).to(torch.uint8).view(values.shape)


def _brute_store(rows: torch.Tensor, kv_scale, block: bool):
    """(bytes [B, D], scales [B, G] or None) the contract asks for: the fp32 product with
    fp32(1 / kv_scale), or fp64 loops over the groups for the power-of-two scales."""
    y = rows.double()
    if not block:
        inv = torch.tensor(1.0 / kv_scale, dtype=torch.float32)
        return _e4m3_brute(rows.float() * inv), None
    b, d = y.shape
    groups = -(-d // 128)
    scales = torch.empty(b, groups, dtype=torch.float64)
    out = torch.empty(b, d, dtype=torch.uint8)
    for i in range(b):
        for g in range(groups):
            part = y[i, g * 128:(g + 1) * 128]
            finite = part[torch.isfinite(part)].abs()
            amax = finite.max().item() if finite.numel() else 0.0
            e = 0
            if amax > 0:
                e = -200
                while amax > 448.0 * 2.0**e:
                    e += 1
                e = max(-126, min(127, e))
            scales[i, g] = 2.0**e
            out[i, g * 128:(g + 1) * 128] = _e4m3_brute(part / 2.0**e)
    return out, scales.float()


def _rows(b, d, dtype, gen):
    """Rows across E4M3's range: normals, subnormals, past 448, exact ties, zeros, +-inf, NaN."""
    rows = torch.randn(b, d, generator=gen, dtype=torch.float64) * torch.logspace(-4, 3, b, dtype=torch.float64)[:, None]
    ties = torch.tensor([1.0625, 3 * 2.0**-10, 2.0**-10, -0.0, 0.0, 460.0, -1e6, float("inf"), -float("inf"),
                         float("nan"), 0.015625, 0.0146484375])
    rows[0, :ties.numel()] = ties.double()[: d]
    # exact midpoints between neighbouring E4M3 values below 1.5 (a small amax: a block scale keeps them ties)
    grid = E4M3.double()
    grid = grid[torch.isfinite(grid) & (grid >= 0) & (grid < 1.5)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    mids = mids[torch.linspace(0, mids.numel() - 1, min(d, mids.numel())).long()]  # subnormal ones included
    rows[1, :mids.numel()] = mids * torch.where(torch.arange(mids.numel()) % 2 == 0, 1.0, -1.0).double()
    rows[-1] = 0.0
    return rows.to(dtype)


# --------------------------------------------------------------------------- kv_store


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("form", ["tensor", "block"])
@pytest.mark.parametrize("d, rows_dtype", [(24, torch.float32), (300, torch.bfloat16)])
def test_fp8_kv_store_writes_the_contract_bytes(impl, form, d, rows_dtype):
    gen = torch.Generator().manual_seed(hash((impl, form, d)) % 2**31)
    b, s = 7, 11
    rows = _rows(b, d, rows_dtype, gen)
    slots = torch.randperm(s, generator=gen)[:b]
    slots[2] = -1  # skipped
    slots[4] = -7
    # d = 24: scale 1 (the ties stay ties); d = 300: any scale
    kv_scale = None if form == "block" else (1.0 if d == 24 else float(torch.rand((), generator=gen)) * 4 + 0.05)
    sentinel = 0x5A
    cache = torch.full((s, d), sentinel, dtype=torch.uint8).view(torch.float8_e4m3fn)
    groups = -(-d // 128)
    scales = torch.full((s, groups), -3.0) if form == "block" else None
    if impl == "reference":
        kv_store_mod.kv_store_reference(cache, slots, rows, kv_scale, scales)
    else:
        on = [t.to(DEVICE) if t is not None else None for t in (cache, slots, rows, scales)]
        kv_store_mod.kv_store_triton(on[0], on[1], on[2], kv_scale, on[3])
        cache.copy_(on[0].cpu())
        if scales is not None:
            scales.copy_(on[3].cpu())

    want, want_scales = _brute_store(rows.float(), kv_scale, form == "block")
    got = cache.view(torch.uint8)
    keep = slots >= 0
    assert torch.equal(got[slots[keep]], want[keep])
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (got[untouched] == sentinel).all()
    if form == "block":
        assert torch.equal(scales[slots[keep]], want_scales[keep])
        assert (scales[untouched] == -3.0).all()


def test_fp8_kv_store_refuses_a_missing_or_doubled_scale():
    cache = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    slots, rows = torch.tensor([1]), torch.randn(1, 8)
    for store in (kv_store_mod.kv_store_reference, kv_store_mod.kv_store_triton):
        with pytest.raises(ValueError, match="an FP8 cache needs exactly one of kv_scale"):
            store(cache, slots, rows)
        with pytest.raises(ValueError, match="an FP8 cache needs exactly one of kv_scale"):
            store(cache, slots, rows, 1.0, torch.zeros(4, 1))
        with pytest.raises(ValueError, match=r"block_scales must be an fp32 tensor of shape \[4, 1\] or \[4\]"):
            store(cache, slots, rows, None, torch.zeros(3, 1))
        with pytest.raises(ValueError, match="only for an FP8 cache"):
            store(torch.zeros(4, 8), slots, rows, 1.0)


TILES = {  # the Triton kernel's paths: elementwise, tensor-core with 3 splits, key-major, two programs a head block
    "elementwise": dict(block_h=2, block_k=4, num_splits=1),
    "dot, 3 splits": dict(block_h=16, block_k=16, num_splits=3),
    "key-major": dict(block_h=16, block_k=16, key_major=True, num_splits=1),
    "dc_split": dict(block_h=16, block_k=16, dc_split=2, num_splits=1),
}


@pytest.mark.parametrize("impl", ["reference"] + list(TILES))
@pytest.mark.parametrize("d", [24, 200])
def test_sparse_mla_reads_block_scales(d, impl):
    """The reference and the Triton kernel over an FP8 cache with per-128 scales are the fp64
    attention over the dequantized rows (e4m3 * scale of the column's group)."""
    gen = torch.Generator().manual_seed(d)
    b, h, s, k, dr = 3, 2, 50, 40, 8
    dc = d - dr
    cache = torch.zeros(s, d, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(s, -(-d // 128))
    kv_store_mod.kv_store_reference(cache, torch.arange(s), torch.randn(s, d, generator=gen) * 3, None, scales)
    real = cache.double() * scales.double().repeat_interleave(128, 1)[:, :d]
    q_nope, q_pe = torch.randn(b, h, dc, generator=gen), torch.randn(b, h, dr, generator=gen)
    topk = torch.randint(0, s, (b, k), generator=gen)
    topk[1, 2:] = -1
    topk[2] = -1
    if impl == "reference":
        out, lse = sparse_mla_mod.sparse_mla_reference(q_nope, q_pe, cache, topk, 0.3, block_scales=scales)
    else:
        out, lse = sparse_mla_mod.sparse_mla_triton(*(t.to(DEVICE) for t in (q_nope, q_pe, cache, topk)), 0.3,
                                                    block_scales=scales.to(DEVICE), **TILES[impl])
        out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = sparse_mla_mod.sparse_mla_reference(q_nope.double(), q_pe.double(), real, topk, 0.3,
                                                             compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5 * want_out.abs().max().item())
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all() and (lse[2] == -math.inf).all()


@pytest.mark.parametrize("form", [dict(kv_dtype="fp8", kv_scale=0.5), dict(kv_dtype="fp8", kv_scales="block"),
                                  dict(kv_dtype="fp8", kv_scale=3.0, index_key_dtype="fp8")], ids=str)
def test_the_fp8_model_reads_what_it_wrote(form):
    """One layer, fed the same rows as the full-precision model (teacher forcing): the FP8 model's
    logits differ by E4M3's rounding, not more (a scale written but not read, or read twice, would
    move them by the scale); its caches dequantize to the full-precision caches' rows within
    E4M3's relative step 2^-4."""
    cfg = get_config(FAMILY, n_layers=1, **form)
    ref_cfg = get_config(FAMILY, n_layers=1)
    batch = standard_test_batch(ref_cfg, max_new_tokens=3, seed=5)
    ref, fp8 = DSAModel(ref_cfg, batch.num_slots, seed=3), DSAModel(cfg, batch.num_slots, seed=3)
    pairs = []

    def both(*inputs):
        a = ref(*inputs)
        pairs.append((fp8(*inputs), a))
        return a

    with torch.no_grad():
        generate(both, batch, 3)
    errors = [((a - b).norm() / b.norm()).item() for a, b in pairs]
    assert 0 < max(errors) < 0.1, errors
    attn, want = fp8.layers[0].attn, ref.kv_caches()[0]
    real = attn.kv_cache.float()
    real = real * (cfg.kv_scale if cfg.kv_scales == "tensor" else attn.kv_block_scales.repeat_interleave(128, 1)[:, :cfg.kv_dim])
    written = want.abs().sum(-1) > 0
    assert written.sum() > 0
    step = 2.0**-4 * want[written].abs() + 2.0**-9 * (cfg.kv_scale if cfg.kv_scales == "tensor" else 1.0)
    assert ((real[written] - want[written]).abs() <= step).all()


# --------------------------------------------------------------------------- the model under DCP

STEPS = 4
ROWS = 8
FAMILY = "glm5.2-tiny"
LAYERS = 4  # layer 3 reuses layer 2's top-k (IndexShare)
VARIANTS = {  # both with FP8 index keys: replicated with the first, sharded with the second (CASES)
    "tensor": dict(kv_dtype="fp8", kv_scale=0.5, index_key_dtype="fp8"),
    "block": dict(kv_dtype="fp8", kv_scales="block", index_key_dtype="fp8"),
}


def _setup(variant):
    cfg = get_config(FAMILY, n_layers=LAYERS, **VARIANTS[variant])
    return cfg, standard_test_batch(cfg, max_new_tokens=STEPS, seed=7)


def _caches(model):
    return {
        "kv": [c.view(torch.uint8).clone() for c in model.kv_caches()],
        "kv_scales": [layer.attn.kv_block_scales.clone() for layer in model.layers],
        "keys": {i: c.view(torch.uint8).clone() if c.dtype == torch.float8_e4m3fn else c.clone()
                 for i, c in model.index_caches().items()},
        "key_scales": {i: layer.attn.indexer.key_scale.clone() for i, layer in enumerate(model.layers)
                       if layer.attn.indexer is not None},
    }


class _Writer(torch.nn.Module):
    """A step that only writes an FP8 cache allocated for the group (kv_store with its scale)."""

    def __init__(self, num_slots, dim, world, form):
        super().__init__()
        from dsa_dcp.kv_cache import allocate_block_scales, allocate_kv_cache

        self.cache = allocate_kv_cache(num_slots, dim, dcp_size=world, dtype=torch.float8_e4m3fn)
        self.scales = allocate_block_scales(self.cache) if form == "block" else None
        self.kv_scale = 0.75 if form == "tensor" else None

    def forward(self, slots, rows):
        if self.scales is None:
            torch.ops.dsa_dcp.kv_store.default(self.cache, slots, rows, self.kv_scale)
        else:
            torch.ops.dsa_dcp.kv_store_block_scaled.default(self.cache, slots, rows, self.scales)
        return rows.sum()


WRITE_SLOTS, WRITE_DIM = 37, 200


def _write_inputs(world):
    gen = torch.Generator().manual_seed(world)
    slots = torch.randperm(WRITE_SLOTS, generator=gen)[:20]
    slots[3] = -1
    return slots, _rows(20, WRITE_DIM, torch.float32, gen)


def _dcp_rank(rank, world, cases):
    from one_trace import OneTrace

    results = {}
    for form in ("tensor", "block"):  # the write alone: the same rows on every rank, so the same bytes
        torch._dynamo.reset()
        writer = _Writer(WRITE_SLOTS, WRITE_DIM, world, form)
        options = {"dcp_size": world, "lowering": "fx"}
        torch.compile(writer, backend="dsa_dcp", options=options, fullgraph=True)(*_write_inputs(world))
        results[form] = (writer.cache.view(torch.uint8).clone(), writer.scales)
    models = {}  # (variant, index_cache) -> its merges: one trace a model, compiled once a merge
    for variant, merge, index_cache in cases:
        models.setdefault((variant, index_cache), []).append(merge)
    for (variant, index_cache), merges in models.items():
        cfg, batch = _setup(variant)
        torch._dynamo.reset()
        model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=11, index_cache=index_cache)
        backend = OneTrace({merge: {"dcp_size": world, "merge": merge, "lowering": "fx", "index_cache": index_cache}
                            for merge in merges})
        step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        for merge in merges:
            backend.select(merge)
            model.reset_caches()
            with torch.no_grad():
                out = generate(step, batch, STEPS, pad_to=ROWS)
            results[(variant, merge, index_cache)] = {"tokens": out.tokens, "logits": out.step_logits,
                                                      **_caches(model)}
            if (variant, merge, index_cache) in NAN_CASES:  # a NaN byte in one FP8 KV row, on its owner
                slot = torch.tensor([batch.slot(*POISON)])
                row = int(local_row(slot, world, 1)) if int(owner(slot, world, 1)) == rank else None
                model.reset_caches()
                with torch.no_grad():
                    results["nan", variant, merge, index_cache] = generate(
                        _poisoned(step, model, row), batch, STEPS, pad_to=ROWS).step_logits
    return results


# The NaN cases, each one of the CASES run again (its compilation): a NaN byte in one FP8 KV row with
# per-tensor scales under ag_rs, and with block scales under ag (sharded FP8 keys).
NAN_CASES = (("tensor", "ag_rs", "replicated"), ("block", "ag", "sharded"))
POISON = (0, 1)  # request 0's position 1: written by the prompt step, read by the steps after it


def _poisoned(step, model, row):
    """``step``, with a NaN byte (0x7F, E4M3's NaN) written into ``row`` of layer 1's FP8 cache after
    the first step (nothing when ``row`` is None: the rank does not own the slot)."""
    calls = []

    def run(*inputs):
        if len(calls) == 1 and row is not None:
            model.kv_caches()[1].view(torch.uint8)[row, 3] = 0x7F
        calls.append(None)
        return step(*inputs)

    return run


def _single_rank(variant):
    cfg, batch = _setup(variant)
    model = DSAModel(cfg, batch.num_slots, seed=11)
    with torch.no_grad():
        ref = generate(model, batch, STEPS, pad_to=ROWS)
    return cfg, batch, ref, _caches(model)


def _split_rows(num_slots, world, rank_tensors):
    """The global rows rebuilt from each rank's local rows (by owner and local row), and whether a
    rank's rows that hold no slot of it are all zero (never written)."""
    slots = torch.arange(num_slots)
    own, row = owner(slots, world, 1), local_row(slots, world, 1)
    rebuilt = torch.zeros((num_slots,) + tuple(rank_tensors[0].shape[1:]), dtype=rank_tensors[0].dtype)
    clean = True
    for r, local in enumerate(rank_tensors):
        assert local.shape[0] == local_cache_rows(num_slots, world, 1)
        mine = own == r
        rebuilt[mine] = local[row[mine]]
        used = torch.zeros(local.shape[0], dtype=torch.bool)
        used[row[mine]] = True
        clean &= bool((local[~used] == 0).all())
    return rebuilt, clean


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# Every merge mode, not the whole cross-product. The FP8 forms change what is stored and how the
# local attention reads it, before the merge; a merge sees an (out, lse) pair like any other, so
# each form needs one merge and each merge one form. N = 2 runs the head-sharded merges (a2a, ag_rs,
# fused_a2a) with per-tensor scales and FP8 index keys in a replicated index cache, and block scales
# with FP8 index keys in a sharded index cache with a2a and ag. The cases of one model are traced once
# (tests/one_trace.py), and NAN_CASES run two of them again with a NaN byte in one FP8 row: it shows
# in the same logits as on one rank. What N changes is which rank owns a slot (the writes, their
# local rows, the sharded keys), the same for every cache dtype: a group whose slots do not split
# evenly (N = 3) is checked by tests/test_dcp.py (KV writes, every layer's cache rebuilt from its
# owners) and tests/test_sharded_index.py (sharded index keys).
CASES = {
    2: [("tensor", "a2a", "replicated"), ("tensor", "ag_rs", "replicated"), ("tensor", "fused_a2a", "replicated"),
        ("block", "a2a", "sharded"), ("block", "ag", "sharded")],
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN case
@pytest.mark.parametrize("world", sorted(CASES))
def test_fp8_kv_under_dcp_matches_the_single_rank_model(world):
    cases = CASES[world]
    ranks = run_on_ranks(_dcp_rank, world, cases, timeout=600)
    for form in ("tensor", "block"):  # a step that only writes: the owner's bytes are the single-rank bytes
        one = _Writer(WRITE_SLOTS, WRITE_DIM, 1, form)
        one(*_write_inputs(world))
        rebuilt, clean = _split_rows(WRITE_SLOTS, world, [r[form][0] for r in ranks])
        assert clean and (rebuilt != 0).any()
        assert torch.equal(rebuilt, one.cache.view(torch.uint8)), form
        if form == "block":
            scales, _ = _split_rows(WRITE_SLOTS, world, [r[form][1] for r in ranks])
            assert torch.equal(scales, one.scales)
    singles = {variant: _single_rank(variant) for variant in {c[0] for c in cases}}
    # NaN: the rows that read the poisoned slot are NaN exactly where the single-rank model's are
    for nan_case in NAN_CASES:
        cfg, batch = _setup(nan_case[0])
        model = DSAModel(cfg, batch.num_slots, seed=11)
        with torch.no_grad():
            ref = generate(_poisoned(model, model, batch.slot(*POISON)), batch, STEPS, pad_to=ROWS).step_logits
        assert any(b.isnan().any() for b in ref) and all(not b.isnan().all() for b in ref)
        for r in ranks:
            for a, b in zip(r[("nan",) + nan_case], ref, strict=True):
                assert torch.equal(a.isnan(), b.isnan()), nan_case
                finite = ~b.isnan().any(dim=1)
                assert _relative_error(a[finite], b[finite]) < 1e-5, nan_case
    for case in cases:
        variant = case[0]
        cfg, batch, ref, want = singles[variant]
        got = [r[case] for r in ranks]
        for res in got:
            assert res["tokens"] == ref.tokens, case
            for a, b in zip(res["logits"], ref.step_logits, strict=True):
                assert _relative_error(a, b) < 1e-5, case
        # The KV bytes (and block scales) each owner holds are the single-rank cache's rows. Layer 0's
        # rows come from the embeddings alone: the same bytes. A later layer's rows come from hidden
        # states that agree up to fp32 reassociation, so a value within an ulp of an E4M3 rounding tie
        # may land on the neighbouring code: at most one code step, in a handful of the elements.
        for layer in range(cfg.n_layers):
            rebuilt, clean = _split_rows(batch.num_slots, world, [res["kv"][layer] for res in got])
            assert clean, (case, layer)
            assert (want["kv"][layer] != 0).any()
            if layer == 0:
                assert torch.equal(rebuilt, want["kv"][layer]), case
            step = (rebuilt.int() - want["kv"][layer].int()).abs()
            assert step.max() <= 1 and (step > 0).float().mean() < 1e-3, (case, layer, int((step > 0).sum()))
            if variant == "block":
                rebuilt, _ = _split_rows(batch.num_slots, world, [res["kv_scales"][layer] for res in got])
                assert (want["kv_scales"][layer] > 0).any()
                if layer == 0:
                    assert torch.equal(rebuilt, want["kv_scales"][layer]), case
                ratio = rebuilt / want["kv_scales"][layer]  # a tie at a group's amax may move its scale a step
                assert ((rebuilt == want["kv_scales"][layer]) | (ratio == 2) | (ratio == 0.5)).all(), (case, layer)
        for i, keys in want["keys"].items():
            if case[2] == "sharded":
                rebuilt, clean = _split_rows(batch.num_slots, world, [res["keys"][i] for res in got])
                assert clean
                scales, _ = _split_rows(batch.num_slots, world, [res["key_scales"][i] for res in got])
            else:  # replicated: every rank holds every key
                assert all(torch.equal(res["keys"][i], got[0]["keys"][i]) for res in got)
                rebuilt, scales = got[0]["keys"][i], got[0]["key_scales"][i]
            # FP8 keys: the same bytes and scales (up to ties past layer 0, as above)
            assert keys.dtype == torch.uint8 and (keys != 0).any()
            if i == 0:
                assert torch.equal(rebuilt, keys) and torch.equal(scales, want["key_scales"][i]), case
            step = (rebuilt.int() - keys.int()).abs()
            assert step.max() <= 1 and (step > 0).float().mean() < 1e-3, (case, i)


# --------------------------------------------------------------------------- refusals at compile time


def _fp8_step(write):
    def step(q_nope, q_pe, cache, topk, slots, rows):
        write(cache, slots, rows)
        out, lse = torch.ops.dsa_dcp.sparse_mla.default(q_nope, q_pe, cache, topk, 0.5, 1.0)
        return out
    return step


def _compile_error(fn, cache):
    from dsa_dcp.inspection.targets import fake_group

    g = torch.Generator().manual_seed(0)
    b, h, dc, dr, k = 3, 4, 8, 4, 5
    inputs = (torch.randn(b, h, dc, generator=g), torch.randn(b, h, dr, generator=g), cache,
              torch.randint(-1, 24, (b, k), generator=g), torch.randint(-1, 24, (b,), generator=g),
              torch.randn(b, dc + dr, generator=g))
    with fake_group(2):
        torch._dynamo.reset()
        with pytest.raises(Exception) as err:
            torch.compile(fn, backend="dsa_dcp", options={"dcp_size": 2, "merge": "ag"}, fullgraph=True)(*inputs)
    return str(err.value)


def test_an_fp8_cache_written_without_its_scale_is_refused_at_compile_time():
    import dsa_dcp

    cache = dsa_dcp.allocate_kv_cache(24, 12, dcp_size=2, dtype=torch.float8_e4m3fn)

    def plain(cache, slots, rows):
        cache[slots] = rows.to(cache.dtype)

    message = _compile_error(_fp8_step(plain), cache)
    assert "FP8 KV cache" in message and "must be written by kv_store with its scale" in message
    message = _compile_error(_fp8_step(torch.ops.dsa_dcp.kv_store.default), cache)  # kv_store without a scale
    assert "an FP8 cache needs exactly one of kv_scale (per tensor) or block_scales (per 128 columns)" in message


class _FP8PositionCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from dsa_dcp.position_cache import allocate_position_cache

        self.register_buffer("kv_cache", allocate_position_cache((2, 8, 4), 1, dcp_size=2, dtype=torch.float8_e4m3fn))

    def forward(self, x, start_pos: int):
        self.kv_cache[:2, start_pos:start_pos + 1] = x.to(torch.float8_e4m3fn)
        return self.kv_cache[:2, :start_pos + 1].float().sum(1)


def test_an_fp8_position_cache_is_refused_under_dcp():
    from dsa_dcp.inspection.targets import fake_group

    torch._dynamo.reset()
    with fake_group(2):
        compiled = torch.compile(_FP8PositionCache(), backend="dsa_dcp", options={"dcp_size": 2}, fullgraph=True)
        with pytest.raises(Exception) as err:
            compiled(torch.randn(2, 1, 4), 3)
    assert "position cache l_self_buffers_kv_cache_ is FP8 E4M3: the position-cache writes and the attention " \
           "over position caches carry no scale" in str(err.value)


# --------------------------------------------------------------------------- the memory plan


@pytest.mark.parametrize("form, plan_dtype", [({"kv_dtype": "fp8"}, "fp8"),
                                              ({"kv_dtype": "fp8", "kv_scales": "block"}, "fp8_block"),
                                              ({"kv_dtype": "fp8", "index_key_dtype": "fp8"}, "fp8")])
def test_the_memory_plan_reports_the_bytes_the_model_allocates(form, plan_dtype):
    """The plan of an FP8 config (kv_dtype=None: the config's own storage) counts the bytes a
    DCP rank's caches and scales hold per slot, and for the published shapes FACTS.md's 576 / 132 B."""
    from dsa_dcp.inspection import memory_plan

    world, slots = 2, 40
    cfg = get_config(FAMILY, n_layers=LAYERS, **form)
    plan = memory_plan(cfg, dcp_size=world, slots=slots)
    assert plan.kv_dtype == plan_dtype
    model = DSAModel(cfg, slots, dcp_size=world)
    kv = sum(l.attn.kv_cache.nbytes + l.attn.kv_block_scales.nbytes for l in model.layers)
    keys = sum(l.attn.indexer.index_cache.nbytes + l.attn.indexer.key_scale.nbytes
               for l in model.layers if l.attn.indexer is not None)
    rows = local_cache_rows(slots, world, 1)
    assert kv == rows * plan.kv_bytes_per_token  # the per-tensor scale is a constant: plan.fixed_bytes_per_rank
    if cfg.index_key_dtype == "fp8":
        assert keys == slots * plan.index_bytes_per_token
    real = memory_plan(get_config("glm5.3", **form), dcp_size=world)
    assert real.kv_bytes_per_token_layer == {"fp8": 576, "fp8_block": 576 + 5 * 4}[plan_dtype]
    assert real.index_bytes_per_token_layer == 132
