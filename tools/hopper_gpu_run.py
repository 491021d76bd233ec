"""On the GPU machine: smoke-test, then time the Hopper sparse MLA kernel in one process.

    python3 tools/hopper_gpu_run.py smoke [bf16|fp8]  # small launches, errors against fp64 printed
    python3 tools/hopper_gpu_run.py bench OUT.json   # graph times, all shapes; Triton beside it at K = 2048
    python3 tools/hopper_gpu_run.py diag             # B = 128, K = 2048: without the gathers, prefetch 0/2/3
    python3 tools/hopper_gpu_run.py summary TUNE.json  # the table `bench kernels --tune` printed, in short

The full comparison with FlashInfer is ``dsa-dcp bench kernels``; this is the short version for
a development run (graph times only, default split counts, plus a split sweep at B <= 32).
"""

from __future__ import annotations

import json
import sys
import time

import torch


def smoke(kinds: list[str]) -> int:
    from dsa_dcp.kernels.sparse_mla import sparse_mla_reference
    from dsa_dcp.kernels.sparse_mla_hopper import sparse_mla_hopper, unavailable_reason

    print("hopper kernel:", unavailable_reason() or "available")
    g = torch.Generator(device="cuda").manual_seed(0)
    for kv_dtype in [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[k] for k in kinds]:
        for splits in (1, 3):
            B, H, K, S = 2, 64, 300, 2000
            q = torch.randn(B, H, 512, device="cuda", generator=g).bfloat16()
            qp = torch.randn(B, H, 64, device="cuda", generator=g).bfloat16()
            cache = torch.randn(S, 576, device="cuda", generator=g)
            scale = None
            kv = cache.bfloat16()
            if kv_dtype != torch.bfloat16:
                scale = float(cache.abs().amax()) / 448
                kv = (cache / scale).to(kv_dtype)
            topk = torch.stack([torch.randperm(S, device="cuda", generator=g)[:K] for _ in range(B)]).int()
            topk[:, -20:] = -1
            t = time.time()
            out, lse = sparse_mla_hopper(q, qp, kv, topk, 0.07, scale, num_splits=splits)
            torch.cuda.synchronize()
            ref = sparse_mla_reference(q.double(), qp.double(), kv.float().double() * (scale or 1.0), topk, 0.07,
                                       compute_dtype=torch.float64)
            rel = ((out.double() - ref[0]).abs().max() / ref[0].abs().max()).item()
            lse_err = (lse.double() - ref[1].double()).abs().max().item()
            print(f"{kv_dtype} splits={splits}: rel out {rel:.2e}, abs lse {lse_err:.2e} ({time.time() - t:.1f} s)")
    print("SMOKE_OK", *kinds)
    return 0


def bench(path: str) -> int:
    from dsa_dcp.bench.measure import device_limits, in_graph_us
    from dsa_dcp.bench.mla_cases import MlaCase, check_mla, make_caches
    from dsa_dcp.kernels.sparse_mla_hopper import default_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    limits = device_limits()
    print(f"# limits: copy {limits['copy_GBps']:.0f} GB/s, bf16 mm {limits['bf16_mm_TFLOPS']:.0f} TFLOP/s")
    caches = make_caches()
    rows = []
    for kv in ("bf16", "fp8"):
        for h in (64, 128):
            for b in (1, 8, 32, 128):
                for k in (512, 1024, 2048):
                    cache, scale = caches[kv]
                    case = MlaCase(cache, h, b, k, kv, scale)
                    ref = case.reference()
                    row = {"kv": kv, "H": h, "B": b, "K": k, "flops": case.flops, "bytes": case.bytes}
                    default = default_splits(b, h, k, sms)
                    splits = {default} | ({1, max(1, default // 2), 2 * default} if b <= 32 and k == 2048 else set())
                    for s in sorted(splits):
                        try:
                            check_mla("hopper", case.hopper(num_splits=s)(), ref)
                            us = in_graph_us([case.hopper(v, num_splits=s) for v in range(case.views)])
                        except AssertionError as e:
                            row[f"hopper_s{s}_error"] = str(e)[:200]
                            continue
                        row[f"hopper_s{s}_us"] = us
                    row["hopper_default_splits"] = default
                    if k == 2048:
                        check_mla("triton", case.triton()(), ref)
                        row["triton_us"] = in_graph_us([case.triton(v) for v in range(case.views)])
                    rows.append(row)
                    best = min((v, key) for key, v in row.items() if key.startswith("hopper_s") and key.endswith("_us"))
                    us = best[0]
                    print(f"{kv} H={h:3d} B={b:3d} K={k:4d}: hopper {us:7.1f} us ({best[1][8:-3]:>3}) "
                          f"{case.flops / us / 1e6:5.0f} TFLOPS {case.bytes / us / 1e3:5.0f} GB/s"
                          + (f" | default {row[f'hopper_s{default}_us']:.1f}" if f"hopper_s{default}_us" in row else "")
                          + (f" | triton {row['triton_us']:.1f}" if "triton_us" in row else "")
                          + "".join(f" | {key}" for key in row if key.endswith("_error")), flush=True)
                    with open(path, "w") as f:
                        json.dump({"limits": limits, "rows": rows}, f, indent=1)
    return 0


def diag() -> int:
    """Where the time goes at B = 128, K = 2048: the kernel without its gathers (compute and
    synchronization alone), and the L2 prefetch distance 0 / 2 / 3."""
    from dsa_dcp.bench.measure import device_limits, in_graph_us
    from dsa_dcp.bench.mla_cases import MlaCase, make_caches

    limits = device_limits()
    print(f"limits: copy {limits['copy_GBps']:.0f} GB/s, bf16 mm {limits['bf16_mm_TFLOPS']:.0f} TFLOP/s")
    caches = make_caches()
    for kv in ("bf16", "fp8"):
        for h in (64, 128):
            cache, scale = caches[kv]
            case = MlaCase(cache, h, 128, 2048, kv, scale)
            res = {}
            for name, kw in (("compute only", dict(_compute_only=True, prefetch=2, early_s=False)),
                             ("compute only early_s", dict(_compute_only=True, prefetch=2, early_s=True)),
                             ("pf0", dict(prefetch=0, early_s=False)), ("pf2", dict(prefetch=2, early_s=False)),
                             ("pf3", dict(prefetch=3, early_s=False)), ("pf2 early_s", dict(prefetch=2, early_s=True))):
                res[name] = in_graph_us([case.hopper(v, num_splits=1, **kw) for v in range(case.views)])
            tiles = 2048 // 64 * 128 * (h // 64) / torch.cuda.get_device_properties(0).multi_processor_count
            print(f"{kv} H={h} B=128 K=2048: " + ", ".join(f"{n} {v:.1f}" for n, v in res.items())
                  + f" us; {tiles:.1f} tiles an SM: compute only {res['compute only'] / tiles:.2f} us a tile", flush=True)
    return 0


def summary(path: str) -> int:
    """The tuned table in short: per shape the Triton and Hopper graph times, rates, choices."""
    table = json.load(open(path))
    print("kv   H   B    K | triton us | hopper us  TFLOPS  GB/s (splits,pf,early) | hop/tri | op us tri hop -> backend")
    for e in table["entries"]:
        us, t = e["us"], e.get("hopper_tiles", {})
        hop, tri = us.get("hopper_graph"), us.get("triton_graph")
        b, h, k = e["B"], e["H"], e["K"]
        flops = 2 * b * h * k * 1088
        nbytes = b * k * 576 * (1 if e["kv"] == "fp8" else 2) + 2 * b * h * 576 * 2
        print(f"{e['kv']:4} {h:3} {b:3} {k:4} | {tri:9.1f} | " + (
            f"{hop:9.1f} {flops / hop / 1e6:7.0f} {nbytes / hop / 1e3:5.0f} "
            f"({t.get('num_splits')},{t.get('prefetch')},{int(bool(t.get('early_s')))}) | {tri / hop:7.2f}"
            if hop else "        -") + f" | {us.get('triton_op', 0):.0f} {us.get('hopper_op', 0):.0f} -> "
            f"{e['backend']}/{e.get('graph_backend')}")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    mode = sys.argv[1]
    if mode == "smoke":
        sys.exit(smoke(sys.argv[2:] or ["bf16", "fp8"]))
    sys.exit({"bench": bench, "diag": lambda: diag(), "summary": summary}[mode](*sys.argv[2:]))
