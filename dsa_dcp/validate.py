"""Compile-time validation: every problem with a DCP program, reported together, before any rewrite.

``validate(gm, ctx, pipeline)`` runs the rules below and returns one message per problem; the
backend raises them all in one ``DCPValidationError``. The graph rules live beside the pass that
needs them (each pass's ``check(gm, ctx)``), so a pass and its preconditions cannot drift apart;
this module is the one place that runs them all, plus the rules about the group and the device.

The rules (``docs/validation.md`` lists each with its message):
  options          unknown keys and bad values (``DCPOptions.parse``, before anything else)
  group_size       the DCP group has ``dcp_size`` ranks
  rank             a given ``rank`` option matches this process's rank in the group
  heads            head-sharded merges (``a2a``, ``ag_rs``, ``fused_a2a``) need ``H % N == 0``
  epilogue         head-sharded merges need the attention output to feed the per-head
                   up-projection and the output projection, and the LSE unused
  kv_layout        each KV cache was allocated for this ``dcp_size`` and ``interleave``
  kv_dtype         KV caches are bf16, fp16 (or fp32, the reference dtype)
  kv_writes        a KV cache is only read by sparse attention and written by writes the
                   rewrite can localize
  interleave_page  ``interleave`` divides ``page_size`` (when the page size is given)
  multi_host       the DCP group is on one host, unless ``allow_multi_host``
  merge_device     ``fused_a2a`` on CUDA needs symmetric memory for the group (or a workspace)
  cuda_graphs      CUDA graphs are not requested for a step that runs on the CPU
  debug_checks     run-time debug checks only with the FX lowering and without CUDA graphs
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
import torch.fx as fx

from dsa_dcp.lowering import runs_on_cuda
from dsa_dcp.passes.base import CompileContext, DCPPass

HOST_KEY = "dsa_dcp/host/{}"
HOST_WAIT = datetime.timedelta(seconds=60)


class DCPValidationError(ValueError):
    """The program cannot be compiled as asked; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(self.problems, 1))
        super().__init__(f"dsa_dcp cannot compile this program ({len(self.problems)} problem(s)):\n{lines}")


def validate(gm: fx.GraphModule, ctx: CompileContext, pipeline: list[DCPPass]) -> list[str]:
    opts = ctx.options
    problems: list[str] = []
    on_cuda = runs_on_cuda(ctx.example_inputs)
    if opts.cuda_graphs and not on_cuda:
        problems.append("cuda_graphs=True, but the compiled step runs on the CPU; CUDA graphs need CUDA tensors")
    if opts.debug_checks and (opts.lowering != "fx" or (on_cuda and opts.cuda_graphs is not False)):
        problems.append("debug_checks synchronize with the host: use them with lowering='fx' and "
                        "cuda_graphs=False")
    if ctx.dcp_size == 1:
        return problems
    if opts.page_size is not None and opts.page_size % opts.interleave:
        problems.append(f"interleave={opts.interleave} must divide page_size={opts.page_size}: a page's tokens "
                        f"are spread over the ranks in whole interleave blocks")
    problems += _multi_host_problems(ctx)
    if opts.merge == "fused_a2a" and on_cuda and ctx.group_name is not None:
        from dsa_dcp.kernels.fused_merge import unavailable_reason

        reason = unavailable_reason(ctx.group_name)
        if reason:
            problems.append(f"merge='fused_a2a' is not available on this device: {reason}; use merge='a2a'")
    for graph_pass in pipeline:
        check = getattr(graph_pass, "check", None)
        if check is not None:
            problems += check(gm, ctx)
    return problems


def group_hosts(group_name: str) -> list[str] | None:
    """The host of each rank of the group, through the default store (no collective, so ranks that
    compile at different times never wait on each other's graphs); ``None`` for a fake group."""
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    group = _resolve_process_group(group_name)
    if dist.get_backend(group) == "fake":
        return None
    store = _get_default_store()
    store.set(HOST_KEY.format(dist.get_rank()), socket.gethostname())
    keys = [HOST_KEY.format(r) for r in dist.get_process_group_ranks(group)]
    store.wait(keys, HOST_WAIT)
    return [store.get(k).decode() for k in keys]


def _multi_host_problems(ctx: CompileContext) -> list[str]:
    if ctx.options.allow_multi_host or ctx.group_name is None:
        return []
    hosts = group_hosts(ctx.group_name)
    if hosts is None or len(set(hosts)) == 1:
        return []
    return [f"the DCP group spans {len(set(hosts))} hosts ({sorted(set(hosts))}); every layer merges over it, so "
            f"it belongs inside one host's fast interconnect. Set allow_multi_host=True to compile it anyway"]
