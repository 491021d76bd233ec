"""The index cache under DCP: replicated (left as it is) or sharded (``options.index_cache``).

Expects: the graph the ``indexer_kernels`` pass leaves, where a recognized indexer is
``topk_select(index_scores(q, w, index_cache, ...), page_table, req_ids, P, K)``. An index cache is
a graph input read by ``index_scores`` or allocated by ``dsa_dcp.allocate_index_cache``; it is
sharded when it also has a recorded layout (``kv_layout``: this rank's ``ceil(S/N)`` rows).

``check`` refuses a cache that does not match the option, both ways; with
``index_cache="sharded"``, a program with no index cache it can shard (a model whose indexer keeps
its keys per request and position, as transformers' and the plain model's do: the option would
save nothing, so it names the caches kept whole), and any read of a sharded cache but ``index_scores`` (an indexer the
``indexer_kernels`` pass did not recognize: its reason is in the message) and any use of its
scores but ``topk_select`` (they hold this rank's candidates only). Its writes are
``localize_kv_writes``'s, as a KV cache's.
Leaves, with ``index_cache="sharded"``, for each indexer::

    scores_r = index_scores_sharded(q, w, index_cache, ..., N, rank, I)   # owned candidates; -inf elsewhere
    mine     = topk_candidates(scores_r, K)                             # [T, K, 2]: (score bits, position)
    gathered = wait_tensor(all_gather_into_tensor(mine, N, group))      # [N * T, K, 2]
    topk     = topk_agree(gathered, page_table, req_ids, P, K, N)       # the replicated cache's topk_select

one all-gather of ``T * K * 8`` bytes per rank per indexer layer. With ``"replicated"`` it
changes nothing.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx as fx

from dsa_dcp.kv_cache import is_index_cache, kv_layout
from dsa_dcp.ops import C10D, INDEX_SCORES, INDEX_SCORES_SHARDED, TOPK_AGREE, TOPK_CANDIDATES, TOPK_SELECT
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.fx import Emitter, alias_base, placeholder_values, users_in_order
from dsa_dcp.passes.graph import is_replicated
from dsa_dcp.passes.indexer import find_indexers
from dsa_dcp.passes.kv_writes import _is_localizable_write as is_localizable_write
from dsa_dcp.passes.match.position_indexer import POSITION_INDEXER


@dataclasses.dataclass
class IndexCachePlan(Plan):
    caches: list[fx.Node] = dataclasses.field(default_factory=list)
    # (index_scores node, its topk_select users) to shard
    indexers: list[tuple[fx.Node, list[fx.Node]]] = dataclasses.field(default_factory=list)


def index_cache_inputs(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, object]:
    """Index caches: inputs read by ``index_scores`` or allocated by ``allocate_index_cache`` (those of
    replicated modules left out: they stay whole)."""
    values = placeholder_values(gm, example_inputs)
    found = {node: value for node, value in values.items() if is_index_cache(value) and not is_replicated(node)}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is INDEX_SCORES and not node.meta.get(POSITION_INDEXER) \
                and not is_replicated(node):
            base = alias_base(node.args[2])
            if base.op == "placeholder":
                found.setdefault(base, values.get(base))
    return found


class IndexCache(DCPPass):
    name = "index_cache"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> IndexCachePlan:
        plan = IndexCachePlan()
        mode, n, interleave = ctx.options.index_cache, ctx.dcp_size, ctx.options.interleave
        left = None
        for base, cache in index_cache_inputs(gm, ctx.example_inputs).items():
            layout = kv_layout(cache) if cache is not None else None
            rows = list(cache.shape) if cache is not None else "?"
            if mode == "replicated" and layout is not None:
                plan.problems.append(
                    f"index cache {base.name} holds this rank's share of the index keys ({layout.rows} rows for "
                    f"{layout.num_slots} slots: allocated for index_cache='sharded', dcp_size={layout.dcp_size}) but "
                    f"the program is compiled with index_cache='replicated'; pass options={{'index_cache': "
                    f"'sharded', ...}}, or allocate the index caches whole (DSAModel(..., index_cache='replicated'))")
                continue
            if mode == "replicated":
                continue
            if layout is None:
                plan.problems.append(
                    f"index_cache='sharded' keeps only this rank's index keys, but index cache {base.name} {rows} "
                    f"holds every slot's (allocated replicated); allocate it for the group: DSAModel(..., "
                    f"dcp_size={n}, index_cache='sharded') or dsa_dcp.allocate_index_cache(num_slots, dim, "
                    f"dcp_size={n}, interleave={interleave}, sharded=True)")
                continue
            plan.caches.append(base)
            for user in users_in_order(base):
                if user.op == "call_function" and user.target is INDEX_SCORES and user.args[2] is base \
                        and base not in user.args[:2] + user.args[3:]:
                    self._plan_indexer(user, plan)
                elif not is_localizable_write(user, base):
                    if left is None:
                        left = find_indexers(gm)[1]
                    plan.problems.append(
                        f"index cache {base.name} holds this rank's rows only (index_cache='sharded'), but it is "
                        f"read by {user.format_node()}, not by a lightning indexer the indexer_kernels pass "
                        f"recognized{_why(user, left)}; only its index_scores can read a sharded index cache"
                        f"{where(user)}")
        # a replicated module's step (a speculative draft) keeps its index caches whole by request
        if mode == "sharded" and not plan.caches and not plan.problems and not any(map(is_replicated, gm.graph.nodes)):
            plan.problems.append(_nothing_to_shard(gm, ctx))
        plan.all_gathers = [f"{scores.name}'s top-k agreement" for scores, _ in plan.indexers]
        return plan

    @staticmethod
    def _plan_indexer(scores: fx.Node, plan: IndexCachePlan) -> None:
        selects = []
        for user in users_in_order(scores):
            if user.op == "call_function" and user.target is TOPK_SELECT and user.args[0] is scores \
                    and scores not in user.args[1:]:
                selects.append(user)
            else:
                plan.problems.append(
                    f"the indexer scores {scores.name} are used by {user.format_node()}; with index_cache='sharded' "
                    f"each rank has only its own candidates' scores, so only topk_select may read them{where(user)}")
        plan.indexers.append((scores, selects))

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: IndexCachePlan) -> dict:
        if ctx.options.index_cache != "sharded":
            return {"index_cache": ctx.options.index_cache}
        graph, n, rank, interleave = gm.graph, ctx.dcp_size, ctx.rank, ctx.options.interleave
        for scores, selects in plan.indexers:
            emit = Emitter(graph, like=scores)
            with graph.inserting_before(scores):
                mine = emit(INDEX_SCORES_SHARDED, *scores.args, n, rank, interleave)
            for select in selects:
                _, page_table, req_ids, page_size, k = select.args
                emit = Emitter(graph, like=select)
                with graph.inserting_before(select):
                    candidates = emit(TOPK_CANDIDATES, mine, k)
                    gathered = emit(C10D.wait_tensor.default,
                                    emit(C10D.all_gather_into_tensor.default, candidates, n, ctx.group_name))
                    topk = emit(TOPK_AGREE, gathered, page_table, req_ids, page_size, k, n)
                select.replace_all_uses_with(topk)
                graph.erase_node(select)
            graph.erase_node(scores)
        return {"index_cache": "sharded", "index_caches": len(plan.caches), "indexers_sharded": len(plan.indexers),
                "collectives_inserted": sum(len(s) for _, s in plan.indexers)}


def _nothing_to_shard(gm: fx.GraphModule, ctx: CompileContext) -> str:
    """The refusal of ``index_cache="sharded"`` for a program with no index cache the pass can shard
    (a model whose indexer reads a per-request key cache, such as transformers' ``indexer_keys``):
    the option would otherwise do nothing, and every rank would keep every key. Names the caches
    that stay whole on every rank."""
    whole = [node.name for node, value in replicated_caches(gm, ctx.example_inputs).items()]
    held = f"; these caches stay whole on every rank: {whole}" if whole else ""
    return (f"index_cache='sharded' keeps only this rank's index keys, but this program has no index cache the "
            f"index_cache pass can shard (one allocated by dsa_dcp.allocate_index_cache(..., sharded=True) and read "
            f"by a lightning indexer the indexer_kernels pass recognized){held}. Compile with "
            f"index_cache='replicated' (the default), or give the model a slot-indexed index cache (DSAModel(..., "
            f"index_cache='sharded'))")


def replicated_caches(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, object]:
    """Floating-point graph inputs the step writes in place that no DCP pass splits over the group
    (neither a KV cache with a recorded layout nor a position cache): caches every rank holds whole,
    such as an index-key cache indexed by request and position."""
    from dsa_dcp.passes.fx import mutated_args
    from dsa_dcp.position_cache import PositionShardedCache

    values = placeholder_values(gm, example_inputs)
    written = {alias_base(a) for node in gm.graph.nodes for a in mutated_args(node)}
    return {node: value for node, value in values.items()
            if node in written and isinstance(value, torch.Tensor) and value.is_floating_point()
            and not isinstance(value, (torch.nn.Parameter, PositionShardedCache)) and kv_layout(value) is None}


def _why(user: fx.Node, left: list[tuple[fx.Node, str]]) -> str:
    """The reason the indexer pass gave for the ``torch.topk`` that ``user`` feeds, if any."""
    reasons = dict(left)
    seen, frontier = {user}, collections.deque([user])
    while frontier:  # breadth first: the nearest top-k is this indexer's
        node = frontier.popleft()
        if node in reasons:
            return f" ({node.name}: {reasons[node]})"
        for nxt in node.users:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return ""
