"""DCP on models as their authors write them: transformers' DSA models and a plain-PyTorch model.

Each case starts N gloo ranks once and runs its merge modes in them: greedy generation of 3
requests of different prompt lengths (prefill, then decode), compiled with
``backend="dsa_dcp"``, against the single-rank model run eagerly. Checked: the tokens, every
step's logits (rel < 1e-5), the remaps per step, and the caches: each rank holds T / N positions
and the shards rebuild the single-rank cache.

The default cases cover every model and attention implementation, both group sizes and every
merge mode at least once per model family within the CPU budget; ``DSA_DCP_FULL_MATRIX=1`` runs
every merge mode for every (model, N).
"""

import os

import pytest
import torch

from dsa_dcp.launch import run_on_ranks
from dsa_dcp.slots import local_row, owner

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)

transformers = pytest.importorskip("transformers")

MERGES = ("ag", "a2a", "ag_rs", "fused_a2a")
PROMPT_LENS = (3, 5, 7)
NEW_TOKENS = 3
MAX_LEN = 12  # positions per request: a multiple of 2 and 3


# --------------------------------------------------------------------------- the models


def hf_model(family: str, attn: str):
    """A tiny random transformers model: 2 dense layers, 12 heads, K and V of
    different widths; GLM's second layer reuses the first one's top-k and its projections have biases."""
    from dsa_dcp.integrations.transformers import tiny_model

    return tiny_model(family, attn_implementation=attn, layers=2)


def hf_generate(model, dcp_size: int | None, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Greedy generation on a ``DCPStaticCache`` for ``dcp_size`` ranks, or (``None``, the reference)
    on transformers' own ``StaticCache``."""
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts

    ids, mask = left_padded_prompts(PROMPT_LENS, model.config.vocab_size)
    if dcp_size is None:
        cache = transformers.StaticCache(model.config, max_cache_len=MAX_LEN)  # allocated by its first update
    else:
        cache = DCPStaticCache(model.config, max_cache_len=MAX_LEN, batch_size=len(PROMPT_LENS), dcp_size=dcp_size,
                               dtype=dtype, device=device)
    with torch.no_grad():  # disable_compile: on CUDA generate would wrap the model in its own torch.compile
        out = model.generate(ids.to(device), attention_mask=mask.to(device), past_key_values=cache,
                             max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, disable_compile=True)
    caches = [(layer.keys, layer.values) for layer in cache.layers]
    return out.sequences[:, ids.shape[1]:].tolist(), [x.float().cpu() for x in out.logits], caches


def plain_model(dcp_size: int):
    from dsa_dcp.models.plain import Transformer, init_weights, tiny_args
    from dsa_dcp.position_cache import shard_position_caches

    model = init_weights(Transformer(tiny_args(max_seq_len=MAX_LEN)), seed=0).eval()
    if dcp_size > 1:
        shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=dcp_size)
    return model


def plain_generate(model, compiled):
    from dsa_dcp.models.plain import generate, random_prompts

    tokens, logits = generate(compiled, random_prompts(list(PROMPT_LENS), 64, seed=1), NEW_TOKENS)
    caches = [(layer.attn.kv_cache, layer.attn.pe_cache) for layer in model.layers]
    return tokens, logits, caches


def _generate(model_name: str, dcp_size: int, options: dict | None):
    if model_name == "plain":
        model = plain_model(dcp_size if options else 1)
        compiled = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True) if options else model
        return plain_generate(model, compiled)
    family, attn = model_name.split(":")
    model = hf_model(family, attn)
    if options:
        model.compile(backend="dsa_dcp", options=options, fullgraph=True)
    return hf_generate(model, dcp_size if options else None)


def _rank(rank, world, model_name, merges, lowering="fx"):
    from one_trace import OneTrace, zero_position_caches

    from dsa_dcp.position_cache import local_positions

    results = {}
    torch._dynamo.reset()
    backend = OneTrace({merge: {"dcp_size": world, "merge": merge} | ({"lowering": lowering} if lowering else {})
                        for merge in merges})  # the model traced once, compiled once a merge mode
    if model_name == "plain":
        model = plain_model(world)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
    else:
        model = hf_model(*model_name.split(":"))
        model.compile(backend=backend, fullgraph=True)
    for merge in merges:
        backend.select(merge)
        try:
            if model_name == "plain":
                zero_position_caches(model)
                tokens, logits, caches = plain_generate(model, compiled)
            else:
                tokens, logits, caches = hf_generate(model, world)
        except Exception as e:  # noqa: BLE001 - the parent asserts
            results[merge] = {"error": f"{type(e).__name__}: {e}"}
            continue
        report = backend.reports[merge]
        results[merge] = {"tokens": tokens, "logits": logits, "summary": report.summary,
                          "fallbacks": report.stats()["dcp_rewrite"]["layers_merged_with_ag"],
                          "caches": [[local_positions(t).clone() for t in pair] for pair in caches],
                          "global_shapes": [[tuple(t.shape) for t in pair] for pair in caches]}
    return results


CASES = [  # the FX lowering (fast to compile on CPU), then the default options (Inductor)
    ("plain", 2, MERGES, "fx"),
    ("plain", 3, ("a2a",), "fx"),
    ("deepseek_v32:eager", 2, ("ag", "a2a"), "fx"),
    ("deepseek_v32:sdpa", 3, ("ag_rs", "fused_a2a"), "fx"),
    ("glm_moe_dsa:eager", 2, ("ag_rs", "fused_a2a"), "fx"),
    ("glm_moe_dsa:sdpa", 3, ("ag", "a2a"), "fx"),
    ("plain", 2, ("a2a",), None),  # transformers' models under the default options: examples/transformers_dcp.py
]
if os.environ.get("DSA_DCP_FULL_MATRIX"):
    CASES = [(m, n, MERGES, lowering) for m in ("plain", "deepseek_v32:eager", "deepseek_v32:sdpa",
                                                "glm_moe_dsa:eager", "glm_moe_dsa:sdpa")
             for n in (2, 3) for lowering in ("fx", None)]


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("model_name, world, merges, lowering", CASES, ids=lambda v: str(v))
def test_unmodified_model_matches_single_rank(model_name, world, merges, lowering):
    ref_tokens, ref_logits, ref_caches = _generate(model_name, 1, None)
    ranks = run_on_ranks(_rank, world, model_name, merges, lowering, timeout=600)
    attention_layers = len(ref_caches)
    for merge in merges:
        for rank, res in enumerate(ranks):
            got = res[merge]
            assert "error" not in got, (merge, rank, got.get("error"))
            assert got["tokens"] == ref_tokens, (merge, rank)
            assert len(got["logits"]) == len(ref_logits)
            for a, b in zip(got["logits"], ref_logits):
                assert _relative_error(a, b) < 1e-5, (merge, rank)
            assert got["fallbacks"] == [], got["fallbacks"]  # every epilogue was sharded by heads
            s = got["summary"]  # the decode graph's
            assert s["sparse_attention_nodes"] == attention_layers
            # GLM's second layer reuses the first one's top-k: one remap for both
            assert s["remaps"] == (1 if model_name.startswith("glm") else attention_layers)
            assert s["merges"] == attention_layers
        _check_caches_are_split(ref_caches, [r[merge] for r in ranks], world, model_name != "plain")


@pytest.mark.parametrize("model_name", ["deepseek_v32:eager", "glm_moe_dsa:sdpa"])
def test_a_group_of_one_attends_over_the_top_k_alone(model_name):
    """dcp_size=1 on a DCPStaticCache: the dense top-k-masked attention becomes sparse attention over
    the top-k positions (as fast as the top-k, not the context, allows), the indexer becomes
    ``index_scores`` + ``topk_select``, and it gives eager's tokens and logits; the cache holds
    every position."""
    import dsa_dcp

    ref_tokens, ref_logits, ref_caches = _generate(model_name, 1, None)
    torch._dynamo.reset()
    tokens, logits, caches = _generate(model_name, 1, {"dcp_size": 1, "lowering": "fx"})
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert _relative_error(a, b) < 1e-5
    stats = dsa_dcp.backend_report().stats()["recognize_sparse_attention"]
    assert stats["attention_recognized"] == len(ref_caches) and stats["declined"] == []
    # the indexer of every full layer (DeepSeek-V3.2: both; GLM-5: the first, the second shares it)
    indexers = dsa_dcp.backend_report().stats()["indexer_kernels"]
    assert indexers["indexers_matched"] == (2 if model_name.startswith("deepseek") else 1)
    assert indexers["indexers_left"] == []
    held = {"caches": [[t.local for t in pair] for pair in caches],
            "global_shapes": [[tuple(t.shape) for t in pair] for pair in caches]}
    _check_caches_are_split(ref_caches, [held], 1, left_padded=True)


def _check_caches_are_split(ref_caches, rank_results, world, left_padded):
    """Each rank holds T / N positions; together the shards are the single-rank cache.

    transformers left-pads the shorter prompts: a padding row attends to nothing, so under DCP its
    attention output is 0 where the single-rank model averages every position (docs/models.md);
    what later layers cache for it differs, and no real token ever reads it. Those positions are
    left out of the comparison."""
    width = max(PROMPT_LENS)
    for layer, ref_pair in enumerate(ref_caches):
        for which, ref in enumerate(ref_pair):
            dim = 2 if ref.dim() == 4 else 1
            t = ref.shape[dim]
            positions = torch.arange(t)
            own, row = owner(positions, world), local_row(positions, world)
            rebuilt = torch.zeros_like(ref)
            for rank, res in enumerate(rank_results):
                local = res["caches"][layer][which]
                assert res["global_shapes"][layer][which] == tuple(ref.shape)
                assert local.shape[dim] == t // world  # 1/N of the positions in memory
                mine = positions[own == rank]
                rebuilt.index_copy_(dim, mine, local.index_select(dim, row[own == rank]))
            assert ref.abs().sum() > 0
            if left_padded:
                for b, n in enumerate(PROMPT_LENS):
                    ref[b, :, :width - n] = rebuilt[b, :, :width - n] = 0
            torch.testing.assert_close(rebuilt, ref, rtol=1e-5, atol=1e-5)


def test_inspect_counts_one_remap_per_glm_indexer():
    """``dsa-dcp inspect hf:glm_moe_dsa --dcp 4``: layers full, shared, shared, full -> 2 remaps."""
    import dsa_dcp
    from dsa_dcp.inspection import inspect_target

    inspection = inspect_target("hf:glm_moe_dsa", dcp_size=4, merge="a2a")
    summary = dsa_dcp.backend_report().summary
    assert summary["sparse_attention_nodes"] == 4 and summary["remaps"] == 2
    stats = dsa_dcp.backend_report().stats()
    assert stats["share_remaps"]["remaps_before"] == 4 and stats["dcp_rewrite"]["layers_merged_with_ag"] == []
    assert "remaps after sharing          2" in inspection.to_text()


# --------------------------------------------------------------------------- sampling and beam search

SEED = 100
GENERATE = {  # how each case calls generate
    "sample": {"do_sample": True, "top_k": 0},  # the whole distribution: seeds matter at every step
    "sample_top_p": {"do_sample": True, "top_k": 0, "top_p": 0.9, "temperature": 0.7},  # warpers after our processor
    "beam": {"num_beams": 2, "do_sample": False},  # the cache is reordered between steps
}


def _generate_mode(model, dcp_size: int, mode: str, seed: int, cache: bool = True):
    """``generate`` of 2 prompts, 4 new tokens, seeded with ``seed`` just before: the new tokens and each
    step's logits; ``cache=False`` lets transformers allocate its own cache (the single-rank reference of
    beam search)."""
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts

    kwargs = GENERATE[mode]
    ids, mask = left_padded_prompts((3, 5), model.config.vocab_size)
    if cache:
        rows = len(ids) * kwargs.get("num_beams", 1)
        kwargs = {**kwargs, "past_key_values": DCPStaticCache(model.config, max_cache_len=MAX_LEN, batch_size=rows,
                                                               dcp_size=dcp_size)}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, disable_compile=True, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:].tolist(), torch.stack(out.logits)


def _modes_rank(rank, world, family):
    torch._dynamo.reset()
    model = hf_model(family, "eager")
    model.compile(backend="dsa_dcp", options={"dcp_size": world, "lowering": "fx"}, fullgraph=True)
    return {mode: _generate_mode(model, world, mode, SEED + rank) for mode in GENERATE}  # each rank its own seed


def test_sampling_and_beam_search_agree_over_the_group_whatever_the_ranks_seeds():
    """Regression: with each rank seeded differently (as torchrun processes often are), rank 0's second
    token was sampled by rank 1. generate with a DCPStaticCache now broadcasts rank 0's scores and random
    state every step: every rank generates what the single-rank model generates with rank 0's seed; beam
    search (num_beams=2) reorders the cache in place and matches transformers' own single-rank search."""
    family = "deepseek_v32"
    model = hf_model(family, "eager")
    ref = {mode: _generate_mode(model, 1, mode, SEED, cache=mode != "beam") for mode in GENERATE}
    for mode in ("sample", "sample_top_p"):  # the seeds matter: rank 1's alone would sample otherwise
        assert _generate_mode(model, 1, mode, SEED + 1)[0] != ref[mode][0], mode
    ranks = run_on_ranks(_modes_rank, 2, family, timeout=600)
    for rank, got in enumerate(ranks):
        for mode, (tokens, logits) in got.items():
            assert tokens == ref[mode][0], (rank, mode, tokens, ref[mode][0])
            # the logits too: a peer fed another token shifts them without always changing a sampled token
            torch.testing.assert_close(logits, ref[mode][1], rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {mode}: {m}")


def test_generate_refuses_to_guess_which_ranks_sample_together():
    """A world of 4 ranks and a cache for 2: two DCP groups may serve different requests, so generate
    needs the group named (cache.sample_over(group)); with it, the group's processor is added."""
    from dsa_dcp.inspection.targets import fake_group
    from dsa_dcp.integrations.transformers import DCPGroupSampling, DCPStaticCache, sampling_processor, tiny_model

    config = tiny_model("deepseek_v32").config
    with fake_group(4):
        cache = DCPStaticCache(config, max_cache_len=MAX_LEN, batch_size=1, dcp_size=2)
        with pytest.raises(ValueError, match=r"generate with a DCPStaticCache for dcp_size=2 in a world of 4 "
                                             r"rank\(s\): .* name them: cache.sample_over\(group\)"):
            sampling_processor(cache)
        group = object()
        processor = sampling_processor(cache.sample_over(group))
        assert isinstance(processor, DCPGroupSampling) and processor.group is group
        whole = DCPStaticCache(config, max_cache_len=MAX_LEN, batch_size=1, dcp_size=4)
        assert sampling_processor(whole).group is None  # the world is the DCP group
    assert sampling_processor(DCPStaticCache(config, max_cache_len=MAX_LEN, batch_size=1, dcp_size=1)) is None


# --------------------------------------------------------------------------- GPU: bf16, ranks sharing one GPU


def _bf16_on_one_gpu_rank(rank, world, family):
    """Each of ``world`` gloo ranks on GPU 0 (NCCL refuses two ranks on one device): the model in
    bf16 on the GPU alone (eager), then compiled for DCP with the default options (refused: a CUDA
    graph cannot capture gloo's collectives), with ``merge='ag'`` (refused: gloo's all-gather of
    CUDA tensors crashes), then with ``cuda_graphs=False`` (the default merge, ``a2a``)."""
    from dsa_dcp.position_cache import local_positions

    torch.cuda.set_device(0)

    def bf16_model(options=None):
        torch._dynamo.reset()
        model = hf_model(family, "eager").to("cuda", torch.bfloat16)
        if options:
            model.compile(backend="dsa_dcp", options=options, fullgraph=True)
        return model

    def refusal(options):
        try:
            hf_generate(bf16_model(options), world, "cuda", torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - the parent asserts
            return f"{type(e).__name__}: {e}"
        return None

    ref_tokens, ref_logits, _ = hf_generate(bf16_model(), None, "cuda", torch.bfloat16)
    refused = {"graphs": refusal({"dcp_size": world}),  # CUDA graphs over gloo
               "ag": refusal({"dcp_size": world, "cuda_graphs": False, "merge": "ag"})}  # gloo's CUDA all-gather
    tokens, logits, caches = hf_generate(bf16_model({"dcp_size": world, "cuda_graphs": False}), world, "cuda",
                                         torch.bfloat16)
    return {"ref_tokens": ref_tokens, "tokens": tokens, "refused": refused,
            "rel_errors": [_relative_error(a, b) for a, b in zip(logits, ref_logits)],
            "positions": [local_positions(t).shape[2] for pair in caches for t in pair],
            "device": str(local_positions(caches[0][0]).device), "dtype": str(local_positions(caches[0][0]).dtype)}


@pytest.mark.gpu
def test_transformers_model_in_bf16_on_two_ranks_sharing_one_gpu():
    """GLM-5's transformers model in bf16 under DCP 2 generates the tokens it generates on one GPU,
    every kernel on the GPU (the merges over gloo, through the host)."""
    for r in run_on_ranks(_bf16_on_one_gpu_rank, 2, "glm_moe_dsa", timeout=600):
        graphs, ag = r["refused"]["graphs"], r["refused"]["ag"]
        assert graphs is not None and "a CUDA graph cannot capture them; compile with cuda_graphs=False" in graphs
        assert ag is not None and "this step all-gathers CUDA tensors over a gloo group" in ag, ag
        assert r["device"] == "cuda:0" and r["dtype"] == "torch.bfloat16"
        assert r["positions"] == [MAX_LEN // 2] * len(r["positions"])  # half of each layer's K and V
        assert r["tokens"] == r["ref_tokens"]
        assert max(r["rel_errors"]) < 3e-2, r["rel_errors"]  # bf16 rounding, reassociated by the merge


# --------------------------------------------------------------------------- GPU: one device, the defaults


GPU_PROMPTS, GPU_NEW, GPU_LEN = (5, 17, 40), 8, 64


def _gpu_generate(model, cache_kind: str, dtype: torch.dtype):
    """Greedy generation on CUDA: (tokens, per-step logits) on a fresh cache of ``cache_kind``
    (``"static"``: transformers' own, ``"dcp"``: ``DCPStaticCache(dcp_size=1)``)."""
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts

    ids, mask = left_padded_prompts(GPU_PROMPTS, model.config.vocab_size, seed=4)
    cache = transformers.StaticCache(model.config, max_cache_len=GPU_LEN) if cache_kind == "static" else \
        DCPStaticCache(model.config, max_cache_len=GPU_LEN, batch_size=len(GPU_PROMPTS), dcp_size=1, dtype=dtype,
                       device="cuda")
    with torch.no_grad():
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=GPU_NEW,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, disable_compile=True)
    return out.sequences[:, ids.shape[1]:].tolist(), [x.float().cpu() for x in out.logits]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_transformers_model_on_one_gpu_under_the_default_options(family):
    """``model.compile(backend="dsa_dcp", options={"dcp_size": 1})`` with the defaults (Inductor, CUDA
    graphs) generates eager's fp32 tokens, twice on new caches (the second prefill replays a graph:
    its shape was seen before), and in bf16 its logits are as near eager's as stock torch.compile's."""
    import dsa_dcp
    from dsa_dcp.integrations.transformers import tiny_model

    def model(dtype, backend=None):
        torch._dynamo.reset()
        m = tiny_model(family, layers=2, max_position_embeddings=GPU_LEN).to("cuda", dtype)
        if backend == "dsa_dcp":
            m.compile(backend="dsa_dcp", options={"dcp_size": 1}, fullgraph=True)
        elif backend == "inductor":
            m.compile(fullgraph=True)
        return m

    ref_tokens, ref_logits = _gpu_generate(model(torch.float32), "static", torch.float32)
    compiled = model(torch.float32, "dsa_dcp")
    for attempt in range(2):
        tokens, logits = _gpu_generate(compiled, "dcp", torch.float32)
        assert tokens == ref_tokens, attempt
        for a, b in zip(logits, ref_logits, strict=True):
            assert _relative_error(a, b) < 1e-4, attempt
    lowered = dsa_dcp.backend_report().lowered
    assert len(lowered.graphs) >= 1  # the decode step replays a graph
    stats = dsa_dcp.backend_report().stats()["recognize_sparse_attention"]
    assert stats["attention_recognized"] == 2

    bf16_ref = _gpu_generate(model(torch.bfloat16), "static", torch.bfloat16)
    stock = _gpu_generate(model(torch.bfloat16, "inductor"), "static", torch.bfloat16)
    ours = _gpu_generate(model(torch.bfloat16, "dsa_dcp"), "dcp", torch.bfloat16)

    def error(run):  # over the steps before a greedy token first differs (bf16 rounding may flip a near-tie)
        agree = [i for i in range(GPU_NEW) if all(a[: i + 1] == b[: i + 1] for a, b in zip(run[0], bf16_ref[0]))]
        steps = (agree[-1] + 1) if agree else 1
        return max((a - b).abs().max().item() for a, b in zip(run[1][:steps], bf16_ref[1][:steps]))

    assert error(ours) <= max(2 * error(stock), 5e-2), (error(ours), error(stock))
