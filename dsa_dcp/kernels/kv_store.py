"""KV store: write new KV rows into the (local) cache at their slots.

Contract (both implementations):

``kv_store(cache[S, D], slots[B] int32|int64, rows[B, D]) -> None`` — in place,
``cache[slots[i]] = rows[i]`` (cast to the cache dtype) for every ``slots[i] >= 0``; negative
slots are skipped. Slots are rows of *this* cache (already localized, see
:func:`dsa_dcp.slots.localize_slots`). Two rows with the same non-negative slot are a contract
violation (which one lands is unspecified). A slot ``>= S`` is a contract violation too: the
reference raises, the Triton kernel skips it rather than write out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TRITON_FLOAT_DTYPES, check_float, check_index, check_launchable, check_same_device, next_pow2

_OP = "kv_store"


def _check(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    check_float(_OP, "cache", cache, 2)
    check_index(_OP, "slots", slots, 1)
    check_float(_OP, "rows", rows, 2)
    if rows.shape[0] != slots.shape[0]:
        raise ValueError(f"{_OP}: rows has {rows.shape[0]} rows but slots has {slots.shape[0]}")
    if rows.shape[1] != cache.shape[1]:
        raise ValueError(f"{_OP}: rows width {rows.shape[1]} != cache width {cache.shape[1]}")
    check_same_device(_OP, cache=cache, slots=slots, rows=rows)


def kv_store_reference(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain-torch KV store (see module docstring)."""
    _check(cache, slots, rows)
    keep = slots >= 0
    cache[slots[keep].long()] = rows[keep].to(cache.dtype)


@triton.jit
def _kv_store_kernel(
    cache_ptr,
    slots_ptr,
    rows_ptr,
    S,
    D,
    stride_cache_s,
    stride_cache_d,
    stride_rows,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    ok = (slot >= 0) & (slot < S)
    slot = tl.where(ok, slot, 0)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        m = tl.where(ok, offs < D, False)  # not `& ok`: the interpreter cannot `&` a block with a scalar
        v = tl.load(rows_ptr + i * stride_rows + offs, mask=m, other=0.0)
        dst = cache_ptr + slot * stride_cache_s + offs * stride_cache_d
        tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=m)


def kv_store_triton(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, *, block_d: int | None = None
) -> None:
    """Triton KV store, one program per row, masked store for skipped slots. No host sync.

    ``cache`` is written in place and may be a strided view (it is never copied).
    """
    _check(cache, slots, rows)
    for name, t in (("cache", cache), ("rows", rows)):
        if t.dtype not in TRITON_FLOAT_DTYPES:
            raise ValueError(f"{_OP}: {name} dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {t.dtype}")
    B, D = rows.shape
    if B == 0 or D == 0:
        return
    check_launchable(_kv_store_kernel, cache, slots, rows)
    block = block_d or min(next_pow2(D), 1024)
    if block & (block - 1):
        raise ValueError(f"{_OP}: block_d must be a power of two, got {block}")
    rows_c = rows.contiguous()
    _kv_store_kernel[(B,)](
        cache, slots.contiguous(), rows_c, cache.shape[0], D, cache.stride(0), cache.stride(1), rows_c.stride(0),
        BLOCK_D=block,
    )
