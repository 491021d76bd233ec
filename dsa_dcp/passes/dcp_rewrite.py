"""The DCP rewrite: every sparse attention node attends over this rank's slots, then merges.

Expects: dynamo's graph with sparse attention nodes (``SPARSE_ATTENTION_OPS``) whose KV caches
were already localized (``LocalizeKVWrites``): each holds this rank's rows only.
Leaves, for each attention node ``(out, lse) = attn(q_nope, q_pe, kv, topk, scale)``::

    local, count = topk_remap(topk, N, rank, I)              # one per attention node
    out_r, lse_r = attn(q_nope, q_pe, kv, local, scale)      # empty rows are (0, -inf) by contract
    out, lse = <the merge strategy's nodes>(out_r, lse_r)    # dsa_dcp.merge.MERGES[options.merge]

For the head-sharded merges the layer's epilogue is sharded too (``match/epilogue.py``, sharded by ``head_shard.py``). A
layer whose epilogue cannot be sharded (or whose model reads the LSE) merges with ``ag`` instead,
with a warning naming the node. A layer that holds a tensor-parallel shard of the heads (its output
projection summed over a TP group: ``tensor_parallel.py``) attends with the DCP group's query heads
(``options.replicate_q``: computed on every rank from the group's query weights, gathered once at
compile time; off: all-gathered each step) and keeps the merged output of its own heads; its
epilogue and all-reduce stay as the model wrote them. ``check`` returns the plan (a ``LayerPlan`` per attention node)
that ``run`` carries out; a graph it refuses is left untouched. Layers that share a top-k tensor get
one remap each here; ``share_remaps`` merges them.
"""

from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from dsa_dcp.debug_checks import check_step
from dsa_dcp.kv_cache import kv_layout
from dsa_dcp.merge import MERGES, MergeSite, MergeStrategy, head_slice
from dsa_dcp.ops import SPARSE_MLA, TOPK_REMAP
from dsa_dcp.ops_positions import SPARSE_MLA_POSITIONS
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.fx import Emitter, alias_base, getitem_users, placeholder_values, recorded_layer, refresh_meta
from dsa_dcp.passes.graph import sparse_attention_nodes
from dsa_dcp.passes.head_shard import shard
from dsa_dcp.passes.match.epilogue import HeadEpilogue
from dsa_dcp.passes.match.query import QueryProjection
from dsa_dcp.passes.tensor_parallel import (TPSite, gather_group_query, gather_query_weights, group_problems,
                                            replicate_group_query, replicated_query_bytes, tp_site,
                                            unplaced_collectives)

ALL_GATHER = MERGES["ag"]
MLA_ATTENTION = (SPARSE_MLA, SPARSE_MLA_POSITIONS)  # one latent KV head: the same on every TP rank


@dataclasses.dataclass
class LayerPlan:
    """How one attention node is rewritten: the merge it uses and the epilogue it shards."""

    attn: fx.Node
    layer: int | None
    merge: MergeStrategy
    epilogue: HeadEpilogue | None = None
    fallback: str | None = None  # why this layer merges with ag instead of the option's merge
    tp: TPSite | None = None  # the layer holds H/T heads of this TP group
    query: QueryProjection | None = None  # replicate_q: the TP layer's query projection


@dataclasses.dataclass
class RewritePlan(Plan):
    layers: list[LayerPlan] = dataclasses.field(default_factory=list)


def _heads_and_dim(attn: fx.Node) -> tuple[object, object]:
    """Heads and head dim of the attention output (the value dim may differ from the query's)."""
    value = attn.meta.get("example_value")
    value = value[0] if isinstance(value, (tuple, list)) else attn.args[0].meta.get("example_value")
    return (value.shape[1], value.shape[2]) if value is not None else (None, None)


class DCPRewrite(DCPPass):
    name = "dcp_rewrite"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> RewritePlan:
        plan = RewritePlan()
        if ctx.group_name is None:
            plan.problems.append("dcp_size > 1 needs a process group to merge over")
        attention = sparse_attention_nodes(gm.graph)
        for attn in attention:
            self._plan_layer(attn, ctx, plan)
        placed = {layer.tp.all_reduce for layer in plan.layers if layer.tp is not None}
        unplaced = unplaced_collectives(gm, placed) if attention else []
        if unplaced:
            plan.problems.append(
                f"the model's graph has collectives the DCP rewrite cannot place ({', '.join(unplaced)}): a layer is "
                f"taken as tensor-parallel only when its attention output reaches its output projection through the "
                f"per-head epilogue and that projection is summed over a group (all_reduce 'sum'); any other "
                f"collective could mean heads the merge would mix up")
        sites = {layer.tp.group_name: layer.tp for layer in plan.layers if layer.tp is not None}
        if len(sites) > 1:
            plan.problems.append("the layers sum their output projections over different process groups; DCP needs "
                                 "one TP group for the step")
        for site in sites.values():
            plan.problems.extend(group_problems(site, ctx.group_name, ctx.dcp_size))
        other = [layer.attn.name for layer in plan.layers if layer.tp is None]
        if sites and other:  # they would be merged as if they held every head
            plan.problems.append(
                f"some layers hold a tensor-parallel shard of the heads, but {', '.join(other)} could not be recognized "
                f"as such (their attention output does not reach an output projection summed over the TP group "
                f"through the per-head epilogue); DCP inside TP needs every layer recognized")
        plan.all_gathers = [layer.attn.name for layer in plan.layers
                            if layer.merge.all_gathers or (layer.tp and layer.query is None)]
        return plan

    def _plan_layer(self, attn: fx.Node, ctx: CompileContext, plan: RewritePlan) -> None:
        n, strategy = ctx.dcp_size, MERGES[ctx.options.merge]
        layer = recorded_layer(attn)
        heads, head_dim = _heads_and_dim(attn)
        if heads is None:
            plan.problems.append(f"no shape recorded for the query of {attn.name}{where(attn)}")
            return
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            plan.problems.append(f"{attn.name} has a symbolic head count or head dim ({heads}, {head_dim}); "
                                 f"DCP needs them static{where(attn)}")
            return
        items = dict(getitem_users(attn))
        whole = len(items) != len(attn.users)
        epilogue = HeadEpilogue.match(items[0]) if 0 in items and not whole else None
        tp = tp_site(epilogue.linear) if epilogue is not None else None
        if tp is not None:
            self._plan_tp_layer(attn, layer, strategy, tp, ctx.options.replicate_q, plan)
            return
        if not strategy.head_sharded:
            plan.layers.append(LayerPlan(attn, layer, strategy))
            return
        if heads % n:
            plan.problems.append(
                f"merge={strategy.name!r} shards heads over the group, but {attn.name} has {heads} heads, "
                f"not divisible by dcp_size={n}; use merge='ag' or a dcp_size that divides {heads}{where(attn)}")
            return
        if whole:
            reason = "its (out, lse) result is used whole"
        elif 1 in items and items[1].users:
            reason = "the model reads its LSE, and a head-sharded merge leaves each rank the LSE of its own heads"
        else:
            if epilogue is not None:
                plan.layers.append(LayerPlan(attn, layer, strategy, epilogue))
                return
            reason = ("its output does not feed a per-head up-projection and the output projection "
                      "(einsum('thc,hcv->thv', out, w_uv) -> flatten(1) -> linear(., w_o)) that could be "
                      "sharded by heads")
        fallback = f"merge={strategy.name!r} cannot shard {attn.name} by heads: {reason}; this layer merges " \
                   f"with 'ag'{where(attn)}"
        plan.layers.append(LayerPlan(attn, layer, ALL_GATHER, fallback=fallback))
        plan.warnings.append(fallback)

    @staticmethod
    def _plan_tp_layer(attn: fx.Node, layer: int | None, strategy: MergeStrategy, tp: TPSite, replicate_q: bool,
                       plan: RewritePlan) -> None:
        if attn.target not in MLA_ATTENTION:
            plan.problems.append(f"{attn.name} holds a tensor-parallel shard of the heads; DCP inside TP takes the MLA "
                                 f"attention (sparse_mla, sparse_mla_positions) only{where(attn)}")
        query = QueryProjection.match(attn) if replicate_q and attn.target in MLA_ATTENTION else None
        if isinstance(query, str):  # the layer stays planned (its all-reduce placed): the problem refuses
            plan.problems.append(f"replicate_q: the query weights of {attn.name}'s heads cannot be found: {query}; "
                                 f"compile with replicate_q=False")
            query = None
        plan.layers.append(LayerPlan(attn, layer, strategy, tp=tp, query=query))

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: RewritePlan) -> dict:
        collectives = 0
        checks = _DebugChecks(gm, ctx) if ctx.options.debug_checks else None
        weights = [w for layer in plan.layers if layer.query is not None for w in layer.query.weights]
        gathered = gather_query_weights(weights, placeholder_values(gm, ctx.example_inputs), ctx.dcp_size,
                                        ctx.group_name) if weights else {}
        for index, layer in enumerate(plan.layers):
            collectives += self._rewrite(gm, ctx, layer, index, checks, gathered)
        return {
            "sparse_attention_nodes": len(plan.layers),
            "remaps_inserted": len(plan.layers),
            "merge": ctx.options.merge,
            "layers_merged_with_ag": [l.attn.name for l in plan.layers if l.fallback],
            "tp_layers": sum(1 for l in plan.layers if l.tp is not None),
            "query_all_gathers": sum(1 for l in plan.layers if l.tp is not None and l.query is None),
            "replicated_query_bytes": sum(replicated_query_bytes(l.query, gathered, ctx.dcp_size)
                                          for l in plan.layers if l.query is not None),
            "collectives_inserted": collectives,
        }

    @staticmethod
    def _rewrite(gm: fx.GraphModule, ctx: CompileContext, layer: LayerPlan, index: int,
                 checks: _DebugChecks | None, gathered: dict) -> int:
        graph, attn, n = gm.graph, layer.attn, ctx.dcp_size
        emit = Emitter(graph, like=attn)
        q_nope, q_pe, kv, topk, *rest = attn.args  # rest: sm_scale [, kv_scale, block_scales] (FP8 KV)
        with graph.inserting_before(attn):
            if checks is not None:
                checks.insert(topk, kv, index)
            local = emit(operator.getitem, emit(TOPK_REMAP, topk, n, ctx.rank, ctx.options.interleave), 0)
            if layer.query is not None:  # the DCP group's heads: each rank's H/T, in DCP-rank order
                q_nope, q_pe = replicate_group_query(gm, emit, layer.query, gathered, n, ctx.rank)
            elif layer.tp is not None:
                q_nope, q_pe = gather_group_query(emit, q_nope, q_pe, n, ctx.group_name)
        attn.args = (q_nope, q_pe, kv, local, *rest)
        if layer.tp is not None:
            refresh_meta([attn])

        old = dict(getitem_users(attn))
        with graph.inserting_before(attn.next):  # keeps the new nodes in creation order
            out_r = emit(operator.getitem, attn, 0)
            lse_r = emit(operator.getitem, attn, 1)
            if checks is not None:
                checks.insert(topk, kv, index)
            site = MergeSite(dcp_size=n, rank=ctx.rank, group_name=ctx.group_name, head_dim=_heads_and_dim(attn)[1])
            combined = layer.merge.emit(emit, out_r, lse_r, site)
            new_out = emit(operator.getitem, combined, 0)
            new_lse = emit(operator.getitem, combined, 1)
            if layer.tp is not None and not layer.merge.head_sharded:  # all N*H/T heads merged: keep this rank's
                new_out, new_lse = (emit(head_slice, value, n, ctx.rank) for value in (new_out, new_lse))
        for i, replacement in ((0, new_out), (1, new_lse)):
            if i in old:
                old[i].replace_all_uses_with(replacement)
                graph.erase_node(old[i])
        if layer.epilogue is not None:
            all_reduce = shard(layer.epilogue, gm, n, ctx.rank, ctx.group_name)
            if checks is not None:
                with graph.inserting_before(all_reduce):
                    checks.insert(topk, kv, index)
        gathers_query = layer.tp is not None and layer.query is None
        return layer.merge.collectives + (1 if layer.epilogue is not None or gathers_query else 0)


class _DebugChecks:
    """``debug_checks``: a ``check_step`` node before each collective the rewrite adds, numbered in
    graph order. Its result is unused, so remap sharing still sees the same top-k. The cache's layout
    is known: localize_kv_writes refused any other."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext) -> None:
        self.graph, self.ctx, self.position = gm.graph, ctx, 0
        self.values = placeholder_values(gm, ctx.example_inputs)

    def insert(self, topk: fx.Node, kv: fx.Node, layer_index: int) -> None:
        """A check of the layer's global ``topk`` (slots of the cache ``kv``) at the insert point."""
        num_slots = kv_layout(self.values[alias_base(kv)]).num_slots
        Emitter(self.graph).opaque(check_step, topk, self.position, layer_index, num_slots, self.ctx.dcp_size,
                            self.ctx.group_name)
        self.position += 1
