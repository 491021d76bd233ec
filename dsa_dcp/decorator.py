"""``@dsa_dcp.sparse_attention``: a model author's own sparse attention as a rewritable graph node.

The decorated function must meet the ``sparse_mla`` contract (see ``dsa_dcp.ops``)::

    fn(q_nope[B, H, Dc], q_pe[B, H, Dr], kv[S, Dc + Dr], topk[B, K], sm_scale: float) -> (out[B, H, Dc], lse[B, H])

It may return its LSE in base 2 (``lse_base="2"``) and leave ``+inf`` or NaN in the LSE of rows
with no valid slot (``empty_lse=...``); the op wrapping it normalizes to natural-log LSE and
``(0, -inf)`` empty rows (``dsa_dcp.ops.normalize_attention_result``). Empty rows are the rows
whose top-k has no valid slot, and rows whose LSE is ``-inf``; the declared mark is never looked
for elsewhere. On a row that has a valid slot, a NaN or ``+inf`` LSE is a result (a NaN or an
infinity in the query or the KV rows it read) and stays as it is: were it taken for "empty", a DCP
merge would drop that rank's shard and give a finite answer where the single-rank model gives
NaN. So a NaN mark and a NaN from corrupt KV can never be confused.

The function becomes a ``torch.library`` custom op listed in ``SPARSE_ATTENTION_OPS``, so the DCP
passes rewrite it exactly like the built-in op: on a rank, it is called with that rank's local KV
cache and remapped top-k, so it must skip ``-1`` entries (which the contract requires).

The contract is checked while dynamo traces the model: the fake implementation runs the function
on the fake inputs and raises ``SparseAttentionContractError`` for a wrong output structure,
shape or dtype, so a broken function fails at compile time. Functions that cannot run on fake
tensors (data-dependent shapes) are checked on their first real call instead.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from typing import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from dsa_dcp.ops import (
    SPARSE_ATTENTION_OPS,
    SparseAttentionSpec,
    _sparse_mla_fake_outputs,
    check_sparse_mla_inputs,
    normalize_attention_result,
)

log = logging.getLogger(__name__)

LSE_BASES = ("e", "2")
EMPTY_LSE_MARKS = ("-inf", "+inf", "nan")
_op_ids = itertools.count()


class SparseAttentionContractError(ValueError):
    """A decorated sparse attention function does not meet the ``sparse_mla`` contract."""


def _check_result(name: str, result: object, q_nope: Tensor) -> tuple[Tensor, Tensor]:
    b, h, dc = q_nope.shape
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(t, Tensor) for t in result)):
        got = "one tensor" if isinstance(result, Tensor) else type(result).__name__
        raise SparseAttentionContractError(
            f"@sparse_attention function {name!r} must return (out, lse), two tensors; got {got}"
        )
    out, lse = result
    if tuple(out.shape) != (b, h, dc):
        raise SparseAttentionContractError(
            f"@sparse_attention function {name!r}: out must have shape [B, H, Dc] = {[b, h, dc]}, got {list(out.shape)}"
        )
    if tuple(lse.shape) != (b, h):
        raise SparseAttentionContractError(
            f"@sparse_attention function {name!r}: lse must have shape [B, H] = {[b, h]}, got {list(lse.shape)}"
        )
    if not (out.is_floating_point() and lse.is_floating_point()):
        raise SparseAttentionContractError(
            f"@sparse_attention function {name!r}: out and lse must be floating point, got {out.dtype} and {lse.dtype}"
        )
    return out, lse


def sparse_attention(
    fn: Callable | None = None, *, lse_base: str = "e", empty_lse: str = "-inf", name: str | None = None
):
    """Mark ``fn`` as a single-rank sparse attention implementation (see module docstring).

    Usable bare (``@sparse_attention``) or with arguments
    (``@sparse_attention(lse_base="2", empty_lse="+inf")``). Returns a callable that invokes the
    registered op; ``.op`` is the ``OpOverload``, ``.spec`` its ``SparseAttentionSpec``,
    ``.reference`` the original function.
    """
    if lse_base not in LSE_BASES:
        raise ValueError(f"sparse_attention: lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if empty_lse not in EMPTY_LSE_MARKS:
        raise ValueError(f"sparse_attention: empty_lse must be one of {EMPTY_LSE_MARKS}, got {empty_lse!r}")
    if fn is None:
        return functools.partial(sparse_attention, lse_base=lse_base, empty_lse=empty_lse, name=name)

    label = name or getattr(fn, "__qualname__", "fn")
    op_name = f"user_{re.sub(r'[^0-9A-Za-z_]', '_', label)}_{next(_op_ids)}"

    def impl(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float) -> tuple[Tensor, Tensor]:
        check_sparse_mla_inputs(q_nope, q_pe, kv, topk)
        out, lse = _check_result(label, fn(q_nope, q_pe, kv, topk, sm_scale), q_nope)
        out, lse = normalize_attention_result(out.to(q_nope.dtype), lse, topk, lse_base)
        return out, lse

    def fake(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float) -> tuple[Tensor, Tensor]:
        check_sparse_mla_inputs(q_nope, q_pe, kv, topk)
        try:
            result = fn(q_nope, q_pe, kv, topk, sm_scale)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            log.debug("%s cannot run on fake tensors (%s); its outputs are checked when it runs", label, e)
        else:
            _check_result(label, result, q_nope)
        return _sparse_mla_fake_outputs(q_nope)

    custom = torch.library.custom_op(f"dsa_dcp::{op_name}", impl, mutates_args=())
    custom.register_fake(fake)
    overload = getattr(torch.ops.dsa_dcp, op_name).default
    spec = SparseAttentionSpec(name=label, op=overload, impl=fn, lse_base=lse_base, empty_lse=empty_lse)
    SPARSE_ATTENTION_OPS[overload] = spec

    @functools.wraps(fn)
    def call(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float) -> tuple[Tensor, Tensor]:
        return overload(q_nope, q_pe, kv, topk, sm_scale)

    call.op = overload
    call.spec = spec
    call.reference = fn
    return call
