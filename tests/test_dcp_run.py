"""The several-GPU run script, exercised on gloo CPU ranks (its correctness part)."""

from dsa_dcp.bench.dcp_run import RunSpec, check_correctness
from dsa_dcp.launch import run_on_ranks


def _rank(rank, world):
    return list(check_correctness(rank, world, RunSpec(device="cpu", merges=("ag_rs", "fused_a2a"), steps=4, tiny_only=True)))


def test_run_script_correctness_part_on_cpu_ranks():
    for rows in run_on_ranks(_rank, 2):
        assert [r["merge"] for r in rows] == ["ag_rs", "fused_a2a"]
        for r in rows:
            assert r["model"] == "glm5.2-tiny" and r["N"] == 2
            assert r["tokens_match"], r
            assert r["max_rel_logit_err"] < 1e-5, r
            assert r["kv_rows_per_rank"] == r["kv_rows_expected"]
