"""Run-time checks for ``options["debug_checks"]``: slots in range, the same top-k on every rank,
and every rank at the same point of the same step.

Off by default. When on, the DCP rewrite puts ``check_step`` before each collective it adds (a
layer's remap, its merge, its epilogue's all-reduce). Each check all-gathers, from every rank, how
many checks this process has passed, which check this is (its position in the graph) and the
layer's top-k rows themselves, then raises ``DCPRuntimeCheckError`` on every rank alike

- when the ranks are out of step (a rank that retried or skipped part of a step would otherwise
  pair one layer's collectives with another's),
- naming the layer and the row when a top-k slot is outside ``[-1, num_slots)`` on any rank,
- when the ranks disagree on a row's top-k (naming the first differing position and both slots).

Every check gathers the same shape, so checks of ranks that went out of step still pair with each
other and report it; every rank checks every rank's rows, so all of them raise or none does (a
rank raising alone would leave the others waiting in the next collective). The rows are compared
entry by entry, not through a summary: no checksum tells every two different rows apart, and a
linear one cannot tell ``[5, 7]`` from ``[7, 6]``; the rows are small (``B * K`` ids a rank and a
layer: 1 MiB of int64 at B = 64, K = 2048) for a check that already waits for the host. It
synchronizes with the host, so it is for debugging only: the validator refuses it together with
CUDA graphs or Inductor.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DCPRuntimeCheckError(RuntimeError):
    """A debug check failed while the compiled step ran."""


# Checks this process has passed, per DCP group (see the module docstring).
_checks_run: dict[str, int] = {}


def gather_step(topk: Tensor, position: int, dcp_size: int, group_name: str) -> tuple[list, Tensor]:
    """Every rank's ``(checks passed, graph position)`` and ``topk[B, K]`` rows (``[N, B, K]``, int64)."""
    count = _checks_run[group_name] = _checks_run.get(group_name, 0) + 1
    header = torch.tensor([count, position], dtype=torch.int64, device=topk.device)
    mine = torch.cat([header, topk.to(torch.int64).reshape(-1)])
    c10d = torch.ops._c10d_functional
    everyone = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, dcp_size, group_name)).view(dcp_size, -1)
    return everyone[:, :2].tolist(), everyone[:, 2:].view(dcp_size, *topk.shape)


def check_step(topk: Tensor, position: int, layer: int, num_slots: int, dcp_size: int, group_name: str) -> None:
    """The debug check before one collective (see the module docstring)."""
    headers, rows = gather_step(topk, position, dcp_size, group_name)
    if any(h != headers[0] for h in headers):
        where = ", ".join(f"rank {r}: check {c} at graph position {p}" for r, (c, p) in enumerate(headers))
        raise DCPRuntimeCheckError(
            f"layer {layer}: the ranks of the DCP group are out of step ({where}): a rank retried or skipped "
            f"part of a step, so its collectives would pair with another layer's. After any rank fails a "
            f"step, every rank must abandon it (docs/validation.md, 'After a failed step')"
        )
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
