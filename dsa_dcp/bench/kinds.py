"""Kernel names by kind, for splitting a step's device time (``bench step``, ``dcp_run``).

Substrings of CUDA kernel names: the collectives and kernels DCP adds, sparse attention, and the
lightning indexer (our kernels, and the ones torch's composition launches: ``torch.topk``'s
radix select and sort); the rest (``other``) is the model's own work and DCP's torch ops.
"""

from __future__ import annotations

KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("fused_merge", ("fused_a2a_merge",)),
    ("remap", ("topk_remap",)),
    ("combine", ("lse_combine",)),
    ("attention", ("sparse_mla",)),
    # "_topk_": every kernel of topk_select (the remap's, "_topk_remap_kernel", is matched above)
    ("indexer", ("index_scores", "topk_select", "_topk_", "gatherTopK", "radixSort", "radixFindKthValues",
                 "computeBlockwiseWithinKCounts", "computeBlockwiseKthCounts")),
)


def kernel_us_by_kind(kernels: list[tuple[str, float]], runs: int) -> dict[str, float]:
    """Device time per step (us) of ``kernels`` (``(name, us)`` over ``runs`` steps), summed by
    kind (``KERNEL_KINDS``, else ``other``), with the total."""
    out = {f"{kind}_us": 0.0 for kind, _ in KERNEL_KINDS} | {"other_us": 0.0}
    for name, us in kernels:
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name for key in keys)), "other")
        out[f"{kind}_us"] += us / runs
    out["kernels_us"] = sum(us for _, us in kernels) / runs
    return out


def overlap_us(kernels: list[tuple[str, float, float]], runs: int) -> float:
    """Device time per step (us) that ``kernels`` (``(name, us, start us)`` over ``runs`` steps) ran
    side by side: the sum of their times less the time at least one of them ran. 0 for kernels that
    ran one after another, as one stream's do."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((start, start + us) for _, us, start in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return (sum(us for _, us, _ in kernels) - busy) / runs


def top_kernels(kernels: list[tuple[str, float]], runs: int, n: int) -> list[tuple[str, float, float]]:
    """The ``n`` kernels of ``kernels`` (``(name, us)`` over ``runs`` steps) with the most device time:
    ``(name, us a step, launches a step)``, the most first."""
    total: dict[str, list[float]] = {}
    for name, us in kernels:
        t = total.setdefault(name, [0.0, 0])
        t[0] += us
        t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, us / runs, count / runs) for name, (us, count) in ranked]
