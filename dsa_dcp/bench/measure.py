"""How the benches time a kernel, and what they print beside the times.

- :func:`median_us`: ``triton.testing.do_bench``'s median over launches from Python (CUDA events,
  warm, L2 flushed before each call), in microseconds. For small kernels this is the host's launch
  cost, not the GPU's.
- :func:`in_graph_us`: calls captured back to back in one CUDA graph, replayed, time per call:
  what a captured decode step pays.
- :func:`device_limits`: the device's own copy bandwidth and bf16 matrix rate, the ceilings
  beside a kernel's rates; :func:`versions`: the software the numbers were measured with.

Every bench (``dsa-dcp bench kernels``, its ``--tune``, ``dsa-dcp bench indexer``) times through
these, so their numbers compare.
"""

from __future__ import annotations

import importlib.util

import torch

GRAPH_CALLS = 20  # calls of one callable captured in a graph: the per-call time, not a replay's launch
L2_BYTES = 50 << 20  # the H200's L2 is 50 MB (60 MB on the die, 50 MB enabled)


def median_us(fn, rep: int = 100) -> float:
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=max(rep // 4, 5), rep=rep, return_mode="median")


def in_graph_us(fns, rep: int = 100) -> float:
    """Time per call of ``fns`` (a callable, or a list called in turn) captured in one CUDA graph."""
    calls = [fns] * GRAPH_CALLS if callable(fns) else list(fns)
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return median_us(graph.replay, rep) / len(calls)


def device_limits() -> dict:
    """This device's copy bandwidth (2 GiB device to device, bytes read + written) and bf16
    matrix rate (8192^3 on random data), measured once: the ceilings beside the kernel rates."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_us = median_us(lambda: dst.copy_(src), rep=200)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = median_us(lambda: a @ b, rep=200)
    return {"copy_GBps": 2 * (2 << 30) / copy_us / 1e3, "bf16_mm_TFLOPS": 2 * 8192**3 / mm_us / 1e6}


def versions() -> dict:
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__}
    if importlib.util.find_spec("flashinfer") is not None:
        import flashinfer

        v["flashinfer"] = flashinfer.__version__
    return v


def print_rows(rows, json_path: str | None, table) -> list[dict]:
    """Print each row of a bench as one JSON line while it is measured (rewriting ``json_path``
    after each, so a run cut short keeps what it measured), then ``table(rows)``; returns the rows."""
    import json

    done = []
    for row in rows:
        done.append(row)
        print(json.dumps(row), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(done, f, indent=1)
    print(table(done))
    return done
