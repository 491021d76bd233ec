"""Comparisons the kernel and property tests share."""

import math

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, scale_floor: float,
                 nan: bool = False) -> None:
    """The same infinities, and max |a - e| <= rtol * max(max |e|, scale_floor) over finite entries.

    NaN: with ``nan=False`` (inputs that hold none) the result must hold none; with ``nan=True``
    the result must be NaN exactly where ``expected`` is (same positions, none more, none fewer).
    """
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if nan:
        where = torch.isnan(a) != torch.isnan(e)
        assert not where.any(), (
            f"{what}: NaN positions differ at {where.nonzero()[:4].tolist()} "
            f"(result NaN: {int(torch.isnan(a).sum())}, expected NaN: {int(torch.isnan(e).sum())})"
        )
    else:
        assert not torch.isnan(a).any(), f"{what}: NaN in result"
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), f"{what}: -inf positions differ"
    assert torch.equal(torch.isposinf(a), torch.isposinf(e)), f"{what}: +inf positions differ"
    fin = torch.isfinite(e)
    if fin.any():
        err = (a[fin] - e[fin]).abs().max().item()
        scale = max(e[fin].abs().max().item(), scale_floor)
        assert err <= rtol * scale, f"{what}: max abs err {err:.3e} > {rtol:.0e} * {scale:.3e}"


def brute_lse_combine(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse_combine``'s contract in fp64, cell by cell in Python: only ``lse = -inf`` is an empty
    shard (its ``out`` never read); a NaN LSE makes the cell NaN, a ``+inf`` one makes ``lse = +inf``
    and ``out`` NaN; otherwise ``sum_r exp(lse_r - lse) * out_r`` over the non-empty shards, whose
    NaN or inf values count whatever their weight."""
    N, B, H, D = out.shape
    nan, inf = float("nan"), float("inf")
    res = torch.zeros((B, H, D), dtype=torch.float64)
    res_lse = torch.full((B, H), -inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            shards = [r for r in range(N) if float(lse[r, b, h]) != -inf]
            values = [float(lse[r, b, h]) for r in shards]
            if not shards:
                continue
            if any(math.isnan(v) for v in values):
                res_lse[b, h], res[b, h] = nan, nan
            elif inf in values:
                res_lse[b, h], res[b, h] = inf, nan
            else:
                m = max(values)
                res_lse[b, h] = m + math.log(sum(math.exp(v - m) for v in values))
                for r, v in zip(shards, values):
                    res[b, h] += math.exp(v - res_lse[b, h].item()) * out[r, b, h].double().cpu()
    return res, res_lse
