"""FX semantics in one place: what a node calls, its arguments and values, what it aliases and
writes, and ``Emitter``, the one way a pass inserts a node.

Every pass reads dynamo's graph through these functions, so one question has one answer:

- **op identity**: ``target_name`` names any target (``"dsa_dcp.topk_remap.default"``, ``"add_"``,
  ``"getitem"``); ``calls(node, functions, methods)`` asks whether a node calls one of them.
- **arguments**: ``arg(node, i, name)`` is the argument passed at position ``i`` or by keyword
  ``name``, as the call wrote it.
- **values**: ``example(node)``, ``shape(node)``, ``dtype(node)`` read what dynamo recorded in
  ``meta["example_value"]`` (a fake tensor).
- **aliasing and mutation** are read from the op schema first: a node's target resolves to its
  ATen overloads (an ``OpOverload`` itself; a tensor method or torch function by its name,
  ``x.add_(y)`` -> ``aten.add_``, ``torch.transpose`` -> ``aten.transpose``); an argument the
  schema marks written (``Tensor(a!)``) is written, a result that shares an argument's alias set
  without a write (``Tensor(a) self -> Tensor(a)``) is a view of it. What has no schema — Python's
  in-place operators (``operator.iadd``, ``operator.setitem``) and their dunders, and
  ``operator.getitem`` on a tensor (a view) — is in the two tables below;
  ``tests/test_fx.py`` checks that the tables agree with the schemas where both exist. A
  ``call_module`` or a function dynamo kept opaque may write any argument.
- **inserting nodes**: ``Emitter`` gives every node it inserts its ``meta["example_value"]``
  (the target run on the inputs' fake values, in the graph's fake mode), the module stack and
  source line of the node it stands beside, and ``meta["dsa_dcp_layer"]``.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
from typing import Any, Iterator

import torch
import torch.fx as fx

log = logging.getLogger("dsa_dcp.passes")

# Python's in-place operators: no schema, each writes its first argument.
INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                     operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                     operator.ior, operator.ixor, operator.ilshift, operator.irshift}
INPLACE_DUNDERS = {f"__{op.__name__}__" for op in INPLACE_OPERATORS}  # t.__iadd__, t.__setitem__, ...
# ATen names of the tensor dunders (``t.__iadd__`` is ``aten.add_``): how the schema check reads them
DUNDER_OPS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
              "__setitem__": "index_put_", "__iand__": "bitwise_and_", "__ior__": "bitwise_or_",
              "__ixor__": "bitwise_xor_", "__ilshift__": "bitwise_left_shift_", "__irshift__": "bitwise_right_shift_"}
# A result that is a view of its first argument where no schema says so: tensor indexing.
VIEW_WITHOUT_SCHEMA = {operator.getitem}


# --------------------------------------------------------------------------- op identity and arguments


def target_name(target: object) -> str:
    """A target's name: an op's qualified name, a method's name, a function's ``__name__``."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


# One name per tensor op however it is spelled: a method, a torch function or a Python operator
# (``x & y``, ``torch.logical_and``, ``x.bitwise_and`` are all "and").
_OPERATOR_NAMES = {operator.add: "add", operator.mul: "mul", operator.matmul: "matmul", operator.getitem: "getitem",
                   operator.and_: "and", operator.or_: "or", operator.invert: "not", operator.eq: "eq",
                   operator.ne: "ne", operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt"}
_SPELLINGS = {"logical_and": "and", "bitwise_and": "and", "__and__": "and", "logical_or": "or", "bitwise_or": "or",
              "__or__": "or", "logical_not": "not", "bitwise_not": "not", "__invert__": "not", "less_equal": "le",
              "less": "lt", "greater_equal": "ge", "greater": "gt", "__le__": "le", "__lt__": "lt", "__ge__": "ge",
              "__gt__": "gt", "__eq__": "eq", "__ne__": "ne", "not_equal": "ne", "__add__": "add", "__mul__": "mul",
              "__matmul__": "matmul", "__getitem__": "getitem"}


def op_name(node: object) -> str | None:
    """The op's one name for tensor methods, torch functions, Python operators and ATen ops
    (``None`` for anything else: other namespaces' ops are named by ``target_name``)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _SPELLINGS.get(node.target, node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    if isinstance(target, torch._ops.OpOverload):
        return target._opname if target.namespace == "aten" else None
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::")
        return name if namespace == "aten" else None
    if not _is_torch_function(target):
        return None
    name = getattr(target, "__name__", None)
    return _SPELLINGS.get(name, name)


def c10d_name(node: object) -> str | None:
    """The functional collective a node calls (``"all_reduce"``, ``"wait_tensor"``, ...), spelled as
    an overload (what the passes insert) or as its packet (what dynamo records for a model's own
    ``funcol.all_reduce`` or ``dist.all_reduce``); ``None`` for anything else."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    namespace, name = target._qualified_op_name.split("::")
    return name if namespace == "_c10d_functional" else None


def calls(node: object, functions=(), methods=()) -> bool:
    """``node`` is a ``call_function`` of one of ``functions`` or a ``call_method`` of one of ``methods``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument at position ``index`` or keyword ``name`` (``default`` if neither was passed)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


# --------------------------------------------------------------------------- recorded values


def example(node: object) -> Any:
    """What dynamo recorded for ``node`` (a fake tensor, a SymInt, ...), or ``None``."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def shape(node: object) -> tuple | None:
    """``node``'s recorded shape, a tuple (``None`` if it is not a tensor)."""
    value = example(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype(node: object) -> torch.dtype | None:
    value = example(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def is_tensor(node: fx.Node) -> bool:
    """A tensor-valued node (or one with nothing recorded)."""
    value = example(node)
    return value is None or isinstance(value, torch.Tensor)


# --------------------------------------------------------------------------- schemas: aliasing and mutation


@functools.lru_cache(maxsize=None)
def _aten_overloads(name: str) -> tuple:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    return tuple(getattr(packet, o) for o in packet.overloads())


def schemas(node: fx.Node) -> list:
    """The ATen schemas ``node``'s target may run (empty: none known)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, o)._schema for o in target.overloads()]
    if node.op == "call_method":
        return [o._schema for o in _aten_overloads(DUNDER_OPS.get(target, target))]
    if node.op == "call_function" and _is_torch_function(target):
        return [o._schema for o in _aten_overloads(target.__name__)]
    return []


def _is_torch_function(target: object) -> bool:
    owner = getattr(target, "__objclass__", None)  # torch.Tensor.view and friends
    module = getattr(target, "__module__", None) or ""
    return (isinstance(owner, type) and issubclass(owner, torch._C.TensorBase)) or module.split(".")[0] == "torch"


def _nodes(value: object) -> list[fx.Node]:
    """The nodes in an argument (a node, or a list/tuple of them as in ``out=(a, b)``)."""
    if isinstance(value, fx.Node):
        return [value]
    return [v for v in value if isinstance(v, fx.Node)] if isinstance(value, (tuple, list)) else []


def _schema_writes(schema, node: fx.Node) -> list[fx.Node]:
    written = []  # a method's self is args[0], as it is the schema's first argument
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            written += _nodes(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
    return written


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node`` may write in place (module docstring: schema first)."""
    if node.op == "call_module":
        return node.all_input_nodes  # opaque: assume the worst
    if node.op not in ("call_function", "call_method"):
        return []
    target, args = node.target, node.args
    first = [args[0]] if args and isinstance(args[0], fx.Node) else []
    if target in INPLACE_OPERATORS or (node.op == "call_method" and target in INPLACE_DUNDERS):
        return first
    if node.op == "call_function" and getattr(target, "__module__", None) in ("operator", "_operator"):
        return []  # and_, or_, not_ end in "_" but are pure
    written = _nodes(node.kwargs.get("out"))
    if node.kwargs.get("inplace") is True:
        written += first
    found = schemas(node)
    if found:
        for schema in found:  # any overload that writes an argument passed here
            written += [w for w in _schema_writes(schema, node) if w not in written]
        return written
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    if isinstance(name, str) and name.endswith("_") and not name.startswith("_"):
        return first + written  # an in-place method with no ATen op of its name
    if node.op == "call_method" or _is_torch_function(target):
        return written
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] in ("math", "builtins", "dsa_dcp"):
        return written
    return node.all_input_nodes  # a function dynamo kept opaque: assume the worst


def mutates(node: fx.Node, value: fx.Node) -> bool:
    """``node`` may write ``value`` in place."""
    return value in mutated_args(node)


def is_view(node: fx.Node) -> bool:
    """``node``'s result may share its first argument's memory (and ``node`` writes nothing)."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_function" and node.target in VIEW_WITHOUT_SCHEMA:
        return is_tensor(node.args[0])
    for schema in schemas(node):
        first = schema.arguments[0].alias_info if schema.arguments else None
        if first is None or first.is_write:
            continue
        if any(r.alias_info is not None and r.alias_info.before_set == first.before_set for r in schema.returns):
            return is_tensor(node.args[0])
    return False


def returns_written(node: fx.Node) -> bool:
    """``node`` writes its first argument in place and returns it (``x.add_(1)``, ``x += y``)."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv) or node.target in DUNDER_OPS:
        return node.target not in (operator.setitem, "__setitem__")
    for schema in schemas(node):
        first = schema.arguments[0].alias_info if schema.arguments else None
        if first is not None and first.is_write and any(
                r.alias_info is not None and r.alias_info.before_set == first.before_set for r in schema.returns):
            return True
    return False


def alias_base(node: fx.Node) -> fx.Node:
    """Follow views and in-place results back to the node whose storage ``node`` shares."""
    while is_view(node) or returns_written(node):
        node = node.args[0]
    return node


# in-place writes whose result does not depend on what they overwrite: repeating one with the same
# arguments changes nothing (a KV write of the same rows into the same slots)
_OVERWRITES = {"setitem", "__setitem__", "copy_", "index_copy_", "index_fill_", "fill_", "zero_", "masked_fill_",
               "masked_scatter_", "dsa_dcp.kv_store.default", "dsa_dcp.position_store.default"}


def overwrites(node: fx.Node) -> bool:
    """``node`` writes values that do not depend on the ones it replaces (see ``_OVERWRITES``)."""
    name = target_name(node.target)
    if name in ("index_put_", "aten.index_put_.default"):
        return not arg(node, 3, "accumulate", False)
    if name == "scatter_":
        return "reduce" not in node.kwargs and len(node.args) <= 4
    return name in _OVERWRITES


# --------------------------------------------------------------------------- structure


def placeholder_values(gm: fx.GraphModule, example_inputs: tuple) -> dict[fx.Node, object]:
    """Placeholder node -> the real input it stands for (parameters and buffers included)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, example_inputs))


def users_in_order(node: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(node.users, key=order.__getitem__)


def only_user(node: fx.Node, target=None) -> fx.Node | None:
    """The one user of ``node`` (a ``call_function`` of ``target`` when given), else ``None``."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if target is not None and not (user.op == "call_function" and user.target is target):
        return None
    return user


def getitem_users(node: fx.Node) -> Iterator[tuple[int, fx.Node]]:
    """``(index, user)`` for each ``operator.getitem(node, index)`` user of a tuple-valued node."""
    for user in users_in_order(node):
        if user.op == "call_function" and user.target is operator.getitem:
            yield user.args[1], user


# --------------------------------------------------------------------------- metadata and inserting nodes

_LAYER = re.compile(r"\blayers\W{1,12}?(\d+)")
META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")
_MISSING = object()


def recorded_layer(node: fx.Node) -> int | None:
    """The model layer of ``node``: set by a pass (``meta["dsa_dcp_layer"]``), else the ``layers[i]``
    index in dynamo's module stack (outermost match); ``None`` for inputs and where unknown."""
    if "dsa_dcp_layer" in node.meta:
        return node.meta["dsa_dcp_layer"]
    if node.op in ("placeholder", "get_attr", "output"):
        return None  # inputs are shared by layers; dynamo records only their first user
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _LAYER.search(str(path))
        if match:
            return int(match.group(1))
    return None


def fake_mode_of(graph: fx.Graph) -> Any:
    """The fake mode of the values dynamo computed in ``graph`` (``None`` when it recorded none).
    A computed value's mode first: with tensor-subclass inputs dynamo may give the placeholders'
    values another one."""
    from torch._subclasses.fake_tensor import FakeTensor

    placeholder_mode = None
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, FakeTensor):
            if node.op != "placeholder":
                return value.fake_mode
            placeholder_mode = placeholder_mode or value.fake_mode
    return placeholder_mode


def _fake(value: Any, mode: Any = None) -> Any:
    """The fake values of an argument; a fake tensor of another mode re-made in ``mode``."""
    if isinstance(value, fx.Node):
        v = value.meta.get("example_value", _MISSING)
        from torch._subclasses.fake_tensor import FakeTensor

        if mode is not None and isinstance(v, FakeTensor) and v.fake_mode is not mode:
            with mode:
                v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        return v
    if isinstance(value, (list, tuple)):
        return type(value)(_fake(v, mode) for v in value)
    if isinstance(value, dict):
        return {k: _fake(v, mode) for k, v in value.items()}
    return value


def _has_missing(value: Any) -> bool:
    if value is _MISSING:
        return True
    if isinstance(value, dict):
        return any(_has_missing(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_has_missing(v) for v in value)


def _run_fake(node: fx.Node, mode: Any) -> Any:
    args, kwargs = _fake(node.args, mode), _fake(dict(node.kwargs), mode)
    if mode is None or _has_missing(args) or _has_missing(kwargs):
        return _MISSING
    with mode:
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


class Emitter:
    """Inserts nodes that carry their metadata, so nothing downstream (the inspection tool,
    Inductor) needs a second fake-tensor run to know what they hold.

    ``emit(target, *args, **kwargs)`` inserts a ``call_function``, ``emit.method(name, *args,
    **kwargs)`` a ``call_method``. Each node gets ``meta["example_value"]`` (module docstring), the
    module stack and source line of ``like`` (the node it stands beside: an attention node, a KV
    write), and ``meta["dsa_dcp_layer"]``. Nodes go where the graph's insert point is when they are
    emitted (use ``graph.inserting_*``).
    """

    def __init__(self, graph: fx.Graph, like: fx.Node | None = None, layer: int | None = None) -> None:
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)
        self.like = like
        self.layer = layer if layer is not None else (recorded_layer(like) if like is not None else None)

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._finish(self.graph.call_function(target, args, kwargs))

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        return self._finish(self.graph.call_method(name, args, kwargs))

    def opaque(self, target: Any, *args: Any) -> fx.Node:
        """A ``call_function`` not run on fake values (a host-side check that talks to the group):
        it gets the module stack and layer, and no ``example_value``."""
        return self._finish(self.graph.call_function(target, args), None)

    def known(self, value: Any, target: Any, *args: Any) -> fx.Node:
        """A ``call_function`` whose value the caller knows (a fake tensor it made itself), where
        running the target on the fake inputs cannot tell it (a position cache's local part)."""
        return self._finish(self.graph.call_function(target, args), value)

    def _finish(self, node: fx.Node, value: Any = _MISSING) -> fx.Node:
        if self.like is not None:
            for key in META_KEYS:
                if key in self.like.meta:
                    node.meta[key] = self.like.meta[key]
        if self.layer is not None:
            node.meta["dsa_dcp_layer"] = self.layer
        if value is _MISSING:
            try:
                value = _run_fake(node, self.fake_mode)
            except Exception as e:  # noqa: BLE001 - metadata is a convenience, never a reason to fail
                log.debug("no fake value for %s: %s: %s", target_name(node.target), type(e).__name__, e)
        if value is not _MISSING and value is not None:
            node.meta["example_value"] = value
        return node


def refresh_meta(nodes: list[fx.Node]) -> None:
    """Recompute ``meta["example_value"]`` of ``nodes`` (in order) after a pass changed their inputs."""
    for node in nodes:
        try:
            value = _run_fake(node, fake_mode_of(node.graph))
        except Exception as e:  # noqa: BLE001 - stale metadata is dropped, never kept
            log.debug("no fake value for %s: %s: %s", node.name, type(e).__name__, e)
            value = _MISSING
        if value is _MISSING:
            node.meta.pop("example_value", None)
        else:
            node.meta["example_value"] = value
