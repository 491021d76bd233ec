"""``dsa-dcp bench kernels``: each kernel against what a user would otherwise run.

Every variant is checked against the torch reference on the same inputs before it is timed.
Times are medians in microseconds, two ways (:mod:`dsa_dcp.bench.measure`):

- ``eager``: ``triton.testing.do_bench`` over launches from Python (CUDA events, warm, L2 flushed
  before each call). For small kernels this is the host's launch cost, not the GPU's.
- ``graph``: calls captured back to back in one CUDA graph, replayed, time per call. This is what
  a captured decode step pays. For ``sparse_mla`` the captured calls rotate over disjoint slices
  of a 1.2 GB KV cache (about 100 MB or more of distinct rows a replay, twice the H200's L2),
  so every call gathers rows that are not in L2 (:mod:`dsa_dcp.bench.mla_cases`).

Kernels:

- ``topk_remap``: ours (Triton) vs torch eager (``topk_remap_reference``); K = 2048. Beside it,
  the floor: one torch elementwise kernel (``add``) over the same top-k, in a graph, the least
  any kernel that reads the row and writes a row costs there.
- ``lse_combine``: ours vs torch eager; H/N heads of D = 512 (H = 64).
- ``sparse_mla``: our Triton decode kernel and the Hopper (Gluon) kernel
  (:mod:`dsa_dcp.kernels.sparse_mla_hopper`, where it can run; BF16 KV and FP8 E4M3 KV with a
  per-tensor scale) vs FlashInfer's MLA wrapper (fa2, fa3) used as sparse attention (page_size 1,
  kv_indices = the top-k; ``plan()`` outside the timed region, as a server plans once per step).
  "op" columns time the whole ``sparse_mla`` call through each backend as the op runs it
  uncaptured (FlashInfer's includes the index packing and ``plan()``, which syncs with the host).
  Beside each graph time: achieved TFLOPS (``2 B H K (576 + 512)`` FLOPs) and GB/s (the gathered
  KV rows, the queries and the output, each moved once); the device's own limits (a large
  device-to-device copy, a large bf16 matrix product) are measured once and printed with them.

``--tune`` (:mod:`dsa_dcp.bench.tune`) times Triton tile candidates per shape (in graph) and
each backend as the op (eager), and ``--write-table`` writes the winners for
:mod:`dsa_dcp.kernels.dispatch`.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

from dsa_dcp.bench.measure import device_limits, in_graph_us, median_us, versions
from dsa_dcp.bench.mla_cases import DC, SLOTS, MlaCase, check_mla, mla_cases


def _try_in_graph_us(fns, row: dict, key: str) -> None:
    try:
        row[key] = in_graph_us(fns)
    except Exception as e:  # a backend that cannot be captured: say so in the row
        torch.cuda.synchronize()
        row[key] = None
        row[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def bench_remap(batches=(1, 8, 32, 128), ns=(2, 4, 8), k=2048) -> list[dict]:
    from dsa_dcp.kernels import topk_remap_reference, topk_remap_triton

    rows = []
    for b in batches:
        for n in ns:
            topk = torch.randint(0, SLOTS, (b, k), device="cuda", dtype=torch.int32)
            topk[:, k - k // 8:] = -1
            ref = topk_remap_reference(topk, n, 1, 1)
            got = topk_remap_triton(topk, n, 1, 1)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
            ours = lambda: topk_remap_triton(topk, n, 1, 1)  # noqa: E731
            torch_ = lambda: topk_remap_reference(topk, n, 1, 1)  # noqa: E731
            row = _pair("topk_remap", {"B": b, "N": n, "K": k}, ours, torch_)
            # the floor: one elementwise kernel that reads the same top-k and writes as many bytes
            dst = torch.empty_like(topk)
            row["floor_graph_us"] = in_graph_us(lambda: torch.add(topk, 1, out=dst))
            rows.append(row)
    return rows


def _pair(kernel: str, shape: dict, ours, torch_) -> dict:
    row = {"kernel": kernel, **shape,
           "ours_us": median_us(ours), "ours_graph_us": in_graph_us(ours),
           "torch_us": median_us(torch_), "torch_graph_us": in_graph_us(torch_)}  # fmt: skip
    row["eager_speedup"] = row["torch_us"] / row["ours_us"]
    row["step_speedup"] = row["torch_us"] / row["ours_graph_us"]
    row["graph_speedup"] = row["torch_graph_us"] / row["ours_graph_us"]
    return row


def bench_combine(batches=(1, 8, 32, 128), ns=(2, 4, 8), heads=64, d=DC) -> list[dict]:
    from dsa_dcp.kernels import lse_combine_reference, lse_combine_triton

    rows = []
    for b in batches:
        for n in ns:
            out = torch.randn(n, b, heads // n, d, device="cuda", dtype=torch.bfloat16)
            lse = torch.randn(n, b, heads // n, device="cuda")
            ref, got = lse_combine_reference(out, lse), lse_combine_triton(out, lse)
            torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
            ours = lambda: lse_combine_triton(out, lse)  # noqa: E731
            torch_ = lambda: lse_combine_reference(out, lse)  # noqa: E731
            rows.append(_pair("lse_combine", {"B": b, "N": n, "H/N": heads // n, "D": d}, ours, torch_))
    return rows


def _rates(row: dict, name: str, case: "MlaCase") -> None:
    """TFLOPS and GB/s of backend ``name`` from its graph time."""
    us = row.get(f"{name}_graph_us")
    if us:
        row[f"{name}_TFLOPS"] = case.flops / us / 1e6
        row[f"{name}_GBps"] = case.bytes / us / 1e3


def _checked(name: str, fn, ref, row: dict) -> bool:
    """Check a backend against the reference; a wrong result is recorded in the row (and the
    backend not timed) rather than stopping the bench."""
    try:
        check_mla(name, fn(), ref)
        return True
    except AssertionError as e:
        row[f"{name}_error"] = f"wrong result: {e}"
        print(f"# {name} WRONG at {row['kv']} H={row['H']} B={row['B']} K={row['K']}: {e}", file=sys.stderr)
        return False


def bench_sparse_mla(heads=(64, 128), batches=(1, 8, 32, 128), ks=(512, 1024, 2048), kvs=("bf16", "fp8"),
                     backends=("triton", "hopper", "flashinfer"), eager: bool = True) -> list[dict]:
    """One row per shape; ``backends`` limits what is timed, ``eager=False`` times in graph only."""
    from dsa_dcp.kernels import sparse_mla_hopper

    have_fi = "flashinfer" in backends and importlib.util.find_spec("flashinfer") is not None
    have_hopper = "hopper" in backends and sparse_mla_hopper.available()
    timed = median_us if eager else (lambda fn: None)
    if not have_hopper:
        print(f"# hopper kernel not timed: {sparse_mla_hopper.unavailable_reason()}", file=sys.stderr)
    rows = []
    for case, ref in mla_cases(heads, batches, ks, kvs):
        kv, h, b, k = case.kv, case.h, case.b, case.k
        row = {"kernel": "sparse_mla", "H": h, "B": b, "K": k, "kv": kv, "bytes": case.bytes, "flops": case.flops}
        if "triton" in backends and _checked("triton", case.triton(), ref, row):
            row["triton_us"] = timed(case.triton())
            row["triton_graph_us"] = in_graph_us([case.triton(v) for v in range(case.views)])
        if have_hopper and _checked("hopper", case.hopper(), ref, row):
            row["hopper_us"] = timed(case.hopper())
            row["hopper_graph_us"] = in_graph_us([case.hopper(v) for v in range(case.views)])
        if have_fi and kv == "bf16":
            for backend in ("fa2", "fa3"):
                runs = case.flashinfer_runs(backend, graph=False)
                check_mla(backend, runs[0](), ref, lse_base2=True)
                row[f"{backend}_us"] = median_us(runs[0])
                _try_in_graph_us(case.flashinfer_runs(backend, graph=True), row, f"{backend}_graph_us")
                op = case.flashinfer_op(backend)
                check_mla(f"{backend} op", op(), ref)
                row[f"{backend}_op_us"] = median_us(op)
            best = min((row[c] for c in ("fa2_graph_us", "fa3_graph_us") if row.get(c)), default=None)
            if best and row.get("triton_graph_us"):
                row["best_fi_graph_over_triton_graph"] = best / row["triton_graph_us"]
            if best and row.get("hopper_graph_us"):
                row["best_fi_graph_over_hopper_graph"] = best / row["hopper_graph_us"]
            if row.get("triton_us"):
                row["best_fi_over_triton_eager"] = min(row["fa2_us"], row["fa3_us"]) / row["triton_us"]
        for name in ("triton", "hopper", "fa2", "fa3"):
            _rates(row, name, case)
        if row.get("hopper_graph_us") and row.get("triton_graph_us"):
            row["triton_graph_over_hopper_graph"] = row["triton_graph_us"] / row["hopper_graph_us"]
        rows.append(row)
        print(f"# {kv} H={h} B={b} K={k}: graph us: " + ", ".join(
            f"{n} {row[n + '_graph_us']:.1f}" for n in ("triton", "hopper", "fa2", "fa3") if row.get(n + "_graph_us")),
            file=sys.stderr)
    return rows


COLUMNS = {
    "topk_remap": ["B", "N", "K", "ours_us", "ours_graph_us", "floor_graph_us", "torch_us", "torch_graph_us",
                   "eager_speedup", "step_speedup", "graph_speedup"],
    "lse_combine": ["B", "N", "H/N", "D", "ours_us", "ours_graph_us", "torch_us", "torch_graph_us",
                    "eager_speedup", "step_speedup", "graph_speedup"],
    "sparse_mla": ["kv", "H", "B", "K", "triton_us", "triton_graph_us", "triton_GBps", "fa2_us", "fa3_us",
                   "fa2_graph_us", "fa3_graph_us", "fa2_op_us", "fa3_op_us", "best_fi_graph_over_triton_graph",
                   "best_fi_over_triton_eager", "triton_TFLOPS", "hopper_us", "hopper_graph_us", "hopper_TFLOPS",
                   "hopper_GBps", "fa3_TFLOPS", "best_fi_graph_over_hopper_graph", "triton_graph_over_hopper_graph"],
}  # fmt: skip


def format_tables(rows: list[dict]) -> str:
    out = []
    for kernel, cols in COLUMNS.items():
        sel = [r for r in rows if r["kernel"] == kernel]
        if not sel:
            continue
        out.append(f"\n{kernel}\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in sel:
            cells = []
            for c in cols:
                v = r.get(c)
                cells.append("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)))
            out.append("| " + " | ".join(cells) + " |")
    errors = sorted({f"{k}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")})
    out += [f"\nnot captured: {e}" for e in errors]
    return "\n".join(out)


def main(args) -> int:
    torch.manual_seed(0)
    only = set(args.only or ("remap", "combine", "mla"))
    kvs = tuple(args.kv or ("bf16", "fp8"))
    shapes = {name: tuple(v) for name in ("heads", "batches", "ks") if (v := getattr(args, name, None))}
    if args.tune:
        from dsa_dcp.bench.tune import main as tune

        return tune(kvs, args.write_table, shapes, getattr(args, "candidates", None) or "all",
                    getattr(args, "update_table", None))
    rows = []
    parts = {"remap": bench_remap, "combine": bench_combine, "mla": lambda: bench_sparse_mla(kvs=kvs, **shapes)}
    for name, part in parts.items():
        if name in only:
            rows += part()
            if args.json:  # after each kernel, so a run stopped by a time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"device {torch.cuda.get_device_name()}, {versions()}")
    if "mla" in only:
        limits = device_limits()
        print(f"limits measured here: copy {limits['copy_GBps']:.0f} GB/s (read + write), "
              f"bf16 matrix product {limits['bf16_mm_TFLOPS']:.0f} TFLOP/s")
    print(format_tables(rows))
    return 0
