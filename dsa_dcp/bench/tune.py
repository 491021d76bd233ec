"""``dsa-dcp bench kernels --tune``: the measured ``sparse_mla`` dispatch table.

Per shape (H, B, K, KV dtype): the fastest Triton tiles, timed in a CUDA graph over KV rows that
are not in L2 (see :mod:`dsa_dcp.bench.kernels`), then the fastest backend as the op runs it
uncaptured (Triton with those tiles, FlashInfer fa2 and fa3 through the adapter, ``plan()``
included). Every candidate is checked against the reference before it is timed. The result is
the JSON table :mod:`dsa_dcp.kernels.dispatch` reads.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
import time

import torch

from dsa_dcp.bench.kernels import check_mla, in_graph_us, median_us, mla_cases, versions

# A first sweep (block_h 16/32/64 x block_k 16/32/64 x 4/8 warps x 1/2 stages, H = 64, B = 1 and 8,
# bf16) was won only by the first six; the last five are for larger batches, where 64-head tiles
# (warp-group MMA) and a third pipeline stage (the gather's addresses come from a load) may pay. --tune times them with the split counts below.
TILE_CANDIDATES = [
    dict(block_h=16, block_k=16, num_warps=4, num_stages=1),
    dict(block_h=16, block_k=32, num_warps=4, num_stages=2),
    dict(block_h=16, block_k=64, num_warps=4, num_stages=2),
    dict(block_h=16, block_k=64, num_warps=8, num_stages=2),
    dict(block_h=32, block_k=64, num_warps=4, num_stages=2),
    dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
    dict(block_h=16, block_k=64, num_warps=4, num_stages=3),
    dict(block_h=32, block_k=32, num_warps=4, num_stages=3),
    dict(block_h=32, block_k=64, num_warps=4, num_stages=3),
    dict(block_h=64, block_k=32, num_warps=8, num_stages=3),
    dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
]


def _split_candidates(b: int, h: int, k: int, block_h: int, block_k: int, sms: int) -> list[int]:
    """No split, and the powers of two that make half a wave to two waves (at most one K tile each)."""
    programs = b * math.ceil(h / block_h)
    most = max(1, k // block_k)
    waves = {1 << i for i in range(12) if sms / 2 <= programs * (1 << i) <= 2 * sms}
    return sorted({1} | {min(most, s) for s in waves})


def tune_sparse_mla(heads=(64, 128), batches=(1, 8, 32, 128), ks=(512, 2048), kvs=("bf16", "fp8")) -> list[dict]:
    """Per shape: the fastest Triton tiles in graph, then the fastest backend as the op (eager)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    have_fi = importlib.util.find_spec("flashinfer") is not None
    entries = []
    for case, ref in mla_cases(heads, batches, ks, kvs):
        kv, h, b, k = case.kv, case.h, case.b, case.k
        best = None
        for tiles in TILE_CANDIDATES:
            for splits in _split_candidates(b, h, k, tiles["block_h"], tiles["block_k"], sms):
                t = dict(tiles, num_splits=splits)
                try:
                    check_mla("triton", case.triton(**t)(), ref)
                    us = in_graph_us([case.triton(v, **t) for v in range(case.views)], rep=10)
                except Exception as e:  # a tile the compiler cannot fit (shared memory, registers)
                    print(f"# skip {t}: {type(e).__name__}", file=sys.stderr)
                    continue
                if best is None or us < best[0]:
                    best = (us, t)
        tiles = best[1]
        times = {"triton": median_us(case.triton(**tiles), rep=20)}
        if have_fi and kv == "bf16":
            for backend in ("fa2", "fa3"):
                op = case.flashinfer_op(backend)
                check_mla(f"{backend} op", op(), ref)
                times[backend] = median_us(op, rep=20)
        backend = min(times, key=times.get)
        entries.append({"H": h, "B": b, "K": k, "kv": kv, "backend": backend, "tiles": tiles,
                        "us": {"triton_graph": best[0], **{f"{n}_op": v for n, v in times.items()}}})
        print(f"# tuned {time.strftime('%H:%M:%S')} {kv} H={h} B={b} K={k}: {tiles} {best[0]:.1f} us in graph; op: "
              + ", ".join(f"{n} {v:.1f}" for n, v in times.items()), file=sys.stderr)
    return entries


def main(kvs: tuple[str, ...], write_table: str | None) -> int:
    entries = tune_sparse_mla(kvs=kvs)
    table = {"device": torch.cuda.get_device_name(), "versions": versions(),
             "command": "dsa-dcp " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "entries": entries}
    text = json.dumps(table, indent=1)
    print(text)
    if write_table:
        with open(write_table, "w") as f:
            f.write(text + "\n")
    return 0
