"""Matcher for a tensor-parallel layer's query projection: from the attention's query inputs back to
the query latent, with the head axis tracked on the way, and the weights indexed by head.

A TP rank computes the query of its ``H / T`` heads from a latent every rank of its TP group holds
(DeepSeek-V3.2 and GLM-5 as published)::

    q = linear(q_a, wq_b).view(t, h, d)          # wq_b: this rank's heads' rows
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    q_pe = apply_rope(q_pe, cos, sin)             # cos, sin broadcast over the heads
    q_lat = einsum("thn,hnc->thc", q_nope, w_uk)  # absorbed W_UK: this rank's heads
    out, lse = sparse_mla(q_lat, q_pe, kv, topk, scale)

``QueryProjection.match(attn)`` walks from ``q_lat`` and ``q_pe`` backwards, tracking where the head
axis is from the recorded shapes, through the steps whose head axis it can follow: casts and
``contiguous``, ``view``/``reshape``/``unflatten`` (the head axis kept whole, or merged head-major
into the last dim), ``split``/``chunk`` and indexing along other dims, ``cat``/``stack`` along another dim, ``flatten``
of other dims,
pointwise arithmetic (an operand without the head axis, or of size 1 there, is read as it is), a
per-head ``einsum`` (its operand indexed by head is a *query weight*), and ``linear`` whose output's
last dim holds the merged heads (its weight and bias are query weights, its input the latent). A
query weight is a parameter or buffer (a placeholder dynamo lifted, or a ``get_attr``), maybe
through views and indexing. Every value the walk stops at carries no head axis.

The match is the set of nodes between those values and the query (the *projection*: what this rank
runs for its heads) and the query weights it reads. Run with another rank's query weights, the same
nodes compute that rank's heads' query from the same latent. ``match`` returns a reason string where
it cannot find them unambiguously (an op it cannot follow along the heads, a head-carrying value
that is not a parameter, an in-place write).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from dsa_dcp.passes import fx as F
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.match.epilogue import EINSUM, LINEAR

SAME_VALUE_METHODS = {"contiguous", "clone", "to", "float", "half", "bfloat16", "type", "type_as"}
POINTWISE = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub,
             torch.mul, torch.div, torch.neg}
POINTWISE_METHODS = {"add", "sub", "mul", "div", "neg"}
SPLITS = {torch.split, torch.chunk}
SPLIT_METHODS = {"split", "chunk"}
CAT = {torch.cat, torch.concat}
WEIGHT_VIEWS = {"view", "reshape", "contiguous", "to", "float", "half", "bfloat16", "type", "t", "transpose"}


@dataclasses.dataclass
class QueryProjection:
    """One attention node's query projection: ``nodes`` (graph order) compute ``roots`` (the
    attention's query inputs ``q_nope``, ``q_pe``) from values without a head axis and from
    ``weights``, the placeholders or ``get_attr`` nodes indexed by head."""

    roots: tuple[fx.Node, fx.Node]
    nodes: list[fx.Node]
    weights: list[fx.Node]

    @classmethod
    def match(cls, attn: fx.Node) -> QueryProjection | str:
        roots = attn.args[0], attn.args[1]
        heads = F.shape(roots[0])[1] if F.shape(roots[0]) is not None else None
        if not all(isinstance(r, fx.Node) for r in roots) or heads is None:
            return f"the query inputs of {attn.name} have no recorded shape"
        walk = _Walk(heads)
        for root in roots:
            reason = walk.visit(root, 1, False)
            if reason:
                return reason
        if not walk.weights:
            return f"no weight indexed by the query heads was found between the query latent and {attn.name}"
        order = {n: i for i, n in enumerate(attn.graph.nodes)}
        # what this rank computes from its query weights on the way to the query (the walk's path,
        # and the operands it read as broadcast when a rank holds one head)
        nodes = _closure(roots, lambda n: n.all_input_nodes) & _closure(walk.weights, lambda n: n.users)
        nodes -= walk.weights
        for node in nodes:
            if F.mutated_args(node):
                return f"{node.name} writes a tensor in place on the way to the query of {attn.name}"
        for weight in walk.weights:
            writers = [u.name for u in weight.users if F.mutates(u, weight)]
            if writers:
                return f"the query weight {weight.name} is written in the graph ({', '.join(writers)})"
        return cls(roots, sorted(nodes, key=order.__getitem__), sorted(walk.weights, key=order.__getitem__))


def _closure(start, step) -> set[fx.Node]:
    seen, todo = set(start), list(start)
    while todo:
        for other in step(todo.pop()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def _prod(xs) -> int:
    return math.prod(xs) if xs else 1


class _Walk:
    """The backward walk (module docstring): ``visit(node, axis, merged)`` with the head axis of
    ``node`` at ``axis`` (``merged``: heads merged head-major into the last dim)."""

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.nodes: set[fx.Node] = set()
        self.weights: set[fx.Node] = set()
        self.seen: dict[fx.Node, tuple[int, bool]] = {}

    def visit(self, node: fx.Node, axis: int, merged: bool) -> str | None:
        if node in self.seen:
            return None if self.seen[node] == (axis, merged) else \
                f"{node.name} is reached with its query heads on two different axes"
        self.seen[node] = (axis, merged)
        if node.op in ("placeholder", "get_attr"):
            if _is_weight_like(node):
                self.weights.add(node)
                return None
            return f"the query heads come from {node.name}, a graph input that is not a weight indexed by head"
        self.nodes.add(node)
        steps = self._step(node, axis, merged)
        if isinstance(steps, str):
            return f"{steps}{_where(node)}"
        for item in steps:
            reason = self.weight(item[1]) if item[0] == "weight" else self.visit(*item)
            if reason:
                return reason
        return None

    def weight(self, node: object) -> str | None:
        """A query weight: a parameter or buffer, maybe through views and indexing (kept in the match)."""
        cur = node
        for _ in range(8):
            if not isinstance(cur, fx.Node):
                return f"a query weight is not a tensor ({cur!r})"
            if cur.op in ("placeholder", "get_attr"):
                self.weights.add(cur)
                return None
            if F.calls(cur, (operator.getitem,), WEIGHT_VIEWS) and isinstance(cur.args[0], fx.Node):
                self.nodes.add(cur)
                cur = cur.args[0]
                continue
            break
        return f"the query weight {getattr(cur, 'name', cur)} is computed ({F.target_name(getattr(cur, 'target', cur))}), " \
               f"not a parameter or buffer{_where(cur) if isinstance(cur, fx.Node) else ''}"

    def _step(self, node: fx.Node, axis: int, merged: bool):
        """What to visit next: ``(input, axis, merged)`` and ``("weight", node)`` items, or a reason."""
        out = F.shape(node)
        name = node.target if node.op == "call_method" else None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and F.calls(node.args[0], SPLITS, SPLIT_METHODS):
            return [(node.args[0], axis, merged)]
        if F.calls(node, SPLITS, SPLIT_METHODS):
            return self._split(node, axis, merged) or [(node.args[0], axis, merged)]
        if out is None:
            return f"{node.name} has no recorded shape"
        if F.calls(node, (), SAME_VALUE_METHODS) and F.shape(node.args[0]) == out:
            return [(node.args[0], axis, merged)]
        if node.op == "call_function" and node.target is operator.getitem:
            return self._index(node, axis, merged)
        if name == "flatten" or F.calls(node, (torch.flatten,)):
            return self._flatten(node, axis, merged)
        if name in ("view", "reshape", "unflatten"):
            return self._view(node, axis, merged)
        if F.calls(node, EINSUM):
            return self._einsum(node, axis, merged)
        if F.calls(node, LINEAR):
            if not merged or axis != len(out) - 1:
                return f"{node.name} projects the query along its head axis"
            bias = F.arg(node, 2, "bias")
            return [("weight", node.args[1])] + ([("weight", bias)] if bias is not None else [])
        if F.calls(node, CAT):
            tensors, dim = node.args[0], F.arg(node, 1, "dim", 0) % len(out)
            if dim == axis:
                return f"{node.name} concatenates along the query head axis"
            return [(t, axis, merged) for t in tensors]
        if F.calls(node, (torch.stack,)):
            tensors, dim = node.args[0], F.arg(node, 1, "dim", 0) % len(out)
            if merged or dim == axis:
                return f"{node.name} stacks along the query head axis"
            return [(t, axis if axis < dim else axis - 1, False) for t in tensors]
        if F.calls(node, POINTWISE, POINTWISE_METHODS):
            return self._pointwise(node, axis, merged, out)
        return f"{node.name} ({F.target_name(node.target)}) is a step the query heads cannot be followed through"

    @staticmethod
    def _split(split: fx.Node, axis: int, merged: bool) -> str | None:
        source = F.shape(split.args[0])
        dim = F.arg(split, 2, "dim", 0)
        if source is None or not isinstance(dim, int):
            return f"{split.name} splits the query along an unknown dim"
        if merged or dim % len(source) == axis:
            return f"{split.name} splits the query along its head axis"
        return None

    def _index(self, node: fx.Node, axis: int, merged: bool):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        source = F.shape(node.args[0])
        if source is None or not all(i is Ellipsis or isinstance(i, slice) for i in index) \
                or sum(i is Ellipsis for i in index) > 1:
            return f"{node.name} indexes the query with more than slices"
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (len(source) - len(index) + 1) + index[at + 1:]
        whole = axis >= len(index) or index[axis] == slice(None)
        if not whole or (merged and axis < len(index) and index[axis] != slice(None)):
            return f"{node.name} indexes the query along its head axis"
        return [(node.args[0], axis, merged)]

    @staticmethod
    def _flatten(node: fx.Node, axis: int, merged: bool):
        """``flatten(start, end)`` of dims other than the heads (rows ``[B, S, H, D] -> [B*S, H, D]``)."""
        before = F.shape(node.args[0])
        if before is None:
            return f"{node.name} flattens a value with no recorded shape"
        start = F.arg(node, 1, "start_dim", 0) % len(before)
        end = F.arg(node, 2, "end_dim", -1) % len(before)
        if merged or axis == start and end > start:
            return f"{node.name} flattens the query heads with other dims"
        return [(node.args[0], axis if axis < start else axis + (end - start), False)]

    def _view(self, node: fx.Node, axis: int, merged: bool):
        before, after = F.shape(node.args[0]), F.shape(node)
        if before is None:
            return f"{node.name} views a value with no recorded shape"
        if merged:
            if before[-1] == after[-1] and _prod(before) == _prod(after):
                return [(node.args[0], len(before) - 1, True)]
            return f"{node.name} splits the merged query heads"
        inner, rest = _prod(after[:axis]), _prod(after[axis + 1:])
        for j in range(len(before)):
            if before[j] == self.heads and _prod(before[:j]) == inner and _prod(before[j + 1:]) == rest:
                return [(node.args[0], j, False)]
        if before[-1] == self.heads * rest and _prod(before[:-1]) == inner:
            return [(node.args[0], len(before) - 1, True)]
        return f"{node.name} does not keep the query heads whole"

    def _einsum(self, node: fx.Node, axis: int, merged: bool):
        equation = node.args[0]
        if merged or len(node.args) != 3 or not isinstance(equation, str):
            return f"{node.name} is an einsum the query heads cannot be followed through"
        lhs, _, result = equation.replace(" ", "").partition("->")
        subscripts = lhs.split(",")
        head = result[axis] if axis < len(result) else None
        if len(subscripts) != 2 or head is None:
            return f"{node.name} is an einsum the query heads cannot be followed through"
        steps = []
        for sub, operand in zip(subscripts, node.args[1:]):
            if head not in sub:
                continue  # no head axis: read as it is
            if not isinstance(operand, fx.Node):
                return f"{node.name} reads a head-indexed operand that is not a tensor"
            if _is_weight_like(operand):
                steps.append(("weight", operand))
            else:
                steps.append((operand, sub.index(head), False))
        if not any(s[0] == "weight" for s in steps):
            return f"{node.name} has no weight indexed by the query heads"
        return steps

    def _pointwise(self, node: fx.Node, axis: int, merged: bool, out: tuple):
        steps = []
        for operand in node.args:
            if not isinstance(operand, fx.Node):
                continue
            shape = F.shape(operand)
            if shape is None:
                continue  # a scalar (SymInt) read as it is
            at = axis - (len(out) - len(shape))
            if at < 0 or shape[at] == 1:
                if at >= 0 and out[axis] == 1 and _is_weight_like(operand):
                    steps.append(("weight", operand))  # one head: a weight of that head (if replicated, equal anyway)
                continue  # broadcast over the heads: read as it is
            if shape[at] != out[axis]:
                return f"{node.name} broadcasts an operand along the query head axis"
            steps.append(("weight", operand) if _is_weight_like(operand) else (operand, at, merged))
        return steps


def _is_weight_like(node: fx.Node) -> bool:
    """A parameter or buffer (through views and indexing): read, not computed from activations."""
    cur = node
    for _ in range(8):
        if cur.op == "get_attr" or (cur.op == "placeholder" and _is_module_state(cur)):
            return True
        if F.calls(cur, (operator.getitem,), WEIGHT_VIEWS) and isinstance(cur.args[0], fx.Node):
            cur = cur.args[0]
            continue
        return False
    return False


def _is_module_state(placeholder: fx.Node) -> bool:
    """A placeholder dynamo lifted from a module's parameters or buffers."""
    value = F.example(placeholder)
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    name = source.name() if callable(getattr(source, "name", None)) else str(source or placeholder.name)
    return "_parameters" in name or "_buffers" in name or "parameters_" in placeholder.name \
        or "buffers_" in placeholder.name


def _where(node: fx.Node) -> str:
    """`` (at <source line>)``: the user's line on one line, so the refusal's advice ends it."""
    line = where(node).strip().removeprefix("at ").strip()
    return f" (at {line})" if line else ""
