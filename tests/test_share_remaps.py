"""``share_remaps``: one top-k remap per distinct top-k, never one shared between different top-k.

Graph-level checks compile for rank 0 of a fake process group in this process (no collectives
run for real); the numerics are checked on real gloo ranks, sharing on against sharing off and
against the single-rank function.
"""

import logging
import operator

import pytest
import torch
import torch.fx as fx

import dsa_dcp
from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.kv_cache import allocate_kv_cache
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.passes import build_pipeline
from dsa_dcp.passes.base import CompileContext
from dsa_dcp.passes.dataflow import to_networkx
from dsa_dcp.passes.share_remaps import ShareRemaps


# many short gloo runs: kept ranks (conftest.py)
pytestmark = pytest.mark.usefixtures("kept_ranks")

SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default
TOPK_REMAP = torch.ops.dsa_dcp.topk_remap.default
S, DC, DR, B, H, K = 32, 8, 4, 4, 2, 6


def _compile_stats(fn, *args, world=2, merge="ag", **options):
    """Compile ``fn`` for rank 0 of ``world``, run it once; the report's summary and share_remaps stats."""
    torch._dynamo.reset()
    with fake_group(world), torch.no_grad():
        options = {"dcp_size": world, "merge": merge, "lowering": "fx", **options}
        torch.compile(fn, backend="dsa_dcp", options=options, fullgraph=True)(*args)
    report = dsa_dcp.backend_report()
    return report.summary, report.stats().get("share_remaps")


# ----------------------------------------------------------------------------- whole models


def _model_stats(family, layers=None, world=2):
    cfg = get_config(family, **({"n_layers": layers} if layers else {}))
    model = DSAModel(cfg, 64, dcp_size=world)
    rows = torch.zeros(4, dtype=torch.int64)
    page_table = torch.full((1, 16), -1, dtype=torch.int32)
    return cfg, *_compile_stats(model, rows, rows - 1, rows, rows - 1, page_table, world=world, merge="a2a")


# GLM-5.2 whole (78 layers, 21 indexers: 21 remaps, each fused into its indexer's selection) is
# tests/test_inspect.py::test_glm52_tiny_shares_21_remaps_each_fused_into_its_selection, on the
# compile of the whole tiny model that module's inspection tests share (rank 0 of 4, a2a).


def test_deepseek_v32_keeps_one_remap_per_layer():
    cfg, summary, stats = _model_stats("deepseek-v3.2-tiny", layers=4, world=4)  # 61 layers: the same, slower
    assert cfg.indexer_layers == tuple(range(4))
    assert summary["remaps"] == summary["sparse_attention_nodes"] == 4
    assert (stats["remaps_before"], stats["remaps_after"]) == (4, 4)
    assert stats["layer_groups"] == [[layer] for layer in range(4)]
    assert len(stats["refusals"]) == 3


def test_share_remaps_option_turns_the_pass_off():
    ctx = CompileContext(options=DCPOptions.parse({"dcp_size": 2, "share_remaps": False}), rank=0, group_name="g")
    assert [p.name for p in build_pipeline(ctx)] == ["canonicalize", "indexer_kernels", "index_cache",
                                                     "localize_kv_writes", "dcp_rewrite", "fuse_remaps",
                                                     "slot_bounds"]
    ctx = CompileContext(options=DCPOptions.parse({"dcp_size": 2}), rank=0, group_name="g")
    assert [p.name for p in build_pipeline(ctx)] == ["canonicalize", "indexer_kernels", "index_cache",
                                                     "localize_kv_writes", "dcp_rewrite", "share_remaps", "fuse_remaps",
                                                     "slot_bounds"]
    with pytest.raises(OptionsError, match=r"share_remaps must be True or False, got 'yes'"):
        DCPOptions.parse({"share_remaps": "yes"})
    assert DCPOptions.parse({}).cache_key() != DCPOptions.parse({"share_remaps": False}).cache_key()


# ----------------------------------------------------------------------------- hand-written graphs


def _attn(q, q_pe, kv, topk):
    return SPARSE_MLA(q, q_pe, kv, topk, 0.5)[0]


def _inputs(layers, world=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, q_pe = torch.randn(B, H, DC, generator=gen), torch.randn(B, H, DR, generator=gen)
    caches = [allocate_kv_cache(S, DC + DR, dcp_size=world) for _ in range(layers)]
    topk = torch.randperm(S, generator=gen)[: B * K].view(B, K).to(torch.int32)
    return q, q_pe, caches, topk


def seen_through_views_and_copies(q, q_pe, kv0, kv1, kv2, kv3, kv4, topk):
    a = _attn(q, q_pe, kv0, topk)
    b = _attn(q, q_pe, kv1, topk.view(B, K)[:, :].clone())
    c = _attn(q, q_pe, kv2, topk.contiguous().to(torch.int32).detach())
    d = _attn(q, q_pe, kv3, torch.ops.aten.clone.default(topk.view(-1)).reshape(B, K))
    e = _attn(q, q_pe, kv4, torch.empty_like(topk).copy_(topk))
    return a + b + c + d + e


def through_getitem(q, q_pe, kv0, kv1, kv2, scores):
    t = torch.topk(scores, K, dim=-1)
    a = _attn(q, q_pe, kv0, t.indices.int())
    b = _attn(q, q_pe, kv1, t[1].int())
    c = _attn(q, q_pe, kv2, t[1][:, :K].int())
    return a + b + c


def two_topk_calls(q, q_pe, kv0, kv1, scores):
    a = _attn(q, q_pe, kv0, torch.topk(scores, K, dim=-1).indices.int())
    b = _attn(q, q_pe, kv1, torch.topk(scores, K, dim=-1).indices.int())  # equal values, another tensor
    return a + b


def two_inputs(q, q_pe, kv0, kv1, topk_a, topk_b):
    return _attn(q, q_pe, kv0, topk_a) + _attn(q, q_pe, kv1, topk_b)


def modified_not_in_place(q, q_pe, kv0, kv1, topk):
    return _attn(q, q_pe, kv0, topk) + _attn(q, q_pe, kv1, torch.where(topk > 3, topk, -1))


def _set_column(t):
    t[:, 0] = -1


def _add(t):
    t.add_(0)


def _iadd(t):
    t += 0


def _fill_alias(t):
    t.view(-1)[:2].fill_(-1)


@torch.library.custom_op("dsa_dcp_test::drop_first_slot", mutates_args=("topk",))
def drop_first_slot(topk: torch.Tensor) -> None:
    topk[:, 0] = -1


def _custom_op(t):
    torch.ops.dsa_dcp_test.drop_first_slot.default(t)


EDITS = {"setitem": _set_column, "add_": _add, "+=": _iadd, "alias fill_": _fill_alias,
         "mutating custom op": _custom_op}


def edited_in_place(edit):
    def fn(q, q_pe, kv0, kv1, kv2, topk):
        a = _attn(q, q_pe, kv0, topk)
        edit(topk)
        b = _attn(q, q_pe, kv1, topk)  # both read the edited top-k: they share
        c = _attn(q, q_pe, kv2, topk.clone())
        return a + b + c

    return fn


def copy_edited_in_place(q, q_pe, kv0, kv1, kv2, topk):
    copy = topk.clone()
    a = _attn(q, q_pe, kv0, topk)
    b = _attn(q, q_pe, kv1, copy)  # the copy, unedited yet: same value as topk
    copy[:, 0] = -1
    c = _attn(q, q_pe, kv2, copy)
    return a + b + c


def test_same_topk_through_views_clones_copies_is_shared():
    q, q_pe, caches, topk = _inputs(5)
    summary, stats = _compile_stats(seen_through_views_and_copies, q, q_pe, *caches, topk)
    assert (stats["remaps_before"], summary["remaps"]) == (5, 1), stats["refusals"]
    assert stats["groups"] == [[f"sparse_mla_default{s}" for s in ("", "_1", "_2", "_3", "_4")]]
    assert stats["refusals"] == []
    code = dsa_dcp.backend_report().graph_after
    assert "clone" not in code and "reshape" not in code  # the copies only the dropped remaps read are gone
    assert code.count("sparse_mla.default(") == 5


def test_same_topk_through_getitems_is_shared():
    q, q_pe, caches, _ = _inputs(3)
    summary, stats = _compile_stats(through_getitem, q, q_pe, *caches, torch.randn(B, S))
    assert (stats["remaps_before"], summary["remaps"]) == (3, 1), stats["refusals"]


def test_equal_valued_distinct_topk_tensors_are_not_shared():
    q, q_pe, caches, topk = _inputs(2)
    summary, stats = _compile_stats(two_topk_calls, q, q_pe, *caches, torch.randn(B, S))
    assert (stats["remaps_before"], summary["remaps"]) == (2, 2)
    assert "a different tensor" in stats["refusals"][0]
    summary, stats = _compile_stats(two_inputs, q, q_pe, *caches, topk, topk.clone())
    assert (stats["remaps_before"], summary["remaps"]) == (2, 2)


def test_topk_derived_by_another_op_is_not_shared():
    q, q_pe, caches, topk = _inputs(2)
    summary, stats = _compile_stats(modified_not_in_place, q, q_pe, *caches, topk)
    assert summary["remaps"] == 2
    assert "computed from" in stats["refusals"][0] and "not a view or copy" in stats["refusals"][0]


@pytest.mark.parametrize("edit", list(EDITS))
def test_topk_edited_in_place_between_layers_is_not_shared(edit, caplog):
    q, q_pe, caches, topk = _inputs(3)
    with caplog.at_level(logging.DEBUG, logger="dsa_dcp.passes"):
        summary, stats = _compile_stats(edited_in_place(EDITS[edit]), q, q_pe, *caches, topk.clone())
    assert summary["remaps"] == 2
    assert stats["groups"] == [["sparse_mla_default"], ["sparse_mla_default_1", "sparse_mla_default_2"]]
    (reason,) = stats["refusals"]
    assert "modified in place" in reason
    assert reason in caplog.text


def test_copy_edited_after_its_first_read():
    q, q_pe, caches, topk = _inputs(3)
    summary, stats = _compile_stats(copy_edited_in_place, q, q_pe, *caches, topk)
    assert stats["groups"] == [["sparse_mla_default", "sparse_mla_default_1"], ["sparse_mla_default_2"]]
    assert "modified in place by ['setitem']" in stats["refusals"][0]


def _remap_graph(params):
    """An FX graph with one remap per ``params`` entry, each on input ``a`` or ``b``."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    outs = []
    for source, n, rank, interleave in params:
        remap = graph.call_function(TOPK_REMAP, ({"a": a, "b": b}[source], n, rank, interleave))
        outs.append(graph.call_function(operator.getitem, (remap, 0)))
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _share(gm, *inputs):
    ctx = CompileContext(options=DCPOptions.parse({"dcp_size": 2}), rank=0, group_name=None,
                         example_inputs=inputs)
    return ShareRemaps()(gm, ctx).stats


def test_different_dcp_size_rank_or_interleave_are_not_shared(caplog):
    params = [("a", 2, 0, 1), ("a", 2, 1, 1), ("a", 4, 0, 1), ("a", 2, 0, 2), ("a", 2, 0, 1)]
    gm = _remap_graph(params)
    topk = torch.arange(12, dtype=torch.int32).view(2, 6)
    expected = gm(topk, topk)
    with caplog.at_level(logging.DEBUG, logger="dsa_dcp.passes"):
        stats = _share(gm, topk, topk)
    assert (stats["remaps_before"], stats["remaps_after"]) == (5, 4)
    assert len(stats["refusals"]) == 3
    assert all("different (N, rank, interleave)" in r and r in caplog.text for r in stats["refusals"])
    assert [str(t) for t in gm(topk, topk)] == [str(t) for t in expected]


@pytest.mark.parametrize("same", [True, False])
def test_graph_inputs_that_alias(same):
    base = torch.arange(24, dtype=torch.int32).view(4, 6)
    # two tensor objects over one storage with the same view parameters are one top-k
    a, b = (base[:2], base[:2]) if same else (base[:2], base[2:])
    stats = _share(_remap_graph([("a", 2, 0, 1), ("b", 2, 0, 1)]), a, b)
    assert stats["remaps_after"] == (1 if same else 2)
    stats = _share(_remap_graph([("a", 2, 0, 1), ("b", 2, 0, 1)]), a, a.clone())
    assert stats["remaps_after"] == 2


def test_dataflow_view_has_layers_and_kinds():
    cfg = get_config("glm5.2-tiny", n_layers=4)
    model = DSAModel(cfg, 64, dcp_size=2)
    rows = torch.zeros(4, dtype=torch.int64)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(to_networkx(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep, fullgraph=True)(rows, rows - 1, rows, rows - 1,
                                                       torch.full((1, 16), -1, dtype=torch.int32))
    g = graphs[0]
    attention = [d for _, d in g.nodes(data=True) if d["kind"] == "sparse_attention"]
    assert [d["layer"] for d in attention] == [0, 1, 2, 3]
    assert {d["target"] for d in attention} == {"dsa_dcp.sparse_mla.default"}
    writes = [n for n, d in g.nodes(data=True) if d["mutates"]]
    assert len(writes) == 4 + 3 and all(g.nodes[n]["kind"] == "kv_write" for n in writes)


# ----------------------------------------------------------------------------- on real ranks

STEPS, ROWS = 6, 16


def _on_off_rank(rank, world):
    from dsa_dcp.slots import local_row, owner

    cfg = get_config("glm5.2-tiny", n_layers=4)  # layer 3 reuses layer 2's top-k
    batch = standard_test_batch(cfg, max_new_tokens=STEPS, seed=7)
    from one_trace import OneTrace

    results = {}
    torch._dynamo.reset()
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=11)
    backend = OneTrace({share: {"dcp_size": world, "share_remaps": share, "lowering": "fx"} for share in (True, False)})
    step = torch.compile(model, backend=backend, fullgraph=True)  # traced once, compiled with sharing on and off
    for share in (True, False):
        backend.select(share)
        model.reset_caches()
        with torch.no_grad():
            out = generate(step, batch, STEPS, pad_to=ROWS)
        results[share] = {"tokens": out.tokens, "logits": out.step_logits, "summary": backend.reports[share].summary}

    # a top-k edited in place between layers: the refusal keeps the result right
    q, q_pe, _, topk = _inputs(3, world)
    global_kv = [torch.randn(S, DC + DR, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    slots = torch.arange(S)
    mine = owner(slots, world, 1) == rank
    caches = [allocate_kv_cache(S, DC + DR, dcp_size=world) for _ in range(3)]
    for cache, kv in zip(caches, global_kv):
        cache[local_row(slots[mine], world, 1)] = kv[mine]
    torch._dynamo.reset()
    fn = torch.compile(edited_in_place(EDITS["setitem"]), backend="dsa_dcp", options={"dcp_size": world, "merge": "ag", "lowering": "fx"},
                       fullgraph=True)
    results["edited"] = fn(q, q_pe, *caches, topk.clone())
    results["edited_ref"] = edited_in_place(EDITS["setitem"])(q, q_pe, *global_kv, topk.clone())
    results["edited_remaps"] = dsa_dcp.backend_report().summary["remaps"]
    return results


@pytest.mark.parametrize("world", [2])
def test_outputs_identical_with_sharing_on_and_off(world):
    ranks = run_on_ranks(_on_off_rank, world)
    for res in ranks:
        on, off = res[True], res[False]
        assert on["summary"]["remaps"] == 3 and off["summary"]["remaps"] == 4  # GLM-5.2, 4 layers: 3 indexers
        assert on["tokens"] == off["tokens"] == ranks[0][True]["tokens"]
        assert len(on["logits"]) == len(off["logits"]) >= STEPS
        for a, b in zip(on["logits"], off["logits"]):
            assert torch.equal(a, b)
        assert res["edited_remaps"] == 2
        torch.testing.assert_close(res["edited"], res["edited_ref"], rtol=1e-5, atol=1e-5)
