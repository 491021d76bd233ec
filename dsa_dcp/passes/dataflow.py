"""A networkx view of an FX graph: its dataflow, which values share storage, and in-place writes.

``to_networkx(graph)`` is the one picture both the analyses and the inspection tool use: a
``DiGraph`` with one node per FX node, keyed by the node's name, and an edge ``input -> user`` per
use. Node attributes are plain (JSON-friendly) values:

    op       the FX opcode (``placeholder``, ``call_function``, ``call_method``, ``output``, ...)
    target   the target's name (``"dsa_dcp.topk_remap.default"``, ``"add_"``, ``"getitem"``)
    kind     ``sparse_attention``, ``topk_remap``, ``kv_write``, ``merge``, ``collective`` or ``None``
    layer    the model layer the node belongs to (from dynamo's module stack; nodes a pass inserted
             inherit it from their neighbours; ``None`` for inputs and where it is unknown)
    order    the node's position in the graph (FX graphs are straight-line code)
    mutates  names of the arguments the node writes in place (``[]`` for a pure node)

``alias_classes`` groups the nodes whose values may share storage (views, ops that return an
input, graph inputs that are the same real tensor); ``Writes`` answers "was this storage written
between these two points of the program".
"""

from __future__ import annotations

import bisect

import networkx as nx
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from dsa_dcp.position_cache import local_positions
from dsa_dcp.passes.fx import is_view, mutated_args, placeholder_values, recorded_layer, target_name
from dsa_dcp.passes.graph import node_kind

def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The dataflow of ``graph`` as a ``DiGraph`` keyed by node name (attributes: module docstring)."""
    g = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        g.add_node(node.name, op=node.op, target=target_name(node.target), kind=node_kind(node),
                   layer=recorded_layer(node), order=order, mutates=[a.name for a in mutated_args(node)])
        for arg in node.all_input_nodes:
            g.add_edge(arg.name, node.name)
    _inherit_layers(g)
    return g


def _inherit_layers(g: nx.DiGraph) -> None:
    """Nodes a pass inserted have no module stack: take the layer of users, then inputs, that agree."""
    def agreed(neighbours) -> int | None:
        layers = {g.nodes[n]["layer"] for n in neighbours if g.nodes[n]["op"] not in ("placeholder", "output")}
        return layers.pop() if len(layers) == 1 else None

    order = list(nx.topological_sort(g))
    for name in reversed(order):  # remap <- getitem <- attention
        if g.nodes[name]["layer"] is None and g.nodes[name]["op"] == "call_function":
            g.nodes[name]["layer"] = agreed(g.successors(name))
    for name in order:  # attention -> merge -> collectives
        if g.nodes[name]["layer"] is None and g.nodes[name]["op"] == "call_function":
            g.nodes[name]["layer"] = agreed(g.predecessors(name))


def _storage(value: object) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):
        return None


def real_tensor_key(value: object) -> tuple | None:
    """What identifies a real input tensor: its storage and view parameters (``None`` if unknown)."""
    value = local_positions(value) if isinstance(value, torch.Tensor) else value  # a position cache: its storage
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    ptr = value.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return ("input", ptr, value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)


def alias_classes(gm: fx.GraphModule, example_inputs: tuple = ()) -> dict[str, int]:
    """Node name -> storage class: nodes of one class may share memory.

    Built as the connected components of an undirected graph linking each node to its storage
    (dynamo's fake tensors keep views and aliased inputs on one fake storage), each placeholder to
    the real storage behind it, and, where a pass left no fake tensor, each view to its base.
    """
    links = nx.Graph()
    inputs = placeholder_values(gm, example_inputs)
    for node in gm.graph.nodes:
        links.add_node(node.name)
        fake = _storage(node.meta.get("example_value"))
        if fake is not None:
            links.add_edge(node.name, ("fake", fake))
        real = inputs.get(node)
        real = local_positions(real) if isinstance(real, torch.Tensor) else real  # a position cache: its storage
        if isinstance(real, torch.Tensor) and real.untyped_storage().data_ptr():
            links.add_edge(node.name, ("real", real.untyped_storage().data_ptr()))
        if fake is None and is_view(node):
            links.add_edge(node.name, node.args[0].name)
    classes = {}
    for i, component in enumerate(nx.connected_components(links)):
        for member in component:
            if isinstance(member, str):
                classes[member] = i
    return classes


class Writes:
    """The in-place writes of a graph, by storage class, in program order."""

    def __init__(self, g: nx.DiGraph, classes: dict[str, int]) -> None:
        self._at: dict[int, list[tuple[int, str]]] = {}
        for name, data in g.nodes(data=True):
            for cls in {classes[m] for m in data["mutates"]}:
                self._at.setdefault(cls, []).append((data["order"], name))
        for writes in self._at.values():
            writes.sort()

    def between(self, cls: int, start: int, end: int) -> list[str]:
        """Names of the nodes that write class ``cls`` strictly between positions ``start`` and ``end``."""
        writes = self._at.get(cls, [])
        lo = bisect.bisect_right(writes, (start, "\uffff"))
        hi = bisect.bisect_left(writes, (end, ""))
        return [name for _, name in writes[lo:hi]]
