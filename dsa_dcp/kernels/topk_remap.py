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

from ._common import check_index, check_launchable, next_pow2

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
def _topk_remap_kernel(
    topk_ptr,
    local_ptr,
    count_ptr,
    K,
    DCP_SIZE,
    RANK,
    INTERLEAVE,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * K
    kept = 0
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        in_row = offs < K
        s = tl.load(topk_ptr + base + offs, mask=in_row, other=-1).to(tl.int64)
        valid = in_row & (s >= 0)
        s = tl.where(valid, s, 0)  # integer // and % below are only floor-exact for s >= 0
        keep = valid & ((s // INTERLEAVE) % DCP_SIZE == RANK)
        lrow = (s // (DCP_SIZE * INTERLEAVE)) * INTERLEAVE + s % INTERLEAVE
        keep_i = keep.to(tl.int32)
        # exclusive prefix sum of the keep mask, shifted by what earlier blocks kept
        pos = kept + tl.cumsum(keep_i, axis=0) - keep_i
        tl.store(local_ptr + base + pos, lrow.to(tl.int32), mask=keep)
        kept += tl.sum(keep_i, axis=0)
    # the tail: columns [kept, K) are -1 (disjoint from the columns written above)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        tl.store(local_ptr + base + offs, tl.full([BLOCK_K], -1, tl.int32), mask=(offs < K) & (offs >= kept))
    tl.store(count_ptr + row, kept)


def topk_remap_triton(
    topk: torch.Tensor, dcp_size: int, rank: int, interleave: int = 1, *, block_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k remap, one program per row (see module docstring). No host sync.

    ``block_k`` (a power of two) overrides the K tile; the default covers up to 1024 entries a step.
    """
    _check(topk, dcp_size, rank, interleave)
    B, K = topk.shape
    local = torch.empty((B, K), dtype=torch.int32, device=topk.device)
    count = torch.zeros((B,), dtype=torch.int32, device=topk.device)
    if B == 0 or K == 0:
        local.fill_(-1)
        return local, count
    check_launchable(_topk_remap_kernel, topk)
    block = block_k or min(next_pow2(K), 1024)
    if block & (block - 1):
        raise ValueError(f"{_OP}: block_k must be a power of two, got {block}")
    _topk_remap_kernel[(B,)](topk.contiguous(), local, count, K, dcp_size, rank, interleave, BLOCK_K=block)
    return local, count
