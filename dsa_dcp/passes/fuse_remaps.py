"""Fuse each top-k remap into the selection that feeds it.

Expects: the graph ``share_remaps`` leaves (one ``topk_remap(topk, N, rank, I)`` per distinct top-k),
where a recognized indexer's top-k is ``topk_select(scores, page_table, req_ids, P, K)`` (or, with
``index_cache="sharded"``, ``topk_agree(gathered, page_table, req_ids, P, K, N)``).
Leaves: a remap whose top-k comes from such a node that nothing else reads becomes one
``topk_select_remap(scores, page_table, req_ids, P, K, N, rank, I)`` (``topk_agree_remap(...)``):
this rank's local rows straight from the selection, with no ``[T, K]`` global top-k written in
between. The fused op is the composition exactly, so the values are unchanged. A top-k also read
elsewhere (``debug_checks`` compares it across the ranks, a model may read it) keeps its remap;
each such case is logged (debug, ``dsa_dcp.passes``) and listed in the stats. Layers that share a
top-k keep sharing: the one remap ``share_remaps`` kept is the one fused.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from dsa_dcp.ops import TOPK_AGREE, TOPK_AGREE_REMAP, TOPK_REMAP, TOPK_SELECT, TOPK_SELECT_REMAP
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan, log
from dsa_dcp.passes.fx import Emitter

FUSED = {TOPK_SELECT: TOPK_SELECT_REMAP, TOPK_AGREE: TOPK_AGREE_REMAP}


@dataclasses.dataclass
class FusePlan(Plan):
    fused: list[tuple[fx.Node, fx.Node, tuple]] = dataclasses.field(default_factory=list)  # (remap, top-k, args)
    kept: list[str] = dataclasses.field(default_factory=list)


class FuseRemaps(DCPPass):
    name = "fuse_remaps"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> FusePlan:
        """Which remaps fuse into their selection, and why the others stay apart."""
        plan = FusePlan()
        for remap in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TOPK_REMAP]:
            topk, n, rank, interleave = remap.args
            if not (isinstance(topk, fx.Node) and topk.op == "call_function" and topk.target in FUSED):
                continue  # a top-k the model computes itself: nothing to fuse with
            if len(topk.users) != 1 or remap.kwargs:
                reason = f"{remap.name}: its top-k {topk.name} is also read by " \
                         f"{[u.name for u in topk.users if u is not remap]}: kept unfused"
                log.debug("fuse_remaps: %s", reason)
                plan.kept.append(reason)
                continue
            if topk.target is TOPK_AGREE and topk.args[-1] != n:
                plan.kept.append(f"{remap.name}: remaps for N={n}, its top-k was agreed over N={topk.args[-1]}: "
                                 f"kept unfused")
                continue
            args = topk.args if topk.target is TOPK_AGREE else (*topk.args, n)  # topk_agree carries N already
            plan.fused.append((remap, topk, (*args, rank, interleave)))
        return plan

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: FusePlan) -> dict:
        graph = gm.graph
        for remap, topk, args in plan.fused:
            with graph.inserting_before(remap):
                node = Emitter(graph, like=remap)(FUSED[topk.target], *args)
            remap.replace_all_uses_with(node)
            graph.erase_node(remap)
            graph.erase_node(topk)
        return {"remaps_fused": len(plan.fused), "remaps_kept": plan.kept}
