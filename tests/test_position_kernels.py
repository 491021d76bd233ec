"""The Triton kernels of the position-cache attention ops against their torch references
(``dsa_dcp.ops_positions``), on fresh random inputs: -1 padding, empty rows, K past the cache's
rows, split K, views of a larger cache, NaN in a named row. On CPU they run under the Triton
interpreter; on a GPU machine the same cases run compiled (``-m gpu`` selects the CUDA twins)."""

import importlib

import pytest
import torch

from dsa_dcp.ops_positions import sparse_mha_positions_reference, sparse_mla_positions_reference
from triton_env import (  # noqa: F401 (interpreter_or_fresh_process: an autouse fixture)
    DEVICE,
    fresh_interpreter_test,
    interpreter_or_fresh_process,
    seeded as _gen,
)

positions_mod = importlib.import_module("dsa_dcp.kernels.sparse_positions")


test_in_fresh_interpreter = fresh_interpreter_test(__file__)


def _topk(g, rows, k, batch, length, empty_row=True):
    """Flat slots ``b * T + p`` of random positions, -1 padding (K may exceed the pool), one empty row."""
    pool = batch * length
    topk = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        topk[r, :min(k, pool)] = torch.randperm(pool, generator=g)[:k]
    topk[:, k // 2:] = torch.where(torch.rand(rows, k - k // 2, generator=g) < 0.3, -1, topk[:, k // 2:])
    if empty_row:
        topk[0] = -1
    return topk.to(torch.int32)


def _close(got, want, rtol, what):
    out, lse = got
    ref_out, ref_lse = want
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), what
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf")), what
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=rtol, atol=rtol, msg=what)
    scale = ref_out.float().abs().max().clamp(min=1e-6)
    torch.testing.assert_close(out.float() / scale, ref_out.float() / scale, rtol=rtol, atol=rtol, msg=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, k, splits", [(3, 2, 24, 1), (2, 3, 40, 3), (1, 2, 5, None)])
def test_sparse_mha_positions_kernel(dtype, rows, heads, k, splits):
    g = _gen(dtype, rows, heads, k, splits)
    batch, length, dn, dr, dv = 2, 16, 12, 4, 8
    big_k = torch.randn(batch, heads + 1, length, dn + dr + 3, generator=g)  # views: a head and columns more
    k_cache = big_k[:, 1:, :, 3:].to(dtype)
    v_cache = torch.randn(batch, heads, length, dv, generator=g).to(dtype)
    q_nope = torch.randn(rows, heads, dn, generator=g).to(dtype)
    q_pe = torch.randn(rows, heads, dr, generator=g).to(dtype)
    topk = _topk(g, rows, k, batch, length)
    args = [x.to(DEVICE) for x in (q_nope, q_pe)], [x.to(DEVICE) for x in (k_cache, v_cache)], topk.to(DEVICE)
    got = positions_mod.sparse_mha_positions_triton(args[0][0], args[0][1], args[1], args[2], 0.3, num_splits=splits)
    want = sparse_mha_positions_reference(q_nope, q_pe, [k_cache, v_cache], topk, 0.3, compute_dtype=torch.float64)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    _close([x.cpu() for x in got], [want[0].to(dtype), want[1].float()], 1e-5 if dtype == torch.float32 else 2e-2,
           (dtype, rows, heads, k, splits))
    assert torch.equal(got[0][0].cpu(), torch.zeros_like(got[0][0].cpu()))  # the empty row


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_sparse_mha_positions_kernel_propagates_nan_in_a_named_row_only():
    g = _gen("nan")
    batch, length, heads = 2, 8, 2
    k_cache = torch.randn(batch, heads, length, 8, generator=g)
    v_cache = torch.randn(batch, heads, length, 4, generator=g)
    k_cache[1, :, 3] = float("nan")  # slot 1 * 8 + 3 = 11
    v_cache[0, :, 5] = float("nan")  # slot 5, never named
    topk = torch.tensor([[11, 2, -1], [0, 1, 2], [13, 6, 7]], dtype=torch.int32)
    q_nope, q_pe = torch.randn(3, heads, 6, generator=g), torch.randn(3, heads, 2, generator=g)
    out, lse = positions_mod.sparse_mha_positions_triton(q_nope.to(DEVICE), q_pe.to(DEVICE),
                                                         [k_cache.to(DEVICE), v_cache.to(DEVICE)], topk.to(DEVICE), 0.5)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(lse[0]).all() and torch.isnan(out[0]).all()
    assert torch.isfinite(lse[1:]).all() and torch.isfinite(out[1:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_positions_kernel(dtype):
    g = _gen("mla", dtype)
    batch, length, heads, dc, dr, rows, k = 3, 10, 4, 16, 8, 4, 12
    kv = torch.randn(batch, length, dc, generator=g).to(dtype)
    pe = torch.randn(batch, 1, length, dr, generator=g).to(dtype).select(1, 0)  # transformers' [B, 1, T, Dr] cache
    q_nope = torch.randn(rows, heads, dc, generator=g).to(dtype)
    q_pe = torch.randn(rows, heads, dr, generator=g).to(dtype)
    topk = _topk(g, rows, k, batch, length)
    got = positions_mod.sparse_mla_positions_triton(q_nope.to(DEVICE), q_pe.to(DEVICE), [kv.to(DEVICE), pe.to(DEVICE)],
                                                    topk.to(DEVICE), 0.25)
    want = sparse_mla_positions_reference(q_nope, q_pe, [kv, pe], topk, 0.25, compute_dtype=torch.float64)
    _close([x.cpu() for x in got], [want[0].to(dtype), want[1].float()], 1e-5 if dtype == torch.float32 else 2e-2,
           dtype)
