"""MTP (DeepSeek-V3's multi-token prediction layer) and greedy speculative decoding, single-rank and
under DCP: the draft's caches whole on every rank (``replicated_modules=["mtp"]``), the target's split.

The tiny model has a vocabulary of 4 so that a random-weight draft is often right: with these seeds the
rounds accept none, some and all of the drafted tokens (checked), so rollback is exercised.
"""

import pytest
import torch

from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, make_requests
from dsa_dcp.models.speculative import generate_speculative
from dsa_dcp.slots import local_cache_rows, local_row, owner
from dsa_dcp.validate import DCPValidationError


pytestmark = pytest.mark.usefixtures("kept_ranks")

STEPS = 8
SEED = 8  # the model's weights
BATCH_SEED = 3  # the prompts and pages
VOCAB = 4


def _setup(k, family="deepseek-v3.2-tiny"):
    cfg = get_config(family, n_layers=2, mtp_layers=1, vocab_size=VOCAB)
    return cfg, make_requests(cfg, [3, 9, 14], max_new_tokens=STEPS + k, prefill_chunk=8, seed=BATCH_SEED)


def _single_rank(k):
    cfg, batch = _setup(k)
    model = DSAModel(cfg, batch.num_slots, seed=SEED)
    with torch.no_grad():
        result = generate_speculative(model, model.draft, batch, STEPS, k)
    return cfg, batch, model, result


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_gives_the_targets_greedy_tokens(k):
    """Draft, verify, accept and roll back: the tokens are the target's own greedy tokens (rejected
    rows left in the caches are never read), whatever the draft gets right."""
    cfg, batch, model, result = _single_rank(k)
    plain = DSAModel(get_config(cfg.name, n_layers=2, vocab_size=VOCAB), batch.num_slots, seed=SEED)
    with torch.no_grad():
        reference = generate(plain, batch, STEPS)
    assert result.tokens == reference.tokens
    accepted = {a for per_request in result.accepted for a in per_request}
    assert 0 in accepted and k in accepted  # rounds that reject at once and rounds that accept everything
    assert k == 1 or accepted & set(range(1, k))  # and rounds that accept some drafts and reject the rest
    assert all(len(d) == k for per_request in result.drafts for d in per_request)
    rounds = [a + 1 for per_request in result.accepted for a in per_request]
    assert result.accept_length == sum(rounds) / len(rounds)
    assert 1 < result.accept_length < k + 1


def test_the_mtp_layer_leaves_the_target_as_it_was():
    """The MTP weights are drawn after the target's: the same seed gives the same target, the same logits."""
    cfg, batch = _setup(1)
    with_mtp = DSAModel(cfg, batch.num_slots, seed=SEED)
    without = DSAModel(get_config(cfg.name, n_layers=2, vocab_size=VOCAB), batch.num_slots, seed=SEED)
    target = {n: p for n, p in with_mtp.state_dict().items() if not n.startswith("mtp.")}
    assert target.keys() == without.state_dict().keys()
    assert all(torch.equal(p, without.state_dict()[n]) for n, p in target.items())
    assert {n.split(".")[1] for n in with_mtp.state_dict() if n.startswith("mtp.")} == \
        {"enorm", "hnorm", "eh_proj", "layer", "norm"}
    assert with_mtp.mtp.eh_proj.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert with_mtp.mtp.layer.attn.indexer is not None  # its own indexer and caches
    assert with_mtp.draft_kv_cache().shape == (batch.num_slots, cfg.kv_dim)
    rows = torch.arange(4)
    slots = torch.tensor([batch.slot(0, p) for p in range(4)])
    with torch.no_grad():
        logits, hidden = with_mtp(rows, rows, rows * 0, slots, batch.page_table, return_hidden=True)
        assert torch.equal(logits, without(rows, rows, rows * 0, slots, batch.page_table))
        assert hidden.shape == (4, cfg.hidden_size)
        draft_logits, draft_hidden = with_mtp.draft(rows, rows, rows * 0, slots, batch.page_table, hidden)
    assert draft_logits.shape == (4, cfg.vocab_size) and draft_hidden.shape == hidden.shape
    assert with_mtp.draft_kv_cache()[slots].abs().sum(-1).gt(0).all()  # the draft wrote its own cache
    with pytest.raises(ValueError, match="mtp_layers must be 0 or 1"):
        get_config(cfg.name, mtp_layers=2)
    with pytest.raises(ValueError, match="has no MTP layer"):
        without.draft(rows, rows, rows * 0, slots, batch.page_table, hidden)


def test_module_paths_are_read_from_dynamos_module_stack_in_its_spellings():
    from dsa_dcp.passes.replicated import module_path

    assert module_path("L['self'].mtp.layer.attn") == "mtp.layer.attn"
    assert module_path("L['self']._modules['mtp']._modules['layer']") == "mtp.layer"
    assert module_path('L["self"].layers[0].attn') == "layers.0.attn"
    assert module_path("L['model'].mtp") == "mtp"
    assert module_path("L['self']") == ""


def test_draft_options_are_refused_at_compile_time():
    """Tree drafts are refused by the options; an unknown module name and a verify step whose rows are
    not a multiple of k + 1 by the replicated_modules pass (at every dcp_size, 1 included)."""
    with pytest.raises(OptionsError, match=r"draft_topk must be 1: the draft is a chain .* got 2"):
        DCPOptions.parse({"draft_topk": 2})
    with pytest.raises(OptionsError, match=r"replicated_modules must be a list of distinct module names"):
        DCPOptions.parse({"replicated_modules": ["mtp", "mtp"]})
    with pytest.raises(OptionsError, match=r"draft_length must be None or an integer >= 1, got 0"):
        DCPOptions.parse({"draft_length": 0})
    assert DCPOptions.parse({"replicated_modules": ["mtp"]}).replicated_modules == ("mtp",)

    import dsa_dcp

    cfg, batch = _setup(3)
    model = DSAModel(cfg, batch.num_slots, seed=SEED)
    rows = torch.zeros(8, dtype=torch.int64)
    inputs = (rows, rows - 1, rows, rows - 1, batch.page_table)
    torch._dynamo.reset()
    draft = dsa_dcp.compile(model.draft, replicated_modules=["mpt"], lowering="fx")
    with pytest.raises(DCPValidationError, match=r"replicated_modules names 'mpt', which is no submodule of the "
                                                 r"compiled DSAModel \(its submodules: \['layers', 'norm', 'mtp'\]\)"):
        draft(*inputs, torch.zeros(8, cfg.hidden_size))
    torch._dynamo.reset()
    five = tuple(x[:5] for x in inputs[:4]) + (batch.page_table,)
    with pytest.raises(DCPValidationError, match=r"draft_length=3, but the step's split attention \(sparse_mla\w*\) "
                                                 r"has 5 rows, not a multiple of draft_length \+ 1 = 4"):
        dsa_dcp.compile(model, replicated_modules=["mtp"], draft_length=3, lowering="fx")(*five)

    def draft_and_read_its_cache(model, *inputs):  # the draft's cache read outside the draft module
        logits, _ = model.draft(*inputs)
        return logits + model.mtp.layer.attn.kv_cache.sum()

    torch._dynamo.reset()
    with pytest.raises(DCPValidationError, match=r"cache \w+ is used inside replicated module 'mtp' and outside it"):
        dsa_dcp.compile(draft_and_read_its_cache, replicated_modules=["mtp"], lowering="fx")(
            model, *inputs, torch.zeros(8, cfg.hidden_size))


# ---------------------------------------------------------------------- DCP over gloo


def _dcp_rank(rank, world, merge, ks):
    import dsa_dcp

    out = {}
    for k in ks:
        cfg, batch = _setup(k)
        torch._dynamo.reset()
        model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=SEED)
        options = {"dcp_size": world, "merge": merge, "lowering": "fx", "replicated_modules": ["mtp"],
                   "draft_length": k}
        target = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
        draft = torch.compile(model.draft, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
        with torch.no_grad():
            result = generate_speculative(target, draft, batch, STEPS, k)
        out[k] = {"tokens": result.tokens, "drafts": result.drafts, "accepted": result.accepted,
                  "accept_length": result.accept_length, "logits": result.target_logits,
                  "caches": [c.clone() for c in model.kv_caches()], "draft_cache": model.draft_kv_cache().clone(),
                  "draft_summary": dsa_dcp.backend_report().summary}
    if world == 2:
        out["one_graph"] = _verify_then_draft(world)
    return out


def _verify_and_draft_step(model, input_ids, positions, req_ids, slots, page_table):
    logits, hidden = model(input_ids, positions, req_ids, slots, page_table, return_hidden=True)
    draft_logits, _ = model.draft(input_ids, positions, req_ids, slots, page_table, hidden)
    return logits, draft_logits


def _one_graph_inputs(k):
    cfg, batch = _setup(k)
    rows = [(r, p) for r in (1, 2) for p in range(4)]  # 8 rows: a multiple of draft_length + 1
    ids = torch.tensor([batch.requests[r].prompt[p] for r, p in rows])
    positions = torch.tensor([p for _, p in rows])
    req_ids = torch.tensor([r for r, _ in rows])
    slots = torch.tensor([batch.slot(r, p) for r, p in rows])
    return cfg, batch, (ids, positions, req_ids, slots, batch.page_table)


def _verify_then_draft(world):
    """The target and the draft in one graph: the draft's nodes stay whole, the target's are split; with
    a sharded index cache for the target (the draft's stays whole), then the draft alone again."""
    import dsa_dcp

    cfg, batch, inputs = _one_graph_inputs(3)
    torch._dynamo.reset()
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=SEED, index_cache="sharded")
    options = dict(dcp_size=world, lowering="fx", replicated_modules=["mtp"], draft_length=3, index_cache="sharded")
    step = dsa_dcp.compile(_verify_and_draft_step, **options)
    with torch.no_grad():
        logits, draft_logits = step(model, *inputs)
        summary = dsa_dcp.backend_report().summary
        hidden = model.draft_kv_cache().clone()  # the draft cache after the one-graph step
        again, _ = dsa_dcp.compile(model.draft, **options)(*inputs, torch.ones(len(inputs[0]), cfg.hidden_size))
    return {"logits": logits, "draft_logits": draft_logits, "summary": summary, "draft_cache": hidden,
            "draft_again": again}


def _refusals(world):
    """What the group refuses: a draft cache split over the group named replicated, and a whole
    draft cache compiled without naming its module; compiled for rank 0 of a fake group of ``world``
    ranks in this process (refused at compile time: no collective runs)."""
    from dsa_dcp.inspection.targets import fake_group

    with fake_group(world):
        return _refusals_in_group(world)


def _refusals_in_group(world):
    import dsa_dcp

    cfg, batch = _setup(1)
    rows = torch.zeros(4, dtype=torch.int64)
    inputs = (rows, rows - 1, rows, rows - 1, batch.page_table, torch.zeros(4, cfg.hidden_size))
    errors = {}
    cases = {
        "split_draft_cache": (dict(draft_cache="split"), {"replicated_modules": ["mtp"]}),
        "whole_draft_cache_not_named": (dict(), {}),
    }
    for name, (allocation, options) in cases.items():
        torch._dynamo.reset()
        model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=SEED, **allocation)
        try:
            dsa_dcp.compile(model.draft, dcp_size=world, lowering="fx", **options)(*inputs)
        except DCPValidationError as e:
            errors[name] = str(e)
    torch._dynamo.reset()  # a target step of 6 rows compiled for draft length 3 (verify steps of 4 rows a request)
    model = DSAModel(cfg, batch.num_slots, dcp_size=world, seed=SEED)
    six = torch.zeros(6, dtype=torch.int64)
    try:
        dsa_dcp.compile(model, dcp_size=world, lowering="fx", replicated_modules=["mtp"], draft_length=3)(
            six, six - 1, six, six - 1, batch.page_table)
    except DCPValidationError as e:
        errors["verify_rows"] = str(e)
    return errors


def _check_target_caches_are_split(cfg, batch, reference, rank_caches, world):
    """Every written target row is stored once, on its owner, at its local row (1/N of the slots)."""
    rows = local_cache_rows(batch.num_slots, world, 1)
    slots = torch.arange(batch.num_slots)
    own, row = owner(slots, world, 1), local_row(slots, world, 1)
    assert reference[0].abs().sum(-1).gt(0).sum() > 0
    for layer, ref in enumerate(reference):
        rebuilt = torch.zeros_like(ref)
        for r in range(world):
            cache = rank_caches[r][layer]
            assert cache.shape == (rows, cfg.kv_dim)
            rebuilt[own == r] = cache[row[own == r]]
        torch.testing.assert_close(rebuilt, ref, rtol=1e-5, atol=1e-5)


# k = 1 and 3 at N = 2; k = 3 alone at N = 3 (its rounds run every step kind k = 1 runs, extend and
# verify, and the chain besides; k = 1 under DCP is the N = 2 case).
DCP_CASES = [(2, "a2a", (1, 3)), (3, "ag", (3,))]


@pytest.mark.slow
@pytest.mark.parametrize("world, merge, ks", DCP_CASES, ids=str)
def test_dcp_drafts_and_accepts_what_the_single_rank_model_does(world, merge, ks):
    ranks = run_on_ranks(_dcp_rank, world, merge, ks, timeout=600)
    for k in ks:
        cfg, batch, model, ref = _single_rank(k)
        for rank, res in enumerate(ranks):
            got = res[k]
            assert got["tokens"] == ref.tokens, (k, rank)
            assert got["drafts"] == ref.drafts, (k, rank)
            assert got["accepted"] == ref.accepted, (k, rank)
            assert got["accept_length"] == ref.accept_length
            assert len(got["logits"]) == len(ref.target_logits)
            for a, b in zip(got["logits"], ref.target_logits):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, (k, rank)
            # the draft step has no collective: its attention is single-rank over its whole cache
            assert got["draft_summary"]["collectives"] == 0 and got["draft_summary"]["remaps"] == 0
            # the draft's cache: whole, the same bytes on every rank, the single-rank model's rows
            assert got["draft_cache"].shape == (batch.num_slots, cfg.kv_dim)
            assert torch.equal(got["draft_cache"], ranks[0][k]["draft_cache"])
            torch.testing.assert_close(got["draft_cache"], model.draft_kv_cache(), rtol=1e-5, atol=1e-5)
        _check_target_caches_are_split(cfg, batch, model.kv_caches(), [r[k]["caches"] for r in ranks], world)
    if world == 2:
        cfg, batch, inputs = _one_graph_inputs(3)
        model = DSAModel(cfg, batch.num_slots, seed=SEED)
        with torch.no_grad():
            logits, draft_logits = _verify_and_draft_step(model, *inputs)
        for res in ranks:
            got = res["one_graph"]
            assert got["summary"]["sparse_attention_nodes"] == cfg.n_layers + 1  # the draft's node counted too
            assert got["summary"]["remaps"] == len(cfg.indexer_layers)  # the target's only
            torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["draft_logits"], draft_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["draft_cache"], model.draft_kv_cache(), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            again, _ = model.draft(*inputs, torch.ones(len(inputs[0]), cfg.hidden_size))
        for res in ranks:
            torch.testing.assert_close(res["one_graph"]["draft_again"], again, rtol=1e-5, atol=1e-5)


def test_a_dcp_group_refuses_split_or_unnamed_draft_caches_and_uneven_verify_rows():
    errors = _refusals(2)
    assert "KV cache" in errors["split_draft_cache"]
    assert "of replicated module 'mtp' was allocated for dcp_size=2" in errors["split_draft_cache"]
    assert "allocate its caches whole (DSAModel(..., draft_cache='replicated')" in errors["split_draft_cache"]
    assert "was allocated for dcp_size=1" in errors["whole_draft_cache_not_named"]
    assert "a DCP rank never holds the global cache" in errors["whole_draft_cache_not_named"]
    assert "has 6 rows, not a multiple of draft_length + 1 = 4" in errors["verify_rows"]


def test_bench_times_a_speculative_round_and_the_plain_step():
    """``dsa-dcp bench step --mtp K``'s round on the CPU (a call counter for a timer): every step kind
    compiles with the speculative options and runs; the round is extend + (K - 1) chain + verify."""
    from dsa_dcp.bench.speculative import format_speculative_table, speculative_inputs, speculative_round_us

    k, batch, context = 2, 2, 5
    cfg = get_config("glm5.2-tiny", n_layers=1, mtp_layers=1)
    inputs, num_slots = speculative_inputs(cfg, batch, context, k, "cpu")
    assert inputs["verify"][1].tolist() == [5, 6, 7, 5, 6, 7] and inputs["chain"][1].tolist() == [5, 5]
    model = DSAModel(cfg, num_slots, seed=SEED)
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return float(len(calls))  # plain 1, verify 2, extend 3, chain 4

    torch._dynamo.reset()
    row = speculative_round_us(model, cfg, batch, context, k, timer, {"lowering": "fx"})
    assert row["round_us"] == 3 + (k - 1) * 4 + 2 and row["breakeven_accept_length"] == row["round_us"] / 1
    assert row["us_per_token_at_accept_3"] == row["round_us"] / 3
    assert model.draft_kv_cache()[inputs["extend"][3]].abs().sum(-1).gt(0).all()  # the draft steps ran
    assert "| 2 | 2 | 1 | 2 | 3 | 4 | 9 | 9.00 | 9 | 4 | 3 |" in format_speculative_table([{"batch": 2, **row}])
