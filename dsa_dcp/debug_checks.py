"""Run-time checks for ``options["debug_checks"]``: slots in range, the same top-k on every rank.

Off by default. When on, the DCP rewrite calls ``check_topk`` on each attention layer's top-k
before its remap: it raises ``DCPRuntimeCheckError`` naming the layer and the row when a slot is
outside ``[-1, num_slots)`` or when the ranks disagree on a row's top-k. It synchronizes with the
host, so it is for debugging only: the validator refuses it together with CUDA graphs or Inductor.

The ranks compare the top-k rows themselves, all-gathered over the group, entry by entry: no
summary of a row (a sum, a checksum, a hash) can tell every two different rows apart, and a
linear one cannot tell ``[5, 7]`` from ``[7, 6]``. The rows are small (``B * K`` ids a rank and a
layer: 0.5 MiB of int32 at B = 64, K = 2048), and a debug check that already waits for the host
can afford to move them; exactness is worth more here than the bandwidth a hash would save.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DCPRuntimeCheckError(RuntimeError):
    """A debug check failed while the compiled step ran."""


def gather_topk(topk: Tensor, dcp_size: int, group_name: str) -> Tensor:
    """Every rank's ``topk[B, K]``, as ``[N, B, K]``, in its own dtype (nothing rounded)."""
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(topk.contiguous(), dcp_size, group_name))
    return gathered.view(dcp_size, *topk.shape)


def check_topk(topk: Tensor, num_slots: int, layer: int, dcp_size: int, group_name: str) -> None:
    # gathered first: every rank checks every rank's rows, so all of them raise the same error or
    # none does (a rank raising alone would leave the others waiting in the next collective)
    rows = gather_topk(topk, dcp_size, group_name)
    bad = (rows < -1) | (rows >= num_slots)  # [N, B, K]
    if bool(bad.any()):
        _, row, col = (int(i) for i in bad.nonzero()[0])
        ranks = [r for r in range(dcp_size) if bool(bad[r, row, col])]
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row} holds top-k slot {int(rows[ranks[0], row, col])} at position {col}, outside "
            f"[-1, {num_slots}) (on ranks {ranks})"
        )
    differ = (rows != rows[0]).any(dim=2)  # [N, B]: rank r's row b differs from rank 0's
    if bool(differ.any()):
        row = int(differ.any(dim=0).nonzero()[0])
        ranks = [r for r in range(dcp_size) if bool(differ[r, row])]
        col = int((rows[ranks[0], row] != rows[0, row]).nonzero()[0])
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row}: ranks {ranks} computed a different top-k than rank 0 (first at position "
            f"{col}: rank {ranks[0]} has slot {int(rows[ranks[0], row, col])}, rank 0 has {int(rows[0, row, col])}); "
            f"every rank must compute the same global top-k (is the indexer or its key cache different on some rank?)"
        )
