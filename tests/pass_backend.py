"""A test backend for pass tests: the passes under test on dynamo's graph, in one process.

``PassBackend(passes, dcp_size=N, rank=r, **options)`` is a ``torch.compile`` backend that runs
only ``passes`` (pass classes, in order: each checked, then run) on the traced graph, for rank ``r``
of an ``N``-rank group that a fake process group stands in for, and keeps the graph before and
after with its op counts (``counts_before``, ``counts_after``: target name -> nodes). The compiled
call runs nothing (the rewritten graph's collectives have no peers here, and the model as written
cannot run on a rank's share of a cache): it returns zeros of the graph's output shapes. A pass
test asserts on structure; equivalence with the single-rank model stays with the end-to-end tests
on real gloo ranks.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx

from dsa_dcp.config import DCPOptions
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.passes.base import CompileContext
from dsa_dcp.passes.fx import target_name


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Calls per target name (``call_function`` and ``call_method`` nodes)."""
    return dict(collections.Counter(target_name(n.target) for n in gm.graph.nodes
                                    if n.op in ("call_function", "call_method")))


class PassBackend:
    """See the module docstring. One compilation per instance: ``gm``, ``stats``, ``counts_*``."""

    def __init__(self, passes, *, dcp_size: int = 2, rank: int = 0, **options) -> None:
        self.passes = list(passes)
        self.options = DCPOptions.parse({"dcp_size": dcp_size, **options})
        self.rank = rank
        self.gm: fx.GraphModule | None = None
        self.stats: dict[str, dict] = {}
        self.counts_before: dict[str, int] = {}
        self.counts_after: dict[str, int] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs):
        group = dist.group.WORLD.group_name if dist.is_initialized() else None
        ctx = CompileContext(options=self.options, rank=self.rank, group_name=group,
                             example_inputs=tuple(example_inputs))
        self.counts_before = op_counts(gm)
        outputs = [torch.zeros(o.meta["example_value"].shape, dtype=o.meta["example_value"].dtype)
                   for o in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
        for graph_pass in (cls() for cls in self.passes):
            self.stats[graph_pass.name] = graph_pass(gm, ctx).stats  # checked first: refuses with its problems
        self.gm, self.counts_after = gm, op_counts(gm)
        return lambda *args: outputs


def run_passes(fn, inputs, passes, *, dcp_size: int = 2, rank: int = 0, **options) -> PassBackend:
    """Trace ``fn(*inputs)`` with dynamo and run ``passes`` on its graph (``PassBackend``), inside a
    fake group of ``dcp_size`` ranks; returns the backend (its graph, stats and op counts)."""
    backend = PassBackend(passes, dcp_size=dcp_size, rank=rank, **options)
    torch._dynamo.reset()
    group = fake_group(dcp_size) if not dist.is_initialized() else contextlib.nullcontext()
    with group, torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    return backend
