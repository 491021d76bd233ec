"""The lightning indexer on the GPU: paged scores on tensor cores, a radix top-k, and the top-k
fused with the DCP remap.

Contracts (both implementations of each; ``-1`` or any negative id means "no page / no slot"):

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
    required for FP8 keys and refused otherwise. A slot ``>= S`` is a contract violation (the
    reference raises; the kernel treats the candidate as invalid rather than read out of bounds).

``topk_select(scores[T, C], k, page_table=None, req_ids=None, page_size=1) -> topk[T, k] int32``

    The ``min(k, C)`` largest scores of each row, ordered by the total order "larger value
    first, and among equal values the lower candidate position first", with NaN larger than
    every number (as ``torch.topk`` ranks it) and ``-0.0 == +0.0``. ``-inf`` scores are never
    selected. The selected candidates are returned **in ascending candidate position**
    (not best first: attention needs only the set), compacted to the front; the tail is ``-1``
    (past the row's count: ``min(k, number of scores != -inf)``; ``k > C`` pads with ``-1``).
    Without a page table the entries are candidate positions; with one they are global slots
    ``page_table[req, p // P] * P + p % P`` (``-1`` where that page is negative; every entry of a
    row with a negative ``req_ids`` is ``-1``). The set is the model's ``torch.topk`` set up to
    equal values: where several candidates tie at the k-th value, the lowest positions win.

``topk_select_remap(scores, k, dcp_size N, rank r, interleave I, page_table=None, req_ids=None,
page_size=1) -> (local[T, k] int32, count[T] int32)``

    Exactly ``topk_remap(topk_select(scores, k, ...), N, r, I)`` (:mod:`.topk_remap`): the
    selected slots rank ``r`` owns, as local rows, compacted to the front in ascending candidate
    position, tail ``-1``, and how many per row. One kernel: no ``[T, k]`` global top-k is
    written.

The sharded index cache (each rank holds the index keys of the slots it owns; see the section at
the end of this module):

``index_scores(..., shard=(N, r, I))`` (the op ``index_scores_sharded``)
    ``index_cache`` holds rank ``r``'s rows (``local_row(slot)``); a candidate is valid as above
    and owned by ``r``; every other candidate is ``-inf``. Owned scores are bit-identical to the
    replicated cache's (the same arithmetic on the same shapes, with the same keys).

``topk_candidates(scores[T, C], k) -> [T, k, 2] int32``
    ``topk_select``'s selection of the rank's scores as (fp32 score bits, candidate position)
    pairs in ascending position, ``(-inf, -1)`` past the row's count: what a rank all-gathers.

``topk_agree(gathered[N*T, k', 2], page_table, req_ids, page_size, k, N) -> topk[T, k] int32``
and ``topk_agree_remap(..., N, r, I) -> (local, count)``
    The ``k`` best of each row's ``N * k'`` gathered candidates in ``topk_select``'s order, as
    global slots in ascending position (or, remapped, rank ``r``'s local rows): equal to
    ``topk_select`` (``topk_select_remap``) over the whole scores.

Tolerance of the scores: the kernel sums the products on tensor cores (bf16/fp16 operands are
exact in the fp32 products, FP8 keys are widened exactly) in another order than the reference;
``|kernel - exact| <= 1e-5 * sum_h |w_h| * sum_d |q_hd * k_d|`` (one ulp of fp32 per term
summed, with a margin), plus, for FP8 keys with bf16 queries (whose products run in fp16 with
the queries scaled by 2^-8), ``2^-17 * sum_h |w_h| * sum_d |k_d|`` for query entries below
2^-6. The top-k is computed from the scores it is given, so kernel and reference select the
same set from the same scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_dcp.slots import local_row, owner

from ._common import (
    TRITON_FLOAT_DTYPES,
    cdiv,
    check_float,
    check_index,
    check_launchable,
    check_same_device,
    is_interpreted,
    last_dim_contiguous,
    next_pow2,
    sm_count,
)
from .topk_remap import _owned

FP8_KEY_DTYPES = (torch.float8_e4m3fn,)
RADIX = 256  # 8-bit digits: four passes over a 32-bit key
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _int_arg(op: str, name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{op}: {name} must be a Python int >= {lo}, got {v!r}")


# =========================================================================== index_scores

_SCORES = "index_scores"


def _check_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size) -> None:
    check_float(_SCORES, "q", q, 3)
    check_float(_SCORES, "w", w, 2)
    check_float(_SCORES, "index_cache", index_cache, 2)
    check_index(_SCORES, "page_table", page_table, 2)
    check_index(_SCORES, "req_ids", req_ids, 1)
    check_index(_SCORES, "positions", positions, 1)
    _int_arg(_SCORES, "page_size", page_size, 1)
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
    if q.dtype in FP8_KEY_DTYPES or w.dtype in FP8_KEY_DTYPES:
        raise ValueError(f"{_SCORES}: q and w must be fp32, bf16 or fp16 (FP8 is for the index keys only)")
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
        _check_remap_args(*shard, "index_scores_sharded")
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
        valid = valid & (slot < S)
        slot = tl.where(valid, slot, 0)
        k = tl.load(k_ptr + slot[:, None] * stride_k + offs_d[None, :], mask=valid[:, None] & in_d[None, :], other=0.0)
        if UPCAST:
            s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
        elif DOT_IEEE:
            s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
        else:
            s = tl.dot(k.to(DOT_DTYPE), q_t)
        if KEY_SCALE == 1:
            s = s * scale
        elif KEY_SCALE == 2:
            row_scale = tl.load(ks_ptr + slot, mask=valid, other=0.0).to(tl.float32) / q_prescale
            s = s * row_scale[:, None]
        # relu that keeps NaN (max(NaN, 0) may give 0); padding heads add exact zeros
        contrib = tl.where(s < 0.0, 0.0, s) * w[None, :]
        if BLOCK_H != H:
            contrib = tl.where(in_h[None, :], contrib, 0.0)
        score = tl.sum(contrib, axis=1)
        tl.store(out_ptr + t * stride_ot + offs_c, tl.where(valid, score, float("-inf")), mask=offs_c < c_hi)


def _score_dot(q_dtype: torch.dtype, key_dtype: torch.dtype, interpreted: bool) -> tuple:
    """(dot dtype, fp32 products, query prescale) for the tensor cores.

    bf16/fp16 keys with queries of the same dtype multiply as they are. FP8 keys are widened to
    fp16 (one conversion per two values; bf16 takes several) and bf16 queries go to fp16 scaled
    by 2^-8 (undone with the key scale): fp16 then holds |q| up to 2^24, and only entries below
    2^-6 lose bits. Anything else (fp32, mixed dtypes, the interpreter) runs in fp32.
    """
    if interpreted or q_dtype == torch.float32:
        return tl.float32, True, 1.0
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
    block_c: int | None = None,
    span: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    shard: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Triton paged indexer scores (see module docstring); grid (T, ceil(C / span)).

    Reads the keys straight from the paged cache: no gathered copy, no fp32 keys, one pass.
    ``block_c`` candidates a tile (a power of two >= 16), ``span`` candidates a program (a
    multiple of ``block_c``). Any Hi and Di (padded to powers of two >= 16). No host sync.
    ``shard = (N, r, I)``: the sharded form (see :func:`index_scores_reference`); only the owned
    candidates' keys are read.
    """
    _check_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)
    if shard is not None:
        _check_remap_args(*shard, "index_scores_sharded")
    dcp_size, rank, interleave = shard or (1, 0, 1)
    for name, t in (("q", q), ("w", w)):
        if t.dtype not in TRITON_FLOAT_DTYPES:
            raise ValueError(f"{_SCORES}: {name} dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {t.dtype}")
    if index_cache.dtype not in TRITON_FLOAT_DTYPES + FP8_KEY_DTYPES:
        raise ValueError(f"{_SCORES}: index_cache dtype {index_cache.dtype} is not supported")
    T, H, D = q.shape
    C = page_table.shape[1] * page_size
    out = torch.empty((T, C), dtype=torch.float32, device=q.device)
    if T == 0 or C == 0:
        return out
    if H == 0 or page_table.shape[0] == 0:  # no heads: 0 where valid; no pages: nothing valid
        valid = _valid_mask(page_table, req_ids, positions, page_size, shard)
        return out.fill_(0.0).masked_fill_(~valid, float("-inf"))
    check_launchable(_index_scores_kernel, q, w, index_cache, page_table)
    bc = block_c or (16 if q.device.type != "cuda" else 64)
    if bc < 16 or bc & (bc - 1):
        raise ValueError(f"{_SCORES}: block_c must be a power of two >= 16, got {bc}")
    sp = span or _default_span(T, C, bc, q.device)
    if sp < bc or sp % bc:
        raise ValueError(f"{_SCORES}: span must be a positive multiple of block_c = {bc}, got {sp}")
    dot_dtype, dot_ieee, prescale = _score_dot(q.dtype, index_cache.dtype, is_interpreted(_index_scores_kernel))
    key_scale_mode = 0 if key_scale is None else (2 if key_scale.dim() == 1 and key_scale.shape[0] > 1 else 1)
    q = last_dim_contiguous(q)
    w = last_dim_contiguous(w)
    index_cache = last_dim_contiguous(index_cache)
    page_table = last_dim_contiguous(page_table)
    ks = key_scale.reshape(-1) if key_scale is not None else w  # a placeholder pointer when unused
    _index_scores_kernel[(T, cdiv(C, sp))](
        q, w, index_cache, ks, page_table, req_ids.contiguous(), positions.contiguous(), out,
        H, D, C, index_cache.shape[0], page_table.shape[0], sp, prescale,
        q.stride(0), q.stride(1), w.stride(0), index_cache.stride(0), page_table.stride(0), out.stride(0), rank,
        PAGE=page_size, DCP_SIZE=dcp_size, INTERLEAVE=interleave, KEY_SCALE=key_scale_mode, Q_PRESCALE=prescale != 1.0, BLOCK_C=bc,
        BLOCK_H=max(16, next_pow2(H)), BLOCK_D=max(16, next_pow2(D)),
        DOT_DTYPE=dot_dtype, DOT_IEEE=dot_ieee, UPCAST=is_interpreted(_index_scores_kernel),
        num_warps=num_warps or 4, num_stages=num_stages or 2,
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


# =========================================================================== topk_select

_SELECT = "topk_select"


def _check_select(scores, k, page_table, req_ids, page_size, op=_SELECT) -> None:
    check_float(op, "scores", scores, 2, TRITON_FLOAT_DTYPES)
    _int_arg(op, "k", k, 0)
    if (page_table is None) != (req_ids is None):
        raise ValueError(f"{op}: page_table and req_ids come together (slots) or not at all (positions)")
    if page_table is not None:
        check_index(op, "page_table", page_table, 2)
        check_index(op, "req_ids", req_ids, 1)
        _int_arg(op, "page_size", page_size, 1)
        if req_ids.shape[0] != scores.shape[0]:
            raise ValueError(f"{op}: req_ids must have T = {scores.shape[0]} entries, got {tuple(req_ids.shape)}")
        if page_table.shape[1] * page_size != scores.shape[1]:
            raise ValueError(
                f"{op}: scores must have C = max_pages * page_size = {page_table.shape[1]} * {page_size} "
                f"columns, got {scores.shape[1]}"
            )
        check_same_device(op, scores=scores, page_table=page_table, req_ids=req_ids)


def _check_remap_args(dcp_size, rank, interleave, op) -> None:
    _int_arg(op, "dcp_size", dcp_size, 1)
    _int_arg(op, "interleave", interleave, 1)
    _int_arg(op, "rank", rank, 0)
    if rank >= dcp_size:
        raise ValueError(f"{op}: rank must be in [0, {dcp_size}), got {rank}")


def topk_select_reference(
    scores: torch.Tensor,
    k: int,
    page_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """Plain-torch top-k selection (see module docstring): a stable descending sort gives the
    tie rule (lower position first among equal values; NaN first), the first ``min(k, C)`` not
    ``-inf`` are kept and put back in position order. No host sync."""
    _check_select(scores, k, page_table, req_ids, page_size)
    T, C = scores.shape
    device = scores.device
    s = scores.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 ties with +0.0
    n = min(k, C)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :n]
    keep = s.gather(1, order) != float("-inf")
    pos = torch.where(keep, order, torch.full_like(order, C)).sort(dim=1).values  # position order
    taken = pos < C
    if page_table is not None:
        cand = candidate_slots(page_table, req_ids, page_size)
        out = cand.gather(1, pos.clamp(max=max(C - 1, 0))) if C > 0 else pos
    else:
        out = pos
    out = torch.where(taken, out, torch.full_like(out, -1)).to(torch.int32)
    if n < k:
        out = torch.cat([out, torch.full((T, k - n), -1, dtype=torch.int32, device=device)], dim=1)
    return out


def topk_select_remap_reference(
    scores: torch.Tensor,
    k: int,
    dcp_size: int,
    rank: int,
    interleave: int = 1,
    page_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    page_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_remap_reference(topk_select_reference(...))``: the fused op's meaning, composed."""
    from .topk_remap import topk_remap_reference

    _check_remap_args(dcp_size, rank, interleave, "topk_select_remap")
    topk = topk_select_reference(scores, k, page_table, req_ids, page_size)
    return topk_remap_reference(topk, dcp_size, rank, interleave)


# --------------------------------------------------------------------------- the radix select
#
# The key of a score is a uint32 whose unsigned order is the selection's order (NaN largest,
# -0.0 == +0.0, -inf -> 0). The k-th largest key is found one 8-bit digit at a time, most
# significant first: a histogram of the digit over the keys that match the digits found so far
# (the prefix) picks the bin holding the k-th largest, and "need" shrinks by the count above it.
# A pass stops the search early when the whole bin is needed (unless the bin could hold -inf
# keys, whose key is 0). The selection is then: every key whose top bits are above the prefix,
# plus, among those equal to it, the first `need` in position order.


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 key whose unsigned order is the selection's (NaN largest, -inf 0)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    key = tl.where(x != x, 0xFFFFFFFF, key)
    return tl.where(x == float("-inf"), 0, key).to(tl.uint32)


@triton.jit
def _advance(hist, prefix, need, PASS: tl.constexpr):
    """One digit of the search from the pass's histogram: (prefix, need, done)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= bin
    digit = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
    prefix = (prefix << 8) | digit.to(tl.uint32)
    need = need - above
    done = ((need == in_bin) & (prefix != 0)) | (PASS == 3)
    return prefix, need, done


@triton.jit
def _slots_of(offs, mask, page_row, PAGE: tl.constexpr, HAS_PT: tl.constexpr):
    """Slot (int64, -1 for none) of candidate positions ``offs`` (the positions themselves
    without a page table); loads only where ``mask``."""
    if HAS_PT:
        page = tl.load(page_row + offs // PAGE, mask=mask, other=-1).to(tl.int64)
        return tl.where(page >= 0, page * PAGE + offs % PAGE, -1)
    else:
        return offs.to(tl.int64)


@triton.jit
def _chunk_hist(scores_ptr, lo, hi, prefix, page_row, RANK, PASS: tl.constexpr, OWNED: tl.constexpr,
                PAGE: tl.constexpr, HAS_PT: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr,
                BLOCK: tl.constexpr):
    """Histogram of digit PASS over the keys in [lo, hi) whose top 8*PASS bits equal ``prefix``,
    and the number whose top bits are above it; with OWNED the same two restricted to the
    candidates rank RANK owns."""
    hist = tl.zeros([256], dtype=tl.int32)
    above = 0
    hist_own = tl.zeros([256], dtype=tl.int32)
    above_own = 0
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inr = offs < hi
        key = _ordered_key(tl.load(scores_ptr + offs, mask=inr, other=float("-inf")).to(tl.float32))
        digit = ((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
        if PASS == 0:
            match = inr
            higher = offs < 0
        else:
            top = key >> (32 - 8 * PASS)
            match = inr & (top == prefix)
            higher = inr & (top > prefix)
        hist += tl.histogram(digit, 256, mask=match)
        above += tl.sum(higher.to(tl.int32), axis=0)
        if OWNED:
            keep, _ = _owned(_slots_of(offs, match | higher, page_row, PAGE, HAS_PT), DCP_SIZE, RANK, INTERLEAVE)
            hist_own += tl.histogram(digit, 256, mask=match & keep)
            above_own += tl.sum((higher & keep).to(tl.int32), axis=0)
    return hist, above, hist_own, above_own


@triton.jit
def _write_selected(scores_ptr, lo, hi, prefix, shift, need, active, eq_seen, sel_seen, own_seen,
                    out_ptr, page_row, RANK, PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr,
                    DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """Write the selected candidates of [lo, hi) in position order, after ``sel_seen`` (or, with
    REMAP, the kept local rows after ``own_seen``) entries written before; ``eq_seen`` keys equal
    to the prefix came before [lo, hi). Returns the three running counts."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inr = offs < hi
        inr = tl.where(active, inr, False)
        key = _ordered_key(tl.load(scores_ptr + offs, mask=inr, other=float("-inf")).to(tl.float32))
        top = key >> shift.to(tl.uint32)
        is_eq = inr & (top == prefix)
        eq_i = is_eq.to(tl.int32)
        rank_eq = eq_seen + tl.cumsum(eq_i, axis=0) - eq_i
        sel = (inr & (top > prefix)) | (is_eq & (rank_eq < need))
        slot = _slots_of(offs, sel, page_row, PAGE, HAS_PT)
        if REMAP:
            keep, row = _owned(slot, DCP_SIZE, RANK, INTERLEAVE)
            keep = keep & sel
            keep_i = keep.to(tl.int32)
            tl.store(out_ptr + own_seen + tl.cumsum(keep_i, axis=0) - keep_i, row.to(tl.int32), mask=keep)
            own_seen += tl.sum(keep_i, axis=0)
        else:
            sel_i = sel.to(tl.int32)
            tl.store(out_ptr + sel_seen + tl.cumsum(sel_i, axis=0) - sel_i, tl.where(slot >= 0, slot, -1).to(tl.int32),
                     mask=sel)  # fmt: skip
        sel_seen += tl.sum(sel.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq_i, axis=0)
    return eq_seen, sel_seen, own_seen


@triton.jit
def _write_tail(out_ptr, count_ptr, total, K, REMAP: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs < K) & (offs >= total))
    if REMAP:
        tl.store(count_ptr, total)


@triton.jit
def _row_need(req_ptr, t, C, K, R, HAS_PT: tl.constexpr):
    """How many candidates row t selects before -inf is excluded: min(K, C), 0 for a row
    without a request (an id < 0, or >= R: out of contract, never read)."""
    need = tl.minimum(K, C)
    if HAS_PT:
        req = tl.load(req_ptr + t)
        need = tl.where((req >= 0) & (req < R), need, 0)
    return need


@triton.jit
def _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT: tl.constexpr):
    """Row t's page-table row (clamped into the table; rows without a request read nothing)."""
    if HAS_PT:
        return pt_ptr + tl.minimum(tl.maximum(tl.load(req_ptr + t).to(tl.int64), 0), R - 1) * stride_pt
    else:
        return pt_ptr


@triton.jit
def _topk_row_kernel(
    scores_ptr, out_ptr, count_ptr, pt_ptr, req_ptr, C, K, R, RANK, stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (T,): one program selects a whole row (the passes read it again from L1/L2)."""
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_s
    page_row = _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT)
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    active = need > 0
    prefix = tl.cast(0, tl.uint32)
    level = tl.cast(0, tl.int32)
    done = need == 0
    for d in tl.static_range(4):
        if not done:
            hist, _, _, _ = _chunk_hist(row, 0, C, prefix, page_row, RANK, d, False, PAGE, HAS_PT, DCP_SIZE,
                                        INTERLEAVE, BLOCK)  # fmt: skip
            prefix, need, done = _advance(hist, prefix, need, d)
            level = tl.cast(d, tl.int32)
    need = tl.where((level == 3) & (prefix == 0), 0, need)  # the bin of -inf: none of it
    zero = tl.cast(0, tl.int32)
    _, sel, own = _write_selected(row, 0, C, prefix, 24 - 8 * level, need, active, zero, zero, zero,
                                  out_ptr + t * stride_o, page_row, RANK, PAGE, HAS_PT, REMAP, DCP_SIZE,
                                  INTERLEAVE, BLOCK)  # fmt: skip
    _write_tail(out_ptr + t * stride_o, count_ptr + t, own if REMAP else sel, K, REMAP, BLOCK)


@triton.jit
def _load_state(hist_ptr, need, NPASS: tl.constexpr):
    """(prefix, need, level, done) after the first NPASS passes, from the rows' histograms."""
    prefix = tl.cast(0, tl.uint32)
    level = tl.cast(0, tl.int32)
    done = need == 0
    for d in tl.static_range(NPASS):
        if not done:
            hist = tl.load(hist_ptr + d * 256 + tl.arange(0, 256))
            prefix, need, done = _advance(hist, prefix, need, d)
            level = tl.cast(d, tl.int32)
    return prefix, need, level, done


@triton.jit
def _topk_pass_kernel(
    scores_ptr, hist_ptr, above_ptr, pt_ptr, req_ptr, C, K, R, CHUNK, NCHUNK, RANK, stride_s, stride_pt,
    PASS: tl.constexpr, PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (T, NCHUNK): pass PASS over chunk j of row t.

    Adds the chunk's digit histogram to the row's (``hist[t, PASS]``, atomics; zeroed by the
    launcher) and stores, for the write kernel, the chunk's count of keys at or above each bin
    of this pass (``above[t, PASS, j, :]``, the keys above the prefix included, and with REMAP
    the same over owned candidates at ``above[t, PASS + 4, j, :]``).
    """
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    prefix, need, level, done = _load_state(hist_ptr + t * 4 * 256, need, PASS)
    if not done:
        page_row = _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT)
        lo = j * CHUNK
        hi = tl.minimum(lo + CHUNK, C)
        hist, above, hist_own, above_own = _chunk_hist(scores_ptr + t * stride_s, lo, hi, prefix, page_row, RANK,
                                                       PASS, REMAP, PAGE, HAS_PT, DCP_SIZE, INTERLEAVE, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (t * 4 + PASS) * 256 + bins, hist, mask=hist > 0, sem="relaxed")
        at_or_above = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        tl.store(above_ptr + ((t * 8 + PASS) * NCHUNK + j) * 257 + bins, at_or_above)
        tl.store(above_ptr + ((t * 8 + PASS) * NCHUNK + j) * 257 + 256, above)
        if REMAP:
            own_at_or_above = above_own + tl.sum(hist_own, axis=0) - tl.cumsum(hist_own, axis=0) + hist_own
            tl.store(above_ptr + ((t * 8 + 4 + PASS) * NCHUNK + j) * 257 + bins, own_at_or_above)
            tl.store(above_ptr + ((t * 8 + 4 + PASS) * NCHUNK + j) * 257 + 256, above_own)


@triton.jit
def _count_owned_ties(scores_ptr, lo, hi, prefix, shift, take, page_row, RANK, PAGE: tl.constexpr,
                      HAS_PT: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """How many of the first ``take`` keys equal to the prefix in [lo, hi) rank RANK owns."""
    seen = 0
    owned = 0
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inr = offs < hi
        key = _ordered_key(tl.load(scores_ptr + offs, mask=inr, other=float("-inf")).to(tl.float32))
        is_eq = inr & ((key >> shift.to(tl.uint32)) == prefix)
        eq_i = is_eq.to(tl.int32)
        taken = is_eq & (seen + tl.cumsum(eq_i, axis=0) - eq_i < take)
        keep, _ = _owned(_slots_of(offs, taken, page_row, PAGE, HAS_PT), DCP_SIZE, RANK, INTERLEAVE)
        owned += tl.sum((keep & taken).to(tl.int32), axis=0)
        seen += tl.sum(eq_i, axis=0)
    return owned


@triton.jit
def _topk_write_kernel(
    scores_ptr, hist_ptr, above_ptr, out_ptr, count_ptr, pt_ptr, req_ptr, C, K, R, CHUNK, NCHUNK, RANK,
    stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
):
    """Grid (T, NCHUNK): chunk j of row t writes its selected candidates.

    The chunks before j hold ``gt`` keys above the threshold bin and ``eq`` in it; the first
    ``need`` of the row's ``eq`` (in position order) are selected, so j's entries start after
    ``sum gt + min(sum eq, need)`` of them. With REMAP the owned counts come the same way, except
    for the one chunk whose ties are only partly selected: that chunk is scanned again. The last
    chunk writes the ``-1`` tail (and the count).
    """
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = scores_ptr + t * stride_s
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    active = need > 0
    prefix, need, level, done = _load_state(hist_ptr + t * 4 * 256, need, 4)
    need = tl.where((level == 3) & (prefix == 0), 0, need)
    shift = 24 - 8 * level
    page_row = _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT)
    # the chunks' counts at the threshold bin of the last pass: at or above it, above it
    digit = (prefix & 0xFF).to(tl.int32)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    in_chunks = chunks < NCHUNK
    base = above_ptr + (t * 8 + level) * NCHUNK * 257 + chunks * 257
    live = tl.where(active, in_chunks, False)
    at_or_above = tl.load(base + digit, mask=live, other=0)
    gt = tl.load(base + digit + 1, mask=live, other=0)  # bin 256 holds "above the prefix"
    eq = at_or_above - gt
    before = chunks < j
    eq_before_each = tl.cumsum(eq, axis=0) - eq
    eq_before = tl.sum(tl.where(before, eq, 0), axis=0)
    sel_before = tl.sum(tl.where(before, gt, 0), axis=0) + tl.minimum(eq_before, need)
    own_before = 0
    if REMAP:
        base_own = above_ptr + (t * 8 + 4 + level) * NCHUNK * 257 + chunks * 257
        own_at_or_above = tl.load(base_own + digit, mask=live, other=0)
        own_gt = tl.load(base_own + digit + 1, mask=live, other=0)
        full = eq_before_each + eq <= need
        own_before = tl.sum(tl.where(before, own_gt + tl.where(full, own_at_or_above - own_gt, 0), 0), axis=0)
        partial = in_chunks & (eq_before_each < need) & (eq_before_each + eq > need)
        i_part = tl.sum(tl.where(partial, chunks, 0), axis=0)
        if (tl.sum(partial.to(tl.int32), axis=0) > 0) & (i_part < j):
            take = need - tl.sum(tl.where(partial, eq_before_each, 0), axis=0)
            own_before += _count_owned_ties(row, i_part * CHUNK, tl.minimum(i_part * CHUNK + CHUNK, C), prefix,
                                            shift, take, page_row, RANK, PAGE, HAS_PT, DCP_SIZE, INTERLEAVE, BLOCK)
    lo = j * CHUNK
    _, sel, own = _write_selected(row, lo, tl.minimum(lo + CHUNK, C), prefix, shift, need, active, eq_before,
                                  sel_before, own_before, out_ptr + t * stride_o, page_row, RANK, PAGE, HAS_PT,
                                  REMAP, DCP_SIZE, INTERLEAVE, BLOCK)  # fmt: skip
    if j == NCHUNK - 1:
        _write_tail(out_ptr + t * stride_o, count_ptr + t, own if REMAP else sel, K, REMAP, BLOCK)


def _default_chunks(T: int, C: int, device: torch.device) -> int:
    """Programs per row. One (the whole selection in one launch) for short rows or enough rows
    to fill the GPU; else split each row so that about two programs run per SM, each over
    1024 candidates or more (a pass launch each, see :func:`topk_select_triton`)."""
    if device.type != "cuda":
        return 1
    if C <= 8192 or T >= sm_count(device) // 2:
        return 1
    return max(1, min(cdiv(2 * sm_count(device), T), C // 1024))


def _launch_select(scores, k, page_table, req_ids, page_size, remap, *, chunks=None, block=None, num_warps=None):
    """Shared launcher of topk_select_triton and topk_select_remap_triton; returns (out, count)."""
    T, C = scores.shape
    device = scores.device
    out = torch.empty((T, k), dtype=torch.int32, device=device)
    count = torch.zeros((T,), dtype=torch.int32, device=device)
    if T == 0 or k == 0:
        return out, count
    if C == 0:
        return out.fill_(-1), count
    check_launchable(_topk_row_kernel, scores)
    dcp_size, rank, interleave = remap or (1, 0, 1)
    has_pt = page_table is not None
    scores = last_dim_contiguous(scores)
    pt = last_dim_contiguous(page_table) if has_pt else out  # placeholder pointers when unused
    req = req_ids.contiguous() if has_pt else count
    stride_pt = pt.stride(0) if has_pt else 0
    rows = page_table.shape[0] if has_pt else 1
    ns = chunks or _default_chunks(T, C, device)
    interpreted = is_interpreted(_topk_row_kernel)
    blk = block or (32 if interpreted else (2048 if ns == 1 else 1024))
    if blk < 8 or blk & (blk - 1):
        raise ValueError(f"topk_select: block must be a power of two >= 8, got {blk}")
    warps = num_warps or (8 if ns == 1 else 4)
    common = dict(PAGE=page_size, HAS_PT=has_pt, REMAP=remap is not None, DCP_SIZE=dcp_size,
                  INTERLEAVE=interleave, BLOCK=blk)  # fmt: skip
    if ns == 1:
        _topk_row_kernel[(T,)](
            scores, out, count, pt, req, C, k, rows, rank, scores.stride(0), stride_pt, out.stride(0),
            **common, num_warps=warps,
        )  # fmt: skip
        return out, count
    chunk = cdiv(cdiv(C, ns), blk) * blk  # whole tiles a chunk
    ns = cdiv(C, chunk)
    hist = torch.zeros((T, 4, RADIX), dtype=torch.int32, device=device)
    above = torch.empty((T, 8, ns, RADIX + 1), dtype=torch.int32, device=device)
    for p in range(4):
        _topk_pass_kernel[(T, ns)](
            scores, hist, above, pt, req, C, k, rows, chunk, ns, rank, scores.stride(0), stride_pt,
            PASS=p, **common, num_warps=warps,
        )  # fmt: skip
    _topk_write_kernel[(T, ns)](
        scores, hist, above, out, count, pt, req, C, k, rows, chunk, ns, rank, scores.stride(0), stride_pt,
        out.stride(0),
        **common, BLOCK_CHUNKS=next_pow2(ns), num_warps=warps,
    )  # fmt: skip
    return out, count


def topk_select_triton(
    scores: torch.Tensor,
    k: int,
    page_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    page_size: int = 1,
    *,
    chunks: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton radix top-k (see module docstring). No host sync, no data-dependent shapes.

    ``chunks`` programs a row: 1 runs the whole selection in one launch, a program a row
    (grid (T,)); more split each row into that many chunks and run four histogram passes (grid
    (T, chunks) each, per-row histograms through integer atomics into a zeroed ``[T, 4, 256]``
    workspace; later passes skip their work when an earlier one settled the threshold) and one
    write launch. ``block`` candidates are read a tile (a power of two >= 8).
    """
    _check_select(scores, k, page_table, req_ids, page_size)
    out, _ = _launch_select(scores, k, page_table, req_ids, page_size, None, chunks=chunks, block=block,
                            num_warps=num_warps)  # fmt: skip
    return out


def topk_select_remap_triton(
    scores: torch.Tensor,
    k: int,
    dcp_size: int,
    rank: int,
    interleave: int = 1,
    page_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    page_size: int = 1,
    *,
    chunks: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k fused with the DCP remap (see module docstring): the launches of
    :func:`topk_select_triton`, the write keeping only owned slots as local rows. No host sync."""
    _check_select(scores, k, page_table, req_ids, page_size, "topk_select_remap")
    _check_remap_args(dcp_size, rank, interleave, "topk_select_remap")
    return _launch_select(scores, k, page_table, req_ids, page_size, (dcp_size, rank, interleave),
                          chunks=chunks, block=block, num_warps=num_warps)  # fmt: skip


# =========================================================================== the sharded index cache
#
# With ``index_cache="sharded"`` each rank holds the index keys of the slots it owns and scores only
# those (``index_scores(..., shard=(N, r, I))``: the others are -inf). The group then agrees on the
# global top-k: each rank sends its best k (score, candidate position) pairs (``topk_candidates``),
# one all-gather brings every rank the N * k pairs of each row, and every rank picks the same k
# from them (``topk_agree``). The order "larger score first, lower position first among equal
# scores" (NaN largest, -0.0 == +0.0) is the one topk_select uses, and a candidate in the global
# top k has fewer than k candidates before it, so fewer than k of its own rank's: it is in its
# rank's best k. So the agreed set is exactly topk_select's over the replicated cache's scores.


def _pack_candidates(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[T, k, 2]`` int32: (fp32 score bits, candidate position) of the positions ``pos``
    (``-1``: none, sent as ``(-inf, -1)``)."""
    taken = pos >= 0
    values = scores.to(torch.float32).gather(1, pos.clamp(min=0).to(torch.int64))
    values = torch.where(taken, values, torch.full_like(values, float("-inf")))
    return torch.stack([values.view(torch.int32), pos.to(torch.int32)], dim=-1)


def topk_candidates_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """This rank's best ``k`` candidates of each row of its scores, as ``[T, k, 2]`` int32 pairs
    (fp32 score bits, candidate position), in ascending position; ``(-inf, -1)`` past the row's
    count. The selection is ``topk_select``'s (its tie rule). No host sync."""
    return _pack_candidates(scores, topk_select_reference(scores, k))


def topk_candidates_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_candidates_reference` with the Triton radix select."""
    return _pack_candidates(scores, topk_select_triton(scores, k))


_INT32_MIN = -(2**31)
_NEG_INF_BITS = -8388608  # float32 -inf (0xFF800000) read as int32


def _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, op) -> None:
    check_index(op, "gathered", gathered, 3)
    _int_arg(op, "k", k, 0)
    _int_arg(op, "dcp_size", dcp_size, 1)
    if gathered.dtype != torch.int32 or gathered.shape[2] != 2 or gathered.shape[0] % dcp_size:
        raise ValueError(f"{op}: gathered must be int32 [N * T, k_local, 2] with N = {dcp_size}, got "
                         f"{gathered.dtype} {tuple(gathered.shape)}")
    check_index(op, "page_table", page_table, 2)
    check_index(op, "req_ids", req_ids, 1)
    _int_arg(op, "page_size", page_size, 1)
    if req_ids.shape[0] * dcp_size != gathered.shape[0]:
        raise ValueError(f"{op}: req_ids must have T = {gathered.shape[0] // dcp_size} entries, got "
                         f"{tuple(req_ids.shape)}")


def _agreed_positions(gathered: torch.Tensor, dcp_size: int, k: int, C: int) -> torch.Tensor:
    """``[T, k]`` int64: the positions of the global top k, ascending; ``C`` where there are fewer."""
    NT, kk, _ = gathered.shape
    T = NT // dcp_size
    pairs = gathered.reshape(dcp_size, T, kk, 2).transpose(0, 1).reshape(T, dcp_size * kk, 2)
    bits, pos = pairs[..., 0], pairs[..., 1].to(torch.int64)
    bits = torch.where(bits == _INT32_MIN, torch.zeros_like(bits), bits)  # -0.0 ties with +0.0
    # signed int32 whose order is the scores' (NaN largest), then unique keys: lower position first
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, torch.full_like(order, 2**31 - 1), order)
    taken = (pos >= 0) & (pos < C) & (bits != _NEG_INF_BITS)
    key = order.to(torch.int64) * 2**32 + (2**31 - 1 - pos.clamp(0, C))
    key = torch.where(taken, key, torch.full_like(key, -(2**63)))
    n = min(k, dcp_size * kk)
    top = torch.topk(key, n, dim=1).indices
    chosen = torch.where(taken.gather(1, top), pos.gather(1, top), torch.full_like(top, C))
    chosen = chosen.sort(dim=1).values
    if n < k:
        chosen = torch.cat([chosen, chosen.new_full((T, k - n), C)], dim=1)
    return chosen


def _slots_at(page_table: torch.Tensor, req_ids: torch.Tensor, page_size: int, pos: torch.Tensor) -> torch.Tensor:
    """Global slots (int64) of candidate positions ``pos[T, k]``; ``-1`` for ``pos >= C``, a negative
    page or a row without a request."""
    R, MP = page_table.shape
    C = MP * page_size
    req = req_ids.to(torch.int64)
    if R == 0 or C == 0:
        return torch.full_like(pos, -1)
    pages = page_table.to(torch.int64).index_select(0, req.clamp(0, R - 1))
    safe = pos.clamp(0, C - 1)
    page = pages.gather(1, safe // page_size)
    ok = (pos < C) & (page >= 0) & (req >= 0)[:, None]
    return torch.where(ok, page * page_size + safe % page_size, torch.full_like(pos, -1))


def topk_agree_reference(gathered: torch.Tensor, page_table: torch.Tensor, req_ids: torch.Tensor, page_size: int,
                         k: int, dcp_size: int) -> torch.Tensor:
    """The group's top-k from every rank's ``topk_candidates`` (all-gathered: ``[N * T, k', 2]``, rank
    r's rows at ``[r * T, (r + 1) * T)``): the ``k`` best of each row's ``N * k'`` candidates by
    topk_select's order, as int32 global slots in ascending candidate position, ``-1`` tail —
    ``topk_select`` of the whole scores when every rank sent its best ``k' >= k`` of a partition of
    the candidates. Plain torch on ``N * k'`` entries a row; no host sync, static shapes."""
    _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, "topk_agree")
    C = page_table.shape[1] * page_size
    pos = _agreed_positions(gathered, dcp_size, k, C)
    return _slots_at(page_table, req_ids, page_size, pos).to(torch.int32)


def topk_agree_remap_reference(gathered: torch.Tensor, page_table: torch.Tensor, req_ids: torch.Tensor,
                               page_size: int, k: int, dcp_size: int, rank: int, interleave: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_remap(topk_agree(...), dcp_size, rank, interleave)`` without the global ``[T, k]`` slots
    in between: the agreed slots rank ``rank`` owns, as local rows in ascending candidate position,
    ``-1`` tail, and their count per row."""
    _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, "topk_agree_remap")
    _check_remap_args(dcp_size, rank, interleave, "topk_agree_remap")
    C = page_table.shape[1] * page_size
    pos = _agreed_positions(gathered, dcp_size, k, C)
    slots = _slots_at(page_table, req_ids, page_size, pos)
    safe = slots.clamp(min=0)
    owned = (slots >= 0) & (owner(safe, dcp_size, interleave) == rank)
    # positions are ascending and unique: sorting the owned ones' positions to the front compacts them in order
    first, order = torch.where(owned, pos, torch.full_like(pos, C)).sort(dim=1)
    rows = local_row(safe.gather(1, order), dcp_size, interleave)
    local = torch.where(first < C, rows, torch.full_like(rows, -1)).to(torch.int32)
    return local, owned.sum(dim=1, dtype=torch.int32)
