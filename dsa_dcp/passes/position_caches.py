"""Position caches in the graph: find them, localize their writes, and say what cannot be.

A position cache is a graph input whose real tensor is a ``PositionShardedCache``
(``dsa_dcp.position_cache``): the rank's share of a ``[B, T, ...]`` or ``[B, H, T, D]`` cache. The
model writes it with global positions, in the forms model authors use:

- ``cache[:b, start:end] = rows`` (DeepSeek's published code; ``start``/``end`` ints or SymInts),
- ``cache.index_copy_(dim, positions, rows)`` (transformers' static cache).

``match_write`` finds them (the recognizing pass refuses any other write); ``localize_kv_writes``
(``kv_writes.py``, the rewrite phase) rewrites each: it becomes ``position_store(local_positions(cache), localize_slots(positions, N, r, I), rows, dim)``:
the rank stores the positions it owns at their local positions and skips the others. One
``localize_slots`` serves every write through the same positions (all layers of a step). A graph
that only writes a cache (a prefill that attends over the chunk in hand) is localized the same
way. Every other use of a position cache must be consumed by recognized attention
(``recognize_attention.py``); anything left is refused, naming the node.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dsa_dcp.ops_positions import POSITION_STORE
from dsa_dcp.passes import fx as F
from dsa_dcp.passes.errors import where
from dsa_dcp.position_cache import PositionLayout, local_positions, position_layout
from dsa_dcp.slots import localize_slots


def position_caches(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, PositionLayout]:
    """Each placeholder whose real tensor is a position cache -> its layout."""
    found = {}
    for node, value in F.placeholder_values(gm, example_inputs).items():
        layout = position_layout(value)
        if layout is not None:
            found[node] = layout
    return found


def layout_problems(cache: fx.Node, layout: PositionLayout, dcp_size: int, interleave: int) -> list[str]:
    if (layout.dcp_size, layout.interleave) != (dcp_size, interleave):
        return [f"position cache {cache.name} was allocated for dcp_size={layout.dcp_size}, interleave="
                f"{layout.interleave} but compiled for dcp_size={dcp_size}, interleave={interleave}; allocate it "
                f"with those options"]
    return []


# --------------------------------------------------------------------------- writes


@dataclasses.dataclass
class PositionWrite:
    """One write into a position cache, in a form that can be localized."""

    node: fx.Node
    cache: fx.Node
    rows: fx.Node
    dim: int
    positions: fx.Node | None = None  # index_copy_: a positions tensor
    start: object = None  # slice write: [start, end) as ints or SymInt nodes
    end: object = None


def _is_full_slice(s) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def match_write(node: fx.Node, cache: fx.Node, layout: PositionLayout) -> tuple[PositionWrite | None, str]:
    """``(write, "")`` if ``node`` is a localizable write into ``cache``; ``(None, why)`` if it writes it
    some other way; ``(None, "")`` if it is not a write."""
    dim = layout.dim
    if node.op == "call_method" and node.target == "index_copy_" and node.args[0] is cache:
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        positions = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
        rows = node.args[3] if len(node.args) > 3 else node.kwargs.get("source")
        if not isinstance(d, int) or d % len(layout_shape(cache)) != dim:
            return None, f"index_copy_ along dim {d}, not the position dim {dim}"
        if cache in (positions, rows):
            return None, "the cache is also an argument of its own write"
        return PositionWrite(node, cache, rows, dim, positions=positions), ""
    if node.op == "call_function" and node.target is operator.setitem and node.args[0] is cache:
        index, rows = node.args[1], node.args[2]
        index = index if isinstance(index, tuple) else (index,)
        if not (isinstance(rows, fx.Node) and len(index) > dim and all(isinstance(i, slice) for i in index)):
            return None, "a write whose index is not slices (cache[:b, start:end] = rows)"
        batch, pos = index[0], index[dim]
        if not (batch.start in (None, 0) and batch.step in (None, 1)) or pos.step not in (None, 1) \
                or not all(_is_full_slice(i) for i in index[1:dim] + index[dim + 1:]):
            return None, "a slice write other than cache[:b, start:end] = rows"
        got = F.shape(rows)
        if len(got) != len(layout_shape(cache)):
            return None, f"rows of shape {got} broadcast into the cache"
        start = 0 if pos.start is None else pos.start
        end = pos.stop if pos.stop is not None else layout.length
        return PositionWrite(node, cache, rows, dim, start=start, end=end), ""
    if node.args and node.args[0] is cache and F.mutates(node, cache):
        return None, "an in-place op on the cache"
    return None, ""


def layout_shape(cache: fx.Node) -> list:
    return F.shape(cache)


def localize_writes(gm: fx.GraphModule, writes: list[PositionWrite], local: dict[fx.Node, fx.Node],
                    dcp_size: int, rank: int, interleave: int) -> int:
    """Rewrite each write to ``position_store`` on the local cache; returns the localizations made."""
    graph = gm.graph
    localized: dict[object, fx.Node] = {}
    for w in writes:
        emit = F.Emitter(graph, like=w.node)
        with graph.inserting_before(w.node):
            if w.positions is not None:
                key = w.positions
                positions = w.positions
            else:
                key = ("range", _key(w.start), _key(w.end))
                positions = None
            if key not in localized:
                if positions is None:
                    positions = emit(torch.arange, w.start, w.end, device=F.example(w.rows).device)
                localized[key] = emit(localize_slots, positions, dcp_size, rank, interleave)
            emit(POSITION_STORE, local[w.cache], localized[key], w.rows, w.dim)
        w.node.replace_all_uses_with(w.cache)  # an in-place write returns its target
        graph.erase_node(w.node)
    return len(localized)


def _key(value):
    return value if not isinstance(value, fx.Node) else ("node", value)


def insert_local_views(gm: fx.GraphModule, caches, example_inputs: tuple) -> dict[fx.Node, fx.Node]:
    """One ``local_positions(cache)`` node per position cache, right after the placeholders."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    real = F.placeholder_values(gm, example_inputs)
    mode = F.fake_mode_of(graph)
    local = {}
    emit = F.Emitter(graph)
    with graph.inserting_after(placeholders[-1]):
        for cache in reversed(list(caches)):
            inner = local_positions(real[cache])
            local[cache] = emit.known(mode.from_tensor(inner) if mode is not None else inner, local_positions, cache)
    return local


def local_views(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, fx.Node]:
    """Each position cache's ``local_positions(cache)`` node (``insert_local_views`` made them; made here
    for a cache that has none, as in a graph that only writes it)."""
    caches = position_caches(gm, example_inputs)
    found = {c: next((u for u in c.users if u.op == "call_function" and u.target is local_positions), None)
             for c in caches}
    missing = [c for c, view in found.items() if view is None]
    if missing:
        found |= insert_local_views(gm, missing, example_inputs)
    return found


def stray_uses(cache: fx.Node, allowed: set[fx.Node]) -> list[str]:
    """A problem for every use of ``cache`` outside ``allowed``."""
    return [f"position cache {cache.name} is used by {user.format_node()}, which the DCP rewrite cannot localize "
            f"(a position cache may only be written by cache[:b, start:end] = rows or index_copy_ along its "
            f"position dim, and read by sparse attention written as dense scores masked to a top-k, softmax and "
            f"weighted sum; docs/models.md lists the forms){where(user)}"
            for user in cache.users if user not in allowed]
