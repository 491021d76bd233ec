"""DCP inside tensor parallelism: ``DSAModel(tp_size=T)`` compiled with ``dcp_size=N`` over a DCP
group of its TP group, on 4 gloo ranks, fp32, against the unsharded single-rank model.

Layouts (``dsa_dcp.topology.tp_dcp_groups``): TP 4 + DCP 2 (two DCP groups side by side), TP 4 +
DCP 4, TP 2 + DCP 2 twice side by side (each TP group serving its own requests). Every merge mode
runs for each family, TP 4 + DCP 2 (DCP groups inside a TP group) for both families and each other
layout for one, and each merge mode and each layout with both ``replicate_q`` settings (a covering
set of cases, not every product: each layout of a family is one more trace on 4 ranks, the slow part;
``DSA_DCP_FULL_MATRIX=1`` runs every product); each rank's
greedy tokens and logits equal the single-rank model's, every layer is rewritten as a TP layer, and
each rank holds 1/N of the KV rows TP alone holds. With ``replicate_q`` no layer all-gathers its
query and each rank holds the other DCP ranks' query weights (``replicated_query_bytes``); without
it, one query all-gather a layer. The refusals are ``tests/test_tp_dcp_refusals.py``.
"""

import os

import pytest
import torch

from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch


pytestmark = pytest.mark.usefixtures("kept_ranks")

STEPS, ROWS = 6, 16
LAYERS = {"deepseek-v3.2-tiny": 2, "glm5.2-tiny": 4}  # GLM: layer 3 reuses layer 2's top-k
# (tp, dcp) -> (merge, replicate_q) cases, per family: every merge for each family; TP 4 + DCP 2 for
# both, TP 4 + DCP 4 for GLM (whose layer 3 shares layer 2's remap) and TP 2 + DCP 2 for DeepSeek (a
# layout's groups and DCP ranks come from tp_dcp_groups whatever the family; a shared remap is one
# remap of the same top-k: tests/test_share_remaps.py); each merge and each layout with replicate_q on
# and off, and the inspection of an a2a case with each
CASES = {
    "deepseek-v3.2-tiny": {(4, 2): (("ag", True), ("a2a", False), ("ag_rs", True), ("fused_a2a", False)),
                           (2, 2): (("ag_rs", False), ("a2a", True))},
    "glm5.2-tiny": {(4, 2): (("a2a", True), ("ag_rs", False)), (4, 4): (("ag", False), ("fused_a2a", True))},
}

if os.environ.get("DSA_DCP_FULL_MATRIX"):  # every layout x merge x replicate_q, for a run by hand
    CASES = {family: {layout: tuple((merge, rq) for merge in ("ag", "a2a", "ag_rs", "fused_a2a")
                                    for rq in (True, False)) for layout in ((4, 2), (4, 4), (2, 2))}
             for family in CASES}


def _setup(family: str, seed: int):
    cfg = get_config(family, n_layers=LAYERS[family])
    return cfg, standard_test_batch(cfg, max_new_tokens=STEPS, seed=seed)


def _request_seed(tp: int, rank: int) -> int:
    return 7 + rank // tp  # side-by-side TP groups serve different requests


def _tp_dcp_rank(rank, world, family):
    from one_trace import OneTrace

    import dsa_dcp
    from dsa_dcp.topology import tp_dcp_groups

    results = {}
    for (tp, dcp), cases in CASES[family].items():
        groups = tp_dcp_groups(tp, dcp)
        cfg, batch = _setup(family, _request_seed(tp, rank))
        full = DSAModel(cfg, batch.num_slots, seed=11)
        torch._dynamo.reset()
        model = DSAModel(cfg, batch.num_slots, dcp_size=dcp, seed=1, tp_size=tp, tp_group=groups.tp)
        model.load_unsharded(full)
        # the layout's model traced once, compiled once a case; a2a last: dsa_dcp.inspect reads the
        # latest compilation
        order = sorted(cases, key=lambda case: case[0] == "a2a")
        backend = OneTrace({(merge, replicate_q): {"dcp_size": dcp, "merge": merge, "lowering": "fx",
                                                   "group": groups.dcp, "replicate_q": replicate_q}
                            for merge, replicate_q in order})
        step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        for merge, replicate_q in order:
            backend.select((merge, replicate_q))
            model.reset_caches()
            with torch.no_grad():
                out = generate(step, batch, STEPS, pad_to=ROWS)
            results[tp, dcp, merge, replicate_q] = {
                "tokens": out.tokens, "logits": out.step_logits, "kv_rows": [c.shape[0] for c in model.kv_caches()],
                "stats": backend.reports[merge, replicate_q].stats()["dcp_rewrite"], "traces": backend.traces}
            if merge == "a2a" and (merge, replicate_q) == order[-1]:  # what the inspection tool reports of
                # the latest compilation (a2a all-gathers nothing itself)
                summary = dsa_dcp.inspect(step).summary()
                results[tp, dcp, merge, replicate_q]["inspected"] = (
                    summary["weights"]["replicated_query_bytes"], sorted(summary["collectives"]["by_op"]))
    return results


@pytest.mark.parametrize("family", list(CASES))
def test_tp_with_dcp_inside_matches_the_unsharded_model(family):
    refs = {}
    for rank in range(4):
        for tp in {tp for tp, _ in CASES[family]}:
            seed = _request_seed(tp, rank)
            if seed not in refs:
                cfg, batch = _setup(family, seed)
                single = DSAModel(cfg, batch.num_slots, seed=11)
                with torch.no_grad():
                    refs[seed] = (generate(single, batch, STEPS, pad_to=ROWS), single.kv_caches()[0].shape[0])
    for rank, results in enumerate(run_on_ranks(_tp_dcp_rank, 4, family, timeout=600)):
        for (tp, dcp, merge, replicate_q), got in results.items():
            what = (family, f"tp{tp}", f"dcp{dcp}", merge, f"replicate_q={replicate_q}", rank)
            ref, tp_alone_rows = refs[_request_seed(tp, rank)]
            assert got["tokens"] == ref.tokens, what
            assert len(got["logits"]) == len(ref.step_logits), what
            for a, b in zip(got["logits"], ref.step_logits):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, what
            assert got["stats"]["tp_layers"] == LAYERS[family], what
            assert got["traces"] == 1, what  # one graph a layout, every case compiled from it
            assert got["kv_rows"] == [tp_alone_rows // dcp] * LAYERS[family], what  # 1/N of TP alone's rows
            stats = got["stats"]
            if replicate_q:  # wq_b rows and W_UK of the other DCP ranks' heads, fp32
                assert stats["query_all_gathers"] == 0, what
                assert stats["replicated_query_bytes"] == _query_weight_bytes(family, tp) * (dcp - 1), what
            else:
                assert stats["query_all_gathers"] == LAYERS[family], what
                assert stats["replicated_query_bytes"] == 0, what
            if "inspected" in got:
                held, ops = got["inspected"]
                assert held == stats["replicated_query_bytes"], what
                assert any("all_gather" in op for op in ops) == (not replicate_q), (what, ops)


def _query_weight_bytes(family: str, tp: int) -> int:
    """Bytes of one TP rank's query weights (``wq_b`` and ``w_uk``) over every layer, fp32."""
    cfg = get_config(family, n_layers=LAYERS[family])
    heads = cfg.n_heads // tp
    per_layer = heads * cfg.qk_head_dim * cfg.q_lora_rank + heads * cfg.qk_nope_head_dim * cfg.kv_lora_rank
    return 4 * per_layer * LAYERS[family]


# The plain model (``models/plain.py``) runs the published TP over the whole world (it reads the
# world size when built), so its layouts are TP 4 + DCP 2 and TP 4 + DCP 4; "moe": layer 0 a dense
# TP MLP (``n_dense_layers=1``), layer 1 the expert-parallel MoE. Every case runs the MoE model: its
# layer 0 is the dense TP MLP a "dense" model has in every layer, so each case checks both MLPs under
# TP + DCP, with one trace a layout. (tp, dcp, mlp, merge, replicate_q)
PLAIN_CASES = [(4, 2, "moe", "a2a", True), (4, 2, "moe", "ag", False), (4, 4, "moe", "ag_rs", False),
               (4, 4, "moe", "fused_a2a", True)]
if os.environ.get("DSA_DCP_FULL_MATRIX"):
    PLAIN_CASES = [(4, dcp, mlp, merge, rq) for dcp in (2, 4) for mlp in ("dense", "moe")
                   for merge in ("ag", "a2a", "ag_rs", "fused_a2a") for rq in (True, False)]
PLAIN_MOE = dict(n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=16)
PLAIN_PROMPTS, PLAIN_NEW_TOKENS, PLAIN_MAX_LEN = [3, 5, 7], 3, 12


def _plain_args(mlp: str, **extra):
    from dsa_dcp.models.plain import tiny_args

    return tiny_args(max_seq_len=PLAIN_MAX_LEN, n_heads=8, **(PLAIN_MOE if mlp == "moe" else {}), **extra)


def _plain_generate(model):
    from dsa_dcp.models.plain import generate, random_prompts

    return generate(model, random_prompts(PLAIN_PROMPTS, 64, seed=1), PLAIN_NEW_TOKENS)


def _plain_rank(rank, world):
    from one_trace import OneTrace, zero_position_caches

    from dsa_dcp.models.plain import Transformer, init_weights, load_unsharded
    from dsa_dcp.position_cache import local_positions, shard_position_caches
    from dsa_dcp.topology import tp_dcp_groups

    results = {}
    models = {}  # (tp, dcp, mlp) -> its cases: one trace a model, compiled once a case
    for tp, dcp, mlp, merge, replicate_q in PLAIN_CASES:
        models.setdefault((tp, dcp, mlp), []).append((merge, replicate_q))
    for (tp, dcp, mlp), cases in models.items():
        groups = tp_dcp_groups(tp, dcp)
        full = init_weights(Transformer(_plain_args(mlp)), seed=0).state_dict()
        model = load_unsharded(Transformer(_plain_args(mlp, tensor_parallel=True)), full).eval()
        shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=dcp)
        torch._dynamo.reset()
        backend = OneTrace({(merge, rq): {"dcp_size": dcp, "merge": merge, "lowering": "fx", "group": groups.dcp,
                                          "replicate_q": rq} for merge, rq in cases})
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        for merge, replicate_q in cases:
            backend.select((merge, replicate_q))
            zero_position_caches(model)
            tokens, logits = _plain_generate(compiled)
            results[tp, dcp, mlp, merge, replicate_q] = {
                "tokens": tokens, "logits": logits, "world_size": model.world_size,
                "kv_positions": [local_positions(layer.attn.kv_cache).shape[1] for layer in model.layers],
                "stats": backend.reports[merge, replicate_q].stats()["dcp_rewrite"]}
    return results


@pytest.mark.slow
def test_plain_model_tp_and_ep_with_dcp_inside_matches_the_unsharded_model():
    from dsa_dcp.models.plain import Transformer, init_weights

    refs = {mlp: _plain_generate(init_weights(Transformer(_plain_args(mlp)), seed=0).eval())
            for mlp in {case[2] for case in PLAIN_CASES}}
    # on the ranks the DSAModel runs above used (kept ranks), whose groups had other members: the
    # compile-time agreement counts each rank's rounds in the run's store, not in the process
    for rank, results in enumerate(run_on_ranks(_plain_rank, 4, timeout=600)):
        assert len(results) == len(PLAIN_CASES)
        for (tp, dcp, mlp, merge, replicate_q), got in results.items():
            what = (f"tp{tp}", f"dcp{dcp}", mlp, merge, f"replicate_q={replicate_q}", rank)
            ref_tokens, ref_logits = refs[mlp]
            assert got["world_size"] == tp, what
            assert got["tokens"] == ref_tokens, what
            assert len(got["logits"]) == len(ref_logits), what
            for a, b in zip(got["logits"], ref_logits):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, what
            assert got["kv_positions"] == [PLAIN_MAX_LEN // dcp] * len(got["kv_positions"]), what  # 1/N of TP alone
            assert got["stats"]["tp_layers"] == len(got["kv_positions"]), what
            assert got["stats"]["query_all_gathers"] == (0 if replicate_q else got["stats"]["tp_layers"]), what
            assert (got["stats"]["replicated_query_bytes"] > 0) == replicate_q, what
