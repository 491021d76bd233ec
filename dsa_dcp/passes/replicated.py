"""Replicated modules: keep the modules ``options.replicated_modules`` names out of the DCP rewrite.

A speculative decoding draft (DeepSeek-V3's MTP layer, ``model.mtp``) is small and runs a chain of
one-row steps, latency-bound: splitting its KV over the group would add a merge to every step and
save little memory. So its caches stay whole on every rank and its attention stays single-rank
attention, while the target model's is split.

Runs at every ``dcp_size`` when ``replicated_modules`` or ``draft_length`` is given (its checks hold at
one rank too). Expects: dynamo's graph after the other normalize passes (the indexer as ``index_scores`` +
``topk_select``), whose nodes carry dynamo's module stack.
Leaves: the graph unchanged; every call node inside a named module (its module path is the name or
below it) and every cache input those nodes read or write (a KV cache with a recorded layout, or an
index cache) is marked ``meta[graph.REPLICATED] = name``. The rewrite passes skip marked nodes
(``graph.sparse_attention_nodes``, ``kv_writes.kv_cache_inputs``, ``index_cache.index_cache_inputs``),
so on every rank they compute what the single-rank model computes, over whole caches.

``check`` refuses: a name that is no submodule of the compiled module; a marked cache that a node
outside the module also uses; a marked cache allocated for a DCP group (its rows split over the
ranks: the replicated attention would read global slots in a local cache); and, with
``options.draft_length = k``, a step whose split attention has a row count that is not a multiple
of ``k + 1`` (a verify step holds ``k + 1`` rows a request).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx

from dsa_dcp import registry
from dsa_dcp.kv_cache import is_index_cache, kv_layout
from dsa_dcp.ops import SPARSE_ATTENTION_OPS
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.fx import alias_base, placeholder_values, shape
from dsa_dcp.passes.graph import REPLICATED, sparse_attention_nodes

_ROOT = re.compile(r"^[LG]\.[A-Za-z_][A-Za-z0-9_]*\.?")


def module_path(path: str) -> str:
    """A dynamo module-stack path as a dotted name from the compiled module: ``L['self'].mtp.layer``
    and ``L['self']._modules['layers'][0]`` become ``mtp.layer`` and ``layers.0``."""
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return _ROOT.sub("", path)


def node_module(node: fx.Node, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` whose module ``node`` runs in (by dynamo's module stack), else ``None``."""
    paths = [module_path(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for name in names:
        if any(p == name or p.startswith(name + ".") for p in paths):
            return name
    return None


def _is_cache(value: object) -> bool:
    return isinstance(value, torch.Tensor) and (kv_layout(value) is not None or is_index_cache(value))


@dataclasses.dataclass
class ReplicatedPlan(Plan):
    nodes: dict[fx.Node, str] = dataclasses.field(default_factory=dict)  # node -> its module's name
    caches: dict[fx.Node, str] = dataclasses.field(default_factory=dict)  # cache input -> the module's name


class ReplicatedModules(DCPPass):
    name = "replicated_modules"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> ReplicatedPlan:
        names = ctx.options.replicated_modules
        plan = ReplicatedPlan()
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                module = node_module(node, names)
                if module is not None:
                    plan.nodes[node] = module
        plan.problems += _unknown_names(names, set(plan.nodes.values()))
        values = placeholder_values(gm, ctx.example_inputs)
        for node, module in plan.nodes.items():
            for arg in node.all_input_nodes:
                base = alias_base(arg)
                if base.op == "placeholder" and _is_cache(values.get(base)):
                    plan.caches.setdefault(base, module)
        for cache, module in plan.caches.items():
            plan.problems += _cache_problems(cache, values[cache], module, plan.nodes)
        plan.problems += _verify_rows_problems(gm, ctx, plan.nodes)
        return plan

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: ReplicatedPlan) -> dict:
        for node, module in {**plan.nodes, **plan.caches}.items():
            node.meta[REPLICATED] = module
        attention = _attention(gm) & set(plan.nodes)
        return {"replicated_modules": list(ctx.options.replicated_modules), "nodes": len(plan.nodes),
                "sparse_attention_nodes": len(attention), "caches": [c.name for c in plan.caches]}


def _attention(gm: fx.GraphModule) -> set[fx.Node]:
    return {n for n in gm.graph.nodes if n.op == "call_function" and n.target in SPARSE_ATTENTION_OPS}


def _unknown_names(names: tuple[str, ...], found: set[str]) -> list[str]:
    """Names that are no submodule of the compiled module (when dynamo's frame shows it), else names
    no node of the graph runs in (a function compiled without its module)."""
    module, _ = registry.traced_frame()
    problems = []
    for name in names:
        if module is not None:
            try:
                module.get_submodule(name)
                continue
            except AttributeError:
                children = [child for child, _ in module.named_children()]
                problems.append(f"replicated_modules names {name!r}, which is no submodule of the compiled "
                                f"{type(module).__name__} (its submodules: {children}); name modules by their path "
                                f"from the compiled module, as model.get_submodule(name) takes it (e.g. 'mtp')")
        elif name not in found:
            problems.append(f"replicated_modules names {name!r}, but no node of the compiled graph runs in a module "
                            f"of that path; name modules by their path from the compiled module (e.g. 'mtp')")
    return problems


def _cache_problems(cache: fx.Node, value: torch.Tensor, module: str, nodes: dict[fx.Node, str]) -> list[str]:
    problems = []
    outside = [u for u in _users_through_views(cache) if u.op != "output" and u not in nodes]
    if outside:
        problems.append(f"cache {cache.name} is used inside replicated module {module!r} and outside it (by "
                        f"{', '.join(u.name for u in outside)}{where(outside[0])}); a cache is either whole on every "
                        f"rank (its module replicated) or split over the group, not both")
    layout = kv_layout(value)
    if layout is not None and layout.dcp_size != 1:
        what = "index cache" if is_index_cache(value) else "KV cache"
        problems.append(f"{what} {cache.name} of replicated module {module!r} was allocated for dcp_size="
                        f"{layout.dcp_size} ({layout.rows} rows for {layout.num_slots} slots: this rank's share), "
                        f"but a replicated module attends single-rank over every slot; allocate its caches whole "
                        f"(DSAModel(..., draft_cache='replicated'), or allocate_kv_cache(num_slots, dim, dcp_size=1)), "
                        f"or drop {module!r} from replicated_modules to split it like the target")
    return problems


def _users_through_views(cache: fx.Node) -> list[fx.Node]:
    seen, frontier, out = {cache}, [cache], []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            out.append(user)
            if alias_base(user) is cache:  # a view of the cache: its users use the cache too
                frontier.append(user)
    return out


def _verify_rows_problems(gm: fx.GraphModule, ctx: CompileContext, replicated: dict[fx.Node, str]) -> list[str]:
    """With ``draft_length = k``: the split attention's rows (the verify step's) are a multiple of k + 1."""
    k = ctx.options.draft_length
    if k is None:
        return []
    for attn in sparse_attention_nodes(gm.graph):
        if attn in replicated:
            continue
        rows = (shape(attn.args[0]) or (None,))[0]
        if isinstance(rows, int) and rows % (k + 1):
            return [f"draft_length={k}, but the step's split attention ({attn.name}) has {rows} rows, not a multiple "
                    f"of draft_length + 1 = {k + 1}: a verify step holds k + 1 rows a request (the last accepted "
                    f"token and the k drafted ones); pad the step to a multiple of {k + 1} rows (padding rows: "
                    f"slot -1, position -1){where(attn)}"]
    return []
