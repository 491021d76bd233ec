"""The ``dsa_dcp`` torch.compile backend: parse options, run the passes, lower.

Registered by name through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dsa_dcp", options={...})`` works without importing this package
first. The graph it receives is dynamo's FX graph (before AOT autograd): parameters and buffers
are placeholders, the ``dsa_dcp`` ops are single nodes, in-place KV writes are visible.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._logging import trace_structured
from torch.utils.weak import WeakIdKeyDictionary

from dsa_dcp import conventions  # torch.compile's conventions: mode=, grad mode, compiler reset
from dsa_dcp import progress, registry
from dsa_dcp.config import DCPOptions, OptionsError, resolve_group
from dsa_dcp.lowering import lower
from dsa_dcp.passes import build_pipeline
from dsa_dcp.passes.base import CompileContext
from dsa_dcp.passes.graph import graph_summary, is_replicated, sparse_attention_nodes
from dsa_dcp.passes.kv_writes import kv_cache_inputs
from dsa_dcp.position_cache import PositionShardedCache
from dsa_dcp.passes.errors import DCPRewriteError
from dsa_dcp.report import CompileReport, forget_last_report, last_report, process_group_note, set_last_report, \
    snapshot
from dsa_dcp.validate import DCPValidationError, validate

log = logging.getLogger("dsa_dcp.backend")

__all__ = ["DCPCompileWarning", "compile_context", "dsa_dcp_backend", "forget_last_report", "last_report"]


class DCPCompileWarning(UserWarning):
    """Something a compilation did differently from what the options asked (shown once per compilation)."""


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


# The input signatures each frame was compiled for, by module instance (weakly) or function code:
# a DCP step recompiled for inputs of the same shapes was specialized on a Python value, which
# dynamo recompiles for every new value. A new instance of a module is a new frame to dynamo.
_signatures_by_module: WeakIdKeyDictionary = WeakIdKeyDictionary()
_signatures_by_code: dict[Any, list[tuple]] = {}


def forget_compile_history() -> None:
    """Forget which frames were compiled (``torch.compiler.reset()`` does this too)."""
    _signatures_by_module.clear()
    _signatures_by_code.clear()


conventions.on_compiler_reset(forget_compile_history)


def _input_signature(example_inputs: Sequence[Any]) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
                 for x in example_inputs)


def _recompile_note(example_inputs: Sequence[Any], opts: DCPOptions) -> str | None:
    """A warning when this frame was compiled before for inputs of the same shapes (see above)."""
    module, code = registry.traced_frame()
    if code is None or opts.dcp_size == 1:
        return None
    by_code = _signatures_by_module.setdefault(module, {}) if module is not None else _signatures_by_code
    seen = by_code.setdefault(code, [])
    signature = _input_signature(example_inputs)
    repeated = signature in seen
    seen.append(signature)
    if not repeated:
        return None
    return (f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}) was compiled again for inputs of the same "
            f"shapes ({len(seen)} compilations): dynamo specialized the step on a Python value, such as a "
            f"position passed as an int, and recompiles it for every new value until its recompile limit "
            f"(torch._dynamo.config.recompile_limit) stops it. Pass positions as tensors, or compile with "
            f"dynamic=None (the default) or dynamic=True so the value becomes symbolic (docs/dcp.md, "
            f"'Positions')")


def dsa_dcp_backend(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    opts = DCPOptions.parse(conventions.options_with_mode(options, mode))  # torch.compile(mode=...)
    ctx, problems = compile_context(opts)
    problems = conventions.grad_mode_problems(example_inputs) + problems  # inference only
    ctx = dataclasses.replace(ctx, example_inputs=tuple(example_inputs))
    attention = len(sparse_attention_nodes(gm.graph))
    number, started = progress.compiling(
        f"({len(gm.graph.nodes)} nodes{f', {attention} sparse attention layer' if attention else ''}"
        f"{'s' if attention > 1 else ''}) for rank "
        f"{ctx.rank} of {opts.dcp_size}, lowering {opts.lowering}", ctx.rank)
    report = CompileReport(options=opts, rank=ctx.rank, graph_before=gm.code, passes=[],
                           process_group=process_group_note(opts.dcp_size))
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "dsa_dcp_input_graph", "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False),
    )
    pipeline = build_pipeline(ctx)
    recompiled = _recompile_note(example_inputs, opts)
    for graph_pass in pipeline.normalize:  # to the op vocabulary, so every check below reads it
        plan = graph_pass.check(gm, ctx)
        if plan.problems:
            raise DCPValidationError(problems + plan.problems)
        report.passes.append(graph_pass(gm, ctx, plan))
    plans, more, notes = validate(gm, ctx, pipeline)  # every problem at once, before anything is rewritten
    problems += more
    if problems:
        raise DCPValidationError(problems)
    if opts.dcp_size > 1 and not sparse_attention_nodes(gm.graph) and not kv_cache_inputs(gm, ctx.example_inputs) \
            and not any(isinstance(x, PositionShardedCache) for x in example_inputs) \
            and not any(is_replicated(n) for n in gm.graph.nodes):  # a replicated module's step is whole by request
        notes.append(f"dcp_size={opts.dcp_size}, but this graph has no sparse attention node and touches no KV "
                     f"cache allocated by dsa_dcp.allocate_kv_cache: it was compiled without DCP (every rank "
                     f"runs it whole)")
    if recompiled:
        notes.append(recompiled)
    for graph_pass in pipeline.rewrite:
        report.passes.append(graph_pass(gm, ctx, plans[graph_pass]))
    for graph_pass in pipeline.finish:  # each plans on the rewritten graph; none refuses
        plan = graph_pass.check(gm, ctx)
        if plan.problems:
            raise DCPRewriteError(f"{graph_pass.name} cannot refuse a graph, but found: {plan.problems}")
        report.passes.append(graph_pass(gm, ctx, plan))
    for note in notes:
        log.warning("dsa_dcp: %s", note)
        warnings.warn(note, DCPCompileWarning, stacklevel=2)
    report.warnings = notes
    report.graph_after = gm.code
    report.summary = graph_summary(gm.graph)
    report.graph = snapshot(gm)
    set_last_report(report)
    registry.record(report, example_inputs)  # so dsa_dcp.inspect(compiled) finds it
    lowered = lower(gm, example_inputs, opts)
    progress.compiled(number, started, ctx.rank)
    report.hold_lowered(lowered)
    log.info("compiled for rank %d of %d (lowering %s, %d passes): %s", ctx.rank, opts.dcp_size, opts.lowering,
             len(report.passes), report.summary)  # TORCH_LOGS=dsa_dcp
    return lowered
