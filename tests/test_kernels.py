"""Triton kernels vs their torch references vs independent fp64 brute force.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, which tests/conftest.py
sets before the kernel modules are defined). On a GPU machine the same cases test the compiled
kernels on CUDA tensors.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import checks
from triton_env import (  # noqa: F401 (interpreter_or_fresh_process: an autouse fixture)
    DEVICE,
    fresh_interpreter_test,
    interpreter_or_fresh_process,
    kv_store_mod,
    lse_combine_mod,
    seeded as _gen,
    sparse_mla_mod,
    topk_remap_mod,
)


test_in_fresh_interpreter = fresh_interpreter_test(__file__)


# NaN and inf inputs make numpy (the interpreter) warn about the NaN it computes on purpose
QUIET_NAN = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): one bf16 ulp
BF16_ULP = 2.0**-7
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(actual, expected, rtol, what):
    """``checks.assert_close`` relative to max |e|."""
    checks.assert_close(actual, expected, rtol, what, scale_floor=1e-6)


# ---------------------------------------------------------------------------------------------
# topk_remap


def _random_topk(gen, B, K, S, dtype):
    """Distinct slots per row, negative padding at random positions, one empty row, one sparse row."""
    rows = [
        torch.randperm(S, generator=gen)[:K] if K <= S else torch.randint(0, S, (K,), generator=gen) for _ in range(B)
    ]
    topk = torch.stack(rows) if B else torch.empty((0, K), dtype=torch.int64)
    pad = torch.rand((B, K), generator=gen) < 0.3
    topk[pad] = -1
    if B > 0:
        topk[0] = -1  # a row with no valid slot
    if B > 1 and K > 2:
        keep = torch.zeros(K, dtype=torch.bool)
        keep[torch.randperm(K, generator=gen)[:2]] = True
        topk[1][~keep] = -1  # K much larger than the valid slots
    if B > 2 and K > 1:
        topk[2, K // 2] = -7  # any negative id means "no slot"
    return topk.to(dtype)


def _brute_remap(topk, N, r, I):
    """Python loops over the DESIGN.md formulas, independent of dsa_dcp.slots."""
    B, K = topk.shape
    local = torch.full((B, K), -1, dtype=torch.int32)
    count = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        kept = [(s // (N * I)) * I + s % I for s in topk[b].tolist() if s >= 0 and (s // I) % N == r]
        local[b, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
        count[b] = len(kept)
    return local, count


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("I", [1, 2, 3])
@pytest.mark.parametrize("K,block_k,dtype", [(7, None, torch.int32), (33, 8, torch.int64), (33, 64, torch.int32)])
def test_topk_remap(N, I, K, block_k, dtype):
    B = 6
    S = 4 * K * N * I + 1  # N * I does not divide S (for N * I > 1)
    topk = _random_topk(_gen("remap", N, I, K), B, K, S, dtype)
    valid_per_row = (topk >= 0).sum(1)
    counts = torch.zeros(B, dtype=torch.int64)
    seen = [[] for _ in range(B)]
    for r in range(N):
        exp_local, exp_count = _brute_remap(topk, N, r, I)
        ref_local, ref_count = topk_remap_mod.topk_remap_reference(topk.to(DEVICE), N, r, I)
        tri_local, tri_count = topk_remap_mod.topk_remap_triton(topk.to(DEVICE), N, r, I, block_k=block_k)
        for what, loc, cnt in (("reference", ref_local, ref_count), ("triton", tri_local, tri_count)):
            assert loc.dtype == torch.int32 and cnt.dtype == torch.int32, what
            assert torch.equal(loc.cpu(), exp_local), f"{what} local rows, rank {r}"
            assert torch.equal(cnt.cpu(), exp_count), f"{what} counts, rank {r}"
        counts += exp_count
        for b in range(B):
            for lrow in tri_local[b, : int(tri_count[b])].tolist():
                # invert local_row for rank r: the global slot it stores
                seen[b].append((lrow // I) * N * I + r * I + lrow % I)
    assert torch.equal(counts, valid_per_row), "kept counts over all ranks != valid entries"
    for b in range(B):
        valid = sorted(s for s in topk[b].tolist() if s >= 0)
        assert sorted(seen[b]) == valid, f"row {b}: each valid slot must land on exactly one rank"


@pytest.mark.parametrize("K,N,I", [(2047, 3, 2), (2048, 4, 1)])
def test_topk_remap_large_k(K, N, I):
    topk = _random_topk(_gen("remap-large", K, N, I), 3, K, 3 * K * N * I + 5, torch.int32)
    for r in range(N):
        exp_local, exp_count = _brute_remap(topk, N, r, I)
        tri_local, tri_count = topk_remap_mod.topk_remap_triton(topk.to(DEVICE), N, r, I)
        assert torch.equal(tri_local.cpu(), exp_local) and torch.equal(tri_count.cpu(), exp_count)


@pytest.mark.parametrize("B,K", [(0, 5), (3, 0), (0, 0)])
def test_topk_remap_empty(B, K):
    topk = torch.full((B, K), -1, dtype=torch.int64, device=DEVICE)
    for fn in (topk_remap_mod.topk_remap_reference, topk_remap_mod.topk_remap_triton):
        local, count = fn(topk, 2, 1, 1)
        assert local.shape == (B, K) and count.shape == (B,)
        assert local.dtype == count.dtype == torch.int32
        assert (local == -1).all() and (count == 0).all()


# ---------------------------------------------------------------------------------------------
# lse_combine


def _random_shards(gen, N, B, H, D, dtype, lse_scale=3.0, lse_shift=0.0):
    """Random shards, a quarter of them empty (``-inf``) with NaN in their ``out``, which must never
    be read; (0, 0) empty in every shard, (1, 1) in all but the last."""
    out = torch.randn((N, B, H, D), generator=gen).to(dtype)
    lse = torch.randn((N, B, H), generator=gen) * lse_scale + lse_shift
    lse[torch.rand((N, B, H), generator=gen) < 0.25] = float("-inf")
    lse[:, 0, 0] = float("-inf")  # every shard of (0, 0) empty
    if B > 1 and H > 1:
        lse[:, 1, 1] = float("-inf")  # all empty ...
        lse[N - 1, 1, 1] = 0.5  # ... except the last shard
    out[torch.isneginf(lse)] = float("nan")  # an empty shard's out must never be read
    return out, lse


def _check_combine(out, lse, block_d=None, rows=None, nan=False):
    exp_out, exp_lse = checks.brute_lse_combine(out, lse)
    rtol = RTOL[out.dtype]
    ref = lse_combine_mod.lse_combine_reference(out.to(DEVICE), lse.to(DEVICE))
    tri = lse_combine_mod.lse_combine_triton(out.to(DEVICE), lse.to(DEVICE), block_d=block_d, rows=rows)
    for what, (o, lz) in (("reference", ref), ("triton", tri)):
        assert o.dtype == out.dtype and lz.dtype == torch.float32, what
        checks.assert_close(o, exp_out, rtol, f"{what} out", scale_floor=1e-6, nan=nan)
        checks.assert_close(lz, exp_lse, 1e-5, f"{what} lse", scale_floor=1e-6, nan=nan)
        empty = torch.isneginf(exp_lse)
        assert (o.cpu()[empty] == 0).all(), f"{what}: all-empty (b, h) must give out = 0"
    return ref, tri


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,block_d,rows", [(5, None, None), (40, 16, None), (40, 16, 4), (6, None, 8)])
def test_lse_combine(N, dtype, D, block_d, rows):
    """rows=4 and 8 over B*H = 12 pairs: several (b, h) a program, the last program partly past the end."""
    out, lse = _random_shards(_gen("combine", N, dtype, D), N, 3, 4, D, dtype)
    _check_combine(out, lse, block_d, rows)


@pytest.mark.parametrize("N,D,dtype", [(3, 576, torch.bfloat16), (2, 512, torch.float32), (8, 576, torch.float32)])
def test_lse_combine_mla_width(N, D, dtype):
    out, lse = _random_shards(_gen("combine-wide", N, D, dtype), N, 3, 2, D, dtype)
    _check_combine(out, lse)


def test_lse_combine_large_lse():
    """exp(lse) overflows fp32 here; the running max must keep everything finite."""
    out, lse = _random_shards(_gen("combine-large"), 3, 3, 4, 8, torch.float32, lse_scale=200.0, lse_shift=900.0)
    _check_combine(out, lse)


@pytest.mark.parametrize("N,B,H", [(0, 2, 3), (2, 0, 3), (2, 2, 0)])
def test_lse_combine_empty(N, B, H):
    out = torch.randn((N, B, H, 6), device=DEVICE)
    lse = torch.randn((N, B, H), device=DEVICE)
    for fn in (lse_combine_mod.lse_combine_reference, lse_combine_mod.lse_combine_triton):
        o, lz = fn(out, lse)
        assert o.shape == (B, H, 6) and lz.shape == (B, H)
        assert (o == 0).all() and torch.isneginf(lz).all()


def _non_finite_shards(dtype):
    """N = 3 shards of B = 6 rows, H = 2 heads, D = 5, each row one case of the NaN rule."""
    nan, inf = float("nan"), float("inf")
    gen = _gen("combine-nan", dtype)
    lse = torch.randn((3, 6, 2), generator=gen)  # every shard non-empty but where set below
    out = torch.randn((3, 6, 2, 5), generator=gen).to(dtype)
    lse[1, 0, 0] = nan  # row 0: a NaN LSE in one shard
    out[2, 1, 0, 3] = nan  # row 1: a NaN in the out of a non-empty shard ...
    lse[0, 1, 1], out[0, 1, 1, 0] = -80.0, nan  # ... and of one whose weight underflows
    lse[0, 2, :], out[0, 2] = -inf, nan  # row 2: NaN in the out of an empty shard: ignored
    lse[:, 3, :], out[:, 3] = -inf, nan  # row 3: every shard empty
    lse[0, 4, :] = inf  # row 4: a +inf LSE ...
    lse[2, 4, 1] = nan  # ... and beside it a NaN one
    out[1, 5, 0, 2] = inf  # row 5: an inf in a non-empty shard's out
    return out, lse


@QUIET_NAN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_d,rows", [(None, None), (2, 4)])
def test_lse_combine_propagates_nan_and_ignores_empty_shards(dtype, block_d, rows):
    """Only ``lse = -inf`` is empty: NaN and +inf LSEs, and NaN in a non-empty shard's out, reach
    the result (as the brute force's formula gives them); an empty shard's NaN out never does."""
    out, lse = _non_finite_shards(dtype)
    ref, tri = _check_combine(out, lse, block_d, rows, nan=True)
    for what, (o, lz) in (("reference", ref), ("triton", tri)):
        o, lz = o.cpu(), lz.cpu()
        assert lz[0, 0].isnan() and o[0, 0].isnan().all() and torch.isfinite(o[0, 1]).all(), what
        assert o[1, 0, 3].isnan() and o[1, 0].isnan().sum() == 1 and torch.isfinite(lz[1]).all(), what
        assert o[1, 1, 0].isnan() and o[1, 1].isnan().sum() == 1, f"{what}: a NaN at weight 0 still counts"
        assert torch.isfinite(o[2]).all() and torch.isfinite(lz[2]).all(), f"{what}: an empty shard's out leaked"
        assert (o[3] == 0).all() and torch.isneginf(lz[3]).all(), f"{what}: all-empty row"
        assert torch.isposinf(lz[4, 0]) and o[4, 0].isnan().all(), f"{what}: +inf LSE"
        assert lz[4, 1].isnan() and o[4, 1].isnan().all(), f"{what}: NaN beside +inf"
        assert torch.isposinf(o[5, 0, 2]) and torch.isfinite(lz[5]).all(), what
    # the empty shard of row 2 drops out: the same as merging the other two shards alone
    two = lse_combine_mod.lse_combine_reference(out[1:, 2:3], lse[1:, 2:3])
    for what, (o, lz) in (("reference", ref), ("triton", tri)):
        torch.testing.assert_close(o[2:3].float().cpu(), two[0].float(), rtol=RTOL[dtype], atol=RTOL[dtype])
        torch.testing.assert_close(lz[2:3].cpu(), two[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# sparse_mla


def _brute_mla(q_nope, q_pe, kv, topk, sm_scale):
    B, H, Dc = q_nope.shape
    qn, qp, kvd = q_nope.double().cpu(), q_pe.double().cpu(), kv.double().cpu()
    out = torch.zeros((B, H, Dc), dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        idx = [j for j in topk[b].tolist() if j >= 0]
        if not idx:
            continue
        rows = kvd[idx]
        scores = (qn[b] @ rows[:, :Dc].T + qp[b] @ rows[:, Dc:].T) * sm_scale  # [H, n]
        lse[b] = torch.logsumexp(scores, dim=1)
        out[b] = torch.softmax(scores, dim=1) @ rows[:, :Dc]
    return out, lse


def _random_mla(gen, B, H, K, S, Dc, Dr, dtype):
    q_nope = torch.randn((B, H, Dc), generator=gen).to(dtype)
    q_pe = torch.randn((B, H, Dr), generator=gen).to(dtype)
    kv = torch.randn((S, Dc + Dr), generator=gen).to(dtype)
    topk = _random_topk(gen, B, K, S, torch.int64)
    return q_nope, q_pe, kv, topk


MLA_CASES = [
    # B, H, K, S, Dc, Dr, block_h, block_k, num_splits
    (3, 4, 7, 50, 16, 8, 2, 4, 1),  # elementwise path, several head and K blocks
    (3, 4, 7, 50, 16, 8, None, None, None),  # default tiles: tl.dot, H and K padded
    (3, 5, 40, 33, 16, 8, 16, 16, 1),  # tl.dot, three K blocks, K > S
    (3, 5, 40, 33, 16, 8, 16, 16, 3),  # split K: three splits merged by lse_combine
    (4, 3, 13, 60, 12, 6, 2, 4, 2),  # Dc, Dr not powers of two; splits with no valid key
    (3, 20, 19, 70, 32, 16, 16, 16, 1),  # two head blocks with tl.dot
]


# the key-major products (scores^T = K q^T, acc^T = V^T p^T) on the tensor-core cases, and two
# programs a head block each owning half of the latent (dc_split=2) on every case
MLA_VARIANT_CASES = (
    [c + (False, 1) for c in MLA_CASES]
    + [c + (True, 1) for c in MLA_CASES if c[6] is not None and min(c[6], c[7]) >= 16]
    + [c + (False, 2) for c in MLA_CASES]
    + [(3, 5, 40, 33, 64, 8, 16, 16, 3, False, 2)]  # each half 32 wide: both programs store
)


@pytest.mark.parametrize("case", MLA_VARIANT_CASES,
                         ids=lambda c: "B{}H{}K{}S{}Dc{}Dr{}bh{}bk{}sp{}{}{}".format(
                             *c[:9], "-keymajor" * c[9], "-dcsplit" * (c[10] == 2)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla(case, dtype):
    B, H, K, S, Dc, Dr, block_h, block_k, num_splits, key_major, dc_split = case
    q_nope, q_pe, kv, topk = _random_mla(_gen("mla", case, dtype), B, H, K, S, Dc, Dr, dtype)
    sm_scale = 0.5
    exp_out, exp_lse = _brute_mla(q_nope, q_pe, kv, topk, sm_scale)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, topk)]
    # the reference in fp64 must agree with the brute force almost exactly
    ref64_out, ref64_lse = sparse_mla_mod.sparse_mla_reference(*args, sm_scale, compute_dtype=torch.float64)
    if dtype == torch.float32:
        assert_close(ref64_out, exp_out, 1e-6, "fp64 reference out")  # only the output rounding
    assert_close(ref64_lse, exp_lse, 1e-6, "fp64 reference lse")
    ref = sparse_mla_mod.sparse_mla_reference(*args, sm_scale)
    tri = sparse_mla_mod.sparse_mla_triton(*args, sm_scale, block_h=block_h, block_k=block_k, num_splits=num_splits,
                                           key_major=key_major, dc_split=dc_split)
    for what, (o, lz) in (("reference", ref), ("triton", tri)):
        assert o.dtype == dtype and lz.dtype == torch.float32, what
        assert_close(o, exp_out, RTOL[dtype], f"{what} out")
        assert_close(lz, exp_lse, 1e-5, f"{what} lse")
        assert (o[0] == 0).all() and torch.isneginf(lz[0]).all(), f"{what}: a row with no slot"


def _non_finite_mla(dtype):
    """One row for each non-finite case of the contract (B = 7, H = 4, K = 40, S = 80, Dc = 16,
    Dr = 8): 0 no slot (NaN query), 1 a NaN in one head's query, 2 a NaN in a named KV row,
    3 +inf in a named row's rope part, 4 -inf in a named row's latent (value) part, 5 only that
    row named, 6 the rows of 2 and 3 (NaN beside +inf). Heads alternate the sign of the query
    column the infinity meets, so each infinite row scores +inf on heads 0 and 2 and -inf on heads
    1 and 3. Every KV row no top-k names is NaN."""
    B, H, K, S, Dc, Dr = 7, 4, 40, 80, 16, 8
    nan, inf = float("nan"), float("inf")
    gen = _gen("mla-nan", dtype)
    q_nope, q_pe = torch.randn((B, H, Dc), generator=gen), torch.randn((B, H, Dr), generator=gen)
    kv = torch.randn((S, Dc + Dr), generator=gen)
    a, b, c = 0, 1, 2  # the poisoned rows, named only where placed below
    topk = torch.stack([3 + torch.randperm(S - 3, generator=gen)[:K] for _ in range(B)])
    topk[torch.rand((B, K), generator=gen) < 0.3] = -1
    topk[:, -4:] = -1  # a -1 tail
    topk[0] = -1
    q_nope[0] = nan  # a row with no slot is empty whatever its query holds
    q_nope[1, 2, 0] = nan
    topk[2, 7], kv[a, 3] = a, nan
    topk[3, 20], kv[b, Dc + 1] = b, inf
    topk[4, 33], kv[c, 2] = c, -inf
    topk[5] = -1
    topk[5, 0] = c
    topk[6, 3], topk[6, 30] = a, b
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])
    q_pe[[3, 6], :, 1] = q_pe[[3, 6], :, 1].abs() * sign
    q_nope[4:6, :, 2] = -q_nope[4:6, :, 2].abs() * sign  # kv is -inf there: +inf scores on heads 0, 2
    named = torch.zeros(S, dtype=torch.bool)
    named[topk[topk >= 0]] = True
    kv[~named] = nan
    return q_nope.to(dtype), q_pe.to(dtype), kv.to(dtype), topk


def _brute_split_mla(q_nope, q_pe, kv, topk, sm_scale, split_len):
    """The brute force over each contiguous K range of ``split_len``, merged by the
    ``lse_combine`` contract: what split-K computes (a range whose keys all score -inf is empty)."""
    K = topk.shape[1]
    col = torch.arange(K)
    parts = [_brute_mla(q_nope, q_pe, kv, torch.where((col >= s) & (col < s + split_len), topk, -1), sm_scale)
             for s in range(0, K, split_len)]
    return checks.brute_lse_combine(torch.stack([o for o, _ in parts]), torch.stack([lz for _, lz in parts]))


@QUIET_NAN
@pytest.mark.parametrize("block_h,block_k,num_splits,key_major,dc_split", [
    (2, 4, 1, False, 1),  # elementwise path
    (16, 16, 1, False, 1),  # tensor-core path
    (16, 16, 1, True, 1),  # key-major
    (16, 16, 1, False, 2),  # two programs a head block
    (2, 4, 3, False, 1),  # split K: 3 ranges of 16 keys
    (16, 16, 3, True, 1),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_non_finite_values(dtype, block_h, block_k, num_splits, key_major, dc_split):
    """NaN and infinities in the query or in named KV rows give what the dense softmax gives in
    fp64 (NaN is never "empty"); KV rows no top-k names never matter; split K merges its ranges by
    the lse_combine rule."""
    q_nope, q_pe, kv, topk = _non_finite_mla(dtype)
    dense_out, dense_lse = _brute_mla(q_nope, q_pe, kv, topk, 0.5)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, topk)]
    ref64 = sparse_mla_mod.sparse_mla_reference(*args, 0.5, compute_dtype=torch.float64)
    checks.assert_close(ref64[1], dense_lse, 1e-6, "fp64 reference lse", scale_floor=1e-6, nan=True)
    ref = sparse_mla_mod.sparse_mla_reference(*args, 0.5)
    tri = sparse_mla_mod.sparse_mla_triton(*args, 0.5, block_h=block_h, block_k=block_k, num_splits=num_splits,
                                           key_major=key_major, dc_split=dc_split)
    K = topk.shape[1]
    split_len = -(-(-(-K // num_splits)) // block_k) * block_k  # the launcher's whole-tile ranges
    # one range: the kernel's own result, nothing merged
    split = (dense_out, dense_lse) if split_len >= K else _brute_split_mla(q_nope, q_pe, kv, topk, 0.5, split_len)
    for what, (o, lz), (exp_out, exp_lse) in (("reference", ref, (dense_out, dense_lse)), ("triton", tri, split)):
        checks.assert_close(o, exp_out, RTOL[dtype], f"{what} out", scale_floor=1e-6, nan=True)
        checks.assert_close(lz, exp_lse, 1e-5, f"{what} lse", scale_floor=1e-6, nan=True)
        o, lz = o.cpu(), lz.cpu()
        assert (o[0] == 0).all() and torch.isneginf(lz[0]).all(), f"{what}: no slot, NaN query"
        assert lz[1, 2].isnan() and o[1, 2].isnan().all(), f"{what}: NaN query head"
        assert torch.isfinite(lz[1, [0, 1, 3]]).all() and torch.isfinite(o[1, [0, 1, 3]]).all(), what
        assert lz[2].isnan().all() and o[2].isnan().all(), f"{what}: NaN in a named KV row is never empty"
        assert torch.isposinf(lz[3, [0, 2]]).all() and o[3, [0, 2]].isnan().all(), f"{what}: +inf score"
        assert torch.isfinite(lz[3, [1, 3]]).all() and torch.isfinite(o[3, [1, 3]]).all(), f"{what}: -inf score"
        assert torch.isposinf(lz[4, [0, 2]]).all() and o[4, [0, 2]].isnan().all(), f"{what}: +inf score"
        assert torch.isfinite(lz[4, [1, 3]]).all(), f"{what}: -inf score, other keys finite"
        assert o[4, [1, 3], 2].isnan().all() and o[4, [1, 3]].isnan().sum() == 2, f"{what}: 0 * inf in column 2"
        assert torch.isposinf(lz[5, [0, 2]]).all() and o[5, [0, 2]].isnan().all(), what
        # every key of row 5 scores -inf on heads 1, 3: the dense softmax is 0/0 (NaN out, lse -inf);
        # under split K the one range holding the key is empty to the merge, like a DCP shard
        assert torch.isneginf(lz[5, [1, 3]]).all(), what
        assert lz[6].isnan().all() and o[6].isnan().all(), f"{what}: NaN beside +inf is NaN"
        assert o[5, [1, 3]].isnan().all() if what == "reference" or num_splits == 1 else (o[5, [1, 3]] == 0).all()


def test_sparse_mla_long_topk():
    """DeepSeek-V3.2's K = 2048 (minus one), most of it padding, over a few K tiles."""
    q_nope, q_pe, kv, topk = _random_mla(_gen("mla-long"), 2, 4, 2047, 3000, 16, 8, torch.float32)
    topk[1, 1000:] = torch.randperm(3000, generator=_gen("mla-long-fill"))[:1047]
    exp_out, exp_lse = _brute_mla(q_nope, q_pe, kv, topk, 0.25)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, topk)]
    out, lse = sparse_mla_mod.sparse_mla_triton(*args, 0.25, block_k=128, num_splits=4)
    assert_close(out, exp_out, 1e-5, "out")
    assert_close(lse, exp_lse, 1e-5, "lse")


def test_sparse_mla_strided_views():
    """q_nope / q_pe split from one tensor and a KV view with padded rows: no copies, same result."""
    B, H, K, S, Dc, Dr = 2, 3, 9, 40, 16, 8
    gen = _gen("mla-views")
    q = torch.randn((B, H, Dc + Dr), generator=gen)
    kv_big = torch.randn((S, Dc + Dr + 8), generator=gen)
    topk = _random_topk(gen, B, K, S, torch.int32)
    q_nope, q_pe, kv = q[..., :Dc], q[..., Dc:], kv_big[:, :Dc + Dr]
    exp_out, exp_lse = _brute_mla(q_nope, q_pe, kv, topk, 0.3)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, topk)]
    for block_h, block_k in ((2, 4), (16, 16)):
        out, lse = sparse_mla_mod.sparse_mla_triton(*args, 0.3, block_h=block_h, block_k=block_k)
        assert_close(out, exp_out, 1e-5, "out")
        assert_close(lse, exp_lse, 1e-5, "lse")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_h,block_k,num_splits,key_major,dc_split",
                         [(2, 4, 1, False, 1), (16, 16, 2, False, 1), (16, 16, 2, True, 1), (16, 16, 2, False, 2)])
def test_sparse_mla_fp8_kv(q_dtype, block_h, block_k, num_splits, key_major, dc_split):
    """E4M3 KV with a per-tensor scale: the same as attending over the dequantized cache."""
    B, H, K, S, Dc, Dr = 3, 5, 40, 60, 32, 8
    gen = _gen("mla-fp8", q_dtype, block_h)
    q_nope, q_pe, kv_real, topk = _random_mla(gen, B, H, K, S, Dc, Dr, torch.float32)
    q_nope, q_pe = q_nope.to(q_dtype), q_pe.to(q_dtype)
    kv_scale = float(kv_real.abs().amax()) / 448.0
    kv8 = (kv_real / kv_scale).to(torch.float8_e4m3fn)
    exp_out, exp_lse = _brute_mla(q_nope, q_pe, kv8.double() * kv_scale, topk, 0.5)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv8, topk)]
    ref = sparse_mla_mod.sparse_mla_reference(*args, 0.5, kv_scale)
    tri = sparse_mla_mod.sparse_mla_triton(
        *args, 0.5, kv_scale, block_h=block_h, block_k=block_k, num_splits=num_splits, key_major=key_major,
        dc_split=dc_split,
    )
    for what, (o, lz) in (("reference", ref), ("triton", tri)):
        assert o.dtype == q_dtype, what
        assert_close(o, exp_out, RTOL[q_dtype], f"{what} out")
        assert_close(lz, exp_lse, 1e-5, f"{what} lse")
        assert (o[0] == 0).all() and torch.isneginf(lz[0]).all(), f"{what}: a row with no slot"


def test_sparse_mla_shrinks_tiles_that_do_not_fit_shared_memory(monkeypatch):
    """fp32 queries over FP8 KV with a 16-bit table's tiles overflowed an H200's shared memory
    (242,048 bytes against 232,448): the launcher drops pipeline stages, then halves block_k, and
    gives the same result; ``fit=False`` raises. The device's limit is played by a launch that
    refuses tiles over a budget."""
    from triton.runtime.errors import OutOfResources

    q_nope, q_pe, kv_real, topk = _random_mla(_gen("mla-fit"), 2, 4, 40, 60, 32, 8, torch.float32)
    kv_scale = float(kv_real.abs().amax()) / 448.0
    kv8 = (kv_real / kv_scale).to(torch.float8_e4m3fn)
    exp_out, exp_lse = _brute_mla(q_nope, q_pe, kv8.double() * kv_scale, topk, 0.5)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv8, topk)]
    real, tried = sparse_mla_mod._launch_sparse_mla, []

    def small_device(*a):
        bk, stages = a[9], a[11]
        tried.append((stages, bk))
        if stages * bk > 16:  # the stand-in for the shared memory a tile takes
            raise OutOfResources(stages * bk, 16, "shared memory")
        return real(*a)

    monkeypatch.setattr(sparse_mla_mod, "_launch_sparse_mla", small_device)
    monkeypatch.setattr(sparse_mla_mod, "_FITTED", {})
    out, lse = sparse_mla_mod.sparse_mla_triton(*args, 0.5, kv_scale, block_h=16, block_k=32, num_stages=3)
    assert tried == [(3, 32), (2, 32), (1, 32), (1, 16)]
    assert_close(out, exp_out, RTOL[torch.float32], "out")
    assert_close(lse, exp_lse, 1e-5, "lse")
    tried.clear()
    again, _ = sparse_mla_mod.sparse_mla_triton(*args, 0.5, kv_scale, block_h=16, block_k=32, num_stages=3)
    assert tried == [(1, 16)] and torch.equal(again, out)  # the fitted tiles remembered: one launch
    tried.clear()
    with pytest.raises(OutOfResources):
        sparse_mla_mod.sparse_mla_triton(*args, 0.5, kv_scale, block_h=16, block_k=32, fit=False)
    assert tried == [(3, 32)]
    monkeypatch.setattr(sparse_mla_mod, "_launch_sparse_mla",
                        lambda *a: (_ for _ in ()).throw(OutOfResources(1, 0, "shared memory")))
    with pytest.raises(OutOfResources):  # nothing left to shrink: the device's error
        sparse_mla_mod.sparse_mla_triton(*args, 0.5, kv_scale, block_h=16, block_k=32)


def test_sparse_mla_key_major_needs_the_tensor_core_path():
    args = [t.to(DEVICE) for t in _random_mla(_gen("mla-km"), 2, 2, 4, 10, 16, 8, torch.float32)]
    with pytest.raises(ValueError, match="key_major needs the tensor-core path"):
        sparse_mla_mod.sparse_mla_triton(*args, 0.5, block_h=2, block_k=4, key_major=True)


def test_sparse_mla_dc_split_contract():
    args = [t.to(DEVICE) for t in _random_mla(_gen("mla-dcs"), 2, 2, 4, 10, 32, 8, torch.float32)]
    with pytest.raises(ValueError, match="dc_split must be 1 or 2"):
        sparse_mla_mod.sparse_mla_triton(*args, 0.5, dc_split=4)
    with pytest.raises(ValueError, match="dc_split=2 is for the head-major products"):
        sparse_mla_mod.sparse_mla_triton(*args, 0.5, block_h=16, block_k=16, key_major=True, dc_split=2)


def test_sparse_mla_kv_scale_contract():
    q_nope, q_pe, kv, topk = _random_mla(_gen("mla-scale"), 2, 2, 4, 10, 16, 8, torch.float32)
    kv8 = kv.to(torch.float8_e4m3fn)
    for fn in (sparse_mla_mod.sparse_mla_reference, sparse_mla_mod.sparse_mla_triton):
        with pytest.raises(ValueError, match="FP8 kv needs a positive Python float kv_scale"):
            fn(q_nope, q_pe, kv8, topk, 0.5)
        with pytest.raises(ValueError, match="kv_scale is only for FP8 kv"):
            fn(q_nope, q_pe, kv, topk, 0.5, 2.0)


@pytest.mark.parametrize("B,H,K", [(0, 4, 5), (2, 4, 0), (2, 0, 5)])
def test_sparse_mla_empty(B, H, K):
    q_nope, q_pe = torch.randn((B, H, 16), device=DEVICE), torch.randn((B, H, 8), device=DEVICE)
    kv = torch.randn((10, 24), device=DEVICE)
    topk = torch.zeros((B, K), dtype=torch.int64, device=DEVICE)
    for fn in (sparse_mla_mod.sparse_mla_reference, sparse_mla_mod.sparse_mla_triton):
        out, lse = fn(q_nope, q_pe, kv, topk, 0.1)
        assert out.shape == (B, H, 16) and lse.shape == (B, H)
        assert (out == 0).all() and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# kv_store


@pytest.mark.parametrize("cache_dtype,rows_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize("D,block_d,slot_dtype", [(6, 4, torch.int32), (576, None, torch.int64)])
def test_kv_store(cache_dtype, rows_dtype, D, block_d, slot_dtype):
    gen = _gen("kv", cache_dtype, rows_dtype, D)
    S, B = 13, 6
    cache = torch.randn((S, D), generator=gen).to(cache_dtype)
    rows = torch.randn((B, D), generator=gen).to(rows_dtype)
    slots = torch.randperm(S, generator=gen)[:B]
    slots[1], slots[4] = -1, -3
    slots = slots.to(slot_dtype)
    expected = cache.double()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s] = rows[i].double()
    written = torch.zeros(S, dtype=torch.bool)
    written[[s for s in slots.tolist() if s >= 0]] = True
    for fn in (kv_store_mod.kv_store_reference, kv_store_mod.kv_store_triton):
        got = cache.clone().to(DEVICE)
        if fn is kv_store_mod.kv_store_triton:
            fn(got, slots.to(DEVICE), rows.to(DEVICE), block_d=block_d)
        else:
            fn(got, slots.to(DEVICE), rows.to(DEVICE))
        got = got.cpu()
        assert got.dtype == cache_dtype
        assert torch.equal(got[~written], cache[~written]), f"{fn.__name__}: rows it must not touch changed"
        # a cast to bf16 may differ by one ulp (rounding mode of the Triton interpreter)
        tol = BF16_ULP if (cache_dtype == torch.bfloat16 and rows_dtype != cache_dtype) else 0.0
        diff = (got.double() - expected).abs()
        assert (diff <= tol * expected.abs()).all(), f"{fn.__name__}: stored rows differ"


def test_kv_store_strided_cache_and_empty():
    gen = _gen("kv-view")
    big = torch.randn((9, 20), generator=gen).to(DEVICE)
    cache = big[:, 4:16]  # a view: written in place, never copied
    before = big.clone()
    rows = torch.randn((3, 12), generator=gen).to(DEVICE)
    slots = torch.tensor([8, -1, 0], device=DEVICE)
    kv_store_mod.kv_store_triton(cache, slots, rows)
    expected = before.clone()
    expected[8, 4:16], expected[0, 4:16] = rows[0], rows[2]
    assert torch.equal(big, expected)
    kv_store_mod.kv_store_triton(cache, slots[:0], rows[:0])  # B == 0: nothing happens
    assert torch.equal(big, expected)


# ---------------------------------------------------------------------------------------------
# the ops' choice by device, the package's exports, input checks, import without the interpreter


def test_ops_follow_device():
    """The op layer picks each kernel by device (the Triton kernel it registers for CUDA, the torch
    reference elsewhere); the package itself dispatches nothing and exports both implementations."""
    from dsa_dcp import kernels
    from dsa_dcp.ops import KV_STORE, LSE_COMBINE, TOPK_REMAP

    gen = _gen("dispatch")
    topk = _random_topk(gen, 3, 9, 40, torch.int64).to(DEVICE)
    a, b = TOPK_REMAP(topk, 2, 1, 2), topk_remap_mod.topk_remap_reference(topk, 2, 1, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    out, lse = _random_shards(gen, 2, 3, 2, 4, torch.float32)
    a, b = LSE_COMBINE(out.to(DEVICE), lse.to(DEVICE)), checks.brute_lse_combine(out, lse)
    assert_close(a[0], b[0], 1e-5, "out")
    assert_close(a[1], b[1], 1e-5, "lse")
    cache = torch.zeros((4, 3), device=DEVICE)
    KV_STORE(cache, torch.tensor([2, -1], device=DEVICE), torch.ones((2, 3), device=DEVICE))
    assert cache.sum().item() == 3 and (cache[2] == 1).all()
    ops = ("topk_remap", "lse_combine", "kv_store", "sparse_mla", "index_scores", "topk_select", "topk_select_remap",
           "topk_candidates")  # fmt: skip
    assert set(kernels.__all__) == {f"{op}{suffix}" for op in ops for suffix in ("_reference", "_triton")} | {
        "topk_agree_reference", "topk_agree_remap_reference"
    }


def _bad_calls():
    t, f = torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 4, 16))
    return [
        ("topk_remap", (t[0], 2, 0, 1), "dims"),
        ("topk_remap", (t.float(), 2, 0, 1), "int32 or int64"),
        ("topk_remap", (t, 2, 2, 1), "rank"),
        ("topk_remap", (t, 0, 0, 1), "dcp_size"),
        ("topk_remap", (t, 2, 0, 0), "interleave"),
        ("lse_combine", (torch.zeros((2, 2, 4, 8)), torch.zeros((2, 2, 3))), "shape"),
        ("lse_combine", (torch.zeros((2, 2, 4, 8)), torch.zeros((2, 2, 4), dtype=torch.bfloat16)), "dtype"),
        ("lse_combine", (torch.zeros((2, 4, 8)), torch.zeros((2, 4))), "dims"),
        ("sparse_mla", (f, torch.zeros((2, 4, 8)), torch.zeros((10, 25)), t, 0.1), "columns"),
        ("sparse_mla", (f, torch.zeros((2, 3, 8)), torch.zeros((10, 24)), t, 0.1), "q_pe"),
        ("sparse_mla", (f, torch.zeros((2, 4, 8)), torch.zeros((10, 24)), t[:1], 0.1), "rows"),
        ("sparse_mla", (f, torch.zeros((2, 4, 8)), torch.zeros((10, 24)), t.int().float(), 0.1), "int32"),
        ("kv_store", (torch.zeros((5, 4)), torch.zeros(2, dtype=torch.int64), torch.zeros((2, 3))), "width"),
        ("kv_store", (torch.zeros((5, 4)), torch.zeros(3, dtype=torch.int64), torch.zeros((2, 4))), "rows"),
        ("kv_store", (torch.zeros((5, 4)), torch.zeros(2), torch.zeros((2, 4))), "int32 or int64"),
    ]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("op,args,match", _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_input_checks(impl, op, args, match):
    mod = {"topk_remap": topk_remap_mod, "lse_combine": lse_combine_mod,
           "sparse_mla": sparse_mla_mod, "kv_store": kv_store_mod}[op]  # fmt: skip
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(ValueError, match=match):
        getattr(mod, f"{op}_{impl}")(*args)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU-only behaviour")
def test_import_without_interpreter():
    """The kernels import on a CPU machine without TRITON_INTERPRET and refuse CPU launches clearly."""
    code = (
        "import torch\n"
        "from dsa_dcp import kernels\n"
        "t = torch.full((2, 3), -1, dtype=torch.int64)\n"
        "assert torch.equal(kernels.topk_remap_reference(t, 2, 0)[1], torch.zeros(2, dtype=torch.int32))\n"
        "try:\n"
        "    kernels.topk_remap_triton(t, 2, 0)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('launched a compiled Triton kernel on CPU tensors')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
