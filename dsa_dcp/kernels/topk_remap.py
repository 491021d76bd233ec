"""Top-k remap: global top-k slots -> this rank's local rows, compacted to the front of each row.

Contract (both implementations):

``topk_remap(topk[B, K] int32|int64, dcp_size N, rank r, interleave I) -> (local[B, K] int32, count[B] int32)``

Keeps the entries of each row that rank ``r`` owns (``owner(s) == r``, ``s >= 0``; negative
entries are "no slot" and never kept), converts them to local rows (``local_row(s)``), moves
them to the front of the row in their original order, fills the tail with ``-1`` and returns
the number kept per row. The mapping is the one in :mod:`dsa_dcp.slots`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_dcp.slots import local_row, owner

from ._common import cdiv, check_index, check_launchable, next_pow2

_OP = "topk_remap"


def _check(topk: torch.Tensor, dcp_size: int, rank: int, interleave: int) -> None:
    check_index(_OP, "topk", topk, 2)
    for name, v in (("dcp_size", dcp_size), ("rank", rank), ("interleave", interleave)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{_OP}: {name} must be a Python int, got {v!r}")
    if dcp_size < 1:
        raise ValueError(f"{_OP}: dcp_size must be >= 1, got {dcp_size}")
    if not 0 <= rank < dcp_size:
        raise ValueError(f"{_OP}: rank must be in [0, {dcp_size}), got {rank}")
    if interleave < 1:
        raise ValueError(f"{_OP}: interleave must be >= 1, got {interleave}")


def topk_remap_reference(
    topk: torch.Tensor, dcp_size: int, rank: int, interleave: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch top-k remap (see module docstring). No host sync."""
    _check(topk, dcp_size, rank, interleave)
    B, K = topk.shape
    slots = topk.to(torch.int64)
    safe = slots.clamp(min=0)
    keep = (slots >= 0) & (owner(safe, dcp_size, interleave) == rank)
    rows = local_row(safe, dcp_size, interleave).to(torch.int32)
    # Stable compaction: kept entry j goes to column (number kept before j); the rest go to a
    # spill column K that is cut off afterwards.
    pos = torch.cumsum(keep.to(torch.int64), dim=1) - 1
    dest = torch.where(keep, pos, torch.full_like(pos, K))
    local = torch.full((B, K + 1), -1, dtype=torch.int32, device=topk.device)
    local.scatter_(1, dest, torch.where(keep, rows, torch.full_like(rows, -1)))
    count = keep.sum(dim=1, dtype=torch.int32)
    return local[:, :K].contiguous(), count


@triton.jit
def _owned(s, DCP_SIZE: tl.constexpr, RANK, INTERLEAVE: tl.constexpr):
    """(keep, local row) of the slots ``s``; negative (or masked, loaded as -1) slots are not kept."""
    valid = s >= 0
    s = tl.where(valid, s, 0)  # integer // and % are only floor-exact for s >= 0
    keep = valid & ((s // INTERLEAVE) % DCP_SIZE == RANK)
    return keep, (s // (DCP_SIZE * INTERLEAVE)) * INTERLEAVE + s % INTERLEAVE


@triton.jit
def _topk_remap_kernel(
    topk_ptr,
    local_ptr,
    count_ptr,
    K,
    RANK,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (B, ceil(K / BLOCK_K)): program (b, j) compacts columns [j*BLOCK_K, (j+1)*BLOCK_K) of row b.

    Every program reads the whole row (ROW_BLOCK >= K, one load, no loop) to learn how many
    entries before its block are kept and how many the row keeps in all, so the programs of one
    row need no communication. Slot arithmetic stays in the top-k dtype (int32 for int32 top-k)
    and N and I are compile-time constants, so // and % by powers of two are shifts and masks.
    """
    row = tl.program_id(0).to(tl.int64)
    k_start = tl.program_id(1) * BLOCK_K
    base = row * K
    offs = k_start + tl.arange(0, BLOCK_K)
    s = tl.load(topk_ptr + base + offs, mask=offs < K, other=-1)
    keep, lrow = _owned(s, DCP_SIZE, RANK, INTERLEAVE)
    keep_i = keep.to(tl.int32)
    if ROW_BLOCK == BLOCK_K:  # one program per row
        before = 0
        total = tl.sum(keep_i, axis=0)
    else:
        offs_row = tl.arange(0, ROW_BLOCK)
        keep_row, _ = _owned(tl.load(topk_ptr + base + offs_row, mask=offs_row < K, other=-1), DCP_SIZE, RANK, INTERLEAVE)
        keep_row = keep_row.to(tl.int32)
        before = tl.sum(tl.where(offs_row < k_start, keep_row, 0), axis=0)
        total = tl.sum(keep_row, axis=0)
    # kept entries go to [before, before + kept here) in order; this block's columns past the
    # row's total are the -1 tail (the two sets of columns written are disjoint across programs)
    pos = before + tl.cumsum(keep_i, axis=0) - keep_i
    tl.store(local_ptr + base + pos, lrow.to(tl.int32), mask=keep)
    tl.store(local_ptr + base + offs, tl.full([BLOCK_K], -1, tl.int32), mask=(offs < K) & (offs >= total))
    if tl.program_id(1) == 0:
        tl.store(count_ptr + row, total)


def _default_block(B: int, K: int) -> int:
    """Columns per program: a whole row when there are rows enough to fill the GPU, else 256.

    (Swept on one H200 at K = 2048: 256 columns a program was the fastest below B = 128.)
    """
    row = next_pow2(K)
    return row if B >= 128 else min(row, 256)


def topk_remap_triton(
    topk: torch.Tensor, dcp_size: int, rank: int, interleave: int = 1, *, block_k: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k remap; grid (B, ceil(K / block_k)) (see module docstring). No host sync.

    ``block_k`` (a power of two) overrides the columns per program; ``num_warps`` the warps.
    """
    _check(topk, dcp_size, rank, interleave)
    B, K = topk.shape
    local = torch.empty((B, K), dtype=torch.int32, device=topk.device)
    count = torch.zeros((B,), dtype=torch.int32, device=topk.device)
    if B == 0 or K == 0:
        local.fill_(-1)
        return local, count
    check_launchable(_topk_remap_kernel, topk)
    row_block = next_pow2(K)
    block = min(block_k or _default_block(B, K), row_block)
    if block & (block - 1):
        raise ValueError(f"{_OP}: block_k must be a power of two, got {block}")
    _topk_remap_kernel[(B, cdiv(K, block))](
        topk.contiguous(), local, count, K, rank,
        DCP_SIZE=dcp_size, INTERLEAVE=interleave, ROW_BLOCK=row_block, BLOCK_K=block,
        num_warps=num_warps or 4,
    )  # fmt: skip
    return local, count
