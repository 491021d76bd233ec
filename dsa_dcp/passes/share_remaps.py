"""Share one top-k remap among the attention layers that read the same top-k.

Expects: the graph ``DCPRewrite`` leaves, where every sparse attention node reads
``getitem(topk_remap(topk, N, rank, I), 0)``. With IndexShare (GLM-5.2: 78 layers, 21 indexers)
several layers pass one top-k to their attention, so several remaps compute the same thing.
Leaves: one remap per distinct (top-k value, N, rank, I) — the group's first in program order,
which precedes (dominates, in straight-line FX code) every user of the others — with the others'
users rewired to it and the others, and the copies/views only they read, erased.

Two remaps are the same when their top-k inputs have one value number and the same versions
(``values.ValueNumbering``: the same node through views, copies and same-dtype conversions, or
inputs that are the same real tensor, with no in-place write to any storage on the way between
the reads) and their N, rank and interleave are equal. Every remap that shares with no earlier one
is logged (debug, ``dsa_dcp.passes``) with the reason and listed in the stats' ``refusals``.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import torch.fx as fx

from dsa_dcp.ops import SPARSE_ATTENTION_OPS, TOPK_REMAP
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan, log
from dsa_dcp.passes.dataflow import alias_classes, to_networkx
from dsa_dcp.passes.fx import getitem_users
from dsa_dcp.passes.values import ValueNumbering


@dataclasses.dataclass
class _Remap:
    node: fx.Node
    key: tuple  # (value number, versions, (N, rank, I)): equal keys compute the same remap
    who: str
    attention: list[str]
    layers: list[int | None]


@dataclasses.dataclass
class SharePlan(Plan):
    groups: list[list[_Remap]] = dataclasses.field(default_factory=list)  # the first of each is kept
    refusals: list[str] = dataclasses.field(default_factory=list)
    numbering: ValueNumbering | None = None  # what the copies erased with a dropped remap are


class ShareRemaps(DCPPass):
    name = "share_remaps"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> SharePlan:
        """Which remaps compute the same thing (module docstring), decided before anything is rewritten."""
        g = to_networkx(gm.graph)
        classes = alias_classes(gm, ctx.example_inputs)
        numbering = ValueNumbering(gm, g, classes, ctx.example_inputs)
        remaps = [self._describe(n, g, numbering) for n in gm.graph.nodes
                  if n.op == "call_function" and n.target is TOPK_REMAP]
        groups: dict[tuple, list[_Remap]] = {}
        refusals = []
        for i, remap in enumerate(remaps):
            first = groups.get(remap.key, [None])[0]
            if first is not None and self._dominates(g, first.node, remap.node):
                groups[remap.key].append(remap)
                continue
            if i:
                reason = self._refusal(remap, remaps[:i], g, numbering)
                log.debug("share_remaps: %s", reason)
                refusals.append(reason)
            groups.setdefault(remap.key, [remap])
        return SharePlan(groups=list(groups.values()), refusals=refusals, numbering=numbering)

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: SharePlan) -> dict:
        for members in plan.groups:
            for dropped in members[1:]:
                self._share(gm, plan.numbering, members[0].node, dropped.node)
        return {
            "remaps_before": sum(len(members) for members in plan.groups),
            "remaps_after": len(plan.groups),
            "groups": [[a for m in members for a in m.attention] for members in plan.groups],
            "layer_groups": [[l for m in members for l in m.layers] for members in plan.groups],
            "sources": [members[0].node.args[0].name for members in plan.groups],
            "refusals": plan.refusals,
        }

    @staticmethod
    def _describe(node: fx.Node, g: nx.DiGraph, numbering: ValueNumbering) -> _Remap:
        topk, order = node.args[0], g.nodes[node.name]["order"]
        params = tuple(node.args[1:]) + tuple(sorted(node.kwargs.items()))
        key = (numbering.values[topk.name].number, numbering.versions(topk.name, order), params)
        outputs = [node.name] + [item.name for _, item in getitem_users(node)]
        written = [w for cls in {numbering.classes[o] for o in outputs}
                   for w in numbering.writes.between(cls, order, 1 << 62)]
        if written:  # a user edits the remapped rows: that remap serves its own layer only
            key += (("result written", node.name, tuple(written)),)
        attention = [u.name for _, item in getitem_users(node) for u in item.users
                     if u.op == "call_function" and u.target in SPARSE_ATTENTION_OPS]
        layers = [g.nodes[a]["layer"] for a in attention]
        who = " & ".join(f"layer {l} ({a})" if l is not None else a for a, l in zip(attention, layers)) or node.name
        return _Remap(node, key, who, attention, layers)

    @staticmethod
    def _refusal(remap: _Remap, earlier: list[_Remap], g: nx.DiGraph, numbering: ValueNumbering) -> str:
        """Why ``remap`` shares with none of the ``earlier`` remaps (against the closest candidate)."""
        number, versions, params = remap.key[:3]
        topk = remap.node.args[0].name
        if len(remap.key) > 3:
            return f"{remap.who}: its remap result is modified in place by {list(remap.key[3][2])}: not shared"
        same = [r for r in earlier if r.key[0] == number]
        if same:
            other = next((r for r in reversed(same) if r.key[1] == versions), same[-1])
            if other.key[1] == versions:
                return (f"{remap.who} and {other.who} read the same top-k ({topk}) with different "
                        f"(N, rank, interleave) {params} and {other.key[2]}: not shared")
            start, end = g.nodes[other.node.name]["order"], g.nodes[remap.node.name]["order"]
            classes = {v[1] for v in versions + other.key[1] if v[0] == "writes"}
            writes = sorted({w for c in classes for w in numbering.writes.between(c, -1, end)
                             if g.nodes[w]["order"] > start} | {w for v in versions if v[0] == "written" for w in v[2]})
            return (f"{remap.who} reads top-k {topk} after it was modified in place by {writes or 'a write'} "
                    f"(since {other.who} read it): not shared")
        other = earlier[-1]
        root, other_root = numbering.values[topk].root, numbering.values[other.node.args[0].name].root
        # Not through the remaps: every later top-k depends on earlier layers' attention outputs.
        direct = nx.restricted_view(g, [r.node.name for r in earlier] + [remap.node.name], [])
        if nx.has_path(direct, other_root, root):
            return (f"{remap.who} reads top-k {topk}, computed from {other.who}'s top-k {other_root} by "
                    f"{g.nodes[root]['target']} ({root}): a new value, not a view or copy: not shared")
        return (f"{remap.who} reads top-k {topk}, a different tensor from {other.who}'s "
                f"({other.node.args[0].name}): not shared")

    @staticmethod
    def _dominates(g: nx.DiGraph, kept: fx.Node, dropped: fx.Node) -> bool:
        """``kept`` runs before ``dropped`` (so before all its users) and does not depend on it."""
        return g.nodes[kept.name]["order"] < g.nodes[dropped.name]["order"] and \
            not nx.has_path(g, dropped.name, kept.name)

    @staticmethod
    def _share(gm: fx.GraphModule, numbering: ValueNumbering, kept: fx.Node, dropped: fx.Node) -> None:
        """Rewire ``dropped``'s users to ``kept``; erase ``dropped`` and the copies only it read."""
        kept_items = dict(getitem_users(kept))
        for index, item in list(getitem_users(dropped)):
            if index in kept_items:
                item.replace_all_uses_with(kept_items[index])
                gm.graph.erase_node(item)
            else:
                item.update_arg(0, kept)
        dropped.replace_all_uses_with(kept)
        source = dropped.args[0]
        gm.graph.erase_node(dropped)
        while not source.users and numbering.is_copy_or_view(source.name):
            # a clone/view made for this remap only; it writes nothing, so nothing else needs it
            nxt = numbering.source(source.name)
            gm.graph.erase_node(source)
            source = nxt
