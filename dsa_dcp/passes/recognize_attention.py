"""Recognize sparse attention as model authors write it, and rewrite it into the op vocabulary.

Expects: dynamo's graph of a model whose KV caches are position caches (graph inputs whose real
tensors are ``PositionShardedCache``, ``dsa_dcp.position_cache``) and whose attention reads them
densely, with the top-k applied as a mask (``docs/models.md`` shows each form's graph):

- **absorbed MLA** (DeepSeek's published code)::

      scores = (einsum("bshc,btc->bsht", q_nope, kv[:b, :e]) + einsum("bshr,btr->bsht", q_pe, pe[:b, :e])) * scale
      scores += full((b, 1, e), -inf).scatter_(-1, topk, 0).unsqueeze(2)
      o = einsum("bsht,btc->bshc", scores.softmax(-1, dtype=float32).type_as(x), kv[:b, :e])

- **eager MHA** (transformers ``eager``)::

      index_mask = topk.new_ones((B, S, T), dtype=bool).scatter(-1, topk.long(), False).unsqueeze(1)
      w = matmul(q, k_cache.transpose(2, 3)) * scale + mask.masked_fill(index_mask, finfo.min)
      o = matmul(softmax(w, -1, dtype=float32).to(q.dtype) [-> dropout(p=0)], v_cache)

- **SDPA** (transformers ``sdpa``): ``scaled_dot_product_attention(q, k_cache, v_cache,
  attn_mask=mask & ~index_mask, scale=scale)``.

- **latent MLA, expanded after the read** (transformers from 5.18: the caches hold MLA's latent
  ``[B, 1, T, Dc]`` and rope ``[B, 1, T, Dr]``), the eager or SDPA form above over::

      kv = kv_b_proj(latent).view(B, T, H, Dn + Dv).transpose(1, 2)
      k_nope, v = split(kv, [Dn, Dv], -1)
      k = kv.new_empty(B, H, T, Dn + Dr); k[..., :Dn].copy_(k_nope); k[..., Dn:].copy_(rope.expand(-1, H, -1, -1))

  which becomes absorbed MLA over the latent cache (``W_UK`` folded into the query, ``W_UV``
  applied to the attention's output), so no step expands the cache.

Leaves, for each: ``out, lse = sparse_{mla,mha}_positions(q_nope, q_pe, [local caches], slots, scale)``
(the latent form: ``sparse_mla_positions`` of the absorbed query, then ``W_UV``)
over the flat slots ``b * T + topk`` (``-1`` where the model's own mask excludes the position),
``out`` reshaped back to the layout the model's code continues with; the dense scores, the
``[B, S, T]`` index mask and the cache reads are gone. Every write into a position cache is
localized (``position_caches.py``). Layers that pass one top-k along (GLM's shared indexer) get one
slots tensor, so ``share_remaps`` later keeps one remap for them. Then the DCP passes
(``dcp_rewrite``, ``share_remaps``, ``fuse_merge``) treat these ops like ``sparse_mla``.

Refuses (``check``) any other use of a position cache, a cache allocated for other options, and
a model mask that is not ``[B or 1, 1, S, T]``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from dsa_dcp.ops_positions import SPARSE_MHA_POSITIONS, SPARSE_MLA_POSITIONS
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan
from dsa_dcp.passes.errors import where
from dsa_dcp.passes.position_caches import (PositionWrite, call, insert_local_views, layout_problems,
                                            localize_writes, match_write, method, position_caches, stray_uses)
from dsa_dcp.position_cache import PositionLayout

EINSUM = {torch.einsum, torch.functional.einsum}
MATMUL = {torch.matmul, operator.matmul}
SOFTMAX = {torch.softmax, F.softmax, torch.nn.functional.softmax}
SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
ADD = {operator.add, operator.iadd, torch.add}
MUL = {operator.mul, operator.imul, torch.mul}
AND = {operator.and_, torch.logical_and, torch.bitwise_and}
NOT = {operator.invert, torch.logical_not, torch.bitwise_not}
# ops between the softmax and the weighted sum that keep the probabilities' values (fp32 here)
PROB_CASTS = {"to", "type_as", "float", "type", "contiguous"}


def _is(node, targets=(), methods=()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in methods


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _shape(node) -> list:
    return list(node.meta["example_value"].shape)


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


def _uncast(node):
    """Through casts that widen to float32 (``.float()``, ``.to(torch.float32)``, ``.type_as(t)`` of a
    float32 ``t``) back to what was cast: the attention ops compute in float32 from the cache's own
    dtype, so such a cast of a cache read, a score or a query changes no value they compute."""
    while _is(node, (), ("float", "to", "type_as")) and isinstance(node.args[0], fx.Node) \
            and "example_value" in node.meta and "example_value" in node.args[0].meta:
        before, after = node.args[0].meta["example_value"], node.meta["example_value"]
        if not (after.dtype == torch.float32 and before.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and after.device == before.device and after.shape == before.shape):
            break
        node = node.args[0]
    return node


def _strip_views(node):
    """``unsqueeze``/``view``/``reshape`` chains in front of an index mask."""
    while _is(node, (torch.unsqueeze,), ("unsqueeze", "view", "reshape", "expand")):
        node = node.args[0]
    return node


def _index_mask_topk(node) -> tuple[fx.Node, bool] | None:
    """``(topk, masked_value)`` of ``scatter(base, -1, topk, v)``: the positions the top-k names get ``v``."""
    if not _is(node, (torch.scatter,), ("scatter", "scatter_")) or len(node.args) < 4:
        return None
    dim, topk, value = node.args[1], node.args[2], node.args[3]
    if dim not in (-1, len(_shape(node)) - 1) or not isinstance(topk, fx.Node):
        return None
    return topk, value


def _additive_index_mask(term) -> fx.Node | None:
    """``full(.., -inf).scatter_(-1, topk, 0)`` (viewed) -> topk."""
    scatter = _strip_views(term)
    found = _index_mask_topk(scatter)
    if found is None or found[1] not in (0, 0.0):
        return None
    base = scatter.args[0]
    fill = _arg(base, 1, "fill_value") if _is(base, (torch.full,)) else \
        _arg(base, 1, "fill_value") if _is(base, (), ("new_full",)) else None
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
    if not (_is(base, (torch.ones,), ("new_ones",)) and base.meta["example_value"].dtype == torch.bool):
        return None
    return found[0]


def _additive_terms(node, out: list) -> list:
    node = _uncast(node)
    if _is(node, ADD, ("add", "add_", "__add__", "__iadd__")) and len(node.args) == 2 \
            and all(isinstance(a, fx.Node) for a in node.args) and _arg(node, 2, "alpha", 1) == 1:
        _additive_terms(node.args[0], out)
        _additive_terms(node.args[1], out)
    else:
        out.append(node)
    return out


def _scaled(node) -> tuple[fx.Node, float] | None:
    node = _uncast(node)
    if _is(node, MUL, ("mul", "mul_", "__mul__")) and len(node.args) == 2:
        a, b = node.args
        if isinstance(b, (int, float)) and isinstance(a, fx.Node):
            return a, float(b)
        if isinstance(a, (int, float)) and isinstance(b, fx.Node):
            return b, float(a)
    return None


class _Caches:
    """The position caches of this graph and how their reads look."""

    def __init__(self, layouts: dict[fx.Node, PositionLayout]):
        self.layouts = layouts

    def prefix_read(self, node) -> fx.Node | None:
        """``cache[:b, :e]`` along the position dim (or the cache itself) -> the cache."""
        if node in self.layouts:
            return node
        if _is(node, (operator.getitem,)) and node.args[0] in self.layouts:
            cache, index = node.args
            dim = self.layouts[cache].dim
            index = index if isinstance(index, tuple) else (index,)
            if all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in index) \
                    and all(i.stop is None for i in index[1:dim] + index[dim + 1:]):
                return cache
        return None

    def transposed(self, node) -> fx.Node | None:
        """``cache.transpose(-2, -1)`` of a ``[B, H, T, D]`` cache -> the cache."""
        if _is(node, (torch.transpose,), ("transpose",)) and node.args[0] in self.layouts:
            dims = {d % 4 for d in node.args[1:3]}
            if dims == {2, 3} and self.layouts[node.args[0]].dim == 2:
                return node.args[0]
        return None


def _einsum_parts(node) -> tuple[str, str, str, fx.Node, fx.Node] | None:
    if not (_is(node, EINSUM) and len(node.args) == 3 and isinstance(node.args[0], str)):
        return None
    lhs, _, res = node.args[0].replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    return ops[0], ops[1], res, node.args[1], node.args[2]


def _mla_score(node, caches: _Caches):
    """``einsum("bshc,btc->bsht", q, cache[:b, :e])`` -> (q, cache) when the letters line up."""
    parts = _einsum_parts(node)
    if parts is None:
        return None
    a, b, res, q, read = parts
    cache = caches.prefix_read(_uncast(read))
    if cache is None or len(a) != 4 or len(b) != 3 or len(res) != 4:
        return None
    if not (b[0] == a[0] and b[2] == a[3] and res == a[:3] + b[1] and b[1] not in a):
        return None
    return q, cache


def _match_value(prob_user, caches: _Caches):
    """The weighted sum fed by the probabilities: ``(node, value cache)``."""
    node = prob_user
    parts = _einsum_parts(node)
    if parts is not None:
        a, b, res, _, read = parts
        cache = caches.prefix_read(_uncast(read))
        if cache is not None and len(a) == 4 and len(b) == 3 and b[0] == a[0] and b[1] == a[3] \
                and res == a[:3] + b[2]:
            return node, cache
        return None
    if _is(node, MATMUL, ("matmul", "__matmul__")):
        return node, node.args[1]  # a cache, or the value a latent expansion computes (checked with the key)
    return None


def _through_prob_casts(node: fx.Node) -> fx.Node | None:
    """Follow single-user casts (and a no-op dropout) from the softmax to the weighted sum."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if _is(user, (), PROB_CASTS) or (_is(user, (F.dropout, torch.dropout)) and
                                         _arg(user, 1, "p", 0.5) == 0.0):
            node = user
            continue
        return user
    return None


def _single_head_cache(node, caches: "_Caches") -> bool:
    return node in caches.layouts and caches.layouts[node].dim == 2 and _shape(node)[1] == 1


def match_latent_kv(key: fx.Node, value: fx.Node, caches: "_Caches") -> LatentKV | None:
    """``key`` and ``value`` (the attention's ``[B, H, T, D]`` operands) as the latent expansion of
    the module docstring, or ``None``."""
    if not (_is(key, (), ("new_empty",)) and _is(value, (operator.getitem,)) and value.args[1] == 1):
        return None
    split = value.args[0]
    if not (_is(split, (torch.split, torch.functional.split), ("split",)) and _arg(split, 2, "dim") in (-1, 3)
            and isinstance(split.args[1], (list, tuple)) and len(split.args[1]) == 2):
        return None
    nope, v = split.args[1]
    kv = split.args[0]
    if not (_is(kv, (torch.transpose,), ("transpose",)) and {d % 4 for d in kv.args[1:3]} == {1, 2}):
        return None
    view = kv.args[0]
    if not (_is(view, (), ("view", "reshape")) and _is(view.args[0], (torch._C._nn.linear, F.linear))):
        return None
    linear = view.args[0]
    latent, weight, bias = linear.args[0], linear.args[1], _arg(linear, 2, "bias")
    if bias is not None or not _single_head_cache(latent, caches):
        return None
    b, _, t, dc = _shape(latent)
    heads = _shape(kv)[1]
    if _shape(view) != [b, t, heads, nope + v] or _shape(weight) != [heads * (nope + v), dc]:
        return None
    # k = new_empty(..); k[..., :nope].copy_(k_nope); k[..., nope:].copy_(rope.expand(-1, H, -1, -1))
    copies, expansion = {}, {linear, view, kv, split, value, key}
    for user in key.users:
        if _is(user, (operator.getitem,)):
            index = user.args[1]
            if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
                    and isinstance(index[1], slice) and len(user.users) == 1):
                return None
            (copy,) = user.users
            if not (_is(copy, (), ("copy_",)) and copy.args[0] is user and not copy.users):
                return None
            copies[(index[1].start, index[1].stop)] = copy.args[1]
            expansion |= {user, copy}
    k_nope, k_rope = copies.get((None, nope)), copies.get((nope, None))
    if len(copies) != 2 or k_nope is None or k_rope is None:
        return None
    if not (_is(k_nope, (operator.getitem,)) and k_nope.args[0] is split and k_nope.args[1] == 0):
        return None
    if not (_is(k_rope, (), ("expand",)) and _single_head_cache(k_rope.args[0], caches)
            and _shape(k_rope)[1] == heads and _shape(k_rope)[2] == t):
        return None
    rope = k_rope.args[0]
    if _shape(key) != [b, heads, t, nope + _shape(rope)[3]]:
        return None
    return LatentKV(latent, rope, weight, heads, nope, v, expansion | {k_nope, k_rope})


def _split_query(q: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """A query built as ``cat((q_nope, q_rope), -1)`` splits into its halves (MLA's K layout)."""
    if _is(q, (torch.cat,)) and isinstance(q.args[0], (list, tuple)) and len(q.args[0]) == 2 \
            and _arg(q, 1, "dim", 0) in (-1, len(_shape(q)) - 1):
        return q.args[0][0], q.args[0][1]
    return q, None


def match_softmax_attention(softmax: fx.Node, caches: _Caches) -> tuple[AttentionMatch | None, str]:
    """``(match, "")``, or ``(None, why)`` when this softmax reads a position cache in a form not
    recognized, or ``(None, "")`` when it has nothing to do with position caches."""
    dim = _arg(softmax, 1, "dim")
    logits = softmax.args[0]
    ndim = len(_shape(logits))
    if dim not in (-1, ndim - 1) or ndim != 4:
        return None, ""
    user = _through_prob_casts(softmax)
    value = _match_value(user, caches) if user is not None else None
    terms = _additive_terms(logits, [])
    if value is None:
        reads = [t for t in terms if _reads_cache(t, caches)]
        return None, ("its probabilities do not feed one weighted sum of a position cache" if reads else "")
    output, value_cache = value
    if not _reads_cache(logits, caches) and not _reads_cache(value_cache, caches):
        return None, ""  # attention over other tensors (a prefill over the chunk in hand)
    topk = mask = mask_kind = head_axis = None
    scores = []
    for term in terms:
        found = _additive_index_mask(term)
        if found is not None and topk is None:
            topk, head_axis = found, _head_axis(term)
            continue
        if _is(term, (torch.masked_fill,), ("masked_fill",)) and topk is None:
            found = _bool_index_mask(_arg(term, 1, "mask"))
            fill = _arg(term, 2, "value")
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
    if len(products) == 1 and _is(raw, MATMUL, ("matmul", "__matmul__")) \
            and _is(raw.args[1], (torch.transpose,), ("transpose",)) \
            and {d % 4 for d in raw.args[1].args[1:3]} == {2, 3}:
        return _per_head(output, raw.args[0], raw.args[1].args[0], value_cache, caches, topk, mask, mask_kind, scale)
    return None, "the scores are not q . k over position caches"


def _per_head(output, q, key, value, caches: _Caches, topk, mask, mask_kind, scale) -> tuple[AttentionMatch | None, str]:
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
    if q_pe is None or _shape(q_nope)[-1] != latent.nope:
        return None, "the query is not cat(q_nope, q_rope) split as the key is"
    return AttentionMatch("mla", output, q_nope, q_pe, (latent.latent, latent.rope), caches.layouts[latent.latent],
                          topk, mask, mask_kind, scale, 1, latent), ""


def _size(graph: fx.Graph, node: fx.Node, dim: int):
    """``node``'s size along ``dim``: an int, or a node computing it (a symbolic size is never a constant)."""
    size = _shape(node)[dim]
    return size if isinstance(size, int) else call(graph, torch.ops.aten.sym_size.int, node, dim)


def _integer_base(topk: fx.Node) -> fx.Node:
    """Through ``.long()``/``.int()``/``.to(int)`` back to the node the positions were computed as."""
    while _is(topk, (), ("long", "int", "to")) and isinstance(topk.args[0], fx.Node) \
            and topk.args[0].meta["example_value"].dtype in (torch.int32, torch.int64):
        topk = topk.args[0]
    return topk


def _head_axis(index_mask_term: fx.Node) -> int | None:
    """The index mask is broadcast over heads: ``.unsqueeze(2)`` (scores ``[B, S, H, T]``) or
    ``.unsqueeze(1)`` (``[B, H, S, T]``) says where the heads are."""
    node = index_mask_term
    while _is(node, (torch.unsqueeze,), ("unsqueeze", "view", "reshape", "expand")):
        if _is(node, (torch.unsqueeze,), ("unsqueeze",)) and _arg(node, 1, "dim") in (1, 2):
            return _arg(node, 1, "dim")
        node = node.args[0]
    return None


def _reads_cache(node, caches: _Caches) -> bool:
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


def match_sdpa(node: fx.Node, caches: _Caches) -> tuple[AttentionMatch | None, str]:
    q, k, v = node.args[:3]
    if not _reads_cache(k, caches) and not _reads_cache(v, caches):
        return None, ""
    attn_mask = _arg(node, 3, "attn_mask")
    if _arg(node, 4, "dropout_p", 0.0) != 0.0 or _arg(node, 5, "is_causal", False) or attn_mask is None:
        return None, "scaled_dot_product_attention with dropout, is_causal or no mask"
    keep, topk = None, None
    if _is(attn_mask, AND, ("__and__", "logical_and", "bitwise_and")):
        for a, b in (attn_mask.args, attn_mask.args[::-1]):
            if _is(b, NOT, ("__invert__", "logical_not", "bitwise_not")) and _bool_index_mask(b.args[0]):
                keep, topk = a, _bool_index_mask(b.args[0])
    elif _is(attn_mask, NOT, ("__invert__", "logical_not", "bitwise_not")):
        topk = _bool_index_mask(attn_mask.args[0])
    if topk is None:
        return None, "its attn_mask is not the model mask & ~ones.scatter(-1, topk, False)"
    scale = _arg(node, 6, "scale")
    scale = float(scale) if scale is not None else _shape(q)[-1] ** -0.5
    return _per_head(node, q, k, v, caches, topk, keep, "keep" if keep is not None else None, scale)


# --------------------------------------------------------------------------- the pass


@dataclasses.dataclass
class RecognitionPlan(Plan):
    layouts: dict[fx.Node, PositionLayout] = dataclasses.field(default_factory=dict)
    matches: list[AttentionMatch] = dataclasses.field(default_factory=list)
    writes: list[PositionWrite] = dataclasses.field(default_factory=list)
    declined: list[str] = dataclasses.field(default_factory=list)  # dcp_size 1: left as written, and why


class RecognizeSparseAttention(DCPPass):
    """Rewrite attention over position caches into ``sparse_{mla,mha}_positions`` and localize
    position-cache writes (module docstring). A graph without position caches is left as it is."""

    name = "recognize_sparse_attention"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> RecognitionPlan:
        """Under DCP every use of a position cache must be recognized or is refused. In a group of one
        the cache holds every position, so what is not recognized stays as written (the reasons are
        the pass's ``declined`` stat) and only the recognized attention becomes sparse."""
        layouts = position_caches(gm, ctx.example_inputs)
        caches = _Caches(layouts)
        problems, declined, matches, writes = [], [], [], []
        if not layouts:
            return RecognitionPlan(problems, [], layouts, matches, writes)
        for cache, layout in layouts.items():
            problems += layout_problems(cache, layout, ctx.dcp_size, ctx.options.interleave)
        for node in gm.graph.nodes:
            if _is(node, SOFTMAX, ("softmax",)):
                match, why = match_softmax_attention(node, caches)
            elif _is(node, SDPA):
                match, why = match_sdpa(node, caches)
            else:
                continue
            if match is not None and not self._mask_problems(match):
                matches.append(match)
            elif match is not None:
                declined += self._mask_problems(match)
            elif why:
                declined.append(f"{node.name} attends over a position cache in a form the DCP rewrite does not "
                                f"recognize: {why}{where(node)}")
        consumed = self._consumed(gm, matches)
        for cache, layout in layouts.items():
            allowed = set()
            for user in cache.users:
                write, why = match_write(user, cache, layout)
                if write is not None:
                    writes.append(write)
                    allowed.add(user)
                elif why:
                    declined.append(f"position cache {cache.name}: {why}: {user.format_node()}{where(user)}")
                    allowed.add(user)
            declined += stray_uses(cache, allowed | consumed)
        if ctx.dcp_size == 1:  # the whole cache: the model's own writes and reads stay valid
            return RecognitionPlan(problems, [], layouts, matches, [], declined=declined)
        problems += declined
        if ctx.options.debug_checks and matches:
            problems.append("debug_checks are not available yet for attention over position caches")
        return RecognitionPlan(problems, [], layouts, matches, writes)

    @staticmethod
    def _mask_problems(match: AttentionMatch) -> list[str]:
        if match.mask is None:
            return []
        shape, s, t = _shape(match.mask), _shape(match.topk)[1], match.layout.length
        if len(shape) != 4 or shape[1] != 1 or shape[2] != s or shape[3] != t:
            return [f"the attention mask {match.mask.name} of {match.output.name} is {shape}; the DCP rewrite reads "
                    f"[B or 1, 1, {s}, {t}] masks{where(match.output)}"]
        return []

    @staticmethod
    def _consumed(gm: fx.GraphModule, matches: list[AttentionMatch]) -> set[fx.Node]:
        """The nodes only the dense attention uses (its output, and every node all of whose users
        are such nodes): removed with it. The model's own values (queries, top-k, mask) stay."""
        consumed = {m.output for m in matches} | {n for m in matches if m.latent for n in m.latent.expansion}
        stop = set().union(*(m.inputs() | {_integer_base(m.topk)} for m in matches)) if matches else set()
        for node in reversed(list(gm.graph.nodes)):
            if node in consumed or node in stop or node.op in ("placeholder", "output"):
                continue
            if node.users and all(u in consumed for u in node.users):
                consumed.add(node)
        return consumed

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: RecognitionPlan) -> dict:
        if not plan.layouts:
            return {"position_caches": 0, "attention_recognized": 0, "writes_localized": 0, "declined": []}
        local = insert_local_views(gm, plan.layouts, ctx.example_inputs)
        slots_cache: dict[tuple, fx.Node] = {}
        for match in plan.matches:
            self._rewrite(gm, match, local, slots_cache)
        localizations = localize_writes(gm, plan.writes, local, ctx.dcp_size, ctx.rank, ctx.options.interleave)
        self._erase_dead(gm, self._consumed(gm, plan.matches))
        return {"position_caches": len(plan.layouts), "attention_recognized": len(plan.matches),
                "forms": sorted({m.kind for m in plan.matches}), "writes_localized": len(plan.writes),
                "position_localizations": localizations, "slots_tensors": len(slots_cache), "declined": plan.declined}

    @staticmethod
    def _slots(graph: fx.Graph, match: AttentionMatch, slots_cache: dict) -> fx.Node:
        """Flat slots ``[B*S, K]``: ``b * T + topk``, ``-1`` where the model's mask drops the position.
        One per (top-k value, mask): layers that pass one top-k along share it."""
        topk = _integer_base(match.topk)
        key = (topk, match.mask, match.mask_kind, match.layout.length)
        if key in slots_cache:
            return slots_cache[key]
        b, s = _size(graph, topk, 0), _size(graph, topk, 1)
        positions = method(graph, "long", topk)
        valid = call(graph, operator.ge, positions, 0)
        if match.mask is not None:
            mask = call(graph, operator.getitem, match.mask, (slice(None), 0))
            mask = method(graph, "expand", mask, b, s, match.layout.length)
            picked = call(graph, torch.gather, mask, -1, call(graph, torch.clamp, positions, 0))
            if match.mask_kind == "additive":  # transformers' 0 / finfo.min masks (or -inf)
                picked = call(graph, operator.gt, picked, torch.finfo(picked.meta["example_value"].dtype).min / 2)
            valid = call(graph, operator.and_, valid, picked)
        rows = method(graph, "view", call(graph, torch.arange, b, device=positions.meta["example_value"].device),
                      b, 1, 1)
        flat = call(graph, operator.add, positions, call(graph, operator.mul, rows, match.layout.length))
        flat = call(graph, torch.where, valid, flat, -1)
        slots = method(graph, "flatten", flat, 0, 1)
        slots_cache[key] = slots
        return slots

    def _rewrite(self, gm: fx.GraphModule, match: AttentionMatch, local: dict, slots_cache: dict) -> None:
        graph = gm.graph
        anchor = match.output
        with graph.inserting_before(anchor):
            slots = self._slots(graph, match, slots_cache)

            def rows(q: fx.Node) -> fx.Node:  # [B, S, H, D] or [B, H, S, D] -> [B*S, H, D]
                if match.head_axis == 1:
                    q = method(graph, "transpose", q, 1, 2)
                return method(graph, "flatten", q, 0, 1)

            q_nope = rows(match.q_nope)
            q_pe = rows(match.q_pe) if match.q_pe is not None else \
                call(graph, operator.getitem, q_nope, (Ellipsis, slice(0, 0)))
            caches = [local[c] for c in match.caches]
            latent = match.latent
            if latent is not None:  # absorbed: q_nope . (W_UK latent) = (q_nope W_UK) . latent
                w = method(graph, "view", latent.weight, latent.heads, latent.nope + latent.value, -1)
                w_uk = call(graph, operator.getitem, w, (slice(None), slice(None, latent.nope)))
                w_uv = call(graph, operator.getitem, w, (slice(None), slice(latent.nope, None)))
                q_nope = call(graph, torch.einsum, "rhd,hdc->rhc", q_nope, w_uk)
                caches = [method(graph, "select", c, 1, 0) for c in caches]  # [B, 1, T, D] -> [B, T, D]
            op = SPARSE_MLA_POSITIONS if match.kind == "mla" else SPARSE_MHA_POSITIONS
            attn = call(graph, op, q_nope, q_pe, caches, slots, match.scale)
            out = call(graph, operator.getitem, attn, 0)
            call(graph, operator.getitem, attn, 1)  # the LSE, for the merge
            if latent is not None:  # the per-head value up-projection, after the merge
                out = call(graph, torch.einsum, "rhc,hdc->rhd", out, w_uv)
            out = method(graph, "unflatten", out, 0, (_size(graph, match.topk, 0), _size(graph, match.topk, 1)))
            if match.head_axis == 1:
                out = method(graph, "transpose", out, 1, 2)
            if out.meta["example_value"].dtype != anchor.meta["example_value"].dtype:
                out = method(graph, "to", out, anchor.meta["example_value"].dtype)
        anchor.replace_all_uses_with(out)

    @staticmethod
    def _erase_dead(gm: fx.GraphModule, candidates: set[fx.Node]) -> None:
        for node in reversed(list(gm.graph.nodes)):
            if node in candidates and not node.users:
                gm.graph.erase_node(node)
