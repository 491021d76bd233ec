"""The sharded index cache's top-k: every rank's best candidates, and the group's agreement on them.

With ``index_cache="sharded"`` each rank holds the index keys of the slots it owns and scores only
those (``index_scores(..., shard=(N, r, I))``, :mod:`.index_scores`: the others are ``-inf``). The
group then agrees on the global top-k: each rank sends its best k (score, candidate position) pairs
(``topk_candidates``), one all-gather brings every rank the N * k pairs of each row, and every rank
picks the same k from them (``topk_agree``). The order "larger score first, lower position first
among equal scores" (NaN largest, -0.0 == +0.0) is the one ``topk_select`` uses, and a candidate in
the global top k has fewer than k candidates before it, so fewer than k of its own rank's: it is in
its rank's best k. So the agreed set is exactly ``topk_select``'s over the replicated cache's scores.

Contracts (``-1`` means "no slot"):

``topk_candidates(scores[T, C], k) -> [T, k, 2] int32``
    ``topk_select``'s selection of the rank's scores as (fp32 score bits, candidate position)
    pairs in ascending position, ``(-inf, -1)`` past the row's count: what a rank all-gathers.
    The reference and the Triton form differ only in the selection they run
    (:mod:`.topk_select`).

``topk_agree(gathered[N*T, k', 2], page_table, req_ids, page_size, k, N) -> topk[T, k] int32``
and ``topk_agree_remap(..., N, r, I) -> (local, count)``
    The ``k`` best of each row's ``N * k'`` gathered candidates in ``topk_select``'s order, as
    global slots in ascending position (or, remapped, rank ``r``'s local rows): equal to
    ``topk_select`` (``topk_select_remap``) over the whole scores. Plain torch on ``N * k'``
    entries a row, on every device: there is no Triton form.
"""

from __future__ import annotations

import torch

from dsa_dcp.slots import local_row, owner

from ._common import check_index, check_int, check_remap_args
from .topk_select import topk_select_reference, topk_select_triton


def _pack_candidates(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[T, k, 2]`` int32: (fp32 score bits, candidate position) of the positions ``pos``
    (``-1``: none, sent as ``(-inf, -1)``)."""
    taken = pos >= 0
    values = scores.to(torch.float32).gather(1, pos.clamp(min=0).to(torch.int64))
    values = torch.where(taken, values, torch.full_like(values, float("-inf")))
    return torch.stack([values.view(torch.int32), pos.to(torch.int32)], dim=-1)


def topk_candidates_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """This rank's best ``k`` candidates of each row of its scores, as ``[T, k, 2]`` int32 pairs
    (fp32 score bits, candidate position), in ascending position; ``(-inf, -1)`` past the row's
    count. The selection is ``topk_select``'s (its tie rule). No host sync."""
    return _pack_candidates(scores, topk_select_reference(scores, k))


def topk_candidates_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_candidates_reference` with the Triton radix select."""
    return _pack_candidates(scores, topk_select_triton(scores, k))


_INT32_MIN = -(2**31)
_NEG_INF_BITS = -8388608  # float32 -inf (0xFF800000) read as int32


def _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, op) -> None:
    check_index(op, "gathered", gathered, 3)
    check_int(op, "k", k, 0)
    check_int(op, "dcp_size", dcp_size, 1)
    if gathered.dtype != torch.int32 or gathered.shape[2] != 2 or gathered.shape[0] % dcp_size:
        raise ValueError(f"{op}: gathered must be int32 [N * T, k_local, 2] with N = {dcp_size}, got "
                         f"{gathered.dtype} {tuple(gathered.shape)}")
    check_index(op, "page_table", page_table, 2)
    check_index(op, "req_ids", req_ids, 1)
    check_int(op, "page_size", page_size, 1)
    if req_ids.shape[0] * dcp_size != gathered.shape[0]:
        raise ValueError(f"{op}: req_ids must have T = {gathered.shape[0] // dcp_size} entries, got "
                         f"{tuple(req_ids.shape)}")


def _agreed_positions(gathered: torch.Tensor, dcp_size: int, k: int, C: int) -> torch.Tensor:
    """``[T, k]`` int64: the positions of the global top k, ascending; ``C`` where there are fewer."""
    NT, kk, _ = gathered.shape
    T = NT // dcp_size
    pairs = gathered.reshape(dcp_size, T, kk, 2).transpose(0, 1).reshape(T, dcp_size * kk, 2)
    bits, pos = pairs[..., 0], pairs[..., 1].to(torch.int64)
    bits = torch.where(bits == _INT32_MIN, torch.zeros_like(bits), bits)  # -0.0 ties with +0.0
    # signed int32 whose order is the scores' (NaN largest), then unique keys: lower position first
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, torch.full_like(order, 2**31 - 1), order)
    taken = (pos >= 0) & (pos < C) & (bits != _NEG_INF_BITS)
    key = order.to(torch.int64) * 2**32 + (2**31 - 1 - pos.clamp(0, C))
    key = torch.where(taken, key, torch.full_like(key, -(2**63)))
    n = min(k, dcp_size * kk)
    top = torch.topk(key, n, dim=1).indices
    chosen = torch.where(taken.gather(1, top), pos.gather(1, top), torch.full_like(top, C))
    chosen = chosen.sort(dim=1).values
    if n < k:
        chosen = torch.cat([chosen, chosen.new_full((T, k - n), C)], dim=1)
    return chosen


def _slots_at(page_table: torch.Tensor, req_ids: torch.Tensor, page_size: int, pos: torch.Tensor) -> torch.Tensor:
    """Global slots (int64) of candidate positions ``pos[T, k]``; ``-1`` for ``pos >= C``, a negative
    page or a row without a request."""
    R, MP = page_table.shape
    C = MP * page_size
    req = req_ids.to(torch.int64)
    if R == 0 or C == 0:
        return torch.full_like(pos, -1)
    pages = page_table.to(torch.int64).index_select(0, req.clamp(0, R - 1))
    safe = pos.clamp(0, C - 1)
    page = pages.gather(1, safe // page_size)
    ok = (pos < C) & (page >= 0) & (req >= 0)[:, None]
    return torch.where(ok, page * page_size + safe % page_size, torch.full_like(pos, -1))


def topk_agree_reference(gathered: torch.Tensor, page_table: torch.Tensor, req_ids: torch.Tensor, page_size: int,
                         k: int, dcp_size: int) -> torch.Tensor:
    """The group's top-k from every rank's ``topk_candidates`` (all-gathered: ``[N * T, k', 2]``, rank
    r's rows at ``[r * T, (r + 1) * T)``): the ``k`` best of each row's ``N * k'`` candidates by
    topk_select's order, as int32 global slots in ascending candidate position, ``-1`` tail —
    ``topk_select`` of the whole scores when every rank sent its best ``k' >= k`` of a partition of
    the candidates. Plain torch on ``N * k'`` entries a row; no host sync, static shapes."""
    _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, "topk_agree")
    C = page_table.shape[1] * page_size
    pos = _agreed_positions(gathered, dcp_size, k, C)
    return _slots_at(page_table, req_ids, page_size, pos).to(torch.int32)


def topk_agree_remap_reference(gathered: torch.Tensor, page_table: torch.Tensor, req_ids: torch.Tensor,
                               page_size: int, k: int, dcp_size: int, rank: int, interleave: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_remap(topk_agree(...), dcp_size, rank, interleave)`` without the global ``[T, k]`` slots
    in between: the agreed slots rank ``rank`` owns, as local rows in ascending candidate position,
    ``-1`` tail, and their count per row."""
    _check_agree(gathered, page_table, req_ids, page_size, k, dcp_size, "topk_agree_remap")
    check_remap_args(dcp_size, rank, interleave, "topk_agree_remap")
    C = page_table.shape[1] * page_size
    pos = _agreed_positions(gathered, dcp_size, k, C)
    slots = _slots_at(page_table, req_ids, page_size, pos)
    safe = slots.clamp(min=0)
    owned = (slots >= 0) & (owner(safe, dcp_size, interleave) == rank)
    # positions are ascending and unique: sorting the owned ones' positions to the front compacts them in order
    first, order = torch.where(owned, pos, torch.full_like(pos, C)).sort(dim=1)
    rows = local_row(safe.gather(1, order), dcp_size, interleave)
    local = torch.where(first < C, rows, torch.full_like(rows, -1)).to(torch.int32)
    return local, owned.sum(dim=1, dtype=torch.int32)
