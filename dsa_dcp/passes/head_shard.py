"""Shard a layer's attention epilogue by heads, for the head-sharded merges (``a2a``, ``ag_rs``,
``fused_a2a``): after them rank ``r`` holds the attention output of heads ``[r*H/N, (r+1)*H/N)`` only.

``shard(epilogue, ...)`` rewrites a ``HeadEpilogue`` (``passes/match/epilogue.py``) for the rank's
head group: the per-head weight and the output projection's columns are sliced (views of the
weights the graph already has: no weight is copied or held twice, and Inductor folds the slices
into the matrix products' strides), explicit sizes of the head axis are divided by ``N``, an
all-reduce (sum) follows the projection, with the bias added after it, and the metadata of every
step is recomputed for its new shape. A layer whose epilogue does not match merges with ``ag``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsa_dcp.ops import C10D
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.match.epilogue import HeadEpilogue, Resize


def shard(epilogue: HeadEpilogue, gm: fx.GraphModule, dcp_size: int, rank: int, group_name: str) -> fx.Node:
    """Rewrite ``epilogue`` in place for this rank's head group (module docstring); returns the all-reduce."""
    graph = gm.graph
    group = epilogue.heads // dcp_size
    emit = F.Emitter(graph, like=epilogue.linear)
    for einsum in epilogue.einsums:
        with graph.inserting_before(einsum):
            part = emit(operator.getitem, einsum.args[2], slice(rank * group, (rank + 1) * group))
        einsum.update_arg(2, part)
    for resize in epilogue.resizes:
        _shrink_size_arg(resize, dcp_size)
    F.refresh_meta(epilogue.steps)  # their head axis shrank to H/N
    w_o = epilogue.linear.args[1]
    cols = F.shape(w_o)[1] // dcp_size
    bias = epilogue.linear.args[2] if len(epilogue.linear.args) > 2 else epilogue.linear.kwargs.get("bias")
    with graph.inserting_before(epilogue.linear):
        w_part = emit(operator.getitem, w_o, (slice(None), slice(rank * cols, (rank + 1) * cols)))
    epilogue.linear.args = (epilogue.linear.args[0], w_part)
    epilogue.linear.kwargs = {}
    with graph.inserting_after(epilogue.linear):
        reduced = emit(C10D.all_reduce.default, epilogue.linear, "sum", group_name)
    with graph.inserting_after(reduced):
        result = emit(C10D.wait_tensor.default, reduced)
    if bias is not None:
        with graph.inserting_after(result):
            result = emit(torch.add, result, bias)
    for user in list(epilogue.linear.users):
        if user is not reduced:
            user.replace_input_with(epilogue.linear, result)
    return reduced


def _shrink_size_arg(resize: Resize, dcp_size: int) -> None:
    """Divide the explicit size of the (merged) head axis of a ``view``/``reshape`` by ``N``."""
    node = resize.node
    sizes = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else list(node.args[1:])
    size = sizes[resize.position]
    if isinstance(size, int) and size != -1:
        sizes[resize.position] = size // dcp_size
        node.args = (node.args[0], *sizes)
