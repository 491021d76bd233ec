"""Slot ownership under decode context parallelism.

KV lives in a paged pool addressed by global slot ids; ``-1`` (any negative id) means "no slot".
Under DCP of size ``N`` with interleave ``I``, slot ``s`` is owned by rank ``(s // I) % N`` and
stored there at local row ``(s // (N * I)) * I + s % I``. These are the only definitions of the
mapping; kernels, passes and models call them (or mirror them in Triton and test against them).
"""

from __future__ import annotations

import torch


def owner(slots: torch.Tensor, dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """Rank that stores each slot (meaningless for negative slots)."""
    return torch.div(slots, interleave, rounding_mode="floor") % dcp_size


def local_row(slots: torch.Tensor, dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """Row of each slot in its owner's cache (meaningless for negative slots)."""
    return torch.div(slots, dcp_size * interleave, rounding_mode="floor") * interleave + slots % interleave


def localize_slots(slots: torch.Tensor, dcp_size: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """Global slots -> local rows on ``rank``; slots owned elsewhere (and ``-1``) become ``-1``.

    Elementwise, no host sync: this is what a localized KV write stores through.
    """
    keep = (slots >= 0) & (owner(slots, dcp_size, interleave) == rank)
    return torch.where(keep, local_row(slots, dcp_size, interleave), torch.full_like(slots, -1))


def local_cache_rows(num_slots: int, dcp_size: int, interleave: int = 1) -> int:
    """Rows one rank's cache needs so that every slot it owns fits.

    ``ceil(S / N)`` when ``I == 1``; with ``I > 1`` whole interleave blocks are kept, so it is
    ``ceil(S / (N * I)) * I``.
    """
    if num_slots < 0 or dcp_size < 1 or interleave < 1:
        raise ValueError(f"bad sizes: num_slots={num_slots}, dcp_size={dcp_size}, interleave={interleave}")
    blocks = -(-num_slots // (dcp_size * interleave))
    return blocks * interleave
