"""Indexer kernels: the lightning indexer as a model writes it becomes ``index_scores`` + ``topk_select``.

Expects: dynamo's graph of a step. A lightning indexer is recognized from its ``torch.topk`` node
backwards, by structure (never by module names), in the form ``LightningIndexer.forward`` of
``dsa_dcp/models/dsa.py`` has and the variations a plain-PyTorch author writes::

    pages = page_table.index_select(0, req) [.long()]        # or page_table[req]
    cand  = (pages.unsqueeze(-1) * P + arange(P)).flatten(1)  # or a reshape/view to [T, C]
    valid = (arange(C)[None] <= positions[:, None]) & (cand >= 0)     # any and/or/not of these
    keys  = index_cache[cand.clamp(min=0)] [.float()]
    logits = einsum("thd,tcd->thc", q [.float()], keys).relu()         # or q @ keys.transpose(1, 2)
    score = einsum("thc,th->tc", logits, w)                  # or (logits * w[..., None]).sum(1), a matmul
    score = score.masked_fill(~valid, -inf)                  # or torch.where(valid, score, -inf)
    val, idx = torch.topk(score, K, dim=-1)
    topk = torch.where(val == -inf, -1, cand.gather(1, idx)) [.to(torch.int32)]

Leaves: ``topk = topk_select(index_scores(q, w, index_cache, None, page_table, req, positions, P),
page_table, req, P, K)`` in its place (the index-cache write before it is untouched). The result
differs from the model's only by floating-point reassociation of the scores, by the tie rule (at
the K-th score, the lowest candidate positions win) and by order: ``topk_select`` lists the
selection in ascending candidate position, so the pass rewrites only an indexer whose top-k is read
by sparse attention alone (which needs the set). Anything it cannot prove equivalent — another
mask, scores in another dtype, a top-k read by something else — is left exactly as written, with a
debug line on the ``dsa_dcp.passes`` logger and the reason in the stats (``indexers_left``); never
half-rewritten. A normalize pass: it runs at every ``dcp_size`` (``options.indexer_kernels``)
before validation, so the checks of the DCP passes see the ops.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from dsa_dcp.ops import INDEX_SCORES, SPARSE_ATTENTION_OPS, TOPK_SELECT
from dsa_dcp.passes.base import CompileContext, DCPPass, Plan, log
from dsa_dcp.passes.graph import Emitter

_NAMES = {operator.add: "add", operator.mul: "mul", operator.matmul: "matmul", operator.getitem: "getitem",
          operator.and_: "and", operator.or_: "or", operator.invert: "not", operator.eq: "eq", operator.ne: "ne",
          operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt"}
_ALIASES = {"logical_and": "and", "bitwise_and": "and", "__and__": "and", "logical_or": "or", "bitwise_or": "or",
            "__or__": "or", "logical_not": "not", "bitwise_not": "not", "__invert__": "not", "less_equal": "le",
            "less": "lt", "greater_equal": "ge", "greater": "gt", "__le__": "le", "__lt__": "lt", "__ge__": "ge",
            "__gt__": "gt", "__eq__": "eq", "__ne__": "ne", "not_equal": "ne", "__add__": "add", "__mul__": "mul",
            "__matmul__": "matmul", "__getitem__": "getitem"}
_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq", "ne": "ne"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # widened to fp32 exactly
_INTS = (torch.int32, torch.int64)


class NoMatch(Exception):
    """Why a ``torch.topk`` node is not an indexer the pass can replace."""


def _name(node: object) -> str | None:
    """The op's name for tensor methods, torch functions and operators (``None`` otherwise)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _NAMES:
        return _NAMES[target]
    owner = getattr(target, "__objclass__", None)
    module = getattr(target, "__module__", None) or ""
    if (isinstance(owner, type) and issubclass(owner, torch._C.TensorBase)) or module.startswith("torch"):
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return None
        name = getattr(target, "__name__", None)
        return _ALIASES.get(name, name)
    return None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _shape(node: object) -> tuple | None:
    value = _value(node)
    return tuple(value.shape) if value is not None else None


def _dtype(node: object) -> torch.dtype | None:
    value = _value(node)
    return value.dtype if value is not None else None


def _is_neg_inf(value: object) -> bool:
    return isinstance(value, float) and value == float("-inf")


def _dtype_arg(node: fx.Node) -> torch.dtype | None:
    """The target dtype of a conversion node (``float``, ``long``, ``int``, ``to(dtype)``, ``type(dtype)``)."""
    name = _name(node)
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

    def replace(self, graph: fx.Graph) -> fx.Node:
        """Insert the ops before ``result``, rewire its users, erase what only the pattern used."""
        emit = Emitter(graph, like=self.topk)
        with graph.inserting_before(self.result):
            scores = emit(INDEX_SCORES, self.q, self.w, self.index_cache, None, self.page_table, self.req_ids,
                          self.positions, self.page_size)
            topk = emit(TOPK_SELECT, scores, self.page_table, self.req_ids, self.page_size, self.k)
            if _dtype(self.result) == torch.int64:
                topk = emit(as_int64, topk)
        self.result.replace_all_uses_with(topk)
        position = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(set(self.nodes), key=position.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)
        return topk


def as_int64(topk: torch.Tensor) -> torch.Tensor:
    """The selection as int64 slots, for a model whose top-k is int64."""
    return topk.to(torch.int64)


class _Matcher:
    """Matches one ``torch.topk`` node backwards (see module docstring); raises ``NoMatch``."""

    def __init__(self, topk: fx.Node) -> None:
        self.topk = topk
        self.nodes: list[fx.Node] = [topk]
        self.positions: fx.Node | None = None

    def take(self, *nodes: fx.Node) -> None:
        self.nodes += [n for n in nodes if isinstance(n, fx.Node)]

    # ------------------------------------------------------------------ the top-k and what follows it
    def match(self) -> IndexerMatch:
        topk = self.topk
        score, k = _arg(topk, 0, "input"), _arg(topk, 1, "k")
        if not isinstance(k, int) or isinstance(k, bool):
            raise NoMatch(f"its k is not a constant int ({k!r})")
        if _arg(topk, 2, "dim", -1) not in (-1, 1) or _arg(topk, 3, "largest", True) is not True:
            raise NoMatch("it is not a top-k of the largest values along the last dim of a [T, C] tensor")
        shape = _shape(score)
        if shape is None or len(shape) != 2 or _dtype(score) != torch.float32:
            raise NoMatch(f"it does not select from fp32 scores [T, C] (got {shape}, {_dtype(score)})")
        items = {}
        for user in topk.users:
            if _name(user) != "getitem" or user.args[1] not in (0, 1) or user.args[1] in items:
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
        self._mask(mask, means_valid, cand, shape)
        page_table, req, page_size = cand_of
        t, _ = shape
        heads = (_shape(w) or (0, 0))[1]
        if _shape(q) != (t, heads, (_shape(cache) or (0, 0))[1]) or _shape(w) != (t, heads):
            raise NoMatch(f"q {_shape(q)}, w {_shape(w)} and the index cache {_shape(cache)} are not [T, H, D], [T, H] "
                          f"and [S, D]")
        match = IndexerMatch(topk, result, q, w, cache, page_table, req, self.positions, page_size, k, self.nodes)
        self._check_inputs(match)
        return match

    def _result(self, values: fx.Node, indices: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``where(values == -inf, -1, cand.gather(1, indices))`` [converted]: (cand, the result node)."""
        gathers = [u for u in indices.users if _name(u) == "gather" and _arg(u, 1, "dim") in (1, -1)
                   and _arg(u, 2, "index") is indices and u.args[0] is not indices and not u.kwargs.get("sparse_grad")]
        if len(gathers) != 1:
            raise NoMatch(f"its indices ({indices.name}) are not read by one cand.gather(1, indices)")
        gather = gathers[0]
        cand = gather.args[0]
        test = self._only_user(values, "the top-k values")
        name, args = _name(test), test.args
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
        if _name(pick) == "masked_fill" and is_empty and pick.args[:2] == (gather, test) and \
                _arg(pick, 2, "value") == -1:
            pass
        elif _name(pick) == "where" and len(pick.args) == 3 and pick.args[0] is test:
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
        if _dtype(result) not in _INTS:
            raise NoMatch(f"the top-k {result.name} is not int32 or int64 slots")
        return cand, result

    def _is_fill(self, value: object, like: fx.Node, fill: int) -> bool:
        if value == fill and isinstance(value, int):
            return True
        if _name(value) == "full_like" and value.args[:2] == (like, fill) and set(value.kwargs) <= {"dtype"} \
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
        shape = _shape(cand)
        if _dtype(cand) not in _INTS or shape is None or len(shape) != 2:
            raise NoMatch(f"the gathered candidates {getattr(cand, 'name', cand)} are not an int [T, C] tensor")
        grid = cand.args[0] if _name(cand) in ("flatten", "reshape", "view") and cand.args else None
        if grid is None or _shape(grid) is None or len(_shape(grid)) != 3 or \
                (_name(cand) == "flatten" and _arg(cand, 1, "start_dim", 0) != 1):
            raise NoMatch(f"the candidates {cand.name} are not a [T, pages, P] grid flattened to [T, C]")
        t, max_pages, page_size = _shape(grid)
        if (t, max_pages * page_size) != shape or _name(grid) != "add" or len(grid.args) != 2 or grid.kwargs:
            raise NoMatch(f"the candidates {cand.name} are not pages * P + arange(P)")
        first_is_offs = self._is_arange(grid.args[0], page_size)
        offs, scaled = grid.args if first_is_offs else grid.args[::-1]
        if not first_is_offs and not self._is_arange(offs, page_size):
            raise NoMatch(f"the candidates {cand.name} do not add arange({page_size}) to the page starts")
        if _name(scaled) != "mul" or len(scaled.args) != 2 or page_size not in scaled.args or scaled.kwargs:
            raise NoMatch(f"the page starts {getattr(scaled, 'name', scaled)} are not pages * {page_size}")
        pages = self._unit_view_source(scaled.args[1 - scaled.args.index(page_size)], (t, max_pages))
        self.take(cand, grid, scaled)
        if _dtype_arg(pages) in _INTS and _dtype(pages.args[0]) in _INTS:
            self.take(pages)
            pages = pages.args[0]
        name = _name(pages)
        if name == "index_select" and _arg(pages, 1, "dim") == 0:
            page_table, req = pages.args[0], _arg(pages, 2, "index")
        elif name == "getitem" and isinstance(pages.args[1], fx.Node):
            page_table, req = pages.args
        else:
            raise NoMatch(f"the pages {getattr(pages, 'name', pages)} are not page_table.index_select(0, req) "
                          f"or page_table[req]")
        if _dtype(page_table) not in _INTS or len(_shape(page_table) or ()) != 2 or _shape(page_table)[1] != max_pages \
                or _dtype(req) not in _INTS or _shape(req) != (t,):
            raise NoMatch(f"{pages.name} does not read an int [R, {max_pages}] page table with an int [T] "
                          f"request index")
        self.take(pages)
        return page_table, req, page_size

    def _is_arange(self, node: object, end: int) -> bool:
        """``node`` is ``arange(end)`` of an int dtype, possibly with unit dims added."""
        base = node
        while isinstance(base, fx.Node) and _name(base) != "arange" and self._adds_unit_dims(base):
            base = base.args[0]
        if _name(base) != "arange" or _dtype(base) not in _INTS or _shape(base) != (end,):
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
        if _name(node) not in ("unsqueeze", "view", "reshape", "getitem", "expand") or not node.args:
            return False
        src = node.args[0]
        if not isinstance(src, fx.Node) or _shape(src) is None or _shape(node) is None:
            return False
        if _name(node) == "getitem":
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(i is None or i is Ellipsis or i == slice(None) for i in items):
                return False
        if _name(node) == "expand":
            return _shape(node) == _shape(src)
        return [d for d in _shape(node) if d != 1] == [d for d in _shape(src) if d != 1] and \
            len(_shape(node)) >= len(_shape(src))

    def _unit_view_source(self, node: object, shape: tuple) -> fx.Node:
        """Follow unit-dim views of ``node`` back to a tensor of ``shape`` (taken into the pattern)."""
        chain = []
        while isinstance(node, fx.Node) and _shape(node) != shape and self._adds_unit_dims(node):
            chain.append(node)
            node = node.args[0]
        if not isinstance(node, fx.Node) or _shape(node) != shape:
            raise NoMatch(f"{getattr(node, 'name', node)} is not a view of a {list(shape)} tensor")
        self.take(*chain)
        return node

    # ------------------------------------------------------------------ the mask
    def _masked(self, score: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
        """``score.masked_fill(mask, -inf)`` / ``where(valid, score, -inf)``: (scores, mask, mask means valid)."""
        name = _name(score)
        if name == "masked_fill" and len(score.args) >= 2 and _is_neg_inf(_arg(score, 2, "value")):
            self.take(score)
            return score.args[0], score.args[1], False
        if name == "where" and len(score.args) == 3 and not score.kwargs:
            cond, a, b = score.args
            for keep, fill, valid in ((a, b, True), (b, a, False)):
                if _is_neg_inf(fill) or (_name(fill) == "full_like" and fill.args[1:2] == (float("-inf"),)
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
        name = _name(node)
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
        while _shape(chain) != (t,) and isinstance(chain, fx.Node) and self._adds_unit_dims(chain):
            chain = chain.args[0]
        if _shape(chain) != (t,) or _dtype(chain) not in _INTS or _shape(node) not in ((t, 1),):
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
        if _shape(score) is None or _dtype(score) != torch.float32:
            raise NoMatch(f"its scores {score.name} are not fp32")
        if len(score.users) != 1:
            raise NoMatch(f"its unmasked scores {score.name} are used elsewhere too")
        logits, weights = self._head_sum(score)
        if _name(logits) != "relu" or len(logits.args) != 1 or logits.kwargs.get("inplace") or len(logits.users) != 1:
            raise NoMatch(f"the head sum reads {getattr(logits, 'name', logits)}, not relu(q . k) alone")
        products = logits.args[0]
        q, keys, roles = self._products(products)
        w = weights(roles, _shape(products)[roles.index("h")])
        self.take(score, logits, products)
        if len(products.users) != 1:
            raise NoMatch(f"the products {products.name} are used elsewhere too")
        return q, w, keys

    def _head_sum(self, score: fx.Node):
        """``einsum("thc,th->tc", logits, w)``, ``(logits * w[..., None]).sum(h)`` or a squeezed matmul
        with w. Returns (logits, weights(roles, H) -> w): the weights check the head sum against the
        dim roles of the logits (``("t", "h", "c")`` in some order) once those are known."""
        t, c = _shape(score)
        name = _name(score)
        if name == "einsum" and len(score.args) == 3 and isinstance(score.args[0], str):
            (la, lb), out = _parse_einsum(score.args[0], 2)
            a, b = score.args[1:]
            if len(la) == 2:
                (a, la), (b, lb) = (b, lb), (a, la)

            def weights(roles, h):
                label = dict(zip(roles, la)) if len(la) == 3 else {}
                if not label or lb != label["t"] + label["h"] or out != label["t"] + label["c"] or _shape(b) != (t, h):
                    raise NoMatch(f"the head sum {score.name} ({score.args[0]}) does not sum w[t, h] * logits over h")
                return b
            return a, weights
        if name == "sum" and len(score.args) + len(score.kwargs) >= 2 and set(score.kwargs) <= {"dim", "keepdim"}:
            dim = _arg(score, 1, "dim")
            dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
            prod = score.args[0]
            if _name(prod) != "mul" or len(prod.args) != 2 or prod.kwargs or len(prod.users) != 1 \
                    or not isinstance(dim, int) or _arg(score, 2, "keepdim", False):
                raise NoMatch(f"the head sum {score.name} is not (logits * w).sum(dim)")
            logits, w3 = prod.args if _name(prod.args[0]) == "relu" else prod.args[::-1]
            self.take(prod)

            def weights(roles, h):
                axis = roles.index("h")
                want = tuple({"t": t, "h": h, "c": 1}[r] for r in roles)
                if dim % 3 != axis or _shape(w3) != want:
                    raise NoMatch(f"the head sum {score.name} does not sum logits * w[t, h] over the heads")
                return self._unit_view_source(w3, (t, h))
            return logits, weights
        if name == "squeeze" and len(score.args) == 2 and isinstance(score.args[1], int) \
                and _name(score.args[0]) in ("matmul", "bmm"):
            prod = score.args[0]
            if len(prod.users) != 1 or len(prod.args) != 2:
                raise NoMatch(f"the head sum {score.name} is not a squeezed matmul with the weights")
            a, b = prod.args
            self.take(prod)
            # [T, 1, H] @ logits[T, H, C] -> squeeze(1), or logits[T, C, H] @ [T, H, 1] -> squeeze(2)
            logits, w3, order, axis = (b, a, ("t", "h", "c"), 1) if _name(b) == "relu" else (a, b, ("t", "c", "h"), 2)

            def weights(roles, h):
                want = (t, 1, h) if axis == 1 else (t, h, 1)
                if roles != order or score.args[1] % 3 != axis or _shape(w3) != want:
                    raise NoMatch(f"the head sum {score.name} does not sum w[t, h] * logits over the heads")
                return self._unit_view_source(w3, (t, h))
            return logits, weights
        raise NoMatch(f"its scores {score.name} are not a head-weighted sum (einsum, (logits * w).sum, matmul)")

    def _products(self, node: object) -> tuple[fx.Node, fx.Node, tuple[str, str, str]]:
        """``q . k`` for every head and candidate: (q, keys operand, the result's dim roles)."""
        name = _name(node)
        if _dtype(node) != torch.float32 or len(_shape(node) or ()) != 3:
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
        name = _name(node)
        dims = tuple(node.args[1:]) if isinstance(node, fx.Node) else ()
        if (name == "transpose" and sorted(d % 3 for d in dims) == [1, 2]) or \
                (name == "permute" and tuple(d % 3 for d in (dims[0] if len(dims) == 1 else dims)) == (0, 2, 1)):
            self.take(node)
            return node.args[0]
        raise NoMatch(f"{getattr(node, 'name', node)} is not a transpose of the last two dims")

    @staticmethod
    def _is_keys(node: object) -> bool:
        if _dtype_arg(node) == torch.float32:
            node = node.args[0]
        return _name(node) == "getitem" and isinstance(node.args[1], fx.Node) and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "placeholder"

    def _query(self, q: fx.Node) -> fx.Node:
        """The query operand; a widening to fp32 is dropped (the kernels widen exactly)."""
        if _dtype_arg(q) == torch.float32 and _dtype(q.args[0]) in _FLOATS and len(q.users) == 1:
            self.take(q)
            q = q.args[0]
        if len(_shape(q) or ()) != 3 or _dtype(q) not in _FLOATS:
            raise NoMatch(f"the query {q.name} is not a [T, H, D] fp32/bf16/fp16 tensor")
        return q

    def _key_gather(self, keys: fx.Node, cand: fx.Node) -> fx.Node:
        """``index_cache[cand.clamp(min=0)]`` [widened to fp32]: the cache placeholder."""
        if _dtype_arg(keys) == torch.float32:
            if len(keys.users) != 1 or _dtype(keys.args[0]) not in _FLOATS:
                raise NoMatch(f"the keys {keys.name} are not an exact widening of the cache's rows")
            self.take(keys)
            keys = keys.args[0]
        cache, index = keys.args
        if len(keys.users) != 1 or _dtype(cache) not in _FLOATS or len(_shape(cache) or ()) != 2:
            raise NoMatch(f"the key gather {keys.name} does not read a 2-d fp32/bf16/fp16 index cache once")
        name = _name(index)
        clamped = name == "clamp_min" and _arg(index, 1, "min") == 0 or \
            name == "clamp" and _arg(index, 1, "min") == 0 and _arg(index, 2, "max") is None
        if not clamped or index.args[0] is not cand or len(index.users) != 1:
            raise NoMatch(f"the keys are read at {index.format_node() if isinstance(index, fx.Node) else index}, "
                          f"not at cand.clamp(min=0) of the same candidates")
        self.take(keys, index)
        return cache

    def _check_inputs(self, match: IndexerMatch) -> None:
        """Nothing writes what the ops read between the pattern's reads and the result."""
        graph = self.topk.graph
        position = {n: i for i, n in enumerate(graph.nodes)}
        start, end = min(position[n] for n in self.nodes), position[match.result]
        inputs = (match.q, match.w, match.index_cache, match.page_table, match.req_ids, match.positions)
        for node in inputs:
            for user in node.users:
                if start < position[user] < end and user not in self.nodes and _writes(user, node):
                    raise NoMatch(f"{user.format_node()} writes {node.name} between the indexer's reads of it")


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """``user`` may write ``node`` in place (conservative)."""
    if user.op == "call_method" and user.target.endswith("_") and not user.target.endswith("__"):
        return user.args[0] is node
    if user.op == "call_function" and user.target is operator.setitem:
        return user.args[0] is node
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload):
        schema = user.target._schema.arguments
        return any(a.alias_info is not None and a.alias_info.is_write and i < len(user.args) and user.args[i] is node
                   for i, a in enumerate(schema))
    return False


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
        if _name(node) != "topk":
            continue
        try:
            matches.append(_Matcher(node).match())
        except NoMatch as e:
            left.append((node, str(e)))
    return matches, left


@dataclasses.dataclass
class IndexerPlan(Plan):
    matches: list[IndexerMatch] = dataclasses.field(default_factory=list)
    left: list[tuple[fx.Node, str]] = dataclasses.field(default_factory=list)


class IndexerKernels(DCPPass):
    name = "indexer_kernels"

    def check(self, gm: fx.GraphModule, ctx: CompileContext) -> IndexerPlan:
        """Finds the indexers (matching only: a graph it cannot rewrite is left as written, never refused)."""
        matches, left = find_indexers(gm)
        for node, reason in left:
            log.debug("indexer_kernels: %s left as written: %s", node.name, reason)
        return IndexerPlan(matches=matches, left=left)

    def run(self, gm: fx.GraphModule, ctx: CompileContext, plan: IndexerPlan) -> dict:
        replaced = [match.replace(gm.graph) for match in plan.matches]
        return {
            "indexers_matched": len(replaced),
            "indexers_left": [f"{node.name}: {reason}" for node, reason in plan.left],
            "selections": [n.name for n in replaced],
        }
