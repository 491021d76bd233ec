"""The ``indexer_kernels`` pass: the lightning indexer as authors write it becomes ``index_scores`` +
``topk_select``; anything it cannot prove equivalent is left exactly as written.

Each case compiles with the FX lowering and compares with the same function run eagerly (the
reference indexer as written): attention over the selected slots must agree to fp32 rounding
(random fp32 scores, so ties at the K-th score do not occur).
"""

import pytest
import torch
import torch.nn.functional as F

import dsa_dcp
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.ops import INDEX_SCORES, TOPK_REMAP, TOPK_SELECT, TOPK_SELECT_REMAP


SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default
T, R, MAX_PAGES, P, S, HI, DI, H, DC, DR, K = 6, 3, 5, 4, 64, 4, 8, 2, 8, 4, 7


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- the reference models


# DeepSeek-V3.2: an indexer in every layer; GLM-5.2: indexers in layers 0-2, layer 3 reuses layer 2's top-k
@pytest.mark.parametrize("family, layers", [("deepseek-v3.2-tiny", 2), ("glm5.2-tiny", 4)])
def test_reference_models_at_dcp_size_one(family, layers):
    from one_trace import OneTrace

    cfg = get_config(family, n_layers=layers)
    batch = standard_test_batch(cfg, max_new_tokens=4, seed=5)
    with torch.no_grad():
        ref = generate(DSAModel(cfg, batch.num_slots, seed=2), batch, 4, pad_to=16)
    # the model traced once, compiled with the pass on and off (tests/one_trace.py)
    backend = OneTrace({kernels: {"lowering": "fx", "indexer_kernels": kernels} for kernels in (True, False)})
    model = DSAModel(cfg, batch.num_slots, seed=2)
    torch._dynamo.reset()
    step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    for kernels in (True, False):
        backend.select(kernels)
        model.reset_caches()
        with torch.no_grad():
            out = generate(step, batch, 4, pad_to=16)
        assert out.tokens == ref.tokens
        for a, b in zip(out.step_logits, ref.step_logits, strict=True):
            assert _relative_error(a, b) < 1e-5
        assert backend.traces == 1
        report = backend.reports[kernels]
        targets = _targets(report.graph)
        if kernels:
            stats = report.stats()["indexer_kernels"]
            assert stats["indexers_matched"] == len(cfg.indexer_layers) and stats["indexers_left"] == []
            assert targets.count(TOPK_SELECT) == targets.count(INDEX_SCORES) == len(cfg.indexer_layers)
            assert torch.topk not in targets
        else:
            assert report.passes == [] and targets.count(torch.topk) == len(cfg.indexer_layers)


def test_debug_checks_keep_the_global_topk_and_its_remap():
    """debug_checks read the global top-k, so the remap is not fused (and says why)."""
    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    model = DSAModel(cfg, 64, dcp_size=2)
    rows = torch.zeros(4, dtype=torch.int64)
    page_table = torch.full((1, 16), -1, dtype=torch.int32)
    torch._dynamo.reset()
    with fake_group(2), torch.no_grad():
        options = {"dcp_size": 2, "lowering": "fx", "debug_checks": True, "merge": "ag"}
        torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True)(rows, rows - 1, rows, rows - 1,
                                                                                 page_table)
    stats = dsa_dcp.backend_report().stats()["fuse_remaps"]
    assert stats["remaps_fused"] == 0 and len(stats["remaps_kept"]) == 2
    assert "is also read by" in stats["remaps_kept"][0]


# ----------------------------------------------------------------------------- plain-PyTorch indexers


def indexer(q, w, index_cache, page_table, req_ids, positions, *, product="einsum", head_sum="einsum",
            mask="masked_fill", q_float=True, pages="index_select", clamp="clamp", result="int32", compare="<="):
    """A lightning indexer in plain PyTorch, in the spellings the pass accepts (and some it must not)."""
    req = req_ids.clamp(min=0)
    pages_ = page_table.index_select(0, req).long() if pages == "index_select" else page_table[req].long()
    cand = (pages_.unsqueeze(-1) * P + torch.arange(P)).flatten(1)
    pos = torch.arange(cand.shape[1])

    def valid():
        in_range = pos[None, :] <= positions[:, None] if compare == "<=" else pos[None, :] < positions[:, None]
        return in_range & (cand >= 0)
    index = cand.clamp(min=0) if clamp == "clamp" else cand.clamp_min(0) if clamp == "clamp_min" else cand
    keys = index_cache[index].float()
    qq = q.float() if q_float else q
    if product == "einsum":
        logits = torch.einsum("thd,tcd->thc", qq, keys).relu()
    elif product == "matmul":
        logits = F.relu(qq @ keys.transpose(1, 2))
    else:  # keys first: logits [T, C, H]
        logits = torch.relu(torch.matmul(keys, qq.transpose(-1, -2)))
    if product == "matmul_kq":
        score = torch.einsum("tch,th->tc", logits, w) if head_sum == "einsum" else \
            (logits * w.unsqueeze(1)).sum(-1) if head_sum == "sum" else \
            torch.matmul(logits, w.unsqueeze(-1)).squeeze(-1)
    else:
        score = torch.einsum("thc,th->tc", logits, w) if head_sum == "einsum" else \
            (logits * w[:, :, None]).sum(dim=1) if head_sum == "sum" else (w.unsqueeze(1) @ logits).squeeze(1)
    if mask == "masked_fill":
        score = score.masked_fill(~valid(), float("-inf"))
    elif mask == "where":
        score = torch.where(valid(), score, float("-inf"))
    else:  # the invalid set spelled directly
        score = score.masked_fill((pos[None, :] > positions[:, None]) | (cand < 0), float("-inf"))
    top_score, top_idx = torch.topk(score, K, dim=-1)
    top = torch.where(top_score == float("-inf"), torch.full_like(top_idx, -1), cand.gather(1, top_idx))
    return top.to(torch.int32) if result == "int32" else top


def _step(variant):
    def step(q, w, index_cache, page_table, req_ids, positions, q_nope, q_pe, kv):
        topk = indexer(q, w, index_cache, page_table, req_ids, positions, **variant)
        out, _ = SPARSE_MLA(q_nope, q_pe, kv, topk, 0.3)
        return out
    return step


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    page_table = torch.randperm(S // P, generator=g)[: R * MAX_PAGES].view(R, MAX_PAGES).to(torch.int32)
    page_table[2, 3:] = -1  # a short request
    req_ids = torch.tensor([0, 1, 1, 2, 2, 0])
    positions = torch.tensor([19, 3, 11, 15, 9, -1])  # the last row is padding: no candidate
    return (torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(S, DI, generator=g),
            page_table, req_ids, positions, torch.randn(T, H, DC, generator=g), torch.randn(T, H, DR, generator=g),
            torch.randn(S, DC + DR, generator=g))


def _compile(variant, inputs, **options):
    torch._dynamo.reset()
    fn = _step(variant)
    compiled = torch.compile(fn, backend="dsa_dcp", options={"lowering": "fx", **options}, fullgraph=True,
                             dynamic=False)
    with torch.no_grad():
        return fn(*inputs), compiled(*inputs), dsa_dcp.backend_report()


ACCEPTED = [
    {},
    {"product": "matmul", "head_sum": "sum", "mask": "where", "q_float": False},
    {"product": "matmul_kq", "head_sum": "matmul", "mask": "invalid", "pages": "getitem", "clamp": "clamp_min"},
    {"product": "matmul_kq", "head_sum": "sum", "result": "int64"},
    {"product": "einsum", "head_sum": "matmul", "mask": "where", "result": "int64"},
]


@pytest.mark.parametrize("variant", ACCEPTED, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "reference")
def test_accepted_spellings_are_replaced(variant):
    inputs = _inputs()
    eager, compiled, report = _compile(variant, inputs)
    stats = report.stats()["indexer_kernels"]
    assert stats["indexers_matched"] == 1, stats["indexers_left"]
    targets = _targets(report.graph)
    assert targets.count(INDEX_SCORES) == 1 and targets.count(TOPK_SELECT) == 1 and torch.topk not in targets
    # only the index reads the page table, positions and keys now: the model's gathers are gone
    assert torch.einsum not in targets and torch.arange not in targets
    assert _relative_error(compiled, eager) < 1e-5


def test_bf16_query_reaches_the_kernel_unwidened():
    inputs = list(_inputs())
    inputs[0] = inputs[0].bfloat16()
    eager, compiled, report = _compile({}, tuple(inputs))
    (scores,) = [n for n in report.graph.graph.nodes if n.target is INDEX_SCORES]
    assert scores.args[0].meta["example_value"].dtype == torch.bfloat16  # the .float() was exact: dropped
    assert _relative_error(compiled, eager) < 1e-5


LEFT = [
    ({"compare": "<"}, "its mask term"),  # p < positions: a different candidate set
    ({"clamp": None}, "not at cand.clamp(min=0)"),  # a negative slot would wrap around to the last row
]


@pytest.mark.parametrize("variant, reason", LEFT, ids=lambda v: str(v))
def test_what_it_cannot_prove_is_left_as_written(variant, reason, caplog):
    inputs = _inputs()
    with caplog.at_level("DEBUG", logger="dsa_dcp.passes"):
        eager, compiled, report = _compile(variant, inputs)
    stats = report.stats()["indexer_kernels"]
    assert stats["indexers_matched"] == 0 and len(stats["indexers_left"]) == 1
    assert reason in stats["indexers_left"][0] and reason in caplog.text
    targets = _targets(report.graph)
    assert INDEX_SCORES not in targets and targets.count(torch.topk) == 1
    assert torch.equal(compiled, eager)  # the graph runs as written


def test_a_topk_read_in_order_is_left_as_written():
    """topk_select lists the selection by position; a model that returns the top-k sees its order."""
    inputs = _inputs()

    def returns_topk(q, w, index_cache, page_table, req_ids, positions, q_nope, q_pe, kv):
        topk = indexer(q, w, index_cache, page_table, req_ids, positions)
        out, _ = SPARSE_MLA(q_nope, q_pe, kv, topk, 0.3)
        return out, topk

    torch._dynamo.reset()
    compiled = torch.compile(returns_topk, backend="dsa_dcp", options={"lowering": "fx"}, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(*inputs), returns_topk(*inputs)
    (reason,) = dsa_dcp.backend_report().stats()["indexer_kernels"]["indexers_left"]
    assert "which may depend on its order" in reason
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_a_topk_over_something_else_is_left_alone():
    def route(x, w_gate):
        scores = F.linear(x, w_gate).softmax(-1)
        weights, experts = torch.topk(scores, 2, dim=-1)
        return weights * experts.float()

    torch._dynamo.reset()
    x, w_gate = torch.randn(5, 8), torch.randn(6, 8)
    compiled = torch.compile(route, backend="dsa_dcp", options={"lowering": "fx"}, fullgraph=True)
    assert torch.equal(compiled(x, w_gate), route(x, w_gate))
    report = dsa_dcp.backend_report()
    (reason,) = report.stats()["indexer_kernels"]["indexers_left"]
    assert "are not masked to -inf" in reason
    assert torch.topk in _targets(report.graph)
