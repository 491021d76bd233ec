"""Matcher for a layer's attention epilogue: from the attention output ``[R, H, D]`` to the output
projection, with the head axis tracked on the way (the steps the head-sharded merges shard).

The canonical absorbed-MLA epilogue is ``einsum("thc,hcv->thv", out, w_uv)`` -> ``flatten(1)`` ->
``linear(., w_o[, bias])``. Models written elsewhere reach their output projection through other
steps, for example::

    x = out.unflatten(0, (b, s))                            # [B, S, H, Dc]   (recognize_attention)
    x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -v:])    # per-head value up-projection, weight
    y = wo(x.flatten(2)).type_as(x)                         #   sliced per step from a fused parameter

    x = out.unflatten(0, (b, s)).transpose(1, 2)           # transformers: [B, H, S, Dv]
    x = x.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()
    y = o_proj(x)                                           # linear, maybe with a bias

``HeadEpilogue.match(out)`` follows the attention output through single-user steps, tracking where
the head axis is from the recorded shapes: casts and ``contiguous``, ``transpose``/``permute``,
``unflatten``/``view``/``reshape`` that keep the head axis whole, a per-head ``einsum`` with a
weight indexed by head first, then a ``flatten``/``view``/``reshape`` that merges the heads with
the dims after them (head-major), views that keep that last dim, and ``linear(x, w[, bias])``.
Anything else does not match (``None``). ``passes/head_shard.py`` shards a match.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from dsa_dcp.passes import fx as F

EINSUM = {torch.einsum, torch.functional.einsum}
LINEAR = {torch.nn.functional.linear, torch._C._nn.linear}
SAME_SHAPE_METHODS = {"contiguous", "clone", "to", "type_as", "float", "half", "bfloat16", "type"}


def _prod(xs) -> object:
    return math.prod(xs) if xs else 1


@dataclasses.dataclass
class Resize:
    node: fx.Node
    position: int  # which output axis holds the heads (or the merged heads) and must shrink by N


@dataclasses.dataclass
class HeadEpilogue:
    """A matched epilogue: the per-head weights, the resizes on the way, and the projection."""

    einsums: list[fx.Node]
    resizes: list[Resize]
    linear: fx.Node
    heads: int
    steps: list[fx.Node]  # every node from the attention output to the projection, in order

    @classmethod
    def match(cls, out: fx.Node) -> HeadEpilogue | None:
        shape = F.shape(out)
        if len(shape) != 3:
            return None
        heads, axis, merged = shape[1], 1, False
        einsums, resizes, steps = [], [], []
        cur = out
        for _ in range(64):  # the walk is short; a bound keeps a malformed graph from looping
            user = F.only_user(cur)
            if merged and user is None:  # `linear(x, w).type_as(x)`: x is also read for its dtype
                users = [u for u in cur.users if not _reads_dtype_only(u, cur)]
                user = users[0] if len(users) == 1 else None
            if user is None:
                return None
            if merged and user.op == "call_function" and user.target in LINEAR and user.args[0] is cur \
                    and isinstance(user.args[1], fx.Node) and F.shape(user.args[1])[1] == F.shape(cur)[-1]:
                return cls(einsums, resizes, user, heads, steps)
            step = _step(user, cur, axis, merged, heads)
            if step is None:
                return None
            axis, merged, kind = step
            if kind == "einsum":
                einsums.append(user)
            elif isinstance(kind, int):
                resizes.append(Resize(user, kind))
            steps.append(user)
            cur = user
        return None


def _reads_dtype_only(user: fx.Node, node: fx.Node) -> bool:
    """``y.type_as(node)``: ``node``'s dtype, not its values or shape."""
    return user.op == "call_method" and user.target == "type_as" and len(user.args) == 2 \
        and user.args[1] is node and user.args[0] is not node


def _step(node: fx.Node, src: fx.Node, axis: int, merged: bool, heads: int):
    """``(new axis, merged, kind)`` for one step of the walk (``kind``: "einsum", the output axis of
    a resize to shard, or None), or ``None`` if the step does not keep the heads traceable."""
    is_einsum = node.op == "call_function" and node.target in EINSUM
    if (node.args[1] if is_einsum and len(node.args) > 1 else node.args[0]) is not src:
        return None
    before, after = F.shape(src), F.shape(node)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_method" and name in SAME_SHAPE_METHODS and after == before:
        return axis, merged, None
    if merged:  # only views that keep the merged last dim, up to the projection
        if name in ("view", "reshape") and after[-1] == before[-1] and _prod(after) == _prod(before):
            return axis, True, len(after) - 1
        return None
    if node.op == "call_function" and node.target in EINSUM and len(node.args) == 3 \
            and isinstance(node.args[0], str) and node.args[1] is src and isinstance(node.args[2], fx.Node):
        lhs, _, res = node.args[0].replace(" ", "").partition("->")
        ops = lhs.split(",")
        if len(ops) != 2 or len(ops[0]) != len(before):
            return None
        head = ops[0][axis]
        if ops[1][:1] != head or head not in res or F.shape(node.args[2])[0] != heads:
            return None
        return res.index(head), False, "einsum"
    if name == "transpose" and node.op == "call_method":
        a, b = (d % len(before) for d in node.args[1:3])
        return (b if axis == a else a if axis == b else axis), False, None
    if name == "permute" and node.op == "call_method":
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        dims = [d % len(before) for d in dims]
        return dims.index(axis), False, None
    if name == "flatten":  # x.flatten(...) or torch.flatten(x, ...)
        start = (node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)) % len(before)
        end = (node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)) % len(before)
        if axis < start:
            return axis, False, None
        if axis > end:
            return axis - (end - start), False, None
        if axis == start and end == len(before) - 1:
            return axis, True, None
        return None
    if name in ("view", "reshape", "unflatten") and node.op == "call_method":
        inner = _prod(before[:axis])
        for j in range(len(after)):  # the head axis kept whole, at the same row-major offset
            if after[j] == heads and _prod(after[:j]) == inner and _prod(after[j + 1:]) == _prod(before[axis + 1:]):
                return j, False, (j if name != "unflatten" else None)
        if after[-1] == _prod(before[axis:]) and _prod(after[:-1]) == inner and name != "unflatten":
            return len(after) - 1, True, len(after) - 1
        return None
    return None


