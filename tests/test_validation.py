"""Compile-time validation (one test per rule) and the run-time debug checks."""

import socket

import pytest
import torch

import dsa_dcp
from dsa_dcp.inspection.targets import fake_group as fake_pg
from dsa_dcp.launch import run_on_ranks
from dsa_dcp.backend import DCPCompileWarning
from dsa_dcp.validate import DCPValidationError

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)

S, B, H, DC, DR, K = 24, 3, 4, 8, 4, 5
SPARSE_MLA = torch.ops.dsa_dcp.sparse_mla.default
KV_STORE = torch.ops.dsa_dcp.kv_store.default


def step(q_nope, q_pe, cache, topk, slots, rows):
    KV_STORE(cache, slots, rows)
    out, lse = SPARSE_MLA(q_nope, q_pe, cache, topk, 0.5)
    return out


def step_with_stray_write(q_nope, q_pe, cache, topk, slots, rows):
    cache.mul_(1.0)  # a write the rewrite cannot localize
    return step(q_nope, q_pe, cache, topk, slots, rows)


def _inputs(cache, seed=0, heads=H):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(-1, S, (B, K), generator=g)
    return (torch.randn(B, heads, DC, generator=g), torch.randn(B, heads, DR, generator=g), cache, topk,
            torch.randint(-1, S, (B,), generator=g), torch.randn(B, DC + DR, generator=g))


@pytest.fixture
def fake_group():
    with fake_pg(2):
        yield


def _problems(fn, options, cache, heads=H):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="dsa_dcp", options=options, fullgraph=True)
    with pytest.raises(Exception) as err:
        compiled(*_inputs(cache, heads=heads))
    cause = err.value
    while not isinstance(cause, DCPValidationError) and cause is not None:
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert isinstance(cause, DCPValidationError), repr(err.value)
    return cause.problems


def _local_cache(dtype=torch.float32, dcp_size=2, interleave=1):
    return dsa_dcp.allocate_kv_cache(S, DC + DR, dcp_size=dcp_size, interleave=interleave, dtype=dtype)


def test_rule_group_size(fake_group):
    (p,) = _problems(step, {"dcp_size": 4, "merge": "ag"}, _local_cache(dcp_size=4))
    assert p == "dcp_size=4 but the DCP process group has 2 ranks; they must be equal"


def test_rule_rank(fake_group):
    (p,) = _problems(step, {"dcp_size": 2, "rank": 1, "merge": "ag"}, _local_cache())
    assert p == "option rank=1 but this process is rank 0 of the DCP group"


def test_rule_heads(fake_group):
    problems = _problems(step, {"dcp_size": 2, "merge": "ag_rs"}, _local_cache(), heads=3)
    assert any("merge='ag_rs' shards heads over the group, but" in p and "has 3 heads, not divisible by "
               "dcp_size=2; use merge='ag'" in p for p in problems)


def test_rule_epilogue_falls_back_to_ag_with_a_warning(fake_group):
    """A layer whose epilogue a head-sharded merge cannot shard merges with ag, and says so once."""
    from dsa_dcp.backend import forget_compile_history

    torch._dynamo.reset()
    forget_compile_history()  # earlier tests compiled `step` for these shapes: no "compiled again" warning
    compiled = torch.compile(step, backend="dsa_dcp", options={"dcp_size": 2, "merge": "a2a", "lowering": "fx"},
                             fullgraph=True)
    with pytest.warns(DCPCompileWarning) as caught:
        compiled(*_inputs(_local_cache()))
    (w,) = [w for w in caught if issubclass(w.category, DCPCompileWarning)]
    assert "merge='a2a' cannot shard sparse_mla_default by heads: its output does not feed a per-head " \
           "up-projection" in str(w.message) and "this layer merges with 'ag'" in str(w.message)
    report = dsa_dcp.backend_report()
    assert report.stats()["dcp_rewrite"]["layers_merged_with_ag"] == ["sparse_mla_default"]
    assert report.summary["collectives"] == 1  # the all-gather; no all-to-all, no all-reduce


def test_rule_kv_layout(fake_group):
    (p,) = _problems(step, {"dcp_size": 2, "merge": "ag"}, _local_cache(dcp_size=1))
    assert "was allocated for dcp_size=1, interleave=1 (24 rows for 24 slots) but compiled for dcp_size=2" in p
    plain = torch.zeros(S // 2, DC + DR)
    (p,) = _problems(step, {"dcp_size": 2, "merge": "ag"}, plain)
    assert "was not allocated by dsa_dcp.allocate_kv_cache, so its slot layout is unknown" in p


def test_rule_kv_dtype(fake_group):
    (p,) = _problems(step, {"dcp_size": 2, "merge": "ag"}, _local_cache(dtype=torch.float64))
    assert "has dtype torch.float64; supported: ['bfloat16', 'float16', 'float32', 'float8_e4m3fn']" in p
    # FP8 E4M3 is supported when kv_store writes it with its scale: tests/test_fp8_kv.py (its refusals too)


def test_rule_kv_writes(fake_group):
    (p,) = _problems(step_with_stray_write, {"dcp_size": 2, "merge": "ag"}, _local_cache())
    assert "is used by" in p and "mul_" in p and "which the DCP rewrite cannot localize" in p


def test_rule_interleave_page(fake_group):
    (p,) = _problems(step, {"dcp_size": 2, "merge": "ag", "interleave": 4, "page_size": 6},
                     _local_cache(interleave=4))
    assert p == ("interleave=4 must divide page_size=6: a page's tokens are spread over the ranks in whole "
                 "interleave blocks")


def test_rule_cuda_graphs_on_cpu():
    (p,) = _problems(step, {"cuda_graphs": True}, _local_cache(dcp_size=1))
    assert p == "cuda_graphs=True, but the compiled step runs on the CPU; CUDA graphs need CUDA tensors"


def test_rule_debug_checks_need_fx_lowering():
    (p,) = _problems(step, {"debug_checks": True, "lowering": "inductor"}, _local_cache(dcp_size=1))
    assert p.startswith("debug_checks synchronize with the host")


def test_rule_merge_device(fake_group):
    from torch.distributed.distributed_c10d import _get_default_group

    from dsa_dcp.kernels.fused_merge import unavailable_reason

    reason = unavailable_reason(_get_default_group().group_name)
    assert reason == "the group's backend is 'fake'; symmetric memory needs NCCL with one GPU per rank"


def test_rule_graph_capture():
    """A gloo group's CUDA collectives cannot be captured: the step must be compiled without
    graphs; NCCL's (and a fake group's, which launch nothing) can. On a GPU:
    tests/test_unmodified_models.py::test_transformers_model_in_bf16_on_two_ranks_sharing_one_gpu."""
    from dsa_dcp.validate import graph_capture_problem

    problem = graph_capture_problem("gloo")
    assert problem.startswith("the DCP group's backend is 'gloo': its collectives on CUDA tensors go through the host")
    assert "compile with cuda_graphs=False" in problem
    assert graph_capture_problem("nccl") is None and graph_capture_problem("fake") is None


def test_all_problems_are_reported_together(fake_group):
    problems = _problems(step_with_stray_write, {"dcp_size": 2, "merge": "a2a", "interleave": 2, "page_size": 3},
                         _local_cache(dtype=torch.float64), heads=3)
    assert len(problems) == 5, problems  # page size, heads, layout, dtype, stray write


def _multi_host_rank(rank, world, allow):
    real = socket.gethostname
    socket.gethostname = lambda: f"host{rank}"  # each rank pretends to be on its own machine
    torch._dynamo.reset()
    cache = _local_cache()
    compiled = torch.compile(step, backend="dsa_dcp", fullgraph=True,
                             options={"dcp_size": world, "merge": "ag", "allow_multi_host": allow, "lowering": "fx"})
    try:
        compiled(*_inputs(cache))
    except Exception as e:  # noqa: BLE001
        return str(e)
    finally:
        socket.gethostname = real  # a kept rank runs the next test next
    return "ok"


def test_rule_multi_host():
    refused = run_on_ranks(_multi_host_rank, 2, False)
    assert all("the DCP group spans 2 hosts (['host0', 'host1'])" in r for r in refused)
    assert all("Set allow_multi_host=True to compile it anyway" in r for r in refused)
    assert run_on_ranks(_multi_host_rank, 2, True) == ["ok", "ok"]


def _debug_rank(rank, world, case):
    torch._dynamo.reset()
    cache = _local_cache()
    args = list(_inputs(cache, seed=1))
    if case == "range":
        args[3][1, 2] = S + 5
    elif case == "differ" and rank == 1:
        args[3][2, 0] = (args[3][2, 0] + 1) % S
    compiled = torch.compile(step, backend="dsa_dcp", fullgraph=True,
                             options={"dcp_size": world, "merge": "ag", "debug_checks": True, "lowering": "fx"})
    try:
        compiled(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("case", ["range", "differ", "same"])
def test_debug_checks_name_layer_and_row(case):
    results = run_on_ranks(_debug_rank, 2, case, timeout=120)
    if case == "range":
        assert all("DCPRuntimeCheckError: layer 0: row 1 holds top-k slot 29 at position 2, outside [-1, 24)" in r
                   for r in results)
    elif case == "differ":  # a top-k the step is given is a step input: caught before any collective
        assert all(r.startswith("DCPRuntimeCheckError: the ranks of the DCP group were given different step inputs: "
                                "L['topk'] differs on ranks [1] from rank 0's (first at index (2, 0): rank 1 has ")
                   for r in results), results
    else:
        assert results == ["ok", "ok"]
