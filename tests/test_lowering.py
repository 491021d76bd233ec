"""The default lowering (Inductor): compile once per (model, options, rank, group), cached across
processes; and on a GPU, the fused merge inside an Inductor-compiled, CUDA-graph-replayed step."""

import os
import time

import pytest
import torch

from dsa_dcp.launch import run_on_ranks


def _compile_in(rank, world, cache_dirs, options):
    """Compile and run one step of a tiny model with Inductor, caching in ``cache_dirs[rank]``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    from torch._dynamo.utils import counters

    from dsa_dcp.models import DSAModel, get_config

    cfg = get_config("glm5.2-tiny", n_layers=1)  # one layer: what is cached is the point, not its size
    model = DSAModel(cfg, 256, dcp_size=world, interleave=options.get("interleave", 1), seed=3)
    step = torch.compile(model, backend="dsa_dcp", options={"dcp_size": world, **options}, fullgraph=True,
                         dynamic=False)
    rows = torch.arange(4, dtype=torch.int64)
    counters.clear()
    start = time.perf_counter()
    with torch.no_grad():
        logits = step(rows, rows, torch.zeros_like(rows), rows, torch.arange(4, dtype=torch.int32)[None])
    seconds = time.perf_counter() - start
    return {"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
            "seconds": seconds, "logits": logits}


@pytest.mark.slow
def test_a_second_process_hits_inductors_cache_and_another_rank_misses(tmp_path):
    """The graph names the rank (and the options: tests/test_options.py checks the cache key covers
    them), so rank 1 in rank 0's cache misses."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    cold = run_on_ranks(_compile_in, 2, dirs, {"merge": "a2a"})
    assert all(r["miss"] >= 1 and r["hit"] == 0 for r in cold), cold
    # rank 0 again in its own cache: a hit; rank 1 in rank 0's cache: a miss (its graph names rank 1)
    warm = run_on_ranks(_compile_in, 2, [dirs[0], dirs[0]], {"merge": "a2a"})
    assert warm[0]["hit"] >= 1 and warm[0]["miss"] == 0, warm[0]
    assert warm[1]["miss"] >= 1 and warm[1]["hit"] == 0, warm[1]
    for a, b in zip(cold, warm):
        torch.testing.assert_close(a["logits"], b["logits"], rtol=0, atol=0)
    print(f"\ncompile + first step, rank 0: cold {cold[0]['seconds']:.1f} s, warm {warm[0]['seconds']:.1f} s")


# --------------------------------------------------------------------------- GPU: fused merge under Inductor


def _ipc_inductor_rank(rank, ws, n, h, d, dtype):
    from dsa_dcp.kernels import fused_merge
    from dsa_dcp.report import last_report

    group = "ipc-inductor"
    fused_merge.register_workspace(group, ws)

    def merge_step(out, lse):  # attention output -> this rank's head group, merged
        o, l = torch.ops.dsa_dcp.fused_a2a_merge(out * 1.0, lse, n, rank, group)
        return o.float() * 2.0, l

    step = torch.compile(merge_step, backend="dsa_dcp", options={"lowering": "inductor", "batch_sizes": [8]},
                         fullgraph=True, dynamic=False)
    results = []
    for i in range(4):  # replays: the kernel's epochs advance inside the captured graph
        g = torch.Generator().manual_seed(100 + i)
        outs = torch.randn(n, 8, h, d, generator=g).to(dtype)
        lses = torch.randn(n, 8, h, generator=g) * 3
        o, l = step(outs[rank].cuda(), lses[rank].cuda())
        torch.cuda.synchronize()
        results.append((o.cpu(), l.cpu(), outs, lses))
    return results, len(last_report().lowered.graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_fused_merge_inside_an_inductor_cuda_graph_across_processes(n):
    """N processes on one GPU (CUDA IPC workspaces): the fused merge node, compiled by Inductor and
    replayed from one CUDA graph per process, equals the LSE merge of every rank's head group."""
    from dsa_dcp.kernels import lse_combine_reference
    from dsa_dcp.kernels.ipc_harness import run_ipc_ranks

    h, d, dtype = 8 * n, 512, torch.bfloat16
    ranks = run_ipc_ranks(_ipc_inductor_rank, n, 64, h, d, dtype, n, h, d, dtype, timeout=120)
    g = h // n
    for rank, (results, graphs) in enumerate(ranks):
        assert graphs == 1
        for o, l, outs, lses in results:
            heads = slice(rank * g, (rank + 1) * g)
            ref_o, ref_l = lse_combine_reference(outs[:, :, heads].double(), lses[:, :, heads].float())
            torch.testing.assert_close(l.double(), ref_l.double(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(o.double(), 2.0 * ref_o.double(), rtol=2e-2, atol=2e-2)
