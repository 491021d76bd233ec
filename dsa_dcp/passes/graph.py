"""What the ``dsa_dcp`` ops are in a graph: node kinds (sparse attention, remap, KV write, merge,
collective) and the per-step summary users ask about. FX semantics themselves are ``passes/fx.py``."""

from __future__ import annotations

import torch.fx as fx

from dsa_dcp import merge
from dsa_dcp.passes import fx as F
from dsa_dcp.ops import FUSED_A2A_MERGE, FUSED_REMAPS, KV_STORES, LSE_COMBINE, SPARSE_ATTENTION_OPS, TOPK_REMAP
from dsa_dcp.ops_positions import POSITION_STORE


# Set by the ``replicated_modules`` pass on the nodes and cache inputs of a module the DCP rewrite
# leaves alone (its value: the module's name); every pass skips them.
REPLICATED = "dsa_dcp_replicated"


def is_replicated(node: fx.Node) -> bool:
    """A node or cache input of a module kept out of the DCP rewrite (``options.replicated_modules``)."""
    return REPLICATED in node.meta


def sparse_attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The sparse attention nodes the DCP rewrite splits (those of replicated modules are left out)."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SPARSE_ATTENTION_OPS
            and not is_replicated(n)]


def is_collective(node: fx.Node) -> bool:
    """A functional collective that moves data (its ``wait_tensor`` is not counted)."""
    return F.c10d_name(node) not in (None, "wait_tensor")


# A fused merge (exchange + combine in one op, ``merge="fused_a2a"``) is a merge that is also a
# collective: it moves its packed ``(out, lse)`` as an all-to-all does.
FUSED_MERGE = FUSED_A2A_MERGE
MERGE_TARGETS = (LSE_COMBINE, merge.finish_reduce_scatter, FUSED_MERGE)


def node_kind(node: fx.Node) -> str | None:
    """``sparse_attention``, ``topk_remap``, ``kv_write``, ``merge`` or ``collective`` (else ``None``)."""
    if node.op != "call_function":
        return None
    if node.target in SPARSE_ATTENTION_OPS:
        return "sparse_attention"
    if node.target is TOPK_REMAP or node.target in FUSED_REMAPS:  # a remap fused with its selection counts
        return "topk_remap"
    if node.target in KV_STORES or node.target is POSITION_STORE:
        return "kv_write"
    if node.target in MERGE_TARGETS:
        return "merge"
    return "collective" if is_collective(node) else None


_SUMMARY_KEYS = {"sparse_attention": "sparse_attention_nodes", "topk_remap": "remaps", "merge": "merges",
                 "collective": "collectives", "kv_write": "kv_writes"}


def graph_summary(graph: fx.Graph) -> dict[str, int]:
    """What one run of the graph does, in the units users ask about."""
    counts = dict.fromkeys(("sparse_attention_nodes", "remaps", "merges", "collectives", "kv_writes"), 0)
    for node in graph.nodes:
        kind = node_kind(node)
        if kind is not None:
            counts[_SUMMARY_KEYS[kind]] += 1
        if node.target is FUSED_MERGE:
            counts["collectives"] += 1
    return counts
