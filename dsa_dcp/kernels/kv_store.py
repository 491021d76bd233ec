"""KV store: write new KV rows into the (local) cache at their slots, quantized for an FP8 cache.

Contract (both implementations):

``kv_store(cache[S, D], slots[B] int32|int64, rows[B, D], kv_scale=None, block_scales=None) -> None``
— in place, for every ``slots[i] >= 0``, ``cache[slots[i]] = rows[i]`` (cast to the cache dtype);
negative slots are skipped. Slots are rows of *this* cache (already localized, see
:func:`dsa_dcp.slots.localize_slots`). Two rows with the same non-negative slot are a contract
violation (which one lands is unspecified). A slot ``>= S`` is a contract violation too: the
reference raises, the Triton kernel skips it rather than write out of bounds.

FP8 E4M3 caches (``torch.float8_e4m3fn``): the rows (fp32/bf16/fp16, widened to fp32) are quantized,
with exactly one of

- ``kv_scale`` (a positive Python float, per tensor; the default form): ``cache[s] =
  e4m3(clamp(rows[i] * inv, -448, 448))`` with ``inv = fp32(1 / kv_scale)``; the real value is
  ``cache * kv_scale``. The scale is a constant of the cache (set when it is allocated, as serving
  engines load theirs from the checkpoint); nothing is written but the row.
- ``block_scales`` (fp32 ``[S, G]``, ``G = ceil(D / 128)``, or ``[S]`` when ``G == 1``: the per-token
  scale of an index key): per-128-column scales computed from the row, written at the same slot.
  Column group ``g`` (columns ``[128 g, 128 g + 128)``, the last one possibly shorter) gets the
  power-of-two scale ``2^e``, ``e`` the smallest integer with ``amax_g <= 448 * 2^e`` (``amax_g``
  the largest finite ``|value|`` of the group; ``e = 0`` when it is 0; ``e`` clamped to
  ``[-126, 127]``), and ``cache[s, cols_g] = e4m3(clamp(rows[i, cols_g] * 2^-e, -448, 448))``; the
  real value is ``cache * block_scales[s, g]``. A power of two makes the scaling exact, so the
  scales are the same bits on every device.

``e4m3`` rounds to nearest, ties to even (torch's conversion). Saturation: values beyond the range
(``+-inf`` included) become ``+-448``. NaN stays NaN (the E4M3 NaN with the value's sign bit,
``0x7F`` / ``0xFF``), and only
in its own column: a NaN or an infinity does not enter a group's ``amax``. The bytes depend on the
row alone, so a DCP rank writes the bytes the single-rank model writes for the rows it owns.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import TRITON_FLOAT_DTYPES, check_float, check_index, check_launchable, check_same_device, next_pow2

_OP = "kv_store"

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
E4M3_MAX = 448.0
FP8_GROUP = 128  # columns per block scale


def block_scale_groups(dim: int) -> int:
    """Column groups of a ``dim``-wide row: ``ceil(dim / 128)``."""
    return -(-dim // FP8_GROUP)


def inverse_scale(kv_scale: float) -> float:
    """``fp32(1 / kv_scale)``: the factor a per-tensor FP8 store multiplies the rows by."""
    return float(torch.tensor(1.0 / kv_scale, dtype=torch.float32))


def _check(cache, slots, rows, kv_scale=None, block_scales=None) -> None:
    check_float(_OP, "cache", cache, 2)
    check_index(_OP, "slots", slots, 1)
    check_float(_OP, "rows", rows, 2)
    if rows.shape[0] != slots.shape[0]:
        raise ValueError(f"{_OP}: rows has {rows.shape[0]} rows but slots has {slots.shape[0]}")
    if rows.shape[1] != cache.shape[1]:
        raise ValueError(f"{_OP}: rows width {rows.shape[1]} != cache width {cache.shape[1]}")
    check_same_device(_OP, cache=cache, slots=slots, rows=rows)
    check_scales(_OP, cache, kv_scale, block_scales)
    if cache.dtype in FP8_KV_DTYPES and rows.dtype in FP8_KV_DTYPES:
        raise ValueError(f"{_OP}: rows must be fp32, bf16 or fp16 (kv_store quantizes them), got {rows.dtype}")


def check_scales(op: str, cache: torch.Tensor, kv_scale, block_scales, what: str = "cache") -> None:
    """An FP8 ``cache`` has exactly one of ``kv_scale`` (positive float) or ``block_scales``
    (fp32 ``[S, ceil(D/128)]``, or ``[S]`` for one group); any other cache has neither."""
    if cache.dtype not in FP8_KV_DTYPES:
        if kv_scale is not None or block_scales is not None:
            raise ValueError(f"{op}: kv_scale and block_scales are only for an FP8 {what}, got {cache.dtype}")
        return
    if (kv_scale is None) == (block_scales is None):
        raise ValueError(f"{op}: an FP8 {what} needs exactly one of kv_scale (per tensor) or block_scales "
                         f"(per 128 columns), got kv_scale={kv_scale!r} and "
                         f"block_scales={None if block_scales is None else tuple(block_scales.shape)}")
    if kv_scale is not None:
        if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)) or not 0 < kv_scale < math.inf:
            raise ValueError(f"{op}: kv_scale must be a positive finite Python float, got {kv_scale!r}")
        return
    groups = block_scale_groups(cache.shape[1])
    shapes = [(cache.shape[0], groups)] + ([(cache.shape[0],)] if groups == 1 else [])
    if not isinstance(block_scales, torch.Tensor) or block_scales.dtype != torch.float32 \
            or tuple(block_scales.shape) not in shapes:
        raise ValueError(f"{op}: block_scales must be an fp32 tensor of shape "
                         f"{' or '.join(str(list(s)) for s in shapes)} (one scale per 128 columns of each row), "
                         f"got {block_scales.dtype if isinstance(block_scales, torch.Tensor) else block_scales!r} "
                         f"{tuple(block_scales.shape) if isinstance(block_scales, torch.Tensor) else ''}")
    check_same_device(op, cache=cache, block_scales=block_scales)


def quantize_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3, saturating to +-448 (NaN kept), round to nearest even."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def block_scale_exponents(y: torch.Tensor) -> torch.Tensor:
    """``[B, G]`` int32: the exponent ``e`` of each 128-column group's scale (module docstring)."""
    b, d = y.shape
    groups = block_scale_groups(d)
    a = y.abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    a = torch.nn.functional.pad(a, (0, groups * FP8_GROUP - d)).view(b, groups, FP8_GROUP)
    amax = a.amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 9 + (mantissa > E4M3_MAX / 512).to(exponent.dtype)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    return e.clamp(-126, 127).to(torch.int32)


def quantize_rows(rows: torch.Tensor, kv_scale: float | None = None, block: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(e4m3 rows, block scales [B, G] or None)``: what ``kv_store`` writes for ``rows``."""
    y = rows.float()
    if not block:
        inv = torch.tensor(inverse_scale(kv_scale), dtype=torch.float32, device=y.device)
        return quantize_e4m3(y * inv), None
    e = block_scale_exponents(y)
    one = torch.ones((), dtype=torch.float32, device=y.device)
    cols = torch.arange(y.shape[1], device=y.device) // FP8_GROUP
    inv = torch.ldexp(one, -e.to(torch.float32))[:, cols]  # exact powers of two
    return quantize_e4m3(y * inv), torch.ldexp(one, e.to(torch.float32))


def kv_store_reference(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, kv_scale: float | None = None,
                       block_scales: torch.Tensor | None = None) -> None:
    """Plain-torch KV store (see module docstring)."""
    _check(cache, slots, rows, kv_scale, block_scales)
    keep = slots >= 0
    index = slots[keep].long()
    if cache.dtype not in FP8_KV_DTYPES:
        cache[index] = rows[keep].to(cache.dtype)
        return
    values, scales = quantize_rows(rows[keep], kv_scale, block_scales is not None)
    cache[index] = values
    if scales is not None:
        block_scales[index] = scales.view(-1) if block_scales.dim() == 1 else scales


@triton.jit
def _sign_bit(v):
    """The sign bit (int32 0 or 1) of ``v`` as loaded (fp32, bf16 or fp16), a NaN's included: the
    GPU's arithmetic returns its canonical NaN, which is positive, whatever NaN went in."""
    if v.dtype == tl.float32:
        bits = v.to(tl.int32, bitcast=True)
    else:
        bits = v.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended: bit 31 is the sign
    return (bits >> 31) & 1


@triton.jit
def _e4m3_byte(y, sign):
    """fp32 ``y`` (``|y| <= 448`` or NaN) with the sign bit ``sign`` of the row's value it was scaled
    from -> the E4M3 byte as int32, round to nearest even (a NaN keeps the row's sign: ``0x7F`` or
    ``0xFF``). Integer and exact float arithmetic only, so it is the same on the GPU and under the
    interpreter (whose own fp8 cast rounds ties away and turns NaN into a number)."""
    bits = y.to(tl.int32, bitcast=True)
    ab = bits & 0x7FFFFFFF
    a = ab.to(tl.float32, bitcast=True)
    # normal range (|y| >= 2^-6): keep 3 mantissa bits, ties to even, carry into the exponent
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal range: multiples of 2^-9 (the byte is the multiple; 8 is 2^-6, the first normal)
    m = tl.where(a < 0.015625, a, 0.0) * 512.0
    low = tl.floor(m)
    low_i = low.to(tl.int32)
    frac = m - low
    up = tl.where(frac > 0.5, 1, tl.where(frac == 0.5, low_i & 1, 0))
    mag = tl.where(a >= 0.015625, normal, low_i + up)
    mag = tl.where(y != y, 0x7F, mag)
    return (sign << 7) | mag


@triton.jit
def _saturate(y):
    """Clamp to the E4M3 range, keeping NaN (comparisons with NaN are false)."""
    return tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))


@triton.jit
def _kv_store_kernel(
    cache_ptr,
    slots_ptr,
    rows_ptr,
    scales_ptr,
    S,
    D,
    inv_scale,
    stride_cache_s,
    stride_cache_d,
    stride_rows,
    stride_scales,
    stride_scales_g,
    MODE: tl.constexpr,  # 0: cast to the cache dtype, 1: FP8 per tensor, 2: FP8 per 128 columns
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
        if MODE == 0:
            tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=m)
        else:
            y = v.to(tl.float32)
            if MODE == 1:
                y = y * inv_scale
            else:  # BLOCK_D is the group: one power-of-two scale from the group's largest finite |value|
                a = tl.abs(y)
                a = tl.where((a == float("inf")) | (a != a), 0.0, a)
                amax = tl.max(a, axis=0)
                ab = amax.to(tl.int32, bitcast=True)
                e = (ab >> 23) - 135 + tl.where((ab & 0x7FFFFF) > 0x600000, 1, 0)
                e = tl.where(amax == 0.0, 0, e)
                e = tl.minimum(tl.maximum(e, -126), 127)
                y = y * ((127 - e) << 23).to(tl.float32, bitcast=True)
                scale = ((127 + e) << 23).to(tl.float32, bitcast=True)
                tl.store(scales_ptr + slot * stride_scales + (d0 // BLOCK_D) * stride_scales_g, scale, mask=ok)
            tl.store(dst, _e4m3_byte(_saturate(y), _sign_bit(v)).to(tl.uint8), mask=m)


def kv_store_triton(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, kv_scale: float | None = None,
    block_scales: torch.Tensor | None = None, *, block_d: int | None = None
) -> None:
    """Triton KV store, one program per row, masked store for skipped slots. No host sync.

    ``cache`` (and ``block_scales``) are written in place and may be strided views (never copied).
    An FP8 cache is written through a ``uint8`` view of it, byte by byte (``_e4m3_byte``).
    """
    _check(cache, slots, rows, kv_scale, block_scales)
    fp8 = cache.dtype in FP8_KV_DTYPES
    for name, t in (("cache", cache), ("rows", rows)):
        if t.dtype not in TRITON_FLOAT_DTYPES and not (fp8 and name == "cache"):
            raise ValueError(f"{_OP}: {name} dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {t.dtype}")
    B, D = rows.shape
    if B == 0 or D == 0:
        return
    check_launchable(_kv_store_kernel, cache, slots, rows)
    mode = 0 if not fp8 else (1 if kv_scale is not None else 2)
    block = FP8_GROUP if mode == 2 else (block_d or min(next_pow2(D), 1024))
    if block & (block - 1):
        raise ValueError(f"{_OP}: block_d must be a power of two, got {block}")
    rows_c = rows.contiguous()
    target = cache.view(torch.uint8) if fp8 else cache
    scales = block_scales if block_scales is not None else rows_c  # a placeholder pointer when unused
    strides = (block_scales.stride(0), block_scales.stride(-1)) if block_scales is not None else (0, 0)
    _kv_store_kernel[(B,)](
        target, slots.contiguous(), rows_c, scales, cache.shape[0], D,
        inverse_scale(kv_scale) if kv_scale is not None else 1.0,
        cache.stride(0), cache.stride(1), rows_c.stride(0), *strides,
        MODE=mode, BLOCK_D=block,
    )
