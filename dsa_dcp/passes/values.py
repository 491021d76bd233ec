"""Value numbering over the dataflow: which nodes hold the same values, and when that holds.

``ValueNumbering(gm, g, classes, example_inputs)`` walks ``g`` (``dataflow.to_networkx``) in
topological order and gives every node a number: two nodes with one number hold the same values
*as computed*. A node keeps its source's number through ops that keep the values (clones,
``contiguous``, ``detach``, same-dtype ``to``, ``dst.copy_(src)``, ``x[:]``, views and reshapes
back to the same shape; a chain of row-major reshapes is keyed by its final shape), gets a number
made of its source's and the op's constant arguments for constant views, getitems and dtype
conversions, and a number of its own otherwise: a placeholder or attribute is numbered by the
real tensor behind it (storage, offset, shape, strides, dtype), every other node by itself. So
separately computed tensors are never equated, even when their values agree. It is value numbering
restricted to views, copies and conversions, not common subexpression elimination.

Values live in storage that in-place ops may change later, so a number alone is not enough:
``versions(name, at)`` says what reading ``name`` at position ``at`` depends on — for every
storage on the way (the original's, any copy's), how many in-place writes it had seen when it
was read. Two reads with one number and equal versions see the same values.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import networkx as nx
import torch
import torch.fx as fx

from dsa_dcp.passes.dataflow import Writes, real_tensor_key
from dsa_dcp.passes.fx import is_view, op_name, placeholder_values, target_name

# Ops whose result holds their input's values when shape, dtype and device are unchanged.
SAME_VALUE_OPS = {"clone", "contiguous", "detach", "to", "type", "type_as", "int", "long", "alias", "_to_copy",
                  "lift_fresh_copy", "expand", "expand_as"}
COPY_INTO_OPS = {"copy_", "copy"}  # dst.copy_(src): the result holds src's values
CONVERT_OPS = {"to", "type", "type_as", "int", "long", "_to_copy"}  # to another dtype: keyed by the dtype
# Row-major reshapes: the result is the input's values in another shape, whatever the path to it.
RESHAPE_OPS = {"view", "_unsafe_view", "reshape", "reshape_as", "view_as", "flatten", "unflatten", "squeeze",
               "unsqueeze"}


def _same_meta(a: fx.Node, b: fx.Node, shape: bool = True, dtype: bool = True) -> bool:
    """Both have recorded tensor values on one device, with the same shape / dtype where asked."""
    a, b = a.meta.get("example_value"), b.meta.get("example_value")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device and \
        (a.shape == b.shape or not shape) and (a.dtype == b.dtype or not dtype)


def _whole(index: object) -> bool:
    """``x[index]`` is all of ``x`` when the result keeps x's shape (``x[:]``, ``x[..., :K]`` of width K)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is Ellipsis or (isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1))
               for i in items)


def _shape_key(shape) -> tuple:
    """A hashable form of a shape: a symbolic size (dynamic shapes) by its expression."""
    return tuple(_constant(d) for d in shape)


def _constant(value: object) -> object:
    """A hashable form of a constant argument; raises ``TypeError`` for a node or anything else.
    A symbolic size is keyed by its expression: equal expressions are equal sizes."""
    if isinstance(value, fx.Node):
        raise TypeError("not a constant")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", type(value).__name__, str(value.node.expr))
    if isinstance(value, slice):
        return ("slice", _constant(value.start), _constant(value.stop), _constant(value.step))
    if isinstance(value, (tuple, list)):
        return tuple(_constant(v) for v in value)
    hash(value)
    return value


@dataclasses.dataclass(frozen=True)
class _Value:
    """How a node's value was derived: its number, the node that computed it, the storage reads."""

    number: int
    root: str
    shape: tuple | None  # (value number, shape) before a chain of reshapes, so reshape round trips cancel
    reads: tuple[tuple[int, str | None, int], ...]  # (storage class, copy that made it, read at), closed
    live: tuple[int, str | None]  # the storage the value lives in now, and the copy that made it


class ValueNumbering:
    """Numbers every node's value over the dataflow in topological order (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, g: nx.DiGraph, classes: dict[str, int], example_inputs: tuple) -> None:
        self.g, self.classes = g, classes
        self.writes = Writes(g, classes)
        self._numbers: dict[object, int] = {}
        inputs = placeholder_values(gm, example_inputs)
        nodes = {n.name: n for n in gm.graph.nodes}
        self.values: dict[str, _Value] = {}
        self._sources: dict[str, fx.Node] = {}  # node -> the node its value is derived from
        for name in nx.topological_sort(g):
            node = nodes[name]
            real = inputs.get(node) if node.op == "placeholder" else \
                self._attr(gm, node.target) if node.op == "get_attr" else None
            self.values[name] = self._value(node, real_tensor_key(real))

    @staticmethod
    def _attr(gm: fx.GraphModule, target: str) -> object:
        try:
            return functools.reduce(getattr, target.split("."), gm)
        except AttributeError:
            return None

    def _number(self, key: object) -> int:
        return self._numbers.setdefault(key, len(self._numbers))

    def _derivation(self, node: fx.Node) -> tuple[fx.Node, object] | None:
        """``(source, view)``: node's value is ``source``'s (``view is None``) or a function of it named by
        ``view``; ``None`` when node computes a new value."""
        name, args = op_name(node), node.args
        if not args or not isinstance(args[0], fx.Node):
            return None
        if name in COPY_INTO_OPS and len(args) > 1 and isinstance(args[1], fx.Node):
            return (args[1], None) if _same_meta(node, args[1]) else None
        if name in SAME_VALUE_OPS and _same_meta(node, args[0]):
            return args[0], None
        if name in CONVERT_OPS and _same_meta(node, args[0], shape=True, dtype=False):
            return args[0], ("convert", node.meta["example_value"].dtype)
        if name in RESHAPE_OPS and _same_meta(node, args[0], shape=False):
            return args[0], ("reshape", _shape_key(node.meta["example_value"].shape))
        if is_view(node) and name != "as_strided":  # as_strided reads memory, not values
            try:
                view = ("view", name or target_name(node.target), _constant(args[1:]),
                        _constant(sorted(node.kwargs.items())))
            except TypeError:  # an index or size computed in the graph: treat as a new value
                return None
            if node.target is operator.getitem and _whole(args[1]) and _same_meta(node, args[0]):
                view = None
            return args[0], view
        return None

    def _value(self, node: fx.Node, real_key: tuple | None) -> _Value:
        cls = self.classes[node.name]
        derived = self._derivation(node)
        if derived is None:
            key = real_key or ("node", node.name)  # inputs: the real tensor; anything else: itself
            return _Value(self._number(key), node.name, None, (), (cls, None))
        source, view = derived
        self._sources[node.name] = source
        parent = self.values[source.name]
        number, shape = parent.number, parent.shape
        if view is not None and view[0] == "reshape":
            base, base_shape = shape or (parent.number, _shape_key(source.meta["example_value"].shape))
            number = base if view[1] == base_shape else self._number((base, view))
            shape = (base, base_shape)
        elif view is not None:
            number, shape = self._number((parent.number, view)), None
        if cls == parent.live[0]:  # an alias: reads the same storage later
            return _Value(number, parent.root, shape, parent.reads, parent.live)
        read = (*parent.live, self.g.nodes[node.name]["order"])  # a copy: reads the source's storage now
        return _Value(number, parent.root, shape, parent.reads + (read,), (cls, node.name))

    def source(self, name: str) -> fx.Node | None:
        """The node ``name``'s value is a copy, view or conversion of (``None`` for a new value)."""
        return self._sources.get(name)

    def is_copy_or_view(self, name: str) -> bool:
        """``name`` only re-presents another node's values and writes nothing."""
        return name in self._sources and not self.g.nodes[name]["mutates"]

    def versions(self, name: str, at: int) -> tuple:
        """What the value of ``name`` read at position ``at`` depends on, beyond its number."""
        value = self.values[name]
        out = []
        for cls, made_by, read_at in value.reads + ((*value.live, at),):
            if made_by is None:  # storage older than the value: how many writes it has seen
                out.append(("writes", cls, len(self.writes.between(cls, -1, read_at))))
            else:  # a copy's own storage: unchanged unless written since the copy
                written = self.writes.between(cls, self.g.nodes[made_by]["order"], read_at)
                if written:
                    out.append(("written", made_by, tuple(written)))
        return tuple(out)
