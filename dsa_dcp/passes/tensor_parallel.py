"""Layers that hold ``H / T`` heads of a tensor-parallel (TP) group, and DCP inside that group.

A TP layer is recognized from its graph, as published code writes it: the attention output goes
through the per-head epilogue (``match/epilogue.py``) into the output projection, whose result is
summed over a process group of ``T > 1`` ranks (``_c10d_functional.all_reduce(., "sum", tp)``,
what dynamo records for ``funcol.all_reduce`` and for ``dist.all_reduce``). Each rank then holds
its own ``H / T`` query heads and the whole latent KV (one KV head); the indexer is replicated.

DCP runs inside the TP group (the engines' layout): the DCP group of ``N`` ranks is part of one TP
group and ``N`` divides ``T``. Each layer attends with the DCP group's ``N * H / T`` heads over this
rank's KV shard, so the query of the group's heads is all-gathered over the DCP group first (one
all-gather a layer of ``[q_nope | q_pe]``, in DCP-rank order); the merge then hands each rank the
combined output of its own heads (``a2a``, ``ag_rs``, ``fused_a2a`` by construction: head group
``j`` goes to DCP rank ``j``; ``ag`` keeps its own slice), and the model's own row-parallel output
projection and all-reduce follow unchanged. The rewrite never touches the model's collectives.

The refusals (at compile time, naming the numbers): a DCP group that is not part of the layer's
TP group, ``N`` not dividing ``T``, layers that disagree on their TP group or that are not all
recognized as TP (one left out would be merged as if it held every head), and a graph whose
collectives the rewrite cannot place (some collective but no layer recognized as TP: its heads
could be a TP shard the merge would mix with another rank's).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.head_groups import gather_query_heads
from dsa_dcp.ops import C10D
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.graph import is_collective

# Steps between the output projection and its all-reduce that keep the value (``.type_as(x)``).
_SAME_VALUE_METHODS = {"contiguous", "to", "type_as", "float", "half", "bfloat16", "type"}
ALL_REDUCES = ("all_reduce", "all_reduce_")  # functional and in-place (F.c10d_name)


@dataclasses.dataclass(frozen=True)
class TPSite:
    """A layer's TP group, as its output projection's all-reduce names it."""

    group_name: str
    size: int
    all_reduce: fx.Node


def tp_all_reduce(linear: fx.Node) -> fx.Node | None:
    """The ``all_reduce(., "sum", group)`` that sums ``linear``'s result over a group, reached
    through value-keeping steps (``.type_as``, ``.to``); ``None`` when there is none."""
    cur = linear
    for _ in range(8):
        reduces = [u for u in cur.users if F.c10d_name(u) in ALL_REDUCES and u.args[0] is cur]
        if reduces:
            node = reduces[0]
            op = F.arg(node, 1, "reduceOp")
            return node if isinstance(op, str) and op.lower() == "sum" else None
        user = F.only_user(cur)
        if user is None or not (user.op == "call_method" and user.target in _SAME_VALUE_METHODS):
            return None
        cur = user
    return None


def tp_site(linear: fx.Node) -> TPSite | None:
    """The TP group of the layer whose output projection is ``linear`` (``None``: not TP)."""
    node = tp_all_reduce(linear)
    if node is None:
        return None
    name = F.arg(node, 2, "group_name")
    size = _group_size(name)
    return TPSite(name, size, node) if size > 1 else None


def _group_size(group_name: str) -> int:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_world_size(_resolve_process_group(group_name))


def _global_ranks(group_name: str) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def group_problems(tp: TPSite, dcp_group_name: str, dcp_size: int) -> list[str]:
    """Why DCP over ``dcp_group_name`` cannot run inside ``tp``'s group (empty when it can)."""
    problems = []
    tp_ranks, dcp_ranks = _global_ranks(tp.group_name), _global_ranks(dcp_group_name)
    if not set(dcp_ranks) <= set(tp_ranks):
        problems.append(
            f"the DCP group (global ranks {dcp_ranks}) is not part of the layer's TP group (global ranks "
            f"{tp_ranks}): DCP reuses the ranks of one TP group; build the DCP groups from contiguous "
            f"ranks of each TP group (dsa_dcp.topology.tp_dcp_groups(tp_size, dcp_size))")
    elif tp.size % dcp_size:
        problems.append(f"dcp_size={dcp_size} does not divide the TP size {tp.size}: DCP groups split a TP "
                        f"group evenly")
    return problems


def unplaced_collectives(gm: fx.GraphModule, placed: set[fx.Node]) -> list[str]:
    """Data-moving collectives of the model's graph other than the TP all-reduces in ``placed`` and
    those over the same groups (a TP MLP's sum): ``name (group)`` of each."""
    groups = {F.arg(node, 2, "group_name") for node in placed}
    found = []
    for node in gm.graph.nodes:
        if node in placed or not is_collective(node):
            continue
        if F.c10d_name(node) in ALL_REDUCES and F.arg(node, 2, "group_name") in groups:
            continue
        found.append(f"{node.name} ({F.target_name(node.target)})")
    return found


def gather_group_query(emit: F.Emitter, q_nope: fx.Node, q_pe: fx.Node, dcp_size: int,
                       group_name: str) -> tuple[fx.Node, fx.Node]:
    """The DCP group's query heads, ``[B, N * H/T, D]`` each, DCP rank ``j``'s heads at head group
    ``j``: one all-gather of ``[q_nope | q_pe]`` (module docstring)."""
    nope = F.shape(q_nope)[-1]
    packed = emit(torch.cat, [q_nope, q_pe], -1)
    gathered = emit(C10D.wait_tensor.default,
                    emit(C10D.all_gather_into_tensor.default, packed, dcp_size, group_name))
    heads = emit(gather_query_heads, gathered, dcp_size)
    parts = (slice(None, nope), slice(nope, None))
    return tuple(emit.method("contiguous", emit(operator.getitem, heads, (Ellipsis, part))) for part in parts)
