"""Small FX helpers the passes share: finding nodes, following aliases, real tensors, and
``Emitter``, which inserts nodes that carry their metadata."""

from __future__ import annotations

import logging
import operator
import re
from typing import Any, Iterator

import torch
import torch.fx as fx

from dsa_dcp import merge
from dsa_dcp.ops import C10D, FUSED_A2A_MERGE, FUSED_REMAPS, KV_STORE, LSE_COMBINE, SPARSE_ATTENTION_OPS, \
    TOPK_REMAP
from dsa_dcp.ops_positions import POSITION_STORE

log = logging.getLogger("dsa_dcp.passes")

# call_method / call_function targets whose result aliases their first argument.
VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "transpose", "permute",
                "expand", "narrow", "select", "as_strided", "detach", "view_as", "t", "unfold"}
VIEW_FUNCTIONS = {torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze, torch.transpose, torch.permute,
                  torch.narrow, torch.select, torch.detach, torch.Tensor.view, operator.getitem}


def sparse_attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SPARSE_ATTENTION_OPS]


def alias_base(node: fx.Node) -> fx.Node:
    """Follow views (and tensor slicing) back to the node whose storage ``node`` shares."""
    while True:
        if node.op == "call_method" and node.target in VIEW_METHODS and node.args:
            node = node.args[0]
        elif node.op == "call_function" and node.target in VIEW_FUNCTIONS and node.args \
                and isinstance(node.args[0], fx.Node) and _is_tensor(node.args[0]):
            node = node.args[0]
        else:
            return node


def _is_tensor(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return value is None or isinstance(value, torch.Tensor)


def placeholder_values(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, object]:
    """Placeholder node -> the real input it stands for (parameters and buffers included)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, example_inputs))


def users_in_order(node: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(node.users, key=order.__getitem__)


def only_user(node: fx.Node, target=None) -> fx.Node | None:
    """The one user of ``node`` (a ``call_function`` of ``target`` when given), else ``None``."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if target is not None and not (user.op == "call_function" and user.target is target):
        return None
    return user


def getitem_users(node: fx.Node) -> Iterator[tuple[int, fx.Node]]:
    """``(index, user)`` for each ``operator.getitem(node, index)`` user of a tuple-valued node."""
    for user in users_in_order(node):
        if user.op == "call_function" and user.target is operator.getitem:
            yield user.args[1], user


def is_collective(node: fx.Node) -> bool:
    """A functional collective that moves data (its ``wait_tensor`` is not counted)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not torch.ops._c10d_functional.wait_tensor.default
    )


# A fused merge (exchange + combine in one op, ``merge="fused_a2a"``) is a merge that is also a
# collective: it moves its packed ``(out, lse)`` as an all-to-all does.
FUSED_MERGE = FUSED_A2A_MERGE
MERGE_TARGETS = (LSE_COMBINE, merge.finish_reduce_scatter, FUSED_MERGE)


def node_kind(node: fx.Node) -> str | None:
    """``sparse_attention``, ``topk_remap``, ``kv_write``, ``merge`` or ``collective`` (else ``None``)."""
    if node.op != "call_function":
        return None
    if node.target in SPARSE_ATTENTION_OPS:
        return "sparse_attention"
    if node.target is TOPK_REMAP or node.target in FUSED_REMAPS:  # a remap fused with its selection counts
        return "topk_remap"
    if node.target is KV_STORE or node.target is POSITION_STORE:
        return "kv_write"
    if node.target in MERGE_TARGETS:
        return "merge"
    return "collective" if is_collective(node) else None


_SUMMARY_KEYS = {"sparse_attention": "sparse_attention_nodes", "topk_remap": "remaps", "merge": "merges",
                 "collective": "collectives", "kv_write": "kv_writes"}


def graph_summary(graph: fx.Graph) -> dict[str, int]:
    """What one run of the graph does, in the units users ask about."""
    counts = dict.fromkeys(("sparse_attention_nodes", "remaps", "merges", "collectives", "kv_writes"), 0)
    for node in graph.nodes:
        kind = node_kind(node)
        if kind is not None:
            counts[_SUMMARY_KEYS[kind]] += 1
        if node.target is FUSED_MERGE:
            counts["collectives"] += 1
    return counts


# --------------------------------------------------------------------------- inserting nodes

_LAYER = re.compile(r"\blayers\W{1,12}?(\d+)")
META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def recorded_layer(node: fx.Node) -> int | None:
    """The model layer of ``node``: set by a pass (``meta["dsa_dcp_layer"]``), else the ``layers[i]``
    index in dynamo's module stack (outermost match); ``None`` for inputs and where unknown."""
    if "dsa_dcp_layer" in node.meta:
        return node.meta["dsa_dcp_layer"]
    if node.op in ("placeholder", "get_attr", "output"):
        return None  # inputs are shared by layers; dynamo records only their first user
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _LAYER.search(str(path))
        if match:
            return int(match.group(1))
    return None


def fake_mode_of(graph: fx.Graph) -> Any:
    """The fake mode of the values dynamo recorded in ``graph`` (``None`` when it recorded none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def _fake(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return value.meta.get("example_value", _MISSING)
    if isinstance(value, (list, tuple)):
        return type(value)(_fake(v) for v in value)
    return value


_MISSING = object()


def _has_missing(value: Any) -> bool:
    if value is _MISSING:
        return True
    return isinstance(value, (list, tuple)) and any(_has_missing(v) for v in value)


class Emitter:
    """Inserts ``call_function`` nodes that carry their metadata, so nothing downstream (the
    inspection tool, Inductor) needs a second fake-tensor run to know what they hold.

    Each node gets ``meta["example_value"]`` (its target run on the inputs' fake values, in the
    graph's own fake mode), the module stack and source line of ``like`` (the node it stands
    beside: an attention node, a KV write), and ``meta["dsa_dcp_layer"]``, the model layer.
    Nodes go where the graph's insert point is when they are emitted (use ``graph.inserting_*``).
    """

    def __init__(self, graph: fx.Graph, like: fx.Node | None = None, layer: int | None = None) -> None:
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)
        self.like = like
        self.layer = layer if layer is not None else (recorded_layer(like) if like is not None else None)

    def __call__(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        if self.like is not None:
            for key in META_KEYS:
                if key in self.like.meta:
                    node.meta[key] = self.like.meta[key]
        if self.layer is not None:
            node.meta["dsa_dcp_layer"] = self.layer
        value = self._fake_value(target, args)
        if value is not None:
            node.meta["example_value"] = value
        return node

    def _fake_value(self, target: Any, args: tuple) -> Any:
        fake_args = _fake(args)
        if self.fake_mode is None or _has_missing(fake_args):
            return None
        try:
            with self.fake_mode:
                return target(*fake_args)
        except Exception as e:  # noqa: BLE001 - metadata is a convenience, never a reason to fail
            log.debug("no fake value for %s: %s: %s", getattr(target, "__name__", target), type(e).__name__, e)
            return None


def refresh_meta(nodes: list[fx.Node]) -> None:
    """Recompute ``meta["example_value"]`` of ``nodes`` (in order) after a pass changed their inputs."""
    for node in nodes:
        mode = fake_mode_of(node.graph)
        args, kwargs = _fake(node.args), _fake(dict(node.kwargs))
        if mode is None or _has_missing(args) or _has_missing(list(kwargs.values())):
            node.meta.pop("example_value", None)
            continue
        try:
            with mode:
                if node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    value = node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - stale metadata is dropped, never kept
            log.debug("no fake value for %s: %s: %s", node.name, type(e).__name__, e)
            node.meta.pop("example_value", None)
            continue
        node.meta["example_value"] = value
