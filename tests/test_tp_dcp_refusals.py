"""DCP inside tensor parallelism: the layouts the rewrite refuses at compile time (a DCP group across
TP groups, N not dividing T, a collective it cannot place, query weights ``replicate_q`` cannot
find), ``tp_dcp_groups``' layout, and DTensor parameters. One launch of 4 gloo ranks of their own
(no kept ranks: the refusals leave groups half-used) runs every part, the layouts and the DTensor
program before the refusals; each test asserts on its part (starting ranks is most of the cost)."""

import pytest
import torch

from dsa_dcp.launch import run_on_ranks
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch
from dsa_dcp.models.dsa import MLAAttention


ROWS = 16


class _SummedLogits(torch.nn.Module):
    """A DCP model followed by a collective the rewrite has no place for (a sum of the logits)."""

    def __init__(self, model, group_name):
        super().__init__()
        self.model, self.group_name = model, group_name

    def forward(self, *inputs):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.model(*inputs), "sum", self.group_name)


class _ComputedQueryWeight(MLAAttention):
    """An attention whose query up-projection weight is computed each step (a flip of the parameter),
    not read: ``replicate_q`` cannot hold another rank's copy of it."""

    @property
    def wq_b(self):
        return self._parameters["wq_b"].flip(0)


def _refused_rank(rank, world):
    import torch.distributed as dist

    cfg = get_config("deepseek-v3.2-tiny", n_layers=1)  # refused before any layer matters
    batch = standard_test_batch(cfg, max_new_tokens=1, seed=7)
    errors = {}

    def run_error(step):
        try:
            with torch.no_grad():
                generate(step, batch, 1, pad_to=ROWS)
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            return str(e)
        return "compiled"

    def compile_error(model, options):
        torch._dynamo.reset()
        return run_error(torch.compile(model, backend="dsa_dcp", options=options, fullgraph=True))

    # TP groups {0, 1}, {2, 3}; DCP groups {0, 2}, {1, 3}: each DCP group spans both TP groups
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    model = DSAModel(cfg, batch.num_slots, dcp_size=2, seed=1, tp_size=2, tp_group=tp)
    errors["across"] = compile_error(model, {"dcp_size": 2, "group": across, "lowering": "fx"})
    # replicate_q with a query weight that is computed, not a parameter: refused, and compiles without it
    # (the model traced once, compiled with replicate_q as default and off: tests/one_trace.py)
    from one_trace import OneTrace

    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    model = DSAModel(cfg, batch.num_slots, dcp_size=2, seed=1, tp_size=2, tp_group=pair)
    model.layers[0].attn.__class__ = _ComputedQueryWeight
    options = {"dcp_size": 2, "group": pair, "lowering": "fx"}
    backend = OneTrace({"computed_query": options, "computed_query_gathered": {**options, "replicate_q": False}})
    torch._dynamo.reset()
    step = torch.compile(model, backend=backend, fullgraph=True)
    for case in backend.option_sets:
        backend.select(case)
        model.reset_caches()
        errors[case] = run_error(step)
    # a plain DCP model whose logits are summed over the world: no TP layer, one collective
    model = _SummedLogits(DSAModel(cfg, batch.num_slots, dcp_size=4, seed=1), dist.group.WORLD.group_name)
    errors["unplaced"] = compile_error(model, {"dcp_size": 4, "lowering": "fx"})
    # TP 4 with a DCP group of 3 ranks: 3 does not divide 4 (the check itself: rank 3 is no member)
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        from dsa_dcp.passes.tensor_parallel import TPSite, group_problems

        site = TPSite(dist.group.WORLD.group_name, 4, None)
        errors["not_dividing"] = group_problems(site, three.group_name, 3)
    return errors


def _all_parts_rank(rank, world):
    return {"groups": _groups_rank(rank, world), "dtensor": _dtensor_rank(rank, world),
            "refused": _refused_rank(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results of every part, from one launch of 4 ranks."""
    return run_on_ranks(_all_parts_rank, 4, timeout=300)


def test_tp_layouts_the_rewrite_cannot_run_are_refused_at_compile_time(ranks):
    ranks = [r["refused"] for r in ranks]
    for rank, errors in enumerate(ranks):
        assert "the DCP group (global ranks" in errors["across"] and "is not part of the layer's TP group" \
            in errors["across"], (rank, errors["across"])
        assert "tp_dcp_groups(tp_size, dcp_size)" in errors["across"]
        assert "the model's graph has collectives the DCP rewrite cannot place" in errors["unplaced"], errors["unplaced"]
        assert "replicate_q: the query weights of" in errors["computed_query"], errors["computed_query"]
        assert "is computed (flip), not a parameter or buffer" in errors["computed_query"], errors["computed_query"]
        problems = [line for line in errors["computed_query"].splitlines() if "replicate_q:" in line]
        assert len(problems) == 1 and problems[0].endswith("; compile with replicate_q=False"), errors["computed_query"]
        assert "cannot place" not in errors["computed_query"], errors["computed_query"]  # the one problem
        assert errors["computed_query_gathered"] == "compiled", errors["computed_query_gathered"]
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


def test_tp_dcp_groups_tile_the_world(ranks):
    ranks = [r["groups"] for r in ranks]
    assert ranks[2][4, 2] == ([0, 1, 2, 3], [2, 3]) and ranks[1][4, 4] == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert ranks[3][2, 2] == ([2, 3], [2, 3]) and ranks[2][2, 1] == ([2, 3], [2])
    assert "tp_size=3 does not divide the world of 4 rank(s)" in ranks[0][3, 1]
    assert "dcp_size=3 does not divide tp_size=4" in ranks[0][4, 3]


class _DTensorScale(torch.nn.Module):
    """A step whose parameter is a DTensor, as transformers' ``tp_plan`` and
    ``torch.distributed.tensor.parallel`` make them."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.scale = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))

    def forward(self, x):
        return x * self.scale.to_local()


def _dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    model = _DTensorScale(init_device_mesh("cpu", (world,)))
    out = {}
    for dcp_size in (world, 1):
        torch._dynamo.reset()
        step = torch.compile(model, backend="dsa_dcp", options={"dcp_size": dcp_size, "lowering": "fx"},
                             fullgraph=True)
        try:
            with torch.no_grad():
                out[dcp_size] = step(torch.full((4,), 2.0)).tolist()
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            out[dcp_size] = str(e)
    return out


def test_a_dcp_program_whose_parameters_are_dtensors_is_refused_at_compile_time(ranks):
    """A DCP group of the world's 4 ranks (dcp_size=4) whose parameter is a DTensor over them."""
    for got in (r["dtensor"] for r in ranks):
        assert "1 input(s) of the step are DTensors (l_self_parameters_scale_)" in got[4], got[4]
        assert "DCP does not run inside DTensor tensor parallelism" in got[4], got[4]
        assert got[1] == [2.0] * 4  # dcp_size=1: no DCP, the model runs as written
