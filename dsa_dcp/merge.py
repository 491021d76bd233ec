"""The merge modes: the runtime pieces the DCP rewrite's nodes call, and the table of strategies
(``MERGES``) that says what each mode emits, needs and moves.

Each is plain torch, elementwise or a reshape (no host sync), so it runs on CPU and GPU alike and
Inductor can trace it. The collectives between them are functional collectives
(``torch.ops._c10d_functional``) inserted as their own nodes, so they can be counted and fused.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
from torch import Tensor

from dsa_dcp.head_groups import pack_head_groups, unpack_head_groups
from dsa_dcp.ops import C10D, FUSED_A2A_MERGE, LSE_COMBINE



def split_gathered(gathered: Tensor, dcp_size: int) -> Tensor:
    """An all-gather's ``[N * B, ...]`` result as ``[N, B, ...]``."""
    return gathered.reshape(dcp_size, gathered.shape[0] // dcp_size, *gathered.shape[1:])


def rescale_for_reduce_scatter(out: Tensor, lse: Tensor, lse_all: Tensor, dcp_size: int) -> tuple[Tensor, Tensor]:
    """``ag_rs``: weight this rank's ``out[B, H, D]`` by ``exp(lse - lse_global)``, laid out for a
    reduce-scatter over head groups (``[N, B, H/N, D]``, float32), plus the global LSE ``[B, H]``.

    ``lse_all[N, B, H]`` is every rank's LSE. The ``lse_combine`` rule: only ``lse = -inf`` is an
    empty shard (its ``out`` is selected away). A NaN LSE makes the global LSE and every non-empty
    rank's weight NaN; a ``+inf`` LSE makes the global LSE ``+inf`` and its own rank's weight NaN
    (``exp(inf - inf)``); a NaN in a non-empty shard's ``out`` stays NaN whatever its weight.
    Either way the reduce-scatter's sum is NaN there, as ``lse_combine``'s would be. A row empty
    everywhere has global LSE ``-inf`` and output 0.
    """
    lse_global = torch.logsumexp(lse_all.float(), dim=0)  # NaN beats +inf beats finite; all -inf gives -inf
    mine = lse.float()
    weight = torch.exp(mine - lse_global)
    empty = (mine == float("-inf")).unsqueeze(-1)
    scaled = torch.where(empty, torch.zeros((), dtype=torch.float32, device=out.device),
                         out.float() * weight.unsqueeze(-1))
    b, h, d = out.shape
    g = h // dcp_size
    return scaled.reshape(b, dcp_size, g, d).transpose(0, 1).contiguous(), lse_global


def head_slice(t: Tensor, dcp_size: int, rank: int) -> Tensor:
    """Heads ``[rank * H/N, (rank + 1) * H/N)`` of ``t[B, H, ...]``."""
    g = t.shape[1] // dcp_size
    return t[:, rank * g : (rank + 1) * g]


def finish_reduce_scatter(reduced: Tensor, lse_global: Tensor, like: Tensor, dcp_size: int, rank: int) -> tuple[Tensor, Tensor]:
    """``ag_rs``: the reduce-scatter's ``[1, B, H/N, D]`` float32 sum -> ``(out[B, H/N, D], lse[B, H/N])``
    for this rank's heads, in the attention output's dtype."""
    return reduced.squeeze(0).to(like.dtype), head_slice(lse_global, dcp_size, rank)


# --------------------------------------------------------------------------- merge strategies
#
# A merge mode is one object: the nodes it emits after a layer's local attention, what it needs of
# the layer (head-sharded merges need H % N == 0 and an epilogue to shard), and what it moves. The
# DCP rewrite, validation and the inspection tool read these; nothing else tests the mode's name.


@dataclasses.dataclass(frozen=True)
class MergeSite:
    """What a strategy needs to know to emit one layer's merge."""

    dcp_size: int
    rank: int
    group_name: str
    head_dim: int


@dataclasses.dataclass(frozen=True)
class MergeStrategy:
    """One merge mode (``options.merge``).

    ``emit(emit, out_r, lse_r, site)`` inserts the merge of this rank's ``(out_r[B, H, D], lse_r[B, H])``
    through ``emit`` (a ``passes.fx.Emitter``) and returns the node of the merged ``(out, lse)``
    tuple: all ``H`` heads, or only this rank's head group when ``head_sharded``.
    ``collectives``: data-moving collectives it adds per layer (a fused merge counts as one; the
    head-sharded epilogue's all-reduce is not counted here). ``symmetric_memory``: on CUDA it needs a
    symmetric-memory workspace for the group. ``sent_bytes(b, h, d, n, elem)``: bytes one rank sends per
    layer, ``elem`` the output's element size (the LSE travels as float32).
    """

    name: str
    head_sharded: bool
    collectives: int
    emit: Callable[..., Any]
    sent_bytes: Callable[[int, int, int, int, int], int]
    symmetric_memory: bool = False
    summary: str = ""
    all_gathers: bool = False  # it all-gathers (a gloo group cannot do that for CUDA tensors)


def _wait(emit, node):
    return emit(C10D.wait_tensor.default, node)


def _emit_all_gather(emit, out_r, lse_r, site: MergeSite):
    packed = emit(pack_head_groups, out_r, lse_r, 1)
    recv = _wait(emit, emit(C10D.all_gather_into_tensor.default, packed, site.dcp_size, site.group_name))
    parts = emit(unpack_head_groups, recv, site.head_dim)
    return emit(LSE_COMBINE, emit(operator.getitem, parts, 0), emit(operator.getitem, parts, 1))


def _emit_all_to_all(emit, out_r, lse_r, site: MergeSite):
    n = site.dcp_size
    packed = emit(pack_head_groups, out_r, lse_r, n)
    recv = _wait(emit, emit(C10D.all_to_all_single.default, packed, [1] * n, [1] * n, site.group_name))
    parts = emit(unpack_head_groups, recv, site.head_dim)
    return emit(LSE_COMBINE, emit(operator.getitem, parts, 0), emit(operator.getitem, parts, 1))


def _emit_ag_rs(emit, out_r, lse_r, site: MergeSite):
    n = site.dcp_size
    gathered = _wait(emit, emit(C10D.all_gather_into_tensor.default, lse_r, n, site.group_name))
    lse_all = emit(split_gathered, gathered, n)
    scaled = emit(rescale_for_reduce_scatter, out_r, lse_r, lse_all, n)
    partial = emit(operator.getitem, scaled, 0)
    reduced = _wait(emit, emit(C10D.reduce_scatter_tensor.default, partial, "sum", n, site.group_name))
    return emit(finish_reduce_scatter, reduced, emit(operator.getitem, scaled, 1), out_r, n, site.rank)


def _emit_fused_a2a(emit, out_r, lse_r, site: MergeSite):
    return emit(FUSED_A2A_MERGE, out_r, lse_r, site.dcp_size, site.rank, site.group_name)


def _packed_bytes(b: int, h: int, d: int, elem: int) -> int:
    return b * h * (d * elem + 4)


MERGES: dict[str, MergeStrategy] = {s.name: s for s in (
    MergeStrategy(
        "ag", head_sharded=False, collectives=1, emit=_emit_all_gather, all_gathers=True,
        sent_bytes=lambda b, h, d, n, e: _packed_bytes(b, h, d, e) * (n - 1),
        summary="all-gather (out, lse), combine: every rank gets all H heads"),
    MergeStrategy(
        "a2a", head_sharded=True, collectives=1, emit=_emit_all_to_all,
        sent_bytes=lambda b, h, d, n, e: _packed_bytes(b, h, d, e) * (n - 1) // n,
        summary="all-to-all of (out, lse) by head group, combine: rank j gets head group j"),
    MergeStrategy(
        "ag_rs", head_sharded=True, collectives=2, emit=_emit_ag_rs, all_gathers=True,
        sent_bytes=lambda b, h, d, n, e: b * h * 4 * (n - 1) + b * h * d * 4 * (n - 1) // n,
        summary="all-gather the LSE, rescale, reduce-scatter the output over head groups"),
    MergeStrategy(
        "fused_a2a", head_sharded=True, collectives=1, emit=_emit_fused_a2a, symmetric_memory=True,
        sent_bytes=lambda b, h, d, n, e: _packed_bytes(b, h, d, e) * (n - 1) // n,
        summary="pack, exchange and combine in one kernel per layer (symmetric memory on CUDA; the "
                "composed a2a elsewhere)"),
)}


def host_gather_problem(gathers: list[str]) -> str | None:
    """The refusal of a CUDA step over a gloo group that would all-gather (``gathers``: what would:
    layers whose merge ``all_gathers``, the sharded index cache's agreement, ``debug_checks``).
    gloo's all-gather of CUDA tensors ends the process with a segmentation fault (torch 2.11, on an
    H200: the functional ``all_gather_into_tensor`` of a float32 tensor, two ranks); ``a2a``'s
    all-to-all and all-reduce run there."""
    if not gathers:
        return None
    return (f"this step all-gathers CUDA tensors over a gloo group ({', '.join(gathers)}), and gloo's all-gather "
            f"of CUDA tensors crashes the process; use merge='a2a' (with index_cache='replicated'), or an NCCL group "
            f"(one GPU per rank)")
