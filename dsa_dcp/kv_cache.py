"""The allocation path for KV caches: each rank allocates only the rows it owns.

The KV cache exists before ``torch.compile`` sees the model, so its size under DCP is decided
here, when the model is built: ``allocate_kv_cache(num_slots, dim, dcp_size=N)`` returns a cache
of ``local_cache_rows(num_slots, N, I)`` rows and records its layout. The DCP rewrite looks the
layout up (``kv_layout(tensor)``) and refuses a cache allocated for another DCP size (a global
cache on a DCP rank, or the reverse) or one it knows nothing about.
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


def bytes_per_token(caches: list[torch.Tensor]) -> float:
    """Bytes of these caches per global slot on this rank (``sum(rows * row_bytes) / S``)."""
    total = 0.0
    for cache in caches:
        layout = kv_layout(cache)
        num_slots = layout.num_slots if layout is not None else cache.shape[0]
        total += cache.numel() * cache.element_size() / num_slots
    return total
