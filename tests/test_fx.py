"""``passes/fx.py``, the one place for FX semantics: mutation and aliasing read from the op schemas,
the tables for what has none agreeing with the schemas where both exist, and ``Emitter``'s metadata."""

import operator

import pytest
import torch
import torch.fx as fx

import dsa_dcp  # noqa: F401  registers the ops
from dsa_dcp.passes import fx as F


def _graph(fn, *inputs):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm


def _writes(x, y, cache, slots):
    x.add_(1)
    x += y
    x.__imul__(2)
    y[0] = 3.0
    torch.ops.dsa_dcp.kv_store(cache, slots, x[:2])
    z = x.clone().relu_()
    w = x.transpose(0, 1).contiguous().view(-1).to(torch.float32)
    return z + w.sum() + (x & y.bool()).float().sum() if False else z + w.sum()


def test_writes_and_views_follow_the_schemas():
    cache, slots = torch.zeros(8, 3), torch.tensor([1, 4])
    gm = _graph(_writes, torch.randn(3, 3), torch.randn(3, 3), cache, slots)
    by_target = {}
    for n in gm.graph.nodes:
        by_target.setdefault(F.target_name(n.target), []).append(n)
    names = lambda nodes: sorted(a.name for a in nodes)  # noqa: E731
    (add_,) = by_target["add_"]
    assert names(F.mutated_args(add_)) == [add_.args[0].name]
    (iadd,) = by_target["iadd"]  # x += y: Python's operator, no schema, the table
    assert F.mutated_args(iadd) == [iadd.args[0]]
    (imul,) = by_target["__imul__"]  # a dunder method: aten.mul_'s schema
    assert F.mutated_args(imul) == [imul.args[0]]
    (setitem,) = by_target["setitem"]
    assert F.mutated_args(setitem) == [setitem.args[0]]
    (store,) = by_target["dsa_dcp.kv_store"]
    assert F.mutated_args(store) == [store.args[0]] and F.alias_base(store.args[0]).op == "placeholder"
    (relu_,) = by_target["relu_"]
    assert F.mutated_args(relu_) == [relu_.args[0]] and F.mutated_args(relu_.args[0]) == []  # clone writes nothing
    for name in ("transpose", "contiguous", "view", "to"):  # may share memory: the schema says Tensor(a) -> Tensor(a)
        (node,) = by_target[name]
        assert F.is_view(node) and not F.mutated_args(node), name
    (view,) = by_target["view"]  # back through contiguous, transpose and x += y to the input x
    assert F.alias_base(view) is by_target["add_"][0].args[0] and F.returns_written(iadd)
    assert not F.returns_written(setitem) and F.returns_written(add_) and not F.returns_written(view)
    assert not F.is_view(by_target["sum"][0]) and not F.is_view(relu_.args[0])


@pytest.mark.parametrize("dunder, op", sorted(F.DUNDER_OPS.items()))
def test_the_dunder_table_agrees_with_the_schemas(dunder, op):
    overloads = F._aten_overloads(op)
    assert overloads, op
    assert any(o._schema.arguments[0].alias_info is not None and o._schema.arguments[0].alias_info.is_write
               for o in overloads), f"{dunder} -> aten.{op} does not write self"


def test_the_operator_tables_have_no_schema_to_disagree_with():
    for op in F.INPLACE_OPERATORS | F.VIEW_WITHOUT_SCHEMA:
        node = fx.Graph().call_function(op, ())
        assert F.schemas(node) == [], op


def test_an_opaque_function_may_write_every_argument():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")

    def opaque(x, y):
        return x

    node = g.call_function(opaque, (a, b))
    assert F.mutated_args(node) == [a, b]
    assert F.mutated_args(g.call_function(operator.and_, (a, b))) == []  # ends in _ but pure


def test_emitter_gives_every_node_its_value_and_layer():
    gm = _graph(lambda x: x.relu() + 1, torch.randn(2, 3))
    relu = next(n for n in gm.graph.nodes if F.target_name(n.target) == "relu")
    emit = F.Emitter(gm.graph, like=relu, layer=7)
    with gm.graph.inserting_after(relu):
        full = emit(torch.full, (2, 3), 1.5, dtype=torch.float64)
        flat = emit.method("flatten", full, 0)
    assert F.shape(full) == (2, 3) and F.dtype(full) == torch.float64
    assert F.shape(flat) == (6,) and flat.op == "call_method"
    assert full.meta["dsa_dcp_layer"] == flat.meta["dsa_dcp_layer"] == 7
    assert full.meta.get("stack_trace") == relu.meta.get("stack_trace")
