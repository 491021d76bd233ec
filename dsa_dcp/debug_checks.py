"""Run-time checks for ``options["debug_checks"]``: every rank given the same step inputs, slots in
range, the same top-k on every rank, and every rank at the same point of the same step.

Off by default. When on, the DCP program starts with ``check_step_inputs`` (the ``step_inputs``
pass: before the step's first collective) and the DCP rewrite puts ``check_step`` before each
collective it adds (a layer's remap, its merge, its epilogue's all-reduce). Every check first
all-gathers, from every rank, how many checks this process has passed, which check this is (its
position in the graph) and how long its payload is (``gather_header``: three int64s whatever the
check, so checks of ranks that went out of step pair with each other and report it), then its
payload, and raises ``DCPRuntimeCheckError`` on every rank alike

- when the ranks are out of step (a rank that retried or skipped part of a step would otherwise
  pair one layer's collectives with another's),
- when the ranks were given different step inputs (a digest per input; the first input that differs
  is then exchanged whole, and the message names it, the ranks and the first differing entry),
- naming the layer and the row when a top-k slot is outside ``[-1, num_slots)`` on any rank,
- when the ranks disagree on a row's top-k (naming the first differing position and both slots).

Every rank checks every rank's data, so all of them raise or none does (a rank raising alone would
leave the others waiting in the next collective). The top-k rows are compared entry by entry, not
through a summary: no checksum tells every two different rows apart, and a linear one cannot tell
``[5, 7]`` from ``[7, 6]``; the rows are small (``B * K`` ids a rank and a layer: 1 MiB of int64 at
B = 64, K = 2048) for a check that already waits for the host. The step inputs are compared by a
BLAKE2b digest of their bytes (a collision is as unlikely as a hash collision gets). The checks
synchronize with the host, so they are for debugging only: the validator refuses them together
with CUDA graphs or Inductor.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


class DCPRuntimeCheckError(RuntimeError):
    """A debug check failed while the compiled step ran."""


# Checks this process has passed, per DCP group (see the module docstring).
_checks_run: dict[str, int] = {}
# The graph position of the step-input check (the rewrite numbers the other checks 0, 1, ...).
STEP_INPUTS_POSITION = -1


def _all_gather(mine: Tensor, dcp_size: int, group_name: str) -> Tensor:
    """Every rank's ``mine`` (1-D int64, the same length on every rank), ``[N, len]``."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_gather_into_tensor(mine, dcp_size, group_name)).view(dcp_size, -1)


def _where(position: int) -> str:
    return "the step-input check" if position == STEP_INPUTS_POSITION else f"graph position {position}"


def gather_header(payload: int, position: int, dcp_size: int, group_name: str, device) -> None:
    """The first exchange of every check: ``(checks passed, graph position, payload length)`` from
    every rank, three int64s whatever the check, so checks of ranks that went out of step pair with
    each other; raises ``DCPRuntimeCheckError`` on every rank alike when the ranks are not at the same
    check, before any payload (whose length may differ then) is exchanged."""
    count = _checks_run[group_name] = _checks_run.get(group_name, 0) + 1
    headers = _all_gather(torch.tensor([count, position, payload], dtype=torch.int64, device=device), dcp_size,
                          group_name).tolist()
    if any(h[:2] != headers[0][:2] for h in headers):
        where = ", ".join(f"rank {r}: check {c} at {_where(p)}" for r, (c, p, _) in enumerate(headers))
        raise DCPRuntimeCheckError(
            f"the ranks of the DCP group are out of step ({where}): a rank retried or skipped part of a step, so "
            f"its collectives would pair with another layer's. After any rank fails a step, every rank must "
            f"abandon it (docs/validation.md, 'After a failed step')"
        )
    if any(h != headers[0] for h in headers):  # the same check of steps of different shapes
        sizes = ", ".join(f"rank {r}: {n}" for r, (_, _, n) in enumerate(headers))
        raise DCPRuntimeCheckError(
            f"the ranks of the DCP group ran a step of different shapes: {_where(position)} checks a different "
            f"number of entries on each ({sizes}); every rank must be fed the same step inputs "
            f"(docs/validation.md, 'Every rank feeds the same step inputs')")


def gather_step(topk: Tensor, position: int, dcp_size: int, group_name: str) -> Tensor:
    """Every rank's ``topk[B, K]`` rows (``[N, B, K]``, int64), after ``gather_header``."""
    gather_header(topk.numel(), position, dcp_size, group_name, topk.device)
    return _all_gather(topk.to(torch.int64).reshape(-1), dcp_size, group_name).view(dcp_size, *topk.shape)


def check_step(topk: Tensor, position: int, layer: int, num_slots: int, dcp_size: int, group_name: str) -> None:
    """The debug check before one collective (see the module docstring)."""
    try:
        rows = gather_step(topk, position, dcp_size, group_name)
    except DCPRuntimeCheckError as e:
        raise DCPRuntimeCheckError(f"layer {layer}: {e}") from None
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


# --------------------------------------------------------------------------- the step's inputs


def input_digest(x: Tensor) -> int:
    """A 63-bit digest of a tensor's dtype, shape and bytes (BLAKE2b on the host: the check already
    waits for the host, and unlike a sum it tells a permutation or any single change apart)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{x.dtype}|{tuple(x.shape)}|".encode())
    h.update(x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def check_step_inputs(inputs: list, names: list[str], dcp_size: int, group_name: str) -> None:
    """The debug check at the start of every DCP step, before its first collective: every rank was
    given the same step inputs (token ids, positions, request ids, slots, page table: every tensor
    input that is not a weight or a cache split over the group). Each rank all-gathers one digest per
    input; where they differ, the ranks exchange the first differing input itself and raise
    ``DCPRuntimeCheckError`` on every rank, naming the input, the ranks, and the first differing entry."""
    device = next((x.device for x in inputs if isinstance(x, Tensor)), torch.device("cpu"))
    gather_header(len(inputs), STEP_INPUTS_POSITION, dcp_size, group_name, device)
    if not inputs:
        return
    mine = torch.tensor([input_digest(x) for x in inputs], dtype=torch.int64, device=device)
    digests = _all_gather(mine, dcp_size, group_name)  # [N, F]
    differ = (digests != digests[0]).any(dim=0)
    if not bool(differ.any()):
        return
    field = int(differ.nonzero()[0])
    ranks = [r for r in range(dcp_size) if bool(digests[r, field] != digests[0, field])]
    raise DCPRuntimeCheckError(
        f"the ranks of the DCP group were given different step inputs: {names[field]} differs on ranks {ranks} from "
        f"rank 0's{_first_difference(inputs[field], ranks[0], dcp_size, group_name)}. Every rank of a DCP group must "
        f"be fed the same inputs every step (the group runs one model: sample each token once and broadcast it); "
        f"docs/validation.md, 'Every rank feeds the same step inputs'")


def _first_difference(x: Tensor, other: int, dcp_size: int, group_name: str) -> str:
    """Where rank ``other``'s ``x`` first differs from rank 0's (every rank runs this for the same
    input: the sizes first, then, when they match, the values as int64 or float64 bit patterns)."""
    sizes = _all_gather(torch.tensor([x.numel(), x.dim()], dtype=torch.int64, device=x.device), dcp_size, group_name)
    if bool((sizes != sizes[0]).any()):
        return f" (rank {other} has {int(sizes[other, 0])} entries, rank 0 has {int(sizes[0, 0])})"
    flat = x.detach().reshape(-1)
    values = flat.to(torch.int64) if not flat.is_floating_point() else flat.to(torch.float64).view(torch.int64)
    everyone = _all_gather(values.contiguous(), dcp_size, group_name)
    diff = (everyone[other] != everyone[0]).nonzero()
    if diff.numel() == 0:  # same values, another dtype or shape: the digest covers those
        return " (the same values in another dtype or shape)"
    i = int(diff[0])
    show = (lambda v: repr(float(torch.tensor(v).view(torch.float64)))) if flat.is_floating_point() else int
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tuple(x.shape))) if x.dim() > 1 else i
    return (f" (first at index {index}: rank {other} has {show(int(everyone[other, i]))}, rank 0 has "
            f"{show(int(everyone[0, i]))})")
