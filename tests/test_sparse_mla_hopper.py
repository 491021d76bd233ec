"""The Hopper (Gluon) sparse MLA kernel against an fp64 reference, on the GPU only.

The kernel cannot run under the Triton interpreter, so every case here is marked ``gpu`` and also
skips where :func:`sparse_mla_hopper.available` says no (not Hopper, another Triton). The same
contract is CPU-tested through the Triton kernel (tests/test_kernels.py). Inputs are fresh random
draws seeded per case; relative error is ``max|a - e| / max|e|`` over the rows compared.
"""

import math
import zlib

import pytest
import torch

from dsa_dcp.kernels import sparse_mla_hopper as hopper
from dsa_dcp.kernels.sparse_mla import sparse_mla_reference

gpu = pytest.mark.gpu

DC, DR = 512, 64
SM_SCALE = 192**-0.5


def _need_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = hopper.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _inputs(seed, B, H, K, S, kv_dtype, pad=0.1, empty_rows=(), tail=0):
    """Queries, a cache and a top-k of distinct slots per row with random -1 padding (fraction
    ``pad``), rows in ``empty_rows`` all -1, and the last ``tail`` entries of every row -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_nope = torch.randn(B, H, DC, device="cuda", generator=g).to(torch.bfloat16)
    q_pe = torch.randn(B, H, DR, device="cuda", generator=g).to(torch.bfloat16)
    cache = torch.randn(S, DC + DR, device="cuda", generator=g)
    kv_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        kv_scale = float(cache.abs().amax()) / 448.0
        kv = (cache / kv_scale).to(torch.float8_e4m3fn)
    else:
        kv = cache.to(kv_dtype)
    topk = torch.stack([torch.randperm(S, device="cuda", generator=g)[:K] for _ in range(B)]).int()
    drop = torch.rand(B, K, device="cuda", generator=g) < pad
    topk[drop] = -1
    if tail:
        topk[:, K - tail:] = -1
    for b in empty_rows:
        topk[b] = -1
    return q_nope, q_pe, kv, topk, kv_scale


def _reference(q_nope, q_pe, kv, topk, kv_scale):
    """fp64 throughout (inputs widened, output not rounded); FP8 KV dequantized first."""
    kv = kv.float().double() * (kv_scale if kv_scale is not None else 1.0)
    return sparse_mla_reference(q_nope.double(), q_pe.double(), kv, topk, SM_SCALE, compute_dtype=torch.float64)


def _poison(kv, row, col):
    """Write a NaN at kv[row, col] through the raw bits (indexing writes are not defined for FP8)."""
    if kv.dtype == torch.float8_e4m3fn:
        kv.view(torch.uint8)[row, col] = 0x7F
    else:
        kv.view(torch.int16)[row, col] = 0x7FC0


def _rel(a, e):
    a, e = a.double(), e.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _check(got, ref, rows=None, rtol=2e-2, lse_atol=2e-3):
    out, lse = got
    r_out, r_lse = ref
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    if rows is not None:
        out, lse, r_out, r_lse = out[rows], lse[rows], r_out[rows], r_lse[rows]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))  # the same empty rows
    finite = torch.isfinite(r_lse)
    assert (out[~finite] == 0).all()
    rel = _rel(out, r_out)
    assert rel <= rtol, rel
    if finite.any():
        assert (lse[finite].double() - r_lse[finite].double()).abs().max().item() <= lse_atol
    return rel


KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
CASES = {
    # name: (B, H, K, S, pad, empty_rows, tail, num_splits)
    "k2048_pad_tail_empty": (3, None, 2048, 20000, 0.1, (1,), 300, None),
    "k200_one_split": (2, None, 200, 5000, 0.2, (), 0, 1),
    "k200_two_splits_one_empty": (2, None, 200, 5000, 0.0, (), 80, 3),  # 3 asked, 2 of 128 keys made
    "k1000_default_splits": (4, None, 1000, 9000, 0.05, (2,), 0, None),
    "k512_b16": (16, None, 512, 30000, 0.0, (), 0, None),
    "k7": (2, None, 7, 100, 0.0, (), 2, None),
}


@gpu
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_reference(case, H, kv_dtype):
    _need_kernel()
    B, _, K, S, pad, empty_rows, tail, splits = CASES[case]
    seed = zlib.crc32(f"{case}-{H}-{kv_dtype}".encode())
    q_nope, q_pe, kv, topk, kv_scale = _inputs(seed, B, H, K, S, kv_dtype, pad, empty_rows, tail)
    ref = _reference(q_nope, q_pe, kv, topk, kv_scale)
    got = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE, kv_scale, num_splits=splits)
    _check(got, ref)


@gpu
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("prefetch,early_s,block_k", [(2, True, 64), (0, False, 32)])
def test_pipeline_variants(prefetch, early_s, block_k, kv_dtype):
    """The L2 prefetch distance, the early score product and the key tile (32 keys in four stages)
    change timing only. K = 700 is not a multiple of either tile."""
    _need_kernel()
    q_nope, q_pe, kv, topk, kv_scale = _inputs(prefetch + block_k, 3, 128, 700, 7000, kv_dtype, 0.1, (1,), 30)
    ref = _reference(q_nope, q_pe, kv, topk, kv_scale)
    for splits in (1, 3):
        got = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE, kv_scale, num_splits=splits,
                                       prefetch=prefetch, early_s=early_s, block_k=block_k)
        _check(got, ref)


@gpu
@pytest.mark.parametrize("H", [16, 32, 96])
def test_head_counts_not_a_multiple_of_the_block(H):
    _need_kernel()
    q_nope, q_pe, kv, topk, _ = _inputs(H, 3, H, 333, 4000, torch.bfloat16, 0.1, (0,))
    _check(hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE), _reference(q_nope, q_pe, kv, topk, None))


@gpu
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 4])
def test_nan_reaches_only_its_rows(kv_dtype, splits):
    """A NaN query element makes that (row, head) NaN; a NaN in a KV row the top-k of row 2 names
    makes every head of row 2 NaN; a NaN in a KV row nobody names, or named only by a skipped
    (-1) entry, changes nothing. NaN is never turned into an empty row."""
    _need_kernel()
    B, H, K, S = 4, 64, 700, 6000
    q_nope, q_pe, kv, topk, kv_scale = _inputs(7 + splits, B, H, K, S, kv_dtype, 0.1)
    q_nope[1, 5, 17] = float("nan")
    others = torch.cat([topk[:2], topk[3:]]).flatten().long()
    row2 = topk[2][topk[2] >= 0].long()
    named = int(row2[torch.isin(row2, others, invert=True)][0])  # named by row 2 only
    unnamed = int(torch.isin(torch.arange(S, device="cuda"), topk.flatten().long(), invert=True).nonzero()[0])
    _poison(kv, named, 100)
    _poison(kv, unnamed, 3)
    assert kv[named].float().isnan().any() and kv[unnamed].float().isnan().any()
    out, lse = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE, kv_scale, num_splits=splits)
    assert out[1, 5].isnan().all() and lse[1, 5].isnan()
    assert out[2].isnan().all() and lse[2].isnan().all()
    clean = torch.ones(B, H, dtype=torch.bool, device="cuda")
    clean[1, 5] = False
    clean[2] = False
    kv_clean = kv.clone()
    kv_clean.view(torch.uint8)[[named, unnamed]] = 0
    q_clean = q_nope.clone()
    q_clean[1, 5] = 0
    ref = _reference(q_clean, q_pe, kv_clean, topk, kv_scale)
    _check((out, lse), ref, rows=clean)


@gpu
def test_nan_in_a_query_of_an_empty_row_stays_empty():
    """No valid key: the row is empty (0, -inf) whatever its query holds, as in the reference."""
    _need_kernel()
    q_nope, q_pe, kv, topk, _ = _inputs(3, 2, 64, 128, 1000, torch.bfloat16, 0.0, (0,))
    q_nope[0, 3, 0] = float("nan")
    out, lse = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


@gpu
@pytest.mark.parametrize("splits", [1, 5])
def test_all_rows_empty_and_out_of_range_slots(splits):
    """Every entry -1, or >= S (a contract violation the kernel skips): out 0, lse -inf."""
    _need_kernel()
    q_nope, q_pe, kv, topk, _ = _inputs(11, 3, 128, 640, 1000, torch.bfloat16, 0.0, (0, 1, 2))
    topk[1, ::3] = 1000 + 5
    _poison(kv, 0, 0)  # what a skipped entry must never read
    out, lse = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE, num_splits=splits)
    assert (out == 0).all() and torch.isneginf(lse).all()


@gpu
def test_views_int64_topk_and_fp16_queries():
    """q from a larger projection, a KV cache view with padded rows, int64 slot ids; fp16 queries
    on an fp16 cache."""
    _need_kernel()
    B, H, K, S = 3, 64, 300, 3000
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(B, H, DC + DR + 8, device="cuda", generator=g).half()
    q_nope, q_pe = q[..., :DC], q[..., DC:DC + DR]
    big = torch.randn(S, DC + DR + 64, device="cuda", generator=g).half()
    kv = big[:, :DC + DR]
    topk = torch.stack([torch.randperm(S, device="cuda", generator=g)[:K] for _ in range(B)])
    topk[:, -10:] = -1
    out, lse = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE)
    ref = _reference(q_nope, q_pe, kv, topk, None)
    assert out.dtype == torch.float16
    assert _rel(out, ref[0]) <= 1e-2
    assert (lse - ref[1]).abs().max().item() <= 2e-3


@gpu
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["bf16", "fp8"])
def test_error_against_fp64_at_serving_shape(kv_dtype, record_property):
    """H = 128, B = 8, K = 2048 (10% padding): the error stated in docs/kernels.md."""
    _need_kernel()
    q_nope, q_pe, kv, topk, kv_scale = _inputs(21, 8, 128, 2048, 60000, kv_dtype, 0.1)
    ref = _reference(q_nope, q_pe, kv, topk, kv_scale)
    got = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE, kv_scale)
    rel = _check(got, ref, rtol=1e-2)
    lse_err = (got[1] - ref[1]).abs().max().item()
    record_property("rel_out", rel)
    record_property("abs_lse", lse_err)
    print(f"\n{kv_dtype}: max rel out error {rel:.2e}, max abs lse error {lse_err:.2e}")


@gpu
def test_capturable_in_a_cuda_graph():
    _need_kernel()
    q_nope, q_pe, kv, topk, _ = _inputs(31, 8, 64, 1024, 8000, torch.bfloat16, 0.1)
    expect = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, SM_SCALE)
    topk2 = topk.flip(1).contiguous()
    ref2 = hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk2, SM_SCALE)
    topk.copy_(topk2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], ref2[0]) and torch.equal(got[1], ref2[1])
    assert not torch.equal(expect[0], ref2[0])


def test_bad_inputs_are_refused():
    """Boundary checks run before any launch (so on any machine)."""
    q = torch.zeros(1, 64, DC, dtype=torch.bfloat16)
    qp = torch.zeros(1, 64, DR, dtype=torch.bfloat16)
    kv = torch.zeros(10, DC + DR, dtype=torch.bfloat16)
    t = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="q_nope"):
        hopper.sparse_mla_hopper(torch.zeros(1, 64, 256, dtype=torch.bfloat16), qp, kv, t, 0.1)
    with pytest.raises(ValueError, match="kv_scale"):
        hopper.sparse_mla_hopper(q, qp, kv.to(torch.float8_e4m3fn), t, 0.1)
    with pytest.raises(ValueError, match="kv_scale"):
        hopper.sparse_mla_hopper(q, qp, kv, t, 0.1, kv_scale=1.0)
    with pytest.raises(ValueError, match="topk"):
        hopper.sparse_mla_hopper(q, qp, kv, t.float(), 0.1)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        hopper.sparse_mla_hopper(q.float(), qp.float(), kv.float(), t, 0.1)
    odd = torch.zeros(10, DC + DR + 1, dtype=torch.bfloat16)[:, :DC + DR]  # rows 1154 bytes apart
    with pytest.raises(ValueError, match="16-byte boundaries"):
        hopper.sparse_mla_hopper(q, qp, odd, t, 0.1)
    assert not hopper.supports(q, qp, odd) and hopper.supports(q, qp, kv)
    empty = hopper.sparse_mla_hopper(q, qp, kv, t[:, :0], 0.1)  # K = 0: no launch
    assert (empty[0] == 0).all() and torch.isneginf(empty[1]).all()
    assert not hopper.available(q.device)  # CPU tensors, on any machine (a GPU machine's too)
    with pytest.raises(RuntimeError, match="cannot run here"):
        hopper.sparse_mla_hopper(q, qp, kv, t, 0.1)


def test_default_splits_fill_the_gpu():
    assert hopper.default_splits(128, 128, 2048, 132) == 1
    assert hopper.default_splits(128, 64, 2048, 132) == 1
    assert hopper.default_splits(32, 64, 2048, 132) == 4
    assert hopper.default_splits(1, 64, 2048, 132) == 16  # two tiles a split at least
    assert hopper.default_splits(1, 64, 128, 132) == 1
    assert math.prod((hopper.default_splits(8, 128, 2048, 132), 8, 2)) <= 132


@gpu
def test_the_op_runs_the_table_choice_eagerly_and_in_a_graph():
    """``torch.ops.dsa_dcp.sparse_mla`` on a shape the shipped table gives to the Hopper kernel
    (when this is the device it was measured on): same answer eagerly and replayed."""
    _need_kernel()
    import dsa_dcp  # noqa: F401  registers the ops
    from dsa_dcp.kernels import dispatch

    B, H, K = 32, 64, 2048
    choice = dispatch.choose(H, B, K, torch.bfloat16, torch.device("cuda"))
    if choice is None or choice.graph_backend != "hopper":
        pytest.skip("the shipped table does not give this shape to the Hopper kernel on this device")
    q_nope, q_pe, kv, topk, _ = _inputs(41, B, H, K, 70000, torch.bfloat16, 0.1, (3,))
    ref = _reference(q_nope, q_pe, kv, topk, None)
    op = torch.ops.dsa_dcp.sparse_mla
    _check(op(q_nope, q_pe, kv, topk, SM_SCALE), ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(q_nope, q_pe, kv, topk, SM_SCALE)
    graph.replay()
    torch.cuda.synchronize()
    _check(captured, ref)
