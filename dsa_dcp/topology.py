"""The process groups of tensor parallelism with DCP inside it, laid out as serving engines do.

The world is split into TP groups of ``tp_size`` contiguous ranks, and each TP group into DCP
groups of ``dcp_size`` contiguous ranks (``dcp_size`` divides ``tp_size``; DCP adds no ranks). With
a world of 4, ``tp_dcp_groups(4, 2)`` gives TP ``{0, 1, 2, 3}`` and DCP ``{0, 1}``, ``{2, 3}``;
``tp_dcp_groups(2, 2)`` gives two TP groups ``{0, 1}``, ``{2, 3}``, each one DCP group.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TPDCPGroups", "tp_dcp_groups"]


@dataclasses.dataclass(frozen=True)
class TPDCPGroups:
    """This rank's TP group and DCP group (``torch.distributed`` process groups)."""

    tp: object
    dcp: object


def tp_dcp_groups(tp_size: int, dcp_size: int) -> TPDCPGroups:
    """Make every TP and DCP group of the world (module docstring) and return this rank's.

    Collective over the world: every rank calls it, with the same sizes (``dist.new_group`` is).
    Refuses (``ValueError``) sizes that do not tile the world: ``tp_size`` must divide the world
    size and ``dcp_size`` must divide ``tp_size``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("tp_dcp_groups needs an initialized torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, value in (("tp_size", tp_size), ("dcp_size", dcp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if world % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the world of {world} rank(s): TP groups are blocks of "
                         f"tp_size contiguous ranks")
    if tp_size % dcp_size:
        raise ValueError(f"dcp_size={dcp_size} does not divide tp_size={tp_size}: DCP groups split a TP group evenly")
    tp = [dist.new_group(list(range(start, start + tp_size))) for start in range(0, world, tp_size)]
    dcp = [dist.new_group(list(range(start, start + dcp_size))) for start in range(0, world, dcp_size)]
    return TPDCPGroups(tp=tp[rank // tp_size], dcp=dcp[rank // dcp_size])
