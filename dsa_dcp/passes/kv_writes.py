"""Localize KV writes: each rank stores only the tokens it owns, at their local rows — in slot
caches and in position caches alike (the one pass that makes writes rank-dependent).

Expects: dynamo's graph whose KV caches are graph inputs allocated by
``dsa_dcp.allocate_kv_cache`` for this DCP size. A KV cache is every input with a recorded KV layout
and every cache a sparse attention node reads — also in a graph that only writes it (a prefill step
that attends over the prompt in hand).
Leaves: every write into those caches is ``kv_store(cache, localize_slots(slots), rows)``, with
one ``localize_slots`` node per slots tensor shared by all the layers that write through it —
``kv_store`` nodes get localized slots, and plain ``index_put_`` / ``index_copy_`` / ``cache[s] = x``
writes become ``kv_store`` (negative slots then mean "no slot"). Index-key caches (no recorded
layout, read by no attention node) stay replicated and untouched; a sharded one
(``index_cache="sharded"``) has a layout, is read by ``index_scores`` (``passes/index_cache.py``
shards those reads) and has its writes localized here. ``check`` refuses a cache of the
wrong size or unknown layout, and any other write or read of a KV cache it cannot localize;
``cache_layout_problems`` is the part of it that holds at every ``dcp_size`` (a cache allocated for
a DCP group and compiled without its options is refused too).

Position caches (``PositionShardedCache`` inputs: models that keep KV per request) are written with
global positions, ``cache[:b, start:end] = rows`` or ``cache.index_copy_(dim, positions, rows)``
(``position_caches.match_write``; ``recognize_sparse_attention`` refused any other use). Each
becomes ``position_store(local_positions(cache), localize_slots(positions, N, r, I), rows, dim)``,
one ``localize_slots`` per positions tensor (or ``start:end`` range).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.kv_cache import kv_layout
from dsa_dcp.ops import INDEX_SCORES, KV_STORES, SPARSE_ATTENTION_OPS
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.fx import Emitter, alias_base, placeholder_values
from dsa_dcp.passes.graph import is_replicated, sparse_attention_nodes
from dsa_dcp.passes.position_caches import PositionWrite, local_views, localize_writes, match_write, position_caches
from dsa_dcp.position_cache import position_layout
from dsa_dcp.slots import localize_slots


def _write_slots_and_rows(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(slots, rows)`` of a write this pass can localize, else ``None``."""
    if node.op == "call_function" and node.target in KV_STORES:
        return node.args[1], node.args[2]
    if node.op == "call_method" and node.target == "index_put_":
        indices, values = node.args[1], node.args[2]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if isinstance(indices, (tuple, list)) and len(indices) == 1 and not accumulate:
            return indices[0], values
    if node.op == "call_method" and node.target == "index_copy_" and node.args[1] == 0:
        return node.args[2], node.args[3]
    if node.op == "call_function" and node.target is operator.setitem and isinstance(node.args[1], fx.Node):
        return node.args[1], node.args[2]
    return None


# KV dtypes the contract accepts: bf16/fp16 for serving, fp32 as the exact reference dtype, and FP8
# E4M3 written by kv_store with its scale (kv_store quantizes; the attention reads the scale).
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def kv_caches_read_by_attention(gm: fx.GraphModule) -> tuple[dict[fx.Node, fx.Node], list[str]]:
    """Each KV cache (placeholder) a sparse attention node reads -> that node; problems found."""
    caches, problems = {}, []
    for attn in sparse_attention_nodes(gm.graph):
        if SPARSE_ATTENTION_OPS[attn.target].cache_layout != "slots":
            continue  # position caches: localized by recognize_sparse_attention
        base = alias_base(attn.args[2])
        if base.op != "placeholder":
            problems.append(f"the KV cache of {attn.name} is computed in the graph ({base.name}); it must be a "
                            f"model buffer or input{where(attn)}")
            continue
        caches[base] = attn
    return caches, problems


def kv_cache_inputs(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, torch.Tensor]:
    """Every graph input that is a KV cache by its recorded layout (``allocate_kv_cache``), but the
    caches of replicated modules (``passes/replicated.py``), which stay whole."""
    return {node: value for node, value in placeholder_values(gm, example_inputs).items()
            if isinstance(value, torch.Tensor) and kv_layout(value) is not None and not is_replicated(node)}


def cache_layout_problems(gm: fx.GraphModule, ctx: CompileContext) -> list[str]:
    """Caches allocated for another ``dcp_size`` than the options', at any ``dcp_size`` (1 included):
    slot caches (``allocate_kv_cache``) and position caches (``PositionShardedCache``: a
    ``DCPStaticCache`` or ``shard_position_caches`` for a group), each naming the option to pass."""
    if ctx.dcp_size > 1:
        return []  # LocalizeKVWrites.check and the position-cache pass cover every cache, with the interleave
    problems = []
    for base, cache in placeholder_values(gm, ctx.example_inputs).items():
        layout = position_layout(cache)
        if layout is not None and layout.dcp_size != 1:
            problems.append(
                f"position cache {base.name} {list(cache.shape)} was allocated for dcp_size={layout.dcp_size}, "
                f"interleave={layout.interleave} (this rank holds {layout.local_length} of its {layout.length} "
                f"positions) but compiled for dcp_size=1; pass options={{'dcp_size': {layout.dcp_size}, "
                f"'interleave': {layout.interleave}, ...}} to torch.compile (a DCP rank's cache cannot serve a "
                f"single-rank program), or allocate the cache with dcp_size=1")
    for base, cache in kv_cache_inputs(gm, ctx.example_inputs).items():
        layout = kv_layout(cache)
        if layout.dcp_size != 1:
            problems.append(
                f"KV cache {base.name} was allocated for dcp_size={layout.dcp_size} ({layout.rows} rows for "
                f"{layout.num_slots} slots: this rank's share) but compiled for dcp_size=1; pass "
                f"options={{'dcp_size': {layout.dcp_size}, ...}} to torch.compile (a DCP rank's cache cannot "
                f"serve a single-rank program)")
    return problems


@dataclasses.dataclass
class WritePlan(Plan):
    caches: list[fx.Node] = dataclasses.field(default_factory=list)
    # (write node, cache, slots, rows) in program order
    writes: list[tuple[fx.Node, fx.Node, fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    position_writes: list[PositionWrite] = dataclasses.field(default_factory=list)


class LocalizeKVWrites(DCPPass):
    name = "localize_kv_writes"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> WritePlan:
        """The caches and the writes to localize, and every reason they cannot be."""
        read, problems = kv_caches_read_by_attention(gm)
        plan = WritePlan(problems=problems)
        inputs = placeholder_values(gm, ctx.example_inputs)
        caches = list(read) + [c for c in kv_cache_inputs(gm, ctx.example_inputs) if c not in read]
        position = {node: i for i, node in enumerate(gm.graph.nodes)}
        for base in caches:
            plan.problems += _layout_problems(base, inputs.get(base), ctx.dcp_size, ctx.options.interleave)
            for user in base.users:
                if _is_attention_read(user, base) or _is_index_read(user, base):
                    continue
                if _is_localizable_write(user, base):
                    cache = inputs.get(base)
                    if isinstance(cache, torch.Tensor) and cache.dtype in FP8_KV_DTYPES and user.target not in KV_STORES:
                        plan.problems.append(
                            f"FP8 KV cache {base.name} is written by {user.format_node()}: an FP8 cache must be written "
                            f"by kv_store with its scale (kv_store(cache, slots, rows, kv_scale) or kv_store_block_scaled(cache, slots, rows, block_scales)), "
                            f"which quantizes and saturates the rows; a plain write would cast them without a "
                            f"scale{where(user)}")
                        continue
                    plan.writes.append((user, base, *_write_slots_and_rows(user)))
                    continue
                plan.problems.append(
                    f"KV cache {base.name} is used by {user.format_node()}, which the DCP rewrite cannot localize "
                    f"(a KV cache may only be read by sparse attention and written by kv_store, index_put_, "
                    f"index_copy_ or cache[slots] = rows, on the cache itself, not a view){where(user)}"
                )
        plan.caches = caches
        plan.writes.sort(key=lambda w: position[w[0]])
        for cache, layout in position_caches(gm, ctx.example_inputs).items():
            plan.position_writes += [w for w in (match_write(u, cache, layout)[0] for u in cache.users) if w]
        plan.position_writes.sort(key=lambda w: position[w.node])
        return plan

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: WritePlan) -> dict:
        n, rank, interleave = ctx.dcp_size, ctx.rank, ctx.options.interleave
        graph = gm.graph
        # Every layer writes the step's tokens to the same slots: one localization per slots
        # tensor, placed before its first write (graph order), serves all of them.
        localized: dict[fx.Node, fx.Node] = {}
        for user, base, slots, rows in plan.writes:
            emit = Emitter(graph, like=user)
            with graph.inserting_before(user):
                if slots not in localized:
                    localized[slots] = emit(localize_slots, slots, n, rank, interleave)
                # an FP8 store's scale arguments (kv_scale, block_scales) go along: the block scales
                # have the cache's rows, so the localized slots index them too
                store, scales = (user.target, tuple(user.args[3:])) if user.target in KV_STORES else (KV_STORES[0], ())
                emit(store, base, localized[slots], rows, *scales)
            user.replace_all_uses_with(base)  # in-place writes return their target
            graph.erase_node(user)
        positions = localize_writes(gm, plan.position_writes, local_views(gm, ctx.example_inputs), n, rank,
                                    interleave) if plan.position_writes else 0
        return {"kv_caches": len(plan.caches), "kv_writes_localized": len(plan.writes),
                "slot_localizations": len(localized), "position_writes_localized": len(plan.position_writes),
                "position_localizations": positions}


def _is_attention_read(user: fx.Node, base: fx.Node) -> bool:
    return user.op == "call_function" and user.target in SPARSE_ATTENTION_OPS and user.args[2] is base \
        and base not in user.args[:2] + user.args[3:]


def _is_index_read(user: fx.Node, base: fx.Node) -> bool:
    """The indexer's scores reading a sharded index cache (the index_cache pass shards the read)."""
    return user.op == "call_function" and user.target is INDEX_SCORES and user.args[2] is base \
        and base not in user.args[:2] + user.args[3:]


def _is_localizable_write(user: fx.Node, base: fx.Node) -> bool:
    write = _write_slots_and_rows(user)
    return write is not None and user.args[0] is base and base not in write


def _layout_problems(base: fx.Node, cache: object, n: int, interleave: int) -> list[str]:
    if not isinstance(cache, torch.Tensor):
        return [f"cannot find the tensor behind KV cache input {base.name}"]
    problems = []
    if cache.dtype not in KV_DTYPES:
        problems.append(f"KV cache {base.name} has dtype {cache.dtype}; supported: "
                        f"{[str(d).replace('torch.', '') for d in KV_DTYPES]}")
    layout = kv_layout(cache)
    if layout is None:
        problems.append(
            f"KV cache {base.name} ({list(cache.shape)}) was not allocated by dsa_dcp.allocate_kv_cache, so its "
            f"slot layout is unknown; allocate it with allocate_kv_cache(num_slots, dim, dcp_size={n}, "
            f"interleave={interleave}) so each rank holds only its rows"
        )
    elif (layout.dcp_size, layout.interleave) != (n, interleave):
        problems.append(
            f"KV cache {base.name} was allocated for dcp_size={layout.dcp_size}, interleave={layout.interleave} "
            f"({layout.rows} rows for {layout.num_slots} slots) but compiled for dcp_size={n}, "
            f"interleave={interleave}; allocate it with those options (a DCP rank never holds the global cache)"
        )
    elif cache.shape[0] != layout.rows:
        problems.append(f"KV cache {base.name} has {cache.shape[0]} rows, its layout needs {layout.rows}")
    return problems
