"""Layers that hold ``H / T`` heads of a tensor-parallel (TP) group, and DCP inside that group.

A TP layer is recognized from its graph, as published code writes it: the attention output goes
through the per-head epilogue (``match/epilogue.py``) into the output projection, whose result is
summed over a process group of ``T > 1`` ranks (``_c10d_functional.all_reduce(., "sum", tp)``,
what dynamo records for ``funcol.all_reduce`` and for ``dist.all_reduce``). Each rank then holds
its own ``H / T`` query heads and the whole latent KV (one KV head); the indexer is replicated.

DCP runs inside the TP group (the engines' layout): the DCP group of ``N`` ranks is part of one TP
group and ``N`` divides ``T``. Each layer attends with the DCP group's ``N * H / T`` heads over this
rank's KV shard, in DCP-rank order. Their query comes one of two ways (``options.replicate_q``):

- on (the default): the replicated query projection. The layer's query weights (``wq_b``'s rows
  and the absorbed ``W_UK`` of its heads: ``match/query.py`` finds them from the attention's query
  back to the latent) are all-gathered over the DCP group once, at compile time
  (``gather_query_weights``), and held by the compiled graph as buffers; each step every rank runs
  the layer's query projection once per DCP rank, with that rank's weights, on the latent all of
  them hold (``replicate_group_query``). No collective a step; ``(N - 1) H / T`` heads' query
  weights more per rank.
- off: one all-gather a layer of ``[q_nope | q_pe]`` over the DCP group (``gather_group_query``).

The merge then hands each rank the
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
    the all-reduces and all-gathers over the same groups (a TP MLP's sum, a vocabulary-parallel
    embedding's sum, a column-parallel head's gather): ``name (group)`` of each."""
    groups = {F.arg(node, 2, "group_name") for node in placed}
    found = []
    for node in gm.graph.nodes:
        if node in placed or not is_collective(node):
            continue
        if F.c10d_name(node) in ALL_REDUCES and F.arg(node, 2, "group_name") in groups:
            continue
        if F.c10d_name(node) == "all_gather_into_tensor" and F.arg(node, 2, "group_name") in groups:
            continue  # a column-parallel head's logits gathered over the TP group
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


def gather_query_weights(weights: list[fx.Node], values: dict, dcp_size: int, group_name: str
                         ) -> dict[fx.Node, list[torch.Tensor]]:
    """Every DCP rank's value of each query weight (placeholders, in the order given: the same on
    every rank), by DCP rank: one all-gather each, at compile time. Over a gloo group a CUDA weight
    goes through the host (gloo's all-gather of CUDA tensors crashes the process)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    through_host = dist.get_backend(group) == "gloo"
    gathered = {}
    with torch.no_grad():
        for weight in weights:
            value = values[weight].detach()
            local = value.cpu() if through_host else value
            parts = [torch.empty_like(local) for _ in range(dcp_size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            gathered[weight] = [p.to(value.device) for p in parts]
    return gathered


def replicate_group_query(gm: fx.GraphModule, emit: F.Emitter, projection, gathered: dict, dcp_size: int,
                          rank: int) -> tuple[fx.Node, fx.Node]:
    """The DCP group's query heads, ``[B, N * H/T, D]`` each, DCP rank ``j``'s heads at head group
    ``j``: the projection's nodes run once per other rank ``j`` with ``j``'s query weights (buffers
    of ``gm``, ``dsa_dcp_query_*``), beside this rank's own (module docstring). Inserted at the graph's
    insert point."""
    fake_mode = F.fake_mode_of(gm.graph)
    per_rank = []
    for j in range(dcp_size):
        if j == rank:
            per_rank.append(projection.roots)
            continue
        env = {}
        for weight in projection.weights:
            name = f"dsa_dcp_query_{weight.name}_dcp{j}"
            if not hasattr(gm, name):
                _hold(gm, name, gathered[weight][j])
            node = gm.graph.get_attr(name)
            if fake_mode is not None:
                node.meta["example_value"] = fake_mode.from_tensor(getattr(gm, name), static_shapes=True)
            env[weight] = node
        for node in projection.nodes:
            env[node] = gm.graph.node_copy(node, lambda n: env.get(n, n))
        per_rank.append(tuple(env[root] for root in projection.roots))
    return tuple(emit(torch.cat, [q[i] for q in per_rank], 1) for i in range(2))


def _hold(gm: fx.GraphModule, name: str, weight: torch.Tensor) -> None:
    """``weight`` as a buffer of ``gm``, named to AOT autograd as dynamo names the model's own (it
    lifts every buffer to an input, static for CUDA graphs, and asks dynamo's record of where each
    came from)."""
    gm.register_buffer(name, weight)
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        from torch._dynamo.source import ConstantSource

        sources[name] = ConstantSource(name)


def replicated_query_bytes(projection, gathered: dict, dcp_size: int) -> int:
    """Bytes of the other DCP ranks' query weights a rank holds for one layer."""
    return sum((dcp_size - 1) * gathered[w][0].numel() * gathered[w][0].element_size() for w in projection.weights)
