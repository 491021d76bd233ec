"""Compile-time validation: every problem with a DCP program, reported together, before any rewrite.

``validate(gm, ctx, pipeline)`` runs the rules below and returns the rewrite passes' plans, one
message per problem, and the warnings to show; the backend raises the problems all at once in one
``DCPValidationError``. The graph rules live beside the pass that needs them (each rewrite pass's
``check(gm, ctx)``, which returns the plan that pass then carries out), so a pass and its
preconditions cannot drift apart; this module is the one place that runs them all, plus the rules
about the group and the device. A message shared by several nodes (every layer of a model) is
reported once, naming them all.

The rules (``docs/validation.md`` lists each with its message):
  options          unknown keys and bad values (``DCPOptions.parse``, before anything else)
  group_size       the DCP group has ``dcp_size`` ranks
  rank             a given ``rank`` option matches this process's rank in the group
  group_agreement  every rank of the group compiles with the same options and the same number of
                   sparse attention nodes (one small exchange over the group's store)
  multi_host       the DCP group is on one host, unless ``allow_multi_host``
  heads            head-sharded merges (``a2a``, ``ag_rs``, ``fused_a2a``) need ``H % N == 0``
  kv_layout        each KV cache was allocated for this ``dcp_size`` and ``interleave`` (at every
                   ``dcp_size``: a cache allocated for a group and compiled without options too)
  kv_dtype         KV caches are bf16, fp16, FP8 E4M3 (written by kv_store with its scale), or fp32
                   (the reference dtype); an FP8 position cache is refused under DCP
  kv_writes        a KV cache is only read by sparse attention and written by writes the
                   rewrite can localize
  interleave_page  ``interleave`` divides ``page_size`` (when the page size is given)
  merge_device     ``fused_a2a`` on CUDA needs symmetric memory for the group (or a workspace)
  cuda_graphs      CUDA graphs are not requested for a step that runs on the CPU
  graph_capture    a CUDA step of a group whose collectives a CUDA graph cannot capture (gloo) is
                   compiled with ``cuda_graphs=False``
  host_gather      no all-gather of CUDA tensors over a gloo group (gloo's all-gather of CUDA
                   tensors crashes the process): from the rewrite passes' plans, which say what
                   they will all-gather, and ``merge.host_gather_problem``
  debug_checks     run-time debug checks only with the FX lowering and without CUDA graphs
  dtensor          no graph input (parameter, buffer, cache) is a ``DTensor``: DCP inside tensor
                   parallelism takes a model whose TP is plain tensors and functional collectives
Warnings (shown once per compilation): a layer whose epilogue a head-sharded merge cannot shard
merges with ``ag``; a DCP compilation of a graph with no sparse attention and no KV cache.
"""

from __future__ import annotations

import datetime
import json
import re
import socket

import torch
import torch.distributed as dist
import torch.fx as fx

from dsa_dcp.lowering import runs_on_cuda
from dsa_dcp.merge import host_gather_problem
from dsa_dcp.passes import Pipeline
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.graph import sparse_attention_nodes
from dsa_dcp.passes.kv_writes import cache_layout_problems

AGREEMENT_KEY = "dsa_dcp/compile/{group}/{round}/{rank}"
# How long the agreement waits when the group's own timeout cannot be read (``group_timeout``).
AGREEMENT_WAIT = datetime.timedelta(seconds=60)
# options that may differ between the ranks of one group
PER_RANK_OPTIONS = ("rank", "group")


class DCPValidationError(ValueError):
    """The program cannot be compiled as asked; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(self.problems, 1))
        super().__init__(f"dsa_dcp cannot compile this program ({len(self.problems)} problem(s)):\n{lines}")


def validate(gm: fx.GraphModule, ctx: CompileContext, pipeline: Pipeline
             ) -> tuple[dict[DCPPass, Plan], list[str], list[str]]:
    """``(plans, problems, warnings)`` for compiling ``gm`` with ``pipeline`` (see module docstring)."""
    opts = ctx.options
    problems: list[str] = []
    on_cuda = runs_on_cuda(ctx.example_inputs)
    if opts.cuda_graphs and not on_cuda:
        problems.append("cuda_graphs=True, but the compiled step runs on the CPU; CUDA graphs need CUDA tensors")
    if opts.debug_checks and (opts.lowering != "fx" or (on_cuda and opts.cuda_graphs is not False)):
        problems.append("debug_checks synchronize with the host: use them with lowering='fx' and "
                        "cuda_graphs=False")
    problems += cache_layout_problems(gm, ctx)
    if ctx.dcp_size == 1:
        return {}, grouped(problems), []
    problems += group_agreement_problems(gm, ctx)  # first, so no peer waits on a rank that refuses
    problems += dtensor_problems(gm, ctx)
    if on_cuda and opts.cuda_graphs is not False and ctx.group_name is not None:
        problem = graph_capture_problem(_group_backend(ctx.group_name))
        if problem:
            problems.append(problem)
    if opts.page_size is not None and opts.page_size % opts.interleave:
        problems.append(f"interleave={opts.interleave} must divide page_size={opts.page_size}: a page's tokens "
                        f"are spread over the ranks in whole interleave blocks")
    if opts.merge == "fused_a2a" and on_cuda and ctx.group_name is not None:
        from dsa_dcp.kernels.fused_merge import unavailable_reason

        reason = unavailable_reason(ctx.group_name)
        if reason:
            problems.append(f"merge='fused_a2a' is not available on this device: {reason}; use merge='a2a'")
    plans: dict[DCPPass, Plan] = {}
    warnings: list[str] = []
    for graph_pass in pipeline.rewrite:
        plan = plans[graph_pass] = graph_pass.check(gm, ctx)
        problems += plan.problems
        warnings += plan.warnings
    if on_cuda and ctx.group_name is not None and _group_backend(ctx.group_name) == "gloo":
        gathers = [g for plan in plans.values() for g in plan.all_gathers]
        problem = host_gather_problem(gathers + (["debug_checks' step check"] if opts.debug_checks else []))
        if problem:
            problems.append(problem)
    return plans, grouped(problems), grouped(warnings)


def dtensor_problems(gm: fx.GraphModule, ctx: CompileContext) -> list[str]:
    """A DCP program whose inputs are ``DTensor``s (transformers' ``tp_plan``, ``parallelize_module``)
    is refused: the rewrite reads each rank's local shapes and places its collectives among the
    model's own functional collectives, which a DTensor's implicit redistributions are not."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has none to refuse
        return []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = [node.name for node, value in zip(placeholders, ctx.example_inputs) if isinstance(value, DTensor)]
    if not found:
        return []
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return [f"{len(found)} input(s) of the step are DTensors ({shown}): DCP does not run inside DTensor tensor "
            f"parallelism (transformers' tp_plan / tp_size, torch.distributed.tensor.parallel); build the model's TP "
            f"from plain tensors and functional collectives (dsa_dcp.models.DSAModel(tp_size=...), docs/models.md), "
            f"or compile with dcp_size=1"]


# Backends whose collectives a CUDA graph can capture (a fake group's do nothing on the device).
CAPTURABLE_BACKENDS = ("nccl", "fake")


def _group_backend(group_name: str) -> str:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_backend(_resolve_process_group(group_name))


def graph_capture_problem(backend: str) -> str | None:
    """Why a CUDA graph cannot capture the collectives of a group with this backend (``None`` when
    it can). gloo runs a CUDA tensor's collective on the host (copies to and from host memory and a
    wait on the stream), which a capture refuses; one rank failing its capture would leave its
    peers waiting inside the collective."""
    if backend in CAPTURABLE_BACKENDS:
        return None
    return (f"the DCP group's backend is {backend!r}: its collectives on CUDA tensors go through the host, "
            f"and a CUDA graph cannot capture them; compile with cuda_graphs=False (the step then runs "
            f"without graphs), or use an NCCL group (one GPU per rank) for CUDA graphs")


# --------------------------------------------------------------------------- one message per rule

_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _unnumbered(token: str) -> str:
    return re.sub(r"_#$", "", re.sub(r"\d+", "#", token))


def grouped(messages: list[str]) -> list[str]:
    """One message for the nodes that share it: messages equal up to numbered names in them
    (``sparse_mla``, ``sparse_mla_1``, ``..._layers_modules_3_...``) become the first one, followed by
    the names the others had in its place."""
    order: list[str] = []
    same: dict[str, list[str]] = {}
    for message in messages:
        key = _IDENTIFIER.sub(lambda m: _unnumbered(m.group(0)), message)
        if key not in same:
            order.append(key)
            same[key] = []
        if message not in same[key]:
            same[key].append(message)
    out = []
    for key in order:
        first, *others = same[key]
        if others:
            names = [next((b for a, b in zip(_IDENTIFIER.findall(first), _IDENTIFIER.findall(m)) if a != b), "?")
                     for m in others]
            first += f"\n     (the same for {len(others)} more: {', '.join(names)})"
        out.append(first)
    return out


# --------------------------------------------------------------------------- the group's agreement

ROUND_KEY = "dsa_dcp/compile/{group}/rounds/{rank}"


def _program_options(ctx: CompileContext) -> dict[str, str]:
    return {name: repr(value) for name, value in sorted(vars(ctx.options).items()) if name not in PER_RANK_OPTIONS}


def group_timeout(group) -> datetime.timedelta:
    """How long a rank of ``group`` waits for its peers: the process group's own timeout (what
    ``init_process_group(timeout=...)``, ``run_on_ranks(collective_timeout=...)`` or torchrun set, and
    what its collectives wait), else the default store's, else ``AGREEMENT_WAIT``."""
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or a torch without options
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        timeout = _get_default_store().timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except Exception:  # noqa: BLE001 - no store: the fixed wait
        pass
    return AGREEMENT_WAIT


def group_agreement_problems(gm: fx.GraphModule, ctx: CompileContext) -> list[str]:
    """Every rank of the group publishes its host, options and attention node count through the
    group's store (no collective: ranks that compile at different times never wait on each other's
    graphs), then compares: options that differ are refused with every rank's value named."""
    if ctx.group_name is None:
        return []
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    group = _resolve_process_group(ctx.group_name)
    if dist.get_backend(group) == "fake":
        return []
    ranks = dist.get_process_group_ranks(group)
    mine = {"host": socket.gethostname(), "options": _program_options(ctx),
            "sparse_attention_nodes": len(sparse_attention_nodes(gm.graph))}
    store = _get_default_store()
    # This rank's compilations of the group, counted in the store: a new default process group (a
    # new store) starts the count again, so a process that outlives one group (ranks kept between
    # runs, a server that re-initializes) never waits on a round its peers count differently.
    round_ = store.add(ROUND_KEY.format(group=ctx.group_name, rank=dist.get_rank()), 1)
    keys = [AGREEMENT_KEY.format(group=ctx.group_name, round=round_, rank=r) for r in ranks]
    store.set(keys[ranks.index(dist.get_rank())], json.dumps(mine))
    wait = group_timeout(group)
    try:
        store.wait(keys, wait)
    except Exception:  # noqa: BLE001 - the store's timeout error names no rank
        missing = [r for r, k in zip(range(len(ranks)), keys) if not store.check([k])]
        return [f"ranks {missing} of the DCP group did not reach compilation {round_} of this group within "
                f"{wait.total_seconds():g} s (the process group's timeout); every rank must compile the same "
                f"program (did a rank fail or hang earlier, or compile a different graph?)"]
    everyone = [json.loads(store.get(k)) for k in keys]
    problems = []
    for name in mine["options"]:
        values = [e["options"][name] for e in everyone]
        if len(set(values)) > 1:
            problems.append(f"option {name} differs across the DCP group ("
                            + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                            + "); every rank must compile with the same options")
    counts = [e["sparse_attention_nodes"] for e in everyone]
    if len(set(counts)) > 1:
        problems.append("the ranks compiled different programs: sparse attention nodes per rank "
                        f"{dict(enumerate(counts))}; every rank must run the same model step")
    hosts = [e["host"] for e in everyone]
    if not ctx.options.allow_multi_host and len(set(hosts)) > 1:
        problems.append(f"the DCP group spans {len(set(hosts))} hosts ({sorted(set(hosts))}); every layer merges "
                        f"over it, so it belongs inside one host's fast interconnect. Set allow_multi_host=True "
                        f"to compile it anyway")
    return problems
