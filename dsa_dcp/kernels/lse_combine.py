"""LSE combine: merge N partial attention results by their log-sum-exp.

Contract (both implementations):

``lse_combine(out[N, B, H, D], lse[N, B, H] float32) -> (out[B, H, D] (dtype of out), lse[B, H] float32)``

``lse = logsumexp_r lse_r`` and ``out = sum_r exp(lse_r - lse) * out_r``, accumulated in fp32
(natural-log LSE). Only ``lse_r = -inf`` marks an empty shard: it contributes nothing, its
``out`` is selected away, never multiplied (NaN or inf there cannot leak). When every shard of a
``(b, h)`` is empty (or ``N == 0``) the result is ``out = 0``, ``lse = -inf``.

Every other value takes part as the formula (with ``torch.logsumexp``'s meaning of infinities)
gives it:

- a NaN ``lse_r`` makes the merged ``out`` and ``lse`` NaN;
- a ``+inf`` ``lse_r`` (a shard whose scores reached ``+inf``) makes ``lse = +inf`` and ``out``
  NaN (``exp(inf - inf)``), or NaN ``lse`` too beside a NaN shard;
- NaN or inf in the ``out`` of a non-empty shard reaches the merged ``out`` in those elements,
  even where its weight underflows to 0 (``0 * NaN`` is NaN).

So DCP shows the NaN the single-rank attention shows; no value but ``-inf`` is ever "empty".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    TRITON_FLOAT_DTYPES,
    cdiv,
    check_float,
    check_launchable,
    check_same_device,
    max_keep_nan,
    next_pow2,
)

_OP = "lse_combine"


def _check(out: torch.Tensor, lse: torch.Tensor) -> None:
    check_float(_OP, "out", out, 4)
    check_float(_OP, "lse", lse, 3, dtypes=(torch.float32,))
    if tuple(lse.shape) != tuple(out.shape[:3]):
        raise ValueError(
            f"{_OP}: lse must have shape out.shape[:3] = {tuple(out.shape[:3])}, got {tuple(lse.shape)}"
        )
    check_same_device(_OP, out=out, lse=lse)


def _empty_result(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, B, H, D = out.shape
    return (
        torch.zeros((B, H, D), dtype=out.dtype, device=out.device),
        torch.full((B, H), float("-inf"), dtype=torch.float32, device=out.device),
    )


def lse_combine_reference(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch LSE combine (see module docstring): the formula as written. No host sync."""
    _check(out, lse)
    if out.shape[0] == 0:
        return _empty_result(out)
    lse32 = lse.float()
    res_lse = torch.logsumexp(lse32, dim=0)  # NaN beats +inf beats finite; all -inf gives -inf
    weight = torch.exp(lse32 - res_lse)  # NaN where lse_r and lse are both +inf (or both -inf)
    empty = (lse32 == float("-inf"))[..., None]
    zero = torch.zeros((), dtype=torch.float32, device=out.device)
    contrib = torch.where(empty, zero, weight[..., None] * out.float())
    return contrib.sum(dim=0).to(out.dtype), res_lse


@triton.jit
def _lse_combine_kernel(
    out_ptr,
    lse_ptr,
    res_ptr,
    res_lse_ptr,
    N,
    BH,
    D,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (ceil(B*H / BLOCK_ROWS), ceil(D / BLOCK_D)): BLOCK_ROWS (b, h) pairs, all N shards, one D tile.

    The N LSEs and the [BLOCK_ROWS, N, BLOCK_D] tile of partial outputs are loaded together (one
    round trip to memory each, and the second does not wait for the first), then reduced in
    registers.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = rows < BH
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    shard = offs_n[None, :].to(tl.int64) * BH + rows[:, None]  # [ROWS, N]
    in_shard = in_rows[:, None] & in_n[None, :]
    lse = tl.load(lse_ptr + shard, mask=in_shard, other=-float("inf")).to(tl.float32)
    o = tl.load(
        out_ptr + shard[:, :, None] * D + offs_d[None, None, :],
        mask=in_shard[:, :, None] & in_d[None, None, :],
        other=0.0,
    )
    empty = lse == -float("inf")  # the one empty mark: NaN and +inf take part
    m = tl.reduce(lse, 1, max_keep_nan)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    w = tl.exp(lse - m_safe[:, None])  # 0 for an empty shard; NaN for a NaN shard, or +inf beside m = +inf
    total = tl.sum(w, axis=1)
    # an empty shard's out is selected away (not multiplied by 0), so NaN or inf in it cannot leak;
    # a non-empty shard's is multiplied, so its NaN reaches the result even at weight 0
    o = tl.where(empty[:, :, None], 0.0, o.to(tl.float32))
    acc = tl.sum(w[:, :, None] * o, axis=1)  # [ROWS, BLOCK_D]
    zero = total == 0.0  # every shard empty (a NaN total is not 0)
    denom = tl.where(zero, 1.0, total)
    tl.store(
        res_ptr + rows[:, None] * D + offs_d[None, :],
        (acc / denom[:, None]).to(res_ptr.dtype.element_ty),
        mask=in_rows[:, None] & in_d[None, :],
    )
    if tl.program_id(1) == 0:
        res_lse = tl.where(m == float("inf"), float("inf"), m + tl.log(denom))  # +inf - +inf is NaN: keep +inf
        tl.store(res_lse_ptr + rows, tl.where(zero, -float("inf"), res_lse), mask=in_rows)


TILE_ELEMENTS = 4096  # partial-output elements a program loads (32 fp32 registers a thread at 4 warps)


def _default_tiles(N: int, BH: int, D: int) -> tuple[int, int]:
    """(rows, block_d): whole rows, several per program when there are (b, h) pairs to spare
    (fewer, fuller programs); D split instead when there are few, for more programs."""
    n = next_pow2(N)
    block_d = min(next_pow2(D), 1024, max(TILE_ELEMENTS // n, 16))
    if BH < 128:
        return 1, min(block_d, 128)
    rows = max(1, TILE_ELEMENTS // (n * block_d)) if BH >= 1024 else 1
    return rows, block_d


def lse_combine_triton(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_d: int | None = None,
    rows: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton LSE combine; grid (ceil(B*H / rows), ceil(D / BLOCK_D)), all N shards in one tile (see module docstring).

    ``block_d`` (a power of two) overrides the D tile and ``rows`` the (b, h) pairs a program
    takes (defaults: see ``_default_tiles``).
    ``out_dtype`` overrides the result dtype (sparse MLA's split-K merges fp32 partials into the
    query dtype this way).
    """
    _check(out, lse)
    if out.dtype not in TRITON_FLOAT_DTYPES:
        raise ValueError(f"{_OP}: out dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {out.dtype}")
    N, B, H, D = out.shape
    res_dtype = out_dtype or out.dtype
    if res_dtype not in TRITON_FLOAT_DTYPES:
        raise ValueError(f"{_OP}: out_dtype must be one of {list(TRITON_FLOAT_DTYPES)}, got {res_dtype}")
    if N == 0 or B * H == 0:
        res, res_lse = _empty_result(out)
        return res.to(res_dtype), res_lse
    check_launchable(_lse_combine_kernel, out, lse)
    tile_rows, tile_d = _default_tiles(N, B * H, D)
    block, rows = block_d or tile_d, rows or tile_rows
    for name, v in (("block_d", block), ("rows", rows)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{_OP}: {name} must be a power of two, got {v}")
    res = torch.empty((B, H, D), dtype=res_dtype, device=out.device)
    res_lse = torch.empty((B, H), dtype=torch.float32, device=out.device)
    grid = (cdiv(B * H, rows), max(1, cdiv(D, block)))
    _lse_combine_kernel[grid](
        out.contiguous(), lse.contiguous(), res, res_lse, N, B * H, D,
        BLOCK_ROWS=rows, BLOCK_N=next_pow2(N), BLOCK_D=block,
    )  # fmt: skip
    return res, res_lse
