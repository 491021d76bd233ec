"""The op vocabulary: the graph nodes the DCP passes find and rewrite.

Each op is a ``torch.library`` custom op, so dynamo records it as one node, its fake
implementation gives output metadata during tracing, and in-place writes are declared. The
contracts (single-rank meaning) are written once here and in ``docs/ops.md``:

``kv_store(cache[S, D], slots[B], rows[B, D], kv_scale=None)``
    In place ``cache[slots[i]] = rows[i]``; negative slots are skipped. No host sync on CUDA. An
    FP8 cache is written quantized with ``kv_scale``, or, with one scale per 128 columns, by
    ``kv_store_block_scaled(cache, slots, rows, block_scales)`` (docs/ops.md, "FP8 KV").

``sparse_mla(q_nope[B, H, Dc], q_pe[B, H, Dr], kv[S, Dc + Dr], topk[B, K], sm_scale) -> (out[B, H, Dc], lse[B, H])``
    Softmax attention of each row over the KV rows named in ``topk`` (negative entries skipped;
    the value is the first ``Dc`` columns). ``lse`` is float32, natural log. A row with no valid
    slot returns ``out = 0``, ``lse = -inf``. Any other row is the dense softmax over its named
    rows, NaN included: a NaN in the query or in a named KV row gives NaN ``out`` and ``lse``,
    never "empty"; infinities give what torch's softmax and logsumexp give.

``topk_remap(topk[B, K], dcp_size, rank, interleave) -> (local[B, K] int32, count[B] int32)``
    Keeps the slots ``rank`` owns, as local rows, compacted to the front in order; tail ``-1``.

``lse_combine(out[N, B, H, D], lse[N, B, H]) -> (out[B, H, D], lse[B, H])``
    Log-sum-exp merge of ``N`` partial results. Only ``lse = -inf`` marks an empty shard (its
    ``out`` is never read); all-empty gives ``0`` and ``-inf``. A NaN ``lse`` or a NaN in a
    non-empty shard's ``out`` makes the merged result NaN there; a ``+inf`` ``lse`` gives
    ``lse = +inf`` and NaN ``out``. So DCP shows the NaN the single-rank model shows.

Every sparse attention op (the built-in ``sparse_mla`` and each function decorated with
``@dsa_dcp.sparse_attention``) is listed in ``SPARSE_ATTENTION_OPS``; that table is how the passes
recognize attention nodes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import Tensor

from dsa_dcp.head_groups import pack_head_groups, unpack_head_groups
from dsa_dcp import kernels
from dsa_dcp.kernels.kv_store import check_scales

LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class SparseAttentionSpec:
    """What the passes need to know about one sparse attention op."""

    name: str
    op: torch._ops.OpOverload
    impl: Callable[..., tuple[Tensor, Tensor]]
    lse_base: str  # "e" or "2": the base the implementation returns; the op normalizes to e
    # what the implementation leaves in the LSE of a row with no valid slot: "-inf", "+inf" or
    # "nan". Such rows are found from the top-k, never from this value (normalize_attention_result).
    empty_lse: str
    # "slots": args[2] is one flat slot cache (localize_kv_writes); "positions": a list of
    # position caches (ops_positions.py, localized by passes/recognize_attention.py)
    cache_layout: str = "slots"


SPARSE_ATTENTION_OPS: dict[torch._ops.OpOverload, SparseAttentionSpec] = {}


# --------------------------------------------------------------------------- boundary checks


def check_sparse_mla_inputs(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor) -> None:
    """Shape/dtype contract of ``sparse_mla``; raises ``ValueError`` naming the broken rule."""
    if q_nope.dim() != 3 or q_pe.dim() != 3:
        raise ValueError(f"sparse_mla: q_nope and q_pe must be [B, H, D], got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    if q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"sparse_mla: q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} differ in [B, H]")
    if kv.dim() != 2 or kv.shape[1] != q_nope.shape[2] + q_pe.shape[2]:
        raise ValueError(
            f"sparse_mla: kv must be [S, Dc + Dr] = [S, {q_nope.shape[2] + q_pe.shape[2]}], got {tuple(kv.shape)}"
        )
    if topk.dim() != 2 or topk.shape[0] != q_nope.shape[0]:
        raise ValueError(f"sparse_mla: topk must be [B, K] with B = {q_nope.shape[0]}, got {tuple(topk.shape)}")
    if topk.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla: topk must be int32 or int64 slot ids, got {topk.dtype}")


def _sparse_mla_fake_outputs(q_nope: Tensor) -> tuple[Tensor, Tensor]:
    b, h, _ = q_nope.shape
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((b, h), dtype=torch.float32)


# --------------------------------------------------------------------------- kv_store


# Two ops, one contract (dsa_dcp/kernels/kv_store.py): the per-128-column scales are a second
# written argument, so they get their own op with every argument required (an omitted optional
# argument that an op writes breaks torch 2.11's in-place bookkeeping of custom ops).


@torch.library.custom_op("dsa_dcp::kv_store", mutates_args=("cache",))
def kv_store(cache: Tensor, slots: Tensor, rows: Tensor, kv_scale: float | None = None) -> None:
    kernels.kv_store_reference(cache, slots, rows, kv_scale)


@kv_store.register_kernel("cuda")
def _kv_store_cuda(cache: Tensor, slots: Tensor, rows: Tensor, kv_scale: float | None = None) -> None:
    kernels.kv_store_triton(cache, slots, rows, kv_scale)


@kv_store.register_fake
def _kv_store_fake(cache: Tensor, slots: Tensor, rows: Tensor, kv_scale: float | None = None) -> None:
    _check_kv_store(cache, slots, rows, kv_scale, None)


@torch.library.custom_op("dsa_dcp::kv_store_block_scaled", mutates_args=("cache", "block_scales"))
def kv_store_block_scaled(cache: Tensor, slots: Tensor, rows: Tensor, block_scales: Tensor) -> None:
    kernels.kv_store_reference(cache, slots, rows, None, block_scales)


@kv_store_block_scaled.register_kernel("cuda")
def _kv_store_block_scaled_cuda(cache: Tensor, slots: Tensor, rows: Tensor, block_scales: Tensor) -> None:
    kernels.kv_store_triton(cache, slots, rows, None, block_scales)


@kv_store_block_scaled.register_fake
def _kv_store_block_scaled_fake(cache: Tensor, slots: Tensor, rows: Tensor, block_scales: Tensor) -> None:
    _check_kv_store(cache, slots, rows, None, block_scales)


def _check_kv_store(cache: Tensor, slots: Tensor, rows: Tensor, kv_scale, block_scales) -> None:
    if slots.dim() != 1 or rows.dim() != 2 or rows.shape[0] != slots.shape[0] or rows.shape[1] != cache.shape[1]:
        raise ValueError(
            f"kv_store: want cache [S, D], slots [B], rows [B, D]; got {tuple(cache.shape)}, "
            f"{tuple(slots.shape)}, {tuple(rows.shape)}"
        )
    check_scales("kv_store", cache, kv_scale, block_scales)


# --------------------------------------------------------------------------- sparse_mla


@torch.library.custom_op("dsa_dcp::sparse_mla", mutates_args=())
def sparse_mla(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float,
               kv_scale: float | None = None, block_scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return kernels.sparse_mla_reference(q_nope, q_pe, kv, topk, sm_scale, kv_scale, block_scales=block_scales)


@sparse_mla.register_kernel("cuda")
def _sparse_mla_cuda(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float,
                     kv_scale: float | None = None, block_scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    from dsa_dcp.kernels import dispatch, flashinfer_mla, sparse_mla_hopper

    if block_scales is not None:  # per-128-column FP8 scales: the Triton kernel dequantizes them on load
        choice = dispatch.choose(q_nope.shape[1], q_nope.shape[0], topk.shape[1], kv.dtype, q_nope.device)
        return kernels.sparse_mla_triton(q_nope, q_pe, kv, topk, sm_scale, block_scales=block_scales,
                                         **(choice.tiles if choice is not None else {}))
    # The measured table (kernels/dispatch.py) picks per shape: uncaptured, the fastest op among
    # Triton, the Hopper kernel and FlashInfer (plan and index packing included); inside a
    # CUDA-graph capture the faster of Triton and Hopper in a graph (FlashInfer plans on the host).
    # A backend that cannot run here falls back to the Triton kernel; no table entry: Triton.
    # FP8 KV (kv_scale) runs on Triton or Hopper, which read the scale; FlashInfer is not offered it;
    # per-128 block scales (above) run on Triton only.
    B, H, _ = q_nope.shape
    choice = dispatch.choose(H, B, topk.shape[1], kv.dtype, q_nope.device)
    backend = dispatch.runnable_backend(
        choice,
        torch.cuda.is_current_stream_capturing(),
        flashinfer_ok=lambda: kv_scale is None and flashinfer_mla.available()
        and flashinfer_mla.supports(q_nope, q_pe, kv),
        hopper_ok=lambda: sparse_mla_hopper.available(q_nope.device) and sparse_mla_hopper.supports(q_nope, q_pe, kv),
    )
    if backend in ("fa2", "fa3"):
        return flashinfer_mla.sparse_mla_flashinfer(q_nope, q_pe, kv, topk, sm_scale, backend=backend)
    if backend == "hopper":
        return sparse_mla_hopper.sparse_mla_hopper(q_nope, q_pe, kv, topk, sm_scale, kv_scale, **choice.hopper_tiles)
    if choice is not None:  # the table's tiles, so the kernel need not look them up again
        return kernels.sparse_mla_triton(q_nope, q_pe, kv, topk, sm_scale, kv_scale, **choice.tiles)
    return kernels.sparse_mla_triton(q_nope, q_pe, kv, topk, sm_scale, kv_scale)


@sparse_mla.register_fake
def _sparse_mla_fake(q_nope: Tensor, q_pe: Tensor, kv: Tensor, topk: Tensor, sm_scale: float,
                     kv_scale: float | None = None, block_scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    check_sparse_mla_inputs(q_nope, q_pe, kv, topk)
    check_scales("sparse_mla", kv, kv_scale, block_scales, "kv")
    return _sparse_mla_fake_outputs(q_nope)


SPARSE_ATTENTION_OPS[torch.ops.dsa_dcp.sparse_mla.default] = SparseAttentionSpec(
    name="sparse_mla",
    op=torch.ops.dsa_dcp.sparse_mla.default,
    impl=kernels.sparse_mla_reference,
    lse_base="e",
    empty_lse="-inf",
)


# --------------------------------------------------------------------------- topk_remap


@torch.library.custom_op("dsa_dcp::topk_remap", mutates_args=())
def topk_remap(topk: Tensor, dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    return kernels.topk_remap_reference(topk, dcp_size, rank, interleave)


@topk_remap.register_kernel("cuda")
def _topk_remap_cuda(topk: Tensor, dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    return kernels.topk_remap_triton(topk, dcp_size, rank, interleave)


@topk_remap.register_fake
def _topk_remap_fake(topk: Tensor, dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    if topk.dim() != 2:
        raise ValueError(f"topk_remap: topk must be [B, K], got {tuple(topk.shape)}")
    if not (dcp_size >= 1 and 0 <= rank < dcp_size and interleave >= 1):
        raise ValueError(f"topk_remap: need dcp_size >= 1, 0 <= rank < dcp_size, interleave >= 1; got {dcp_size}, {rank}, {interleave}")
    return (
        topk.new_empty(topk.shape, dtype=torch.int32),
        topk.new_empty(topk.shape[:1], dtype=torch.int32),
    )


# --------------------------------------------------------------------------- lse_combine


@torch.library.custom_op("dsa_dcp::lse_combine", mutates_args=())
def lse_combine(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    return kernels.lse_combine_reference(out, lse)


@lse_combine.register_kernel("cuda")
def _lse_combine_cuda(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    return kernels.lse_combine_triton(out, lse)


@lse_combine.register_fake
def _lse_combine_fake(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    if out.dim() != 4 or lse.shape != out.shape[:3]:
        raise ValueError(f"lse_combine: want out [N, B, H, D] and lse [N, B, H]; got {tuple(out.shape)}, {tuple(lse.shape)}")
    return out.new_empty(out.shape[1:]), lse.new_empty(lse.shape[1:], dtype=torch.float32)


# --------------------------------------------------------------------------- fused_a2a_merge


def _composed_a2a_merge(out: Tensor, lse: Tensor, dcp_size: int, group_name: str) -> tuple[Tensor, Tensor]:
    c10d = torch.ops._c10d_functional
    packed = pack_head_groups(out, lse, dcp_size)
    split = [1] * dcp_size
    received = c10d.wait_tensor(c10d.all_to_all_single(packed, split, split, group_name))
    parts_out, parts_lse = unpack_head_groups(received, out.shape[-1])
    return torch.ops.dsa_dcp.lse_combine(parts_out, parts_lse)


@torch.library.custom_op("dsa_dcp::fused_a2a_merge", mutates_args=())
def fused_a2a_merge(out: Tensor, lse: Tensor, dcp_size: int, rank: int, group_name: str) -> tuple[Tensor, Tensor]:
    """``a2a`` merge as one node: head group ``rank`` of every rank's ``(out, lse)``, LSE-combined.

    The default implementation is the composed reference (pack, all-to-all, combine) over the
    group, so it runs on gloo; on CUDA one fused kernel does it when the group has a workspace.
    """
    return _composed_a2a_merge(out, lse, dcp_size, group_name)


@fused_a2a_merge.register_kernel("cuda")
def _fused_a2a_merge_cuda(out: Tensor, lse: Tensor, dcp_size: int, rank: int, group_name: str) -> tuple[Tensor, Tensor]:
    from dsa_dcp.kernels import fused_merge

    ws = fused_merge.workspace_for(group_name, out, dcp_size, rank)
    if ws is None:
        return _composed_a2a_merge(out, lse, dcp_size, group_name)
    return fused_merge.fused_a2a_merge_triton(out, lse.float(), ws)


@fused_a2a_merge.register_fake
def _fused_a2a_merge_fake(out: Tensor, lse: Tensor, dcp_size: int, rank: int, group_name: str) -> tuple[Tensor, Tensor]:
    b, h, d = out.shape
    if h % dcp_size:
        raise ValueError(f"fused_a2a_merge: {h} heads are not divisible by dcp_size={dcp_size}")
    return out.new_empty((b, h // dcp_size, d)), lse.new_empty((b, h // dcp_size), dtype=torch.float32)


# --------------------------------------------------------------------------- normalization


def normalize_attention_result(out: Tensor, lse: Tensor, topk: Tensor, lse_base: str) -> tuple[Tensor, Tensor]:
    """Bring an implementation's ``(out, lse)`` to the ``sparse_mla`` convention.

    Converts base-2 LSE to natural log and sets the empty rows to ``out = 0``, ``lse = -inf``. A
    row is empty when its top-k has no valid slot (whatever the implementation returned there:
    its declared ``empty_lse`` mark, or anything else) or when its LSE is ``-inf`` (the op's own
    empty mark). Every other row is kept as it is: a NaN or ``+inf`` LSE on a row that has a
    valid slot is an attention result (a NaN or an infinity in the query or the KV rows), never
    an empty mark, so that a DCP merge cannot drop it and give a finite answer where the
    single-rank model gives NaN. So ``empty_lse="nan"`` or ``"+inf"`` only says what the rows
    without slots hold; the top-k finds them. Elementwise: no sync.
    """
    lse = lse.float()
    if lse_base == "2":
        lse = lse * LN2
    empty = (lse == -math.inf) | (topk < 0).all(dim=-1, keepdim=True)
    lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    return out, lse


# --------------------------------------------------------------------------- op handles
# The one home of the overloads the passes, models and tools refer to.

KV_STORE = torch.ops.dsa_dcp.kv_store.default
KV_STORE_BLOCK_SCALED = torch.ops.dsa_dcp.kv_store_block_scaled.default
KV_STORES = (KV_STORE, KV_STORE_BLOCK_SCALED)  # a KV write: (cache, slots, rows, *scale)
SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default
TOPK_REMAP = torch.ops.dsa_dcp.topk_remap.default
LSE_COMBINE = torch.ops.dsa_dcp.lse_combine.default
FUSED_A2A_MERGE = torch.ops.dsa_dcp.fused_a2a_merge.default
C10D = torch.ops._c10d_functional


# =========================================================================== the lightning indexer
# (this section: index_scores, topk_select, topk_select_remap; contracts in dsa_dcp/kernels/index_scores.py,
# dsa_dcp/kernels/topk_select.py
# and docs/ops.md. Built from what the model computes: q after rope [T, Hi, Di], the scaled fp32
# head weights [T, Hi], its index cache and the step's page_table, req_ids, positions.)


@torch.library.custom_op("dsa_dcp::index_scores", mutates_args=())
def index_scores(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None, page_table: Tensor,
                 req_ids: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """``scores[T, C] = sum_h w[t, h] relu(q[t, h] . k[slot(t, p)])`` over valid candidates, ``-inf``
    elsewhere (``C = max_pages * page_size``); keys read through the page table."""
    return kernels.index_scores_reference(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)


@index_scores.register_kernel("cuda")
def _index_scores_cuda(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None, page_table: Tensor,
                       req_ids: Tensor, positions: Tensor, page_size: int) -> Tensor:
    return kernels.index_scores_triton(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)


@index_scores.register_fake
def _index_scores_fake(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None, page_table: Tensor,
                       req_ids: Tensor, positions: Tensor, page_size: int) -> Tensor:
    if q.dim() != 3 or w.shape != q.shape[:2] or index_cache.dim() != 2 or index_cache.shape[1] != q.shape[2]:
        raise ValueError(f"index_scores: want q [T, Hi, Di], w [T, Hi], index_cache [S, Di]; got {tuple(q.shape)}, "
                         f"{tuple(w.shape)}, {tuple(index_cache.shape)}")  # fmt: skip
    if page_table.dim() != 2 or req_ids.shape != q.shape[:1] or positions.shape != q.shape[:1] or page_size < 1:
        raise ValueError(f"index_scores: want page_table [R, max_pages], req_ids [T], positions [T], page_size >= 1; "
                         f"got {tuple(page_table.shape)}, {tuple(req_ids.shape)}, {tuple(positions.shape)}, {page_size}")
    return q.new_empty((q.shape[0], page_table.shape[1] * page_size), dtype=torch.float32)


def _check_topk_select_fake(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int, op: str) -> None:
    if scores.dim() != 2 or page_table.dim() != 2 or req_ids.shape != scores.shape[:1]:
        raise ValueError(f"{op}: want scores [T, C], page_table [R, max_pages], req_ids [T]; got "
                         f"{tuple(scores.shape)}, {tuple(page_table.shape)}, {tuple(req_ids.shape)}")
    if page_size < 1 or k < 0 or scores.shape[1] != page_table.shape[1] * page_size:
        raise ValueError(f"{op}: want C = max_pages * page_size, page_size >= 1, k >= 0; got C = {scores.shape[1]}, "
                         f"max_pages = {page_table.shape[1]}, page_size = {page_size}, k = {k}")


@torch.library.custom_op("dsa_dcp::topk_select", mutates_args=())
def topk_select(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int) -> Tensor:
    """The ``min(k, C)`` best candidates of each row as int32 global slots, in ascending candidate
    position, ``-1`` past the row's count (``-inf`` scores are never selected)."""
    return kernels.topk_select_reference(scores, k, page_table, req_ids, page_size)


@topk_select.register_kernel("cuda")
def _topk_select_cuda(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int) -> Tensor:
    return kernels.topk_select_triton(scores, k, page_table, req_ids, page_size)


@topk_select.register_fake
def _topk_select_fake(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int) -> Tensor:
    _check_topk_select_fake(scores, page_table, req_ids, page_size, k, "topk_select")
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dsa_dcp::topk_select_remap", mutates_args=())
def topk_select_remap(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int, dcp_size: int,
                      rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    """``topk_remap(topk_select(...), dcp_size, rank, interleave)`` in one op: this rank's local
    rows of the selected slots, compacted in the selection's order, and their count per row."""
    return kernels.topk_select_remap_reference(scores, k, dcp_size, rank, interleave, page_table, req_ids, page_size)


@topk_select_remap.register_kernel("cuda")
def _topk_select_remap_cuda(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int,
                            dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    return kernels.topk_select_remap_triton(scores, k, dcp_size, rank, interleave, page_table, req_ids, page_size)


@topk_select_remap.register_fake
def _topk_select_remap_fake(scores: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int,
                            dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    _check_topk_select_fake(scores, page_table, req_ids, page_size, k, "topk_select_remap")
    if not (dcp_size >= 1 and 0 <= rank < dcp_size and interleave >= 1):
        raise ValueError(f"topk_select_remap: need dcp_size >= 1, 0 <= rank < dcp_size, interleave >= 1; got "
                         f"{dcp_size}, {rank}, {interleave}")
    return (scores.new_empty((scores.shape[0], k), dtype=torch.int32),
            scores.new_empty(scores.shape[:1], dtype=torch.int32))


INDEX_SCORES = torch.ops.dsa_dcp.index_scores.default
TOPK_SELECT = torch.ops.dsa_dcp.topk_select.default
TOPK_SELECT_REMAP = torch.ops.dsa_dcp.topk_select_remap.default


# --------------------------------------------------------------------------- the sharded index cache
# (index_cache="sharded": each rank scores the candidates it owns; the group agrees on the top-k
# through one all-gather of every rank's best k. Contracts in dsa_dcp/kernels/topk_agree.py.)


@torch.library.custom_op("dsa_dcp::index_scores_sharded", mutates_args=())
def index_scores_sharded(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None, page_table: Tensor,
                         req_ids: Tensor, positions: Tensor, page_size: int, dcp_size: int, rank: int,
                         interleave: int) -> Tensor:
    """``index_scores`` over a rank's shard of the index cache: the candidates ``rank`` owns, read at
    their local rows; ``-inf`` for every other candidate."""
    return kernels.index_scores_reference(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size,
                                           shard=(dcp_size, rank, interleave))


@index_scores_sharded.register_kernel("cuda")
def _index_scores_sharded_cuda(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None,
                               page_table: Tensor, req_ids: Tensor, positions: Tensor, page_size: int,
                               dcp_size: int, rank: int, interleave: int) -> Tensor:
    return kernels.index_scores_triton(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size,
                                        shard=(dcp_size, rank, interleave))


@index_scores_sharded.register_fake
def _index_scores_sharded_fake(q: Tensor, w: Tensor, index_cache: Tensor, key_scale: Tensor | None,
                               page_table: Tensor, req_ids: Tensor, positions: Tensor, page_size: int,
                               dcp_size: int, rank: int, interleave: int) -> Tensor:
    if not (dcp_size >= 1 and 0 <= rank < dcp_size and interleave >= 1):
        raise ValueError(f"index_scores_sharded: need dcp_size >= 1, 0 <= rank < dcp_size, interleave >= 1; got "
                         f"{dcp_size}, {rank}, {interleave}")
    return _index_scores_fake(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)


@torch.library.custom_op("dsa_dcp::topk_candidates", mutates_args=())
def topk_candidates(scores: Tensor, k: int) -> Tensor:
    """This rank's best ``k`` candidates of each row as ``[T, k, 2]`` int32 (score bits, position)."""
    return kernels.topk_candidates_reference(scores, k)


@topk_candidates.register_kernel("cuda")
def _topk_candidates_cuda(scores: Tensor, k: int) -> Tensor:
    return kernels.topk_candidates_triton(scores, k)


@topk_candidates.register_fake
def _topk_candidates_fake(scores: Tensor, k: int) -> Tensor:
    if scores.dim() != 2 or k < 0:
        raise ValueError(f"topk_candidates: want scores [T, C] and k >= 0, got {tuple(scores.shape)}, {k}")
    return scores.new_empty((scores.shape[0], k, 2), dtype=torch.int32)


def _check_agree_fake(gathered: Tensor, page_table: Tensor, req_ids: Tensor, k: int, dcp_size: int, op: str) -> None:
    if gathered.dim() != 3 or gathered.shape[2] != 2 or page_table.dim() != 2 or k < 0 or dcp_size < 1 \
            or req_ids.shape[0] * dcp_size != gathered.shape[0]:
        raise ValueError(f"{op}: want gathered [N * T, k', 2], page_table [R, max_pages], req_ids [T], k >= 0; got "
                         f"{tuple(gathered.shape)}, {tuple(page_table.shape)}, {tuple(req_ids.shape)}, {k}, "
                         f"N = {dcp_size}")


@torch.library.custom_op("dsa_dcp::topk_agree", mutates_args=())
def topk_agree(gathered: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int, dcp_size: int) -> Tensor:
    """The group's top-k (``topk_select``'s slots) from every rank's gathered ``topk_candidates``."""
    return kernels.topk_agree_reference(gathered, page_table, req_ids, page_size, k, dcp_size)


@topk_agree.register_fake
def _topk_agree_fake(gathered: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int,
                     dcp_size: int) -> Tensor:
    _check_agree_fake(gathered, page_table, req_ids, k, dcp_size, "topk_agree")
    return gathered.new_empty((req_ids.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dsa_dcp::topk_agree_remap", mutates_args=())
def topk_agree_remap(gathered: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int, dcp_size: int,
                     rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    """``topk_remap(topk_agree(...), dcp_size, rank, interleave)`` in one op."""
    return kernels.topk_agree_remap_reference(gathered, page_table, req_ids, page_size, k, dcp_size, rank, interleave)


@topk_agree_remap.register_fake
def _topk_agree_remap_fake(gathered: Tensor, page_table: Tensor, req_ids: Tensor, page_size: int, k: int,
                           dcp_size: int, rank: int, interleave: int) -> tuple[Tensor, Tensor]:
    _check_agree_fake(gathered, page_table, req_ids, k, dcp_size, "topk_agree_remap")
    t = req_ids.shape[0]
    return gathered.new_empty((t, k), dtype=torch.int32), gathered.new_empty((t,), dtype=torch.int32)


INDEX_SCORES_SHARDED = torch.ops.dsa_dcp.index_scores_sharded.default
TOPK_CANDIDATES = torch.ops.dsa_dcp.topk_candidates.default
TOPK_AGREE = torch.ops.dsa_dcp.topk_agree.default
TOPK_AGREE_REMAP = torch.ops.dsa_dcp.topk_agree_remap.default
# a remap fused with the selection that feeds it: what the graph summary counts as a remap
FUSED_REMAPS = (TOPK_SELECT_REMAP, TOPK_AGREE_REMAP)


# =========================================================================== the pool's bounds (DCP step inputs)
# A DCP rank holds 1/N of the pool, so a global slot past the pool is not out of range on every
# rank: its owner may store it in a spare row of its cache (N * I not dividing S) or fail alone while
# its peers wait in the next collective. The DCP program therefore checks the step's global slot ids
# where they enter it, on every rank alike (the group feeds the same inputs), and raises the error
# the single-rank model raises (the IndexError of its first out-of-range index). On CUDA the check is
# a device-side assertion (``torch._assert_async``): no host sync, and every rank fails it alike.
# Each returns a copy of its input, which the program reads in its place, so no compiler drops it.


def past_the_pool(index: int, num_slots: int, detail: str) -> str:
    """The refusal of a slot id past the pool: torch's own indexing message first (what the
    single-rank model raises), then what held it."""
    return (f"index {index} is out of bounds for dimension 0 with size {num_slots}: {detail}, past the KV pool of "
            f"{num_slots} slots (every rank of the DCP group checks the step's global slots, so every rank raises "
            f"this)")


@torch.library.custom_op("dsa_dcp::check_slots", mutates_args=())
def check_slots(slots: Tensor, num_slots: int, what: str) -> Tensor:
    """``slots`` (global slot ids, any shape; negative: no slot), copied, after raising ``IndexError``
    when one is ``>= num_slots`` (``what`` names the tensor in the message: "the step's write slots")."""
    bad = (slots >= num_slots).reshape(-1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        s = int(slots.reshape(-1)[i])
        raise IndexError(past_the_pool(s, num_slots, f"slot {s} (entry {i} of {what})"))
    return slots.clone()


@check_slots.register_kernel("cuda")
def _check_slots_cuda(slots: Tensor, num_slots: int, what: str) -> Tensor:
    torch._assert_async((slots < num_slots).all(), f"dsa_dcp: a slot of {what} is past the KV pool of {num_slots} "
                                                   f"slots")
    return slots.clone()


@check_slots.register_fake
def _check_slots_fake(slots: Tensor, num_slots: int, what: str) -> Tensor:
    return torch.empty_like(slots)


def _request_pages(page_table: Tensor, req_ids: Tensor) -> Tensor:
    """``[T, max_pages]`` int64: the pages of each row's request (``-1`` for a row with no request),
    as ``kernels.indexer.candidate_slots`` reads them."""
    req = req_ids.to(torch.int64)
    if page_table.shape[0] == 0:
        return torch.full((req.shape[0], page_table.shape[1]), -1, dtype=torch.int64, device=page_table.device)
    pages = page_table.to(torch.int64).index_select(0, req.clamp(min=0))
    return torch.where((req >= 0)[:, None], pages, torch.full_like(pages, -1))


@torch.library.custom_op("dsa_dcp::check_pages", mutates_args=())
def check_pages(page_table: Tensor, req_ids: Tensor, page_size: int, num_slots: int) -> Tensor:
    """``page_table``, copied, after raising ``IndexError`` when a page of a request this step reads
    (``req_ids``) holds a slot ``>= num_slots``: the candidate slots the indexer gathers."""
    pages = _request_pages(page_table, req_ids)
    bad = (pages >= 0) & (pages * page_size + page_size > num_slots)
    if bool(bad.any()):
        t, j = (int(i) for i in bad.nonzero()[0])
        p = int(pages[t, j])
        first = max(p * page_size, num_slots)  # the first candidate past the pool, in candidate order
        raise IndexError(past_the_pool(first, num_slots, f"page {p} of request {int(req_ids[t])} (row {t} of the "
                                                         f"step, page {j} of its request) holds slots {p * page_size} "
                                                         f"to {p * page_size + page_size - 1}"))
    return page_table.clone()


@check_pages.register_kernel("cuda")
def _check_pages_cuda(page_table: Tensor, req_ids: Tensor, page_size: int, num_slots: int) -> Tensor:
    pages = _request_pages(page_table, req_ids)
    ok = ((pages < 0) | (pages * page_size + page_size <= num_slots)).all()
    torch._assert_async(ok, f"dsa_dcp: the page table holds a page past the KV pool of {num_slots} slots")
    return page_table.clone()


@check_pages.register_fake
def _check_pages_fake(page_table: Tensor, req_ids: Tensor, page_size: int, num_slots: int) -> Tensor:
    return torch.empty_like(page_table)


CHECK_SLOTS = torch.ops.dsa_dcp.check_slots.default
CHECK_PAGES = torch.ops.dsa_dcp.check_pages.default
