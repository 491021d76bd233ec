"""Run-time checks for ``options["debug_checks"]``: slots in range, the same top-k on every rank.

Off by default. When on, the DCP rewrite calls ``check_topk`` on each attention layer's top-k
before its remap: it raises ``DCPRuntimeCheckError`` naming the layer and the row when a slot is
outside ``[-1, num_slots)`` or when the ranks disagree on a row's top-k (a per-row checksum is
all-gathered over the group). It synchronizes with the host, so it is for debugging only: the
validator refuses it together with CUDA graphs or Inductor.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DCPRuntimeCheckError(RuntimeError):
    """A debug check failed while the compiled step ran."""


def topk_checksum(topk: Tensor) -> Tensor:
    """One int64 per row that changes when any entry or its position changes."""
    weights = torch.arange(1, topk.shape[1] + 1, device=topk.device, dtype=torch.int64)
    return ((topk.long() + 2) * weights).sum(dim=1) * 1_000_003 + topk.shape[1]


def check_topk(topk: Tensor, num_slots: int, layer: int, dcp_size: int, group_name: str) -> None:
    bad = (topk < -1) | (topk >= num_slots)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row} holds top-k slot {int(topk[row, col])} at position {col}, outside "
            f"[-1, {num_slots})"
        )
    c10d = torch.ops._c10d_functional
    sums = c10d.wait_tensor(c10d.all_gather_into_tensor(topk_checksum(topk), dcp_size, group_name))
    sums = sums.view(dcp_size, -1)
    differ = (sums != sums[0]).any(dim=0)
    if bool(differ.any()):
        row = int(differ.nonzero()[0])
        ranks = [r for r in range(dcp_size) if sums[r, row] != sums[0, row]]
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row}: ranks {ranks} computed a different top-k than rank 0; every rank must "
            f"compute the same global top-k (is the indexer or its key cache different on some rank?)"
        )
