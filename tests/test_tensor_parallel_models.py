"""Tensor- and expert-parallel forms of the reference models (``models/dsa.py``, ``models/plain.py``).

On real gloo groups (worlds of 2 and 4), fp32: a TP rank's model, loaded from the unsharded
model's weights, gives the unsharded single-rank model's logits (rel < 1e-5) and greedy tokens
through the model's own generation loop (``models.runner.generate``, ``plain.generate``), eagerly
and under stock ``torch.compile(fullgraph=True)`` (``aot_eager``). ``DSAModel`` runs TP 2, TP 4
and two TP-2 groups side by side in a world of 4 (each group serving its own requests); the
plain model runs published-style TP over the world, with a dense MLP and with the
expert-parallel MoE. Everything runs eagerly in both worlds; compiles are the slow part on 2
CPU cores, so three cases are compiled with ``aot_eager``: GLM-5.2 at TP 2 over the world,
DeepSeek-V3.2 in two TP-2 groups side by side (collectives over subgroups), and the plain MoE
model (layer 0 a dense TP MLP, layer 1 the EP MoE) at TP 2; and DeepSeek-V3.2 at TP 2 through
``backend="dsa_dcp"`` at ``dcp_size=1``. Refusals are checked with and without a process group.
"""

import pytest
import torch

from dsa_dcp.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("kept_ranks")  # several gloo runs: kept ranks (conftest.py)

DSA_FAMILIES = {"deepseek-v3.2": ("deepseek-v3.2-tiny", 2), "glm5.2": ("glm5.2-tiny", 4)}  # GLM: IndexShare at 3
# per world: (family, layout, compiled runs besides eager); "tp2x2" = two TP-2 groups {0, 1}, {2, 3};
# "dsa_dcp": backend="dsa_dcp" at dcp_size 1 (the DCP passes have nothing to do; fx lowering)
DSA_CASES = {
    2: [("deepseek-v3.2", "tp2", ("dsa_dcp",)), ("glm5.2", "tp2", ("aot_eager",))],
    4: [("deepseek-v3.2", "tp4", ()), ("deepseek-v3.2", "tp2x2", ("aot_eager",)),
        ("glm5.2", "tp4", ()), ("glm5.2", "tp2x2", ())],
}
# "moe": layer 0 a dense TP MLP, layer 1 the EP MoE (with a TP shared-expert MLP)
PLAIN_CASES = {2: [("dense", False), ("moe", True)], 4: [("dense", False), ("moe", False)]}
STEPS, PAD_TO = 3, 16
PROMPT_LENS, NEW_TOKENS = [3, 5, 7], 3
MOE = dict(n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=16)


def _dsa_batch(family: str, seed: int):
    from dsa_dcp.models import get_config, standard_test_batch

    name, n_layers = DSA_FAMILIES[family]
    cfg = get_config(name, n_layers=n_layers)
    return cfg, standard_test_batch(cfg, max_new_tokens=STEPS, seed=seed)


def _plain_args(kind: str, **extra):
    from dsa_dcp.models.plain import tiny_args

    return tiny_args(max_seq_len=12, n_heads=8, **(MOE if kind == "moe" else {}), **extra)  # 8 heads: TP 2 and 4


def _prompts():
    from dsa_dcp.models.plain import random_prompts

    return random_prompts(PROMPT_LENS, 64, seed=1)


def _dsa_case(rank: int, world: int, family: str, layout: str, backends: tuple, groups) -> dict:
    from dsa_dcp.models import DSAModel, generate
    from dsa_dcp.models.dsa import shard_for_tp

    group = groups[rank // 2] if layout == "tp2x2" else None
    batch_seed = rank // 2 if layout == "tp2x2" else 0  # side-by-side groups serve different requests
    cfg, batch = _dsa_batch(family, batch_seed)
    tp_size = 2 if layout == "tp2x2" else world
    full = DSAModel(cfg, batch.num_slots, seed=0)
    seeded = DSAModel(cfg, batch.num_slots, seed=0, tp_size=tp_size, tp_group=group)
    expected = shard_for_tp(full, seeded.tp.rank, tp_size)
    out = {"batch_seed": batch_seed, "tp": (seeded.tp.size, seeded.tp.rank),
           "seeded_is_shard": all(torch.equal(v, expected[k]) for k, v in seeded.state_dict().items())}
    model = DSAModel(cfg, batch.num_slots, seed=1, tp_size=tp_size, tp_group=group).load_unsharded(full)
    out["eager"] = generate(model, batch, steps=STEPS, pad_to=PAD_TO)
    for backend in backends:
        model.reset_caches()
        torch._dynamo.reset()
        options = {"options": {"dcp_size": 1, "lowering": "fx"}} if backend == "dsa_dcp" else {}
        with torch.no_grad():
            out[backend] = generate(torch.compile(model, backend=backend, fullgraph=True, **options), batch,
                                    steps=STEPS, pad_to=PAD_TO)
    return out


def _plain_case(kind: str, compiled: bool) -> dict:
    from dsa_dcp.models.plain import Transformer, generate, init_weights, load_unsharded

    full = init_weights(Transformer(_plain_args(kind)), seed=0).state_dict()
    model = load_unsharded(Transformer(_plain_args(kind, tensor_parallel=True)), full).eval()
    out = {"world_size": model.world_size, "eager": generate(model, _prompts(), NEW_TOKENS)}
    if compiled:
        model = load_unsharded(Transformer(_plain_args(kind, tensor_parallel=True)), full).eval()  # empty caches
        torch._dynamo.reset()
        out["compiled"] = generate(torch.compile(model, backend="aot_eager", fullgraph=True), _prompts(), NEW_TOKENS)
    return out


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None  # every rank makes both
    dsa = {(family, layout): _dsa_case(rank, world, family, layout, backends, groups)
           for family, layout, backends in DSA_CASES[world]}
    plain = {kind: _plain_case(kind, compiled) for kind, compiled in PLAIN_CASES[world]}
    return {"dsa": dsa, "plain": plain}


def _assert_same_logits(got: list, ref: list, what) -> None:
    assert len(got) == len(ref), what
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert ((a - b).norm() / b.norm()).item() < 1e-5, (what, step)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_models_match_the_unsharded_model(world):
    from dsa_dcp.models import DSAModel, generate
    from dsa_dcp.models.plain import Transformer, init_weights
    from dsa_dcp.models.plain import generate as plain_generate

    dsa_refs = {}
    for family, layout, _ in DSA_CASES[world]:
        for seed in (0, 1) if layout == "tp2x2" else (0,):
            if (family, seed) not in dsa_refs:
                cfg, batch = _dsa_batch(family, seed)
                dsa_refs[family, seed] = generate(DSAModel(cfg, batch.num_slots, seed=0), batch, steps=STEPS,
                                                  pad_to=PAD_TO)
    plain_refs = {kind: plain_generate(init_weights(Transformer(_plain_args(kind)), seed=0).eval(), _prompts(),
                                       NEW_TOKENS)
                  for kind, _ in PLAIN_CASES[world]}

    for rank, result in enumerate(run_on_ranks(_rank, world, timeout=300)):
        for (family, layout, backends) in DSA_CASES[world]:
            got = result["dsa"][family, layout]
            tp_size = 2 if layout == "tp2x2" else world
            assert got["tp"] == (tp_size, rank % tp_size), (family, layout, rank)
            assert got["seeded_is_shard"], (family, layout, rank)
            ref = dsa_refs[family, got["batch_seed"]]
            for mode in ("eager", *backends):
                what = (family, layout, mode, rank)
                assert got[mode].tokens == ref.tokens, what
                assert got[mode].step_rows == ref.step_rows, what
                _assert_same_logits(got[mode].step_logits, ref.step_logits, what)
        for kind, compiled in PLAIN_CASES[world]:
            got, (ref_tokens, ref_logits) = result["plain"][kind], plain_refs[kind]
            assert got["world_size"] == world, (kind, rank)
            for mode in ("eager", "compiled") if compiled else ("eager",):
                tokens, logits = got[mode]
                assert tokens == ref_tokens, (kind, mode, rank)
                _assert_same_logits(logits, ref_logits, (kind, mode, rank))


def _refusals_in_a_group(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.plain import Transformer, tiny_args

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)
    pair = dist.new_group([0, 1])
    attempts = {
        "tp_size_not_the_world": lambda: DSAModel(cfg, 16, tp_size=2),
        "tp_size_not_the_group": lambda: DSAModel(cfg, 16, tp_size=4, tp_group=pair),
        "not_in_the_group": lambda: DSAModel(cfg, 16, tp_group=pair),
        "plain_heads": lambda: Transformer(tiny_args(tensor_parallel=True)),  # 6 heads over 4 ranks
        "plain_experts": lambda: Transformer(tiny_args(n_heads=8, tensor_parallel=True, n_routed_experts=6)),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_tp_refusals_in_a_process_group():
    results = run_on_ranks(_refusals_in_a_group, 4, timeout=120)
    for rank, got in enumerate(results):
        assert "tp_size=2 in a world of 4 rank(s)" in got["tp_size_not_the_world"], got
        assert "n_heads=6 is not divisible by the tensor-parallel world_size=4" in got["plain_heads"], got
        assert "n_routed_experts=6 is not divisible by the tensor-parallel world_size=4" in got["plain_experts"], got
        if rank < 2:  # members
            assert "tp_size=4 but tp_group has 2 rank(s)" in got["tp_size_not_the_group"], got
            assert got["not_in_the_group"] is None, got  # a TP-2 model
        else:
            for attempt in ("tp_size_not_the_group", "not_in_the_group"):
                assert f"global rank {rank}) is not a member of tp_group" in got[attempt], got


def test_tp_refusals_without_a_group():
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.dsa import shard_for_tp
    from dsa_dcp.models.plain import ModelArgs, Transformer, init_weights, load_unsharded, tiny_args

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)  # 4 heads, intermediate 64
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide n_heads=4 and intermediate_size=64 of 'deepseek-v3.2-tiny'"):
        DSAModel(cfg, 16, tp_size=3)
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide intermediate_size=66"):
        DSAModel(get_config("deepseek-v3.2-tiny", n_layers=1, intermediate_size=66), 16, tp_size=4)
    with pytest.raises(ValueError, match=r"tp_size must be an int >= 1, got 0"):
        DSAModel(cfg, 16, tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size=2 needs an initialized process group"):
        DSAModel(cfg, 16, tp_size=2)

    full = DSAModel(cfg, 16)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        shard_for_tp(full, 2, 2)
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide n_heads=4"):
        shard_for_tp(full, 0, 3)
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide dim 0 of layers.0.attn.wq_b \(shape \(64, 16\)\)"):
        shard_for_tp(full.state_dict(), 0, 3)
    # TP size 1: the unsharded model itself
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in shard_for_tp(full, 0, 1).items())
    assert DSAModel(cfg, 16, tp_size=1).tp.size == 1

    with pytest.raises(ValueError, match=r"n_activated_experts=3 must be in \[1, n_routed_experts=2\]"):
        ModelArgs(n_routed_experts=2, n_activated_experts=3)
    with pytest.raises(ValueError, match=r"score_func='relu'"):
        ModelArgs(score_func="relu")
    other = init_weights(Transformer(tiny_args(n_heads=4)), seed=0).state_dict()
    with pytest.raises(ValueError, match=r"layers.0.attn.wq_b.weight: the unsharded weight's shape \(64, 16\)"):
        load_unsharded(Transformer(tiny_args()), other)
    # no process group: tensor_parallel builds the one-device model
    assert Transformer(tiny_args(tensor_parallel=True)).world_size == 1


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_of_the_merged_mlp_sum_to_the_unsharded_mlp(tp_size):
    """``w_gate_up`` stacks the gate's rows and up's: a TP rank's shard keeps its columns of each, so
    the ranks' partial MLP outputs (before the TP sum) add up to the unsharded MLP's."""
    from dsa_dcp.models import DSAModel, get_config
    from dsa_dcp.models.dsa import shard_for_tp

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)
    full = DSAModel(cfg, 16, seed=5, dtype=torch.float64)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    partial_sum = torch.zeros_like(x)
    for rank in range(tp_size):
        shard = shard_for_tp(full, rank, tp_size)
        gate_up, down = shard["layers.0.mlp.w_gate_up"], shard["layers.0.mlp.w_down"]
        assert gate_up.shape == (2 * cfg.intermediate_size // tp_size, cfg.hidden_size)
        gate, up = (x @ gate_up.T).chunk(2, dim=-1)
        partial_sum += (torch.nn.functional.silu(gate) * up) @ down.T
    torch.testing.assert_close(partial_sum, full.layers[0].mlp(x), rtol=1e-12, atol=1e-12)
