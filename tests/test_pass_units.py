"""Each rewrite on its own, on dynamo's graph in one process (``tests/pass_backend.py``): the passes
under test run for one rank of a fake group, and the graph's op counts before and after say what
they did. Equivalence with the single-rank model is the end-to-end tests' (real gloo ranks)."""

import pytest
import torch

import dsa_dcp
from dsa_dcp.merge import MERGES
from dsa_dcp.passes.dcp_rewrite import DCPRewrite
from dsa_dcp.passes.graph import graph_summary
from dsa_dcp.passes.kv_writes import LocalizeKVWrites
from dsa_dcp.passes.recognize_attention import RecognizeSparseAttention
from pass_backend import run_passes

S, B, H, DC, DR, K = 24, 3, 4, 8, 4, 5
SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default
KV_STORE = torch.ops.dsa_dcp.kv_store.default


def _layer(q_nope, q_pe, cache, topk, slots, rows, w_uv, w_o):
    KV_STORE(cache, slots, rows)
    out, _ = SPARSE_MLA(q_nope, q_pe, cache, topk, 0.5)
    return torch.nn.functional.linear(torch.einsum("thc,hcv->thv", out, w_uv).flatten(1), w_o)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=2)
    return (torch.randn(B, H, DC, generator=g), torch.randn(B, H, DR, generator=g), cache,
            torch.randint(-1, S, (B, K), generator=g), torch.randint(-1, S, (B,), generator=g),
            torch.randn(B, DC + DR, generator=g), torch.randn(H, DC, 6, generator=g), torch.randn(5, H * 6, generator=g))


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_the_rewrite_adds_the_merge_strategys_nodes(merge):
    run = run_passes(_layer, _inputs(), [LocalizeKVWrites, DCPRewrite], dcp_size=2, merge=merge)
    before, after = run.counts_before, run.counts_after
    assert before.get("dsa_dcp.kv_store.default") == 1 and "dsa_dcp.topk_remap.default" not in before
    assert after["localize_slots"] == 1 and after["dsa_dcp.kv_store.default"] == 1
    assert after["dsa_dcp.topk_remap.default"] == 1 and after["dsa_dcp.sparse_mla.default"] == 1
    sharded = MERGES[merge].head_sharded
    # the strategy's own collectives (a fused merge counts as one), plus the all-reduce after the
    # head-sharded projection
    assert graph_summary(run.gm.graph)["collectives"] == MERGES[merge].collectives + sharded, after
    assert run.stats["dcp_rewrite"]["layers_merged_with_ag"] == []
    assert ("_c10d_functional.all_gather_into_tensor.default" in after) == MERGES[merge].all_gathers


def test_recognition_changes_no_write_and_localization_localizes_them():
    """recognize_sparse_attention (normalize: rank-independent) leaves the plain model's position
    writes as written; localize_kv_writes turns them into position_store of the owned positions."""
    from dsa_dcp.models.plain import Transformer, init_weights, tiny_args
    from dsa_dcp.position_cache import shard_position_caches

    model = init_weights(Transformer(tiny_args(max_seq_len=12)), seed=0).eval()
    shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=2)
    tokens = torch.randint(0, 64, (2, 1))
    recognized = run_passes(lambda t: model(t, 5), (tokens,), [RecognizeSparseAttention], dcp_size=2)
    layers = len(model.layers)
    assert recognized.counts_after["dsa_dcp.sparse_mla_positions.default"] == layers
    assert recognized.counts_before["einsum"] - recognized.counts_after["einsum"] == 3 * layers  # scores, value
    assert recognized.counts_after["setitem"] == recognized.counts_before["setitem"]  # the writes stay
    assert "dsa_dcp.position_store.default" not in recognized.counts_after
    localized = run_passes(lambda t: model(t, 5), (tokens,), [RecognizeSparseAttention, LocalizeKVWrites],
                           dcp_size=2)
    assert localized.counts_after["dsa_dcp.position_store.default"] == 2 * layers  # kv and pe per layer
    assert localized.counts_after["setitem"] == recognized.counts_after["setitem"] - 2 * layers
    assert localized.stats["localize_kv_writes"]["position_localizations"] == 1  # one positions range


def _position_indexer(q, w, keys, mask, scale):
    """transformers' indexer over a position cache (``match/position_indexer.py``), its top-k returned."""
    scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * scale
    index = torch.matmul(w.unsqueeze(-2), torch.relu(scores)).squeeze(-2) + mask
    return index.topk(3, dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("scale", [0.25, -0.25])
def test_a_position_indexer_whose_top_k_is_not_read_as_a_set_is_left_as_written(scale):
    """The top-k goes to the output (its order is the model's): no ``topk_select``, the reason in the
    stats; a negative scale inside the relu cannot be folded into the weights either."""
    from dsa_dcp.passes.indexer import IndexerKernels

    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 1, 4, generator=g),
              torch.randn(2, 6, 8, generator=g).bfloat16(), torch.zeros(2, 1, 6), scale)
    backend = run_passes(_position_indexer, inputs, [IndexerKernels], dcp_size=1)
    stats = backend.stats["indexer_kernels"]
    assert stats["indexers_matched"] == 0 and len(stats["indexers_left"]) == 1
    why = "positive constant" if scale < 0 else "not by sparse attention alone"
    assert why in stats["indexers_left"][0]
    assert backend.counts_after == backend.counts_before
