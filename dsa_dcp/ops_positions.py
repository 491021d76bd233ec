"""Ops over position-indexed caches: the op vocabulary for models that keep KV per request.

``dsa_dcp.ops`` serves models written for a paged slot pool (``kv[S, D]``). Models written
elsewhere keep their caches per request, indexed by position:

- DeepSeek's published inference code: ``kv_cache[B, T, Dc]`` and ``pe_cache[B, T, Dr]``
  (absorbed MLA), written ``cache[:b, start:end] = x``;
- Hugging Face transformers: per-head expanded ``keys[B, H, T, Dk]`` and ``values[B, H, T, Dv]``,
  written ``keys.index_copy_(2, positions, k)``.

The recognition pass (``passes/recognize_attention.py``) rewrites the attention these models
write (dense scores masked to the top-k, softmax, weighted sum) into the ops below, so the DCP
passes handle them like ``sparse_mla``. Contracts (single-rank meaning):

``position_store(cache, positions[P], rows, dim)``
    In place: ``cache[:rows.shape[0]].select(dim, positions[i]) = rows.select(dim, i)`` for every
    ``positions[i] >= 0``; negative positions are skipped. ``rows`` has the cache's shape except
    ``P`` along ``dim`` (>= 1) and at most the cache's batch rows along dim 0.

``sparse_mla_positions(q_nope[R, H, Dc], q_pe[R, H, Dr], [kv[B, T, Dc], pe[B, T, Dr]], topk[R, K], sm_scale) -> (out[R, H, Dc], lse[R, H])``
    ``sparse_mla`` over the flat slot pool ``slot = b * T + p`` of the two caches: key
    ``cat(kv[b, p], pe[b, p])``, value ``kv[b, p]``.

``sparse_mha_positions(q_nope[R, H, Dn], q_pe[R, H, Dr], [k[B, H, T, Dn + Dr], v[B, H, T, Dv]], topk[R, K], sm_scale) -> (out[R, H, Dv], lse[R, H])``
    Per-head attention over the same flat pool: head ``h`` of row ``r`` scores
    ``cat(q_nope, q_pe)[r, h] . k[b, h, p]`` and averages ``v[b, h, p]``.

On CUDA both run Triton kernels (``kernels/sparse_positions.py``) that read the named rows in
place; elsewhere the references below.

For both attention ops: ``topk`` entries are flat slots ``b * T + p`` (``T`` is the cache's
position length), negative entries are skipped; ``lse`` is float32, natural log; a row with no
valid entry gives ``out = 0``, ``lse = -inf``; a NaN in a query or in a cached row the top-k names
gives that row NaN ``out`` and NaN ``lse``. The softmax is computed in float32.

Under DCP a rank's cache holds the positions it owns (position ``p`` on rank ``(p // I) % N`` at
local position ``local_row(p)``, ``dsa_dcp.slots``) and ``T`` is a multiple of ``N * I``, so the
flat slot ``b * T + p`` is owned by the owner of ``p`` and sits at local flat slot
``b * T / N + local_row(p)``: ``topk_remap`` of the global flat slots gives exactly the rank's
local flat slots, and the same op runs on the rank's cache (``docs/models.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsa_dcp.ops import SPARSE_ATTENTION_OPS, SparseAttentionSpec

__all__ = ["position_store_reference", "sparse_mla_positions_reference", "sparse_mha_positions_reference",
           "POSITION_STORE", "SPARSE_MLA_POSITIONS", "SPARSE_MHA_POSITIONS", "POSITION_ATTENTION_OPS"]


# --------------------------------------------------------------------------- position_store


def _check_store(cache: Tensor, positions: Tensor, rows: Tensor, dim: int) -> None:
    ok = (positions.dim() == 1 and rows.dim() == cache.dim() and 1 <= dim < cache.dim()
          and rows.shape[dim] == positions.shape[0] and rows.shape[0] <= cache.shape[0]
          and all(rows.shape[d] == cache.shape[d] for d in range(1, cache.dim()) if d != dim))
    if not ok:
        raise ValueError(f"position_store: want positions [P], rows shaped like cache {tuple(cache.shape)} with P "
                         f"along dim {dim} (>= 1) and at most {cache.shape[0]} rows along dim 0; got positions "
                         f"{tuple(positions.shape)}, rows {tuple(rows.shape)}")


def position_store_reference(cache: Tensor, positions: Tensor, rows: Tensor, dim: int) -> None:
    """Plain-torch ``position_store`` (see module docstring), with no host sync and no data-dependent
    shape, so a CUDA graph captures it: a skipped entry writes again what the first kept entry writes
    (or, with none kept, position 0 its own value), so every target gets one value, deterministically."""
    _check_store(cache, positions, rows, dim)
    target = cache.narrow(0, 0, rows.shape[0])
    index = positions.long()
    keep = index >= 0
    first = keep.int().argmax()  # the first kept entry (0 when none is)
    any_kept = keep.any()
    index = torch.where(keep, index, torch.where(any_kept, index[first], 0))
    stand_in = torch.where(any_kept, rows.select(dim, first).to(cache.dtype), target.select(dim, 0))
    shape = [1] * rows.dim()
    shape[dim] = -1
    values = torch.where(keep.view(shape), rows.to(cache.dtype), stand_in.unsqueeze(dim))
    target.index_copy_(dim, index, values)


@torch.library.custom_op("dsa_dcp::position_store", mutates_args=("cache",))
def position_store(cache: Tensor, positions: Tensor, rows: Tensor, dim: int) -> None:
    position_store_reference(cache, positions, rows, dim)


@position_store.register_fake
def _position_store_fake(cache: Tensor, positions: Tensor, rows: Tensor, dim: int) -> None:
    _check_store(cache, positions, rows, dim)


# --------------------------------------------------------------------------- attention


def _check_attention(name: str, q_nope: Tensor, q_pe: Tensor, caches: list[Tensor], topk: Tensor,
                     per_head: bool) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"{name}: q_nope and q_pe must be [R, H, D] with equal [R, H], got "
                         f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    if topk.dim() != 2 or topk.shape[0] != q_nope.shape[0] or topk.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: topk must be int32/int64 [R, K] with R = {q_nope.shape[0]}, got "
                         f"{topk.dtype} {tuple(topk.shape)}")
    if len(caches) != 2:
        raise ValueError(f"{name}: caches must be a list of two tensors, got {len(caches)}")
    a, b = caches
    dn, dr, h = q_nope.shape[2], q_pe.shape[2], q_nope.shape[1]
    if per_head:
        ok = (a.dim() == 4 and b.dim() == 4 and a.shape[:3] == b.shape[:3] and a.shape[1] == h
              and a.shape[3] == dn + dr)
        want = f"k [B, {h}, T, {dn + dr}] and v [B, {h}, T, Dv]"
    else:
        ok = a.dim() == 3 and b.dim() == 3 and a.shape[:2] == b.shape[:2] and a.shape[2] == dn and b.shape[2] == dr
        want = f"kv [B, T, {dn}] and pe [B, T, {dr}]"
    if not ok:
        raise ValueError(f"{name}: caches must be {want}; got {tuple(a.shape)} and {tuple(b.shape)}")


def _decode_slots(topk: Tensor, positions: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flat slots -> (valid, batch row, position), invalid entries pointing at (0, 0)."""
    idx = topk.long()
    valid = idx >= 0
    idx = idx.clamp(min=0)
    return valid, torch.div(idx, positions, rounding_mode="floor"), idx % positions


def _attend(scores: Tensor, values: Tensor, valid: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Softmax of ``scores[R, H, K]`` over the ``valid[R, K]`` entries, applied to ``values[R, H, K, D]``
    (or ``[R, K, D]``, shared by the heads). Empty rows give ``(0, -inf)``; NaN propagates."""
    neg_inf = torch.full((), -math.inf, dtype=scores.dtype, device=scores.device)
    scores = torch.where(valid[:, None, :], scores, neg_inf)
    has = valid.any(dim=-1)[:, None]  # [R, 1]
    if scores.shape[-1] == 0:
        m = torch.full(scores.shape[:2], -math.inf, dtype=scores.dtype, device=scores.device)
    else:
        m = scores.amax(dim=-1)  # NaN stays NaN
    m_safe = torch.where(has, m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe[..., None])  # 0 at skipped entries
    total = p.sum(dim=-1)
    denom = torch.where(has, total, torch.ones_like(total))
    eq = "rhk,rhkd->rhd" if values.dim() == 4 else "rhk,rkd->rhd"
    out = torch.einsum(eq, p, values) / denom[..., None]
    lse = torch.where(has, m_safe + torch.log(denom), torch.full_like(total, -math.inf))
    return out.to(out_dtype), lse.to(torch.float32)


def sparse_mla_positions_reference(q_nope: Tensor, q_pe: Tensor, caches: list[Tensor], topk: Tensor, sm_scale: float,
                                   compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Plain-torch ``sparse_mla_positions``: gathers only the named rows (no copy of the cache)."""
    _check_attention("sparse_mla_positions", q_nope, q_pe, caches, topk, per_head=False)
    kv, pe = caches
    valid, b, p = _decode_slots(topk, kv.shape[1])
    # skipped entries gathered (0, 0): zero them so a NaN there cannot leak through 0 * NaN
    zero = torch.zeros((), dtype=compute_dtype, device=kv.device)
    rows_kv = torch.where(valid[..., None], kv[b, p].to(compute_dtype), zero)  # [R, K, Dc]
    rows_pe = torch.where(valid[..., None], pe[b, p].to(compute_dtype), zero)  # [R, K, Dr]
    scores = (torch.einsum("rhd,rkd->rhk", q_nope.to(compute_dtype), rows_kv)
              + torch.einsum("rhd,rkd->rhk", q_pe.to(compute_dtype), rows_pe)) * sm_scale
    return _attend(scores, rows_kv, valid, q_nope.dtype)


def sparse_mha_positions_reference(q_nope: Tensor, q_pe: Tensor, caches: list[Tensor], topk: Tensor, sm_scale: float,
                                   compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Plain-torch ``sparse_mha_positions``: gathers only the named positions of every head."""
    _check_attention("sparse_mha_positions", q_nope, q_pe, caches, topk, per_head=True)
    k, v = caches
    valid, b, p = _decode_slots(topk, k.shape[2])
    zero = torch.zeros((), dtype=compute_dtype, device=k.device)
    # k[b, :, p] with b, p [R, K]: advanced indices around a slice -> [R, K, H, D]
    keys = torch.where(valid[..., None, None], k[b, :, p].to(compute_dtype), zero).transpose(1, 2)  # [R, H, K, D]
    vals = torch.where(valid[..., None, None], v[b, :, p].to(compute_dtype), zero).transpose(1, 2)
    q = torch.cat([q_nope, q_pe], dim=-1).to(compute_dtype)
    scores = torch.einsum("rhd,rhkd->rhk", q, keys) * sm_scale
    return _attend(scores, vals, valid, q_nope.dtype)


@torch.library.custom_op("dsa_dcp::sparse_mla_positions", mutates_args=())
def sparse_mla_positions(q_nope: Tensor, q_pe: Tensor, caches: list[Tensor], topk: Tensor,
                         sm_scale: float) -> tuple[Tensor, Tensor]:
    return sparse_mla_positions_reference(q_nope, q_pe, caches, topk, sm_scale)


@sparse_mla_positions.register_kernel("cuda")
def _sparse_mla_positions_cuda(q_nope, q_pe, caches, topk, sm_scale):
    from dsa_dcp.kernels.sparse_positions import sparse_mla_positions_triton

    _check_attention("sparse_mla_positions", q_nope, q_pe, caches, topk, per_head=False)
    return sparse_mla_positions_triton(q_nope, q_pe, caches, topk, sm_scale)


@sparse_mla_positions.register_fake
def _sparse_mla_positions_fake(q_nope, q_pe, caches, topk, sm_scale):
    _check_attention("sparse_mla_positions", q_nope, q_pe, caches, topk, per_head=False)
    r, h, _ = q_nope.shape
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((r, h), dtype=torch.float32)


@torch.library.custom_op("dsa_dcp::sparse_mha_positions", mutates_args=())
def sparse_mha_positions(q_nope: Tensor, q_pe: Tensor, caches: list[Tensor], topk: Tensor,
                         sm_scale: float) -> tuple[Tensor, Tensor]:
    return sparse_mha_positions_reference(q_nope, q_pe, caches, topk, sm_scale)


@sparse_mha_positions.register_kernel("cuda")
def _sparse_mha_positions_cuda(q_nope, q_pe, caches, topk, sm_scale):
    from dsa_dcp.kernels.sparse_positions import sparse_mha_positions_triton

    _check_attention("sparse_mha_positions", q_nope, q_pe, caches, topk, per_head=True)
    return sparse_mha_positions_triton(q_nope, q_pe, caches, topk, sm_scale)


@sparse_mha_positions.register_fake
def _sparse_mha_positions_fake(q_nope, q_pe, caches, topk, sm_scale):
    _check_attention("sparse_mha_positions", q_nope, q_pe, caches, topk, per_head=True)
    r, h, _ = q_nope.shape
    return q_nope.new_empty((r, h, caches[1].shape[-1])), q_nope.new_empty((r, h), dtype=torch.float32)


POSITION_STORE = torch.ops.dsa_dcp.position_store.default
SPARSE_MLA_POSITIONS = torch.ops.dsa_dcp.sparse_mla_positions.default
SPARSE_MHA_POSITIONS = torch.ops.dsa_dcp.sparse_mha_positions.default

for _op, _impl in ((SPARSE_MLA_POSITIONS, sparse_mla_positions_reference),
                   (SPARSE_MHA_POSITIONS, sparse_mha_positions_reference)):
    SPARSE_ATTENTION_OPS[_op] = SparseAttentionSpec(name=_op._schema.name.split("::")[1], op=_op, impl=_impl,
                                                    lse_base="e", empty_lse="-inf", cache_layout="positions")

# The caches of these ops are position caches: ``args[2]`` is their list, localized by
# ``passes/recognize_attention.py``; their writes by ``localize_kv_writes`` with the slot caches'.
POSITION_ATTENTION_OPS = (SPARSE_MLA_POSITIONS, SPARSE_MHA_POSITIONS)
