"""Localize KV writes: each rank stores only the tokens it owns, at their local rows.

Expects: dynamo's graph of a model whose sparse attention nodes read KV caches that are graph
inputs allocated by ``dsa_dcp.allocate_kv_cache`` for this DCP size.
Leaves: every write into those caches is ``kv_store(cache, localize_slots(slots), rows)``, with
one ``localize_slots`` node per slots tensor shared by all the layers that write through it —
``kv_store`` nodes get localized slots, and plain ``index_put_`` / ``index_copy_`` / ``cache[s] = x``
writes become ``kv_store`` (negative slots then mean "no slot"). Index-key caches, which no
attention node reads, stay replicated and untouched. Refuses (``DCPRewriteError``) a cache of the
wrong size or unknown layout, and any other write or read of a KV cache it cannot localize.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsa_dcp.kv_cache import kv_layout
from dsa_dcp.ops import SPARSE_ATTENTION_OPS
from dsa_dcp.passes.base import CompileContext, DCPPass
from dsa_dcp.passes.errors import DCPRewriteError, where
from dsa_dcp.passes.graph import alias_base, placeholder_values, sparse_attention_nodes
from dsa_dcp.slots import localize_slots

KV_STORE = torch.ops.dsa_dcp.kv_store.default


def _write_slots_and_rows(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(slots, rows)`` of a write this pass can localize, else ``None``."""
    if node.op == "call_function" and node.target is KV_STORE:
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


# KV dtypes the contract accepts: bf16/fp16 for serving, fp32 as the exact reference dtype.
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


class LocalizeKVWrites(DCPPass):
    name = "localize_kv_writes"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> list[str]:
        """Every reason this graph's KV caches cannot be localized (empty when it can)."""
        caches, problems = kv_caches_read_by_attention(gm)
        inputs = placeholder_values(gm, ctx.example_inputs)
        for base in caches:
            problems += _layout_problems(base, inputs.get(base), ctx.dcp_size, ctx.options.interleave)
            for user in base.users:
                if not _is_attention_read(user, base) and not _is_localizable_write(user, base):
                    problems.append(
                        f"KV cache {base.name} is used by {user.format_node()}, which the DCP rewrite cannot localize "
                        f"(a KV cache may only be read by sparse attention and written by kv_store, index_put_, "
                        f"index_copy_ or cache[slots] = rows, on the cache itself, not a view){where(user)}"
                    )
        return problems

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> dict:
        problems = self.check(gm, ctx)
        if problems:
            raise DCPRewriteError("\n".join(problems))
        n, rank, interleave = ctx.dcp_size, ctx.rank, ctx.options.interleave
        caches, _ = kv_caches_read_by_attention(gm)
        graph = gm.graph
        position = {node: i for i, node in enumerate(graph.nodes)}
        writes = sorted(((user, base) for base in caches for user in base.users
                         if not _is_attention_read(user, base)), key=lambda w: position[w[0]])
        # Every layer writes the step's tokens to the same slots: one localization per slots
        # tensor, placed before its first write (graph order), serves all of them.
        localized: dict[fx.Node, fx.Node] = {}
        for user, base in writes:
            slots, rows = _write_slots_and_rows(user)
            with graph.inserting_before(user):
                if slots not in localized:
                    localized[slots] = graph.call_function(localize_slots, (slots, n, rank, interleave))
                graph.call_function(KV_STORE, (base, localized[slots], rows))
            user.replace_all_uses_with(base)  # in-place writes return their target
            graph.erase_node(user)
        return {"kv_caches": len(caches), "kv_writes_localized": len(writes), "slot_localizations": len(localized)}


def _is_attention_read(user: fx.Node, base: fx.Node) -> bool:
    return user.op == "call_function" and user.target in SPARSE_ATTENTION_OPS and user.args[2] is base \
        and base not in user.args[:2] + user.args[3:]


def _is_localizable_write(user: fx.Node, base: fx.Node) -> bool:
    write = _write_slots_and_rows(user)
    return write is not None and user.args[0] is base and base not in write


def _layout_problems(base: fx.Node, cache: object, n: int, interleave: int) -> list[str]:
    if not isinstance(cache, torch.Tensor):
        return [f"cannot find the tensor behind KV cache input {base.name}"]
    problems = []
    if cache.dtype not in KV_DTYPES:
        extra = (" (the sparse_mla kernels read FP8 E4M3 KV with a per-tensor kv_scale, but the model path "
                 "does not quantize KV writes or carry the scale yet)") \
            if cache.dtype == torch.float8_e4m3fn else ""
        problems.append(f"KV cache {base.name} has dtype {cache.dtype}; supported: "
                        f"{[str(d).replace('torch.', '') for d in KV_DTYPES]}{extra}")
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
