"""The ``dsa_dcp`` torch.compile backend: parse options, run the passes, lower.

Registered by name through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dsa_dcp", options={...})`` works without importing this package
first. The graph it receives is dynamo's FX graph (before AOT autograd): parameters and buffers
are placeholders, the ``dsa_dcp`` ops are single nodes, in-place KV writes are visible.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._logging import trace_structured

from dsa_dcp import conventions  # torch.compile's conventions: mode=, grad mode, compiler reset
from dsa_dcp.config import DCPOptions, OptionsError, resolve_group
from dsa_dcp.inspect import registry
from dsa_dcp.lowering import lower
from dsa_dcp.passes import build_pipeline
from dsa_dcp.passes.base import CompileContext, PassResult
from dsa_dcp.passes.graph import graph_summary
from dsa_dcp.validate import DCPValidationError, validate

log = logging.getLogger("dsa_dcp.backend")


@dataclasses.dataclass
class CompileReport:
    """What one compilation did: the options, this rank, and every pass's result in order."""

    options: DCPOptions
    rank: int
    graph_before: str
    passes: list[PassResult]
    graph_after: str = ""
    summary: dict[str, int] = dataclasses.field(default_factory=dict)
    lowered: Callable | None = None  # what runs each step (a CudaGraphStep on CUDA)
    # per-layer dataflow and collective bytes of the final graph (dsa_dcp.inspect.analysis)
    analysis: Any = None

    def kernels_per_step(self) -> dict | None:
        """CUDA kernels replayed per step, per captured input shape (``None`` without CUDA graphs,
        and for a DCP group: counting runs the step once more, and its collectives would wait for
        ranks that are not counting, or that count at another time)."""
        step = self.lowered
        if self.options.dcp_size > 1 or not hasattr(step, "kernels_per_step"):
            return None
        return step.kernels_per_step()

    def stats(self) -> dict[str, dict[str, Any]]:
        return {p.name: p.stats for p in self.passes}


# Only the latest: a report holds its lowered step (CUDA graphs, their memory pool, weight shards),
# which must not outlive the compiled function. Earlier ones stay reachable, weakly, through
# dsa_dcp.inspect's registry.
_last_report: CompileReport | None = None


def last_report() -> CompileReport | None:
    """The report of the most recent compilation in this process."""
    return _last_report


def forget_last_report() -> None:
    """Drop the most recent report, and the lowered step (CUDA graphs included) it holds."""
    global _last_report
    _last_report = None


conventions.on_compiler_reset(forget_last_report)  # torch.compiler.reset() clears backend_report()


def compile_context(options: DCPOptions) -> tuple[CompileContext, list[str]]:
    """Resolve this rank and its group; the problems found (the group's size must be ``dcp_size``)."""
    if options.dcp_size == 1:
        return CompileContext(options=options, rank=0, group_name=None), []
    if not dist.is_initialized():
        raise OptionsError(
            f"dcp_size={options.dcp_size} needs an initialized torch.distributed process group "
            "(torchrun, or dsa_dcp.launch.run_on_ranks on CPU)"
        )
    group = resolve_group(options.group)  # a group name must name a group of this process
    problems = []
    size = dist.get_world_size(group)
    if size != options.dcp_size:
        problems.append(f"dcp_size={options.dcp_size} but the DCP process group has {size} ranks; they must be equal")
    rank = dist.get_rank(group)
    if options.rank is not None and options.rank != rank:
        problems.append(f"option rank={options.rank} but this process is rank {rank} of the DCP group")
    return CompileContext(options=options, rank=rank, group_name=group.group_name), problems


def dsa_dcp_backend(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    global _last_report
    opts = DCPOptions.parse(conventions.options_with_mode(options, mode))  # torch.compile(mode=...)
    ctx, problems = compile_context(opts)
    problems = conventions.grad_mode_problems(example_inputs) + problems  # inference only
    ctx = dataclasses.replace(ctx, example_inputs=tuple(example_inputs))
    pipeline = build_pipeline(ctx)
    problems += validate(gm, ctx, pipeline)  # every problem at once, before anything is rewritten
    if problems:
        raise DCPValidationError(problems)
    report = CompileReport(options=opts, rank=ctx.rank, graph_before=gm.code, passes=[])
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "dsa_dcp_input_graph", "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False),
    )
    for graph_pass in pipeline:
        report.passes.append(graph_pass(gm, ctx))
    report.graph_after = gm.code
    report.summary = graph_summary(gm.graph)
    report.analysis = _analyze(gm, example_inputs, opts)
    _last_report = report
    registry.record(report, example_inputs)  # so dsa_dcp.inspect(compiled) finds it
    report.lowered = lower(gm, example_inputs, opts)
    log.info("compiled for rank %d of %d (lowering %s, %d passes): %s", ctx.rank, opts.dcp_size, opts.lowering,
             len(report.passes), report.summary)  # TORCH_LOGS=dsa_dcp
    return report.lowered


def _analyze(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: DCPOptions) -> Any:
    """The inspection tool's view of the final graph; a failure here never fails a compilation."""
    from dsa_dcp.inspect.analysis import analyze

    try:
        return analyze(gm, example_inputs, opts.dcp_size, opts.merge)
    except Exception as e:  # noqa: BLE001
        log.warning("dsa_dcp: graph analysis for inspection failed: %s: %s", type(e).__name__, e)
        return None
