"""``dsa-dcp bench kernels``: each kernel against what a user would otherwise run.

Every variant is checked against the torch reference on the same inputs before it is timed.
Times are medians of ``triton.testing.do_bench`` (CUDA events, warm) in microseconds; "in graph"
is the time per call of 20 calls captured in one CUDA graph (what a replayed decode step pays).

- ``topk_remap``: ours (Triton) vs torch eager (``topk_remap_reference``); K = 2048.
- ``lse_combine``: ours vs torch eager; H/N heads of D = 512 (H = 64).
- ``sparse_mla``: our Triton decode kernel vs FlashInfer's MLA wrapper (fa2, fa3) used as sparse
  attention (page_size 1, kv_indices = the top-k; ``plan()`` is outside the timed region, as a
  server would plan once per step); BF16 KV over a cache of 1M slots (1.2 GB, far larger than
  L2), random top-k; bytes moved = the K gathered KV rows + q + out; GB/s beside each time.
"""

from __future__ import annotations

import importlib.util
import json

import torch

GRAPH_CALLS = 20


def _median_us(fn) -> float:
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _in_graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return _median_us(graph.replay) / GRAPH_CALLS


def bench_remap(batches=(1, 8, 32, 128), ns=(2, 4, 8), k=2048, slots=1 << 20) -> list[dict]:
    from dsa_dcp.kernels import topk_remap_reference, topk_remap_triton

    rows = []
    for b in batches:
        for n in ns:
            topk = torch.randint(0, slots, (b, k), device="cuda", dtype=torch.int32)
            topk[:, k - k // 8:] = -1
            ref = topk_remap_reference(topk, n, 1, 1)
            got = topk_remap_triton(topk, n, 1, 1)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
            row = {"kernel": "topk_remap", "B": b, "N": n, "K": k,
                   "ours_us": _median_us(lambda: topk_remap_triton(topk, n, 1, 1)),
                   "torch_us": _median_us(lambda: topk_remap_reference(topk, n, 1, 1))}
            row["ours_in_graph_us"] = _in_graph_us(lambda: topk_remap_triton(topk, n, 1, 1)) if b == 1 else None
            row["speedup"] = row["torch_us"] / row["ours_us"]
            rows.append(row)
    return rows


def bench_combine(batches=(1, 8, 32, 128), ns=(2, 4, 8), heads=64, d=512) -> list[dict]:
    from dsa_dcp.kernels import lse_combine_reference, lse_combine_triton

    rows = []
    for b in batches:
        for n in ns:
            out = torch.randn(n, b, heads // n, d, device="cuda", dtype=torch.bfloat16)
            lse = torch.randn(n, b, heads // n, device="cuda")
            ref, got = lse_combine_reference(out, lse), lse_combine_triton(out, lse)
            torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
            row = {"kernel": "lse_combine", "B": b, "N": n, "H/N": heads // n, "D": d,
                   "ours_us": _median_us(lambda: lse_combine_triton(out, lse)),
                   "torch_us": _median_us(lambda: lse_combine_reference(out, lse))}
            row["ours_in_graph_us"] = _in_graph_us(lambda: lse_combine_triton(out, lse)) if b == 1 else None
            row["speedup"] = row["torch_us"] / row["ours_us"]
            rows.append(row)
    return rows


def _flashinfer_runner(q_nope, q_pe, kv, topk, scale, backend):
    import flashinfer

    b, h, dc = q_nope.shape
    k = topk.shape[1]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
    indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    kv_indptr = indptr * k
    lens = torch.full((b,), k, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, kv_indptr, topk.reshape(-1), lens, h, dc, q_pe.shape[-1], 1, False, scale,
                 q_nope.dtype, kv.dtype)
    ckv, kpe = kv[:, :dc].unsqueeze(1), kv[:, dc:].unsqueeze(1)
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)


def bench_sparse_mla(heads=(64, 128), batches=(1, 8, 32, 128), ks=(512, 1024, 2048), slots=1 << 20) -> list[dict]:
    from dsa_dcp.kernels import sparse_mla_reference, sparse_mla_triton

    have_fi = importlib.util.find_spec("flashinfer") is not None
    kv = torch.randn(slots, 576, device="cuda", dtype=torch.bfloat16)
    scale = 192**-0.5
    rows = []
    for h in heads:
        for b in batches:
            for k in ks:
                q_nope = torch.randn(b, h, 512, device="cuda", dtype=torch.bfloat16)
                q_pe = torch.randn(b, h, 64, device="cuda", dtype=torch.bfloat16)
                topk = torch.stack([torch.randperm(slots, device="cuda")[:k] for _ in range(b)]).int()
                ref_out, ref_lse = sparse_mla_reference(q_nope, q_pe, kv, topk, scale)
                variants = {"triton": lambda: sparse_mla_triton(q_nope, q_pe, kv, topk, scale)}
                if have_fi:
                    for backend in ("fa2", "fa3"):
                        variants[backend] = _flashinfer_runner(q_nope, q_pe, kv, topk, scale, backend)
                moved = b * k * 576 * 2 + 2 * b * h * 576 * 2
                row = {"kernel": "sparse_mla", "H": h, "B": b, "K": k, "kv": "bf16", "bytes": moved}
                for name, fn in variants.items():
                    out, lse = fn()
                    if name != "triton":
                        lse = lse * 0.6931471805599453
                    rel = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                    assert rel < 2e-2, (name, rel)
                    torch.testing.assert_close(lse.float(), ref_lse, rtol=1e-2, atol=1e-2)
                    t = _median_us(fn)
                    row[f"{name}_us"] = t
                    row[f"{name}_GBps"] = moved / t / 1e3
                if b == 1:
                    row["triton_in_graph_us"] = _in_graph_us(variants["triton"])
                best_fi = min((row[f"{x}_us"] for x in ("fa2", "fa3") if f"{x}_us" in row), default=None)
                row["vs_best_flashinfer"] = best_fi / row["triton_us"] if best_fi else None
                rows.append(row)
    return rows


def format_tables(rows: list[dict]) -> str:
    out = []
    for kernel, cols in (
        ("topk_remap", ["B", "N", "K", "ours_us", "torch_us", "speedup", "ours_in_graph_us"]),
        ("lse_combine", ["B", "N", "H/N", "D", "ours_us", "torch_us", "speedup", "ours_in_graph_us"]),
        ("sparse_mla", ["H", "B", "K", "kv", "triton_us", "triton_GBps", "fa2_us", "fa3_us", "vs_best_flashinfer",
                        "triton_in_graph_us"]),
    ):
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
    return "\n".join(out)


def main(args) -> int:
    torch.manual_seed(0)
    rows = bench_remap() + bench_combine() + bench_sparse_mla()
    print(format_tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
