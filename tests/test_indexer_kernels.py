"""The lightning indexer's kernels (dsa_dcp/kernels/index_scores.py, topk_select.py) against their
torch references and against independent checks: an fp64 score, ``torch.topk``'s values, ``topk_remap``.

On CPU the Triton kernels run under the interpreter at tiny shapes (every kernel variant: the
top-k's three paths, resident row, tiled row and chunked passes, with and without the remap,
bf16/fp32/FP8 keys, E4M3 queries over FP8 keys; the FP8 model's compiled step feeds
``index_scores`` E4M3 queries).
On a GPU machine the same cases run on CUDA tensors with the compiled
kernels, and the ``gpu``-marked cases check real sizes (B = 32, C = 32768, K = 2048).
"""

import dataclasses
import importlib
import itertools

import pytest
import torch

from triton_env import (  # noqa: F401 (interpreter_or_fresh_process: an autouse fixture)
    DEVICE,
    fresh_interpreter_test,
    interpreter_or_fresh_process,
    on_device as _dev,
    seeded as _gen,
)

import dsa_dcp
from dsa_dcp.kernels import index_scores as scores_mod
from dsa_dcp.kernels import topk_remap as remap_mod
from dsa_dcp.kernels import topk_select as select_mod
from dsa_dcp.kernels.kv_store import quantize_rows
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.ops import INDEX_SCORES
from dsa_dcp.passes import fx as fx_facts
from dsa_dcp.slots import owner

INF = float("inf")
NAN = float("nan")


test_in_fresh_interpreter = fresh_interpreter_test(__file__)


# ---------------------------------------------------------------------------------------------
# index_scores


def _paged_step(gen, T=5, R=4, max_pages=6, page=4, pages_total=40):
    """A step of T rows over R requests: a shuffled page pool, -1 pages, rows of one request at
    several positions, a position past the capacity, a row without a request."""
    page_table = torch.randperm(pages_total, generator=gen)[: R * max_pages].view(R, max_pages).to(torch.int32)
    page_table[1, 2] = -1  # a hole inside request 1's pages
    page_table[3, 4:] = -1  # request 3 has fewer pages than the capacity
    req_ids = torch.tensor([1, 1, 0, 3, -1, 2, 2][:T], dtype=torch.int64)
    C = max_pages * page
    positions = torch.tensor([9, 13, C + 5, 21, 3, 0, 7][:T], dtype=torch.int64)
    return page_table, req_ids, positions, page


def _brute_scores(q, w, keys, page_table, req_ids, positions, page):
    """fp64 scores and the per-entry error scale sum_h |w| sum_d |q k| (Python loops over rows)."""
    T, Hi, Di = q.shape
    C = page_table.shape[1] * page
    score = torch.full((T, C), -INF, dtype=torch.float64)
    scale = torch.zeros((T, C), dtype=torch.float64)
    qd, wd, kd = q.double(), w.double(), keys.double()
    for t in range(T):
        r = int(req_ids[t])
        for p in range(C):
            pg = int(page_table[r, p // page]) if r >= 0 else -1
            if p > int(positions[t]) or pg < 0:
                continue
            k = kd[pg * page + p % page]
            dots = qd[t] @ k
            score[t, p] = (wd[t] * dots.relu()).sum()
            scale[t, p] = (wd[t].abs() * (qd[t].abs() @ k.abs())).sum()
    return score, scale


KEY_CASES = ["fp32", "bf16", "fp8-row", "fp8-tensor"]


def _keys(gen, S, Di, case):
    """(cache, key_scale, dequantized fp64 keys)."""
    real = torch.randn((S, Di), generator=gen, dtype=torch.float64)
    if case == "fp32":
        return real.float(), None, real.float().double()
    if case == "bf16":
        return real.bfloat16(), None, real.bfloat16().double()
    if case == "fp8-row":
        scale = (real.abs().amax(dim=1) / 448.0).float()
        cache = (real / scale.double()[:, None]).to(torch.float8_e4m3fn)
        return cache, scale, cache.double() * scale.double()[:, None]
    scale = (real.abs().amax() / 448.0).float().reshape(())
    cache = (real / scale.double()).to(torch.float8_e4m3fn)
    return cache, scale, cache.double() * scale.double()


@pytest.mark.parametrize("keys", KEY_CASES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hi,Di,span", [(4, 16, None), (3, 20, 32)])
def test_index_scores(keys, q_dtype, Hi, Di, span):
    """Hi/Di not powers of two (padded heads and columns), several programs a row (span)."""
    gen = _gen("scores", keys, q_dtype, Hi, Di)
    page_table, req_ids, positions, page = _paged_step(gen)
    T, S = req_ids.shape[0], 40 * page
    q = torch.randn((T, Hi, Di), generator=gen).to(q_dtype)
    w = torch.randn((T, Hi), generator=gen) * Hi**-0.5
    cache, key_scale, dequant = _keys(gen, S, Di, keys)
    exp, err_scale = _brute_scores(q, w, dequant, page_table, req_ids, positions, page)
    args = _dev(q, w, cache, key_scale, page_table, req_ids, positions)
    ref = scores_mod.index_scores_reference(*args, page)
    tri = scores_mod.index_scores_triton(*args, page, block_c=16, span=span)
    for what, got in (("reference", ref), ("triton", tri)):
        got = got.cpu().double()
        assert got.dtype == torch.float64 and got.shape == exp.shape
        assert torch.equal(torch.isneginf(got), torch.isneginf(exp)), f"{what}: -inf (invalid) positions differ"
        fin = torch.isfinite(exp)
        assert not torch.isnan(got).any(), what
        err = (got[fin] - exp[fin]).abs()
        assert (err <= 1e-5 * err_scale[fin] + 1e-30).all(), f"{what}: max err {err.max():.3e}"
    # the reference in fp64 is the brute force
    ref64 = scores_mod.index_scores_reference(*args, page, compute_dtype=torch.float64).cpu().double()
    fin = torch.isfinite(exp)
    assert torch.equal(torch.isneginf(ref64), torch.isneginf(exp))
    assert ((ref64[fin] - exp[fin]).abs() <= 1e-6 * err_scale[fin] + 1e-30).all()


def test_index_scores_nan_propagates_only_from_valid_keys():
    """A NaN key row read by a valid candidate makes that score NaN (as the model); NaN in rows
    no valid candidate names (unwritten cache rows, masked positions) never leaks."""
    gen = _gen("scores-nan")
    page_table, req_ids, positions, page = _paged_step(gen)
    T, Hi, Di, S = req_ids.shape[0], 4, 16, 160
    q = torch.randn((T, Hi, Di), generator=gen).bfloat16()
    w = torch.randn((T, Hi), generator=gen)
    cache = torch.randn((S, Di), generator=gen).bfloat16()
    # rows 0 and 1 (request 1, positions 9 and 13): candidate 2 is valid for both, candidate 20
    # (page 5) for neither; one page is in no request's table at all
    slot_valid = int(page_table[1, 0]) * page + 2
    slot_masked = int(page_table[1, 5]) * page
    unused = sorted(set(range(40)) - set(page_table.flatten().tolist()))[0]
    cache[slot_valid, 5] = NAN
    cache[slot_masked] = NAN
    cache[unused * page:(unused + 1) * page] = NAN
    for fn in (scores_mod.index_scores_reference, scores_mod.index_scores_triton):
        out = fn(*_dev(q, w, cache, None, page_table, req_ids, positions), page).cpu()
        assert torch.isnan(out[0, 2]) and torch.isnan(out[1, 2]), fn.__name__
        nan = torch.isnan(out)
        # every NaN is a valid candidate whose slot is the NaN row
        cand = scores_mod.candidate_slots(page_table, req_ids, page)
        p = torch.arange(cand.shape[1])
        valid = (p[None] <= positions[:, None]) & (cand >= 0)
        assert (valid[nan]).all() and (cand[nan] == slot_valid).all(), fn.__name__
        assert torch.isneginf(out[~valid]).all(), fn.__name__


@pytest.mark.parametrize("T,Hi,max_pages,R", [(0, 4, 3, 2), (3, 4, 0, 2), (3, 0, 3, 2), (3, 4, 3, 0)])
def test_index_scores_empty(T, Hi, max_pages, R):
    q = torch.randn(T, Hi, 16)
    w = torch.randn(T, Hi)
    cache = torch.randn(48, 16)
    page_table = torch.arange(R * max_pages, dtype=torch.int32).view(R, max_pages)
    req_ids = torch.zeros(T, dtype=torch.int64) if R else torch.full((T,), -1, dtype=torch.int64)
    positions = torch.full((T,), 5, dtype=torch.int64)
    ref = scores_mod.index_scores_reference(*_dev(q, w, cache, None, page_table, req_ids, positions), 4)
    tri = scores_mod.index_scores_triton(*_dev(q, w, cache, None, page_table, req_ids, positions), 4)
    assert ref.shape == tri.shape == (T, max_pages * 4)
    assert torch.equal(ref.cpu(), tri.cpu())


def test_index_scores_rejects_bad_inputs():
    q, w, cache = torch.randn(2, 4, 16), torch.randn(2, 4), torch.randn(32, 16)
    pt, req, pos = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    fp8 = cache.to(torch.float8_e4m3fn)
    bad = [
        ((q, w, fp8, None, pt, req, pos, 4), "key_scale"),
        ((q, w, cache, torch.ones(32), pt, req, pos, 4), "only for FP8"),
        ((q, w, fp8, torch.ones(31), pt, req, pos, 4), "key_scale must be"),
        ((q, w[:, :3], cache, None, pt, req, pos, 4), "w must be"),
        ((q, w, cache[:, :8], None, pt, req, pos, 4), "Di"),
        ((q, w, cache, None, pt, req[:1], pos, 4), "T = 2"),
        ((q, w, cache, None, pt, req, pos, 0), "page_size"),
        ((q, w, cache, None, pt.float(), req, pos, 4), "page_table"),
    ]
    for args, match in bad:
        for fn in (scores_mod.index_scores_reference, scores_mod.index_scores_triton):
            with pytest.raises(ValueError, match=match):
                fn(*args)
    for cap in (8, 256):
        with pytest.raises(ValueError, match="max_registers must be 16-255"):
            scores_mod.index_scores_triton(q, w, cache, None, pt, req, pos, 4, max_registers=cap)


# ---------------------------------------------------------------------------------------------
# topk_select


def _check_against_topk(scores, got, k):
    """The contract against the model's torch.topk: the selected positions are distinct, in
    ascending order, hold exactly the top values (NaN first, -inf never), -1 after them."""
    T, C = scores.shape
    for t in range(T):
        row = scores[t].double()
        n = min(k, C)
        top = torch.topk(row, n).values if n else row[:0]
        want = top[~torch.isneginf(top)]
        idx = got[t].long()
        cnt = int((idx >= 0).sum())
        assert cnt == want.numel(), f"row {t}: {cnt} selected, want {want.numel()}"
        assert (idx[cnt:] == -1).all() and (idx[:cnt] >= 0).all(), f"row {t}: -1 tail"
        sel = idx[:cnt]
        assert (sel[1:] > sel[:-1]).all(), f"row {t}: positions not ascending and distinct"
        vals = row[sel].sort(descending=True).values  # sort puts NaN first, as topk does
        assert torch.equal(torch.isnan(vals), torch.isnan(want)), f"row {t}: NaN count"
        fin = ~torch.isnan(want)
        assert torch.equal(vals[fin], want[fin]), f"row {t}: selected values differ from torch.topk's"


def _tricky_scores(gen, T, C):
    """Rows with ties, NaN, +-inf, -0.0/+0.0, shorter than K, empty."""
    s = torch.randint(-3, 4, (T, C), generator=gen).float() * 0.5  # many equal values
    s[0] = torch.randn(C, generator=gen)  # distinct
    if T > 1:
        s[1, C // 3:] = -INF  # fewer valid candidates than K
    if T > 2:
        s[2] = -INF  # no valid candidate
    if T > 3:
        s[3, ::5] = NAN
        s[3, 1::7] = INF
    if T > 4:
        s[4, ::2] = -0.0
        s[4, 1::2] = 0.0
    return s


# the top-k's paths as (path, chunks) keywords: the row held in registers, the row read in tiles
# of `block`, the row split over programs, the row compacted above a sample's threshold by one
# program or split over programs (at these sizes its buffer rarely holds the row's candidates: the
# tiled passes then select the row; test_topk_select_sampled_routes takes each of its routes)
PATHS = {"resident": dict(path="resident"), "row": dict(path="row"), "chunked": dict(chunks=2),
         "sampled": dict(path="sampled"), "sampled split": dict(path="sampled", chunks=3)}

SELECT_CASES = [
    # (T, C, k, path, block)
    (5, 64, 10, "resident", 16),
    (5, 64, 10, "row", 16),
    (5, 64, 10, "chunked", 16),
    (5, 48, 64, "resident", 16),  # k > C
    (5, 48, 64, "chunked", 16),
    (5, 40, 40, "resident", 16),  # k == C
    (5, 40, 40, "row", 16),
    (5, 64, 10, "sampled", 16),
    (5, 48, 64, "sampled", 16),
    (5, 64, 10, "sampled split", 16),
]


@pytest.mark.parametrize("T,C,k,path,block", SELECT_CASES)
def test_topk_select(T, C, k, path, block):
    scores = _tricky_scores(_gen("select", T, C, k), T, C)
    ref = select_mod.topk_select_reference(scores.to(DEVICE), k).cpu()
    tri = select_mod.topk_select_triton(scores.to(DEVICE), k, block=block, **PATHS[path]).cpu()
    assert ref.dtype == tri.dtype == torch.int32 and ref.shape == (T, k)
    _check_against_topk(scores, ref, k)
    assert torch.equal(tri, ref), "the kernel and the reference break ties alike (lowest position first)"


def test_topk_select_tie_rule():
    """At the k-th value the lowest positions win; NaN ranks above +inf; -0.0 ties with +0.0."""
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0, 3.0, -INF],
                           [0.0, -0.0, 1.0, NAN, INF, -0.0, 0.0, NAN],
                           [-INF] * 8])  # fmt: skip
    want = torch.tensor([[1, 2, 4, 6], [2, 3, 4, 7], [-1, -1, -1, -1]], dtype=torch.int32)
    want5 = torch.tensor([0, 2, 3, 4, 7], dtype=torch.int32)  # k = 5 adds the first of the zeros
    for path, kw in PATHS.items():
        got = select_mod.topk_select_triton(scores.to(DEVICE), 4, block=16, **kw).cpu()
        assert torch.equal(got, want), path
        got5 = select_mod.topk_select_triton(scores.to(DEVICE), 5, block=16, **kw).cpu()
        assert torch.equal(got5[1], want5), path
    assert torch.equal(select_mod.topk_select_reference(scores, 4), want)
    assert torch.equal(select_mod.topk_select_reference(scores, 5)[1], want5)


def _tied_at_depth(gen, C, k, low_bits):
    """A row whose k-th best value is tied across the cut, with 6 distinct values just above it
    that share all but its last 3 bits, the rest far below; the tied value's last ``low_bits`` bits
    are set (0: its floor at every depth past its set bits is the value itself)."""
    v = 0x3F800000 | ((1 << low_bits) - 1 if low_bits else 0)
    bits = torch.full((C,), v, dtype=torch.int32)
    bits[:6] = v + 8 * torch.arange(1, 7, dtype=torch.int32)  # above the tied value, same top 26 bits
    row = bits.view(torch.float32).clone()
    row[6 + 8:] = torch.randn(C - 14, generator=gen) - 10.0  # 8 tied copies, then far below
    return row[torch.randperm(C, generator=gen)]


@pytest.mark.parametrize("path", list(PATHS))
def test_topk_select_ties_straddling_the_cut(path):
    """The count search's tie check (it stops at the floor of a bin only when fewer than the need
    lie above the floor) against the reference: tied values whose bits end at several depths, so
    the check fires at each of its steps or never, and rows of ReLU zeros and of a coarse grid."""
    gen = _gen("ties-straddling", path)
    C, k = 64, 10  # 6 above the tie, 4 of its 8 copies taken
    rows = [_tied_at_depth(gen, C, k, low) for low in (0, 3, 5, 9, 13, 17, 21)]
    rows.append(torch.randn(C, generator=gen).relu())  # about half zeros: tied at 0 when k exceeds the positives
    rows.append(torch.randn(C, generator=gen).to(torch.float8_e4m3fn).float())
    scores = torch.stack(rows)
    for kk in (k, 40):
        ref = select_mod.topk_select_reference(scores, kk)
        _check_against_topk(scores, ref, kk)
        got = select_mod.topk_select_triton(scores.to(DEVICE), kk, block=16, **PATHS[path]).cpu()
        assert torch.equal(got, ref), (path, kk)
    # the rows do straddle: more copies of the k-th value than the selection takes
    kth = scores[0].sort(descending=True).values[k - 1]
    assert int((scores[0] == kth).sum()) == 8 and int((scores[0] > kth).sum()) == 6


@pytest.mark.parametrize("path", list(PATHS))
def test_topk_select_slots(path):
    """Through the page table: global slots, -1 for a negative page, all -1 for a row without a
    request; rows of several requests."""
    gen = _gen("select-slots", path)
    page_table, req_ids, _, page = _paged_step(gen)
    T, C = req_ids.shape[0], page_table.shape[1] * page
    scores = torch.randn((T, C), generator=gen)
    scores[1, 9] = 5.0  # a finite score at a candidate whose page is -1 (request 1, page 2)
    ref = select_mod.topk_select_reference(*_dev(scores, 7, page_table, req_ids), page).cpu()
    tri = select_mod.topk_select_triton(*_dev(scores, 7, page_table, req_ids), page, block=16, **PATHS[path]).cpu()
    assert torch.equal(tri, ref)
    pos = select_mod.topk_select_reference(scores, 7)
    cand = scores_mod.candidate_slots(page_table, req_ids, page)
    for t in range(T):
        want = [int(cand[t, p]) if p >= 0 else -1 for p in pos[t].tolist()]
        if req_ids[t] < 0:
            want = [-1] * 7
        assert ref[t].tolist() == want, t
    at = pos[1].tolist().index(9)  # row 1's best candidate has no page: selected, -1 in its place
    assert ref[1, at] == -1 and (ref[1, :at] >= 0).any() | (ref[1, at + 1:] >= 0).any()


def test_request_ids_past_the_table_read_nothing():
    """An id >= R is out of contract: the reference raises, the kernels give the row nothing."""
    gen = _gen("req-past")
    page_table, req_ids, positions, page = _paged_step(gen)
    req_ids[0] = page_table.shape[0]
    q, w, cache = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, generator=gen), torch.randn(160, 16)
    args = _dev(q, w, cache, None, page_table, req_ids, positions)
    with pytest.raises(IndexError):  # on the host: on CUDA the reference's indexing is a device-side assert
        scores_mod.index_scores_reference(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], page)
    scores = scores_mod.index_scores_triton(*args, page).cpu()
    assert torch.isneginf(scores[0]).all() and torch.isfinite(scores[1, :2]).all()
    scores[0] = torch.randn(scores.shape[1], generator=gen)  # finite scores for the row: still nothing
    for path, kw in PATHS.items():
        topk = select_mod.topk_select_triton(*_dev(scores, 5, page_table, req_ids), page, block=16, **kw).cpu()
        assert (topk[0] == -1).all() and (topk[1] >= 0).any(), path


@pytest.mark.parametrize("T,C,k", [(0, 8, 4), (3, 8, 0), (3, 0, 4)])
def test_topk_select_empty(T, C, k):
    scores = torch.randn(T, C, device=DEVICE)
    for fn in (select_mod.topk_select_reference, select_mod.topk_select_triton):
        out = fn(scores, k)
        assert out.shape == (T, k) and out.dtype == torch.int32 and (out == -1).all()
    local, count = select_mod.topk_select_remap_triton(scores, k, 2, 1)
    assert local.shape == (T, k) and count.shape == (T,) and (local == -1).all() and (count == 0).all()


def test_topk_select_rejects_bad_inputs():
    s = torch.randn(2, 8)
    pt, req = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    for fn in (select_mod.topk_select_reference, select_mod.topk_select_triton):
        with pytest.raises(ValueError, match="come together"):
            fn(s, 3, pt, None)
        with pytest.raises(ValueError, match="max_pages"):
            fn(s, 3, pt, req, 3)
        with pytest.raises(ValueError, match="k must be"):
            fn(s, -1)
        with pytest.raises(ValueError, match="scores"):
            fn(s.long(), 3)
    with pytest.raises(ValueError, match="rank"):
        select_mod.topk_select_remap_triton(s, 3, 2, 2)


# ---------------------------------------------------------------------------------------------
# topk_select_remap


REMAP_CASES = [(1, 1), (2, 1), (3, 2)]


@pytest.mark.parametrize("N,I", REMAP_CASES)
@pytest.mark.parametrize("path", list(PATHS))
def test_topk_select_remap(N, I, path):
    """Fused == topk_select then topk_remap, exactly, on every rank; the chunked form with ties at
    the threshold spread over several chunks (the partly selected chunk is scanned again)."""
    gen = _gen("remap", N, I, path)
    page_table, req_ids, _, page = _paged_step(gen)
    T, C = req_ids.shape[0], page_table.shape[1] * page
    scores = torch.randint(0, 3, (T, C), generator=gen).float()  # ties at the threshold everywhere
    scores[0] = torch.randn(C, generator=gen)
    scores[2, 5:] = -INF
    k = 9
    args = _dev(scores, k)
    pt_args = _dev(page_table, req_ids)
    kw = dict(chunks=3) if path == "chunked" else PATHS[path]  # chunked: 8 candidates a chunk
    topk = select_mod.topk_select_triton(*args, *pt_args, page, block=8, **kw)
    assert torch.equal(topk.cpu(), select_mod.topk_select_reference(*args, *pt_args, page).cpu())
    if path == "chunked":  # rows whose ties at the threshold straddle chunks (8 candidates a chunk)
        straddle = 0
        for t in range(T):
            kth = scores[t].sort(descending=True).values[k - 1]
            chunks_with_ties = {p // 8 for p in (scores[t] == kth).nonzero().flatten().tolist()}
            straddle += len(chunks_with_ties) > 1 and int((scores[t] >= kth).sum()) > k
        assert straddle >= 2
    total = torch.zeros(T, dtype=torch.int64)
    for r in range(N):
        want_local, want_count = remap_mod.topk_remap_reference(topk, N, r, I)
        local, count = select_mod.topk_select_remap_triton(*args, N, r, I, *pt_args, page, block=8, **kw)
        assert torch.equal(local.cpu(), want_local.cpu()) and torch.equal(count.cpu(), want_count.cpu()), r
        ref_local, ref_count = select_mod.topk_select_remap_reference(*args, N, r, I, *pt_args, page)
        assert torch.equal(ref_local.cpu(), want_local.cpu()) and torch.equal(ref_count.cpu(), want_count.cpu()), r
        total += count.cpu().long()
    assert torch.equal(total, (topk.cpu() >= 0).sum(1)), "every selected slot on exactly one rank"


def test_topk_select_remap_positions():
    """Without a page table the candidate positions are the slots."""
    scores = _tricky_scores(_gen("remap-positions"), 5, 40)
    topk = select_mod.topk_select_reference(scores, 12)
    for path, kw in PATHS.items():
        for r in (0, 2):
            local, count = select_mod.topk_select_remap_triton(scores.to(DEVICE), 12, 3, r, block=16, **kw)
            want = remap_mod.topk_remap_reference(topk, 3, r, 1)
            assert torch.equal(local.cpu(), want[0]) and torch.equal(count.cpu(), want[1]), (path, r)


def test_split_rows_take_about_the_programs_asked():
    """A row split over ``ns`` programs reads whole tiles a program, as many as lie nearest C / ns:
    a decode row at 32K tokens (32,832 candidates) split 32 ways in tiles of 1,024 takes 33
    programs, not 17 of 2,048; rows of a multiple of ``ns`` tiles split evenly as before."""
    def programs(C, ns, block=1024):
        return -(-C // select_mod.split_chunk(C, ns, block))

    assert select_mod.split_chunk(32768, 32, 1024) == 1024 and programs(32768, 32) == 32
    assert select_mod.split_chunk(32832, 32, 1024) == 1024 and programs(32832, 32) == 33
    assert programs(131136, 128) == 129 and programs(131072, 8) == 8
    assert programs(30000, 16) == 15  # 1,875 a program asked: 2,048 is nearer than 1,024
    for C in range(1, 400, 7):  # never fewer than about three quarters, nor more than about one and a half times
        for ns in (1, 2, 3, 5, 8):
            n = programs(C, ns, 16)
            assert n >= 1 and (C <= 16 * ns or 0.66 * ns <= n <= 1.5 * ns + 1), (C, ns, n)


def test_topk_select_resident_two_tiles():
    """A row at most a quarter past a power of two is held as two tiles (the power of two and the
    rest: a decode row at 4K tokens, 4,160 candidates in pages of 64, as 4,096 + 64 lanes). The
    selection runs across both: the value at the cut tied on both sides of the tiles' seam (the
    lowest positions win, in the first tile and then the second), the best values in the second
    tile, the second tile's lanes past C; with a page table, and fused with the remap."""
    assert select_mod.resident_tiles(4160) == (4096, 64) and select_mod.resident_tiles(4096) == (4096, 0)
    assert select_mod.resident_tiles(6000) == (8192, 0)  # more than a quarter past 4,096: one tile
    gen = _gen("two tiles")
    C, k = 36, 10
    assert select_mod.resident_tiles(C) == (32, 16)
    scores = torch.randn(4, C, generator=gen)
    scores[0, 28:] = 5.0  # the best values, in the second tile and the first tile's last lanes
    scores[1] = torch.rand(C, generator=gen)  # below 1
    scores[1, [0, 3, 7, 12, 16, 25]] = 3.0  # above the cut
    scores[1, [20, 30, 33, 34, 35]] = 2.0  # the cut's value, tied across the seam: 4 of 5 taken
    scores[2, 32:] = -INF  # the second tile all -inf
    scores[3] = -INF
    scores[3, [1, 33, 35]] = 0.0  # fewer valid candidates than k, two of them in the second tile
    ref = select_mod.topk_select_reference(scores, k)
    _check_against_topk(scores, ref, k)
    assert ref[1].tolist() == [0, 3, 7, 12, 16, 20, 25, 30, 33, 34]  # the seam's tie cut after 34
    assert torch.equal(select_mod.topk_select_triton(scores.to(DEVICE), k, path="resident").cpu(), ref)
    page = 4
    page_table = torch.randperm(40, generator=gen)[: 2 * (C // page)].view(2, C // page).to(torch.int32)
    page_table[1, 8] = -1  # a page of the second tile missing
    req_ids = torch.tensor([0, 1, 1, 0])
    slots = select_mod.topk_select_reference(*_dev(scores, k), *_dev(page_table, req_ids), page).cpu()
    got = select_mod.topk_select_triton(*_dev(scores, k), *_dev(page_table, req_ids), page, path="resident").cpu()
    assert torch.equal(got, slots)
    for N, I in ((2, 1), (3, 2)):
        for r in range(N):
            want = remap_mod.topk_remap_reference(slots, N, r, I)
            local, count = select_mod.topk_select_remap_triton(*_dev(scores, k), N, r, I, *_dev(page_table, req_ids),
                                                               page, path="resident")  # fmt: skip
            assert torch.equal(local.cpu(), want[0]) and torch.equal(count.cpu(), want[1]), (N, r)


def test_topk_select_decode_row_at_4k_tokens():
    """The resident kernel at the size it runs at on the GPU (its tiles, tail and warps are the
    GPU's: 4,096 + 64 lanes, K = 2048): decode rows at 4,096 cached tokens (4,097 positions,
    4,160 candidates in 65 pages of 64) through a shuffled page table; randn, through a ReLU (the
    2048th best tied at 0 on both sides of the tiles' seam), rounded to E4M3, a NaN in the second
    tile, and rows of 8,256 candidates (8,192 + 64) forced resident; the default plan and the
    fused remap at N = 2 and 4 on one rank each."""
    gen = _gen("decode row at 4K")
    k, page = 2048, 64
    for C in (4160, 8256):
        assert select_mod.resident_tiles(C) == (C - 64, 64)
        T, pages = 4, C // page
        scores = torch.randn(T, C, generator=gen)
        shift = 0.1 if C < 8192 else 0.75  # about 1,900 of the row's 4,097 (8,193) valid candidates above it
        scores[1] = (scores[1] - shift).relu()  # so the cut is at 0, tied on both sides of the seam
        scores[2] = scores[2].to(torch.float8_e4m3fn).float()  # few distinct values: ties at the cut
        scores[:, C - 63:] = -INF  # the positions past the row's 4,097th (8,193rd)
        scores[1, C - 64] = 0.0  # the second tile's one valid candidate, tied at the cut
        scores[3, C - 70] = NAN  # in the first tile's last page
        scores[3, C - 64] = NAN  # the second tile's one valid candidate
        kth = scores[1].sort(descending=True).values[k - 1]
        assert kth == 0 and (scores[1, : C - 64] == 0).any() and (scores[1, C - 64:] == 0).any()
        page_table = torch.randperm(2 * pages, generator=gen)[: 2 * pages].view(2, pages).to(torch.int32)
        req_ids = torch.tensor([0, 1, 1, 0])
        ref = select_mod.topk_select_reference(scores, k)
        _check_against_topk(scores, ref, k)
        path = "resident" if C > select_mod.RESIDENT_MAX else None
        assert torch.equal(select_mod.topk_select_triton(scores.to(DEVICE), k, path=path).cpu(), ref), C
        slots = select_mod.topk_select_reference(scores, k, page_table, req_ids, page)
        got = select_mod.topk_select_triton(*_dev(scores, k, page_table, req_ids), page, path=path).cpu()
        assert torch.equal(got, slots), C
        for N, r in ((2, 1), (4, 2)):
            want = remap_mod.topk_remap_reference(slots, N, r, 1)
            local, count = select_mod.topk_select_remap_triton(*_dev(scores, k), N, r, 1, *_dev(page_table, req_ids),
                                                               page, path=path)  # fmt: skip
            assert torch.equal(local.cpu(), want[0]) and torch.equal(count.cpu(), want[1]), (C, N, r)


def test_topk_select_resident_random():
    """The resident path (the whole row in registers) against the references on random rows of few
    values: ties at the k-th value, NaN, +-inf, -0.0/+0.0, rows with fewer valid candidates than k,
    k > C; as positions and through a page table (negative pages, a row without a request), and
    fused with the remap on every rank (local rows and counts)."""
    gen = _gen("resident")
    page_table, req_ids, _, page = _paged_step(gen, T=6)
    T, C = req_ids.shape[0], page_table.shape[1] * page
    vals = torch.tensor([-INF, -1.0, -0.0, 0.0, 0.5, 0.5, 2.0, INF, NAN])
    scores = vals[torch.randint(0, len(vals), (T, C), generator=gen)]
    scores[0] = (torch.randn(C, generator=gen) * 2).round() / 2  # finite, many equal
    scores[1, C // 3:] = -INF  # fewer valid candidates than k
    scores[5] = -INF
    scores[5, [3, C - 1]] = -0.0  # two valid candidates: zeros
    pt_args = _dev(page_table, req_ids)
    for k in (7, C + 5):
        ref = select_mod.topk_select_reference(scores, k)
        _check_against_topk(scores, ref, k)
        if k < C:  # row 0 ties at its k-th value: only the lowest positions of that value are taken
            kth = scores[0].sort(descending=True).values[k - 1]
            assert int((scores[0] == kth).sum()) > int((scores[0, ref[0].long()] == kth).sum())
        assert torch.equal(select_mod.topk_select_triton(scores.to(DEVICE), k, path="resident").cpu(), ref), k
        slots = select_mod.topk_select_reference(*_dev(scores, k), *pt_args, page).cpu()
        got = select_mod.topk_select_triton(*_dev(scores, k), *pt_args, page, path="resident").cpu()
        assert torch.equal(got, slots), k
        for N, I in ((2, 1), (3, 2)):
            for r in range(N):
                want = remap_mod.topk_remap_reference(slots, N, r, I)
                local, count = select_mod.topk_select_remap_triton(*_dev(scores, k), N, r, I, *pt_args, page,
                                                                   path="resident")  # fmt: skip
                assert torch.equal(local.cpu(), want[0]) and torch.equal(count.cpu(), want[1]), (k, N, r)


@pytest.mark.parametrize("T, C, want", [
    (1, 4096, ("resident", 1)),  # fits one program's registers
    (128, 8192, ("resident", 1)),
    (1, 32768, ("sampled", 32)),  # rows up to 32K: the split sampled form, 1024 candidates a program
    (1, 65536, ("chunked", 64)),  # one or two rows over 32K: the chunked passes
    (2, 131072, ("chunked", 128)),
    (3, 65536, ("sampled", 64)),  # from three rows the split sampled form
    (4, 131072, ("sampled", 66)),  # about two programs an SM
    (8, 16384, ("sampled", 16)),
    (32, 32768, ("sampled", 16)),  # a split sampled program compacts at most 2K candidates
    (32, 131072, ("sampled", 64)),
    (128, 16384, ("sampled", 1)),  # <= 16K candidates and <= 4 programs a row: one program
    (128, 32768, ("sampled", 16)),
    (2048, 20480, ("sampled", 10)),
    (2048, 40960, ("sampled", 20)),
])
def test_topk_select_default_plan(monkeypatch, T, C, want):
    """The launcher's (path, programs a row) on a GPU of 132 SMs (an H200), and on the CPU one
    program a row, as docs/kernels.md states them."""
    monkeypatch.setattr(select_mod, "sm_count", lambda device: 132)
    assert select_mod._default_plan(T, C, torch.device("cuda")) == want
    cpu = select_mod._default_plan(T, C, torch.device("cpu"))
    assert cpu == ("resident" if C <= select_mod.RESIDENT_MAX else "sampled", 1)


def test_topk_select_sampled_routes(monkeypatch):
    """The sampled path selects each row from its buffer when the sample's threshold is safe and
    the buffer holds the candidates above it (the small buffer or the large one), and by the
    tiled passes otherwise (ties past the buffer, NaN past it, a threshold set above the k-th
    best); every route gives the references' answer, as positions, as slots and fused with the
    remap on every rank, by one program a row and with the row split over three programs (the
    same routes: the same threshold and count), also with the threshold's search stopped early;
    the split rows selected by their last chunk to finish and by a launch of their own (each split
    launch runs both ways; one program a row has no finish)."""
    gen = _gen("sampled")
    monkeypatch.setattr(select_mod, "SAMPLE_EVERY", 2)  # a sample of 128: thresholds near the k-th best
    T, C, k, page = 8, 256, 12, 16
    scores = torch.randn(T, C, generator=gen)
    scores[1, 90:] = -INF  # few candidates: the sample lets every one through
    scores[2] = 0.5  # every candidate ties: past the buffer
    scores[3, ::5] = NAN  # 52 NaN, all above the threshold: past the small buffer (32), in the large (64)
    scores[4, 40:] = -0.0  # ties at zero after 40 random scores
    scores[4, 100] = INF
    scores[5] = (torch.randn(C, generator=gen) * 2).round() / 2  # many equal values
    scores[6, ::3] = NAN  # 86 NaN: past the large buffer
    page_table = torch.randperm(T * C // page, generator=gen).view(T, C // page).int()
    page_table[3, 2] = -1
    req_ids = torch.arange(T)
    req_ids[7] = -1
    scores, page_table, req_ids = _dev(scores, page_table, req_ids)

    def finishes(chunks):  # the split rows selected in the segment launch, then in a third launch
        return (1 << 20, 0) if chunks > 1 else (select_mod.FINISH_IN_SEGMENTS_PER_SM,)

    def select(sigmas, chunks, pt_args=(None, None)):
        monkeypatch.setattr(select_mod, "SAMPLE_SIGMAS", sigmas)
        want = select_mod.topk_select_reference(scores, k, *pt_args, page)
        routes = []
        for finish in finishes(chunks):
            monkeypatch.setattr(select_mod, "FINISH_IN_SEGMENTS_PER_SM", finish)
            route = torch.full((T,), -1, dtype=torch.int32, device=DEVICE)
            got, _ = select_mod._launch_select(scores, k, *pt_args, page, None, path="sampled", route=route,
                                               block=32, chunks=chunks)  # fmt: skip
            assert torch.equal(got, want), (sigmas, chunks, finish)
            routes.append(route.tolist())
        assert all(r == routes[0] for r in routes), "the same routes however the split rows finish"
        return routes[0]

    # -4: thresholds above the k-th best (too few candidates): the tiled passes
    routes = {(sigmas, chunks): select(sigmas, chunks) for sigmas in (5.0, 0.0, -4.0) for chunks in (1, 3)}
    for (sigmas, chunks), route in routes.items():
        assert route == routes[sigmas, 1], "the split rows take the same routes (same threshold, same count)"
        assert route[2] == 2 and route[6] == 2, route  # past the large buffer
        assert route[3] == 1, route  # in the large buffer
        assert sigmas < 0 or route[1] in (0, 1), route
    assert {0, 1} <= set(routes[0.0, 1]) and 1 in routes[5.0, 1]
    assert routes[-4.0, 1].count(2) > routes[5.0, 1].count(2), "a threshold too high takes the tiled passes"
    default_prefix_bits = select_mod.SAMPLE_PREFIX_BITS
    for prefix_bits in (4, 12):  # the threshold's search stopped early: a lower threshold, the same answer
        monkeypatch.setattr(select_mod, "SAMPLE_PREFIX_BITS", prefix_bits)
        assert select(5.0, 1) == select(5.0, 3), prefix_bits
    monkeypatch.setattr(select_mod, "SAMPLE_PREFIX_BITS", default_prefix_bits)
    pt_args = (page_table, req_ids)
    for chunks in (1, 3):  # through the page table, and fused with the remap on every rank
        route = select(0.0, chunks, pt_args)
        assert route[:7] == routes[0.0, 1][:7] and route[7] == 0, route  # a row without a request: an empty buffer
        want = select_mod.topk_select_reference(scores, k, *pt_args, page)
        for r, finish in itertools.product(range(3), finishes(chunks)):
            monkeypatch.setattr(select_mod, "FINISH_IN_SEGMENTS_PER_SM", finish)
            local, count = select_mod.topk_select_remap_triton(scores, k, 3, r, 2, *pt_args, page, path="sampled",
                                                               block=32, chunks=chunks)  # fmt: skip
            want_local, want_count = remap_mod.topk_remap_reference(want, 3, r, 2)
            assert torch.equal(local, want_local) and torch.equal(count, want_count), (chunks, r, finish)


class _Launches:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


def test_topk_select_paths_and_keywords(monkeypatch):
    """One program a row runs the resident kernel up to RESIDENT_MAX candidates, the sampled kernel
    above; with neither keyword the default plan picks (on the GPU two short rows above
    RESIDENT_MAX are split: the split sampled form); ``chunks`` > 1 forces the chunked passes,
    ``path`` any path; bad keywords raise."""
    monkeypatch.setattr(select_mod, "RESIDENT_MAX", 32)
    names = ("_topk_resident_kernel", "_topk_write_kernel", "_topk_sampled_kernel",
             "_topk_segment_kernel")  # (the row kernel: none of them)
    spies = {name: _Launches(getattr(select_mod, name)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(select_mod, name, spy)
    long_path, long_programs = select_mod._default_plan(2, 40, torch.device(DEVICE))
    default_long = "split sampled" if long_path == "sampled" and long_programs > 1 else long_path
    cases = [(32, dict(), "resident"), (40, dict(), default_long), (40, dict(chunks=1), "sampled"),
             (32, dict(chunks=2), "chunked"), (40, dict(path="resident", num_warps=4), "resident"),
             (32, dict(path="row"), "row"), (32, dict(path="chunked"), "chunked"),
             (32, dict(path="sampled"), "sampled")]  # fmt: skip
    for C, kw, want in cases:
        s = torch.randn(2, C, generator=_gen("paths", C), device="cpu").to(DEVICE)
        before = {name: spy.calls for name, spy in spies.items()}
        got = select_mod.topk_select_triton(s, 6, block=8, **kw)
        assert torch.equal(got, select_mod.topk_select_reference(s, 6)), kw
        ran = {name for name, spy in spies.items() if spy.calls > before[name]}
        assert ran == {"resident": {"_topk_resident_kernel"}, "row": set(), "chunked": {"_topk_write_kernel"},
                       "sampled": {"_topk_sampled_kernel"}, "split sampled": {"_topk_segment_kernel"}}[want], kw
    s = torch.randn(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="path must be"):
        select_mod.topk_select_triton(s, 6, path="tiles")
    for path in ("resident", "row"):
        with pytest.raises(ValueError, match="one program a row"):
            select_mod.topk_select_triton(s, 6, path=path, chunks=2)
    with pytest.raises(ValueError, match="block must be"):
        select_mod.topk_select_triton(s, 6, block=12)
    with pytest.raises(ValueError, match="at most"):
        long_row = torch.zeros(1, select_mod.RESIDENT_LIMIT + 1, device=DEVICE)
        select_mod.topk_select_triton(long_row, 6, path="resident")


# ---------------------------------------------------------------------------------------------
# property: the selected set equals the reference's on random inputs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VALUES = [-INF, -2.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, INF, NAN]


@settings(max_examples=8)
@given(
    T=st.integers(1, 3),
    C=st.integers(1, 40),
    k=st.integers(1, 48),
    path=st.sampled_from(["resident", "row", "chunked", "sampled"]),
    data=st.data(),
)
def test_topk_select_property(T, C, k, path, data):
    kind = data.draw(st.sampled_from(["few values", "random"]))
    if kind == "few values":
        cells = data.draw(st.lists(st.sampled_from(VALUES), min_size=T * C, max_size=T * C))
        scores = torch.tensor(cells, dtype=torch.float32).view(T, C)
    else:
        seed = data.draw(st.integers(0, 2**31 - 1))
        scores = torch.randn((T, C), generator=torch.Generator().manual_seed(seed))
    ref = select_mod.topk_select_reference(scores, k)
    _check_against_topk(scores, ref, k)
    kw = dict(path=path, chunks=data.draw(st.integers(1, 3)) if path in ("chunked", "sampled") else None, block=16)
    tri = select_mod.topk_select_triton(scores.to(DEVICE), k, **kw).cpu()
    assert torch.equal(tri, ref)
    n, r = data.draw(st.integers(1, 3)), 0
    local, count = select_mod.topk_select_remap_triton(scores.to(DEVICE), k, n, r, **kw)
    want = remap_mod.topk_remap_reference(ref, n, r, 1)
    assert torch.equal(local.cpu(), want[0]) and torch.equal(count.cpu(), want[1])


# ---------------------------------------------------------------------------------------------
# the ops


def test_ops_cpu_meaning_and_opcheck():
    from dsa_dcp import ops

    gen = _gen("ops")
    page_table, req_ids, positions, page = _paged_step(gen)
    T, Hi, Di = req_ids.shape[0], 4, 16
    q, w, cache = torch.randn(T, Hi, Di, generator=gen), torch.randn(T, Hi, generator=gen), torch.randn(160, Di, generator=gen)
    scores = ops.INDEX_SCORES(q, w, cache, None, page_table, req_ids, positions, page)
    assert torch.equal(scores, scores_mod.index_scores_reference(q, w, cache, None, page_table, req_ids, positions, page))
    topk = ops.TOPK_SELECT(scores, page_table, req_ids, page, 6)
    assert torch.equal(topk, select_mod.topk_select_reference(scores, 6, page_table, req_ids, page))
    local, count = ops.TOPK_SELECT_REMAP(scores, page_table, req_ids, page, 6, 2, 1, 1)
    want = remap_mod.topk_remap_reference(topk, 2, 1, 1)
    assert torch.equal(local, want[0]) and torch.equal(count, want[1])
    torch.library.opcheck(ops.index_scores, (q, w, cache, None, page_table, req_ids, positions, page))
    torch.library.opcheck(ops.topk_select, (scores, page_table, req_ids, page, 6))
    torch.library.opcheck(ops.topk_select_remap, (scores, page_table, req_ids, page, 6, 2, 1, 1))


# ---------------------------------------------------------------------------------------------
# real sizes on the GPU


def _real_step(B, C, Hi, Di, page, key_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = C // page
    page_table = torch.randperm(B * pages, device="cuda", generator=g).view(B, pages).int()
    req_ids = torch.arange(B, device="cuda")
    positions = torch.randint(C // 2, C, (B,), device="cuda", generator=g)
    positions[0] = C - 1
    q = torch.randn(B, Hi, Di, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(B, Hi, device="cuda", generator=g) * (Hi * Di) ** -0.5
    keys = torch.randn(B * C, Di, device="cuda", generator=g)
    if key_dtype == "fp8":
        scale = keys.abs().amax(dim=1) / 448.0
        return q, w, (keys / scale[:, None]).to(torch.float8_e4m3fn), scale, page_table, req_ids, positions
    return q, w, keys.bfloat16(), None, page_table, req_ids, positions


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8"])
def test_index_scores_register_cap_gpu(key_dtype):
    """A register cap changes where values live, not the arithmetic: every score (replicated and
    sharded, both paths) at the default cap equals the kernel's at caps of 64, 96 and none (255)
    bit for bit; 64 makes ptxas keep fewer values in registers than either kernel would."""
    B, C, Hi, Di, page = 4, 8192, 32, 128, 64
    q, w, cache, scale, page_table, req_ids, positions = _real_step(B, C, Hi, Di, page, key_dtype, seed=3)
    if key_dtype == "fp8":  # E4M3 queries, as the models hand them over with FP8 keys
        q8, q_scale = quantize_rows(q.view(B * Hi, Di), block=True)
        q, w = q8.view(B, Hi, Di), w * q_scale.view(B, Hi)
    args = (q, w, cache, scale, page_table, req_ids, positions, page)
    for kw in (dict(), dict(path="pages"), dict(shard=(2, 1, 16))):
        want = scores_mod.index_scores_triton(*args, **kw)
        for cap in (64, 96, 255):  # 255: no cap
            assert torch.equal(scores_mod.index_scores_triton(*args, **kw, max_registers=cap), want), (kw, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8"])
def test_indexer_real_size_gpu(key_dtype):
    B, C, K, Hi, Di, page = 32, 32768, 2048, 64, 128, 64
    q, w, cache, scale, page_table, req_ids, positions = _real_step(B, C, Hi, Di, page, key_dtype)
    ref = scores_mod.index_scores_reference(q, w, cache, scale, page_table, req_ids, positions, page,
                                    compute_dtype=torch.float64)  # fmt: skip
    got = scores_mod.index_scores_triton(q, w, cache, scale, page_table, req_ids, positions, page)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    rel = ((got.double() - ref.double())[fin].abs().max() / ref[fin].abs().max()).item()
    assert rel < 1e-4, rel
    for kw in (dict(), dict(chunks=1), dict(chunks=16), dict(path="resident"),  # resident at its limit: 32K
               dict(path="sampled")):
        tri = select_mod.topk_select_triton(got, K, page_table, req_ids, page, **kw)
        assert torch.equal(tri, select_mod.topk_select_reference(got, K, page_table, req_ids, page)), kw
        for n in (2, 4):
            local, count = select_mod.topk_select_remap_triton(got, K, n, 1, 1, page_table, req_ids, page, **kw)
            want = remap_mod.topk_remap_reference(tri, n, 1, 1)
            assert torch.equal(local, want[0]) and torch.equal(count, want[1]), (kw, n)
    _check_against_topk(got[:4].cpu(), select_mod.topk_select_triton(got[:4], K).cpu(), K)


@pytest.mark.gpu
@pytest.mark.parametrize("B,C", [(1, 131072), (128, 4096), (8, 32768)])
def test_topk_select_shapes_gpu(B, C):
    g = torch.Generator(device="cuda").manual_seed(B)
    scores = torch.randn(B, C, device="cuda", generator=g)
    scores[:, -7:] = -INF
    for k in (512, 1024, 2048):
        ref = select_mod.topk_select_reference(scores, k)
        paths = [dict(), dict(chunks=4), dict(path="row"), dict(path="sampled")]
        paths += [dict(path="resident")] if C <= select_mod.RESIDENT_LIMIT else []
        for kw in paths:
            assert torch.equal(select_mod.topk_select_triton(scores, k, **kw), ref), (k, kw)


# ---------------------------------------------------------------------------------------------
# the bench's baseline is the model's composition


def test_bench_composition_matches_the_ops():
    """``bench indexer`` times ours against ``indexer_torch``: the same slots (set per row) as
    index_scores then topk_select, for bf16 and FP8 keys; its overlap helper counts set overlap."""
    bench = importlib.import_module("dsa_dcp.bench.indexer")
    gen = _gen("bench")
    page_table, req_ids, positions, page = _paged_step(gen)
    T, Hi, Di = req_ids.shape[0], 4, 16
    q, w = torch.randn(T, Hi, Di, generator=gen), torch.randn(T, Hi, generator=gen)
    for case in ("fp32", "fp8-row"):
        cache, key_scale, _ = _keys(gen, 160, Di, case)
        args = (q, w, cache, key_scale, page_table, req_ids, positions, page)
        theirs = bench.indexer_torch(*args, 7)
        ours = select_mod.topk_select_reference(scores_mod.index_scores_reference(*args), 7, page_table, req_ids, page)
        # (a row without a request, req_ids = -1, is empty for the ops; the model clamps it to
        # request 0, and its padding rows are (req 0, position -1): empty both ways)
        has = req_ids >= 0
        assert torch.equal(theirs[has].sort(dim=1).values, ours[has].sort(dim=1).values), case
        assert bench._overlap(ours[has], theirs[has]) == 1.0
    a = torch.tensor([[3, 5, -1], [1, 2, 4]])
    assert bench._overlap(a, torch.tensor([[5, 9, 3], [2, 7, 8]])) == 3 / 5


# ---------------------------------------------------------------------------------------------
# FP8 index queries: with FP8 index keys the reference models quantize the indexer's queries to
# E4M3 as well (one power-of-two scale a head, folded into the head's weight, as DeepSeek-V3.2's
# inference does), and index_scores multiplies E4M3 x E4M3.

E4M3 = torch.float8_e4m3fn


def _fp8_queries(q: torch.Tensor, w: torch.Tensor):
    """The model's quantization: E4M3 queries, each head's power-of-two scale folded into w."""
    T, Hi, Di = q.shape
    q8, scale = quantize_rows(q.reshape(T * Hi, Di), block=True)
    return q8.view(T, Hi, Di), w * scale.view(T, Hi)


@pytest.mark.parametrize("keys", ["fp8-row", "fp8-tensor"])
@pytest.mark.parametrize("Hi,Di,max_pages,span", [(4, 32, 6, None), (3, 40, 40, 128)])
def test_index_scores_fp8_queries(keys, Hi, Di, max_pages, span):
    """Against the fp64 brute force over the E4M3 queries, within the contract's bound; Hi and Di
    not powers of two, two programs a row (span 128 of 160 candidates: a whole tile on a GPU);
    -1 pages, a row without a request, short rows."""
    gen = _gen("fp8-queries", keys, Hi, Di)
    page_table, req_ids, positions, page = _paged_step(gen, max_pages=max_pages, pages_total=200)
    T, S = req_ids.shape[0], 200 * page
    q, w = _fp8_queries(torch.randn((T, Hi, Di), generator=gen) * 3, torch.randn((T, Hi), generator=gen) * Hi**-0.5)
    assert q.dtype == E4M3
    cache, key_scale, dequant = _keys(gen, S, Di, keys)
    exp, err_scale = _brute_scores(q.double(), w, dequant, page_table, req_ids, positions, page)
    args = _dev(q, w, cache, key_scale, page_table, req_ids, positions)
    for name, got in (("reference", scores_mod.index_scores_reference(*args, page)),
                      ("triton", scores_mod.index_scores_triton(*args, page, span=span))):
        got = got.cpu().double()
        assert torch.equal(torch.isneginf(got), torch.isneginf(exp)), f"{name}: -inf (invalid) positions differ"
        fin = torch.isfinite(exp)
        assert fin.sum() > 20 and not torch.isnan(got).any(), name
        err = (got[fin] - exp[fin]).abs()
        assert (err <= 1e-5 * err_scale[fin] + 1e-30).all(), f"{name}: max err {err.max():.3e}"


def test_index_scores_fp8_queries_sharded_equal_the_replicated_cache():
    """Each rank's owned scores (its rows of the sharded cache) are bit-identical to the
    replicated cache's, and the ranks together cover every valid candidate once."""
    gen = _gen("fp8-queries-sharded")
    page_table, req_ids, positions, page = _paged_step(gen)
    T, Hi, Di, S, N, interleave = req_ids.shape[0], 4, 32, 40 * page, 2, 2
    q, w = _fp8_queries(torch.randn((T, Hi, Di), generator=gen), torch.randn((T, Hi), generator=gen))
    cache, key_scale, _ = _keys(gen, S, Di, "fp8-row")
    rep = scores_mod.index_scores_triton(*_dev(q, w, cache, key_scale, page_table, req_ids, positions), page).cpu()
    owned_total = torch.zeros_like(rep, dtype=torch.int32)
    slots = torch.arange(S)
    for r in range(N):
        mine = owner(slots, N, interleave) == r  # local rows are the owned slots in order
        args = _dev(q, w, cache[mine], key_scale[mine], page_table, req_ids, positions)
        got = scores_mod.index_scores_triton(*args, page, shard=(N, r, interleave)).cpu()
        owned = torch.isfinite(got) | torch.isnan(got)
        assert torch.equal(got[owned], rep[owned]), f"rank {r}: owned scores differ from the replicated cache's"
        owned_total += owned.int()
    assert torch.equal(owned_total == 1, ~torch.isneginf(rep)), "every valid candidate is owned by exactly one rank"


@pytest.mark.parametrize("keys", ["fp8-row", "fp8-tensor", "bf16"])
@pytest.mark.parametrize("Hi,block_c,span", [(3, None, None), (4, 32, 64)])
def test_index_scores_pages_path(keys, Hi, block_c, span):
    """The page-block path (block copies of whole pages) against the fp64 brute force within the
    contract's bound, and the gather path's -inf: padded heads, one and two pages a tile, several
    programs a row, -1 pages, a page past the cache, a row without a request, short rows."""
    gen = _gen("pages", keys, Hi, block_c)
    page_table, req_ids, positions, page = _paged_step(gen, max_pages=5, page=16, pages_total=24)
    T, Di, S = req_ids.shape[0], 32, 24 * page
    q, w = torch.randn((T, Hi, Di), generator=gen), torch.randn((T, Hi), generator=gen) * Hi**-0.5
    q, w = _fp8_queries(q, w) if keys.startswith("fp8") else (q.bfloat16(), w)
    cache, key_scale, dequant = _keys(gen, S, Di, keys)
    exp, err_scale = _brute_scores(q.double(), w, dequant, page_table, req_ids, positions, page)
    page_table[0, 3] = 24  # request 0 (row 2, every page valid) names a page past the cache: no slot, no read
    exp[2, 3 * page: 4 * page] = -INF
    args = _dev(q, w, cache, key_scale, page_table, req_ids, positions)
    got = scores_mod.index_scores_triton(*args, page, path="pages", block_c=block_c, span=span).cpu().double()
    gathered = scores_mod.index_scores_triton(*args, page, path="gather").cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(exp)), "-inf (invalid) positions differ"
    assert torch.equal(torch.isneginf(gathered), torch.isneginf(exp))
    fin = torch.isfinite(exp)
    assert fin.sum() > 20 and not torch.isnan(got).any()
    err = (got[fin] - exp[fin]).abs()
    assert (err <= 1e-5 * err_scale[fin] + 1e-30).all(), f"max err {err.max():.3e}"


def test_index_scores_pages_path_refusals():
    """What the page-block path cannot read is refused by name when asked for; the default then
    takes the gather path."""
    gen = _gen("pages-refusals")
    page_table, req_ids, positions, page = _paged_step(gen, page=16)
    q8, w = _fp8_queries(torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, generator=gen))
    cache, key_scale, _ = _keys(gen, 40 * page, 32, "fp8-row")
    args = _dev(q8, w, cache, key_scale, page_table, req_ids, positions)
    for why, call in (
        ("page size 8", lambda: scores_mod.index_scores_triton(*args, 8, path="pages")),
        ("Di = 48", lambda: scores_mod.index_scores_triton(q8[:, :, :24].repeat(1, 1, 2).to(DEVICE), *args[1:2],
                                                           cache[:, :24].repeat(1, 2).to(DEVICE), *args[3:], page,
                                                           path="pages")),
        ("sharded cache", lambda: scores_mod.index_scores_triton(*args, page, path="pages", shard=(2, 0, 1))),
        ("queries torch.bfloat16 over keys torch.float8_e4m3fn",
         lambda: scores_mod.index_scores_triton(q8.float().bfloat16().to(DEVICE), *args[1:], page, path="pages")),
        ("rows not contiguous", lambda: scores_mod.index_scores_triton(
            args[0], args[1], torch.cat([cache, cache], 1).to(DEVICE)[:, 1:33], *args[3:], page, path="pages")),
    ):
        with pytest.raises(ValueError, match=why):
            call()
    halves = torch.stack([page_table * 2, page_table * 2 + 1], dim=2).flatten(1)  # the same slots in pages of 8
    small_pages = _dev(q8, w, cache, key_scale, halves, req_ids, positions)
    assert torch.equal(scores_mod.index_scores_triton(*small_pages, 8),
                       scores_mod.index_scores_triton(*small_pages, 8, path="gather"))
    with pytest.raises(ValueError, match="multiple of the page size"):
        scores_mod.index_scores_triton(*args, page, path="pages", block_c=24)
    with pytest.raises(ValueError, match="path must be"):
        scores_mod.index_scores_triton(*args, page, path="tma")


def test_fp8_queries_need_fp8_keys():
    q, w, cache = torch.randn(2, 4, 32), torch.randn(2, 4), torch.randn(32, 32)
    pt, req, pos = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    for keys in (cache, cache.bfloat16()):
        for fn in (scores_mod.index_scores_reference, scores_mod.index_scores_triton):
            with pytest.raises(ValueError, match="FP8 queries are for FP8 index keys only"):
                fn(q.to(E4M3), w, keys, None, pt, req, pos, 4)
    with pytest.raises(ValueError, match="w must be fp32, bf16 or fp16"):
        scores_mod.index_scores_reference(q, w.to(E4M3), cache.to(E4M3), torch.ones(32), pt, req, pos, 4)


def test_model_feeds_index_scores_e4m3_queries_and_equals_eager():
    """glm5.2-tiny (2 layers) with FP8 KV and index keys: the compiled step (FX lowering) reads
    E4M3 queries in every index_scores and gives the eager model's tokens and logits."""
    cfg = dataclasses.replace(get_config("glm5.2-tiny", n_layers=2), kv_dtype="fp8", index_key_dtype="fp8")
    batch = standard_test_batch(cfg, max_new_tokens=3, seed=3)
    model = DSAModel(cfg, batch.num_slots, seed=4)
    with torch.no_grad():
        ref = generate(model, batch, 3, pad_to=16)
    model.reset_caches()
    torch._dynamo.reset()
    step = torch.compile(model, backend="dsa_dcp", fullgraph=True, dynamic=False, options={"lowering": "fx"})
    with torch.no_grad():
        out = generate(step, batch, 3, pad_to=16)
    graph = dsa_dcp.backend_report().graph
    scores = [n for n in graph.graph.nodes if n.op == "call_function" and n.target == INDEX_SCORES]
    assert len(scores) == len(cfg.indexer_layers)
    assert all(fx_facts.dtype(n.args[0]) == E4M3 for n in scores)
    assert out.tokens == ref.tokens
    for a, b in zip(out.step_logits, ref.step_logits, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
