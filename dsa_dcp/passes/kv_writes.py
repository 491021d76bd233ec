"""Localize KV writes: each rank stores only the tokens it owns, at their local rows.

Expects: dynamo's graph of a model whose sparse attention nodes read KV caches that are graph
inputs allocated by ``dsa_dcp.allocate_kv_cache`` for this DCP size.
Leaves: every write into those caches is ``kv_store(cache, localize_slots(slots), rows)`` —
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


class LocalizeKVWrites(DCPPass):
    name = "localize_kv_writes"

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> dict:
        n, rank, interleave = ctx.dcp_size, ctx.rank, ctx.options.interleave
        inputs = placeholder_values(gm, ctx.example_inputs)
        caches = {}
        for attn in sparse_attention_nodes(gm.graph):
            base = alias_base(attn.args[2])
            if base.op != "placeholder":
                raise DCPRewriteError(f"the KV cache of {attn.name} is computed in the graph ({base.name}); "
                                      f"it must be a model buffer or input{where(attn)}")
            caches[base] = attn
        for base in caches:
            self._check_layout(base, inputs.get(base), n, interleave)

        localized = 0
        graph = gm.graph
        for base in caches:
            for user in list(base.users):
                if user.op == "call_function" and user.target in SPARSE_ATTENTION_OPS and user.args[2] is base:
                    continue
                write = _write_slots_and_rows(user)
                if write is None or user.args[0] is not base or base in write:
                    self._refuse(user, base)
                slots, rows = write
                with graph.inserting_before(user):
                    local = graph.call_function(localize_slots, (slots, n, rank, interleave))
                    graph.call_function(KV_STORE, (base, local, rows))
                user.replace_all_uses_with(base)  # in-place writes return their target
                graph.erase_node(user)
                localized += 1
        return {"kv_caches": len(caches), "kv_writes_localized": localized}

    @staticmethod
    def _check_layout(base: fx.Node, cache: object, n: int, interleave: int) -> None:
        if not isinstance(cache, torch.Tensor):
            raise DCPRewriteError(f"cannot find the tensor behind KV cache input {base.name}")
        layout = kv_layout(cache)
        if layout is None:
            raise DCPRewriteError(
                f"KV cache {base.name} ({list(cache.shape)}) was not allocated by dsa_dcp.allocate_kv_cache, so its "
                f"slot layout is unknown; allocate it with allocate_kv_cache(num_slots, dim, dcp_size={n}, "
                f"interleave={interleave}) so each rank holds only its rows"
            )
        if (layout.dcp_size, layout.interleave) != (n, interleave):
            raise DCPRewriteError(
                f"KV cache {base.name} was allocated for dcp_size={layout.dcp_size}, interleave={layout.interleave} "
                f"({layout.rows} rows for {layout.num_slots} slots) but compiled for dcp_size={n}, "
                f"interleave={interleave}; allocate it with those options (a DCP rank never holds the global cache)"
            )
        if cache.shape[0] != layout.rows:
            raise DCPRewriteError(f"KV cache {base.name} has {cache.shape[0]} rows, its layout needs {layout.rows}")

    @staticmethod
    def _refuse(user: fx.Node, base: fx.Node) -> None:
        raise DCPRewriteError(
            f"KV cache {base.name} is used by {user.format_node()}, which the DCP rewrite cannot localize "
            f"(a KV cache may only be read by sparse attention and written by kv_store, index_put_, index_copy_ "
            f"or cache[slots] = rows, on the cache itself, not a view)"
            f"{where(user)}"
        )
