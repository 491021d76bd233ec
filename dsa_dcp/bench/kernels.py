"""``dsa-dcp bench kernels``: each kernel against what a user would otherwise run.

Every variant is checked against the torch reference on the same inputs before it is timed.
Times are medians in microseconds, two ways:

- ``eager``: ``triton.testing.do_bench`` over launches from Python (CUDA events, warm, L2 flushed
  before each call). For small kernels this is the host's launch cost, not the GPU's.
- ``graph``: calls captured back to back in one CUDA graph, replayed, time per call. This is what
  a captured decode step pays. For ``sparse_mla`` the captured calls rotate over disjoint slices
  of a 1.2 GB KV cache (about 100 MB or more of distinct rows a replay, twice the H200's L2),
  so every call gathers rows that are not in L2.

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
import itertools
import json
import math
import sys

import torch

GRAPH_CALLS = 20
L2_BYTES = 50 << 20  # the H200's L2 is 50 MB (60 MB on the die, 50 MB enabled)
SLOTS = 1 << 20
DC, DR = 512, 64


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


class MlaCase:
    """Inputs of one sparse MLA shape: queries, a 1M-slot cache in ``views`` disjoint slices and a
    top-k into one slice (the same indices address a different slice in each view)."""

    def __init__(self, cache: torch.Tensor, h: int, b: int, k: int, kv: str, scale_fp8: float):
        self.h, self.b, self.k, self.kv = h, b, k, kv
        per_call = b * k * (DC + DR) * cache.element_size()
        self.views = max(1, min(128, math.ceil(2 * L2_BYTES / per_call)))
        span = cache.shape[0] // self.views
        self.caches = [cache[i * span:(i + 1) * span] for i in range(self.views)]
        self.q_nope = torch.randn(b, h, DC, device="cuda", dtype=torch.bfloat16)
        self.q_pe = torch.randn(b, h, DR, device="cuda", dtype=torch.bfloat16)
        self.topk = torch.stack([torch.randperm(span, device="cuda")[:k] for _ in range(b)]).int()
        self.sm_scale = 192**-0.5
        self.kv_scale = scale_fp8 if kv == "fp8" else None
        self.bytes = b * k * (DC + DR) * cache.element_size() + 2 * b * h * (DC + DR) * 2
        self.flops = 2 * b * h * k * (DC + DR + DC)  # scores over 576 columns, values over 512

    def reference(self):
        from dsa_dcp.kernels import sparse_mla_reference

        return sparse_mla_reference(self.q_nope, self.q_pe, self.caches[0], self.topk, self.sm_scale, self.kv_scale)

    def triton(self, view: int = 0, **tiles):
        from dsa_dcp.kernels import sparse_mla_triton

        return lambda: sparse_mla_triton(
            self.q_nope, self.q_pe, self.caches[view], self.topk, self.sm_scale, self.kv_scale, **tiles
        )

    def hopper(self, view: int = 0, **kw):
        from dsa_dcp.kernels.sparse_mla_hopper import sparse_mla_hopper

        return lambda: sparse_mla_hopper(
            self.q_nope, self.q_pe, self.caches[view], self.topk, self.sm_scale, self.kv_scale, **kw
        )

    def flashinfer_op(self, backend: str):
        """The whole ``sparse_mla`` call through FlashInfer, as the op runs it uncaptured."""
        from dsa_dcp.kernels import flashinfer_mla

        return lambda: flashinfer_mla.sparse_mla_flashinfer(
            self.q_nope, self.q_pe, self.caches[0], self.topk, self.sm_scale, backend=backend
        )

    def flashinfer_runs(self, backend: str, graph: bool):
        """``wrapper.run`` per view after one ``plan()`` (graph: a CUDA-graph wrapper)."""
        import flashinfer

        b, h, k = self.b, self.h, self.k
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        kv_indptr, indices = indptr * k, self.topk.reshape(-1).contiguous()
        lens = torch.full((b,), k, dtype=torch.int32, device="cuda")
        if graph:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                ws, True, indptr.clone(), kv_indptr.clone(), indices.clone(), lens.clone(), backend=backend
            )
        else:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
        wrapper.plan(indptr, kv_indptr, indices, lens, h, DC, DR, 1, False, self.sm_scale, torch.bfloat16,
                     torch.bfloat16)
        out = torch.empty(b, h, DC, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, device="cuda", dtype=torch.float32)

        def run(cache):
            ckv, kpe = cache[:, :DC].unsqueeze(1), cache[:, DC:].unsqueeze(1)
            return lambda: wrapper.run(self.q_nope, self.q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)

        return [run(c) for c in self.caches]


def check_mla(name: str, got, ref, lse_base2: bool = False) -> None:
    out, lse = got
    if lse_base2:
        lse = lse * 0.6931471805599453
    rel = ((out.float() - ref[0].float()).norm() / ref[0].float().norm()).item()
    assert rel < 2e-2, (name, rel)
    torch.testing.assert_close(lse.float(), ref[1], rtol=1e-2, atol=1e-2)


def make_caches():
    cache = torch.randn(SLOTS, DC + DR, device="cuda", dtype=torch.bfloat16)
    scale = float(cache.abs().amax()) / 448.0
    return {"bf16": (cache, None), "fp8": ((cache.float() / scale).to(torch.float8_e4m3fn), scale)}


def mla_cases(heads, batches, ks, kvs):
    """``(case, reference result)`` for every shape, over one pair of BF16/FP8 caches."""
    caches = make_caches()
    for kv, h, b, k in itertools.product(kvs, heads, batches, ks):
        cache, scale = caches[kv]
        case = MlaCase(cache, h, b, k, kv, scale)
        yield case, case.reference()


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
