"""The forms published inference code takes, on the plain reference model (``models/plain.py``,
one ``ModelArgs`` field per form): casts on the cache reads, the softmax in float32 then cast back,
the mask added in place or not, and a graph break that hands the top-k to the attention's graph
as an input. Under DCP on gloo ranks each gives the single-rank model's tokens and logits, and
every attention is rewritten into sparse attention over the rank's positions."""

import pytest
import torch

from dsa_dcp.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)

FORMS = {  # the forms that can meet in one model do (a compile a model on every rank)
    "cache_cast_float+softmax_cast": {"cache_cast": "float", "softmax_cast": True},
    "cache_cast_to+mask_out_of_place": {"cache_cast": "to", "mask_add": "out_of_place"},
    "cache_cast_type_as": {"cache_cast": "type_as"},
    "topk_break_assert": {"topk_break": "assert"},
    "topk_break_broadcast": {"topk_break": "broadcast"},
}
PROMPT_LENS, NEW_TOKENS, MAX_LEN = [3, 5, 7], 3, 12  # MAX_LEN: a multiple of 2 and 3


def _model(form: dict, dcp_size: int):
    from dsa_dcp.models.plain import Transformer, init_weights, tiny_args
    from dsa_dcp.position_cache import shard_position_caches

    model = init_weights(Transformer(tiny_args(max_seq_len=MAX_LEN, **form)), seed=0).eval()
    if dcp_size:
        shard_position_caches(model, ("kv_cache", "pe_cache"), dcp_size=dcp_size)
    return model


def _generate(model):
    from dsa_dcp.models.plain import generate, random_prompts

    return generate(model, random_prompts(PROMPT_LENS, 64, seed=1), NEW_TOKENS)


def _rank(rank, world, names):
    from dsa_dcp.backend import dsa_dcp_backend, last_report

    results = {}
    for name in names:
        form = FORMS[name]
        torch._dynamo.reset()
        recognized = []

        def backend(gm, example_inputs):  # every graph's report: a graph break makes several
            step = dsa_dcp_backend(gm, example_inputs, options={"dcp_size": world, "lowering": "fx"})
            recognized.append(last_report().stats().get("recognize_sparse_attention", {}).get("attention_recognized", 0))
            return step

        model = _model(form, world)
        compiled = torch.compile(model, backend=backend, fullgraph=not form.get("topk_break"))
        tokens, logits = _generate(compiled)
        results[name] = {"tokens": tokens, "logits": logits, "recognized": recognized}
    return results


@pytest.mark.slow
def test_published_forms_match_single_rank():
    # two ranks: the forms are the same at every group size (N = 3 splits the plain model's caches in
    # tests/test_unmodified_models.py)
    world, names = 2, list(FORMS)
    refs = {name: _generate(_model(FORMS[name], 0)) for name in names}
    for rank, results in enumerate(run_on_ranks(_rank, world, names, timeout=600)):
        for name in names:
            got, (ref_tokens, ref_logits) = results[name], refs[name]
            assert got["tokens"] == ref_tokens, (name, rank)
            for a, b in zip(got["logits"], ref_logits, strict=True):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, (name, rank)
            # the decode step's attention rewritten: both layers in one graph, or, behind a graph break,
            # one layer's per graph (dynamo compiles it once for both: the weights and caches are inputs)
            layers_per_graph = 1 if FORMS[name].get("topk_break") else 2
            assert max(got["recognized"]) == layers_per_graph, (name, got["recognized"])
