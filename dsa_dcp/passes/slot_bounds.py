"""Check the step's global slot ids against the pool on every rank, where they enter the program.

Under DCP a rank holds ``local_cache_rows(S, N, I)`` rows, so a slot id past the pool (``>= S``,
a page past the pool in the page table) is not out of range everywhere as it is on one device:
its owner may write it into a spare row (when ``N * I`` does not divide ``S``) and attend over it,
or fail alone while its peers wait in the next collective. This pass makes the program raise the
single-rank model's ``IndexError`` on every rank instead, at the same point of the step.

Expects: the graph the rewrite leaves (a finishing pass: it plans on that graph, after the rewrite).
Leaves, before the first use of each global slot tensor that enters the step:

- the slots of the KV writes: ``localize_slots(check_slots(slots, S, ...), N, r, I)``;
- each page table the indexer ops read (``index_scores``, ``topk_select``, their sharded and fused
  forms): ``check_pages(page_table, req_ids, P, S)``, read by all of them in its place;
- each top-k given as a graph input: ``topk_remap(check_slots(topk, S, ...), N, r, I)``.

A tensor the step writes in place (a top-k edited between layers) is checked before each reader
instead, so that no reader sees a copy taken before the edit. ``S`` is the smallest pool of the caches involved (their recorded layout, or a replicated index
cache's rows). Every rank checks the same global ids (the group feeds the same step inputs), so all
raise or none does. The checks are ``dsa_dcp.ops.CHECK_SLOTS`` / ``CHECK_PAGES``: a host-side check of
CPU tensors, a device-side assertion on CUDA (no host sync); each costs one
elementwise pass over ``T`` slots or ``T x max_pages`` pages per step. A top-k computed inside the
step comes from the page table (checked) or from the model's own gather of a replicated cache
(which raises on every rank alike).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from dsa_dcp.kv_cache import is_index_cache, kv_layout
from dsa_dcp.ops import CHECK_PAGES, CHECK_SLOTS, INDEX_SCORES, INDEX_SCORES_SHARDED, KV_STORES, TOPK_AGREE, \
    TOPK_AGREE_REMAP, TOPK_REMAP, TOPK_SELECT, TOPK_SELECT_REMAP
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.fx import Emitter, alias_base, mutated_args, placeholder_values
from dsa_dcp.slots import localize_slots

# op -> argument positions of (page_table, req_ids, page_size)
PAGE_TABLE_ARGS = {
    INDEX_SCORES: (4, 5, 7), INDEX_SCORES_SHARDED: (4, 5, 7),
    TOPK_SELECT: (1, 2, 3), TOPK_SELECT_REMAP: (1, 2, 3), TOPK_AGREE: (1, 2, 3), TOPK_AGREE_REMAP: (1, 2, 3),
}


def pool_size(value: object) -> int | None:
    """The global slots of a slot cache: its recorded layout's, a replicated index cache's rows."""
    if not isinstance(value, torch.Tensor):
        return None
    layout = kv_layout(value)
    if layout is not None:
        return layout.num_slots
    return value.shape[0] if is_index_cache(value) else None


@dataclasses.dataclass
class Guard:
    """One check to insert: ``target(tensor, *extra)`` before the first of ``readers``, which then
    read its result at argument ``position`` (an int, or a function of the reader)."""

    tensor: fx.Node
    readers: list[fx.Node]
    position: int | Callable[[fx.Node], int]
    target: Any
    extra: tuple


@dataclasses.dataclass
class SlotPlan(Plan):
    slot_checks: list[Guard] = dataclasses.field(default_factory=list)
    page_checks: list[Guard] = dataclasses.field(default_factory=list)


class SlotBounds(DCPPass):
    name = "slot_bounds"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> SlotPlan:
        """The checks to insert (nothing to refuse: the checks happen when the step runs)."""
        graph = gm.graph
        plan = SlotPlan()
        values = placeholder_values(gm, ctx.example_inputs)
        pools = [s for s in (pool_size(v) for v in values.values()) if s is not None]
        if not pools:
            return plan
        smallest = min(pools)
        # a tensor the step writes in place (a top-k edited between layers) is checked before each
        # reader, so no reader sees a copy taken before the edit; any other is checked once
        written = {alias_base(a) for node in graph.nodes for a in mutated_args(node)}

        def pool_of(cache: fx.Node) -> int:
            size = pool_size(values.get(alias_base(cache)))
            return size if size is not None else smallest

        def guards(readers: dict[tuple, list[fx.Node]], position: int | Callable[[fx.Node], int], target: Any,
                   extra: Callable[[tuple, list[fx.Node]], tuple]) -> list[Guard]:
            """A check of each tensor before its first reader (each reader when the tensor is written
            in place), which the readers then read instead."""
            return [Guard(key[0], batch, position, target, extra(key, batch)) for key, users in readers.items()
                    for batch in ([[u] for u in users] if alias_base(key[0]) in written else [users])]

        def readers_of(select: Callable[[fx.Node], tuple | None]) -> dict[tuple, list[fx.Node]]:
            found: dict[tuple, list[fx.Node]] = {}
            for node in graph.nodes:
                key = select(node) if node.op == "call_function" else None
                if key is not None:
                    found.setdefault(key, []).append(node)
            return found

        # the KV writes' slots (one localization per slots tensor, shared by the layers' writes)
        plan.slot_checks = guards(
            readers_of(lambda n: (n.args[0],) if n.target is localize_slots and any(
                u.target in KV_STORES for u in n.users) else None), 0, CHECK_SLOTS,  # not a position cache's
            lambda key, batch: (min((pool_of(u.args[0]) for loc in batch for u in loc.users if u.target in KV_STORES),
                                    default=smallest), "the step's write slots"))
        # the page tables the indexer ops read, with the request ids and page size they read them by
        plan.page_checks = guards(
            readers_of(lambda n: tuple(n.args[i] for i in PAGE_TABLE_ARGS[n.target]) if n.target in PAGE_TABLE_ARGS
                       else None),
            lambda user: PAGE_TABLE_ARGS[user.target][0], CHECK_PAGES, lambda key, batch: (key[1], key[2], smallest))
        # a top-k the step is given (one computed inside it comes from the checked page table)
        plan.slot_checks += guards(
            readers_of(lambda n: (n.args[0],) if n.target is TOPK_REMAP and alias_base(n.args[0]).op == "placeholder"
                       else None), 0, CHECK_SLOTS,
            lambda key, batch: (_attended_pool(batch, pool_of, smallest), "the step's top-k input"))
        return plan

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: SlotPlan) -> dict:
        graph = gm.graph
        for guard in plan.slot_checks + plan.page_checks:
            emit = Emitter(graph, like=guard.readers[0])
            with graph.inserting_before(guard.readers[0]):
                checked = emit(guard.target, guard.tensor, *guard.extra)
            for user in guard.readers:
                pos = guard.position if isinstance(guard.position, int) else guard.position(user)
                user.args = (*user.args[:pos], checked, *user.args[pos + 1:])
        return {"slot_checks": len(plan.slot_checks), "page_checks": len(plan.page_checks)}


def _attended_pool(remaps: list[fx.Node], pool_of: Callable[[fx.Node], int], smallest: int) -> int:
    """The pool of the caches the attention after these remaps reads (``smallest`` if none is found)."""
    from dsa_dcp.ops import SPARSE_ATTENTION_OPS

    sizes = []
    for remap in remaps:
        for item in remap.users:
            for attn in item.users:
                if attn.op == "call_function" and attn.target in SPARSE_ATTENTION_OPS and \
                        SPARSE_ATTENTION_OPS[attn.target].cache_layout == "slots":
                    sizes.append(pool_of(attn.args[2]))
    return min(sizes, default=smallest)
