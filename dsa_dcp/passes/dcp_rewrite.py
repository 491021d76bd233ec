"""The DCP rewrite: every sparse attention node attends over this rank's slots, then merges.

Expects: dynamo's graph with sparse attention nodes (``SPARSE_ATTENTION_OPS``) whose KV caches
were already localized (``LocalizeKVWrites``): each holds this rank's rows only.
Leaves, for each attention node ``(out, lse) = attn(q_nope, q_pe, kv, topk, scale)``::

    local, count = topk_remap(topk, N, rank, I)              # one per attention node
    out_r, lse_r = attn(q_nope, q_pe, kv, local, scale)      # empty rows are (0, -inf) by contract
    merge by options.merge:
      ag     pack -> all_gather -> unpack -> lse_combine              every rank: all H heads
      a2a    pack by head group -> all_to_all -> unpack -> lse_combine  rank j: heads of group j
      ag_rs  all_gather(lse) -> rescale -> reduce_scatter over heads     rank j: heads of group j

For the head-sharded merges the layer's epilogue is sharded too (``head_shard.HeadEpilogue``).
Everything is checked before anything is rewritten: a graph it refuses is left untouched.
Layers that share a top-k tensor get one remap each here; ``share_remaps`` merges them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsa_dcp import merge
from dsa_dcp.passes.base import CompileContext, DCPPass, log
from dsa_dcp.passes.errors import DCPRewriteError, where
from dsa_dcp.debug_checks import check_topk
from dsa_dcp.kv_cache import kv_layout
from dsa_dcp.passes.graph import alias_base, getitem_users, is_collective, placeholder_values, sparse_attention_nodes
from dsa_dcp.passes.epilogue_trace import TracedHeadEpilogue
from dsa_dcp.passes.head_shard import HeadEpilogue

C10D = torch.ops._c10d_functional
TOPK_REMAP = torch.ops.dsa_dcp.topk_remap.default
LSE_COMBINE = torch.ops.dsa_dcp.lse_combine.default
HEAD_SHARDED_MERGES = ("a2a", "fused_a2a", "ag_rs")


class AgFallback(str):
    """A layer whose epilogue a head-sharded merge cannot shard: merged with ``ag`` (the reason)."""

    @property
    def reason(self) -> str:
        return str(self)


def _heads_and_dim(attn: fx.Node) -> tuple[int, int]:
    """Heads and head dim of the attention output (the value dim may differ from the query's)."""
    value = attn.meta.get("example_value")
    value = value[0] if isinstance(value, (tuple, list)) else attn.args[0].meta.get("example_value")
    if value is None:
        raise DCPRewriteError(f"no shape recorded for the output of {attn.name}")
    return value.shape[1], value.shape[2]


class DCPRewrite(DCPPass):
    name = "dcp_rewrite"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> list[str]:
        """Every reason the attention nodes cannot be rewritten for these options."""
        problems = [p for attn in sparse_attention_nodes(gm.graph) for p in self._plan(attn, ctx)[1]]
        if ctx.group_name is None:
            problems.append("dcp_size > 1 needs a process group to merge over")
        return problems

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> dict:
        opts = ctx.options
        attns = sparse_attention_nodes(gm.graph)
        problems = self.check(gm, ctx)  # everything is validated before anything is rewritten
        if problems:
            raise DCPRewriteError("\n".join(problems))
        collectives, fallbacks = 0, []
        for layer, attn in enumerate(attns):
            epilogue, _ = self._plan(attn, ctx)
            if opts.debug_checks:
                self._insert_topk_check(gm, ctx, attn, layer)
            mode = opts.merge
            if isinstance(epilogue, AgFallback):  # this layer only: its epilogue cannot be sharded by heads
                log.warning("dsa_dcp: %s", epilogue.reason)
                fallbacks.append(attn.name)
                epilogue, mode = None, "ag"
            collectives += self._rewrite(gm, ctx, attn, epilogue, mode)
        return {
            "sparse_attention_nodes": len(attns),
            "remaps_inserted": len(attns),
            "merge": opts.merge,
            "collectives_inserted": collectives,
            "merge_fallbacks": fallbacks,
        }

    def _plan(self, attn: fx.Node, ctx: CompileContext) -> tuple[HeadEpilogue | None, list[str]]:
        """The epilogue to shard by heads (head-sharded merges), and the problems found."""
        n, merge_mode = ctx.dcp_size, ctx.options.merge
        if merge_mode not in HEAD_SHARDED_MERGES:
            return None, []
        heads, _ = _heads_and_dim(attn)
        if heads % n:
            return None, [
                f"merge={merge_mode!r} shards heads over the group, but {attn.name} has {heads} heads, "
                f"not divisible by dcp_size={n}; use merge='ag' or a dcp_size that divides {heads}{where(attn)}"
            ]
        items = dict(getitem_users(attn))
        if len(items) != len(attn.users):
            return None, [f"{attn.name}'s result is used whole; expected (out, lse) = attn(...){where(attn)}"]
        if 1 in items and items[1].users:
            return AgFallback(
                f"merge={merge_mode!r} leaves each rank the LSE of its own heads only, but the model uses the LSE "
                f"of {attn.name}: that layer is merged with 'ag'{where(attn)}"), []
        epilogue = HeadEpilogue.match(items[0]) if 0 in items else None
        if epilogue is None and 0 in items:
            epilogue = TracedHeadEpilogue.match(items[0])
        if epilogue is None:
            return AgFallback(
                f"merge={merge_mode!r} needs {attn.name}'s output to feed a per-head up-projection and the output "
                f"projection (einsum('thc,hcv->thv', out, w_uv).flatten(1) -> linear(., w_o), or the forms "
                f"passes/epilogue_trace.py follows), so both can be sharded by heads; this graph does something "
                f"else with it: that layer is merged with 'ag'{where(attn)}"), []
        return epilogue, []

    @staticmethod
    def _insert_topk_check(gm: fx.GraphModule, ctx: CompileContext, attn: fx.Node, layer: int) -> None:
        """``debug_checks``: a side-effect node before the remap (its result is unused, so remap
        sharing sees the same top-k). The cache's layout is known: localize_kv_writes refused any other."""
        cache = placeholder_values(gm, ctx.example_inputs)[alias_base(attn.args[2])]
        num_slots = kv_layout(cache).num_slots
        with gm.graph.inserting_before(attn):
            gm.graph.call_function(check_topk, (attn.args[3], num_slots, layer, ctx.dcp_size, ctx.group_name))

    def _rewrite(self, gm: fx.GraphModule, ctx: CompileContext, attn: fx.Node, epilogue, mode: str) -> int:
        graph, n, rank, group = gm.graph, ctx.dcp_size, ctx.rank, ctx.group_name
        q_nope, q_pe, kv, topk, scale = attn.args
        with graph.inserting_before(attn):
            remap = graph.call_function(TOPK_REMAP, (topk, n, rank, ctx.options.interleave))
            local = graph.call_function(operator.getitem, (remap, 0))
        attn.args = (q_nope, q_pe, kv, local, scale)

        old = dict(getitem_users(attn))
        calls = []

        def call(target, *args):
            node = graph.call_function(target, args)
            calls.append(node)
            return node

        def collective(op, *args):
            return call(C10D.wait_tensor.default, call(op, *args))

        with graph.inserting_before(attn.next):  # keeps the new nodes in creation order
            out_r = call(operator.getitem, attn, 0)
            lse_r = call(operator.getitem, attn, 1)
            _, head_dim = _heads_and_dim(attn)
            if mode in ("ag", "a2a", "fused_a2a"):  # fuse_merge turns the a2a chain into one node
                if mode == "ag":  # every rank gets every head of every rank
                    packed = call(merge.pack_head_groups, out_r, lse_r, 1)
                    recv = collective(C10D.all_gather_into_tensor.default, packed, n, group)
                else:  # rank j gets head group j of every rank
                    packed = call(merge.pack_head_groups, out_r, lse_r, n)
                    recv = collective(C10D.all_to_all_single.default, packed, [1] * n, [1] * n, group)
                parts = call(merge.unpack_head_groups, recv, head_dim)
                combined = call(LSE_COMBINE, call(operator.getitem, parts, 0), call(operator.getitem, parts, 1))
            elif mode == "ag_rs":
                gathered = collective(C10D.all_gather_into_tensor.default, lse_r, n, group)
                lse_all = call(merge.split_gathered, gathered, n)
                scaled = call(merge.rescale_for_reduce_scatter, out_r, lse_r, lse_all, n)
                partial = call(operator.getitem, scaled, 0)
                reduced = collective(C10D.reduce_scatter_tensor.default, partial, "sum", n, group)
                combined = call(merge.finish_reduce_scatter, reduced, call(operator.getitem, scaled, 1), out_r, n, rank)
            else:  # validated by DCPOptions
                raise DCPRewriteError(f"unknown merge {mode!r}")
            new_out = call(operator.getitem, combined, 0)
            new_lse = call(operator.getitem, combined, 1)
        for index, replacement in ((0, new_out), (1, new_lse)):
            if index in old:
                old[index].replace_all_uses_with(replacement)
                graph.erase_node(old[index])
        if epilogue is not None:
            epilogue.shard(gm, ctx.example_inputs, n, rank, group)
        return sum(1 for c in calls if is_collective(c)) + (1 if epilogue is not None else 0)
