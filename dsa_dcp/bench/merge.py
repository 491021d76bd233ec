"""``dsa-dcp bench merge``: the fused a2a merge against pack + exchange + combine.

Only one GPU is lent, so N ranks are emulated in one process on one GPU: every rank's buffers
live there and each rank's work goes on its own CUDA stream, so the N ranks' kernels run
concurrently as they would on N GPUs (the fused kernels wait on each other's flags). The GPU's
bandwidth and SMs are shared by the N ranks, so times are pessimistic for large batches; for
small batches (latency-bound) they show what a launch costs.

- fused: one ``fused_a2a_merge`` launch per rank.
- unfused: per rank ``pack_head_groups`` (torch), the exchange as N device copies of the packed
  slices into the receivers' buffers (what an all-to-all moves; NCCL cannot run two ranks on one
  GPU), a cross-stream join, ``unpack`` and ``lse_combine`` (Triton).

Both are checked against the reference, then timed per merge (all N ranks) with CUDA events
around 20 merges launched on the streams, median of 5 (launch costs included in both). Not in a
CUDA graph: a graph may run independent branches one after another, and N fused kernels that
wait on each other's flags would then never finish.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from dsa_dcp.head_groups import lse_words, pack_head_groups, unpack_head_groups
from dsa_dcp.kernels.fused_merge import MergeWorkspace, fused_a2a_merge_reference, fused_a2a_merge_triton
from dsa_dcp.kernels.lse_combine import lse_combine_triton

REPEAT = 20


def _time_streams(fn) -> float:
    """Median microseconds per call of ``fn`` (which forks and joins its streams on the current one)."""
    main = torch.cuda.current_stream()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for _ in range(REPEAT):
            fn()
        end.record(main)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return statistics.median(times)


def bench_case(n: int, b: int, heads_per_rank: int, d: int = 512, dtype=torch.bfloat16) -> dict:
    h = heads_per_rank * n
    buffers = [MergeWorkspace.buffers(n, max(b, 1), h, d, dtype, "cuda") for _ in range(n)]
    workspaces = [MergeWorkspace.from_buffers(r, buffers) for r in range(n)]
    outs = [torch.randn(b, h, d, device="cuda").to(dtype) for _ in range(n)]
    lses = [torch.randn(b, h, device="cuda") for _ in range(n)]
    recv = [torch.empty(n, b, heads_per_rank, d + lse_words(dtype), dtype=dtype, device="cuda") for _ in range(n)]
    streams = [torch.cuda.Stream() for _ in range(n)]
    main = torch.cuda.current_stream()
    results: list = [None] * n

    def fused():
        for s in streams:
            s.wait_stream(main)
        for r in range(n):
            with torch.cuda.stream(streams[r]):
                results[r] = fused_a2a_merge_triton(outs[r], lses[r], workspaces[r])
        for s in streams:
            main.wait_stream(s)

    def unfused():
        for s in streams:
            s.wait_stream(main)
        for r in range(n):
            with torch.cuda.stream(streams[r]):
                packed = pack_head_groups(outs[r], lses[r], n)
                for j in range(n):
                    recv[j][r].copy_(packed[j], non_blocking=True)
        for s in streams:  # the exchange completes everywhere before anyone combines
            main.wait_stream(s)
        for s in streams:
            s.wait_stream(main)
        for r in range(n):
            with torch.cuda.stream(streams[r]):
                o, l = unpack_head_groups(recv[r], d)
                results[r] = lse_combine_triton(o, l)
        for s in streams:
            main.wait_stream(s)

    for name, fn in (("fused", fused), ("unfused", unfused)):
        fn()
        torch.cuda.synchronize()
        for r in range(n):
            ref_out, ref_lse = fused_a2a_merge_reference([o.float() for o in outs], lses, r)
            torch.testing.assert_close(results[r][0].float(), ref_out, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(results[r][1], ref_lse, rtol=1e-3, atol=1e-3)
    row = {"n": n, "batch": b, "heads_per_rank": heads_per_rank, "head_dim": d,
           "fused_us": _time_streams(fused), "unfused_us": _time_streams(unfused)}
    row["unfused_over_fused"] = row["unfused_us"] / row["fused_us"]
    return row


def run_merge_bench(ns=(2, 4, 8), batches=(1, 8, 32, 128), heads: int = 64) -> list[dict]:
    rows = []
    for b in sorted(batches):
        for n in ns:
            rows.append(bench_case(n, b, heads // n))
            print(f"# N={n} B={b}: fused {rows[-1]['fused_us']:.1f} us, unfused {rows[-1]['unfused_us']:.1f} us",
                  file=sys.stderr, flush=True)
    return rows


def format_merge_table(rows: list[dict]) -> str:
    lines = ["| N | batch | heads per rank | fused us | unfused us | unfused / fused |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['batch']} | {r['heads_per_rank']} | {r['fused_us']:.1f} | "
                     f"{r['unfused_us']:.1f} | {r['unfused_over_fused']:.2f}x |")
    return "\n".join(lines)


def main(args) -> int:
    rows = run_merge_bench(tuple(args.dcp), tuple(args.batches), args.heads)
    print(format_merge_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
