"""The several-GPU run script, exercised on gloo CPU ranks (its correctness part)."""

import pytest

from dsa_dcp.bench.dcp_run import RunSpec, check_correctness, check_transformers, failed_checks, topology_problem
from dsa_dcp.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("kept_ranks")  # many short gloo runs: kept ranks (conftest.py)


def _rank(rank, world):
    return list(check_correctness(rank, world, RunSpec(device="cpu", merges=("fused_a2a",), steps=4, tiny_only=True,
                                                       lowering="fx", tiny_layers=8)))


def _tp_rank(rank, world):
    rows = []
    for replicate_q in (True, False):
        rows += check_correctness(rank, world, RunSpec(device="cpu", merges=("a2a",), steps=3, tiny_only=True,
                                                       lowering="fx", tiny_layers=2, tp=2, dcp=2,
                                                       replicate_q=replicate_q))
    return rows


def _mtp_rank(rank, world):
    from dsa_dcp.bench.dcp_run import check_speculative

    spec = RunSpec(device="cpu", merges=("a2a",), steps=4, tiny_only=True, lowering="fx", tiny_layers=2, mtp=2,
                   kv_dtype="fp8")
    return list(check_speculative(rank, world, spec))


def _hf_rank(rank, world):
    # 2 layers: GLM-5's layer 1 shares layer 0's top-k (tests/test_unmodified_models.py covers more)
    spec = RunSpec(device="cpu", merges=("fused_a2a",), steps=3, tiny_only=True, lowering="fx", tiny_layers=2)
    return list(check_transformers(rank, world, spec))


@pytest.mark.slow
def test_run_script_transformers_part_on_cpu_ranks():
    """transformers' models under DCP against one rank, as the several-GPU run checks them."""
    for rows in run_on_ranks(_hf_rank, 2):
        assert [(r["model"], r["merge"]) for r in rows] == [
            (m, "fused_a2a") for m in ("deepseek_v32", "glm_moe_dsa")]
        for r in rows:
            assert r["dtype"] == "float32" and r["N"] == 2
            assert r["tokens_match"], r
            assert r["rel_logit_err"] < 1e-5, r
            assert len(r["tokens"]) == 3 and all(len(t) == 3 for t in r["tokens"])


@pytest.mark.slow
def test_run_script_correctness_part_on_cpu_ranks():
    for rows in run_on_ranks(_rank, 2):
        assert [r["merge"] for r in rows] == ["fused_a2a"]  # every merge: tests/test_dcp.py
        for r in rows:
            assert r["model"] == "glm5.2-tiny" and r["N"] == 2
            assert r["tokens_match"], r
            assert r["max_rel_logit_err"] < 1e-5, r
            assert r["kv_rows_per_rank"] == r["kv_rows_expected"]


@pytest.mark.slow
def test_run_script_correctness_part_with_dcp_inside_tp_on_cpu_ranks():
    """``--tp 2 --dcp 2`` with and without ``--replicate-q``: the unsharded single-device model's tokens."""
    for rows in run_on_ranks(_tp_rank, 2):
        assert [(r["tp"], r["N"], r["merge"], r["replicate_q"]) for r in rows] == [
            (2, 2, "a2a", True), (2, 2, "a2a", False)]
        for r in rows:
            assert r["tokens_match"], r
            assert r["max_rel_logit_err"] < 1e-5, r
            assert r["kv_rows_per_rank"] == r["kv_rows_expected"], r


def test_run_script_topology_is_checked_against_the_world():
    assert topology_problem(4, 2, 2) is None and topology_problem(4, 4, None) is None
    assert topology_problem(2, 1, None) is None
    assert topology_problem(4, 3, None) == "--tp 3 does not divide the world of 4 rank(s)"
    assert topology_problem(4, 4, 3) == "--dcp 3 does not divide --tp 4: DCP groups split a TP group evenly"
    assert topology_problem(4, 1, 2) == "without TP the DCP group is the world: --dcp 2 in a world of 4"


def test_run_script_mtp_part_on_cpu_ranks():
    """``--mtp K --kv-dtype fp8``: speculative decoding with the draft whole on every rank, FP8 KV and
    index keys, against one rank (the part without FP8: tests/test_mtp.py)."""
    for rows in run_on_ranks(_mtp_rank, 2):
        assert [(r["merge"], r["draft_length"], r["kv_dtype"], r["kv_cache_dtype"], r["index_cache_dtype"])
                for r in rows] == [("a2a", 2, "fp8", "float8_e4m3fn", "float8_e4m3fn")]
        for r in rows:
            assert r["tokens_match"] and r["drafts_match"] and r["accepted_match"], r
            assert r["accept_length"] == r["ref_accept_length"] and 1 <= r["accept_length"] <= 3
            assert r["max_rel_logit_err"] < 1e-5, r
            assert r["kv_rows_per_rank"] == r["kv_rows_expected"]
            assert r["draft_kv_rows"] == r["draft_kv_rows_expected"] and r["draft_cache_same_as_rank0"]


def test_failed_checks_name_the_part_row_and_check():
    """What rank 0 prints for every rank (a rank whose own rows fail fails the run everywhere)."""
    good = {"tokens_match": True, "drafts_match": True, "accepted_match": True, "draft_cache_same_as_rank0": True,
            "kv_rows_per_rank": 4, "kv_rows_expected": 4, "model": "m", "merge": "a2a"}
    results = {"correctness": [dict(good), dict(good, fused_kernel=False)],
               "mtp": [dict(good, draft_cache_same_as_rank0=False, kv_rows_per_rank=5)], "transformers": [{}]}
    assert failed_checks(results) == ["correctness row 1 (m, a2a): fused_kernel",
                                      "mtp row 0 (m, a2a): draft_cache_same_as_rank0", "mtp row 0 (m, a2a): kv_rows"]
    assert failed_checks({"correctness": [good], "mtp": [good]}) == []


def test_step_kernel_time_is_split_by_what_dcp_adds():
    from dsa_dcp.bench.kinds import kernel_us_by_kind

    kernels = [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 30.0), ("_topk_remap_kernel", 6.0),
               ("_lse_combine_kernel", 3.0), ("_sparse_mla_kernel", 60.0), ("_fused_a2a_merge_kernel", 9.0),
               ("ampere_bf16_s16816gemm", 90.0), ("triton_poi_fused_add_0", 6.0),
               ("void at::native::sbtopk::gatherTopK<float>", 12.0), ("radixSortKVInPlace", 3.0),
               ("_topk_segment_kernel", 3.0)]
    got = kernel_us_by_kind(kernels, runs=3)
    assert got == {"nccl_us": 10.0, "fused_merge_us": 3.0, "remap_us": 2.0, "combine_us": 1.0, "attention_us": 20.0,
                   "indexer_us": 6.0, "other_us": 32.0, "kernels_us": 74.0}


def test_step_top_kernels_sum_each_name_over_its_launches():
    import random

    from dsa_dcp.bench.kinds import top_kernels

    rng = random.Random(0)
    names = [f"k{i}" for i in range(6)]
    kernels = [(rng.choice(names), rng.uniform(0.5, 9.0)) for _ in range(60)]
    runs, n = 3, 4
    got = top_kernels(kernels, runs=runs, n=n)
    totals = {name: sum(us for k, us in kernels if k == name) for name in names}
    expected = sorted(totals, key=totals.get, reverse=True)[:n]
    assert [name for name, _, _ in got] == expected
    for name, us, count in got:
        assert abs(us - totals[name] / runs) < 1e-9
        assert count == sum(k == name for k, _ in kernels) / runs


def test_ranks_sharing_a_gpu_are_refused_what_needs_nccl_before_any_rank_starts(capsys):
    """``--backend gloo`` on CUDA runs the a2a merge without graphs; the rest is refused by name."""
    import pytest

    from dsa_dcp.bench.dcp_run import main

    for argv, message in [
        (["--device", "cuda", "--backend", "gloo", "--merges", "a2a", "ag"], "['ag'] need NCCL"),
        (["--device", "cuda", "--backend", "gloo", "--parts", "latency", "--merges", "a2a"], "['latency'] need NCCL"),
        (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--device", "cpu", "--parts", "mtp"], "--parts mtp needs --mtp K"),
        (["--device", "cpu", "--mtp", "0"], "--mtp needs a draft length >= 1, got 0"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
