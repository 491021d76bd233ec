"""What the compiled graph does, per layer: its top-k source, remap, merge and collectives.

Computed when someone inspects a compilation, from the copy of the final (rewritten) graph its
report keeps:

- shapes come from the nodes' metadata (``meta["example_value"]``: dynamo's fake values, and the
  ones the passes give every node they insert), so nothing runs the graph again;
- the structure comes from the FX graph's own order and edges: every node is attributed to the
  latest sparse attention node it depends on, which is how a collective or a merge is tied to its
  layer.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.ops import FUSED_REMAPS, TOPK_REMAP
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.fx import alias_base
from dsa_dcp.passes.graph import FUSED_MERGE, MERGE_TARGETS, is_collective, sparse_attention_nodes


# Bytes a rank sends for one collective whose per-rank input is ``b`` bytes, over ``n`` ranks
# (direct/ring algorithms): all-gather sends its shard to each other rank; all-to-all and
# reduce-scatter keep 1/n of their input; a ring all-reduce is a reduce-scatter plus an all-gather.
SENT_BYTES = {
    "all_gather_into_tensor": lambda b, n: b * (n - 1),
    "all_to_all_single": lambda b, n: b * (n - 1) // n,
    "reduce_scatter_tensor": lambda b, n: b * (n - 1) // n,
    "all_reduce": lambda b, n: 2 * b * (n - 1) // n,
    "fused_a2a_merge": lambda b, n: b * (n - 1) // n,
}


@dataclasses.dataclass
class Collective:
    """One functional collective of the step, with the bytes it moves on this rank."""

    node: str
    op: str
    layer: int | None
    input_shape: list[int]
    dtype: str
    input_bytes: int
    sent_bytes_per_rank: int


@dataclasses.dataclass
class LayerFlow:
    """One sparse attention node (a layer) and what feeds and follows it."""

    layer: int
    node: str
    op: str
    topk_source: str  # id of the top-k tensor it attends with (a ``TopkSource.id``)
    remap: str | None  # the ``topk_remap`` node it uses, None when the graph has none
    merge: str | None  # the merge node (lse_combine / finish_reduce_scatter) after it
    collectives: list[str]


@dataclasses.dataclass
class TopkSource:
    """A distinct top-k tensor: computed by a layer's indexer, or an input of the graph."""

    id: str  # the FX node name
    first_layer: int  # the first layer that attends with it (its indexer's layer)
    layers: list[int]


@dataclasses.dataclass
class RemapGroup:
    """One ``topk_remap`` node and the layers whose attention reads its result."""

    node: str
    topk_source: str
    layers: list[int]


@dataclasses.dataclass
class GraphAnalysis:
    layers: list[LayerFlow]
    sources: list[TopkSource]
    remaps: list[RemapGroup]
    collectives: list[Collective]
    dcp_size: int
    merge: str | None
    shapes_known: bool = True
    note: str = ""
    process_group: str = ""  # the group this rank was compiled in, as seen at compile time


def collective_inputs(nodes: list[fx.Node]) -> dict:
    """``{collective node: (input shape, dtype, input bytes)}`` from the nodes' metadata."""
    found = {}
    for n in nodes:
        # a fused merge sends (out, lse): its first two arguments; a collective its first
        args = n.args[: 2 if n.target is FUSED_MERGE else 1]
        tensors = [a.meta.get("example_value") for a in args if isinstance(a, fx.Node)]
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        if tensors:
            found[n] = (list(tensors[0].shape), tensors[0].dtype, sum(t.numel() * t.element_size() for t in tensors))
    return found


def _op_name(node: fx.Node) -> str:
    """A collective's name, from its overload (the passes' nodes) or its packet (a model's own
    ``funcol.all_reduce``, as dynamo records it)."""
    return F.c10d_name(node) or getattr(node.target, "_opname", str(node.target))


def _group_size(node: fx.Node, dcp_size: int) -> int:
    name = _op_name(node)
    if name == "all_gather_into_tensor" or name == "reduce_scatter_tensor":
        size = node.args[2] if name == "reduce_scatter_tensor" else node.args[1]
        if isinstance(size, int):
            return size
    return dcp_size


def analyze(gm: fx.GraphModule, dcp_size: int, merge_mode: str | None, process_group: str = "") -> GraphAnalysis:
    """Per-layer dataflow and collective bytes of ``gm`` (see module docstring)."""
    graph = gm.graph
    attns = sparse_attention_nodes(graph)
    index = {a: i for i, a in enumerate(attns)}

    # Each node belongs to the latest attention node it depends on (None: before the first); an
    # FX graph's node order is a topological order.
    owner: dict[fx.Node, int | None] = {}
    for node in graph.nodes:
        preds = [owner[p] for p in node.all_input_nodes if owner[p] is not None]
        owner[node] = index[node] if node in index else (max(preds) if preds else None)

    sources: dict[fx.Node, TopkSource] = {}
    remaps: dict[fx.Node, RemapGroup] = {}
    layers = []
    for i, attn in enumerate(attns):
        topk = attn.args[3]
        remap = None
        if isinstance(topk, fx.Node) and topk.target is operator.getitem and isinstance(topk.args[0], fx.Node) \
                and (topk.args[0].target is TOPK_REMAP or topk.args[0].target in FUSED_REMAPS):
            remap = topk.args[0]
            topk = remap.args[0]
        base = alias_base(topk) if isinstance(topk, fx.Node) else topk
        src = sources.setdefault(base, TopkSource(id=base.name, first_layer=i, layers=[]))
        src.layers.append(i)
        if remap is not None:
            remaps.setdefault(remap, RemapGroup(node=remap.name, topk_source=src.id, layers=[])).layers.append(i)
        layers.append(LayerFlow(layer=i, node=attn.name, op=getattr(attn.target, "__name__", str(attn.target)),
                                topk_source=src.id, remap=remap.name if remap is not None else None,
                                merge=None, collectives=[]))

    coll_nodes = [n for n in graph.nodes if is_collective(n) or n.target is FUSED_MERGE]
    for node in graph.nodes:
        if node.op == "call_function" and node.target in MERGE_TARGETS and owner.get(node) is not None:
            flow = layers[owner[node]]
            flow.merge = flow.merge or node.name

    shapes = collective_inputs(coll_nodes)
    missing = [n.name for n in coll_nodes if n not in shapes]
    shapes_known = not missing
    note = f"collective shapes unknown for {missing}: no metadata recorded" if missing else ""
    collectives = []
    for node in coll_nodes:
        op = _op_name(node)
        shape, dtype, nbytes = shapes.get(node, ([], None, 0))
        n = _group_size(node, dcp_size)
        layer = owner.get(node)
        collectives.append(Collective(
            node=node.name, op=op, layer=layer, input_shape=shape,
            dtype=str(dtype).replace("torch.", "") if dtype is not None else "unknown",
            input_bytes=nbytes, sent_bytes_per_rank=SENT_BYTES.get(op, lambda b, n: b)(nbytes, n),
        ))
        if layer is not None:
            layers[layer].collectives.append(node.name)
    return GraphAnalysis(layers=layers, sources=list(sources.values()), remaps=list(remaps.values()),
                         collectives=collectives, dcp_size=dcp_size, merge=merge_mode if dcp_size > 1 else None,
                         shapes_known=shapes_known, note=note, process_group=process_group)
