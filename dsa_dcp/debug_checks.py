"""Run-time checks for ``options["debug_checks"]``: slots in range, the same top-k on every rank,
and every rank at the same point of the same step.

Off by default. When on, the DCP rewrite puts ``check_step`` before each collective it adds (a
layer's remap, its merge, its epilogue's all-reduce). Each check raises ``DCPRuntimeCheckError``
naming the layer and the row when a top-k slot is outside ``[-1, num_slots)``; then it all-gathers,
from every rank, how many checks this process has passed, which check this is (its position in the
graph) and a per-row checksum of the layer's top-k, and raises when the ranks are out of step (a
rank that retried or skipped part of a step would otherwise pair one layer's collectives with
another's) or disagree on a row's top-k. Every check gathers the same shape, so checks of ranks
that went out of step still pair with each other and report it. It synchronizes with the host,
so it is for debugging only: the validator refuses it together with CUDA graphs or Inductor.
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


# Checks this process has passed, per DCP group (see the module docstring).
_checks_run: dict[str, int] = {}


def check_step(topk: Tensor, position: int, layer: int, num_slots: int, dcp_size: int, group_name: str) -> None:
    """The debug check before one collective (see the module docstring)."""
    bad = (topk < -1) | (topk >= num_slots)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row} holds top-k slot {int(topk[row, col])} at position {col}, outside "
            f"[-1, {num_slots})"
        )
    count = _checks_run[group_name] = _checks_run.get(group_name, 0) + 1
    header = torch.tensor([count, position], dtype=torch.int64, device=topk.device)
    mine = torch.cat([header, topk_checksum(topk).to(torch.int64).reshape(-1)])
    c10d = torch.ops._c10d_functional
    everyone = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, dcp_size, group_name)).view(dcp_size, -1)
    headers = everyone[:, :2].tolist()
    if any(h != headers[0] for h in headers):
        where = ", ".join(f"rank {r}: check {c} at graph position {p}" for r, (c, p) in enumerate(headers))
        raise DCPRuntimeCheckError(
            f"layer {layer}: the ranks of the DCP group are out of step ({where}): a rank retried or skipped "
            f"part of a step, so its collectives would pair with another layer's. After any rank fails a "
            f"step, every rank must abandon it (docs/validation.md, 'After a failed step')"
        )
    sums = everyone[:, 2:]
    differ = (sums != sums[0]).any(dim=0)
    if bool(differ.any()):
        row = int(differ.nonzero()[0])
        ranks = [r for r in range(dcp_size) if sums[r, row] != sums[0, row]]
        raise DCPRuntimeCheckError(
            f"layer {layer}: row {row}: ranks {ranks} computed a different top-k than rank 0; every rank must "
            f"compute the same global top-k (is the indexer or its key cache different on some rank?)"
        )
