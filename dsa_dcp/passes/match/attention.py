"""Matchers for sparse attention as model authors write it over position caches.

Each matcher reads a graph (through ``passes/fx.py``) and returns what it found as a dataclass,
or why a node that reads a position cache is not a form it knows; it changes nothing. The forms
(``docs/models.md`` shows each one's graph):

- **absorbed MLA** (DeepSeek's published code): ``(einsum(q_nope, kv[:b, :e]) + einsum(q_pe,
  pe[:b, :e])) * scale`` plus ``full(-inf).scatter_(-1, topk, 0).unsqueeze(2)``, softmax, weighted
  sum ``einsum(p, kv[:b, :e])``;
- **eager MHA** (transformers ``eager``): ``matmul(q, k_cache.transpose(2, 3)) * scale +
  mask.masked_fill(ones(bool).scatter(-1, topk, False), finfo.min)``, softmax, ``matmul(p, v_cache)``;
- **SDPA** (transformers ``sdpa``): ``scaled_dot_product_attention(q, k_cache, v_cache,
  attn_mask=mask & ~index_mask)``;
- **latent MLA expanded after the read** (transformers from 5.18): the MHA forms over K and V that
  ``kv_b_proj(latent)`` and the rope cache build every step (``match_latent_kv``).

Widening casts (``.float()``, ``.to(torch.float32)``, ``.type_as``) between a cache read and the
products are read through (``uncast``). The rewrite that consumes an ``AttentionMatch`` is
``passes/recognize_attention.py``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as TF

from dsa_dcp.passes import fx as F
from dsa_dcp.position_cache import PositionLayout

EINSUM = {torch.einsum, torch.functional.einsum}
MATMUL = {torch.matmul, operator.matmul}
SOFTMAX = {torch.softmax, TF.softmax}
SDPA = {TF.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
ADD = {operator.add, operator.iadd, torch.add}
MUL = {operator.mul, operator.imul, torch.mul}
AND = {operator.and_, torch.logical_and, torch.bitwise_and}
NOT = {operator.invert, torch.logical_not, torch.bitwise_not}
# ops between the softmax and the weighted sum that keep the probabilities' values (fp32 here)
PROB_CASTS = {"to", "type_as", "float", "type", "contiguous"}


@dataclasses.dataclass
class AttentionMatch:
    """One recognized attention over position caches."""

    kind: str  # "mla" (absorbed, caches [kv, pe]) or "mha" (per head, caches [k, v])
    output: fx.Node  # the weighted sum the op replaces
    q_nope: fx.Node
    q_pe: fx.Node | None  # None: q_nope is the whole query (MHA without a rope split)
    caches: tuple[fx.Node, fx.Node]
    layout: PositionLayout
    topk: fx.Node  # positions [B, S, K]
    mask: fx.Node | None  # the model's own mask [B or 1, 1, S, T]
    mask_kind: str | None  # "additive" (0 keeps, finfo.min/-inf drops) or "keep" (bool)
    scale: float
    head_axis: int  # 2: [B, S, H, D] (scores [B, S, H, T]); 1: [B, H, S, D]
    latent: LatentKV | None = None  # the latent MLA form: K and V expanded from caches (latent, rope)

    def inputs(self) -> set[fx.Node]:
        """Nodes the rewritten attention still reads (never erased with the dense part)."""
        keep = {self.q_nope, self.topk, *self.caches}
        if self.latent is not None:
            keep.add(self.latent.weight)
        return keep | {n for n in (self.q_pe, self.mask) if n is not None}


@dataclasses.dataclass
class LatentKV:
    """K and V a model expands, every step, from MLA's latent and rope caches (module docstring)."""

    latent: fx.Node  # position cache [B, 1, T, Dc]
    rope: fx.Node  # position cache [B, 1, T, Dr]
    weight: fx.Node  # kv_b_proj's weight [H * (Dn + Dv), Dc]
    heads: int
    nope: int
    value: int
    expansion: set[fx.Node]  # the nodes that build K and V (removed with the dense attention)


# --------------------------------------------------------------------------- matching pieces


def uncast(node):
    """Through casts that widen to float32 (``.float()``, ``.to(torch.float32)``, ``.type_as(t)`` of a
    float32 ``t``) back to what was cast: the attention ops compute in float32 from the cache's own
    dtype, so such a cast of a cache read, a score or a query changes no value they compute."""
    while F.calls(node, (), ("float", "to", "type_as")) and isinstance(node.args[0], fx.Node) \
            and "example_value" in node.meta and "example_value" in node.args[0].meta:
        before, after = node.args[0].meta["example_value"], node.meta["example_value"]
        if not (after.dtype == torch.float32 and before.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and after.device == before.device and after.shape == before.shape):
            break
        node = node.args[0]
    return node


def _strip_views(node):
    """``unsqueeze``/``view``/``reshape`` chains in front of an index mask."""
    while F.calls(node, (torch.unsqueeze,), ("unsqueeze", "view", "reshape", "expand")):
        node = node.args[0]
    return node


def _index_mask_topk(node) -> tuple[fx.Node, bool] | None:
    """``(topk, masked_value)`` of ``scatter(base, -1, topk, v)``: the positions the top-k names get ``v``."""
    if not F.calls(node, (torch.scatter,), ("scatter", "scatter_")) or len(node.args) < 4:
        return None
    dim, topk, value = node.args[1], node.args[2], node.args[3]
    if dim not in (-1, len(F.shape(node)) - 1) or not isinstance(topk, fx.Node):
        return None
    return topk, value


def _additive_index_mask(term) -> fx.Node | None:
    """``full(.., -inf).scatter_(-1, topk, 0)`` (viewed) -> topk."""
    scatter = _strip_views(term)
    found = _index_mask_topk(scatter)
    if found is None or found[1] not in (0, 0.0):
        return None
    base = scatter.args[0]
    fill = F.arg(base, 1, "fill_value") if F.calls(base, (torch.full,)) else \
        F.arg(base, 1, "fill_value") if F.calls(base, (), ("new_full",)) else None
    if fill != -math.inf:
        return None
    return found[0]


def _bool_index_mask(node) -> fx.Node | None:
    """``ones(bool).scatter(-1, topk, False)`` (viewed; True = not selected) -> topk."""
    scatter = _strip_views(node)
    found = _index_mask_topk(scatter)
    if found is None or found[1] is not False:
        return None
    base = scatter.args[0]
    if not (F.calls(base, (torch.ones,), ("new_ones",)) and base.meta["example_value"].dtype == torch.bool):
        return None
    return found[0]


def _additive_terms(node, out: list) -> list:
    node = uncast(node)
    if F.calls(node, ADD, ("add", "add_", "__add__", "__iadd__")) and len(node.args) == 2 \
            and all(isinstance(a, fx.Node) for a in node.args) and F.arg(node, 2, "alpha", 1) == 1:
        _additive_terms(node.args[0], out)
        _additive_terms(node.args[1], out)
    else:
        out.append(node)
    return out


def _scaled(node) -> tuple[fx.Node, float] | None:
    node = uncast(node)
    if F.calls(node, MUL, ("mul", "mul_", "__mul__")) and len(node.args) == 2:
        a, b = node.args
        if isinstance(b, (int, float)) and isinstance(a, fx.Node):
            return a, float(b)
        if isinstance(a, (int, float)) and isinstance(b, fx.Node):
            return b, float(a)
    return None


class PositionCaches:
    """The position caches of this graph and how their reads look."""

    def __init__(self, layouts: dict[fx.Node, PositionLayout]):
        self.layouts = layouts

    def prefix_read(self, node) -> fx.Node | None:
        """``cache[:b, :e]`` along the position dim (or the cache itself) -> the cache."""
        if node in self.layouts:
            return node
        if F.calls(node, (operator.getitem,)) and node.args[0] in self.layouts:
            cache, index = node.args
            dim = self.layouts[cache].dim
            index = index if isinstance(index, tuple) else (index,)
            if all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in index) \
                    and all(i.stop is None for i in index[1:dim] + index[dim + 1:]):
                return cache
        return None

    def transposed(self, node) -> fx.Node | None:
        """``cache.transpose(-2, -1)`` of a ``[B, H, T, D]`` cache -> the cache."""
        if F.calls(node, (torch.transpose,), ("transpose",)) and node.args[0] in self.layouts:
            dims = {d % 4 for d in node.args[1:3]}
            if dims == {2, 3} and self.layouts[node.args[0]].dim == 2:
                return node.args[0]
        return None


def _einsum_parts(node) -> tuple[str, str, str, fx.Node, fx.Node] | None:
    if not (F.calls(node, EINSUM) and len(node.args) == 3 and isinstance(node.args[0], str)):
        return None
    lhs, _, res = node.args[0].replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    return ops[0], ops[1], res, node.args[1], node.args[2]


def _mla_score(node, caches: PositionCaches):
    """``einsum("bshc,btc->bsht", q, cache[:b, :e])`` -> (q, cache) when the letters line up."""
    parts = _einsum_parts(node)
    if parts is None:
        return None
    a, b, res, q, read = parts
    cache = caches.prefix_read(uncast(read))
    if cache is None or len(a) != 4 or len(b) != 3 or len(res) != 4:
        return None
    if not (b[0] == a[0] and b[2] == a[3] and res == a[:3] + b[1] and b[1] not in a):
        return None
    return q, cache


def _match_value(prob_user, caches: PositionCaches):
    """The weighted sum fed by the probabilities: ``(node, value cache)``."""
    node = prob_user
    parts = _einsum_parts(node)
    if parts is not None:
        a, b, res, _, read = parts
        cache = caches.prefix_read(uncast(read))
        if cache is not None and len(a) == 4 and len(b) == 3 and b[0] == a[0] and b[1] == a[3] \
                and res == a[:3] + b[2]:
            return node, cache
        return None
    if F.calls(node, MATMUL, ("matmul", "__matmul__")):
        return node, node.args[1]  # a cache, or the value a latent expansion computes (checked with the key)
    return None


def _through_prob_casts(node: fx.Node) -> fx.Node | None:
    """Follow single-user casts (and a no-op dropout) from the softmax to the weighted sum."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if F.calls(user, (), PROB_CASTS) or (F.calls(user, (TF.dropout, torch.dropout)) and
                                         F.arg(user, 1, "p", 0.5) == 0.0):
            node = user
            continue
        return user
    return None


def _single_head_cache(node, caches: PositionCaches) -> bool:
    return node in caches.layouts and caches.layouts[node].dim == 2 and F.shape(node)[1] == 1


def match_latent_kv(key: fx.Node, value: fx.Node, caches: PositionCaches) -> LatentKV | None:
    """``key`` and ``value`` (the attention's ``[B, H, T, D]`` operands) as the latent expansion of
    the module docstring, or ``None``."""
    if not (F.calls(key, (), ("new_empty",)) and F.calls(value, (operator.getitem,)) and value.args[1] == 1):
        return None
    split = value.args[0]
    if not (F.calls(split, (torch.split, torch.functional.split), ("split",)) and F.arg(split, 2, "dim") in (-1, 3)
            and isinstance(split.args[1], (list, tuple)) and len(split.args[1]) == 2):
        return None
    nope, v = split.args[1]
    kv = split.args[0]
    if not (F.calls(kv, (torch.transpose,), ("transpose",)) and {d % 4 for d in kv.args[1:3]} == {1, 2}):
        return None
    view = kv.args[0]
    if not (F.calls(view, (), ("view", "reshape")) and F.calls(view.args[0], (torch._C._nn.linear, TF.linear))):
        return None
    linear = view.args[0]
    latent, weight, bias = linear.args[0], linear.args[1], F.arg(linear, 2, "bias")
    if bias is not None or not _single_head_cache(latent, caches):
        return None
    b, _, t, dc = F.shape(latent)
    heads = F.shape(kv)[1]
    if F.shape(view) != (b, t, heads, nope + v) or F.shape(weight) != (heads * (nope + v), dc):
        return None
    # k = new_empty(..); k[..., :nope].copy_(k_nope); k[..., nope:].copy_(rope.expand(-1, H, -1, -1))
    copies, expansion = {}, {linear, view, kv, split, value, key}
    for user in key.users:
        if F.calls(user, (operator.getitem,)):
            index = user.args[1]
            if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
                    and isinstance(index[1], slice) and len(user.users) == 1):
                return None
            (copy,) = user.users
            if not (F.calls(copy, (), ("copy_",)) and copy.args[0] is user and not copy.users):
                return None
            copies[(index[1].start, index[1].stop)] = copy.args[1]
            expansion |= {user, copy}
    k_nope, k_rope = copies.get((None, nope)), copies.get((nope, None))
    if len(copies) != 2 or k_nope is None or k_rope is None:
        return None
    if not (F.calls(k_nope, (operator.getitem,)) and k_nope.args[0] is split and k_nope.args[1] == 0):
        return None
    if not (F.calls(k_rope, (), ("expand",)) and _single_head_cache(k_rope.args[0], caches)
            and F.shape(k_rope)[1] == heads and F.shape(k_rope)[2] == t):
        return None
    rope = k_rope.args[0]
    if F.shape(key) != (b, heads, t, nope + F.shape(rope)[3]):
        return None
    return LatentKV(latent, rope, weight, heads, nope, v, expansion | {k_nope, k_rope})


def _split_query(q: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """A query built as ``cat((q_nope, q_rope), -1)`` splits into its halves (MLA's K layout)."""
    if F.calls(q, (torch.cat,)) and isinstance(q.args[0], (list, tuple)) and len(q.args[0]) == 2 \
            and F.arg(q, 1, "dim", 0) in (-1, len(F.shape(q)) - 1):
        return q.args[0][0], q.args[0][1]
    return q, None


def match_softmax_attention(softmax: fx.Node, caches: PositionCaches) -> tuple[AttentionMatch | None, str]:
    """``(match, "")``, or ``(None, why)`` when this softmax reads a position cache in a form not
    recognized, or ``(None, "")`` when it has nothing to do with position caches."""
    dim = F.arg(softmax, 1, "dim")
    logits = softmax.args[0]
    ndim = len(F.shape(logits))
    if dim not in (-1, ndim - 1) or ndim != 4:
        return None, ""
    user = _through_prob_casts(softmax)
    value = _match_value(user, caches) if user is not None else None
    terms = _additive_terms(logits, [])
    if value is None:
        reads = [t for t in terms if reads_cache(t, caches)]
        return None, ("its probabilities do not feed one weighted sum of a position cache" if reads else "")
    output, value_cache = value
    if not reads_cache(logits, caches) and not reads_cache(value_cache, caches):
        return None, ""  # attention over other tensors (a prefill over the chunk in hand)
    topk = mask = mask_kind = head_axis = None
    scores = []
    for term in terms:
        found = _additive_index_mask(term)
        if found is not None and topk is None:
            topk, head_axis = found, _head_axis(term)
            continue
        if F.calls(term, (torch.masked_fill,), ("masked_fill",)) and topk is None:
            found = _bool_index_mask(F.arg(term, 1, "mask"))
            fill = F.arg(term, 2, "value")
            if found is not None and isinstance(fill, (int, float)) and fill <= torch.finfo(torch.float32).min / 2:
                topk, mask, mask_kind = found, term.args[0], "additive"
                continue
        scores.append(term)
    if topk is None:
        return None, "no top-k mask (full(-inf).scatter_(-1, topk, 0), or masked_fill(ones.scatter(-1, topk, False)))"
    if len(scores) != 1 or _scaled(scores[0]) is None:
        return None, "the scores are not (q . k) * scale plus the masks"
    raw, scale = _scaled(scores[0])
    # absorbed MLA: (einsum(q_nope, kv) + einsum(q_pe, pe)) * scale
    products = _additive_terms(raw, [])
    if len(products) == 2 and all(_mla_score(p, caches) for p in products):
        (q1, c1), (q2, c2) = (_mla_score(p, caches) for p in products)
        if value_cache not in (c1, c2) or c1 is c2:
            return None, "the value is not one of the two score caches"
        (q_nope, kv), (q_pe, pe) = ((q1, c1), (q2, c2)) if c1 is value_cache else ((q2, c2), (q1, c1))
        if head_axis is None:
            return None, "the top-k mask is not unsqueezed over the heads (index_mask.unsqueeze(2))"
        return AttentionMatch("mla", output, q_nope, q_pe, (kv, pe), caches.layouts[kv], topk, None, None, scale,
                              head_axis), ""
    # per-head MHA: matmul(q, k.transpose(2, 3)) * scale, K and V position caches or their latent expansion
    if len(products) == 1 and F.calls(raw, MATMUL, ("matmul", "__matmul__")) \
            and F.calls(raw.args[1], (torch.transpose,), ("transpose",)) \
            and {d % 4 for d in raw.args[1].args[1:3]} == {2, 3}:
        return _per_head(output, raw.args[0], raw.args[1].args[0], value_cache, caches, topk, mask, mask_kind, scale)
    return None, "the scores are not q . k over position caches"


def _per_head(output, q, key, value, caches: PositionCaches, topk, mask, mask_kind, scale) -> tuple[AttentionMatch | None, str]:
    """Per-head attention of ``q`` over ``key`` and ``value``: position caches (``mha``), or K and V
    expanded from latent caches (absorbed ``mla``)."""
    q_nope, q_pe = _split_query(q)
    if key in caches.layouts and value in caches.layouts and caches.layouts[key].dim == 2:
        return AttentionMatch("mha", output, q_nope, q_pe, (key, value), caches.layouts[key], topk, mask, mask_kind,
                              scale, 1), ""
    latent = match_latent_kv(key, value, caches)
    if latent is None:
        return None, ("its K and V are neither position caches nor their latent expansion "
                      "(kv_b_proj(latent).view.transpose, split, new_empty + copy_ of the rope)")
    if q_pe is None or F.shape(q_nope)[-1] != latent.nope:
        return None, "the query is not cat(q_nope, q_rope) split as the key is"
    return AttentionMatch("mla", output, q_nope, q_pe, (latent.latent, latent.rope), caches.layouts[latent.latent],
                          topk, mask, mask_kind, scale, 1, latent), ""


# ``meta`` key of the node that reads a top-k as a set of positions, ``-1`` meaning none: the
# ``.long()`` that starts ``recognize_sparse_attention``'s slots (``match/position_indexer.py``).
SET_READ = "dsa_dcp_topk_set"


def integer_base(topk: fx.Node) -> fx.Node:
    """Through ``.long()``/``.int()``/``.to(int)`` back to the node the positions were computed as."""
    while F.calls(topk, (), ("long", "int", "to")) and isinstance(topk.args[0], fx.Node) \
            and topk.args[0].meta["example_value"].dtype in (torch.int32, torch.int64):
        topk = topk.args[0]
    return topk


def _head_axis(index_mask_term: fx.Node) -> int | None:
    """The index mask is broadcast over heads: ``.unsqueeze(2)`` (scores ``[B, S, H, T]``) or
    ``.unsqueeze(1)`` (``[B, H, S, T]``) says where the heads are."""
    node = index_mask_term
    while F.calls(node, (torch.unsqueeze,), ("unsqueeze", "view", "reshape", "expand")):
        if F.calls(node, (torch.unsqueeze,), ("unsqueeze",)) and F.arg(node, 1, "dim") in (1, 2):
            return F.arg(node, 1, "dim")
        node = node.args[0]
    return None


def reads_cache(node, caches: PositionCaches) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in caches.layouts:
            return True
        if not isinstance(n, fx.Node) or n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def match_sdpa(node: fx.Node, caches: PositionCaches) -> tuple[AttentionMatch | None, str]:
    q, k, v = node.args[:3]
    if not reads_cache(k, caches) and not reads_cache(v, caches):
        return None, ""
    attn_mask = F.arg(node, 3, "attn_mask")
    if F.arg(node, 4, "dropout_p", 0.0) != 0.0 or F.arg(node, 5, "is_causal", False) or attn_mask is None:
        return None, "scaled_dot_product_attention with dropout, is_causal or no mask"
    keep, topk = None, None
    if F.calls(attn_mask, AND, ("__and__", "logical_and", "bitwise_and")):
        for a, b in (attn_mask.args, attn_mask.args[::-1]):
            if F.calls(b, NOT, ("__invert__", "logical_not", "bitwise_not")) and _bool_index_mask(b.args[0]):
                keep, topk = a, _bool_index_mask(b.args[0])
    elif F.calls(attn_mask, NOT, ("__invert__", "logical_not", "bitwise_not")):
        topk = _bool_index_mask(attn_mask.args[0])
    if topk is None:
        return None, "its attn_mask is not the model mask & ~ones.scatter(-1, topk, False)"
    scale = F.arg(node, 6, "scale")
    scale = float(scale) if scale is not None else F.shape(q)[-1] ** -0.5
    return _per_head(node, q, k, v, caches, topk, keep, "keep" if keep is not None else None, scale)
