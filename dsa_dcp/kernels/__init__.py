"""Triton kernels and their plain-torch references (same contract, same module).

Each op has ``<op>_reference`` (torch, any device) and ``<op>_triton`` (CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1`` set before this package is imported). The dispatchers
``topk_remap``, ``lse_combine``, ``kv_store`` and the indexer's ``index_scores``, ``topk_select``
and ``topk_select_remap`` (module :mod:`.indexer`) pick the Triton kernel for CUDA tensors and the
reference otherwise. ``sparse_mla`` has no dispatcher here: the op layer chooses its backend from the measured table
(:mod:`dsa_dcp.kernels.dispatch`).
Contracts: each module's docstring and docs/kernels.md.
"""

from __future__ import annotations

import torch

from .indexer import (
    index_scores_reference,
    index_scores_triton,
    topk_select_reference,
    topk_select_remap_reference,
    topk_select_remap_triton,
    topk_select_triton,
)
from .kv_store import kv_store_reference, kv_store_triton
from .lse_combine import lse_combine_reference, lse_combine_triton
from .sparse_mla import sparse_mla_reference, sparse_mla_triton
from .topk_remap import topk_remap_reference, topk_remap_triton

__all__ = [
    "index_scores",
    "index_scores_reference",
    "index_scores_triton",
    "kv_store",
    "kv_store_reference",
    "kv_store_triton",
    "lse_combine",
    "lse_combine_reference",
    "lse_combine_triton",
    "sparse_mla_reference",
    "sparse_mla_triton",
    "topk_remap",
    "topk_remap_reference",
    "topk_remap_triton",
    "topk_select",
    "topk_select_reference",
    "topk_select_remap",
    "topk_select_remap_reference",
    "topk_select_remap_triton",
    "topk_select_triton",
]


def topk_remap(
    topk: torch.Tensor, dcp_size: int, rank: int, interleave: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k remap by device: Triton on CUDA, the torch reference elsewhere."""
    fn = topk_remap_triton if topk.is_cuda else topk_remap_reference
    return fn(topk, dcp_size, rank, interleave)


def lse_combine(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE combine by device: Triton on CUDA, the torch reference elsewhere."""
    fn = lse_combine_triton if out.is_cuda else lse_combine_reference
    return fn(out, lse)


def kv_store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """KV store by device: Triton on CUDA, the torch reference elsewhere."""
    fn = kv_store_triton if cache.is_cuda else kv_store_reference
    fn(cache, slots, rows)


def index_scores(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size: int) -> torch.Tensor:
    """Indexer scores by device: Triton on CUDA, the torch reference elsewhere."""
    fn = index_scores_triton if q.is_cuda else index_scores_reference
    return fn(q, w, index_cache, key_scale, page_table, req_ids, positions, page_size)


def topk_select(scores, k: int, page_table=None, req_ids=None, page_size: int = 1) -> torch.Tensor:
    """Top-k selection by device: Triton on CUDA, the torch reference elsewhere."""
    fn = topk_select_triton if scores.is_cuda else topk_select_reference
    return fn(scores, k, page_table, req_ids, page_size)


def topk_select_remap(scores, k: int, dcp_size: int, rank: int, interleave: int = 1, page_table=None, req_ids=None,
                      page_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection fused with the remap by device: Triton on CUDA, the torch reference elsewhere."""
    fn = topk_select_remap_triton if scores.is_cuda else topk_select_remap_reference
    return fn(scores, k, dcp_size, rank, interleave, page_table, req_ids, page_size)
