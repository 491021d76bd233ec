"""The wire layout of the head-sharded merges: a rank's ``(out, lse)`` packed by head group.

``pack_head_groups`` puts head group ``j`` of ``out[B, H, D]`` and its float32 LSE (bit-cast into
``lse_words`` trailing elements of the output's dtype) into slice ``j`` of one tensor, so one
all-to-all (or all-gather) moves both; ``unpack_head_groups`` reads what arrived. The merge
strategies (``merge.py``) and the composed reference of the fused merge op (``ops.py``) share it.
``gather_query_heads`` is the other direction, for layers that hold a TP shard of the heads: the
DCP group's query heads, laid out so that head group ``j`` is rank ``j``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lse_words(dtype: torch.dtype) -> int:
    """How many elements of ``dtype`` hold one float32 LSE when packed beside the output."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def pack_head_groups(out: Tensor, lse: Tensor, dcp_size: int) -> Tensor:
    """``out[B, H, D]``, ``lse[B, H]`` -> ``[N, B, H/N, D + w]``: slice j (head group j) goes to rank j.

    The float32 LSE is bit-cast into ``w = lse_words(out.dtype)`` trailing elements, so one
    all-to-all moves both.
    """
    b, h, d = out.shape
    g = h // dcp_size
    out_g = out.reshape(b, dcp_size, g, d).transpose(0, 1)
    # bit-cast before the transpose (a view of the row-major LSE), so the cat is the one copy
    lse_g = lse.float().reshape(b, dcp_size, g, 1).view(out.dtype).transpose(0, 1)
    return torch.cat([out_g, lse_g], dim=-1)


def unpack_head_groups(received: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """``[N, B, G, D + w]`` received from the N ranks -> ``(out[N, B, G, D], lse[N, B, G])``."""
    out = received[..., :head_dim]
    lse = received[..., head_dim:].contiguous().view(torch.float32).squeeze(-1)
    return out, lse


def gather_query_heads(gathered: Tensor, dcp_size: int) -> Tensor:
    """An all-gather's ``[N * B, G, D]`` (rank ``j``'s ``[B, G, D]`` query heads at rows ``j*B``) as
    ``[B, N * G, D]``: rank ``j``'s heads become head group ``j``, the group ``pack_head_groups``
    sends back to rank ``j``."""
    b = gathered.shape[0] // dcp_size
    return gathered.reshape(dcp_size, b, *gathered.shape[1:]).transpose(0, 1).reshape(
        b, dcp_size * gathered.shape[1], *gathered.shape[2:])
