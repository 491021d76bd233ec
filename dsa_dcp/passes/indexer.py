"""Indexer kernels: the lightning indexer as a model writes it becomes ``index_scores`` + ``topk_select``.

Expects: dynamo's graph of a step. A lightning indexer is recognized from its ``torch.topk`` node
backwards by ``passes/match/indexer.py`` (the forms are listed there).

Leaves: ``topk = topk_select(index_scores(q, w, index_cache, key_scale, page_table, req, positions, P),
page_table, req, P, K)`` in its place (``key_scale``: ``None``, or FP8 keys' per-token scales; the
index-cache write before it is untouched). The result
differs from the model's only by floating-point reassociation of the scores, by the tie rule (at
the K-th score, the lowest candidate positions win) and by order: ``topk_select`` lists the
selection in ascending candidate position, so the pass rewrites only an indexer whose top-k is read
by sparse attention alone (which needs the set). Anything it cannot prove equivalent — another
mask, scores in another dtype, a top-k read by something else — is left exactly as written, with a
debug line on the ``dsa_dcp.passes`` logger and the reason in the stats (``indexers_left``); never
half-rewritten. A normalize pass: it runs at every ``dcp_size`` (``options.indexer_kernels``)
before validation, so the checks of the DCP passes see the ops.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.ops import INDEX_SCORES, TOPK_SELECT
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan, log
from dsa_dcp.passes.match.indexer import IndexerMatch, find_indexers
from dsa_dcp.passes.match.position_indexer import POSITION_INDEXER, PositionIndexerMatch, find_position_indexers


def replace(match: IndexerMatch, graph: fx.Graph) -> fx.Node:
    """Insert the ops before ``match.result``, rewire its users, erase what only the pattern used."""
    emit = F.Emitter(graph, like=match.topk)
    with graph.inserting_before(match.result):
        scores = emit(INDEX_SCORES, match.q, match.w, match.index_cache, match.key_scale, match.page_table, match.req_ids,
                      match.positions, match.page_size)
        topk = emit(TOPK_SELECT, scores, match.page_table, match.req_ids, match.page_size, match.k)
        if F.dtype(match.result) == torch.int64:
            topk = emit(as_int64, topk)
    match.result.replace_all_uses_with(topk)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(match.nodes), key=position.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return topk


def replace_position(match: PositionIndexerMatch, graph: fx.Graph) -> fx.Node:
    """The indexer over a position cache (``match/position_indexer.py``): request ``b``'s positions
    are one page of ``T`` slots, ``b * T + p`` in the key cache seen as ``[B * T, D]``; every position
    is a candidate (``positions = T - 1``) and the model's own mask is added to the scores as
    before. The top-k is selected over ``[B * S, T]`` with a page table of zeros, so its entries are
    positions ``p`` (``-1`` past the row's count), as ``[B, S, K]`` int64."""
    emit = F.Emitter(graph, like=match.topk)
    b, s, t = F.shape(match.topk.args[0])
    device = F.example(match.scores).device
    with graph.inserting_before(match.scores):
        rows = emit(operator.mul, _size(emit, match.w, 0), _size(emit, match.w, 1))
        q = emit.method("reshape", match.q, rows, *F.shape(match.q)[2:])
        w = emit.method("reshape", emit(operator.mul, match.w, match.scale), rows, F.shape(match.w)[2])
        keys = emit.method("reshape", match.keys, -1, F.shape(match.keys)[2])
        req = emit(operator.floordiv, emit(torch.arange, rows, device=device, dtype=torch.int32),
                   _size(emit, match.w, 1))
        pages = emit.method("view", emit(torch.arange, _size(emit, match.w, 0), device=device, dtype=torch.int32),
                            -1, 1)
        last = emit(torch.full_like, req, t - 1)
        scores = emit(INDEX_SCORES, q, w, keys, None, pages, req, last, t)
        scores.meta[POSITION_INDEXER] = True
        scores = emit.method("view", scores, _size(emit, match.w, 0), _size(emit, match.w, 1), t)
    match.scores.replace_all_uses_with(scores)
    masked = match.topk.args[0]
    with graph.inserting_before(match.topk):
        flat = emit.method("reshape", masked, rows, t)
        zeros = emit(torch.zeros_like, pages)
        picked = emit(TOPK_SELECT, flat, zeros, req, t, match.k)
        picked = emit(as_int64, emit.method("view", picked, _size(emit, match.w, 0), _size(emit, match.w, 1),
                                            match.k))
    match.indices.replace_all_uses_with(picked)
    _erase_unused(graph, [match.scores, *match.topk.users, match.topk])
    return picked


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` and then their inputs while nothing reads them and they write nothing."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if node.graph is not graph or node.users or node.op not in ("call_function", "call_method") \
                or F.mutated_args(node):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        pending += inputs


def _size(emit: F.Emitter, node: fx.Node, dim: int):
    """``node``'s size along ``dim``: an int, or a node computing it (a symbolic size)."""
    size = F.shape(node)[dim]
    return size if isinstance(size, int) else emit(torch.ops.aten.sym_size.int, node, dim)


def as_int64(topk: torch.Tensor) -> torch.Tensor:
    """The selection as int64 slots, for a model whose top-k is int64."""
    return topk.to(torch.int64)


@dataclasses.dataclass
class IndexerPlan(Plan):
    matches: list[IndexerMatch] = dataclasses.field(default_factory=list)
    position_matches: list[PositionIndexerMatch] = dataclasses.field(default_factory=list)
    left: list[tuple[fx.Node, str]] = dataclasses.field(default_factory=list)


class IndexerKernels(DCPPass):
    name = "indexer_kernels"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> IndexerPlan:
        """Finds the indexers (matching only: a graph it cannot rewrite is left as written, never refused)."""
        matches, left = find_indexers(gm)
        position_matches, position_left = find_position_indexers(gm)
        found = {m.topk for m in position_matches}
        position_reasons = dict(position_left)
        left = [(node, position_reasons.get(node, reason)) for node, reason in left if node not in found]
        for node, reason in left:
            log.debug("indexer_kernels: %s left as written: %s", node.name, reason)
        return IndexerPlan(matches=matches, position_matches=position_matches, left=left)

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: IndexerPlan) -> dict:
        replaced = [replace(match, gm.graph) for match in plan.matches]
        replaced += [replace_position(match, gm.graph) for match in plan.position_matches]
        return {
            "indexers_matched": len(replaced),
            "indexers_left": [f"{node.name}: {reason}" for node, reason in plan.left],
            "selections": [n.name for n in replaced],
        }
