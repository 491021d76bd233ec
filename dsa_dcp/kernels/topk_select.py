"""The lightning indexer's top-k: a radix select over each row's scores, alone or fused with the DCP
remap.

Contracts (both implementations of each; ``-1`` or any negative id means "no page / no slot"):

``topk_select(scores[T, C], k, page_table=None, req_ids=None, page_size=1) -> topk[T, k] int32``

    The ``min(k, C)`` largest scores of each row, ordered by the total order "larger value
    first, and among equal values the lower candidate position first", with NaN larger than
    every number (as ``torch.topk`` ranks it) and ``-0.0 == +0.0``. ``-inf`` scores are never
    selected. The selected candidates are returned **in ascending candidate position**
    (not best first: attention needs only the set), compacted to the front; the tail is ``-1``
    (past the row's count: ``min(k, number of scores != -inf)``; ``k > C`` pads with ``-1``).
    Without a page table the entries are candidate positions; with one they are global slots
    ``page_table[req, p // P] * P + p % P`` (``-1`` where that page is negative; every entry of a
    row with a negative ``req_ids`` is ``-1``), the candidates of :mod:`.index_scores`. The set is
    the model's ``torch.topk`` set up to equal values: where several candidates tie at the k-th
    value, the lowest positions win.

``topk_select_remap(scores, k, dcp_size N, rank r, interleave I, page_table=None, req_ids=None,
page_size=1) -> (local[T, k] int32, count[T] int32)``

    Exactly ``topk_remap(topk_select(scores, k, ...), N, r, I)`` (:mod:`.topk_remap`): the
    selected slots rank ``r`` owns, as local rows, compacted to the front in ascending candidate
    position, tail ``-1``, and how many per row. One kernel: no ``[T, k]`` global top-k is
    written.

The top-k is computed from the scores it is given, so kernel and reference select the same set
from the same scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
from .index_scores import candidate_slots
from .topk_remap import _owned, topk_remap_reference

RADIX = 256  # 8-bit digits: four passes over a 32-bit key (the row and chunked paths)
# The threshold search over keys held in registers (:func:`_held_threshold`: the resident kernel, and
# the sampled kernels' sample and buffer) goes one bit a step, each step one reduction of a count,
# stopping once exactly the need lie at or above the prefix. It replaced eight 4-bit passes of
# tl.histogram (each a ballot per bit of the bin and a popcount per bin a lane owns, then a scan of
# the 16 bins). On an H100 (K = 2048, in a CUDA graph, fp32 randn scores, one process; us)
# histogram / two bits a step (three counts packed in one int64 reduction) / one bit: batch 1 / 4K
# 9.7 / 8.5 / 8.3, batch 1 / 8K 16.8 / 14.8 / 13.6, batch 8 / 32K (split sampled) 26.1 / 23.8 / 23.1.
# The resident path (one program holds its whole row in registers) is the default for one program
# a row up to RESIDENT_MAX candidates, the sampled path above it. On an H200 (K = 2048, in a CUDA
# graph, fp32 randn scores, page size 64: the inputs of `bench indexer --only topk`) the resident
# kernel took 18.8 us at batch 1 / 8K against 22.2 for the sampled one, 37.4 against 34.6 at
# batch 1 / 16K, 39.6 against 34.7 at batch 128 / 16K and 100.1 against 53.7 at batch 128 / 32K.
# ``path="resident"`` runs it up to RESIDENT_LIMIT, where its packed 16-bit counts end.
RESIDENT_MAX = 8192
RESIDENT_LIMIT = 32768
# A row past a power of two by at most RESIDENT_OVER_MAX times it is held as that power of two and
# a second tile over the rest (:func:`resident_tiles`): the count search's steps cost about the lanes
# held, and a row of 4,160 candidates (a decode row at 4,096 tokens in pages of 64) took 11.7-13.0 us
# held as 8,192 lanes, as a row of 8,192 did (13.1), against 7.1-7.5 for a row of 4,096 (H100,
# K = 2048, in a CUDA graph; docs/benchmarks.md).
RESIDENT_OVER_MAX = 0.25
# Keys equal to the need-th best on both sides of the cut (ReLU zeros, scores on a coarse grid)
# keep the count search from its exact stop: it checks for them at step TIE_CHECK_FROM and every
# TIE_CHECK_EVERY steps after (:func:`_held_threshold`), instead of running all 32 steps. Before
# the check, on an H100 (K = 2048, in a CUDA graph, batch 1, us): 4,096 randn scores 6.9, the same
# through a ReLU (tied at 0) 11.5; 4,160 (4,097 finite) randn 8.8, rounded to E4M3 16.6. From
# step 16, where random rows are done (about 12 steps at 4K), so that they do not pay for it;
# the check's own cost is not measured yet.
TIE_CHECK_FROM = 16
TIE_CHECK_EVERY = 4
# The sampled path (one program a row, rows above RESIDENT_MAX): a threshold from a sample of the
# row, one read compacting the candidates at or above it into a buffer, the buffer selected in
# registers (`_topk_sampled_kernel`). One candidate in SAMPLE_EVERY is sampled (at most
# SAMPLE_MAX), and the threshold is the sample's r-th best with r SAMPLE_SIGMAS standard deviations
# above its expected share of the selection: with K = 2048 at 32K or 128K candidates (a 2048- or
# 8192-candidate sample) the buffer then holds about 3,000 candidates, under the 4096 of the small
# buffer by about 4.5 standard deviations, and a row misses the selection (the exact tiled passes
# then run) about once in 10**6.
SAMPLE_EVERY = 16
SAMPLE_MAX = 8192
SAMPLE_SIGMAS = 5.0
# The threshold's search stops after the key's top SAMPLE_PREFIX_BITS bits (fp32: sign, exponent and
# the first 11 bits of the mantissa): the floor of that bin lies within 2**-11 of the sample's r-th
# best, relative, which lets through a few more candidates and saves the search's last passes.
SAMPLE_PREFIX_BITS = 20
# Rows above RESIDENT_MAX candidates are split over programs (:func:`_default_plan`): one or two
# rows (fewer than CHUNKED_ROWS) of over CHUNKED_MIN candidates by the chunked passes, the rest by
# the split sampled form; rows of up to ONE_PROGRAM_MAX candidates that would get at most four
# programs each keep one if there are SPLIT_SAMPLED_ROWS rows or more. On an H100 (K = 2048, in a
# CUDA graph, one process; us) batch 1 took 18.3 / 19.6 (split sampled / chunked, 32 programs a
# row) at 32K but 27.8 / 23.7 at 128K (128 programs), where the split sampled form's one-program
# parts (an 8K sample, the finish) weigh more; batch 2 at 128K 26.6 (128 programs) against 24.4
# for the chunked passes of the histogram search before it; batch 4 at 128K 31.0 / 35.4 (128).
CHUNKED_ROWS = 3
SPLIT_SAMPLED_ROWS = 8
CHUNKED_MIN = 32768
ONE_PROGRAM_MAX = 16384
# A program of the split sampled form compacts at most SAMPLED_CHUNK_MAX candidates: rows get more
# programs than the two an SM of :func:`split_programs` would give them where that is more. On an
# H100 (K = 2048, in a CUDA graph, rows selected in a third launch; us) 8 / 16 / 32 programs a row
# took 26.6 / 25.3 / 25.9 at batch 32 / 32K, 52.2 / 46.0 / 46.2 at batch 32 / 128K, and 4 / 16 / 32
# 40.5 / 40.7 / 41.3 at batch 128 / 32K, 8 / 32 / 64 117.3 / 114.9 / 116.8 at batch 128 / 128K.
SAMPLED_CHUNK_MAX = 2048
# The split sampled form selects a row in the segment launch (its last chunk to finish) where the
# launch has at most FINISH_IN_SEGMENTS_PER_SM programs an SM, else in a third launch: a segment
# kernel holding the select takes 255 registers (one 8-warp program an SM, by ptxas for sm_90),
# without it a few dozen. On an H100 (132 SMs; us) finished in segments / in a third launch: 128
# programs in all 21.7 / 22.1 (batch 4 / 32K), 22.1 / 22.3 (batch 8 / 32K), 22.8 / 24.0 (batch 32 /
# 16K); 256 programs 23.7 / 22.0 (batch 8 / 32K), 24.5 / 22.3 (batch 32 / 16K), 34.1 / 31.3 (batch
# 4 / 128K); at batch 128 / 32K with 512 programs 59.9 / 40.5.
FINISH_IN_SEGMENTS_PER_SM = 1
PATHS = ("resident", "row", "chunked", "sampled")
ONE_PROGRAM_PATHS = ("resident", "row")

_SELECT = "topk_select"


def _check_select(scores, k, page_table, req_ids, page_size, op=_SELECT) -> None:
    check_float(op, "scores", scores, 2, TRITON_FLOAT_DTYPES)
    check_int(op, "k", k, 0)
    if (page_table is None) != (req_ids is None):
        raise ValueError(f"{op}: page_table and req_ids come together (slots) or not at all (positions)")
    if page_table is not None:
        check_index(op, "page_table", page_table, 2)
        check_index(op, "req_ids", req_ids, 1)
        check_int(op, "page_size", page_size, 1)
        if req_ids.shape[0] != scores.shape[0]:
            raise ValueError(f"{op}: req_ids must have T = {scores.shape[0]} entries, got {tuple(req_ids.shape)}")
        if page_table.shape[1] * page_size != scores.shape[1]:
            raise ValueError(
                f"{op}: scores must have C = max_pages * page_size = {page_table.shape[1]} * {page_size} "
                f"columns, got {scores.shape[1]}"
            )
        check_same_device(op, scores=scores, page_table=page_table, req_ids=req_ids)


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
    check_remap_args(dcp_size, rank, interleave, "topk_select_remap")
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
#
# (Wider digits would save passes, e.g. 11 + 11 + 10 bits, but tl.histogram's cost grows with its
# bins: per 32 keys a ballot per bit of the bin and a popcount per bin a lane owns, 8 bins a lane
# at 256 bins and 64 at 2048.)


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
    """One 8-bit digit of the search from the pass's histogram: (prefix, need, done)."""
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
def _select_tiled(row, C, K, need, out_row, count_ptr, page_row, RANK, PAGE: tl.constexpr, HAS_PT: tl.constexpr,
                  REMAP: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """One program selects row ``row`` of C scores, reading it in BLOCK-candidate tiles: four
    8-bit radix passes (each a read of the row) and one writing read."""
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
    _, sel, own = _write_selected(row, 0, C, prefix, 24 - 8 * level, need, active, zero, zero, zero, out_row,
                                  page_row, RANK, PAGE, HAS_PT, REMAP, DCP_SIZE, INTERLEAVE, BLOCK)  # fmt: skip
    _write_tail(out_row, count_ptr, own if REMAP else sel, K, REMAP, BLOCK)


@triton.jit
def _topk_row_kernel(
    scores_ptr, out_ptr, count_ptr, pt_ptr, req_ptr, C, K, R, RANK, stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (T,): one program selects a whole row (the passes read it again from L1/L2)."""
    t = tl.program_id(0).to(tl.int64)
    _select_tiled(scores_ptr + t * stride_s, C, K, _row_need(req_ptr, t, C, K, R, HAS_PT), out_ptr + t * stride_o,
                  count_ptr + t, _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT), RANK, PAGE, HAS_PT, REMAP,
                  DCP_SIZE, INTERLEAVE, BLOCK)  # fmt: skip


@triton.jit
def _held_threshold(key, need, PREFIX_BITS: tl.constexpr = 32, TIE_FROM: tl.constexpr = TIE_CHECK_FROM,
                    TIE_EVERY: tl.constexpr = TIE_CHECK_EVERY, key2=None):
    """A threshold key for the ``need`` best of a register tensor of keys (at most 2**15 of them):
    either exactly ``need`` keys lie at or above it, or it is the ``need``-th best key with its
    bits below the top PREFIX_BITS cleared (with PREFIX_BITS = 32 the key itself; the tie check
    below may return the key itself for fewer bits too). Either way it is at or below the
    ``need``-th best key. 0 (``-inf``'s key) only when fewer than ``need`` keys are above 0; for
    ``need = 0`` no key is at or above it (or exactly none are).

    Found one bit a step, most significant first, each step one reduction: the count of keys at
    or above the prefix extended by a 1 bit; the bit is 1 where that count reaches ``need``, and
    the search stops once the keys at or above the prefix number exactly ``need`` (about 12 bits
    into 4K random keys). Keys equal to the ``need``-th best on both sides of the cut never leave
    exactly ``need`` at or above a prefix, so that stop does not come and the search would run all
    32 steps: at step TIE_FROM and every TIE_EVERY steps after, the same reduction also counts the
    keys above the prefix's floor (packed, 16 bits each), and the search stops with the floor
    when they are fewer than ``need`` (the floor, with ``need`` or more at or above it, is then
    the ``need``-th best key itself). With ``key2`` the keys are those of ``key`` and ``key2``
    together (a row held as two tiles, :func:`_topk_resident_kernel`)."""
    prefix = tl.cast(0, tl.uint32)
    thr = tl.cast(0, tl.uint32)
    have = tl.cast(-1, tl.int32)  # keys at or above thr, once a bit was 1
    done = need < 0
    for d in tl.static_range(PREFIX_BITS):
        if not done:
            SHIFT: tl.constexpr = 31 - d
            up = (prefix << 1) | 1
            if d >= TIE_FROM and (d - TIE_FROM) % TIE_EVERY == 0:
                packed = tl.sum(((key >= (up << SHIFT)).to(tl.uint32) << 16) | (key > thr).to(tl.uint32), axis=0)
                if key2 is not None:
                    packed += tl.sum(((key2 >= (up << SHIFT)).to(tl.uint32) << 16) | (key2 > thr).to(tl.uint32),
                                     axis=0)  # fmt: skip
                above = (packed >> 16).to(tl.int32)
                tied = (packed & 0xFFFF).to(tl.int32) < need  # thr is the need-th best key: keep it
            else:
                above = tl.sum((key >= (up << SHIFT)).to(tl.int32), axis=0)
                if key2 is not None:
                    above += tl.sum((key2 >= (up << SHIFT)).to(tl.int32), axis=0)
                tied = tl.cast(False, tl.int1)  # a constant: the selects below fold away
            bit = (above >= need) & ~tied
            prefix = tl.where(tied, prefix, tl.where(bit, up, prefix << 1))
            have = tl.where(bit, above, have)
            thr = tl.where(tied, thr, prefix << SHIFT)
            done = tied | (have == need)
    return thr


@triton.jit
def _select_held(key, pos, K, need, out_row, count_ptr, page_row, RANK, PAGE: tl.constexpr, HAS_PT: tl.constexpr,
                 REMAP: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, TAIL: tl.constexpr,
                 key2=None, pos2=None):
    """Select and write the ``need`` best of a register tensor of keys (at most 2**15 of them) whose
    lanes hold candidates in ascending position (lanes that hold nothing hold key 0); the tie rule
    and the output order follow the lanes. ``pos`` is each lane's candidate position, its slot
    read through ``page_row`` with ``HAS_PT``; without (``HAS_PT`` false) ``pos`` is written as
    it is: the positions, or their slots (-1 for none) where the caller resolved them. With
    ``key2`` the row is held as two tiles, ``key2`` / ``pos2`` after ``key`` / ``pos`` (together at
    most 2**15 lanes).

    Every key above the threshold (:func:`_held_threshold`) is selected, and the first
    ``need - (keys above it)`` equal to it: all of them where exactly ``need`` lie at or above
    it, none where it is ``-inf``'s key 0 (the row has fewer valid keys than ``need``). One scan
    of packed counts (keys above the threshold in the high 16 bits, equal to it in the low 16)
    gives every selected key its output column: the keys above it before it, plus its rank
    among the equal ones (:func:`_store_held`, a tile at a time)."""
    thr = _held_threshold(key, need, key2=key2)
    above = tl.sum((key > thr).to(tl.int32), axis=0)
    if key2 is not None:
        above += tl.sum((key2 > thr).to(tl.int32), axis=0)
    need = tl.where(thr == 0, 0, need - above)
    before, total = _store_held(key, pos, thr, need, tl.cast(0, tl.uint32), tl.cast(0, tl.int32), out_row, page_row,
                                RANK, PAGE, HAS_PT, REMAP, DCP_SIZE, INTERLEAVE)  # fmt: skip
    if key2 is not None:
        _, total = _store_held(key2, pos2, thr, need, before, total, out_row, page_row, RANK, PAGE, HAS_PT, REMAP,
                               DCP_SIZE, INTERLEAVE)  # fmt: skip
    _write_tail(out_row, count_ptr, total, K, REMAP, TAIL)


@triton.jit
def _store_held(key, pos, thr, need, before, written, out_row, page_row, RANK, PAGE: tl.constexpr,
                HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Write the selected lanes of one tile of a held row (:func:`_select_held`). ``before``: the
    packed counts of the tiles before it (keys above ``thr`` in the high 16 bits, equal in the low
    16); ``written``: the entries they wrote (the owned ones with ``REMAP``). Returns both with this
    tile's added."""
    gt = (key > thr).to(tl.uint32)
    eq = (key == thr).to(tl.uint32)
    packed = before + tl.cumsum((gt << 16) | eq, axis=0)  # inclusive; at most 2**15 lanes: no carry, no wrap
    eq_before = (packed & 0xFFFF).to(tl.int32) - eq.to(tl.int32)
    gt_before = (packed >> 16).to(tl.int32) - gt.to(tl.int32)
    sel = (gt != 0) | ((eq != 0) & (eq_before < need))
    slot = _slots_of(pos, sel, page_row, PAGE, HAS_PT)
    if REMAP:
        keep, row = _owned(slot, DCP_SIZE, RANK, INTERLEAVE)
        keep = keep & sel
        keep_i = keep.to(tl.int32)
        tl.store(out_row + written + tl.cumsum(keep_i, axis=0) - keep_i, row.to(tl.int32), mask=keep)
        written += tl.sum(keep_i, axis=0)
    else:
        tl.store(out_row + gt_before + tl.minimum(eq_before, need), tl.where(slot >= 0, slot, -1).to(tl.int32),
                 mask=sel)  # fmt: skip
        written += tl.sum(sel.to(tl.int32), axis=0)
    return before + tl.sum((gt << 16) | eq, axis=0), written


@triton.jit
def _topk_resident_kernel(
    scores_ptr, out_ptr, count_ptr, pt_ptr, req_ptr, C, K, R, RANK, stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, OVER: tl.constexpr, TAIL: tl.constexpr,
):
    """Grid (T,): one program selects a whole row held in registers (BLOCK + OVER >= C).

    The row is held as a tile of BLOCK candidates and, where OVER is not 0, a second tile of the
    OVER after them (:func:`resident_tiles`: a row just over a power of two is not held, and its
    count search not run, over twice its length). It is read once and its keys computed once,
    then selected in registers (:func:`_select_held`). Out-of-range lanes load ``-inf``: key 0,
    which is never selected, so only the load is masked; every key of a row without a request is
    made 0 after the load. The row's scores, its request id and its pages are all loaded before
    the select, none waiting on another but the pages on the id: the select of one row is a
    chain of dependent steps, and a load issued after it (the pages of the selected candidates)
    or before it on another load (the scores behind the request id) would add its latency to the
    chain."""
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_s
    x = tl.load(row + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < C, other=float("-inf"))
    if OVER > 0:
        x2 = tl.load(row + BLOCK + tl.arange(0, OVER), mask=BLOCK + tl.arange(0, OVER) < C, other=float("-inf"))
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    page_row = _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT)
    key, slot = _held_keys(x, 0, C, need, page_row, PAGE, HAS_PT, BLOCK)
    key2, slot2 = None, None
    if OVER > 0:
        key2, slot2 = _held_keys(x2, BLOCK, C, need, page_row, PAGE, HAS_PT, OVER)
    # the slots are resolved: the select takes them as its positions, without a page table
    _select_held(key, slot, K, need, out_ptr + t * stride_o, count_ptr + t, pt_ptr, RANK, PAGE, False, REMAP,
                 DCP_SIZE, INTERLEAVE, TAIL, key2, slot2)  # fmt: skip


@triton.jit
def _held_keys(x, start, C, need, page_row, PAGE: tl.constexpr, HAS_PT: tl.constexpr, BLOCK: tl.constexpr):
    """The keys and slots (int32, -1 for none) of the row's loaded candidates ``[start, start +
    BLOCK)``: key 0 past C and everywhere in a row without a request (``need`` 0). A page entry is
    shared by PAGE lanes: one load a page; int32 as written (half the registers an int64 slot held
    through the select would take)."""
    offs = start + tl.arange(0, BLOCK)
    slot = _slots_of(offs, tl.where(need > 0, offs < C, False), page_row, PAGE, HAS_PT).to(tl.int32)
    return tl.where(need > 0, _ordered_key(x.to(tl.float32)), 0), slot


@triton.jit
def _sample_threshold(row, C, need, SAMPLE: tl.constexpr, SIGMAS: tl.constexpr, PREFIX_BITS: tl.constexpr):
    """A key ``>= 1`` below which, with high probability, none of the row's ``need`` best lie: the
    r-th best of SAMPLE candidates taken one in ``ceil(C / SAMPLE)`` (at a hashed offset in
    each stride, so no period of the scores lines up with the sample), where r is the count the
    sample's share of the need would give plus SIGMAS standard deviations and 4. Only a guess:
    the caller checks it against the row's count. The search stops after the key's top
    PREFIX_BITS bits: the threshold lies between the floor of the bin that holds the r-th best
    and that key (1, every candidate but ``-inf``, where the sample holds fewer than r valid
    keys)."""
    i = tl.arange(0, SAMPLE)
    stride = (C + SAMPLE - 1) // SAMPLE
    jitter = (((i.to(tl.uint32) * 2654435761) >> 16) % stride.to(tl.uint32)).to(tl.int32)
    pos = i * stride + jitter
    valid = tl.where(need > 0, pos < C, False)
    key = _ordered_key(tl.load(row + pos, mask=valid, other=float("-inf")).to(tl.float32))
    n = tl.sum(valid.to(tl.int32), axis=0)
    share = need.to(tl.float32) * n.to(tl.float32) / C.to(tl.float32)
    r = tl.minimum((share + SIGMAS * tl.sqrt(share) + 4.0).to(tl.int32) + 1, n)
    return tl.maximum(_held_threshold(key, r, PREFIX_BITS), 1)


@triton.jit
def _compact(row, lo, hi, low, kbuf, pbuf, live, LARGE: tl.constexpr, BLOCK: tl.constexpr):
    """Store the keys (as int32 bits) and positions of the candidates of [lo, hi) whose key is at
    or above ``low`` at the front of the buffer, in position order, as far as LARGE entries;
    return how many there were (all of them, stored or not)."""
    lane = tl.arange(0, BLOCK)
    m = tl.cast(0, tl.int32)
    nxt = tl.load(row + lo + lane, mask=tl.where(live, lo + lane < hi, False), other=float("-inf"))
    for start in range(lo, hi, BLOCK):
        offs = start + lane
        key = _ordered_key(nxt.to(tl.float32))
        # the next tile's load is issued before this one's work
        nxt = tl.load(row + offs + BLOCK, mask=tl.where(live, offs + BLOCK < hi, False), other=float("-inf"))
        ge = key >= low
        ge_i = ge.to(tl.int32)
        at = m + tl.cumsum(ge_i, axis=0) - ge_i
        fits = ge & (at < LARGE)
        tl.store(kbuf + at, key.to(tl.int32, bitcast=True), mask=fits)
        tl.store(pbuf + at, offs, mask=fits)
        m += tl.sum(ge_i, axis=0)
    return m


@triton.jit
def _entry_at(i, start_row, SEG: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, LOG_CHUNKS: tl.constexpr):
    """Where entry ``i`` of a row's buffer lies. A buffer of one segment (``LOG_CHUNKS`` 0) holds
    it at ``i``; a buffer of segments (SEG entries each, chunk c's entries numbered from
    ``start_row[c]`` on, the starts ascending over BLOCK_CHUNKS chunks, padding chunks starting at
    the row's count) at ``c * SEG + i - start_row[c]`` for the chunk c that a binary search over
    the starts finds."""
    if LOG_CHUNKS == 0:
        return i
    c = tl.zeros(i.shape, dtype=tl.int32)
    for step in tl.static_range(LOG_CHUNKS):
        probe = c + (BLOCK_CHUNKS >> (step + 1))
        c = tl.where(tl.load(start_row + probe) <= i, probe, c)
    return c * SEG + i - tl.load(start_row + c)


@triton.jit
def _select_buffer(kbuf, pbuf, start_row, m, K, need, out_row, count_ptr, page_row, RANK, PAGE: tl.constexpr,
                   HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr,
                   LANES: tl.constexpr, TAIL: tl.constexpr, SEG: tl.constexpr,
                   BLOCK_CHUNKS: tl.constexpr, LOG_CHUNKS: tl.constexpr, SHARED: tl.constexpr):
    """Select the ``need`` best of the buffer's first ``m`` keys and positions (:func:`_entry_at`
    says where each lies), held in LANES lanes; with SHARED (other programs wrote the buffer) the
    loads bypass L1."""
    i = tl.arange(0, LANES)
    at = _entry_at(i, start_row, SEG, BLOCK_CHUNKS, LOG_CHUNKS)
    if SHARED:
        key = tl.load(kbuf + at, mask=i < m, other=0, cache_modifier=".cg")
        pos = tl.load(pbuf + at, mask=i < m, other=0, cache_modifier=".cg")
    else:
        key = tl.load(kbuf + at, mask=i < m, other=0)
        pos = tl.load(pbuf + at, mask=i < m, other=0)
    _select_held(key.to(tl.uint32, bitcast=True), pos, K, need, out_row, count_ptr, page_row, RANK, PAGE, HAS_PT,
                 REMAP, DCP_SIZE, INTERLEAVE, TAIL)  # fmt: skip


@triton.jit
def _select_buffered(row, C, K, need, low, m, kbuf, pbuf, start_row, out_row, count_ptr, route_ptr, page_row, RANK,
                     PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
                     INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, SMALL: tl.constexpr, LARGE: tl.constexpr,
                     TAIL: tl.constexpr, SEG: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
                     LOG_CHUNKS: tl.constexpr, SHARED: tl.constexpr):
    """Select the row from its buffer of the ``m`` candidates at or above ``low`` where that is
    safe (``m >= need``, or ``low`` lets every candidate but ``-inf`` through) and the buffer
    holds them (in registers over SMALL lanes, else LARGE), else by the exact tiled passes;
    ``route`` says which: 0, 1 or 2. The buffer holds every candidate at or above ``low`` in
    position order, so with ``m >= need`` it holds the best ``need`` and all their ties."""
    safe = (m >= need) | (low == 1)
    if safe & (m <= SMALL):
        tl.store(route_ptr, 0)
        _select_buffer(kbuf, pbuf, start_row, m, K, need, out_row, count_ptr, page_row, RANK, PAGE, HAS_PT, REMAP,
                       DCP_SIZE, INTERLEAVE, SMALL, TAIL, SEG, BLOCK_CHUNKS, LOG_CHUNKS, SHARED)  # fmt: skip
    elif safe & (m <= LARGE):
        tl.store(route_ptr, 1)
        _select_buffer(kbuf, pbuf, start_row, m, K, need, out_row, count_ptr, page_row, RANK, PAGE, HAS_PT, REMAP,
                       DCP_SIZE, INTERLEAVE, LARGE, TAIL, SEG, BLOCK_CHUNKS, LOG_CHUNKS, SHARED)  # fmt: skip
    else:
        tl.store(route_ptr, 2)
        _select_tiled(row, C, K, need, out_row, count_ptr, page_row, RANK, PAGE, HAS_PT, REMAP, DCP_SIZE,
                      INTERLEAVE, BLOCK)  # fmt: skip


@triton.jit
def _topk_sampled_kernel(
    scores_ptr, out_ptr, count_ptr, route_ptr, kbuf_ptr, pbuf_ptr, pt_ptr, req_ptr, C, K, R, RANK, stride_s,
    stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr, SIGMAS: tl.constexpr,
    PREFIX_BITS: tl.constexpr, SMALL: tl.constexpr, LARGE: tl.constexpr, TAIL: tl.constexpr,
):
    """Grid (T,): one program selects a long row from a sample's threshold.

    1. A threshold key from a sample of the row (:func:`_sample_threshold`).
    2. One read of the row compacts every candidate whose key is at or above it, in position
       order, into the row's buffer (:func:`_compact`: LARGE keys and positions; ``m`` counts
       them all).
    3. The row is selected from the buffer, or by the tiled passes where the buffer cannot hold
       the selection (:func:`_select_buffered`, which writes ``route[t]``)."""
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_s
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    kbuf = kbuf_ptr + t * LARGE
    pbuf = pbuf_ptr + t * LARGE
    low = _sample_threshold(row, C, need, SAMPLE, SIGMAS, PREFIX_BITS)
    m = _compact(row, 0, C, low, kbuf, pbuf, need > 0, LARGE, BLOCK)
    tl.debug_barrier()  # the buffer's stores before any lane reads them
    _select_buffered(row, C, K, need, low, m, kbuf, pbuf, kbuf, out_ptr + t * stride_o, count_ptr + t,
                     route_ptr + t, _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT), RANK, PAGE, HAS_PT, REMAP,
                     DCP_SIZE, INTERLEAVE, BLOCK, SMALL, LARGE, TAIL, LARGE, 1, 0, False)  # fmt: skip


# The sampled path with each row split over chunks: the rows' thresholds, then the chunks' segments,
# the row selected from its segments by the last of its chunks to finish (two launches) or by a third
# launch; no program waits for another.


@triton.jit
def _topk_sample_kernel(scores_ptr, low_ptr, arrived_ptr, req_ptr, C, K, R, stride_s, HAS_PT: tl.constexpr,
                        SAMPLE: tl.constexpr, SIGMAS: tl.constexpr, PREFIX_BITS: tl.constexpr):
    """Grid (T,): row t's threshold key (:func:`_sample_threshold`) into ``low[t]``, and its
    count of finished chunks zeroed."""
    t = tl.program_id(0).to(tl.int64)
    low = _sample_threshold(scores_ptr + t * stride_s, C, _row_need(req_ptr, t, C, K, R, HAS_PT), SAMPLE, SIGMAS,
                            PREFIX_BITS)  # fmt: skip
    tl.store(low_ptr + t, low.to(tl.int32, bitcast=True))
    tl.store(arrived_ptr + t, 0)


@triton.jit
def _finish_segments(row, t, need, low, cnt_ptr, start_ptr, sk_ptr, sp_ptr, out_ptr, count_ptr, route_ptr, pt_ptr,
                     req_ptr, C, K, R, RANK, NCHUNK, stride_pt, stride_o,
                     PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
                     INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
                     LOG_CHUNKS: tl.constexpr, SEG: tl.constexpr, SMALL: tl.constexpr, LARGE: tl.constexpr,
                     TAIL: tl.constexpr, SHARED: tl.constexpr):
    """Row t selected from its segments, read in chunk order where they lie (:func:`_select_buffered`
    over :func:`_entry_at`; with SHARED, written by other programs of this launch, bypassing L1),
    after its chunks' starts are stored. A chunk's count exceeds SEG only if the row's exceeds
    LARGE (SEG = min(chunk, LARGE)), and then the tiled passes select the row: every entry the
    buffer routes read was stored."""
    chunks = tl.arange(0, BLOCK_CHUNKS)
    if SHARED:
        counts = tl.load(cnt_ptr + t * NCHUNK + chunks, mask=chunks < NCHUNK, other=0, cache_modifier=".cg")
    else:
        counts = tl.load(cnt_ptr + t * NCHUNK + chunks, mask=chunks < NCHUNK, other=0)
    start_row = start_ptr + t * BLOCK_CHUNKS
    tl.store(start_row + chunks, tl.cumsum(counts, axis=0) - counts)  # padding chunks start at m
    tl.debug_barrier()  # the starts' stores before any lane reads them
    _select_buffered(row, C, K, need, low, tl.sum(counts, axis=0), sk_ptr + t * NCHUNK * SEG, sp_ptr + t * NCHUNK * SEG,
                     start_row, out_ptr + t * stride_o, count_ptr + t, route_ptr + t,
                     _page_row(pt_ptr, req_ptr, t, R, stride_pt, HAS_PT), RANK, PAGE, HAS_PT, REMAP, DCP_SIZE,
                     INTERLEAVE, BLOCK, SMALL, LARGE, TAIL, SEG, BLOCK_CHUNKS, LOG_CHUNKS, SHARED)  # fmt: skip


@triton.jit
def _topk_segment_kernel(
    scores_ptr, low_ptr, arrived_ptr, cnt_ptr, start_ptr, sk_ptr, sp_ptr, out_ptr, count_ptr, route_ptr, pt_ptr,
    req_ptr, C, K, R, RANK, CHUNK, NCHUNK, stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, LOG_CHUNKS: tl.constexpr,
    SEG: tl.constexpr, SMALL: tl.constexpr, LARGE: tl.constexpr, TAIL: tl.constexpr,
    FINISH: tl.constexpr,
):
    """Grid (T, NCHUNK): chunk j of row t compacts its candidates at or above ``low[t]`` into its
    own segment of the row's buffer (at most SEG of them, :func:`_compact`) and stores how many
    there were (all of them) in ``cnt[t, j]``.

    With FINISH the chunk then counts itself finished in ``arrived[t]`` (after a barrier of its
    lanes' stores, acquire-release), and the row's last chunk to finish selects the row
    (:func:`_finish_segments`). Without it the kernel holds no select (a few dozen registers, so
    many programs an SM compact at once) and ``_topk_finish_segments_kernel`` selects the rows."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = scores_ptr + t * stride_s
    need = _row_need(req_ptr, t, C, K, R, HAS_PT)
    lo = j * CHUNK
    seg = (t * NCHUNK + j) * SEG
    low = tl.load(low_ptr + t).to(tl.uint32, bitcast=True)
    n = _compact(row, lo, tl.minimum(lo + CHUNK, C), low, sk_ptr + seg, sp_ptr + seg, need > 0, SEG, BLOCK)
    tl.store(cnt_ptr + t * NCHUNK + j, n)
    if FINISH:
        tl.debug_barrier()  # every lane's stores before the arrival (released by it)
        if tl.atomic_add(arrived_ptr + t, 1, sem="acq_rel") == NCHUNK - 1:
            _finish_segments(row, t, need, low, cnt_ptr, start_ptr, sk_ptr, sp_ptr, out_ptr, count_ptr, route_ptr,
                             pt_ptr, req_ptr, C, K, R, RANK, NCHUNK, stride_pt, stride_o, PAGE, HAS_PT, REMAP,
                             DCP_SIZE, INTERLEAVE, BLOCK, BLOCK_CHUNKS, LOG_CHUNKS, SEG, SMALL, LARGE, TAIL,
                             True)  # fmt: skip


@triton.jit
def _topk_finish_segments_kernel(
    scores_ptr, low_ptr, cnt_ptr, start_ptr, sk_ptr, sp_ptr, out_ptr, count_ptr, route_ptr, pt_ptr, req_ptr, C, K, R,
    RANK, NCHUNK, stride_s, stride_pt, stride_o,
    PAGE: tl.constexpr, HAS_PT: tl.constexpr, REMAP: tl.constexpr, DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, LOG_CHUNKS: tl.constexpr,
    SEG: tl.constexpr, SMALL: tl.constexpr, LARGE: tl.constexpr, TAIL: tl.constexpr,
):
    """Grid (T,): row t selected from its segments (:func:`_finish_segments`), after the segment
    launch without FINISH."""
    t = tl.program_id(0).to(tl.int64)
    _finish_segments(scores_ptr + t * stride_s, t, _row_need(req_ptr, t, C, K, R, HAS_PT),
                     tl.load(low_ptr + t).to(tl.uint32, bitcast=True), cnt_ptr, start_ptr, sk_ptr, sp_ptr, out_ptr,
                     count_ptr, route_ptr, pt_ptr, req_ptr, C, K, R, RANK, NCHUNK, stride_pt, stride_o, PAGE, HAS_PT,
                     REMAP, DCP_SIZE, INTERLEAVE, BLOCK, BLOCK_CHUNKS, LOG_CHUNKS, SEG, SMALL, LARGE, TAIL,
                     False)  # fmt: skip


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


def split_programs(T: int, C: int, device: torch.device) -> int:
    """Programs a row when rows are split: about two programs an SM, each over 1024 candidates or
    more, at least two (one off the GPU, where nothing runs in parallel)."""
    if device.type != "cuda":
        return 1
    return max(2, min(cdiv(2 * sm_count(device), T), C // 1024))


def split_chunk(C: int, ns: int, block: int) -> int:
    """Candidates a program of a row split over about ``ns`` programs reads: whole tiles of
    ``block``, as many as lie nearest ``C / ns`` (at least one); the row then takes ``cdiv(C,
    chunk)`` programs. Rounding up would halve the programs of a row just past a multiple of
    ``ns`` tiles: a decode row at 32K tokens (32,832 candidates in pages of 64) split 32 ways in
    tiles of 1,024 would take 17 programs of 2,048 instead of 33 of 1,024."""
    return max(1, round(C / (ns * block))) * block


def _default_plan(T: int, C: int, device: torch.device) -> tuple[str, int]:
    """(path, programs a row) the launcher takes for T rows of C candidates.

    Up to RESIDENT_MAX candidates one program holds its row (resident). Longer rows are split
    (:func:`split_programs`): one or two rows (under CHUNKED_ROWS) of over CHUNKED_MIN candidates
    by the chunked passes, the rest by the split sampled form (at least one program per
    SAMPLED_CHUNK_MAX candidates), except that SPLIT_SAMPLED_ROWS rows or more of up to
    ONE_PROGRAM_MAX candidates that would get at most four programs each keep one program a row
    (sampled). On an H200 (K = 2048, in a CUDA graph, fp32 randn scores, ``bench indexer --only
    topk``; us; the split sampled form in three launches then): chunked / split sampled at batch 8 were 27.2 / 25.7 (16K), 29.2 / 29.4
    (32K), 57.4 / 43.5 (128K); one program / split sampled at batch 32 35.3 / 30.0, 51.7 / 33.8,
    142.9 / 63.5, and at batch 128 (three programs a row) 32.7 / 36.5, 52.4 / 49.8, 170.6 / 135.8.
    The choices under SPLIT_SAMPLED_ROWS rows are measured at the constants above."""
    if C <= RESIDENT_MAX:
        return "resident", 1
    ns = split_programs(T, C, device)
    if ns == 1 or (C <= ONE_PROGRAM_MAX and ns <= 4 and T >= SPLIT_SAMPLED_ROWS):
        return "sampled", 1
    if T < CHUNKED_ROWS and C > CHUNKED_MIN:
        return "chunked", ns
    return "sampled", max(ns, cdiv(C, SAMPLED_CHUNK_MAX))


def resident_tiles(C: int) -> tuple[int, int]:
    """(BLOCK, OVER) of the resident kernel for rows of C candidates: one tile of the next power of
    two, or, for a row at most RESIDENT_OVER_MAX past a power of two, a tile of that power of two
    and one of the next power of two over the rest (at least 16): a decode row at 4,096 cached
    tokens holds 4,097 positions, 4,160 candidates in pages of 64, held as 4,096 + 64 lanes
    instead of 8,192."""
    block = max(next_pow2(C), 16)
    low = block // 2
    if low >= 16 and C - low <= RESIDENT_OVER_MAX * low:
        return low, max(next_pow2(C - low), 16)
    return block, 0


def _resident_warps(block: int) -> int:
    """Warps of the resident kernel (4-bit digits): 4 up to 4096 candidates, 8 up to 8192, 16 up to
    16384, 32 above. Measured on an H200 (us, K = 2048; batch 1 and batch 128): 4 / 8 / 16 warps at
    4K 7.7 / 7.9 / 8.5 and 11.4 / 10.9 / 11.2, 8 / 16 / 32 warps at 8K 14.0 / 16.3 / 17.5 and
    18.0 / 20.9 / 22.1, at 16K 35.2 / 25.5 / 31.1 and 41.8 / 32.6 / 39.9, at 32K (batch 128)
    172.8 / 108.0 / 82.7."""
    return 4 if block <= 4096 else 8 if block <= 8192 else 16 if block <= 16384 else 32


def _sampled_sizes(C: int, k: int) -> tuple[int, int, int]:
    """(SAMPLE, SMALL, LARGE) of the sampled kernel for rows of C candidates: a sample of one
    candidate in SAMPLE_EVERY (16 to SAMPLE_MAX of them), and buffers of twice the selection and
    twice that (at most RESIDENT_LIMIT, where the packed counts of the held select end)."""
    sample = min(max(next_pow2(cdiv(C, SAMPLE_EVERY)), 16), SAMPLE_MAX)
    small = min(max(next_pow2(2 * min(k, C)), 16), RESIDENT_LIMIT)
    return sample, small, min(2 * small, RESIDENT_LIMIT)


def _launch_select(scores, k, page_table, req_ids, page_size, remap, *, chunks=None, block=None, num_warps=None,
                   path=None, route=None):  # fmt: skip
    """Shared launcher of topk_select_triton and topk_select_remap_triton; returns (out, count).
    ``route`` (int32 ``[T]``, for tests) receives the sampled kernel's route of each row."""
    if path is not None and path not in PATHS:
        raise ValueError(f"topk_select: path must be one of {PATHS} or None, got {path!r}")
    if path in ONE_PROGRAM_PATHS and chunks not in (None, 1):
        raise ValueError(f"topk_select: path={path!r} runs one program a row, got chunks={chunks}")
    if block is not None and (block < 8 or block & (block - 1)):
        raise ValueError(f"topk_select: block must be a power of two >= 8, got {block}")
    T, C = scores.shape
    if path == "resident" and C > RESIDENT_LIMIT:
        raise ValueError(f"topk_select: path='resident' holds at most {RESIDENT_LIMIT} candidates a row, got {C}")
    device = scores.device
    out = torch.empty((T, k), dtype=torch.int32, device=device)
    count = torch.empty((T,), dtype=torch.int32, device=device)  # every path writes it (no fill launch)
    if T == 0 or k == 0:
        return out, count.zero_()
    if C == 0:
        return out.fill_(-1), count.zero_()
    check_launchable(_topk_row_kernel, scores)
    dcp_size, rank, interleave = remap or (1, 0, 1)
    has_pt = page_table is not None
    scores = last_dim_contiguous(scores)
    pt = last_dim_contiguous(page_table) if has_pt else out  # placeholder pointers when unused
    req = req_ids.contiguous() if has_pt else count
    stride_pt = pt.stride(0) if has_pt else 0
    rows = page_table.shape[0] if has_pt else 1
    if path is None and chunks is None:
        path, ns = _default_plan(T, C, device)
    elif path is None:
        path, ns = ("chunked" if chunks > 1 else "resident" if C <= RESIDENT_MAX else "sampled"), chunks
    else:
        ns = 1 if path in ONE_PROGRAM_PATHS else chunks or 1
    common = dict(PAGE=page_size, HAS_PT=has_pt, REMAP=remap is not None, DCP_SIZE=dcp_size,
                  INTERLEAVE=interleave)  # fmt: skip
    if path == "resident":
        res, over = resident_tiles(C)
        _topk_resident_kernel[(T,)](
            scores, out, count, pt, req, C, k, rows, rank, scores.stride(0), stride_pt, out.stride(0),
            **common, BLOCK=res, OVER=over, TAIL=max(res, min(next_pow2(k), 2048)),
            num_warps=num_warps or _resident_warps(res),
        )  # fmt: skip
        return out, count
    interpreted = is_interpreted(_topk_row_kernel)
    blk = block or (32 if interpreted else (2048 if path == "row" or (path == "sampled" and ns == 1) else 1024))
    common["BLOCK"] = blk
    if path == "sampled":
        sample, small, large = _sampled_sizes(C, k)
        route = route if route is not None else torch.empty((T,), dtype=torch.int32, device=device)
        held = dict(SMALL=small, LARGE=large, TAIL=max(16, min(next_pow2(k), 2048)))
        warps = num_warps or _resident_warps(large)
        if ns == 1:
            kbuf = torch.empty((T, large), dtype=torch.int32, device=device)
            pbuf = torch.empty((T, large), dtype=torch.int32, device=device)
            _topk_sampled_kernel[(T,)](
                scores, out, count, route, kbuf, pbuf, pt, req, C, k, rows, rank, scores.stride(0), stride_pt,
                out.stride(0), **common, SAMPLE=sample, SIGMAS=SAMPLE_SIGMAS, PREFIX_BITS=SAMPLE_PREFIX_BITS, **held,
                num_warps=warps,
            )  # fmt: skip
            return out, count
        chunk = split_chunk(C, ns, blk)
        ns = cdiv(C, chunk)
        low = torch.empty((T,), dtype=torch.int32, device=device)
        arrived = torch.empty((T,), dtype=torch.int32, device=device)  # zeroed by the sample kernel
        cnt = torch.empty((T, ns), dtype=torch.int32, device=device)
        _topk_sample_kernel[(T,)](scores, low, arrived, req, C, k, rows, scores.stride(0), HAS_PT=has_pt,
                                  SAMPLE=sample, SIGMAS=SAMPLE_SIGMAS, PREFIX_BITS=SAMPLE_PREFIX_BITS,
                                  num_warps=_resident_warps(sample))  # fmt: skip
        seg = min(chunk, large)
        sk = torch.empty((T, ns, seg), dtype=torch.int32, device=device)
        sp = torch.empty((T, ns, seg), dtype=torch.int32, device=device)
        start = torch.empty((T, next_pow2(ns)), dtype=torch.int32, device=device)
        finish = T * ns <= FINISH_IN_SEGMENTS_PER_SM * max(sm_count(device), 1)
        segments = dict(BLOCK_CHUNKS=next_pow2(ns), LOG_CHUNKS=next_pow2(ns).bit_length() - 1, SEG=seg, **held)
        _topk_segment_kernel[(T, ns)](
            scores, low, arrived, cnt, start, sk, sp, out, count, route, pt, req, C, k, rows, rank, chunk, ns,
            scores.stride(0), stride_pt, out.stride(0), **common, **segments, FINISH=finish,
            num_warps=num_warps or (warps if finish else 4),
        )  # fmt: skip
        if not finish:
            _topk_finish_segments_kernel[(T,)](
                scores, low, cnt, start, sk, sp, out, count, route, pt, req, C, k, rows, rank, ns, scores.stride(0),
                stride_pt, out.stride(0), **common, **segments, num_warps=warps,
            )  # fmt: skip
        return out, count
    if path == "row":
        _topk_row_kernel[(T,)](
            scores, out, count, pt, req, C, k, rows, rank, scores.stride(0), stride_pt, out.stride(0),
            **common, num_warps=num_warps or 8,
        )  # fmt: skip
        return out, count
    warps = num_warps or 4
    chunk = split_chunk(C, ns, blk)
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
    path: str | None = None,
) -> torch.Tensor:
    """Triton radix top-k (see module docstring). No host sync, no data-dependent shapes.

    Four paths, all selecting the same set:

    - ``"resident"`` (grid (T,)): one program holds its whole row in registers (a tensor of
      ``next_pow2(C)`` candidates), reads it once, runs the radix passes on it and writes the
      selection with one scan. The default for one program a row when ``C <= RESIDENT_MAX``.
    - ``"sampled"`` (grid (T,)): one program a row takes a threshold from a sample of the row,
      compacts the candidates at or above it into a buffer with one read, and selects the buffer
      as the resident path selects a row; the row path's passes where the buffer cannot hold
      the selection (:func:`_topk_sampled_kernel`). With ``chunks`` > 1 the compaction is split
      over programs (``_topk_sample_kernel``, then ``_topk_segment_kernel``, whose last program
      of a row to finish selects the row, or with many programs ``_topk_finish_segments_kernel``).
    - ``"row"`` (grid (T,)): one program a row that reads the row again in ``block``-candidate
      tiles for each pass and for the write.
    - ``"chunked"``: each row split into ``chunks`` chunks; four histogram passes (grid (T, chunks)
      each, per-row histograms through integer atomics into a zeroed ``[T, 4, 256]`` workspace;
      later passes skip their work when an earlier one settled the threshold) and one write launch.

    ``chunks`` programs a row: 1 means one program a row (resident or sampled by ``C``), more the
    chunked path (or the split sampled one with ``path="sampled"``); with neither set, the
    launcher picks both (:func:`_default_plan`), and a path forced without ``chunks`` runs one
    program a row. ``path`` forces a path (``"resident"`` and ``"row"`` take no
    ``chunks`` > 1; ``"resident"`` at most ``RESIDENT_LIMIT`` candidates a row). ``block``
    candidates are read a tile by the row, sampled and chunked paths (a power of two >= 8; the
    resident path ignores it). ``num_warps`` overrides the warps of any path.
    """
    _check_select(scores, k, page_table, req_ids, page_size)
    out, _ = _launch_select(scores, k, page_table, req_ids, page_size, None, chunks=chunks, block=block,
                            num_warps=num_warps, path=path)  # fmt: skip
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
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k fused with the DCP remap (see module docstring): the launches of
    :func:`topk_select_triton` (the same paths and keywords), the write keeping only owned slots
    as local rows. No host sync."""
    _check_select(scores, k, page_table, req_ids, page_size, "topk_select_remap")
    check_remap_args(dcp_size, rank, interleave, "topk_select_remap")
    return _launch_select(scores, k, page_table, req_ids, page_size, (dcp_size, rank, interleave),
                          chunks=chunks, block=block, num_warps=num_warps, path=path)  # fmt: skip
