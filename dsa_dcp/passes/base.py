"""What every pass shares: the compile context, a cache-correct ``uuid()``, and a report."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
from typing import Any

import torch.fx as fx
from torch._logging import trace_structured

from dsa_dcp.config import DCPOptions
from dsa_dcp.passes.errors import DCPRewriteError

log = logging.getLogger("dsa_dcp.passes")


@dataclasses.dataclass(frozen=True)
class CompileContext:
    """What a pass may depend on: the options and where this rank sits in its DCP group.

    ``group_name`` names the process group for functional collectives (``None`` when
    ``dcp_size == 1``).
    """

    options: DCPOptions
    rank: int
    group_name: str | None
    # The real tensors behind the graph's placeholders (parameters and caches are placeholders).
    example_inputs: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def dcp_size(self) -> int:
        return self.options.dcp_size


@dataclasses.dataclass(kw_only=True)
class Plan:
    """What a pass's ``check`` found: the problems that refuse the graph, the warnings to show, and
    (in subclasses) everything ``run`` needs, so nothing is checked or planned twice."""

    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    all_gathers: list[str] = dataclasses.field(default_factory=list)  # what the rewrite will all-gather


@dataclasses.dataclass
class PassResult:
    """What one pass did, in numbers the inspection tool and the demo print."""

    name: str
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    code_before: str = ""
    code_after: str = ""
    nodes_added: list[str] = dataclasses.field(default_factory=list)
    nodes_removed: list[str] = dataclasses.field(default_factory=list)


class DCPPass:
    """A graph pass: ``check(gm, ctx)`` returns its ``Plan`` (problems included), then
    ``run(gm, ctx, plan)`` carries the plan out, rewriting ``gm`` in place, and returns its stats.

    The backend checks every pass of the pipeline before it runs any, so a refused graph is left
    untouched; a pass whose decisions depend on an earlier pass's rewrite plans nothing in ``check``
    and decides in ``run``. Subclasses say in their docstring what graph they expect and what they
    leave. ``uuid()`` hashes the pass's source and the context, so a graph compiled for one rank,
    group size or option set is never served to another from a compile cache.
    """

    name = "pass"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> Plan:
        return Plan()

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: Plan) -> dict[str, Any]:
        raise NotImplementedError

    def uuid(self, ctx: CompileContext) -> str:
        src = inspect.getsource(type(self))
        key = f"{type(self).__qualname__}|{src}|{ctx.options.cache_key()}|{ctx.rank}|{ctx.group_name}"
        return hashlib.sha256(key.encode()).hexdigest()

    def __call__(self, gm: fx.GraphModule, ctx: CompileContext, plan: Plan | None = None) -> PassResult:
        before_nodes = {_node_key(n) for n in gm.graph.nodes}
        if plan is None:  # run on its own (tests): check first, refuse before rewriting anything
            plan = self.check(gm, ctx)
            if plan.problems:
                raise DCPRewriteError("\n".join(plan.problems))
        result = PassResult(name=self.name, code_before=gm.code)
        result.stats = self.run(gm, ctx, plan) or {}
        gm.graph.lint()
        gm.recompile()
        after_nodes = {_node_key(n) for n in gm.graph.nodes}
        result.code_after = gm.code
        result.nodes_added = sorted(after_nodes - before_nodes)
        result.nodes_removed = sorted(before_nodes - after_nodes)
        # TORCH_LOGS=dsa_dcp: a line per pass; +dsa_dcp: the nodes it added and removed
        log.info("pass %s (rank %d of %d): %s", self.name, ctx.rank, ctx.dcp_size, result.stats)
        log.debug("pass %s: +%d nodes %s, -%d nodes %s", self.name, len(result.nodes_added), result.nodes_added,
                  len(result.nodes_removed), result.nodes_removed)

        def trace_payload() -> str:  # one artifact per pass in TORCH_TRACE / tlparse
            head = [f"# pass {result.name}: {result.stats}",
                    f"# nodes added: {len(result.nodes_added)}, removed: {len(result.nodes_removed)}"]
            head += [f"# + {n}" for n in result.nodes_added] + [f"# - {n}" for n in result.nodes_removed]
            return "\n".join(head) + "\n" + gm.print_readable(print_output=False)

        trace_structured("artifact", payload_fn=trace_payload,
                         metadata_fn=lambda: {"name": f"dsa_dcp_pass_{self.name}", "encoding": "string"})
        return result


def _node_key(node: fx.Node) -> str:
    return f"{node.name} = {node.op}:{getattr(node.target, '__name__', node.target)}"
