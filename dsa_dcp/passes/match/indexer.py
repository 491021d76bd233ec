"""Matcher for the lightning indexer as a model writes it, from its ``torch.topk`` node backwards.

By structure (never by module names), in the form ``LightningIndexer.forward`` of
``dsa_dcp/models/dsa.py`` has and the variations a plain-PyTorch author writes::

    pages = page_table.index_select(0, req) [.long()]        # or page_table[req]
    cand  = (pages.unsqueeze(-1) * P + arange(P)).flatten(1)  # or a reshape/view to [T, C]
    valid = (arange(C)[None] <= positions[:, None]) & (cand >= 0)     # any and/or/not of these
    keys  = index_cache[cand.clamp(min=0)] [.float()]
            [* key_scale[cand.clamp(min=0)].unsqueeze(-1)]   # FP8 keys with one fp32 scale a token
    logits = einsum("thd,tcd->thc", q [.float()], keys).relu()         # or q @ keys.transpose(1, 2)
    score = einsum("thc,th->tc", logits, w)                  # or (logits * w[..., None]).sum(1), a matmul
    score = score.masked_fill(~valid, -inf)                  # or torch.where(valid, score, -inf)
    val, idx = torch.topk(score, K, dim=-1)
    topk = torch.where(val == -inf, -1, cand.gather(1, idx)) [.to(torch.int32)]

``find_indexers(gm)`` returns an ``IndexerMatch`` per recognized indexer and, for every other
``torch.topk``, why not (``NoMatch``): another mask, scores in another dtype, a top-k read by
anything but sparse attention, a write between its reads. It changes nothing; the rewrite that
consumes the matches is ``passes/indexer.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsa_dcp.ops import SPARSE_ATTENTION_OPS
from dsa_dcp.passes import fx as F

_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq", "ne": "ne"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # widened to fp32 exactly
_INTS = (torch.int32, torch.int64)


class NoMatch(Exception):
    """Why a ``torch.topk`` node is not an indexer the pass can replace."""


def _is_neg_inf(value: object) -> bool:
    return isinstance(value, float) and value == float("-inf")


def _dtype_arg(node: fx.Node) -> torch.dtype | None:
    """The target dtype of a conversion node (``float``, ``long``, ``int``, ``to(dtype)``, ``type(dtype)``)."""
    name = F.op_name(node)
    fixed = {"float": torch.float32, "long": torch.int64, "int": torch.int32}
    if name in fixed and len(node.args) == 1 and not node.kwargs:
        return fixed[name]
    if name in ("to", "type"):
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        extra = set(node.kwargs) - {"dtype"}
        if isinstance(dtype, torch.dtype) and not extra and len(node.args) <= 2:
            return dtype
    return None


@dataclasses.dataclass
class IndexerMatch:
    """One recognized indexer: what the ops need, and the nodes that implement it now."""

    topk: fx.Node  # the torch.topk node
    result: fx.Node  # the top-k slots the model hands on (replaced)
    q: fx.Node
    w: fx.Node
    index_cache: fx.Node
    page_table: fx.Node
    req_ids: fx.Node  # the request index the model reads the page table with
    positions: fx.Node
    page_size: int
    k: int
    nodes: list[fx.Node]  # every node of the pattern (erased once nothing else uses it)
    key_scale: fx.Node | None = None  # FP8 keys: the per-token fp32 scales [S]


class _Matcher:
    """Matches one ``torch.topk`` node backwards (see module docstring); raises ``NoMatch``."""

    def __init__(self, topk: fx.Node) -> None:
        self.topk = topk
        self.nodes: list[fx.Node] = [topk]
        self.positions: fx.Node | None = None
        self.key_scale: fx.Node | None = None

    def take(self, *nodes: fx.Node) -> None:
        self.nodes += [n for n in nodes if isinstance(n, fx.Node)]

    # ------------------------------------------------------------------ the top-k and what follows it
    def match(self) -> IndexerMatch:
        topk = self.topk
        score, k = F.arg(topk, 0, "input"), F.arg(topk, 1, "k")
        if not isinstance(k, int) or isinstance(k, bool):
            raise NoMatch(f"its k is not a constant int ({k!r})")
        if F.arg(topk, 2, "dim", -1) not in (-1, 1) or F.arg(topk, 3, "largest", True) is not True:
            raise NoMatch("it is not a top-k of the largest values along the last dim of a [T, C] tensor")
        shape = F.shape(score)
        if shape is None or len(shape) != 2 or F.dtype(score) != torch.float32:
            raise NoMatch(f"it does not select from fp32 scores [T, C] (got {shape}, {F.dtype(score)})")
        items = {}
        for user in topk.users:
            if F.op_name(user) != "getitem" or user.args[1] not in (0, 1) or user.args[1] in items:
                raise NoMatch(f"its result is used by {user.format_node()}, not as (values, indices)")
            items[user.args[1]] = user
        if set(items) != {0, 1}:
            raise NoMatch("it needs both its values (the -inf test) and its indices")
        self.take(*items.values())
        unmasked, mask, means_valid = self._masked(score)
        cand, result = self._result(items[0], items[1])
        self._consumers(result)
        cand_of = self._candidates(cand)  # (page_table, req, page_size)
        q, w, keys = self._scores(unmasked)
        cache = self._key_gather(keys, cand)
        if F.dtype(q) == torch.float8_e4m3fn and self.key_scale is None:
            raise NoMatch(f"the query {q.name} is E4M3 but the keys are not (FP8 queries go with FP8 keys)")
        self._mask(mask, means_valid, cand, shape)
        page_table, req, page_size = cand_of
        t, _ = shape
        heads = (F.shape(w) or (0, 0))[1]
        if F.shape(q) != (t, heads, (F.shape(cache) or (0, 0))[1]) or F.shape(w) != (t, heads):
            raise NoMatch(f"q {F.shape(q)}, w {F.shape(w)} and the index cache {F.shape(cache)} are not [T, H, D], [T, H] "
                          f"and [S, D]")
        match = IndexerMatch(topk, result, q, w, cache, page_table, req, self.positions, page_size, k, self.nodes,
                             self.key_scale)
        self._check_inputs(match)
        return match

    def _result(self, values: fx.Node, indices: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``where(values == -inf, -1, cand.gather(1, indices))`` [converted]: (cand, the result node)."""
        gathers = [u for u in indices.users if F.op_name(u) == "gather" and F.arg(u, 1, "dim") in (1, -1)
                   and F.arg(u, 2, "index") is indices and u.args[0] is not indices and not u.kwargs.get("sparse_grad")]
        if len(gathers) != 1:
            raise NoMatch(f"its indices ({indices.name}) are not read by one cand.gather(1, indices)")
        gather = gathers[0]
        cand = gather.args[0]
        test = self._only_user(values, "the top-k values")
        name, args = F.op_name(test), test.args
        if name in ("eq", "ne") and len(args) == 2 and values in args and _is_neg_inf(args[1 - args.index(values)]):
            is_empty = name == "eq"
        elif name == "isneginf" and args == (values,):
            is_empty = True
        else:
            raise NoMatch(f"its values are used by {test.format_node()}, not a test for -inf")
        self.take(gather, test)
        pick = self._only_user(test, "the -inf test")
        # what else reads the slots or the indices must be the -1 fill shaped like them
        fills = [u for u in list(gather.users) + list(indices.users) if u is not pick and u is not gather]
        if F.op_name(pick) == "masked_fill" and is_empty and pick.args[:2] == (gather, test) and \
                F.arg(pick, 2, "value") == -1:
            pass
        elif F.op_name(pick) == "where" and len(pick.args) == 3 and pick.args[0] is test:
            chosen, other = (pick.args[2], pick.args[1]) if is_empty else (pick.args[1], pick.args[2])
            if chosen is not gather or not (self._is_fill(other, gather, -1) or self._is_fill(other, indices, -1)):
                raise NoMatch(f"{pick.format_node()} does not put -1 where the top-k value is -inf")
            fills = [f for f in fills if f is not other]
        else:
            raise NoMatch(f"the -inf test is used by {pick.format_node()}, not where(..., -1, slots)")
        if fills:
            raise NoMatch(f"the top-k's slots or indices are also used by {fills[0].format_node()}")
        self.take(pick)
        result = pick
        if len(pick.users) == 1:
            user = next(iter(pick.users))
            if _dtype_arg(user) in _INTS:
                self.take(user)
                result = user
        if F.dtype(result) not in _INTS:
            raise NoMatch(f"the top-k {result.name} is not int32 or int64 slots")
        return cand, result

    def _is_fill(self, value: object, like: fx.Node, fill: int) -> bool:
        if value == fill and isinstance(value, int):
            return True
        if F.op_name(value) == "full_like" and value.args[:2] == (like, fill) and set(value.kwargs) <= {"dtype"} \
                and len(value.users) == 1:
            self.take(value)
            return True
        return False

    @staticmethod
    def _only_user(node: fx.Node, what: str) -> fx.Node:
        if len(node.users) != 1:
            raise NoMatch(f"{what} ({node.name}) have {len(node.users)} users, the pattern has one")
        return next(iter(node.users))

    @staticmethod
    def _consumers(result: fx.Node) -> None:
        """The top-k must be read as a set: by sparse attention only (topk_select orders by position)."""
        if not result.users:
            raise NoMatch(f"its top-k {result.name} is not used")
        for user in result.users:
            spec = user.op == "call_function" and user.target in SPARSE_ATTENTION_OPS
            if not (spec and len(user.args) > 3 and user.args[3] is result
                    and result not in user.args[:3] + user.args[4:] and result not in user.kwargs.values()):
                raise NoMatch(f"its top-k {result.name} is used by {user.format_node()}, which may depend on its "
                              f"order (topk_select lists the selection by position; sparse attention needs the set)")

    # ------------------------------------------------------------------ the candidates
    def _candidates(self, cand: fx.Node) -> tuple[fx.Node, fx.Node, int]:
        """``cand = (pages.unsqueeze(-1) * P + arange(P)).flatten(1)``: (page_table, req, P)."""
        shape = F.shape(cand)
        if F.dtype(cand) not in _INTS or shape is None or len(shape) != 2:
            raise NoMatch(f"the gathered candidates {getattr(cand, 'name', cand)} are not an int [T, C] tensor")
        grid = cand.args[0] if F.op_name(cand) in ("flatten", "reshape", "view") and cand.args else None
        if grid is None or F.shape(grid) is None or len(F.shape(grid)) != 3 or \
                (F.op_name(cand) == "flatten" and F.arg(cand, 1, "start_dim", 0) != 1):
            raise NoMatch(f"the candidates {cand.name} are not a [T, pages, P] grid flattened to [T, C]")
        t, max_pages, page_size = F.shape(grid)
        if (t, max_pages * page_size) != shape or F.op_name(grid) != "add" or len(grid.args) != 2 or grid.kwargs:
            raise NoMatch(f"the candidates {cand.name} are not pages * P + arange(P)")
        first_is_offs = self._is_arange(grid.args[0], page_size)
        offs, scaled = grid.args if first_is_offs else grid.args[::-1]
        if not first_is_offs and not self._is_arange(offs, page_size):
            raise NoMatch(f"the candidates {cand.name} do not add arange({page_size}) to the page starts")
        if F.op_name(scaled) != "mul" or len(scaled.args) != 2 or page_size not in scaled.args or scaled.kwargs:
            raise NoMatch(f"the page starts {getattr(scaled, 'name', scaled)} are not pages * {page_size}")
        pages = self._unit_view_source(scaled.args[1 - scaled.args.index(page_size)], (t, max_pages))
        self.take(cand, grid, scaled)
        if _dtype_arg(pages) in _INTS and F.dtype(pages.args[0]) in _INTS:
            self.take(pages)
            pages = pages.args[0]
        name = F.op_name(pages)
        if name == "index_select" and F.arg(pages, 1, "dim") == 0:
            page_table, req = pages.args[0], F.arg(pages, 2, "index")
        elif name == "getitem" and isinstance(pages.args[1], fx.Node):
            page_table, req = pages.args
        else:
            raise NoMatch(f"the pages {getattr(pages, 'name', pages)} are not page_table.index_select(0, req) "
                          f"or page_table[req]")
        if F.dtype(page_table) not in _INTS or len(F.shape(page_table) or ()) != 2 or F.shape(page_table)[1] != max_pages \
                or F.dtype(req) not in _INTS or F.shape(req) != (t,):
            raise NoMatch(f"{pages.name} does not read an int [R, {max_pages}] page table with an int [T] "
                          f"request index")
        self.take(pages)
        return page_table, req, page_size

    def _is_arange(self, node: object, end: int) -> bool:
        """``node`` is ``arange(end)`` of an int dtype, possibly with unit dims added."""
        base = node
        while isinstance(base, fx.Node) and F.op_name(base) != "arange" and self._adds_unit_dims(base):
            base = base.args[0]
        if F.op_name(base) != "arange" or F.dtype(base) not in _INTS or F.shape(base) != (end,):
            return False
        args = [a for a in base.args]
        bounds = {"start": base.kwargs.get("start", 0), "end": base.kwargs.get("end"),
                  "step": base.kwargs.get("step", 1)}
        if len(args) == 1:
            bounds["end"] = args[0]
        elif len(args) in (2, 3):
            bounds.update(zip(("start", "end", "step"), args))
        if bounds != {"start": 0, "end": end, "step": 1}:
            return False
        chain = node
        while chain is not base:
            self.take(chain)
            chain = chain.args[0]
        self.take(base)
        return True

    @staticmethod
    def _adds_unit_dims(node: fx.Node) -> bool:
        """A view that only inserts size-1 dims (the element order is unchanged)."""
        if F.op_name(node) not in ("unsqueeze", "view", "reshape", "getitem", "expand") or not node.args:
            return False
        src = node.args[0]
        if not isinstance(src, fx.Node) or F.shape(src) is None or F.shape(node) is None:
            return False
        if F.op_name(node) == "getitem":
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(i is None or i is Ellipsis or i == slice(None) for i in items):
                return False
        if F.op_name(node) == "expand":
            return F.shape(node) == F.shape(src)
        return [d for d in F.shape(node) if d != 1] == [d for d in F.shape(src) if d != 1] and \
            len(F.shape(node)) >= len(F.shape(src))

    def _unit_view_source(self, node: object, shape: tuple) -> fx.Node:
        """Follow unit-dim views of ``node`` back to a tensor of ``shape`` (taken into the pattern)."""
        chain = []
        while isinstance(node, fx.Node) and F.shape(node) != shape and self._adds_unit_dims(node):
            chain.append(node)
            node = node.args[0]
        if not isinstance(node, fx.Node) or F.shape(node) != shape:
            raise NoMatch(f"{getattr(node, 'name', node)} is not a view of a {list(shape)} tensor")
        self.take(*chain)
        return node

    # ------------------------------------------------------------------ the mask
    def _masked(self, score: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
        """``score.masked_fill(mask, -inf)`` / ``where(valid, score, -inf)``: (scores, mask, mask means valid)."""
        name = F.op_name(score)
        if name == "masked_fill" and len(score.args) >= 2 and _is_neg_inf(F.arg(score, 2, "value")):
            self.take(score)
            return score.args[0], score.args[1], False
        if name == "where" and len(score.args) == 3 and not score.kwargs:
            cond, a, b = score.args
            for keep, fill, valid in ((a, b, True), (b, a, False)):
                if _is_neg_inf(fill) or (F.op_name(fill) == "full_like" and fill.args[1:2] == (float("-inf"),)
                                         and len(fill.users) == 1):
                    if isinstance(fill, fx.Node):
                        self.take(fill)
                    self.take(score)
                    return keep, cond, valid
        raise NoMatch(f"its scores {score.name} are not masked to -inf (masked_fill(mask, -inf) or "
                      f"where(valid, scores, -inf))")

    def _mask(self, mask: fx.Node, means_valid: bool, cand: fx.Node, shape: tuple) -> None:
        """The mask must be exactly "p <= positions[t] and cand >= 0" (or its negation)."""
        cases = [(a, b) for a in (False, True) for b in (False, True)]
        table = [self._truth(mask, a, b, cand, shape) for a, b in cases]
        if not means_valid:
            table = [not v for v in table]
        if table != [a and b for a, b in cases]:
            raise NoMatch("its mask is not (position <= positions[t]) & (cand >= 0) "
                          f"(valid for (pos ok, slot ok) in {cases}: {table})")
        if self.positions is None:
            raise NoMatch("its mask does not compare candidate positions with the rows' positions")

    def _truth(self, node: object, pos_ok: bool, slot_ok: bool, cand: fx.Node, shape: tuple) -> bool:
        name = F.op_name(node)
        if name == "not" and len(node.args) == 1:
            self.take(node)
            return not self._truth(node.args[0], pos_ok, slot_ok, cand, shape)
        if name in ("and", "or") and len(node.args) == 2:
            self.take(node)
            a, b = (self._truth(x, pos_ok, slot_ok, cand, shape) for x in node.args)
            return (a and b) if name == "and" else (a or b)
        if name in _FLIP and len(node.args) == 2 and not node.kwargs:
            left, right = node.args
            if not isinstance(left, fx.Node):
                left, right, name = right, left, _FLIP[name]
            if left is cand and isinstance(right, int):
                if (name, right) in (("ge", 0), ("gt", -1)):
                    self.take(node)
                    return slot_ok
                if (name, right) in (("lt", 0), ("le", -1)):
                    self.take(node)
                    return not slot_ok
            elif isinstance(right, fx.Node):
                t, c = shape
                for p_side, r_side, op in ((left, right, name), (right, left, _FLIP[name])):
                    if self._is_arange(p_side, c) and op in ("le", "gt"):
                        self._row_positions(r_side, t)
                        self.take(node)
                        return pos_ok if op == "le" else not pos_ok
        raise NoMatch(f"its mask term {getattr(node, 'format_node', lambda: node)()} is not a test of "
                      f"position <= positions[t] or cand >= 0")

    def _row_positions(self, node: fx.Node, t: int) -> None:
        chain = node
        while F.shape(chain) != (t,) and isinstance(chain, fx.Node) and self._adds_unit_dims(chain):
            chain = chain.args[0]
        if F.shape(chain) != (t,) or F.dtype(chain) not in _INTS or F.shape(node) not in ((t, 1),):
            raise NoMatch(f"{node.name} is not the rows' int positions [T] as a column [T, 1]")
        if self.positions is not None and chain is not self.positions:
            raise NoMatch(f"its mask compares with two positions tensors ({self.positions.name}, {chain.name})")
        self.positions = chain
        while node is not chain:
            self.take(node)
            node = node.args[0]

    # ------------------------------------------------------------------ the scores
    def _scores(self, score: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        """The head-weighted relu sum: (q, w, the keys operand)."""
        if F.shape(score) is None or F.dtype(score) != torch.float32:
            raise NoMatch(f"its scores {score.name} are not fp32")
        if len(score.users) != 1:
            raise NoMatch(f"its unmasked scores {score.name} are used elsewhere too")
        logits, weights = self._head_sum(score)
        if F.op_name(logits) != "relu" or len(logits.args) != 1 or logits.kwargs.get("inplace") or len(logits.users) != 1:
            raise NoMatch(f"the head sum reads {getattr(logits, 'name', logits)}, not relu(q . k) alone")
        products = logits.args[0]
        q, keys, roles = self._products(products)
        w = weights(roles, F.shape(products)[roles.index("h")])
        self.take(score, logits, products)
        if len(products.users) != 1:
            raise NoMatch(f"the products {products.name} are used elsewhere too")
        return q, w, keys

    def _head_sum(self, score: fx.Node):
        """``einsum("thc,th->tc", logits, w)``, ``(logits * w[..., None]).sum(h)`` or a squeezed matmul
        with w. Returns (logits, weights(roles, H) -> w): the weights check the head sum against the
        dim roles of the logits (``("t", "h", "c")`` in some order) once those are known."""
        t, c = F.shape(score)
        name = F.op_name(score)
        if name == "einsum" and len(score.args) == 3 and isinstance(score.args[0], str):
            (la, lb), out = _parse_einsum(score.args[0], 2)
            a, b = score.args[1:]
            if len(la) == 2:
                (a, la), (b, lb) = (b, lb), (a, la)

            def weights(roles, h):
                label = dict(zip(roles, la)) if len(la) == 3 else {}
                if not label or lb != label["t"] + label["h"] or out != label["t"] + label["c"] or F.shape(b) != (t, h):
                    raise NoMatch(f"the head sum {score.name} ({score.args[0]}) does not sum w[t, h] * logits over h")
                return b
            return a, weights
        if name == "sum" and len(score.args) + len(score.kwargs) >= 2 and set(score.kwargs) <= {"dim", "keepdim"}:
            dim = F.arg(score, 1, "dim")
            dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
            prod = score.args[0]
            if F.op_name(prod) != "mul" or len(prod.args) != 2 or prod.kwargs or len(prod.users) != 1 \
                    or not isinstance(dim, int) or F.arg(score, 2, "keepdim", False):
                raise NoMatch(f"the head sum {score.name} is not (logits * w).sum(dim)")
            logits, w3 = prod.args if F.op_name(prod.args[0]) == "relu" else prod.args[::-1]
            self.take(prod)

            def weights(roles, h):
                axis = roles.index("h")
                want = tuple({"t": t, "h": h, "c": 1}[r] for r in roles)
                if dim % 3 != axis or F.shape(w3) != want:
                    raise NoMatch(f"the head sum {score.name} does not sum logits * w[t, h] over the heads")
                return self._unit_view_source(w3, (t, h))
            return logits, weights
        if name == "squeeze" and len(score.args) == 2 and isinstance(score.args[1], int) \
                and F.op_name(score.args[0]) in ("matmul", "bmm"):
            prod = score.args[0]
            if len(prod.users) != 1 or len(prod.args) != 2:
                raise NoMatch(f"the head sum {score.name} is not a squeezed matmul with the weights")
            a, b = prod.args
            self.take(prod)
            # [T, 1, H] @ logits[T, H, C] -> squeeze(1), or logits[T, C, H] @ [T, H, 1] -> squeeze(2)
            logits, w3, order, axis = (b, a, ("t", "h", "c"), 1) if F.op_name(b) == "relu" else (a, b, ("t", "c", "h"), 2)

            def weights(roles, h):
                want = (t, 1, h) if axis == 1 else (t, h, 1)
                if roles != order or score.args[1] % 3 != axis or F.shape(w3) != want:
                    raise NoMatch(f"the head sum {score.name} does not sum w[t, h] * logits over the heads")
                return self._unit_view_source(w3, (t, h))
            return logits, weights
        raise NoMatch(f"its scores {score.name} are not a head-weighted sum (einsum, (logits * w).sum, matmul)")

    def _products(self, node: object) -> tuple[fx.Node, fx.Node, tuple[str, str, str]]:
        """``q . k`` for every head and candidate: (q, keys operand, the result's dim roles)."""
        name = F.op_name(node)
        if F.dtype(node) != torch.float32 or len(F.shape(node) or ()) != 3:
            raise NoMatch(f"the products {getattr(node, 'name', node)} are not fp32 [T, H, C]")
        if name == "einsum" and len(node.args) == 3 and isinstance(node.args[0], str):
            (la, lb), out = _parse_einsum(node.args[0], 2)
            a, b = node.args[1:]
            if self._is_keys(a):
                (a, la), (b, lb) = (b, lb), (a, la)
            if not self._is_keys(b) or len(la) != 3 or len(lb) != 3:
                raise NoMatch(f"the products {node.name} do not read the gathered keys")
            t, h, d = la
            if lb[0] != t or lb[2] != d or lb[1] in la or sorted(out) != sorted(t + h + lb[1]) or len(set(la)) != 3:
                raise NoMatch(f"the products {node.name} ({node.args[0]}) are not q[t, h, d] . keys[t, c, d]")
            roles = tuple({t: "t", h: "h", lb[1]: "c"}[x] for x in out)
            return self._query(a), b, roles
        if name in ("matmul", "bmm") and len(node.args) == 2:
            a, b = node.args
            if self._is_keys(a):
                q = self._transposed(b)
                return self._query(q), a, ("t", "c", "h")
            keys = self._transposed(b)
            if self._is_keys(keys):
                return self._query(a), keys, ("t", "h", "c")
        raise NoMatch(f"the products {getattr(node, 'name', node)} are not einsum/matmul of q with the gathered keys")

    def _transposed(self, node: object) -> fx.Node:
        name = F.op_name(node)
        dims = tuple(node.args[1:]) if isinstance(node, fx.Node) else ()
        if (name == "transpose" and sorted(d % 3 for d in dims) == [1, 2]) or \
                (name == "permute" and tuple(d % 3 for d in (dims[0] if len(dims) == 1 else dims)) == (0, 2, 1)):
            self.take(node)
            return node.args[0]
        raise NoMatch(f"{getattr(node, 'name', node)} is not a transpose of the last two dims")

    @staticmethod
    def _scaled(node: object) -> tuple[fx.Node, fx.Node] | None:
        """``(keys, unsqueeze)`` of ``keys * key_scale[index].unsqueeze(-1)`` (either order), else None."""
        if F.op_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
            return None
        for keys, scale in (node.args, node.args[::-1]):
            if isinstance(keys, fx.Node) and F.op_name(scale) == "unsqueeze" and F.arg(scale, 1, "dim") in (-1, 2) \
                    and F.op_name(scale.args[0]) == "getitem" and isinstance(scale.args[0].args[0], fx.Node) \
                    and scale.args[0].args[0].op == "placeholder":
                return keys, scale
        return None

    @staticmethod
    def _is_keys(node: object) -> bool:
        scaled = _Matcher._scaled(node)
        if scaled is not None:
            node = scaled[0]
        if _dtype_arg(node) == torch.float32:
            node = node.args[0]
        return F.op_name(node) == "getitem" and isinstance(node.args[1], fx.Node) and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "placeholder"

    def _query(self, q: fx.Node) -> fx.Node:
        """The query operand; a widening to fp32 is dropped (the kernels widen exactly). E4M3
        queries (with E4M3 keys only: ``match`` checks) are kept E4M3 for the FP8 x FP8 products."""
        if _dtype_arg(q) == torch.float32 and F.dtype(q.args[0]) in _FLOATS + (torch.float8_e4m3fn,) \
                and len(q.users) == 1:
            self.take(q)
            q = q.args[0]
        if len(F.shape(q) or ()) != 3 or F.dtype(q) not in _FLOATS + (torch.float8_e4m3fn,):
            raise NoMatch(f"the query {q.name} is not a [T, H, D] fp32/bf16/fp16/e4m3 tensor")
        return q

    def _key_gather(self, keys: fx.Node, cand: fx.Node) -> fx.Node:
        """``index_cache[cand.clamp(min=0)]`` [widened to fp32] [times the FP8 keys' per-token
        scales read at the same candidates]: the cache placeholder (the scales: ``self.key_scale``)."""
        floats = _FLOATS
        scaled = self._scaled(keys)
        if scaled is not None:  # FP8 keys: e4m3 widened to fp32, times key_scale[slot], as index_scores reads them
            if len(keys.users) != 1:
                raise NoMatch(f"the scaled keys {keys.name} are read by more than the products")
            self.take(keys)
            keys, unsqueeze = scaled
            gather = unsqueeze.args[0]
            scale, index = gather.args
            if len(unsqueeze.users) != 1 or len(gather.users) != 1 or F.dtype(scale) != torch.float32 \
                    or len(F.shape(scale) or ()) != 1:
                raise NoMatch(f"the key scales {gather.name} are not one fp32 scale a slot, read once")
            self._check_index(index, cand, "key scales")
            self.take(unsqueeze, gather, index)
            self.key_scale = scale
            floats = (torch.float8_e4m3fn,)
        if _dtype_arg(keys) == torch.float32:
            if len(keys.users) != 1 or F.dtype(keys.args[0]) not in floats:
                raise NoMatch(f"the keys {keys.name} are not an exact widening of the cache's rows")
            self.take(keys)
            keys = keys.args[0]
        cache, index = keys.args
        if len(keys.users) != 1 or F.dtype(cache) not in floats or len(F.shape(cache) or ()) != 2:
            raise NoMatch(f"the key gather {keys.name} does not read a 2-d index cache once (fp32/bf16/fp16, or FP8 "
                          f"times its per-token scales)")
        self._check_index(index, cand, "keys")
        self.take(keys, index)
        return cache

    @staticmethod
    def _check_index(index: object, cand: fx.Node, what: str) -> None:
        name = F.op_name(index)
        clamped = name == "clamp_min" and F.arg(index, 1, "min") == 0 or \
            name == "clamp" and F.arg(index, 1, "min") == 0 and F.arg(index, 2, "max") is None
        if not clamped or index.args[0] is not cand or len(index.users) != 1:
            raise NoMatch(f"the {what} are read at {index.format_node() if isinstance(index, fx.Node) else index}, "
                          f"not at cand.clamp(min=0) of the same candidates")

    def _check_inputs(self, match: IndexerMatch) -> None:
        """Nothing writes what the ops read between the pattern's reads and the result."""
        graph = self.topk.graph
        position = {n: i for i, n in enumerate(graph.nodes)}
        start, end = min(position[n] for n in self.nodes), position[match.result]
        inputs = (match.q, match.w, match.index_cache, match.page_table, match.req_ids, match.positions) + \
            ((match.key_scale,) if match.key_scale is not None else ())
        for node in inputs:
            for user in node.users:
                if start < position[user] < end and user not in self.nodes and F.mutates(user, node):
                    raise NoMatch(f"{user.format_node()} writes {node.name} between the indexer's reads of it")


def _parse_einsum(equation: str, operands: int) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        raise NoMatch(f"einsum {equation!r} has no explicit output or has an ellipsis")
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != operands:
        raise NoMatch(f"einsum {equation!r} does not have {operands} operands")
    return parts, out


def find_indexers(gm: fx.GraphModule) -> tuple[list[IndexerMatch], list[tuple[fx.Node, str]]]:
    """Every ``torch.topk`` node: recognized indexers, and the others with the reason."""
    matches, left = [], []
    for node in gm.graph.nodes:
        if F.op_name(node) != "topk":
            continue
        try:
            matches.append(_Matcher(node).match())
        except NoMatch as e:
            left.append((node, str(e)))
    return matches, left


