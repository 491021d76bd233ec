"""Shard a layer's attention epilogue by heads, for the head-sharded merges (``a2a``, ``ag_rs``).

After those merges rank ``r`` holds the attention output of heads ``[r*H/N, (r+1)*H/N)`` only. The
epilogue the passes recognize is the absorbed-MLA one::

    o = torch.einsum("thc,hcv->thv", out, w_uv)     # per-head value up-projection
    o = o.flatten(1)
    y = torch.nn.functional.linear(o, w_o[, bias])  # output projection over all heads

It becomes ``einsum(out_r, w_uv[heads_r])`` -> ``flatten`` -> ``linear(o_r, w_o[:, cols_r])`` ->
all-reduce (sum) -> ``+ bias``. The weight shards are sliced once, at compile time, from the real
parameters and kept as constants of the compiled graph; nothing is re-sliced per step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

import operator

from dsa_dcp.passes.graph import only_user

EINSUM_TARGETS = {torch.einsum, torch.functional.einsum}
LINEAR_TARGETS = {torch.nn.functional.linear, torch._C._nn.linear}
C10D = torch.ops._c10d_functional


def _is_head_einsum(node: fx.Node, out: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target in EINSUM_TARGETS and len(node.args) == 3):
        return False
    equation, a, w = node.args
    if a is not out or not isinstance(equation, str) or not isinstance(w, fx.Node):
        return False
    lhs, _, result = equation.replace(" ", "").partition("->")
    ops = lhs.split(",")
    # out is [T, H, C], w is [H, C, V], result keeps the head letter at position 1.
    return len(ops) == 2 and len(ops[0]) == 3 and len(ops[1]) == 3 and ops[1][0] == ops[0][1] \
        and len(result) == 3 and result[1] == ops[0][1]


def _is_flatten_1(node: fx.Node, src: fx.Node) -> bool:
    """``src.flatten(1)`` (or ``torch.flatten(src, 1)``) on a 3-d tensor."""
    is_flatten = (node.op == "call_method" and node.target == "flatten") or (
        node.op == "call_function" and node.target is torch.flatten
    )
    if not is_flatten or node.args[0] is not src:
        return False
    args, kw = list(node.args[1:]), node.kwargs
    start = args[0] if args else kw.get("start_dim", 0)
    end = args[1] if len(args) > 1 else kw.get("end_dim", -1)
    return start == 1 and end in (-1, 2)


@dataclasses.dataclass
class HeadEpilogue:
    """One matched epilogue: ``einsum -> flatten -> linear`` fed by an attention output."""

    einsum: fx.Node
    flatten: fx.Node
    linear: fx.Node

    @classmethod
    def match(cls, out: fx.Node) -> HeadEpilogue | None:
        einsum = only_user(out)
        if einsum is None or not _is_head_einsum(einsum, out):
            return None
        flat = only_user(einsum)
        if flat is None or not _is_flatten_1(flat, einsum):
            return None
        linear = only_user(flat)
        if linear is None or linear.op != "call_function" or linear.target not in LINEAR_TARGETS \
                or linear.args[0] is not flat or not isinstance(linear.args[1], fx.Node):
            return None
        return cls(einsum, flat, linear)

    def shard(self, gm: fx.GraphModule, example_inputs: tuple, dcp_size: int, rank: int, group_name: str) -> None:
        """Rewrite in place for this rank's head group (see module docstring)."""
        w_uv_node = self.einsum.args[2]
        w_o_node = self.linear.args[1]
        heads = w_uv_node.meta["example_value"].shape[0]
        group = heads // dcp_size
        cols = w_o_node.meta["example_value"].shape[1] // dcp_size
        graph = gm.graph
        with graph.inserting_before(self.einsum):
            w_uv_attr = graph.call_function(operator.getitem, (w_uv_node, slice(rank * group, (rank + 1) * group)))
        self.einsum.args = (self.einsum.args[0], self.einsum.args[1], w_uv_attr)
        bias = self.linear.args[2] if len(self.linear.args) > 2 else self.linear.kwargs.get("bias")
        with graph.inserting_before(self.linear):
            w_o_attr = graph.call_function(operator.getitem, (w_o_node, (slice(None), slice(rank * cols, (rank + 1) * cols))))
        self.linear.args = (self.flatten, w_o_attr)
        self.linear.kwargs = {}
        with graph.inserting_after(self.linear):
            reduced = graph.call_function(C10D.all_reduce.default, (self.linear, "sum", group_name))
        with graph.inserting_after(reduced):
            waited = graph.call_function(C10D.wait_tensor.default, (reduced,))
        result = waited
        if bias is not None:
            with graph.inserting_after(waited):
                result = graph.call_function(torch.add, (waited, bias))
        for user in list(self.linear.users):
            if user is not reduced:
                user.replace_input_with(self.linear, result)

