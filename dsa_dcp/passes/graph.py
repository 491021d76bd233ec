"""Small FX helpers the passes share: finding nodes, following aliases, real tensors."""

from __future__ import annotations

import operator
from typing import Iterator

import torch
import torch.fx as fx

from dsa_dcp import merge
from dsa_dcp.ops import SPARSE_ATTENTION_OPS

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
FUSED_MERGE = torch.ops.dsa_dcp.fused_a2a_merge.default
MERGE_TARGETS = (torch.ops.dsa_dcp.lse_combine.default, merge.finish_reduce_scatter, FUSED_MERGE)
TOPK_REMAP = torch.ops.dsa_dcp.topk_remap.default
KV_STORE = torch.ops.dsa_dcp.kv_store.default
POSITION_STORE = torch.ops.dsa_dcp.position_store.default  # a write into a position cache (ops_positions.py)


def node_kind(node: fx.Node) -> str | None:
    """``sparse_attention``, ``topk_remap``, ``kv_write``, ``merge`` or ``collective`` (else ``None``)."""
    if node.op != "call_function":
        return None
    if node.target in SPARSE_ATTENTION_OPS:
        return "sparse_attention"
    if node.target is TOPK_REMAP:
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
