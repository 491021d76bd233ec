"""DCP inside tensor parallelism: ``DSAModel(tp_size=T)`` compiled with ``dcp_size=N`` over a DCP
group of its TP group, on 4 gloo ranks, fp32, against the unsharded single-rank model.

Layouts (``dsa_dcp.topology.tp_dcp_groups``): TP 4 + DCP 2 (two DCP groups side by side), TP 4 +
DCP 4, TP 2 + DCP 2 twice side by side (each TP group serving its own requests). Every merge mode
runs for each family over the layouts; each rank's greedy tokens and logits equal the single-rank
model's, every layer is rewritten as a TP layer, and each rank holds 1/N of the KV rows TP alone
holds. The refusals: a DCP group across TP groups, N not dividing T, a collective the rewrite
cannot place.
"""

import pytest
import torch

from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch

pytestmark = pytest.mark.usefixtures("kept_ranks")

STEPS, ROWS = 6, 16
LAYERS = {"deepseek-v3.2-tiny": 2, "glm5.2-tiny": 4}  # GLM: layer 3 reuses layer 2's top-k
# (tp, dcp) -> merges, per family: every merge for each family, every layout for both
CASES = {
    "deepseek-v3.2-tiny": {(4, 2): ("ag", "a2a", "ag_rs", "fused_a2a"), (4, 4): ("a2a",), (2, 2): ("ag_rs",)},
    "glm5.2-tiny": {(4, 2): ("a2a",), (4, 4): ("ag", "fused_a2a"), (2, 2): ("a2a", "ag_rs")},
}


def _setup(family: str, seed: int):
    cfg = get_config(family, n_layers=LAYERS[family])
    return cfg, standard_test_batch(cfg, max_new_tokens=STEPS, seed=seed)


def _request_seed(tp: int, rank: int) -> int:
    return 7 + rank // tp  # side-by-side TP groups serve different requests


def _tp_dcp_rank(rank, world, family):
    import dsa_dcp
    from dsa_dcp.topology import tp_dcp_groups

    results = {}
    for (tp, dcp), merges in CASES[family].items():
        groups = tp_dcp_groups(tp, dcp)
        cfg, batch = _setup(family, _request_seed(tp, rank))
        full = DSAModel(cfg, batch.num_slots, seed=11)
        for merge in merges:
            torch._dynamo.reset()
            model = DSAModel(cfg, batch.num_slots, dcp_size=dcp, seed=1, tp_size=tp, tp_group=groups.tp)
            model.load_unsharded(full)
            options = {"dcp_size": dcp, "merge": merge, "lowering": "fx", "group": groups.dcp}
            step = torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True, dynamic=False)
            with torch.no_grad():
                out = generate(step, batch, STEPS, pad_to=ROWS)
            results[tp, dcp, merge] = {"tokens": out.tokens, "logits": out.step_logits,
                                       "kv_rows": [c.shape[0] for c in model.kv_caches()],
                                       "stats": dsa_dcp.backend_report().stats()["dcp_rewrite"]}
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
        for (tp, dcp, merge), got in results.items():
            what = (family, f"tp{tp}", f"dcp{dcp}", merge, rank)
            ref, tp_alone_rows = refs[_request_seed(tp, rank)]
            assert got["tokens"] == ref.tokens, what
            assert len(got["logits"]) == len(ref.step_logits), what
            for a, b in zip(got["logits"], ref.step_logits):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, what
            assert got["stats"]["tp_layers"] == LAYERS[family], what
            assert got["kv_rows"] == [tp_alone_rows // dcp] * LAYERS[family], what  # 1/N of TP alone's rows


class _SummedLogits(torch.nn.Module):
    """A DCP model followed by a collective the rewrite has no place for (a sum of the logits)."""

    def __init__(self, model, group_name):
        super().__init__()
        self.model, self.group_name = model, group_name

    def forward(self, *inputs):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.model(*inputs), "sum", self.group_name)


def _refused_rank(rank, world):
    import torch.distributed as dist

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)  # refused before any layer matters
    batch = standard_test_batch(cfg, max_new_tokens=1, seed=7)
    errors = {}

    def compile_error(model, options, ranks):
        torch._dynamo.reset()
        if rank not in ranks:
            return None
        try:
            with torch.no_grad():
                generate(torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True), batch, 1,
                         pad_to=ROWS)
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            return str(e)
        return "compiled"

    # TP groups {0, 1}, {2, 3}; DCP groups {0, 2}, {1, 3}: each DCP group spans both TP groups
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    model = DSAModel(cfg, batch.num_slots, dcp_size=2, seed=1, tp_size=2, tp_group=tp)
    errors["across"] = compile_error(model, {"dcp_size": 2, "group": across, "lowering": "fx"}, range(4))
    # a plain DCP model whose logits are summed over the world: no TP layer, one collective
    model = _SummedLogits(DSAModel(cfg, batch.num_slots, dcp_size=4, seed=1), dist.group.WORLD.group_name)
    errors["unplaced"] = compile_error(model, {"dcp_size": 4, "lowering": "fx"}, range(4))
    # TP 4 with a DCP group of 3 ranks: 3 does not divide 4 (the check itself: rank 3 is no member)
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        from dsa_dcp.passes.tensor_parallel import TPSite, group_problems

        site = TPSite(dist.group.WORLD.group_name, 4, None)
        errors["not_dividing"] = group_problems(site, three.group_name, 3, "")
    return errors


def test_tp_layouts_the_rewrite_cannot_run_are_refused_at_compile_time():
    ranks = run_on_ranks(_refused_rank, 4, timeout=300)
    for rank, errors in enumerate(ranks):
        assert "the DCP group (global ranks" in errors["across"] and "is not part of the layer's TP group" \
            in errors["across"], (rank, errors["across"])
        assert "tp_dcp_groups(tp_size, dcp_size)" in errors["across"]
        assert "the model's graph has collectives the DCP rewrite cannot place" in errors["unplaced"], errors["unplaced"]
    for rank in range(3):
        assert ranks[rank]["not_dividing"] == ["dcp_size=3 does not divide the TP size 4: DCP groups split a TP group "
                                               "evenly"]


def _groups_rank(rank, world):
    import torch.distributed as dist

    from dsa_dcp.topology import tp_dcp_groups

    out = {}
    for tp, dcp in ((4, 2), (4, 4), (2, 2), (2, 1)):
        g = tp_dcp_groups(tp, dcp)
        out[tp, dcp] = (dist.get_process_group_ranks(g.tp), dist.get_process_group_ranks(g.dcp))
    for bad in ((3, 1), (4, 3)):
        try:
            tp_dcp_groups(*bad)
        except ValueError as e:
            out[bad] = str(e)
    return out


def test_tp_dcp_groups_tile_the_world():
    ranks = run_on_ranks(_groups_rank, 4)
    assert ranks[2][4, 2] == ([0, 1, 2, 3], [2, 3]) and ranks[1][4, 4] == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert ranks[3][2, 2] == ([2, 3], [2, 3]) and ranks[2][2, 1] == ([2, 3], [2])
    assert "tp_size=3 does not divide the world of 4 rank(s)" in ranks[0][3, 1]
    assert "dcp_size=3 does not divide tp_size=4" in ranks[0][4, 3]
