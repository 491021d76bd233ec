"""The lightning indexer's scores: every candidate of a row scored against its query heads, keys read
through the page table on the tensor cores.

Contract (both implementations; ``-1`` or any negative id means "no page / no slot"):

``index_scores(q[T, Hi, Di], w[T, Hi], index_cache[S, Di], key_scale, page_table[R, MP],
req_ids[T], positions[T], page_size P) -> scores[T, C] float32`` with ``C = MP * P``

    Row ``t`` belongs to request ``req_ids[t]``; its candidate ``p`` in ``[0, C)`` is the slot
    ``page_table[req, p // P] * P + p % P`` and is valid iff ``p <= positions[t]`` and that
    page is ``>= 0`` (a negative ``req_ids[t]`` makes every candidate of the row invalid; an id
    ``>= R`` is a contract violation: the reference raises, the kernels treat it as negative).
    ``scores[t, p] = sum_h w[t, h] * relu(q[t, h] . k[slot])`` for valid ``p``, ``-inf``
    otherwise; NaN in a valid key, a query or a weight propagates (``relu(NaN) = NaN``), as in
    the model. Keys are bf16/fp16/fp32 rows, or FP8 E4M3 rows with an fp32 ``key_scale``:
    shape ``[S]`` (one scale per row: the 132-byte-a-token layout, 128 e4m3 bytes + one fp32)
    or ``[]``/``[1]`` (per tensor); the key is ``k_e4m3.float() * scale``. ``key_scale`` is
    required for FP8 keys and refused otherwise. Queries are fp32/bf16/fp16, or, with FP8 keys
    only, FP8 E4M3 (``q_e4m3.float()``: the caller folds each query's scale into ``w``, as
    DeepSeek-V3.2's inference does); the products then go to ``tl.dot`` as E4M3 x E4M3 (on sm_90 Triton widens both to fp16 for
    a warp's mma.sync: exact products, fp32 sums; docs/kernels.md). A slot ``>= S`` is a contract violation (the
    reference raises; the kernel treats the candidate as invalid rather than read out of bounds).

``index_scores(..., shard=(N, r, I))`` (the op ``index_scores_sharded``: the sharded index cache,
where each rank holds the index keys of the slots it owns, :mod:`.topk_agree`)
    ``index_cache`` holds rank ``r``'s rows (``local_row(slot)``); a candidate is valid as above
    and owned by ``r``; every other candidate is ``-inf``. Owned scores are bit-identical to the
    replicated cache's at the same ``block_c`` and by default (the same arithmetic on the same
    tiles, with the same keys).

Tolerance: the kernel sums the products on tensor cores (bf16/fp16 operands are exact in the fp32
products, FP8 keys are widened exactly) in another order than the reference;
``|kernel - exact| <= 1e-5 * sum_h |w_h| * sum_d |q_hd * k_d|`` (one ulp of fp32 per term
summed, with a margin; FP8 x FP8 products are exact in fp32 and the kernel moves them into its
fp32 sum every 16 terms), plus, for FP8 keys with bf16 queries (whose products run in fp16 with
the queries scaled by 2^-8), ``2^-17 * sum_h |w_h| * sum_d |k_d|`` for query entries below
2^-6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsa_dcp.slots import local_row, owner

from ._common import (
    TRITON_FLOAT_DTYPES,
    cdiv,
    check_float,
    check_index,
    check_int,
    check_launchable,
    check_remap_args,
    check_same_device,
    is_interpreted,
    last_dim_contiguous,
    next_pow2,
    sm_count,
)
from .topk_remap import _owned

FP8_KEY_DTYPES = (torch.float8_e4m3fn,)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

_SCORES = "index_scores"

# Registers a thread for the gather kernel's E4M3 products (ptxas's maxnreg). Uncapped, its
# 128 x 4-warp tile takes 119 (four programs an SM); at 96 five fit and nothing spills. On an H100
# (docs/benchmarks.md) no cap took 1.10-1.12x the time of 96 from batch 8 / 32K to 128 / 32K, 80
# gained less, 64 and 72 were slower than no cap; bf16 keys (62 registers, bound by shared memory)
# gained nothing.
FP8_MAX_REGISTERS = 96


def _check_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size) -> None:
    check_float(_SCORES, "q", q, 3)
    check_float(_SCORES, "w", w, 2)
    check_float(_SCORES, "index_cache", index_cache, 2)
    check_index(_SCORES, "page_table", page_table, 2)
    check_index(_SCORES, "req_ids", req_ids, 1)
    check_index(_SCORES, "positions", positions, 1)
    check_int(_SCORES, "page_size", page_size, 1)
    T, Hi, Di = q.shape
    if tuple(w.shape) != (T, Hi):
        raise ValueError(f"{_SCORES}: w must be [T, Hi] = [{T}, {Hi}], got {tuple(w.shape)}")
    if index_cache.shape[1] != Di:
        raise ValueError(f"{_SCORES}: index_cache must be [S, Di] with Di = {Di}, got {tuple(index_cache.shape)}")
    if req_ids.shape[0] != T or positions.shape[0] != T:
        raise ValueError(
            f"{_SCORES}: req_ids and positions must have T = {T} entries, got {tuple(req_ids.shape)} and "
            f"{tuple(positions.shape)}"
        )
    if w.dtype in FP8_KEY_DTYPES:
        raise ValueError(f"{_SCORES}: w must be fp32, bf16 or fp16, got {w.dtype}")
    if q.dtype in FP8_KEY_DTYPES and index_cache.dtype not in FP8_KEY_DTYPES:
        raise ValueError(f"{_SCORES}: FP8 queries are for FP8 index keys only, got keys {index_cache.dtype}")
    if index_cache.dtype in FP8_KEY_DTYPES:
        S = index_cache.shape[0]
        if not isinstance(key_scale, torch.Tensor) or key_scale.dtype != torch.float32:
            raise ValueError(f"{_SCORES}: FP8 index keys need an fp32 key_scale tensor, got {key_scale!r}")
        if tuple(key_scale.shape) not in ((), (1,), (S,)):
            raise ValueError(
                f"{_SCORES}: key_scale must be [S] = [{S}] (per row) or [] / [1] (per tensor), got "
                f"{tuple(key_scale.shape)}"
            )
        check_same_device(_SCORES, index_cache=index_cache, key_scale=key_scale)
    elif key_scale is not None:
        raise ValueError(f"{_SCORES}: key_scale is only for FP8 index keys, got key dtype {index_cache.dtype}")
    check_same_device(_SCORES, q=q, w=w, index_cache=index_cache, page_table=page_table, req_ids=req_ids,
                      positions=positions)  # fmt: skip


def candidate_slots(page_table: torch.Tensor, req_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[T, C]`` int64: the slot of every candidate of every row (negative: no slot)."""
    req = req_ids.to(torch.int64)
    R, MP = page_table.shape
    if R == 0:
        pages = torch.full((req.shape[0], MP), -1, dtype=torch.int64, device=page_table.device)
    else:
        pages = page_table.to(torch.int64).index_select(0, req.clamp(min=0))
    pages = torch.where((req >= 0)[:, None], pages, torch.full_like(pages, -1))
    offs = torch.arange(page_size, device=pages.device)
    cand = (pages[:, :, None] * page_size + offs).flatten(1)
    # a negative page gives negative slots for every offset; name them all -1
    return torch.where(cand >= 0, cand, torch.full_like(cand, -1))


def index_scores_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    compute_dtype: torch.dtype = torch.float32,
    *,
    shard: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The model's composition (see module docstring): gather every candidate's key, einsum,
    relu, head-weighted einsum, mask. ``compute_dtype`` (fp32 as the model, fp64 for tests) is
    the arithmetic precision; the result is float32. No host sync.

    ``shard = (N, r, I)``: the sharded form (``index_scores_sharded``): ``index_cache`` holds rank
    ``r``'s rows only, the candidates ``r`` owns are scored from their local rows and every other
    candidate is ``-inf``. The same arithmetic on the same shapes, so an owned candidate's score is
    bit-identical to the replicated cache's."""
    _check_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)
    if shard is not None:
        check_remap_args(*shard, "index_scores_sharded")
    cand = candidate_slots(page_table, req_ids, page_size)  # [T, C]
    C = cand.shape[1]
    p = torch.arange(C, device=cand.device)
    valid = (p[None, :] <= positions.to(torch.int64)[:, None]) & (cand >= 0)
    rows = cand.clamp(min=0)
    if shard is not None:
        n, rank, interleave = shard
        valid = valid & (owner(rows, n, interleave) == rank)
        rows = torch.where(valid, local_row(rows, n, interleave), torch.zeros_like(rows))
    keys = index_cache[rows].to(compute_dtype)  # [T, C, Di]
    if key_scale is not None:
        scale = key_scale.to(compute_dtype)
        keys = keys * (scale[rows][..., None] if scale.dim() == 1 and scale.shape[0] > 1 else scale.reshape(()))
    logits = torch.einsum("thd,tcd->thc", q.to(compute_dtype), keys).relu()
    score = torch.einsum("thc,th->tc", logits, w.to(compute_dtype))
    return score.masked_fill(~valid, float("-inf")).to(torch.float32)


@triton.jit
def _store_scores(s, w, in_h, H, valid, slot, ks_ptr, scale, q_prescale, out_ptrs, out_mask,
                  KEY_SCALE: tl.constexpr, BLOCK_H: tl.constexpr):
    """A tile's epilogue, ``s`` its ``[candidates, heads]`` products: the key scale, relu, the head
    weights, the sum over heads, ``-inf`` where invalid, stored."""
    if KEY_SCALE == 1:
        s = s * scale
    elif KEY_SCALE == 2:
        row_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0).to(tl.float32) / q_prescale
        s = s * row_scale[:, None]
    # relu that keeps NaN (one max.NaN instruction; a plain max(NaN, 0) may give 0); padding heads add exact zeros
    contrib = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    if BLOCK_H != H:
        contrib = tl.where(in_h[None, :], contrib, 0.0)
    score = tl.sum(contrib, axis=1)
    tl.store(out_ptrs, tl.where(valid, score, float("-inf")), mask=out_mask)


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    pt_ptr,
    req_ptr,
    pos_ptr,
    out_ptr,
    H,
    D,
    C,
    S,
    R,
    SPAN,
    q_prescale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_k,
    stride_pt,
    stride_ot,
    RANK,
    PAGE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    """Grid (T, ceil(C / SPAN)): program (t, j) scores candidates [j*SPAN, (j+1)*SPAN) of row t.

    The row's queries and weights are loaded once; each BLOCK_C candidates: slots through the
    page table, one gathered [BLOCK_C, Di] key tile, ``k @ q^T`` on the tensor cores (keys as
    the MMA's wide side, heads its narrow one), relu and the head-weighted sum in registers.
    KEY_SCALE: 0 none, 1 per tensor, 2 per key row (applied to the products, before the relu).
    DCP_SIZE > 1 (sharded cache): only the candidates rank RANK owns are valid, read at their local rows.
    """
    t = tl.program_id(0).to(tl.int64)
    c_lo = tl.program_id(1) * SPAN
    c_hi = tl.minimum(c_lo + SPAN, C)
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    in_h = offs_h < H
    in_d = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=in_h[:, None] & in_d[None, :], other=0.0)  # fmt: skip
    if Q_PRESCALE:  # bf16 queries against FP8 keys (see the launcher)
        q = q.to(tl.float32) * q_prescale
    if UPCAST:
        q_t = tl.trans(q.to(tl.float32))
    else:
        q_t = tl.trans(q.to(DOT_DTYPE))
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=in_h, other=0.0).to(tl.float32)
    scale = 1.0
    if KEY_SCALE == 1:
        scale = tl.load(ks_ptr).to(tl.float32) / q_prescale
    page_row = pt_ptr + tl.minimum(tl.maximum(req, 0), R - 1) * stride_pt
    for c0 in range(c_lo, c_hi, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        live = (offs_c < c_hi) & (offs_c <= pos)
        live = tl.where((req >= 0) & (req < R), live, False)
        page = tl.load(page_row + offs_c // PAGE, mask=live, other=-1).to(tl.int64)
        slot = page * PAGE + offs_c % PAGE
        valid = live & (page >= 0)
        if DCP_SIZE > 1:
            keep, row = _owned(slot, DCP_SIZE, RANK, INTERLEAVE)
            valid = valid & keep
            slot = row
        valid = valid & (slot < S)  # invalid slots stay unclamped: every read of them is masked by `valid`
        # (a clamp here, as a select or a product, fails Triton 3.6's layout pass for the sharded cache
        # at interleave >= 16 with 64-candidate tiles: docs/kernels.md)
        k = tl.load(k_ptr + slot[:, None] * stride_k + offs_d[None, :], mask=valid[:, None] & in_d[None, :], other=0.0)
        if UPCAST:
            s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
        elif DOT_IEEE:
            s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
        elif FP8_DOT:  # E4M3 x E4M3, exact products moved into the fp32 sum every 16 terms (under 32,
            # Triton's sm_90 lowering takes mma.sync on fp16, not FP8 wgmma: docs/kernels.md)
            s = tl.dot(k, q_t, max_num_imprecise_acc=16)
        else:
            s = tl.dot(k.to(DOT_DTYPE), q_t)
        _store_scores(s, w, in_h, H, valid, slot, ks_ptr, scale, q_prescale, out_ptr + t * stride_ot + offs_c,
                      offs_c < c_hi, KEY_SCALE, BLOCK_H)


@triton.jit
def _index_scores_pages_kernel(
    q_ptr,
    w_ptr,
    k_desc,
    ks_ptr,
    pt_ptr,
    req_ptr,
    pos_ptr,
    out_ptr,
    H,
    C,
    S,
    R,
    SPAN,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_pt,
    stride_ot,
    PAGE: tl.constexpr,
    PAGES: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The gather kernel's contract and grid for the replicated cache, the keys read a page at a
    time: a page's ``[PAGE, Di]`` rows are one block copy through ``k_desc`` (the tensor memory
    accelerator on Hopper: no per-row addresses in registers), PAGES pages a step. A negative
    page, or one past the cache, reads zeros (the copy's bounds) and scores ``-inf``. Each
    candidate's products and epilogue are the gather kernel's."""
    t = tl.program_id(0).to(tl.int64)
    c_lo = tl.program_id(1) * SPAN
    c_hi = tl.minimum(c_lo + SPAN, C)
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    in_h = offs_h < H
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=in_h[:, None], other=0.0)
    if UPCAST:
        q_t = tl.trans(q.to(tl.float32))
    else:
        q_t = tl.trans(q)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=in_h, other=0.0).to(tl.float32)
    scale = 1.0
    if KEY_SCALE == 1:
        scale = tl.load(ks_ptr).to(tl.float32)
    known = (req >= 0) & (req < R)
    page_row = pt_ptr + tl.minimum(tl.maximum(req, 0), R - 1) * stride_pt
    for c0 in range(c_lo, c_hi, PAGE * PAGES):
        for i in tl.static_range(PAGES):
            cp = c0 + i * PAGE  # a page's first candidate (spans are whole pages)
            page = tl.load(page_row + tl.minimum(cp, c_hi - 1) // PAGE).to(tl.int64)
            page = tl.where(known & (cp < c_hi), page, -1)
            k = k_desc.load([(tl.maximum(page, 0) * PAGE).to(tl.int32), 0])
            if UPCAST:
                s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
            elif FP8_DOT:  # as the gather kernel
                s = tl.dot(k, q_t, max_num_imprecise_acc=16)
            else:
                s = tl.dot(k, q_t)
            offs_c = cp + tl.arange(0, PAGE)
            slot = page * PAGE + tl.arange(0, PAGE)  # a negative page: every slot negative
            valid = (offs_c < c_hi) & (offs_c <= pos) & (slot >= 0) & (slot < S)
            _store_scores(s, w, in_h, H, valid, slot, ks_ptr, scale, 1.0, out_ptr + t * stride_ot + offs_c,
                          offs_c < c_hi, KEY_SCALE, BLOCK_H)


def _score_dot(q_dtype: torch.dtype, key_dtype: torch.dtype, interpreted: bool) -> tuple:
    """(dot dtype, fp32 products, query prescale) for the tensor cores.

    bf16/fp16 keys with queries of the same dtype multiply as they are. FP8 keys are widened to
    fp16 (one conversion per two values; bf16 takes several) and bf16 queries go to fp16 scaled
    by 2^-8 (undone with the key scale): fp16 then holds |q| up to 2^24, and only entries below
    2^-6 lose bits. FP8 queries (with FP8 keys) multiply as they are. Anything else (fp32, mixed
    dtypes, the interpreter) runs in fp32.
    """
    if interpreted or q_dtype == torch.float32:
        return tl.float32, True, 1.0
    if q_dtype in FP8_KEY_DTYPES:
        return tl.float8e4nv, False, 1.0
    if key_dtype in FP8_KEY_DTYPES:
        return tl.float16, False, (1.0 if q_dtype == torch.float16 else 2.0**-8)
    if key_dtype == q_dtype:
        return _TL_DTYPES[q_dtype], False, 1.0
    return tl.float32, True, 1.0


def _default_span(T: int, C: int, block_c: int, device: torch.device) -> int:
    """Candidates per program: enough programs for about four waves, each scoring whole tiles
    (the row's queries are loaded once a program, so fewer, longer programs read less)."""
    tiles = cdiv(C, block_c)
    sms = sm_count(device) or 4  # interpreted: still several programs a row at the tests' shapes
    per_program = max(1, cdiv(T * tiles, 4 * sms))
    return per_program * block_c


def _pages_misfit(q, index_cache, page_size: int, shard) -> str | None:
    """Why the pages kernel cannot read these keys (``None``: it can). It needs the replicated cache
    (a sharded rank's rows of a page hold only its owned candidates), E4M3 queries over FP8 keys or
    queries of the keys' bf16/fp16 dtype, a page of 16-256 candidates and Di of 32-256 (powers of
    two: a page is one block copy), rows contiguous and 16-byte aligned, fewer than 2^31 of them."""
    D, item = index_cache.shape[1], index_cache.element_size()
    if shard is not None:
        return "the sharded cache (a rank's rows of a page hold only the candidates it owns)"
    if not (q.dtype in FP8_KEY_DTYPES or (q.dtype == index_cache.dtype and q.dtype in (torch.bfloat16, torch.float16))):
        return f"queries {q.dtype} over keys {index_cache.dtype} (needs E4M3 over FP8 keys, or the keys' bf16/fp16)"
    if page_size & (page_size - 1) or not 16 <= page_size <= 256:
        return f"page size {page_size} (needs a power of two in [16, 256])"
    if D & (D - 1) or not 32 <= D <= 256:
        return f"Di = {D} (needs a power of two in [32, 256])"
    if index_cache.stride(1) != 1 or (index_cache.stride(0) * item) % 16 or index_cache.data_ptr() % 16:
        return "index_cache rows not contiguous and 16-byte aligned"
    if index_cache.shape[0] >= 2**31:
        return f"{index_cache.shape[0]} slots (block copies address fewer than 2^31 rows)"
    return None


def index_scores_triton(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    *,
    path: str | None = None,
    block_c: int | None = None,
    span: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    shard: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Triton paged indexer scores (see module docstring); grid (T, ceil(C / span)).

    Reads the keys straight from the paged cache: no gathered copy, no fp32 keys, one pass.
    ``path``: ``"gather"`` (each candidate's key row loaded through its slot; any shape, the
    sharded cache) or ``"pages"`` (a page's rows one block copy; see :func:`_pages_misfit` for
    what it needs); default ``"gather"``.
    ``block_c`` candidates a tile (a power of two >= 16; for ``"pages"`` a multiple of the page
    size, the candidates of a step), ``span`` candidates a program (a multiple of ``block_c``).
    Any Hi and Di (padded to powers of two >= 16). No host sync.
    ``max_registers``: a cap on the registers a thread (ptxas's ``maxnreg``; 16-255), which lets
    more programs share an SM; the arithmetic, hence every score, is the same at any cap. Default:
    FP8_MAX_REGISTERS for the gather kernel's E4M3 products, else none (255: no cap).
    ``shard = (N, r, I)``: the sharded form (see :func:`index_scores_reference`); only the owned
    candidates' keys are read.
    """
    _check_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)
    if shard is not None:
        check_remap_args(*shard, "index_scores_sharded")
    dcp_size, rank, interleave = shard or (1, 0, 1)
    for name, t in (("q", q), ("w", w)):
        if t.dtype not in TRITON_FLOAT_DTYPES + (FP8_KEY_DTYPES if name == "q" else ()):
            raise ValueError(f"{_SCORES}: {name} dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {t.dtype}")
    if index_cache.dtype not in TRITON_FLOAT_DTYPES + FP8_KEY_DTYPES:
        raise ValueError(f"{_SCORES}: index_cache dtype {index_cache.dtype} is not supported")
    if path not in (None, "gather", "pages"):
        raise ValueError(f"{_SCORES}: path must be 'gather' or 'pages', got {path!r}")
    if max_registers is not None and not 16 <= max_registers <= 255:
        raise ValueError(f"{_SCORES}: max_registers must be 16-255 (registers a thread), got {max_registers}")
    T, H, D = q.shape
    C = page_table.shape[1] * page_size
    out = torch.empty((T, C), dtype=torch.float32, device=q.device)
    if T == 0 or C == 0:
        return out
    if H == 0 or page_table.shape[0] == 0:  # no heads: 0 where valid; no pages: nothing valid
        valid = _valid_mask(page_table, req_ids, positions, page_size, shard)
        return out.fill_(0.0).masked_fill_(~valid, float("-inf"))
    check_launchable(_index_scores_kernel, q, w, index_cache, page_table)
    pages = path == "pages"
    if pages and (misfit := _pages_misfit(q, index_cache, page_size, shard)):
        raise ValueError(f"{_SCORES}: the pages path cannot read these keys: {misfit}")
    interpreted = is_interpreted(_index_scores_kernel)
    fp8_dot = q.dtype in FP8_KEY_DTYPES and not interpreted
    if pages:  # H100 sweep (docs/benchmarks.md): two 64-candidate pages a step for FP8 keys, one for bf16
        bc = block_c or max(page_size, 128 if fp8_dot else 64)
    else:
        bc = block_c or (16 if q.device.type != "cuda" else 128 if fp8_dot else 64)  # H200 sweeps (docs/benchmarks.md)
    if bc < 16 or bc & (bc - 1) or (pages and bc % page_size):
        raise ValueError(f"{_SCORES}: block_c must be a power of two >= 16{' and a multiple of the page size' if pages else ''}, got {bc}")
    sp = span or _default_span(T, C, bc, q.device)
    if sp < bc or sp % bc:
        raise ValueError(f"{_SCORES}: span must be a positive multiple of block_c = {bc}, got {sp}")
    key_scale_mode = 0 if key_scale is None else (2 if key_scale.dim() == 1 and key_scale.shape[0] > 1 else 1)
    q = last_dim_contiguous(q)
    w = last_dim_contiguous(w)
    page_table = last_dim_contiguous(page_table)
    ks = key_scale.reshape(-1) if key_scale is not None else w  # a placeholder pointer when unused
    block_h = max(16, next_pow2(H))
    if pages:
        desc = TensorDescriptor(index_cache, list(index_cache.shape), list(index_cache.stride()), [page_size, D])
        _index_scores_pages_kernel[(T, cdiv(C, sp))](
            q, w, desc, ks, page_table, req_ids.contiguous(), positions.contiguous(), out,
            H, C, index_cache.shape[0], page_table.shape[0], sp,
            q.stride(0), q.stride(1), w.stride(0), page_table.stride(0), out.stride(0),
            PAGE=page_size, PAGES=bc // page_size, KEY_SCALE=key_scale_mode, BLOCK_H=block_h, BLOCK_D=D,
            FP8_DOT=fp8_dot, UPCAST=interpreted, num_warps=num_warps or 4, num_stages=num_stages or 3,
            maxnreg=max_registers,
        )  # fmt: skip
        return out
    dot_dtype, dot_ieee, prescale = _score_dot(q.dtype, index_cache.dtype, interpreted)
    index_cache = last_dim_contiguous(index_cache)
    _index_scores_kernel[(T, cdiv(C, sp))](
        q, w, index_cache, ks, page_table, req_ids.contiguous(), positions.contiguous(), out,
        H, D, C, index_cache.shape[0], page_table.shape[0], sp, prescale,
        q.stride(0), q.stride(1), w.stride(0), index_cache.stride(0), page_table.stride(0), out.stride(0), rank,
        PAGE=page_size, DCP_SIZE=dcp_size, INTERLEAVE=interleave, KEY_SCALE=key_scale_mode, Q_PRESCALE=prescale != 1.0, BLOCK_C=bc,
        BLOCK_H=block_h, BLOCK_D=max(32 if fp8_dot else 16, next_pow2(D)),  # E4M3 products: k >= 32
        DOT_DTYPE=dot_dtype, DOT_IEEE=dot_ieee, UPCAST=interpreted, FP8_DOT=fp8_dot,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
        maxnreg=max_registers or (FP8_MAX_REGISTERS if fp8_dot else None),
    )  # fmt: skip
    return out


def _valid_mask(page_table, req_ids, positions, page_size, shard=None) -> torch.Tensor:
    cand = candidate_slots(page_table, req_ids, page_size)
    p = torch.arange(cand.shape[1], device=cand.device)
    valid = (p[None, :] <= positions.to(torch.int64)[:, None]) & (cand >= 0)
    if shard is not None:
        n, rank, interleave = shard
        valid = valid & (owner(cand.clamp(min=0), n, interleave) == rank)
    return valid
