"""``index_cache="sharded"`` on N CPU ranks over gloo, against the replicated cache and the single-rank
model; and the top-k agreement itself against ``topk_select`` on the whole scores.

One spawn per (family, N) compiles the model twice on every rank, with the replicated and the
sharded index cache (FX lowering), and generates over the standard schedule. The single-rank
model runs the reference indexer as written (``indexer_kernels=False`` is not needed: it runs
eagerly). Each rank returns its tokens, logits, index caches and the compile report's numbers.
"""

import pytest
import torch

from dsa_dcp.kernels import index_scores as scores_mod
from dsa_dcp.kernels import topk_agree as agree_mod
from dsa_dcp.kernels import topk_select as select_mod
from dsa_dcp.kernels.topk_remap import topk_remap_reference
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.slots import local_cache_rows, local_row, owner


# many short gloo runs: kept ranks (conftest.py)
pytestmark = pytest.mark.usefixtures("kept_ranks")

STEPS = 4
ROWS = 16
LAYERS = {"deepseek-v3.2-tiny": 2, "glm5.2-tiny": 4}  # GLM-5.2: indexers at 0, 1, 2; layer 3 reuses 2's top-k
INF = float("inf")


def _setup(family):
    cfg = get_config(family, n_layers=LAYERS[family])
    return cfg, standard_test_batch(cfg, max_new_tokens=STEPS, seed=7)


def _merge(cfg, world):
    return "a2a" if cfg.n_heads % world == 0 else "ag"


FAMILIES = ("glm5.2-tiny", "deepseek-v3.2-tiny")
# N -> the families it runs: both at N = 3, the group whose slots do not split evenly (merge ag: 3
# does not divide the 4 heads). The even split of N = 2, under a2a, with a sharded index cache is checked
# end to end by tests/test_fp8_kv.py (GLM-5.2, FP8 keys, a2a) and tests/test_mtp.py (the target's
# sharded index cache in the one-graph verify + draft step); the agreement itself at N = 1 to 4 against
# topk_select below (test_agreement_selects_exactly_topk_select); the merges at N = 2 and 4 by
# tests/test_dcp.py (a merge reads the attention's output, not the index cache).
WORLD_FAMILIES = {3: FAMILIES}


def _rank(rank, world):
    import dsa_dcp

    results = {}
    for family in WORLD_FAMILIES[world]:
        cfg, batch = _setup(family)
        for index_cache in ("replicated", "sharded"):
            torch._dynamo.reset()
            model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=11, index_cache=index_cache)
            options = {"dcp_size": world, "merge": _merge(cfg, world), "lowering": "fx", "index_cache": index_cache}
            step = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
            with torch.no_grad():
                out = generate(step, batch, STEPS, pad_to=ROWS)
            report = dsa_dcp.backend_report()
            results[family, index_cache] = {
                "tokens": out.tokens, "logits": out.step_logits, "summary": report.summary, "stats": report.stats(),
                "index_caches": {i: c.clone() for i, c in model.index_caches().items()},
            }
    return results


def _single_rank(family):
    cfg, batch = _setup(family)
    model = DSAModel(cfg, batch.num_slots, seed=11)
    with torch.no_grad():
        ref = generate(model, batch, STEPS, pad_to=ROWS)
    return cfg, batch, ref, model.index_caches()


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(WORLD_FAMILIES))
def test_sharded_index_cache_matches_replicated_and_single_rank(world):
    """The families of ``WORLD_FAMILIES[world]`` (GLM-5.2's layer 3 attends with layer 2's top-k) on
    one spawn of N ranks."""
    ranks = run_on_ranks(_rank, world, timeout=900)
    for family in WORLD_FAMILIES[world]:
        cfg, batch, ref, ref_index = _single_rank(family)
        indexers = len(cfg.indexer_layers)
        per_layer = {"ag": 1, "a2a": 2}[_merge(cfg, world)]
        for rank, res in enumerate(ranks):
            for mode in ("replicated", "sharded"):
                got = res[family, mode]
                assert got["tokens"] == ref.tokens, (family, mode, rank)
                for a, b in zip(got["logits"], ref.step_logits, strict=True):
                    assert _relative_error(a, b) < 1e-5, (family, mode, rank)
                stats, summary = got["stats"], got["summary"]
                assert stats["indexer_kernels"]["indexers_matched"] == indexers, stats["indexer_kernels"]
                assert stats["indexer_kernels"]["indexers_left"] == []
                # one fused top-k + remap per indexer, shared by the layers that reuse its top-k
                assert stats["fuse_remaps"]["remaps_fused"] == indexers and summary["remaps"] == indexers
                extra = indexers if mode == "sharded" else 0  # the agreement's all-gather per indexer layer
                assert summary["collectives"] == per_layer * cfg.n_layers + extra
            assert res[family, "sharded"]["stats"]["index_cache"]["indexers_sharded"] == indexers
            # the same slots on every rank, in the same order, so the same attention: bit for bit
            for a, b in zip(res[family, "sharded"]["logits"], res[family, "replicated"]["logits"], strict=True):
                assert torch.equal(a, b), (family, rank)
        _check_index_caches(batch.num_slots, world, ref_index, [{m: r[family, m] for m in ("replicated", "sharded")}
                                                                for r in ranks])


def _check_index_caches(num_slots, world, ref_index, ranks):
    """Replicated: every rank holds the whole cache. Sharded: ceil(S/N) rows each, every key once, on its owner."""
    rows = local_cache_rows(num_slots, world)
    slots = torch.arange(num_slots)
    own, row = owner(slots, world), local_row(slots, world)
    for layer, ref in ref_index.items():
        rebuilt = torch.zeros_like(ref)
        for r, res in enumerate(ranks):
            torch.testing.assert_close(res["replicated"]["index_caches"][layer], ref, rtol=1e-5, atol=1e-6)
            shard = res["sharded"]["index_caches"][layer]
            assert shard.shape == (rows, ref.shape[1])
            rebuilt[own == r] = shard[row[own == r]]
        assert ref.abs().sum() > 0
        torch.testing.assert_close(rebuilt, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the agreement: N ranks' best k of a partition of the candidates -> topk_select of the whole


def _partitioned_case(gen, world, interleave, ties):
    T, R, max_pages, page = 6, 3, 5, 4
    C = max_pages * page
    page_table = torch.randperm(30, generator=gen)[: R * max_pages].view(R, max_pages).to(torch.int32)
    page_table[1, 3] = -1
    req_ids = torch.tensor([0, 1, 1, 2, -1, 2])
    positions = torch.tensor([C + 2, 13, 5, 17, 3, -1])
    scores = torch.randint(-2, 3, (T, C), generator=gen).float() if ties else torch.randn((T, C), generator=gen)
    scores[torch.rand((T, C), generator=gen) < 0.1] = float("nan")
    scores[torch.rand((T, C), generator=gen) < 0.1] = -0.0
    scores[torch.rand((T, C), generator=gen) < 0.05] = -INF  # a valid candidate may score -inf too
    cand = scores_mod.candidate_slots(page_table, req_ids, page)
    valid = (torch.arange(C)[None] <= positions[:, None]) & (cand >= 0)
    scores = scores.masked_fill(~valid, -INF)
    mine = [valid & (owner(cand.clamp(min=0), world, interleave) == r) for r in range(world)]
    return scores, mine, page_table, req_ids, page


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("ties", [True, False])
def test_agreement_selects_exactly_topk_select(world, interleave, ties):
    gen = torch.Generator().manual_seed(world * 10 + interleave + ties)
    for k in (0, 1, 3, 8, 20, 23):
        scores, mine, page_table, req_ids, page = _partitioned_case(gen, world, interleave, ties)
        expect = select_mod.topk_select_reference(scores, k, page_table, req_ids, page)
        gathered = torch.cat([agree_mod.topk_candidates_reference(scores.masked_fill(~m, -INF), k) for m in mine])
        assert gathered.shape == (world * scores.shape[0], k, 2)
        got = agree_mod.topk_agree_reference(gathered, page_table, req_ids, page, k, world)
        assert torch.equal(got, expect), k
        for r in range(world):
            local, count = agree_mod.topk_agree_remap_reference(gathered, page_table, req_ids, page, k, world, r, interleave)
            want_local, want_count = topk_remap_reference(expect, world, r, interleave)
            assert torch.equal(local, want_local) and torch.equal(count, want_count), (k, r)


def test_agreement_ignores_what_no_rank_sent():
    """Padding pairs (-inf, -1) and garbage positions (what a no-op collective leaves) select nothing."""
    page_table = torch.arange(8, dtype=torch.int32).view(2, 4)
    req_ids = torch.tensor([0, 1])
    bits = torch.tensor([1.0, -INF, 2.0]).view(torch.int32)
    gathered = torch.stack([bits.expand(2, 3), torch.tensor([[3, -1, 99], [-7, 5, 2]], dtype=torch.int32)], -1)
    got = agree_mod.topk_agree_reference(gathered.contiguous(), page_table, req_ids, 2, 3, 1)
    # row 0: position 3 (score 1) is slot 1 * 2 + 1; -1 and 99 (>= C = 8) are not candidates.
    # row 1: -7 is not a candidate, 5 scores -inf; position 2 (score 2) is slot 5 * 2 + 0
    assert got.tolist() == [[3, -1, -1], [10, -1, -1]]


def test_sharded_ops_meet_their_schemas():
    from dsa_dcp import ops

    gen = torch.Generator().manual_seed(3)
    scores, mine, page_table, req_ids, page = _partitioned_case(gen, 2, 1, True)
    candidates = ops.topk_candidates(scores.masked_fill(~mine[0], -INF), 5)
    gathered = torch.cat([candidates, ops.topk_candidates(scores.masked_fill(~mine[1], -INF), 5)])
    torch.library.opcheck(ops.topk_candidates, (scores, 5))
    torch.library.opcheck(ops.topk_agree, (gathered, page_table, req_ids, page, 5, 2))
    torch.library.opcheck(ops.topk_agree_remap, (gathered, page_table, req_ids, page, 5, 2, 1, 1))
    q, w = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, generator=gen)
    cache = torch.randn(local_cache_rows(30 * page, 2), 8, generator=gen)
    positions = torch.tensor([19, 13, 5, 17, 3, -1])
    torch.library.opcheck(ops.index_scores_sharded, (q, w, cache, None, page_table, req_ids, positions, page, 2, 1, 1))


# ---------------------------------------------------------------------------------------------
# validation: the option and the caches must agree, both ways


def _problems(model_or_fn, inputs, options):
    from dsa_dcp.inspection.targets import fake_group
    from dsa_dcp.validate import DCPValidationError

    torch._dynamo.reset()
    with fake_group(2), torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(model_or_fn, backend="dsa_dcp", options={"lowering": "fx", **options}, fullgraph=True)(*inputs)
    cause = err.value
    while cause is not None and not isinstance(cause, DCPValidationError):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert isinstance(cause, DCPValidationError), repr(err.value)
    return cause.problems


def _model_inputs():
    rows = torch.zeros(4, dtype=torch.int64)
    return rows, rows - 1, rows, rows - 1, torch.full((1, 16), -1, dtype=torch.int32)


@pytest.mark.parametrize("allocated, compiled", [("replicated", "sharded"), ("sharded", "replicated")])
def test_index_cache_option_and_caches_must_agree(allocated, compiled):
    cfg = get_config("deepseek-v3.2-tiny", n_layers=2)
    model = DSAModel(cfg, 64, dcp_size=2, index_cache=allocated)
    problems = _problems(model, _model_inputs(), {"dcp_size": 2, "merge": "ag", "index_cache": compiled})
    assert len(problems) == 1, problems  # one message for both layers' caches
    (p,) = problems
    if compiled == "sharded":
        assert "index_cache='sharded' keeps only this rank's index keys, but index cache" in p
        assert "holds every slot's (allocated replicated); allocate it for the group: DSAModel(..., dcp_size=2, " \
               "index_cache='sharded')" in p
    else:
        assert "holds this rank's share of the index keys (32 rows for 64 slots: allocated for " \
               "index_cache='sharded', dcp_size=2) but the program is compiled with index_cache='replicated'" in p
    assert "(the same for 1 more:" in p


def test_sharded_index_cache_needs_the_indexer_kernels():
    from dsa_dcp.config import DCPOptions, OptionsError

    with pytest.raises(OptionsError, match=r"index_cache='sharded' needs indexer_kernels=True"):
        DCPOptions.parse({"index_cache": "sharded", "indexer_kernels": False})
    with pytest.raises(OptionsError, match=r"index_cache must be one of \['replicated', 'sharded'\], got 'split'"):
        DCPOptions.parse({"index_cache": "split"})


def test_a_sharded_cache_read_by_an_unrecognized_indexer_is_refused_with_the_reason():
    import dsa_dcp
    from test_indexer_pass import DC, DI, DR, SPARSE_MLA, _inputs, indexer

    def step(q, w, index_cache, page_table, req_ids, positions, q_nope, q_pe, kv):
        topk = indexer(q, w, index_cache, page_table, req_ids, positions, compare="<")
        return SPARSE_MLA(q_nope, q_pe, kv, topk, 0.3)[0]

    inputs = list(_inputs())
    s = inputs[2].shape[0]
    inputs[2] = dsa_dcp.allocate_index_cache(s, DI, dcp_size=2, sharded=True)
    inputs[-1] = dsa_dcp.allocate_kv_cache(s, DC + DR, dcp_size=2)
    problems = _problems(step, inputs, {"dcp_size": 2, "merge": "ag", "index_cache": "sharded"})
    (p,) = [p for p in problems if p.startswith("index cache")]
    assert "holds this rank's rows only (index_cache='sharded'), but it is read by" in p
    assert "not by a lightning indexer the indexer_kernels pass recognized (topk: its mask term" in p


@pytest.mark.parametrize("n", [2, 4, 8])
def test_memory_plan_of_the_sharded_index_cache(n):
    from dsa_dcp.inspection.memory import memory_plan

    plan = memory_plan("glm5.3", "fp8", n, gpu_mem_gib=80, index_cache="sharded")
    assert plan.bytes_per_token_per_rank == (44928 + 2772) / n == plan.bytes_per_token_per_rank_split_index
    assert plan.index_bytes_per_token_per_rank == 2772 / n
    assert plan.tokens_that_fit == plan.tokens_that_fit_split_index
    assert dict(plan.rows())["index-key bytes per token per rank"].endswith(f"(2,772 / {n}: sharded)")
    bf16 = memory_plan("glm5.2", "bf16", n, slots=1000, index_cache="sharded")
    assert bf16.bytes_per_rank_for_slots == local_cache_rows(1000, n) * (78 * 1152 + 21 * 256)


def _plain_model_for_two_ranks():
    from dsa_dcp.models.plain import Transformer, init_weights, tiny_args
    from dsa_dcp.position_cache import shard_position_caches

    model = init_weights(Transformer(tiny_args(max_seq_len=8)), seed=0).eval()
    shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=2)
    return model, (torch.randint(0, 64, (2, 3)), 0)


def _transformers_generate_for_two_ranks():
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts, tiny_model

    model = tiny_model("glm_moe_dsa")
    ids, mask = left_padded_prompts((3, 4), model.config.vocab_size)
    cache = DCPStaticCache(model.config, max_cache_len=8, batch_size=2, dcp_size=2)

    def prefill(ids, mask):  # what generate calls first: the model over the prompts, into the cache
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    return prefill, (ids, mask)


@pytest.mark.parametrize("kind", ["plain", "transformers"])
def test_a_sharded_index_cache_on_a_model_whose_index_keys_the_pass_cannot_shard_is_refused(kind):
    """Regression: ``index_cache='sharded'`` compiled to nothing (``indexers_sharded: 0``, every index key
    kept on every rank) for models whose indexer keeps its keys per request and position."""
    if kind == "transformers":
        pytest.importorskip("transformers")
        step, inputs = _transformers_generate_for_two_ranks()
        whole = "['l_cache_layers_0_indexer_keys']"  # GLM's one full indexer layer; layer 1 reuses its top-k
    else:
        step, inputs = _plain_model_for_two_ranks()
        whole = ("['l_self_modules_layers_modules_0_modules_attn_modules_indexer_buffers_k_cache_', "
                 "'l_self_modules_layers_modules_1_modules_attn_modules_indexer_buffers_k_cache_']")
    (p,) = _problems(step, inputs, {"dcp_size": 2, "merge": "ag", "index_cache": "sharded"})
    assert p.startswith("index_cache='sharded' keeps only this rank's index keys, but this program has no index "
                        "cache the index_cache pass can shard"), p
    assert f"these caches stay whole on every rank: {whole}. Compile with index_cache='replicated'" in p, p
