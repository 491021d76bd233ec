"""Comparisons the kernel and property tests share."""

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, scale_floor: float) -> None:
    """No NaN, the same infinities, and max |a - e| <= rtol * max(max |e|, scale_floor) over finite entries."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in result"
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), f"{what}: -inf positions differ"
    assert torch.equal(torch.isposinf(a), torch.isposinf(e)), f"{what}: +inf positions differ"
    fin = torch.isfinite(e)
    if fin.any():
        err = (a[fin] - e[fin]).abs().max().item()
        scale = max(e[fin].abs().max().item(), scale_floor)
        assert err <= rtol * scale, f"{what}: max abs err {err:.3e} > {rtol:.0e} * {scale:.3e}"
