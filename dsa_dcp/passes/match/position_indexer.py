"""Matcher for the lightning indexer over a position cache, as transformers' DSA models write it.

By structure (never by module names), from its ``topk`` node backwards::

    keys   = index_key_cache                                 # [B, T, D], written in place before
    scores = matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) [* scale]   # [B, S, H, T]
    scores = relu(scores)
    index  = matmul(w.unsqueeze(-2), scores).squeeze(-2)     # w [B, S, H] fp32: [B, S, T]
    index  = index + mask        # or mask + index, index.masked_fill(m, -inf), or no mask
    topk   = index.topk(K, dim=-1).indices                   # [B, S, K]

(the ``.float()`` casts and the ``transpose``/``unsqueeze`` may come in either order). The
indices must reach sparse attention only through the slots that ``recognize_sparse_attention``
builds (``SET_READ``): that reads them as a set and takes ``-1`` as "no position", so
``topk_select``'s ascending order and ``-1`` tail (at ``-inf`` scores) give the same attention.

``find_position_indexers(gm)`` returns a ``PositionIndexerMatch`` per recognized indexer and, for
every other top-k over ``[B, S, T]`` scores, why not. It changes nothing; the rewrite is
``passes/indexer.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsa_dcp.passes import fx as F
from dsa_dcp.passes.match.attention import SET_READ
from dsa_dcp.passes.match.indexer import NoMatch

_WIDENING = (torch.bfloat16, torch.float16, torch.float32)  # exact in fp32
# ``meta`` key of the ``index_scores`` node the rewrite puts in place of such an indexer: its keys
# are a request's positions, which stay whole on every rank (the ``index_cache`` pass shards paged
# index caches only).
POSITION_INDEXER = "dsa_dcp_position_indexer"


@dataclasses.dataclass
class PositionIndexerMatch:
    """One recognized indexer over a position cache: what ``index_scores``/``topk_select`` need."""

    topk: fx.Node
    indices: fx.Node  # getitem(topk, 1): replaced
    scores: fx.Node  # the [B, S, T] scores before the mask: replaced
    q: fx.Node  # [B, S, H, D] (before a widening cast)
    w: fx.Node  # [B, S, H] fp32
    scale: float  # the positive factor inside the relu, folded into w
    keys: fx.Node  # [B, T, D] key cache
    k: int


def _through_casts(node: object) -> object:
    """Back through value-keeping widening casts (``.float()``, ``.to(torch.float32)``)."""
    while F.calls(node, (), ("float", "to")) and isinstance(node.args[0], fx.Node) \
            and F.dtype(node.args[0]) in _WIDENING and F.dtype(node) == torch.float32 \
            and (node.target == "float" or len(node.args) + len(node.kwargs) == 2):
        node = node.args[0]
    return node


def _is_matmul(node: object) -> bool:
    return F.op_name(node) == "matmul" and len(node.args) == 2 and not node.kwargs


class _Matcher:
    def __init__(self, topk: fx.Node) -> None:
        self.topk = topk

    def match(self) -> PositionIndexerMatch:
        topk = self.topk
        masked, k = F.arg(topk, 0, "input"), F.arg(topk, 1, "k")
        if not isinstance(k, int) or isinstance(k, bool):
            raise NoMatch(f"its k is not a constant int ({k!r})")
        if F.arg(topk, 2, "dim", -1) not in (-1, 2) or F.arg(topk, 3, "largest", True) is not True:
            raise NoMatch("it is not a top-k of the largest values along the last dim")
        shape = F.shape(masked)
        if shape is None or len(shape) != 3 or F.dtype(masked) != torch.float32:
            raise NoMatch(f"it does not select from fp32 scores [B, S, T] (got {shape}, {F.dtype(masked)})")
        if not isinstance(shape[2], int):
            raise NoMatch("its number of positions is not static")
        items = dict(F.getitem_users(topk))
        if set(items) - {0, 1} or 1 not in items or (0 in items and items[0].users):
            raise NoMatch("it is used for more than its indices")
        indices = items[1]
        scores = self._unmasked(masked)
        if len(scores.users) != 1:
            raise NoMatch(f"its scores {scores.name} are used by more than the mask and the top-k")
        q, w, scale, keys = self._scores(scores, shape)
        self._read_as_set(indices)
        return PositionIndexerMatch(topk, indices, scores, q, w, scale, keys, k)

    @staticmethod
    def _read_as_set(indices: fx.Node) -> None:
        """Every live use of the indices (through integer casts) is a slots conversion (``SET_READ``)."""
        pending = [indices]
        while pending:
            node = pending.pop()
            for user in node.users:
                if user.meta.get(SET_READ):
                    continue
                if F.calls(user, (), ("long", "int", "to")) and user.args[0] is node \
                        and F.dtype(user) in (torch.int32, torch.int64):
                    pending.append(user)
                    continue
                raise NoMatch(f"its indices are used by {user.format_node()}, not by sparse attention alone "
                              f"(topk_select lists the selection by position; sparse attention needs the set)")

    @staticmethod
    def _unmasked(masked: fx.Node) -> fx.Node:
        """The scores before ``+ mask`` / ``masked_fill(m, -inf)`` (or ``masked`` itself)."""
        name = F.op_name(masked)
        if name == "add" and len(masked.args) == 2 and not masked.kwargs:
            a, b = masked.args
            for scores, mask in ((a, b), (b, a)):
                if _is_head_sum(scores) and isinstance(mask, fx.Node):
                    return scores
        if name == "masked_fill" and isinstance(masked.args[0], fx.Node):
            value = F.arg(masked, 2, "value")
            if isinstance(value, float) and value == float("-inf"):
                return masked.args[0]
        if _is_head_sum(masked):
            return masked
        raise NoMatch(f"its scores {masked.name} are not a head sum, + mask or masked_fill(m, -inf) of one")

    def _scores(self, scores: fx.Node, shape: tuple) -> tuple[fx.Node, fx.Node, float, fx.Node]:
        """``matmul(w.unsqueeze(-2), relu(matmul(q, keys^T) * c)).squeeze(-2)``: (q, w, c, keys)."""
        product = scores.args[0]
        weights, relu = product.args
        w = weights.args[0]
        if F.op_name(weights) != "unsqueeze" or F.arg(weights, 1, "dim") not in (-2, 2) \
                or F.dtype(w) != torch.float32:
            raise NoMatch(f"the head weights {weights.name} are not fp32 w.unsqueeze(-2)")
        if F.op_name(relu) != "relu" or len(relu.users) != 1:
            raise NoMatch(f"{relu.name} is not the relu of the per-head scores, read once")
        logits, scale = relu.args[0], 1.0
        if F.op_name(logits) == "mul" and len(logits.args) == 2:
            a, b = logits.args
            logits, scale = (a, b) if isinstance(b, (int, float)) else (b, a)
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0 \
                    or len(logits.users) != 1:
                raise NoMatch(f"the per-head scores are scaled by {scale!r}, not a positive constant")
        if not _is_matmul(logits):
            raise NoMatch(f"the per-head scores {logits.name} are not a matmul of queries and keys")
        q, keys_t = _through_casts(logits.args[0]), logits.args[1]
        keys = self._keys(keys_t)
        b, s, t = shape
        h = (F.shape(w) or (0, 0, 0))[-1]
        d = (F.shape(keys) or (0, 0, 0))[-1]
        if F.shape(q) != (b, s, h, d) or F.shape(w) != (b, s, h) or F.shape(keys) != (b, t, d) \
                or F.dtype(q) not in _WIDENING or F.dtype(keys) not in _WIDENING:
            raise NoMatch(f"q {F.shape(q)}, w {F.shape(w)} and the keys {F.shape(keys)} are not [B, S, H, D], "
                          f"[B, S, H] and [B, T, D] floats")
        return q, w, float(scale), keys

    @staticmethod
    def _keys(node: object) -> fx.Node:
        """``keys.transpose(-1, -2)``, ``.float()`` and ``.unsqueeze(1)`` in any order: ``keys``."""
        seen = set()
        while isinstance(node, fx.Node):
            name = F.op_name(node)
            if name == "unsqueeze" and F.arg(node, 1, "dim") == 1 and "unsqueeze" not in seen:
                seen.add(name)
            elif name == "transpose" and {F.arg(node, 1, "dim0"), F.arg(node, 2, "dim1")} in ({-1, -2}, {1, 2}) \
                    and "transpose" not in seen and len(F.shape(node.args[0]) or ()) == 3:
                seen.add(name)
            elif _through_casts(node) is not node:
                node = _through_casts(node)
                continue
            else:
                break
            node = node.args[0]
        if seen != {"unsqueeze", "transpose"}:
            raise NoMatch(f"the keys of the per-head scores are not keys.transpose(-1, -2).unsqueeze(1) ({node})")
        return node


def _is_head_sum(node: object) -> bool:
    """``matmul(a, b).squeeze(-2)``."""
    return F.op_name(node) == "squeeze" and F.arg(node, 1, "dim") in (-2, 2) and _is_matmul(node.args[0])


def find_position_indexers(gm: fx.GraphModule) -> tuple[list[PositionIndexerMatch], list[tuple[fx.Node, str]]]:
    """Every top-k over ``[B, S, T]`` scores: a match, or ``(node, why not)``."""
    matches, left = [], []
    for node in list(gm.graph.nodes):
        if not (F.op_name(node) == "topk" and len(F.shape(F.arg(node, 0, "input")) or ()) == 3):
            continue
        try:
            matches.append(_Matcher(node).match())
        except NoMatch as e:
            left.append((node, str(e)))
    return matches, left
