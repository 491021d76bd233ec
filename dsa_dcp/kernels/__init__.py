"""Triton kernels and their plain-torch references (same contract, same module).

Each op has ``<op>_reference`` (torch, any device) and ``<op>_triton`` (CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1`` set before this package is imported); the sharded index
cache's agreement is plain torch only. Which one runs is the op layer's choice (``dsa_dcp.ops``
registers each ``_triton`` as the op's CUDA kernel; ``sparse_mla`` picks its backend from the
measured table, :mod:`.dispatch`). Contracts: each module's docstring and docs/kernels.md.
"""

from .index_scores import index_scores_reference, index_scores_triton
from .kv_store import kv_store_reference, kv_store_triton
from .lse_combine import lse_combine_reference, lse_combine_triton
from .sparse_mla import sparse_mla_reference, sparse_mla_triton
from .topk_agree import (
    topk_agree_reference,
    topk_agree_remap_reference,
    topk_candidates_reference,
    topk_candidates_triton,
)
from .topk_remap import topk_remap_reference, topk_remap_triton
from .topk_select import (
    topk_select_reference,
    topk_select_remap_reference,
    topk_select_remap_triton,
    topk_select_triton,
)

__all__ = [
    "index_scores_reference", "index_scores_triton",
    "kv_store_reference", "kv_store_triton",
    "lse_combine_reference", "lse_combine_triton",
    "sparse_mla_reference", "sparse_mla_triton",
    "topk_agree_reference", "topk_agree_remap_reference",
    "topk_candidates_reference", "topk_candidates_triton",
    "topk_remap_reference", "topk_remap_triton",
    "topk_select_reference", "topk_select_triton",
    "topk_select_remap_reference", "topk_select_remap_triton",
]  # fmt: skip
