"""Sparse MLA decode attention over the KV rows named by a top-k list.

Contract (both implementations):

``sparse_mla(q_nope[B, H, Dc], q_pe[B, H, Dr], kv[S, Dc + Dr], topk[B, K] int32|int64, sm_scale,
kv_scale=None) -> (out[B, H, Dc] (dtype of q_nope), lse[B, H] float32)``

For each row ``b`` and head ``h``: ``score_j = sm_scale * (q_nope[b, h] . kv[j, :Dc] + q_pe[b, h] .
kv[j, Dc:])`` over the entries ``j`` of ``topk[b]`` that are ``>= 0`` (negative entries are
skipped; each entry counts as one key, duplicates are not expected), ``out = softmax(score) @
kv[j, :Dc]`` and ``lse = log(sum_j exp(score_j))`` (natural log). Accumulated in fp32 (the Triton
kernel's tensor-core dots take bf16/fp16 operands for such inputs, P included). An entry ``>= S``
is a contract violation: the reference raises, the Triton kernel skips it rather than read out
of bounds.

Non-finite values (the rule every implementation follows):

- A row with no valid entry gives ``out = 0`` and ``lse = -inf`` (empty), whatever its query
  holds. KV rows the top-k does not name are never read: NaN or inf there changes nothing.
- Otherwise the row is the dense softmax over the named rows, as torch computes it in fp64
  (``torch.logsumexp``, ``torch.softmax(score) @ V``), NaN and infinities included: a NaN in the
  query or in a named KV row gives NaN ``out`` and NaN ``lse`` (never "empty"); a score of
  ``+inf`` gives NaN ``out`` and ``lse = +inf``; keys scoring ``-inf`` get weight 0, and ``0 * inf``
  in their values is NaN in those columns; a row whose every named key scores ``-inf`` gives NaN
  ``out`` and ``lse = -inf``. (Scores are infinite only when KV or the query holds an infinity.)
- Split-K partials are merged by ``lse_combine``, where ``lse = -inf`` marks an empty partial:
  a K split whose every key scores ``-inf`` drops out of the merge (docs/ops.md, "NaN and
  infinities").

FP8 KV: ``kv`` may be ``float8_e4m3fn`` with one per-tensor fp32 ``kv_scale`` (every column,
latent and rope alike, is stored as ``kv_real / kv_scale`` rounded to E4M3; 576 bytes a token at
Dc + Dr = 576). The kernel reads the FP8 bytes, widens them in registers (to fp16 for the tensor
cores) and applies the scale once to the scores and once to the output, so no dequantized copy
exists.
``kv_scale`` is required for FP8 KV and refused for any other KV dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._common import (
    TRITON_FLOAT_DTYPES,
    cdiv,
    check_float,
    check_index,
    check_launchable,
    check_same_device,
    is_interpreted,
    last_dim_contiguous,
    max_keep_nan,
    next_pow2,
    sm_count,
)
from . import dispatch
from .kv_store import FP8_GROUP, check_scales
from .lse_combine import lse_combine_triton

_OP = "sparse_mla"


FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def _check(q_nope, q_pe, kv, topk, sm_scale, kv_scale=None, block_scales=None) -> None:
    check_float(_OP, "q_nope", q_nope, 3)
    check_float(_OP, "q_pe", q_pe, 3)
    check_float(_OP, "kv", kv, 2)
    if kv.dtype in FP8_KV_DTYPES:
        if block_scales is None and (isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float))
                                     or not kv_scale > 0):
            raise ValueError(f"{_OP}: FP8 kv needs a positive Python float kv_scale, got {kv_scale!r}")
        check_scales(_OP, kv, kv_scale, block_scales, "kv")
        if q_nope.dtype in FP8_KV_DTYPES or q_pe.dtype in FP8_KV_DTYPES:
            raise ValueError(f"{_OP}: queries must be fp32, bf16 or fp16 (FP8 is for the KV cache only)")
    elif kv_scale is not None or block_scales is not None:
        raise ValueError(f"{_OP}: kv_scale is only for FP8 kv (block_scales too), got kv dtype {kv.dtype}")
    check_index(_OP, "topk", topk, 2)
    B, H, Dc = q_nope.shape
    if tuple(q_pe.shape[:2]) != (B, H):
        raise ValueError(f"{_OP}: q_pe must have shape [B={B}, H={H}, Dr], got {tuple(q_pe.shape)}")
    Dr = q_pe.shape[2]
    if kv.shape[1] != Dc + Dr:
        raise ValueError(f"{_OP}: kv must have Dc + Dr = {Dc} + {Dr} = {Dc + Dr} columns, got {tuple(kv.shape)}")
    if topk.shape[0] != B:
        raise ValueError(f"{_OP}: topk must have B={B} rows, got {tuple(topk.shape)}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"{_OP}: sm_scale must be a Python float, got {sm_scale!r}")
    check_same_device(_OP, q_nope=q_nope, q_pe=q_pe, kv=kv, topk=topk)


def sparse_mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    sm_scale: float,
    kv_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    block_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch sparse MLA (see module docstring): gather, dense softmax over the named rows.
    No host sync. FP8 KV with per-128-column ``block_scales`` (``dsa_dcp/kernels/kv_store.py``) is
    read here only: each gathered row is multiplied by its groups' scales.

    ``compute_dtype`` (fp32 by default, fp64 for tests) is the arithmetic precision; the LSE is
    returned as float32 either way. FP8 KV is dequantized (``* kv_scale``) after the gather.
    ``torch.logsumexp`` and ``torch.softmax`` give the non-finite cases their dense meaning.
    """
    _check(q_nope, q_pe, kv, topk, sm_scale, kv_scale, block_scales)
    Dc = q_nope.shape[2]
    idx = topk.to(torch.int64)
    valid = idx >= 0  # [B, K]
    rows = kv[idx.clamp(min=0)].to(compute_dtype)  # [B, K, Dc + Dr]
    if kv_scale is not None:
        rows = rows * kv_scale
    if block_scales is not None:  # [B, K, G] -> one scale per column
        scales = block_scales.view(block_scales.shape[0], -1)[idx.clamp(min=0)].to(compute_dtype)
        rows = rows * scales[..., torch.arange(kv.shape[1], device=kv.device) // FP8_GROUP]
    # skipped entries gathered row 0: zero them, or a NaN/inf there (an unwritten cache row)
    # would leak through 0 * NaN into the output
    rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=compute_dtype, device=rows.device))
    qn = q_nope.to(compute_dtype)
    qp = q_pe.to(compute_dtype)
    scores = torch.einsum("bhd,bkd->bhk", qn, rows[..., :Dc]) + torch.einsum("bhd,bkd->bhk", qp, rows[..., Dc:])
    scores = scores * sm_scale
    neg_inf = torch.full((), float("-inf"), dtype=compute_dtype, device=scores.device)
    scores = torch.where(valid[:, None, :], scores, neg_inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row without valid entries
    out = torch.einsum("bhk,bkd->bhd", torch.softmax(scores, dim=-1), rows[..., :Dc])
    # a row with no valid entry is empty (its softmax is 0/0); every other row keeps its NaN
    has = valid.any(dim=-1)[:, None, None]
    out = torch.where(has, out, torch.zeros((), dtype=compute_dtype, device=out.device))
    return out.to(q_nope.dtype), lse.to(torch.float32)


@triton.jit
def _mma(a, b, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    """A tensor-core product, fp32 accumulation: full fp32 products (not tf32) for fp32 operands
    (DOT_IEEE), else operands in DOT_DTYPE."""
    if DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    """``q[BLOCK_H, D] @ k[BLOCK_K, D]^T``: on the tensor cores, or (tiny tiles) multiply and sum."""
    if USE_DOT:
        return _mma(q, tl.trans(k), DOT_DTYPE, DOT_IEEE)
    else:
        return tl.sum(q[:, None, :] * k[None, :, :], axis=2)


@triton.jit
def _operand(x, UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A loaded tile in the dtype the products take: fp32 under UPCAST (the interpreter, whose
    bf16 arithmetic is wrong, and the elementwise path, which would otherwise multiply and sum in
    bf16), else the dot dtype (a no-op for bf16/fp16 on bf16/fp16; FP8 KV is widened here)."""
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def _load_q(ptr, offs_h, in_h, cols, in_cols, stride_h, q_prescale, Q_PRESCALE: tl.constexpr,
            UPCAST: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A head block of queries, in the dtype the products take (:func:`_operand`: bf16/fp16
    queries on bf16/fp16 KV go to the products as loaded, so the compiler may keep them in shared
    memory); Q_PRESCALE (FP8 KV with bf16 queries, see the launcher) scales them in fp32 first."""
    q = tl.load(ptr + offs_h[:, None] * stride_h + cols[None, :], mask=in_h[:, None] & in_cols[None, :], other=0.0)
    if Q_PRESCALE:
        q = q.to(tl.float32) * q_prescale
    return _operand(q, UPCAST, DOT_DTYPE)


@triton.jit
def _block_dequant(x, bs_row, cols, valid, in_cols, stride_bs_g):
    """FP8 tile ``x[BLOCK_K, cols]`` times each key's scale of each column's 128-column group (fp32)."""
    scale = tl.load(bs_row[:, None] + (cols[None, :] // 128) * stride_bs_g, mask=valid[:, None] & in_cols[None, :],
                    other=0.0)
    return x.to(tl.float32) * scale


@triton.jit
def _sparse_mla_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    pe_ptr,
    topk_ptr,
    out_ptr,
    lse_ptr,
    B,
    H,
    K,
    S,
    SPLIT_LEN,
    score_scale,
    out_scale,
    q_prescale,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_kv,
    stride_pe,
    stride_topk,
    bs_ptr,
    stride_bs,
    stride_bs_g,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DC_SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    KEY_MAJOR: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,  # FP8 KV with per-128-column scales (bs_ptr [S, G]): dequantized on load
):
    b = tl.program_id(0).to(tl.int64)
    # program_id(1) is (head block, latent part): with DC_SPLIT = 2 the two programs of a head
    # block each own half of the Dc output columns (and score with all of them)
    part = tl.program_id(1) % DC_SPLIT
    offs_h = (tl.program_id(1) // DC_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)  # this program's K range: [k_start, k_end)
    k_start = split * SPLIT_LEN
    k_end = tl.minimum(k_start + SPLIT_LEN, K)
    in_h = offs_h < H
    own = part * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the output columns (BLOCK_DV = padded Dc / DC_SPLIT)
    in_own = own < DC
    other = (1 - part) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the other half (DC_SPLIT = 2 only)
    in_other = other < DC
    offs_dr = tl.arange(0, BLOCK_DR)
    in_dr = offs_dr < DR

    # FP8 KV is widened in registers (_operand), its scale applied to the scores and the output,
    # never per element.
    q_row = q_nope_ptr + b * stride_qn_b
    qn = _load_q(q_row, offs_h, in_h, own, in_own, stride_qn_h, q_prescale, Q_PRESCALE, UPCAST, DOT_DTYPE)
    qp = _load_q(q_pe_ptr + b * stride_qp_b, offs_h, in_h, offs_dr, in_dr, stride_qp_h, q_prescale, Q_PRESCALE,
                 UPCAST, DOT_DTYPE)
    if DC_SPLIT == 2:
        qn_other = _load_q(q_row, offs_h, in_h, other, in_other, stride_qn_h, q_prescale, Q_PRESCALE, UPCAST,
                           DOT_DTYPE)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    seen = tl.zeros([BLOCK_K], dtype=tl.int32)  # lanes that held a valid key (tells -inf scores from none)
    if KEY_MAJOR:
        # keys as the rows of every product: scores^T = K q^T ([BLOCK_K, BLOCK_H]) and
        # acc^T = V^T p^T ([BLOCK_DV, BLOCK_H]), so the MMA's wide dimension is the key tile or
        # the latent, not a small head block (DC_SPLIT = 1: the launcher sees to it)
        qn_t = tl.trans(qn)
        qp_t = tl.trans(qp)
        acc = tl.zeros([BLOCK_DV, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(topk_ptr + b * stride_topk + offs_k, mask=offs_k < k_end, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < S)
        seen = seen | valid.to(tl.int32)
        kv_row = kv_ptr + tl.where(valid, idx, 0) * stride_kv
        pe_row = pe_ptr + tl.where(valid, idx, 0) * stride_pe  # the rope part: kv's own columns, or a second tensor
        kc = tl.load(kv_row[:, None] + own[None, :], mask=valid[:, None] & in_own[None, :], other=0.0)
        kr = tl.load(pe_row[:, None] + offs_dr[None, :], mask=valid[:, None] & in_dr[None, :], other=0.0)
        if BLOCK_SCALES:
            bs_row = bs_ptr + tl.where(valid, idx, 0) * stride_bs
            kc = _block_dequant(kc, bs_row, own, valid, in_own, stride_bs_g)
            kr = _block_dequant(kr, bs_row, DC + offs_dr, valid, in_dr, stride_bs_g)
        kc = _operand(kc, UPCAST, DOT_DTYPE)
        kr = _operand(kr, UPCAST, DOT_DTYPE)
        if KEY_MAJOR:  # (USE_DOT; the launcher sees to it)
            s_t = _mma(kc, qn_t, DOT_DTYPE, DOT_IEEE) + _mma(kr, qp_t, DOT_DTYPE, DOT_IEEE)
            s_t = tl.where(valid[:, None], s_t * score_scale, -float("inf"))
            m_new = max_keep_nan(m_i, tl.reduce(s_t, 0, max_keep_nan))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p_t = tl.exp(s_t - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(p_t, axis=0)
            acc = acc * alpha[None, :] + _mma(tl.trans(kc), p_t, DOT_DTYPE, DOT_IEEE)
            m_i = m_new
        else:
            s = _scores(qn, kc, USE_DOT, DOT_DTYPE, DOT_IEEE) + _scores(qp, kr, USE_DOT, DOT_DTYPE, DOT_IEEE)
            if DC_SPLIT == 2:
                # the other half of the latent: scored here, its values left to the other program
                ko = tl.load(kv_row[:, None] + other[None, :], mask=valid[:, None] & in_other[None, :], other=0.0)
                if BLOCK_SCALES:
                    ko = _block_dequant(ko, bs_row, other, valid, in_other, stride_bs_g)
                s += _scores(qn_other, _operand(ko, UPCAST, DOT_DTYPE), USE_DOT, DOT_DTYPE, DOT_IEEE)
            s = tl.where(valid[None, :], s * score_scale, -float("inf"))
            m_new = max_keep_nan(m_i, tl.reduce(s, 1, max_keep_nan))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no (-inf) - (-inf) before a valid key
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                pv = _mma(p, kc, DOT_DTYPE, DOT_IEEE)
            else:
                pv = tl.sum(p[:, :, None] * kc[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    # l_i == 0: no key carried weight (no valid key, or every valid one scored -inf): lse = -inf.
    # A NaN l_i (NaN or +inf scores) is not 0, so NaN and +inf reach out and lse as they are.
    zero = l_i == 0.0
    denom = tl.where(zero, 1.0, l_i)
    # every valid key scored -inf: the dense softmax is 0/0 = NaN; with no valid key the row is empty (out = 0)
    nan_out = zero & (tl.max(seen, axis=0) > 0)
    scale_h = tl.where(nan_out, float("nan"), out_scale / denom)
    # out is [splits, B, H, DC] and lse [splits, B, H]: the layout lse_combine merges
    out_row = (split.to(tl.int64) * B + b) * H + offs_h
    if KEY_MAJOR:
        out = acc * scale_h[None, :]
        tl.store(
            out_ptr + out_row[None, :] * DC + own[:, None],
            out.to(out_ptr.dtype.element_ty),
            mask=in_h[None, :] & in_own[:, None],
        )
    else:
        out = acc * scale_h[:, None]  # acc is 0 for a row without keys
        tl.store(
            out_ptr + out_row[:, None] * DC + own[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=in_h[:, None] & in_own[None, :],
        )
    if part == 0:  # one program of the head block writes the LSE
        lse = tl.where(m_i == float("inf"), float("inf"), m_i + tl.log(denom))  # +inf - +inf is NaN: keep +inf
        tl.store(lse_ptr + out_row, tl.where(zero, -float("inf"), lse), mask=in_h)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
def _default_tiles(B: int, H: int, device: torch.device) -> tuple[int, int, int]:
    """(block_h, block_k, num_warps), from a sweep on one H200 at Dc=512, Dr=64, K=2048, bf16."""
    if device.type != "cuda":
        return 16, 64, 4
    if B * H <= 128:
        return 16, 64, 8
    if H >= 128 or B * H >= 8192:
        return 64, 32, 8
    return 32, 64, 8


def _default_splits(programs: int, K: int, block_k: int, device: torch.device) -> int:
    """Split K when the grid would fill under half the GPU; each split keeps two K tiles or more.

    (At half a wave or more, the fp32 partials and the extra combine cost more than they gain.)
    """
    sms = sm_count(device)
    if 2 * programs > sms:
        return 1
    return max(1, min(cdiv(sms, programs), K // (2 * block_k)))


def sparse_mla_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    sm_scale: float,
    kv_scale: float | None = None,
    *,
    block_scales: torch.Tensor | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    key_major: bool | None = None,
    dc_split: int | None = None,
    pe: torch.Tensor | None = None,
    fit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton sparse MLA decode (see module docstring); grid (B, ceil(H / BLOCK_H) * dc_split, splits).

    ``pe`` (``[S, Dr]``): the rope part of every slot in a tensor of its own, ``kv`` then ``[S, Dc]``
    (models that cache the latent and its rope apart: ``sparse_mla_positions``).

    Online softmax over K in tiles of ``block_k``: gather the tile's KV rows, score the head
    block, keep a running max and sum and an fp32 ``acc[BLOCK_H, Dc]``. Tensor-core ``tl.dot`` is
    used when ``block_h`` and ``block_k`` are both >= 16 (always, by default), else an elementwise
    multiply-and-sum. With ``num_splits > 1`` (flash-decoding) each program takes one contiguous
    range of K, writes an fp32 partial ``(out, lse)``, and :func:`lse_combine_triton` merges the
    splits; by default K is split only when ``B * ceil(H / block_h)`` programs would not fill the
    GPU. Any H, K, Dc, Dr (Dc and Dr are padded to powers of two). ``q_nope``/``q_pe``/``kv`` may
    be views with a unit last stride (the KV cache is never copied). FP8 KV (``kv_scale``) is
    read as FP8 and widened in registers. ``key_major`` computes the transposed products
    (``scores^T = K q^T``, ``acc^T = V^T p^T``: the key tile and the latent are the MMA's wide
    dimensions, the head block its narrow one); it needs the tensor-core path. ``dc_split=2``
    gives each head block two programs, each owning half of the Dc output columns (an fp32
    accumulator half the size) and each computing the whole score tile (the score product is
    done twice). No host sync.

    ``fit``: tiles that need more shared memory than the device has (the measured table's tiles
    are for 16-bit queries; fp32 queries over FP8 KV widen both operands to fp32) are shrunk, one
    pipeline stage at a time down to one, then by halving ``block_k`` down to 16: the same result,
    slower. ``fit=False`` raises Triton's ``OutOfResources`` instead (tile sweeps).
    """
    if pe is not None:  # checked as the pool [S, Dc + Dr] they are together
        if pe.dim() != 2 or kv.dim() != 2 or pe.shape[0] != kv.shape[0] or pe.dtype != kv.dtype \
                or kv.dtype in FP8_KV_DTYPES:
            raise ValueError(f"{_OP}: a separate pe must be [S, Dr] beside kv [S, Dc], one dtype (not FP8); got "
                             f"kv {kv.dtype} {tuple(kv.shape)}, pe {pe.dtype} {tuple(pe.shape)}")
        _check(q_nope, q_pe, torch.empty((0, kv.shape[1] + pe.shape[1]), dtype=kv.dtype, device=kv.device), topk,
               sm_scale, kv_scale)
    else:
        _check(q_nope, q_pe, kv, topk, sm_scale, kv_scale, block_scales)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv", kv)):
        if t.dtype not in TRITON_FLOAT_DTYPES + (FP8_KV_DTYPES if name == "kv" else ()):
            raise ValueError(f"{_OP}: {name} dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {t.dtype}")
    B, H, Dc = q_nope.shape
    Dr = q_pe.shape[2]
    K = topk.shape[1]
    device = q_nope.device
    if B == 0 or H == 0 or K == 0:
        out = torch.zeros((B, H, Dc), dtype=q_nope.dtype, device=device)
        return out, torch.full((B, H), float("-inf"), dtype=torch.float32, device=device)
    check_launchable(_sparse_mla_kernel, q_nope, q_pe, kv, topk)
    tiles = {}
    if device.type == "cuda" and all(v is None for v in (block_h, block_k, num_warps, num_stages, num_splits, key_major,
                                                         dc_split)):
        choice = dispatch.choose(H, B, K, kv.dtype, device)  # tiles measured for this shape, if any
        tiles = choice.tiles if choice is not None else {}
    tile_h, tile_k, warps = _default_tiles(B, H, device)
    bh = block_h or tiles.get("block_h") or tile_h
    bk = block_k or tiles.get("block_k") or tile_k
    warps = num_warps or tiles.get("num_warps") or warps
    num_stages = num_stages or tiles.get("num_stages")
    num_splits = num_splits or tiles.get("num_splits")
    key_major = bool(tiles.get("key_major", False) if key_major is None else key_major)
    dc_split = dc_split or tiles.get("dc_split") or 1
    for name, v in (("block_h", bh), ("block_k", bk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{_OP}: {name} must be a power of two, got {v}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{_OP}: num_splits must be >= 1, got {num_splits}")
    if dc_split not in (1, 2):
        raise ValueError(f"{_OP}: dc_split must be 1 or 2, got {dc_split}")
    if dc_split == 2 and key_major:
        raise ValueError(f"{_OP}: dc_split=2 is for the head-major products, not key_major")
    asked = (num_stages or 3, bk)
    # the tiles that fit, remembered so an oversize request fails once, not on every call
    key = (asked, bh, warps, key_major, dc_split, q_nope.dtype, kv.dtype, block_scales is not None,
           q_nope.shape[2], q_pe.shape[2], device)
    stages, bk = _FITTED.get(key, asked) if fit else asked
    while True:
        try:
            out = _launch_sparse_mla(q_nope, q_pe, kv, pe, topk, sm_scale, kv_scale, block_scales, bh, bk, warps,
                                     stages, num_splits, key_major, dc_split)
        except OutOfResources:
            if not fit or (stages == 1 and bk <= 16):
                raise
            stages, bk = (stages - 1, bk) if stages > 1 else (stages, bk // 2)
            continue
        if (stages, bk) != asked:
            _FITTED[key] = (stages, bk)
        return out


_FITTED: dict = {}  # sparse_mla_triton's shrunk tiles: launch key -> (num_stages, block_k) that fit


def _launch_sparse_mla(q_nope, q_pe, kv, pe, topk, sm_scale, kv_scale, block_scales, bh, bk, warps, num_stages,
                       num_splits, key_major, dc_split):
    """One launch of :func:`sparse_mla_triton` with its tiles settled."""
    B, H, Dc = q_nope.shape
    Dr = q_pe.shape[2]
    K = topk.shape[1]
    device = q_nope.device
    head_blocks = cdiv(H, bh)
    splits = num_splits or _default_splits(B * head_blocks * dc_split, K, bk, device)
    split_len = cdiv(cdiv(K, splits), bk) * bk  # whole K tiles per split
    splits = cdiv(K, split_len)
    use_dot = bh >= 16 and bk >= 16
    if key_major and not use_dot:
        raise ValueError(f"{_OP}: key_major needs the tensor-core path (block_h and block_k >= 16), got {bh} x {bk}")
    # tl.dot wants every dim >= 16
    block_dv = max(next_pow2(Dc) // dc_split, 16 if use_dot else 1)
    block_dr = max(next_pow2(Dr), 16 if use_dot else 1)
    # tensor-core operands in the query dtype when the KV matches it. FP8 KV is widened to fp16
    # (one instruction per two values, where bf16 takes several), and bf16 queries go to fp16
    # scaled by 2^-8 (undone in the score scale): fp16 then holds |q| up to 2^24 without
    # overflow, and only |q| below about 1.5e-5 loses precision, which no score can notice.
    same = q_nope.dtype == q_pe.dtype and (kv.dtype == q_nope.dtype or kv.dtype in FP8_KV_DTYPES)
    interpreted = is_interpreted(_sparse_mla_kernel)
    q_prescale = 1.0
    if interpreted or not same or q_nope.dtype == torch.float32:
        dot_dtype = tl.float32
    elif kv.dtype in FP8_KV_DTYPES:
        dot_dtype = tl.float16
        q_prescale = 1.0 if q_nope.dtype == torch.float16 else 2.0**-8
    else:
        dot_dtype = _TL_DTYPES[q_nope.dtype]
    scale = 1.0 if kv_scale is None else float(kv_scale)
    q_nope = last_dim_contiguous(q_nope)
    q_pe = last_dim_contiguous(q_pe)
    kv = last_dim_contiguous(kv)
    pe = kv[:, Dc:] if pe is None else last_dim_contiguous(pe)
    topk = topk.contiguous()
    # one split writes the result itself; several write fp32 partials for lse_combine
    # (no leading split dim for one split: the results are then fresh tensors, not views)
    lead = () if splits == 1 else (splits,)
    out = torch.empty(lead + (B, H, Dc), dtype=q_nope.dtype if splits == 1 else torch.float32, device=device)
    lse = torch.empty(lead + (B, H), dtype=torch.float32, device=device)
    _sparse_mla_kernel[(B, head_blocks * dc_split, splits)](
        q_nope, q_pe, kv, pe, topk, out, lse,
        B, H, K, kv.shape[0], split_len, float(sm_scale) * scale / q_prescale, scale, q_prescale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), pe.stride(0),
        topk.stride(0),
        block_scales if block_scales is not None else topk,  # a placeholder pointer when unused
        block_scales.stride(0) if block_scales is not None else 0,
        block_scales.stride(-1) if block_scales is not None else 0,
        DC=Dc, DR=Dr, BLOCK_H=bh, BLOCK_K=bk, BLOCK_DV=block_dv, BLOCK_DR=block_dr, DC_SPLIT=dc_split,
        USE_DOT=use_dot, DOT_DTYPE=dot_dtype, DOT_IEEE=bool(dot_dtype == tl.float32),
        UPCAST=interpreted or not use_dot, Q_PRESCALE=q_prescale != 1.0, KEY_MAJOR=key_major,
        BLOCK_SCALES=block_scales is not None, num_warps=warps, num_stages=num_stages,
    )  # fmt: skip
    if splits == 1:
        return out, lse
    return lse_combine_triton(out, lse, out_dtype=q_nope.dtype)
