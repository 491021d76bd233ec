"""FP8 index queries: with FP8 index keys the reference models quantize the indexer's queries to
E4M3 as well (one power-of-two scale a head, folded into the head's weight, as DeepSeek-V3.2's
inference does), and ``index_scores`` multiplies E4M3 x E4M3 (dsa_dcp/kernels/index_scores.py).

The kernel against an fp64 brute force (interpreted on CPU, compiled on a GPU machine), the sharded
form bit-identical to the replicated one, the refusal of FP8 queries over non-FP8 keys, and the
model: the compiled step feeds ``index_scores`` the E4M3 queries and equals the eager model.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from test_indexer_kernels import _brute_scores, _dev, _gen, _keys, _paged_step  # noqa: E402
from triton_env import DEVICE, NEEDS_FRESH_PROCESS, SKIP_REASON, rerun_in_fresh_interpreter  # noqa: E402

import dsa_dcp  # noqa: E402
from dsa_dcp.kernels import index_scores as scores_mod  # noqa: E402
from dsa_dcp.kernels.kv_store import quantize_rows  # noqa: E402
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch  # noqa: E402
from dsa_dcp.ops import INDEX_SCORES  # noqa: E402
from dsa_dcp.passes import fx as fx_facts  # noqa: E402
from dsa_dcp.slots import owner  # noqa: E402

E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _interpreter_or_fresh_process(request):
    if NEEDS_FRESH_PROCESS and request.node.originalname != "test_in_fresh_interpreter":
        pytest.skip(SKIP_REASON)


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the interpreter works in this process")
def test_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__, timeout=600)


def _fp8_queries(q: torch.Tensor, w: torch.Tensor):
    """The model's quantization: E4M3 queries, each head's power-of-two scale folded into w."""
    T, Hi, Di = q.shape
    q8, scale = quantize_rows(q.reshape(T * Hi, Di), block=True)
    return q8.view(T, Hi, Di), w * scale.view(T, Hi)


@pytest.mark.parametrize("keys", ["fp8-row", "fp8-tensor"])
@pytest.mark.parametrize("Hi,Di,max_pages,span", [(4, 32, 6, None), (3, 40, 40, 128)])
def test_index_scores_fp8_queries(keys, Hi, Di, max_pages, span):
    """Against the fp64 brute force over the E4M3 queries, within the contract's bound; Hi and Di
    not powers of two, two programs a row (span 128 of 160 candidates: a whole tile on a GPU);
    -1 pages, a row without a request, short rows."""
    gen = _gen("fp8-queries", keys, Hi, Di)
    page_table, req_ids, positions, page = _paged_step(gen, max_pages=max_pages, pages_total=200)
    T, S = req_ids.shape[0], 200 * page
    q, w = _fp8_queries(torch.randn((T, Hi, Di), generator=gen) * 3, torch.randn((T, Hi), generator=gen) * Hi**-0.5)
    assert q.dtype == E4M3
    cache, key_scale, dequant = _keys(gen, S, Di, keys)
    exp, err_scale = _brute_scores(q.double(), w, dequant, page_table, req_ids, positions, page)
    args = _dev(q, w, cache, key_scale, page_table, req_ids, positions)
    for name, got in (("reference", scores_mod.index_scores_reference(*args, page)),
                      ("triton", scores_mod.index_scores_triton(*args, page, span=span))):
        got = got.cpu().double()
        assert torch.equal(torch.isneginf(got), torch.isneginf(exp)), f"{name}: -inf (invalid) positions differ"
        fin = torch.isfinite(exp)
        assert fin.sum() > 20 and not torch.isnan(got).any(), name
        err = (got[fin] - exp[fin]).abs()
        assert (err <= 1e-5 * err_scale[fin] + 1e-30).all(), f"{name}: max err {err.max():.3e}"


def test_index_scores_fp8_queries_sharded_equal_the_replicated_cache():
    """Each rank's owned scores (its rows of the sharded cache) are bit-identical to the
    replicated cache's, and the ranks together cover every valid candidate once."""
    gen = _gen("fp8-queries-sharded")
    page_table, req_ids, positions, page = _paged_step(gen)
    T, Hi, Di, S, N, interleave = req_ids.shape[0], 4, 32, 40 * page, 2, 2
    q, w = _fp8_queries(torch.randn((T, Hi, Di), generator=gen), torch.randn((T, Hi), generator=gen))
    cache, key_scale, _ = _keys(gen, S, Di, "fp8-row")
    rep = scores_mod.index_scores_triton(*_dev(q, w, cache, key_scale, page_table, req_ids, positions), page).cpu()
    owned_total = torch.zeros_like(rep, dtype=torch.int32)
    slots = torch.arange(S)
    for r in range(N):
        mine = owner(slots, N, interleave) == r  # local rows are the owned slots in order
        args = _dev(q, w, cache[mine], key_scale[mine], page_table, req_ids, positions)
        got = scores_mod.index_scores_triton(*args, page, shard=(N, r, interleave)).cpu()
        owned = torch.isfinite(got) | torch.isnan(got)
        assert torch.equal(got[owned], rep[owned]), f"rank {r}: owned scores differ from the replicated cache's"
        owned_total += owned.int()
    assert torch.equal(owned_total == 1, ~torch.isneginf(rep)), "every valid candidate is owned by exactly one rank"


def test_fp8_queries_need_fp8_keys():
    q, w, cache = torch.randn(2, 4, 32), torch.randn(2, 4), torch.randn(32, 32)
    pt, req, pos = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    for keys in (cache, cache.bfloat16()):
        for fn in (scores_mod.index_scores_reference, scores_mod.index_scores_triton):
            with pytest.raises(ValueError, match="FP8 queries are for FP8 index keys only"):
                fn(q.to(E4M3), w, keys, None, pt, req, pos, 4)
    with pytest.raises(ValueError, match="w must be fp32, bf16 or fp16"):
        scores_mod.index_scores_reference(q, w.to(E4M3), cache.to(E4M3), torch.ones(32), pt, req, pos, 4)


def test_model_feeds_index_scores_e4m3_queries_and_equals_eager():
    """glm5.2-tiny (2 layers) with FP8 KV and index keys: the compiled step (FX lowering) reads
    E4M3 queries in every index_scores and gives the eager model's tokens and logits."""
    import dataclasses

    cfg = dataclasses.replace(get_config("glm5.2-tiny", n_layers=2), kv_dtype="fp8", index_key_dtype="fp8")
    batch = standard_test_batch(cfg, max_new_tokens=3, seed=3)
    model = DSAModel(cfg, batch.num_slots, seed=4)
    with torch.no_grad():
        ref = generate(model, batch, 3, pad_to=16)
    model.reset_caches()
    torch._dynamo.reset()
    step = torch.compile(model, backend="dsa_dcp", fullgraph=True, dynamic=False, options={"lowering": "fx"})
    with torch.no_grad():
        out = generate(step, batch, 3, pad_to=16)
    graph = dsa_dcp.backend_report().graph
    scores = [n for n in graph.graph.nodes if n.op == "call_function" and n.target == INDEX_SCORES]
    assert len(scores) == len(cfg.indexer_layers)
    assert all(fx_facts.dtype(n.args[0]) == E4M3 for n in scores)
    assert out.tokens == ref.tokens
    for a, b in zip(out.step_logits, ref.step_logits, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
