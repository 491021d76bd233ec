"""Runtime pieces of the merge modes, called from nodes the DCP rewrite inserts.

Each is plain torch, elementwise or a reshape (no host sync), so it runs on CPU and GPU alike and
Inductor can trace it. The collectives between them are functional collectives
(``torch.ops._c10d_functional``) inserted as their own nodes, so they can be counted and fused.
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
