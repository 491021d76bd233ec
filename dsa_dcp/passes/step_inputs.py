"""``debug_checks``: check at the start of every DCP step that every rank was given the same inputs.

A DCP group runs one model: every rank must be fed the same step inputs (token ids, positions,
request ids, slots, page table) every step. A rank fed a different token computes its share of the
attention for another sequence, and the merges mix it into every rank's result: finite, wrong
logits on every rank, with nothing to notice (the top-k check agrees whenever the contexts are
shorter than the top-k).

Expects: any DCP graph (it runs last and only inserts). Leaves, with ``debug_checks=True``, one
``check_step_inputs(inputs, names, N, group)`` call right after the placeholders, before any other
node and so before the step's first collective. Its inputs are the step's tensor inputs but the
weights (``nn.Parameter``), the model's buffers (its own state: under tensor or expert parallelism a
rank may hold its own share of one) and the caches (a KV or index cache, a position cache, or any
input the step writes in place: state that is split over the group, or derived from earlier steps'
inputs, which this check covered then). Each is named by where dynamo found it (``L['input_ids']``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsa_dcp.debug_checks import check_step_inputs
from dsa_dcp.kv_cache import is_index_cache, kv_layout
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.fx import Emitter, alias_base, mutated_args, placeholder_values
from dsa_dcp.position_cache import PositionShardedCache


def input_name(node: fx.Node) -> str:
    """How the user knows a graph input: dynamo's source (``L['input_ids']``), else the node's name."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    try:
        name = source.name if source is not None else None  # a property in torch 2.13, a method before
        name = name() if callable(name) else name
    except Exception:  # noqa: BLE001 - a source without a printable name
        name = None
    return name if isinstance(name, str) else node.name


def step_inputs(gm: fx.GraphModule, example_inputs: tuple) -> list[fx.Node]:
    """The placeholders every rank must be given alike (module docstring), in graph order."""
    written = {alias_base(a) for node in gm.graph.nodes for a in mutated_args(node)}
    found = []
    for node, value in placeholder_values(gm, example_inputs).items():
        if not isinstance(value, torch.Tensor) or isinstance(value, (torch.nn.Parameter, PositionShardedCache)):
            continue
        if node in written or kv_layout(value) is not None or is_index_cache(value):
            continue
        if any(part in input_name(node) for part in ("._buffers[", "._parameters[")):
            continue  # the model's own state, as its weights: under TP or EP a rank may hold its own share
        found.append(node)
    return found


@dataclasses.dataclass
class StepInputsPlan(Plan):
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)


class StepInputs(DCPPass):
    name = "step_inputs"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> StepInputsPlan:
        """The step inputs to compare (nothing to refuse: the check happens when the step runs)."""
        return StepInputsPlan(inputs=step_inputs(gm, ctx.example_inputs))

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: StepInputsPlan) -> dict:
        graph = gm.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            Emitter(graph).opaque(check_step_inputs, list(plan.inputs), [input_name(n) for n in plan.inputs], ctx.dcp_size,
                           ctx.group_name)
        return {"step_inputs_checked": [input_name(n) for n in plan.inputs]}
