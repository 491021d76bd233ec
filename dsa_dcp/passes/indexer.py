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

import torch
import torch.fx as fx

from dsa_dcp.ops import INDEX_SCORES, TOPK_SELECT
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan, log
from dsa_dcp.passes.match.indexer import IndexerMatch, find_indexers


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


def as_int64(topk: torch.Tensor) -> torch.Tensor:
    """The selection as int64 slots, for a model whose top-k is int64."""
    return topk.to(torch.int64)


@dataclasses.dataclass
class IndexerPlan(Plan):
    matches: list[IndexerMatch] = dataclasses.field(default_factory=list)
    left: list[tuple[fx.Node, str]] = dataclasses.field(default_factory=list)


class IndexerKernels(DCPPass):
    name = "indexer_kernels"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> IndexerPlan:
        """Finds the indexers (matching only: a graph it cannot rewrite is left as written, never refused)."""
        matches, left = find_indexers(gm)
        for node, reason in left:
            log.debug("indexer_kernels: %s left as written: %s", node.name, reason)
        return IndexerPlan(matches=matches, left=left)

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: IndexerPlan) -> dict:
        replaced = [replace(match, gm.graph) for match in plan.matches]
        return {
            "indexers_matched": len(replaced),
            "indexers_left": [f"{node.name}: {reason}" for node, reason in plan.left],
            "selections": [n.name for n in replaced],
        }
