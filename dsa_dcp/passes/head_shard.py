"""Shard a layer's attention epilogue by heads, for the head-sharded merges (``a2a``, ``ag_rs``, ``fused_a2a``).

After those merges rank ``r`` holds the attention output of heads ``[r*H/N, (r+1)*H/N)`` only. The
epilogue recognized is the absorbed-MLA one, as model code writes it::

    o = torch.einsum("thc,hcv->thv", out, w_uv)     # per-head value up-projection (any letters;
                                                    # the weight's first axis is the head axis)
    o = o.flatten(1)                                # or .reshape(T, -1) / .view(T, H * V)
    y = torch.nn.functional.linear(o, w_o[, bias])  # output projection over all heads

with dtype casts (``.to``, ``.type_as``, ``.float()``, ...) allowed between the steps: they act
elementwise, so they do not care which heads a rank holds. The weights may be any nodes —
parameters, or per-step slices of a fused parameter (``wkv_b[:, -v:]``).

It becomes ``einsum(out_r, w_uv[heads_r])`` -> ``flatten(1)`` -> ``linear(o_r, w_o[:, cols_r])`` ->
all-reduce (sum) -> ``+ bias``. The shards are slices of the weights in the graph (views: no weight
is copied or held twice, and Inductor folds the slices into the matrix products' strides).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.ops import C10D
from dsa_dcp.passes.graph import Emitter, only_user, refresh_meta

EINSUM_TARGETS = {torch.einsum, torch.functional.einsum}
LINEAR_TARGETS = {torch.nn.functional.linear, torch._C._nn.linear}
CAST_METHODS = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "contiguous"}
RESHAPE_METHODS = {"reshape", "view"}


def _value(node: object):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is_head_einsum(node: fx.Node, out: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target in EINSUM_TARGETS and len(node.args) == 3):
        return False
    equation, a, w = node.args
    if a is not out or not isinstance(equation, str) or not isinstance(w, fx.Node):
        return False
    lhs, _, result = equation.replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2 or any(len(o) != 3 for o in ops) or len(result) != 3:
        return False
    (t, h, c), weight = ops[0], ops[1]
    # out [T, H, C] x w [H, ...] -> [T, H, V]: head axis kept, latent axis contracted
    return weight[0] == h and result[0] == t and result[1] == h and c in weight and c not in result


def _is_cast(node: fx.Node, src: fx.Node) -> bool:
    return node.op == "call_method" and node.target in CAST_METHODS and node.args[0] is src


def _is_flatten_heads(node: fx.Node, src: fx.Node) -> bool:
    """``src.flatten(1)``, ``torch.flatten(src, 1)``, or a reshape/view of the 3-d ``src`` to 2-d."""
    if node.args[0] is not src:
        return False
    if (node.op == "call_method" and node.target == "flatten") or (
            node.op == "call_function" and node.target is torch.flatten):
        args, kw = list(node.args[1:]), node.kwargs
        start = args[0] if args else kw.get("start_dim", 0)
        end = args[1] if len(args) > 1 else kw.get("end_dim", -1)
        return start == 1 and end in (-1, 2)
    if (node.op == "call_method" and node.target in RESHAPE_METHODS) or (
            node.op == "call_function" and node.target is torch.reshape):
        before, after = _value(src), _value(node)
        return before is not None and after is not None and before.dim() == 3 and after.dim() == 2 \
            and after.shape[0] == before.shape[0]
    return False


def _follow(node: fx.Node, accept) -> fx.Node | None:
    """The node after ``node`` that ``accept`` matches, skipping casts; each step its only user."""
    while True:
        user = only_user(node)
        if user is None:
            return None
        if accept(user, node):
            return user
        if not _is_cast(user, node):
            return None
        node = user


@dataclasses.dataclass
class HeadEpilogue:
    """One matched epilogue: ``einsum -> [casts] -> flatten -> [casts] -> linear`` fed by an attention output."""

    einsum: fx.Node
    flatten: fx.Node
    linear: fx.Node

    @classmethod
    def match(cls, out: fx.Node) -> HeadEpilogue | None:
        einsum = _follow(out, lambda u, src: _is_head_einsum(u, src))
        if einsum is None:
            return None
        flat = _follow(einsum, _is_flatten_heads)
        if flat is None:
            return None
        linear = _follow(flat, lambda u, src: u.op == "call_function" and u.target in LINEAR_TARGETS
                         and u.args[0] is src and isinstance(u.args[1], fx.Node))
        if linear is None:
            return None
        w_uv, w_o = _value(einsum.args[2]), _value(linear.args[1])
        o = _value(einsum)
        if w_uv is None or w_o is None or o is None or w_o.dim() != 2 \
                or w_o.shape[1] != o.shape[1] * o.shape[2]:
            return None
        return cls(einsum, flat, linear)

    def shard(self, gm: fx.GraphModule, dcp_size: int, rank: int, group_name: str) -> fx.Node:
        """Rewrite in place for this rank's head group (see module docstring); returns the all-reduce."""
        graph = gm.graph
        w_uv_node, w_o_node = self.einsum.args[2], self.linear.args[1]
        group = _value(w_uv_node).shape[0] // dcp_size
        cols = _value(w_o_node).shape[1] // dcp_size
        emit = Emitter(graph, like=self.einsum)
        with graph.inserting_before(self.einsum):
            w_uv_shard = emit(operator.getitem, w_uv_node, slice(rank * group, (rank + 1) * group))
        self.einsum.args = (self.einsum.args[0], self.einsum.args[1], w_uv_shard)
        if self.flatten.target != "flatten" and self.flatten.target is not torch.flatten:
            with graph.inserting_before(self.flatten):  # a view to [T, H * V] names the old width
                flat = emit(torch.flatten, self.flatten.args[0], 1)
            self.flatten.replace_all_uses_with(flat)
            graph.erase_node(self.flatten)
            self.flatten = flat
        bias = self.linear.args[2] if len(self.linear.args) > 2 else self.linear.kwargs.get("bias")
        chain, node = [], self.einsum  # einsum -> casts -> flatten -> casts: their shapes shrink to H/N heads
        while node is not self.linear:
            chain.append(node)
            node = only_user(node)
        refresh_meta(chain)
        with graph.inserting_before(self.linear):
            w_o_shard = emit(operator.getitem, w_o_node, (slice(None), slice(rank * cols, (rank + 1) * cols)))
        self.linear.args = (self.linear.args[0], w_o_shard)
        self.linear.kwargs = {}
        with graph.inserting_after(self.linear):
            reduced = emit(C10D.all_reduce.default, self.linear, "sum", group_name)
        with graph.inserting_after(reduced):
            result = emit(C10D.wait_tensor.default, reduced)
        if bias is not None:
            with graph.inserting_after(result):
                result = emit(torch.add, result, bias)
        for user in list(self.linear.users):
            if user is not reduced:
                user.replace_input_with(self.linear, result)
        return reduced
