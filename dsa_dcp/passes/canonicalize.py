"""Canonicalize: one spelling for every call of the op vocabulary.

Expects: dynamo's graph as the model wrote it. A model may call an op through its packet
(``torch.ops.dsa_dcp.sparse_mla(...)``) or its overload (``torch.ops.dsa_dcp.sparse_mla.default``),
with arguments by position or by name.
Leaves: every call of a ``dsa_dcp`` op (built-in or ``@sparse_attention``-decorated) targets its
overload, with every argument by position, so the other passes match one form. It changes no
value and cannot refuse a graph; it runs first, before validation.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsa_dcp.ops import SPARSE_ATTENTION_OPS
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan


def vocabulary_namespaces() -> set[str]:
    """The namespaces whose ops the passes read: ``dsa_dcp`` and those of decorated functions."""
    return {"dsa_dcp"} | {op.namespace for op in SPARSE_ATTENTION_OPS}


def _overload(target: object, namespaces: set[str]) -> torch._ops.OpOverload | None:
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace = target._qualified_op_name.split("::")[0]
        if namespace in namespaces and target.overloads() == ["default"]:
            return target.default
        return None
    if isinstance(target, torch._ops.OpOverload) and target.namespace in namespaces:
        return target
    return None


def positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple | None:
    """``args`` and ``kwargs`` of a call of ``op`` as positional arguments (``None`` if they do not bind)."""
    out, kwargs = list(args), dict(kwargs)
    for arg in op._schema.arguments[len(args):]:
        if arg.name in kwargs:
            out.append(kwargs.pop(arg.name))
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            return None
    return tuple(out) if not kwargs else None


@dataclasses.dataclass
class CanonicalPlan(Plan):
    calls: list[tuple[fx.Node, torch._ops.OpOverload, tuple]] = dataclasses.field(default_factory=list)


class Canonicalize(DCPPass):
    name = "canonicalize"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> CanonicalPlan:
        """The calls to respell (it never refuses: a call that does not bind is left for the op to report)."""
        namespaces = vocabulary_namespaces()
        plan = CanonicalPlan()
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            op = _overload(node.target, namespaces)
            if op is None or (op is node.target and not node.kwargs):
                continue
            args = positional(op, node.args, node.kwargs)
            if args is not None:
                plan.calls.append((node, op, args))
        return plan

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: CanonicalPlan) -> dict:
        for node, op, args in plan.calls:
            node.target, node.args, node.kwargs = op, args, {}
        return {"calls_canonicalized": len(plan.calls)}
