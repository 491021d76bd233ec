"""The ``dsa_dcp`` torch.compile backend: parse options, run the passes, lower.

Registered by name through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dsa_dcp", options={...})`` works without importing this package
first. The graph it receives is dynamo's FX graph (before AOT autograd): parameters and buffers
are placeholders, the ``dsa_dcp`` ops are single nodes, in-place KV writes are visible.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.lowering import lower
from dsa_dcp.passes import build_pipeline
from dsa_dcp.passes.base import CompileContext, PassResult
from dsa_dcp.passes.graph import graph_summary


@dataclasses.dataclass
class CompileReport:
    """What one compilation did: the options, this rank, and every pass's result in order."""

    options: DCPOptions
    rank: int
    graph_before: str
    passes: list[PassResult]
    graph_after: str = ""
    summary: dict[str, int] = dataclasses.field(default_factory=dict)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {p.name: p.stats for p in self.passes}


_reports: list[CompileReport] = []


def last_report() -> CompileReport | None:
    """The report of the most recent compilation in this process."""
    return _reports[-1] if _reports else None


def compile_context(options: DCPOptions) -> CompileContext:
    """Resolve this rank and its group; check the group matches ``dcp_size``."""
    if options.dcp_size == 1:
        return CompileContext(options=options, rank=0, group_name=None)
    if options.rank is not None and not dist.is_initialized():
        return CompileContext(options=options, rank=options.rank, group_name=None)
    if not dist.is_initialized():
        raise OptionsError(
            f"dcp_size={options.dcp_size} needs an initialized torch.distributed process group "
            "(torchrun, or dsa_dcp.launch.run_on_ranks on CPU)"
        )
    group = options.group
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    group = group or dist.group.WORLD
    size = dist.get_world_size(group)
    if size != options.dcp_size:
        raise OptionsError(f"dcp_size={options.dcp_size} but the DCP process group has {size} ranks; they must be equal")
    rank = dist.get_rank(group)
    if options.rank is not None and options.rank != rank:
        raise OptionsError(f"option rank={options.rank} but this process is rank {rank} of the DCP group")
    return CompileContext(options=options, rank=rank, group_name=group.group_name)


def dsa_dcp_backend(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: dict[str, Any] | None = None
) -> Callable:
    opts = DCPOptions.parse(options)
    ctx = dataclasses.replace(compile_context(opts), example_inputs=tuple(example_inputs))
    report = CompileReport(options=opts, rank=ctx.rank, graph_before=gm.code, passes=[])
    for graph_pass in build_pipeline(ctx):
        report.passes.append(graph_pass(gm, ctx))
    report.graph_after = gm.code
    report.summary = graph_summary(gm.graph)
    _reports.append(report)
    return lower(gm, example_inputs, opts)
