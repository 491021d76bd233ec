"""Sparse attention over position caches (``dsa_dcp.ops_positions``): the Triton kernels.

``sparse_mha_positions(q_nope[R, H, Dn], q_pe[R, H, Dr], [k[B, H, T, Dn + Dr], v[B, H, T, Dv]],
topk[R, K], sm_scale) -> (out[R, H, Dv], lse[R, H])``: per-head attention of each row over the
flat slots ``b * T + p`` its top-k names (negative entries skipped), the contract and non-finite
rules of ``ops_positions.sparse_mha_positions_reference`` (float32 arithmetic, natural-log LSE,
an empty row ``(0, -inf)``, NaN in a query or a named row gives NaN ``out`` and ``lse``, a row
whose named keys all score ``-inf`` too). Entries past the pool are skipped, never read.

One program takes one (row, head, K range): it gathers the named positions' K rows of its head
(one contiguous row each), scores them against the query, keeps a running max and sum and an fp32
``acc[Dv]`` over its V rows. The caches are read in place (any strides, unit last stride), so the
bytes a row costs are its top-k's K and V rows, not the context's. When ``R * H`` programs would
not fill the GPU, K is split (flash-decoding) and ``lse_combine`` merges the fp32 partials.

``sparse_mla_positions`` needs no kernel of its own: its caches ``kv[B, T, Dc]`` and
``pe[B, T, Dr]`` are the slot pool ``[B * T, ...]`` of ``sparse_mla``, whose Triton kernel reads the
rope part from a second tensor (``sparse_mla_positions_triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_launchable, is_interpreted, last_dim_contiguous, max_keep_nan, next_pow2, sm_count
from .lse_combine import lse_combine_triton
from .sparse_mla import sparse_mla_triton


@triton.jit
def _sparse_mha_positions_kernel(
    q_nope_ptr, q_pe_ptr, k_ptr, v_ptr, topk_ptr, out_ptr, lse_ptr,
    R, H, K, T, SLOTS, SPLIT_LEN, scale,
    s_qn_r, s_qn_h, s_qp_r, s_qp_h,
    s_k_b, s_k_h, s_k_t, s_v_b, s_v_h, s_v_t, s_topk,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    k_start = split * SPLIT_LEN
    k_end = tl.minimum(k_start + SPLIT_LEN, K)
    offs_d = tl.arange(0, BLOCK_DK)
    in_nope = offs_d < DN
    in_rope = (offs_d >= DN) & (offs_d < DN + DR)
    # the query as one [Dn + Dr] vector, like the cached key row; fp32 after loading (the
    # interpreter's bf16 arithmetic is wrong, and the products are accumulated in fp32 anyway)
    q = tl.load(q_nope_ptr + r * s_qn_r + h * s_qn_h + offs_d, mask=in_nope, other=0.0).to(tl.float32)
    q += tl.load(q_pe_ptr + r * s_qp_r + h * s_qp_h + (offs_d - DN), mask=in_rope, other=0.0).to(tl.float32)
    offs_v = tl.arange(0, BLOCK_DV)
    in_v = offs_v < DV
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    seen = tl.full([], 0, tl.int32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(topk_ptr + r * s_topk + offs_k, mask=offs_k < k_end, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < SLOTS)
        idx = tl.where(valid, idx, 0)
        b = idx // T
        p = idx % T
        k_row = k_ptr + b * s_k_b + h * s_k_h + p * s_k_t
        keys = tl.load(k_row[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d < DN + DR)[None, :],
                       other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(keys * q[None, :], axis=1) * scale, -float("inf"))
        m_new = max_keep_nan(m_i, tl.reduce(s, 0, max_keep_nan))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no (-inf) - (-inf) before a valid key
        alpha = tl.exp(m_i - m_safe)
        weights = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(weights, axis=0)
        v_row = v_ptr + b * s_v_b + h * s_v_h + p * s_v_t
        values = tl.load(v_row[:, None] + offs_v[None, :], mask=valid[:, None] & in_v[None, :],
                         other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(weights[:, None] * values, axis=0)
        m_i = m_new
        seen = seen | tl.max(valid.to(tl.int32), axis=0)
    # no valid key: empty (0, -inf). Valid keys that all scored -inf: the dense softmax's 0/0 (NaN).
    # NaN or +inf scores made l_i NaN, which reaches out and lse as it is.
    empty = seen == 0
    nan_row = (seen > 0) & (l_i == 0.0)
    denom = tl.where(empty | nan_row, 1.0, l_i)
    out = tl.where(nan_row, float("nan"), acc / denom)
    lse = tl.where(empty, -float("inf"), tl.where(nan_row, float("nan"), m_i + tl.log(denom)))
    row = (split.to(tl.int64) * R + r) * H + h  # out [splits, R, H, Dv], lse [splits, R, H]
    tl.store(out_ptr + row * DV + offs_v, out.to(out_ptr.dtype.element_ty), mask=in_v)
    tl.store(lse_ptr + row, lse)


def _splits(programs: int, K: int, block_k: int, device: torch.device) -> int:
    """Split K when the grid would fill under half the GPU; each split keeps two K tiles or more."""
    sms = sm_count(device)
    if 2 * programs > sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), K // (2 * block_k)))


def sparse_mha_positions_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, caches: list[torch.Tensor],
                                topk: torch.Tensor, sm_scale: float, *, block_k: int | None = None,
                                num_splits: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``sparse_mha_positions`` (module docstring); the caller checked the shapes
    (``ops_positions._check_attention``). Grid (R, H, splits). No host sync."""
    k, v = caches
    R, H, Dn = q_nope.shape
    Dr, Dv, K = q_pe.shape[2], v.shape[3], topk.shape[1]
    B, T = k.shape[0], k.shape[2]
    device = q_nope.device
    if R == 0 or H == 0 or K == 0:
        return (torch.zeros((R, H, Dv), dtype=q_nope.dtype, device=device),
                torch.full((R, H), float("-inf"), dtype=torch.float32, device=device))
    check_launchable(_sparse_mha_positions_kernel, q_nope, q_pe, k, v, topk)
    q_nope, q_pe, k, v = (last_dim_contiguous(t) for t in (q_nope, q_pe, k, v))
    topk = topk.contiguous()
    bk = block_k or (16 if is_interpreted(_sparse_mha_positions_kernel) else 32)
    splits = num_splits or _splits(R * H, K, bk, device)
    split_len = cdiv(cdiv(K, splits), bk) * bk  # whole K tiles per split
    splits = cdiv(K, split_len)
    lead = () if splits == 1 else (splits,)
    out = torch.empty(lead + (R, H, Dv), dtype=q_nope.dtype if splits == 1 else torch.float32, device=device)
    lse = torch.empty(lead + (R, H), dtype=torch.float32, device=device)
    _sparse_mha_positions_kernel[(R, H, splits)](
        q_nope, q_pe, k, v, topk, out, lse,
        R, H, K, T, B * T, split_len, float(sm_scale),
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), topk.stride(0),
        DN=Dn, DR=Dr, DV=Dv, BLOCK_K=bk, BLOCK_DK=next_pow2(Dn + Dr), BLOCK_DV=next_pow2(Dv),
        num_warps=num_warps,
    )  # fmt: skip
    if splits == 1:
        return out, lse
    return lse_combine_triton(out, lse, out_dtype=q_nope.dtype)


def sparse_mla_positions_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, caches: list[torch.Tensor],
                                topk: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``sparse_mla_positions``: ``sparse_mla``'s kernel over the caches seen as the slot pool
    ``[B * T, D]`` (views: each cache's batch rows must be ``T`` rows apart, as allocated)."""
    kv, pe = caches
    flat = [c.reshape(c.shape[0] * c.shape[1], c.shape[2]) for c in (kv, pe)]  # views for allocated caches
    return sparse_mla_triton(q_nope, q_pe, flat[0], topk, sm_scale, pe=flat[1])
