"""Fuse the ``a2a`` merge into one node per layer: ``fused_a2a_merge``.

Expects: the graph ``DCPRewrite`` leaves for ``merge="a2a"`` (or ``"fused_a2a"``)::

    packed = pack_head_groups(out_r, lse_r, N)
    received = wait_tensor(all_to_all_single(packed, [1]*N, [1]*N, group))
    parts = unpack_head_groups(received, D)
    combined = lse_combine(parts[0], parts[1])

Leaves: ``combined = fused_a2a_merge(out_r, lse_r, N, rank, group)`` and nothing of the chain.
On CUDA that node is one kernel launch (``kernels/fused_merge.py``); elsewhere it runs the
composed reference, so every CPU test of ``a2a`` also runs the fused node. A chain that does not
match exactly (another user of an intermediate) is left as it is and logged.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp import merge
from dsa_dcp.passes.base import CompileContext, DCPPass, log
from dsa_dcp.passes.graph import only_user

C10D = torch.ops._c10d_functional
FUSED = torch.ops.dsa_dcp.fused_a2a_merge.default
LSE_COMBINE = torch.ops.dsa_dcp.lse_combine.default


@dataclasses.dataclass
class A2AMerge:
    pack: fx.Node
    exchange: fx.Node
    wait: fx.Node
    unpack: fx.Node
    getitems: list[fx.Node]
    combine: fx.Node

    @classmethod
    def match(cls, pack: fx.Node) -> A2AMerge | None:
        exchange = only_user(pack, C10D.all_to_all_single.default)
        wait = exchange and only_user(exchange, C10D.wait_tensor.default)
        unpack = wait and only_user(wait, merge.unpack_head_groups)
        if unpack is None:
            return None
        getitems = list(unpack.users)
        if len(getitems) != 2 or any(g.target is not operator.getitem for g in getitems):
            return None
        by_index = {g.args[1]: g for g in getitems}
        combines = {u for g in getitems for u in g.users}
        if set(by_index) != {0, 1} or len(combines) != 1:
            return None
        combine = combines.pop()
        if combine.target is not LSE_COMBINE or combine.args != (by_index[0], by_index[1]):
            return None
        return cls(pack, exchange, wait, unpack, [by_index[0], by_index[1]], combine)

    def replace(self, graph: fx.Graph, rank: int) -> None:
        out_r, lse_r, n = self.pack.args
        group = self.exchange.args[3]
        with graph.inserting_before(self.combine):
            fused = graph.call_function(FUSED, (out_r, lse_r, n, rank, group))
        self.combine.replace_all_uses_with(fused)
        for node in (self.combine, *self.getitems, self.unpack, self.wait, self.exchange, self.pack):
            graph.erase_node(node)


class FuseMergeA2A(DCPPass):
    name = "fuse_merge"

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> dict:
        packs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is merge.pack_head_groups]
        fused = 0
        for pack in packs:
            match = A2AMerge.match(pack)
            if match is None:
                log.debug("fuse_merge: %s does not start a pack -> all_to_all -> combine chain; left as is", pack.name)
                continue
            match.replace(gm.graph, ctx.rank)
            fused += 1
        return {"merges_fused": fused, "merges_left": len(packs) - fused}
