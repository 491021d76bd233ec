"""``index_cache="sharded"`` on N CPU ranks over gloo, against the replicated cache and the single-rank
model; and the top-k agreement itself against ``topk_select`` on the whole scores.

One spawn per (family, N) compiles the model twice on every rank, with the replicated and the
sharded index cache (FX lowering), and generates over the standard schedule. The single-rank
model runs the reference indexer as written (``indexer_kernels=False`` is not needed: it runs
eagerly). Each rank returns its tokens, logits, index caches and the compile report's numbers.
"""

import pytest
import torch

from dsa_dcp.kernels import indexer as ix
from dsa_dcp.kernels.topk_remap import topk_remap_reference
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.slots import local_cache_rows, local_row, owner

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


def _rank(rank, world):
    import dsa_dcp

    results = {}
    for family in FAMILIES:
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


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_index_cache_matches_replicated_and_single_rank(world):
    """Both families (GLM-5.2's layer 3 attends with layer 2's top-k) on one spawn of N ranks."""
    ranks = run_on_ranks(_rank, world, timeout=900)
    for family in FAMILIES:
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
    cand = ix.candidate_slots(page_table, req_ids, page)
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
        expect = ix.topk_select_reference(scores, k, page_table, req_ids, page)
        gathered = torch.cat([ix.topk_candidates_reference(scores.masked_fill(~m, -INF), k) for m in mine])
        assert gathered.shape == (world * scores.shape[0], k, 2)
        got = ix.topk_agree_reference(gathered, page_table, req_ids, page, k, world)
        assert torch.equal(got, expect), k
        for r in range(world):
            local, count = ix.topk_agree_remap_reference(gathered, page_table, req_ids, page, k, world, r, interleave)
            want_local, want_count = topk_remap_reference(expect, world, r, interleave)
            assert torch.equal(local, want_local) and torch.equal(count, want_count), (k, r)


def test_agreement_ignores_what_no_rank_sent():
    """Padding pairs (-inf, -1) and garbage positions (what a no-op collective leaves) select nothing."""
    page_table = torch.arange(8, dtype=torch.int32).view(2, 4)
    req_ids = torch.tensor([0, 1])
    bits = torch.tensor([1.0, -INF, 2.0]).view(torch.int32)
    gathered = torch.stack([bits.expand(2, 3), torch.tensor([[3, -1, 99], [-7, 5, 2]], dtype=torch.int32)], -1)
    got = ix.topk_agree_reference(gathered.contiguous(), page_table, req_ids, 2, 3, 1)
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
