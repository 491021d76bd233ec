"""Recognize sparse attention as model authors write it, and rewrite it into the op vocabulary.

Expects: dynamo's graph of a model whose KV caches are position caches (graph inputs whose real
tensors are ``PositionShardedCache``, ``dsa_dcp.position_cache``) and whose attention reads them
densely, with the top-k applied as a mask: the forms ``passes/match/attention.py`` matches
(absorbed MLA, eager MHA, SDPA, latent MLA expanded after the read; ``docs/models.md`` shows each
one's graph).

Leaves, for each: ``out, lse = sparse_{mla,mha}_positions(q_nope, q_pe, [local caches], slots, scale)``
(the latent form: ``sparse_mla_positions`` of the absorbed query, ``W_UK`` folded into it, then
``W_UV`` on its output) over the flat slots ``b * T + topk`` (``-1`` where the model's own mask
excludes the position), ``out`` reshaped back to the layout the model's code continues with; the
dense scores, the ``[B, S, T]`` index mask and the cache reads are gone. The writes into position
caches are checked here (any other use is refused) and left for ``localize_kv_writes``: this pass,
a normalize pass, changes no value and does not depend on the rank. Layers that pass one top-k along (GLM's
shared indexer) get one slots tensor, so ``share_remaps`` later keeps one remap for them. Then the
DCP passes (``dcp_rewrite``, ``share_remaps``, ``fuse_remaps``) treat these ops like ``sparse_mla``.

Refuses (``check``) any other use of a position cache, a cache allocated for other options, and
a model mask that is not ``[B or 1, 1, S, T]``; in a group of one it leaves those as written.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.ops_positions import SPARSE_MHA_POSITIONS, SPARSE_MLA_POSITIONS
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.match.attention import (SDPA, SET_READ, SOFTMAX, AttentionMatch, PositionCaches, integer_base,
                                            match_sdpa, match_softmax_attention)
from dsa_dcp.passes.position_caches import (PositionWrite, insert_local_views, layout_problems, match_write,
                                            position_caches, stray_uses)
from dsa_dcp.position_cache import PositionLayout

def _size(emit: F.Emitter, node: fx.Node, dim: int):
    """``node``'s size along ``dim``: an int, or a node computing it (a symbolic size is never a constant)."""
    size = F.shape(node)[dim]
    return size if isinstance(size, int) else emit(torch.ops.aten.sym_size.int, node, dim)


# --------------------------------------------------------------------------- the pass


@dataclasses.dataclass
class RecognitionPlan(Plan):
    layouts: dict[fx.Node, PositionLayout] = dataclasses.field(default_factory=dict)
    matches: list[AttentionMatch] = dataclasses.field(default_factory=list)
    writes: list[PositionWrite] = dataclasses.field(default_factory=list)
    declined: list[str] = dataclasses.field(default_factory=list)  # dcp_size 1: left as written, and why


class RecognizeSparseAttention(DCPPass):
    """Rewrite attention over position caches into ``sparse_{mla,mha}_positions`` and localize
    position-cache writes (module docstring). A graph without position caches is left as it is."""

    name = "recognize_sparse_attention"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> RecognitionPlan:
        """Under DCP every use of a position cache must be recognized or is refused. In a group of one
        the cache holds every position, so what is not recognized stays as written (the reasons are
        the pass's ``declined`` stat) and only the recognized attention becomes sparse."""
        layouts = position_caches(gm, ctx.example_inputs)
        caches = PositionCaches(layouts)
        problems, declined, matches, writes = [], [], [], []
        if not layouts:
            return RecognitionPlan(problems=problems, layouts=layouts, matches=matches, writes=writes)
        if ctx.dcp_size > 1:  # at 1, a cache allocated for a group is refused by validation (kv_writes)
            values = F.placeholder_values(gm, ctx.example_inputs)
            for cache, layout in layouts.items():
                problems += layout_problems(cache, layout, ctx.dcp_size, ctx.options.interleave)
                if getattr(values.get(cache), "dtype", None) == torch.float8_e4m3fn:
                    problems.append(
                        f"position cache {cache.name} is FP8 E4M3: the position-cache writes and the attention over "
                        f"position caches carry no scale (FP8 KV under DCP is for slot caches written by kv_store "
                        f"with its scale: DSAModel with kv_dtype='fp8', docs/models.md); keep this cache in bf16, "
                        f"fp16 or fp32{where(cache)}")
        for node in gm.graph.nodes:
            if F.calls(node, SOFTMAX, ("softmax",)):
                match, why = match_softmax_attention(node, caches)
            elif F.calls(node, SDPA):
                match, why = match_sdpa(node, caches)
            else:
                continue
            if match is not None and not self._mask_problems(match):
                matches.append(match)
            elif match is not None:
                declined += self._mask_problems(match)
            elif why:
                declined.append(f"{node.name} attends over a position cache in a form the DCP rewrite does not "
                                f"recognize: {why}{where(node)}")
        consumed = self._consumed(gm, matches)
        for cache, layout in layouts.items():
            allowed = set()
            for user in cache.users:
                write, why = match_write(user, cache, layout)
                if write is not None:
                    writes.append(write)
                    allowed.add(user)
                elif why:
                    declined.append(f"position cache {cache.name}: {why}: {user.format_node()}{where(user)}")
                    allowed.add(user)
            declined += stray_uses(cache, allowed | consumed)
        if ctx.dcp_size == 1:  # the whole cache: the model's own writes and reads stay valid
            return RecognitionPlan(problems=problems, layouts=layouts, matches=matches, declined=declined)
        problems += declined
        if ctx.options.debug_checks and matches:
            problems.append("debug_checks are not available yet for attention over position caches")
        return RecognitionPlan(problems=problems, layouts=layouts, matches=matches, writes=writes)

    @staticmethod
    def _mask_problems(match: AttentionMatch) -> list[str]:
        if match.mask is None:
            return []
        shape, s, t = F.shape(match.mask), F.shape(match.topk)[1], match.layout.length
        if len(shape) != 4 or shape[1] != 1 or shape[2] != s or shape[3] != t:
            return [f"the attention mask {match.mask.name} of {match.output.name} is {shape}; the DCP rewrite reads "
                    f"[B or 1, 1, {s}, {t}] masks{where(match.output)}"]
        return []

    @staticmethod
    def _consumed(gm: fx.GraphModule, matches: list[AttentionMatch]) -> set[fx.Node]:
        """The nodes only the dense attention uses (its output, and every node all of whose users
        are such nodes): removed with it. The model's own values (queries, top-k, mask) stay."""
        consumed = {m.output for m in matches} | {n for m in matches if m.latent for n in m.latent.expansion}
        stop = set().union(*(m.inputs() | {integer_base(m.topk)} for m in matches)) if matches else set()
        for node in reversed(list(gm.graph.nodes)):
            if node in consumed or node in stop or node.op in ("placeholder", "output"):
                continue
            if node.users and all(u in consumed for u in node.users):
                consumed.add(node)
        return consumed

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: RecognitionPlan) -> dict:
        if not plan.layouts:
            return {"position_caches": 0, "attention_recognized": 0, "position_writes": 0, "declined": []}
        local = insert_local_views(gm, plan.layouts, ctx.example_inputs)
        slots_cache: dict[tuple, fx.Node] = {}
        for match in plan.matches:
            self._rewrite(gm, match, local, slots_cache)
        self._erase_dead(gm, self._consumed(gm, plan.matches))
        return {"position_caches": len(plan.layouts), "attention_recognized": len(plan.matches),
                "forms": sorted({m.kind for m in plan.matches}), "position_writes": len(plan.writes),
                "slots_tensors": len(slots_cache), "declined": plan.declined}

    @staticmethod
    def _slots(emit: F.Emitter, match: AttentionMatch, slots_cache: dict) -> fx.Node:
        """Flat slots ``[B*S, K]``: ``b * T + topk``, ``-1`` where the model's mask drops the position.
        One per (top-k value, mask): layers that pass one top-k along share it."""
        topk = integer_base(match.topk)
        key = (topk, match.mask, match.mask_kind, match.layout.length)
        if key in slots_cache:
            return slots_cache[key]
        b, s = _size(emit, topk, 0), _size(emit, topk, 1)
        positions = emit.method("long", topk)
        positions.meta[SET_READ] = True  # read as a set, -1 = no position (the valid test below)
        valid = emit(operator.ge, positions, 0)
        if match.mask is not None:
            mask = emit.method("expand", emit(operator.getitem, match.mask, (slice(None), 0)), b, s, match.layout.length)
            picked = emit(torch.gather, mask, -1, emit(torch.clamp, positions, 0))
            if match.mask_kind == "additive":  # transformers' 0 / finfo.min masks (or -inf)
                picked = emit(operator.gt, picked, torch.finfo(F.dtype(picked)).min / 2)
            valid = emit(operator.and_, valid, picked)
        rows = emit.method("view", emit(torch.arange, b, device=F.example(positions).device), b, 1, 1)
        flat = emit(torch.where, valid, emit(operator.add, positions, emit(operator.mul, rows, match.layout.length)), -1)
        slots = emit.method("flatten", flat, 0, 1)
        slots_cache[key] = slots
        return slots

    def _rewrite(self, gm: fx.GraphModule, match: AttentionMatch, local: dict, slots_cache: dict) -> None:
        graph = gm.graph
        anchor = match.output
        emit = F.Emitter(graph, like=anchor)
        with graph.inserting_before(anchor):
            slots = self._slots(emit, match, slots_cache)

            def rows(q: fx.Node) -> fx.Node:  # [B, S, H, D] or [B, H, S, D] -> [B*S, H, D]
                if match.head_axis == 1:
                    q = emit.method("transpose", q, 1, 2)
                return emit.method("flatten", q, 0, 1)

            q_nope = rows(match.q_nope)
            q_pe = rows(match.q_pe) if match.q_pe is not None else emit(operator.getitem, q_nope, (Ellipsis, slice(0, 0)))
            caches = [local[c] for c in match.caches]
            latent = match.latent
            if latent is not None:  # absorbed: q_nope . (W_UK latent) = (q_nope W_UK) . latent
                w = emit.method("view", latent.weight, latent.heads, latent.nope + latent.value, -1)
                w_uk = emit(operator.getitem, w, (slice(None), slice(None, latent.nope)))
                w_uv = emit(operator.getitem, w, (slice(None), slice(latent.nope, None)))
                q_nope = emit(torch.einsum, "rhd,hdc->rhc", q_nope, w_uk)
                caches = [emit.method("select", c, 1, 0) for c in caches]  # [B, 1, T, D] -> [B, T, D]
            op = SPARSE_MLA_POSITIONS if match.kind == "mla" else SPARSE_MHA_POSITIONS
            attn = emit(op, q_nope, q_pe, caches, slots, match.scale)
            out = emit(operator.getitem, attn, 0)
            emit(operator.getitem, attn, 1)  # the LSE, for the merge
            if latent is not None:  # the per-head value up-projection, after the merge
                out = emit(torch.einsum, "rhc,hdc->rhd", out, w_uv)
            out = emit.method("unflatten", out, 0, (_size(emit, match.topk, 0), _size(emit, match.topk, 1)))
            if match.head_axis == 1:
                out = emit.method("transpose", out, 1, 2)
            if F.dtype(out) != F.dtype(anchor):
                out = emit.method("to", out, F.dtype(anchor))
        anchor.replace_all_uses_with(out)

    @staticmethod
    def _erase_dead(gm: fx.GraphModule, candidates: set[fx.Node]) -> None:
        for node in reversed(list(gm.graph.nodes)):
            if node in candidates and not node.users:
                gm.graph.erase_node(node)
