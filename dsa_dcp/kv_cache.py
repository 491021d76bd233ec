"""The allocation path for KV caches: each rank allocates only the rows it owns.

The KV cache exists before ``torch.compile`` sees the model, so its size under DCP is decided
here, when the model is built: ``allocate_kv_cache(num_slots, dim, dcp_size=N)`` returns a cache
of ``local_cache_rows(num_slots, N, I)`` rows and records its layout. The DCP rewrite looks the
layout up (``kv_layout(tensor)``) and refuses a cache allocated for another DCP size (a global
cache on a DCP rank, or the reverse) or one it knows nothing about.

The indexer's key cache is allocated by ``allocate_index_cache``: whole (``[S, dim]`` on every
rank, ``index_cache="replicated"``) or, ``sharded=True``, like a KV cache (this rank's rows, its
layout recorded: ``index_cache="sharded"``). Either way it is recorded as an index cache
(``is_index_cache``), so the backend can tell the two kinds apart and refuse a mismatch with the
``index_cache`` option.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dsa_dcp.slots import local_cache_rows


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How a KV cache tensor maps global slots to its rows."""

    num_slots: int  # global slot pool size S
    dcp_size: int
    interleave: int

    @property
    def rows(self) -> int:
        return local_cache_rows(self.num_slots, self.dcp_size, self.interleave)


_layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()


def allocate_kv_cache(
    num_slots: int,
    dim: int,
    *,
    dcp_size: int = 1,
    interleave: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed ``[local_cache_rows(num_slots, dcp_size, interleave), dim]`` cache with its layout recorded."""
    layout = KVLayout(num_slots=num_slots, dcp_size=dcp_size, interleave=interleave)
    cache = torch.zeros(layout.rows, dim, dtype=dtype, device=device)
    _layouts[cache] = layout
    return cache


def kv_layout(cache: torch.Tensor) -> KVLayout | None:
    """The layout ``cache`` was allocated with (``None`` if it did not come from ``allocate_kv_cache``)."""
    return _layouts.get(cache)


_index_caches: WeakIdKeyDictionary = WeakIdKeyDictionary()


def allocate_index_cache(
    num_slots: int,
    dim: int,
    *,
    dcp_size: int = 1,
    interleave: int = 1,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed index-key cache: ``[num_slots, dim]`` (replicated), or with ``sharded=True`` and
    ``dcp_size > 1`` the ``local_cache_rows(num_slots, dcp_size, interleave)`` rows this rank owns,
    with its layout recorded as ``allocate_kv_cache`` does (its writes are then localized)."""
    if sharded and dcp_size > 1:
        cache = allocate_kv_cache(num_slots, dim, dcp_size=dcp_size, interleave=interleave, dtype=dtype,
                                  device=device)
    else:
        cache = torch.zeros(num_slots, dim, dtype=dtype, device=device)
    _index_caches[cache] = True
    return cache


def allocate_block_scales(cache: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """Zeroed fp32 scales of an FP8 cache written with per-128-column scales (``kv_store``'s
    ``block_scales``): ``[rows, ceil(D / 128)]``, or ``[rows]`` with ``per_row`` (an index key's one
    scale a token, ``D <= 128``). They have the cache's rows (its local rows under DCP: the same
    localized slots index both), so they need no layout of their own."""
    groups = -(-cache.shape[1] // 128)
    if per_row and groups != 1:
        raise ValueError(f"one scale a row needs a row of at most 128 columns, got {cache.shape[1]}")
    shape = (cache.shape[0],) if per_row else (cache.shape[0], groups)
    return torch.zeros(shape, dtype=torch.float32, device=cache.device)


def is_index_cache(cache: object) -> bool:
    """``cache`` came from ``allocate_index_cache`` (sharded when it also has a ``kv_layout``)."""
    return isinstance(cache, torch.Tensor) and cache in _index_caches


def bytes_per_token(caches: list[torch.Tensor]) -> float:
    """Bytes of these caches per global slot on this rank (``sum(rows * row_bytes) / S``)."""
    total = 0.0
    for cache in caches:
        layout = kv_layout(cache)
        num_slots = layout.num_slots if layout is not None else cache.shape[0]
        total += cache.numel() * cache.element_size() / num_slots
    return total
