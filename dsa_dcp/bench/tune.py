"""``dsa-dcp bench kernels --tune``: the measured ``sparse_mla`` dispatch table.

Per shape (H, B, K, KV dtype): the fastest Triton tiles and, where it runs, the Hopper kernel's
fastest split count, each timed in a CUDA graph over KV rows that are not in L2 (see
:mod:`dsa_dcp.bench.mla_cases`); the faster of the two is the captured choice (``graph_backend``).
Then the fastest backend as the op runs it uncaptured (Triton with its tiles, Hopper with its
splits, FlashInfer fa2 and fa3 through the adapter, ``plan()`` included) is ``backend``. Every
candidate is checked against the reference before it is timed. The result is the JSON table
:mod:`dsa_dcp.kernels.dispatch` reads. ``--candidates hopper`` times no new Triton tiles (only the
shipped table's, or the heuristic's where it has none) beside the Hopper kernel.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
import time

import torch

from dsa_dcp.bench.measure import in_graph_us, median_us, versions
from dsa_dcp.bench.mla_cases import check_mla, mla_cases

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
# The key-major products (scores^T = K q^T, acc^T = V^T p^T): the key tile and the latent are the
# MMA's wide dimensions, so 64-head tiles no longer give the score product a 16- or 32-wide side.
# acc^T is [512, block_h] fp32: 8 warps for 64 heads, 4 for 32 or fewer, to stay in registers.
KEY_MAJOR_CANDIDATES = [
    dict(block_h=64, block_k=64, num_warps=8, num_stages=2, key_major=True),
    dict(block_h=64, block_k=32, num_warps=8, num_stages=3, key_major=True),
    dict(block_h=32, block_k=64, num_warps=4, num_stages=3, key_major=True),
    dict(block_h=32, block_k=64, num_warps=8, num_stages=2, key_major=True),
    dict(block_h=16, block_k=64, num_warps=4, num_stages=2, key_major=True),
]
# Two programs a head block, each owning half of the latent's output columns (dc_split=2): a
# [block_h, 256] fp32 accumulator, so 64 heads fit one warp group (4 warps) and 128 heads two,
# each warp group then holding whole rows of the score tile; the score product is done twice.
DC_SPLIT_CANDIDATES = [
    dict(block_h=64, block_k=64, num_warps=4, num_stages=2, dc_split=2),
    dict(block_h=64, block_k=32, num_warps=4, num_stages=3, dc_split=2),
    dict(block_h=64, block_k=64, num_warps=8, num_stages=2, dc_split=2),
    dict(block_h=128, block_k=32, num_warps=8, num_stages=2, dc_split=2),
    dict(block_h=128, block_k=64, num_warps=8, num_stages=2, dc_split=2),
    dict(block_h=32, block_k=64, num_warps=4, num_stages=3, dc_split=2),
]
CANDIDATE_SETS = {
    "all": TILE_CANDIDATES + KEY_MAJOR_CANDIDATES + DC_SPLIT_CANDIDATES,
    "key-major": KEY_MAJOR_CANDIDATES,
    "dc-split": DC_SPLIT_CANDIDATES,
    "hopper": [],  # the shipped Triton tiles only, beside the Hopper kernel
}


# The Hopper kernel's variants timed per shape: 64-key tiles in two stages, 32-key tiles in four.
# (An L2 bulk prefetch of the rows two or three tiles ahead, and issuing the next tile's scores
# before this tile's P V completes, were timed on all 48 shapes of docs/benchmarks.md and lost
# everywhere: 0-29% and 0-8% slower. They stay launch options, off; pass them to time them.)
HOPPER_VARIANTS = [
    dict(block_k=64, prefetch=0, early_s=False),
    dict(block_k=32, prefetch=0, early_s=False),
]


def _hopper_split_candidates(b: int, h: int, k: int, sms: int) -> list[int]:
    """The Hopper kernel's split counts to time: its default, half and twice that (one split
    keeping a key tile at least), and no split where the default is small."""
    from dsa_dcp.kernels.sparse_mla_hopper import BLOCK_K, default_splits

    tiles = math.ceil(k / BLOCK_K)
    d = default_splits(b, h, k, sms)
    out = {s for s in (max(1, d // 2), d, 2 * d) if s <= tiles}
    if d <= 2:
        out.add(1)
    return sorted(out)


def _hopper_candidates(b: int, h: int, k: int, sms: int) -> list[dict]:
    return [dict(num_splits=s, **v) for s in _hopper_split_candidates(b, h, k, sms) for v in HOPPER_VARIANTS]


def _split_candidates(b: int, h: int, k: int, block_h: int, block_k: int, sms: int) -> list[int]:
    """No split, and the powers of two that make half a wave to two waves (at most one K tile each)."""
    programs = b * math.ceil(h / block_h)
    most = max(1, k // block_k)
    waves = {1 << i for i in range(12) if sms / 2 <= programs * (1 << i) <= 2 * sms}
    return sorted({1} | {min(most, s) for s in waves})


def _candidates(b: int, h: int, k: int, kv: str, tile_set: list[dict], sms: int) -> list[tuple[str, dict]]:
    """``(label, tiles)`` to time: the shipped table's choice for the shape (if any), then each
    candidate of the set with each of its split counts."""
    from dsa_dcp.kernels import dispatch

    out = []
    table = dispatch.load_table()
    shipped = table and dispatch.lookup(table, torch.cuda.get_device_name(), h, b, k, kv,
                                        dispatch.device_arch(torch.cuda.current_device()))
    if shipped:  # its Triton tiles, whichever backend it chose
        out.append(("shipped", dict(shipped.tiles)))
    elif not tile_set:
        out.append(("heuristic", {}))
    for tiles in tile_set:
        if tiles["block_h"] > h:  # a head block larger than the heads: mostly masked lanes
            continue
        for splits in _split_candidates(b, h, k, tiles["block_h"], tiles["block_k"], sms):
            out.append(("candidate", dict(tiles, num_splits=splits)))
    return out


def tune_sparse_mla(heads=(64, 128), batches=(1, 8, 32, 128), ks=(512, 2048), kvs=("bf16", "fp8"),
                    candidates: str = "all") -> list[dict]:
    """Per shape: the fastest Triton tiles in graph (among ``CANDIDATE_SETS[candidates]`` and the
    shipped table's choice) and the Hopper kernel's fastest split count in graph (where it runs);
    then the fastest backend as the op (eager). Every timing is printed."""
    from dsa_dcp.kernels import sparse_mla_hopper
    from dsa_dcp.kernels._common import sm_count

    sms = sm_count(torch.device("cuda", 0))
    have_fi = importlib.util.find_spec("flashinfer") is not None
    have_hopper = sparse_mla_hopper.available()
    if not have_hopper:
        print(f"# hopper kernel not tuned: {sparse_mla_hopper.unavailable_reason()}", file=sys.stderr)
    entries = []
    for case, ref in mla_cases(heads, batches, ks, kvs):
        kv, h, b, k = case.kv, case.h, case.b, case.k
        best = shipped_us = None
        for label, t in _candidates(b, h, k, kv, CANDIDATE_SETS[candidates], sms):
            try:
                check_mla("triton", case.triton(**t)(), ref)
                us = in_graph_us([case.triton(v, **t) for v in range(case.views)], rep=10)
            except AssertionError:  # a wrong result is a bug, not a tile to skip
                raise
            except Exception as e:  # a tile the compiler cannot fit (shared memory, registers)
                print(f"# skip {t}: {type(e).__name__}", file=sys.stderr)
                continue
            print(f"#   {kv} H={h} B={b} K={k} {label} {t}: {us:.1f} us in graph", file=sys.stderr)
            if label == "shipped":
                shipped_us = us
            if best is None or us < best[0]:
                best = (us, t)
        tiles = best[1]
        graph_us = {"triton": best[0]}
        hopper_best = None
        if have_hopper:
            for t in _hopper_candidates(b, h, k, sms):
                try:
                    check_mla("hopper", case.hopper(**t)(), ref)
                except AssertionError as e:  # never chosen; said loudly (the GPU tests should have caught it)
                    print(f"# WRONG hopper {kv} H={h} B={b} K={k} {t}: {e}", file=sys.stderr)
                    continue
                us = in_graph_us([case.hopper(v, **t) for v in range(case.views)], rep=10)
                print(f"#   {kv} H={h} B={b} K={k} hopper {t}: {us:.1f} us in graph", file=sys.stderr)
                if hopper_best is None or us < hopper_best[0]:
                    hopper_best = (us, t)
            if hopper_best is not None:
                graph_us["hopper"] = hopper_best[0]
        graph_backend = min(graph_us, key=graph_us.get)
        times = {"triton": median_us(case.triton(**tiles), rep=20)}
        if hopper_best is not None:
            times["hopper"] = median_us(case.hopper(**hopper_best[1]), rep=20)
        if have_fi and kv == "bf16":
            for backend in ("fa2", "fa3"):
                op = case.flashinfer_op(backend)
                check_mla(f"{backend} op", op(), ref)
                times[backend] = median_us(op, rep=20)
        backend = min(times, key=times.get)
        entry = {"H": h, "B": b, "K": k, "kv": kv, "backend": backend, "graph_backend": graph_backend,
                 "tiles": tiles,
                 "us": {**{f"{n}_graph": v for n, v in graph_us.items()}, **{f"{n}_op": v for n, v in times.items()}}}
        if hopper_best is not None:
            entry["hopper_tiles"] = hopper_best[1]
        if shipped_us is not None:
            entry["us"]["shipped_triton_graph"] = shipped_us
        entries.append(entry)
        print(f"# tuned {time.strftime('%H:%M:%S')} {kv} H={h} B={b} K={k}: in graph "
              + ", ".join(f"{n} {v:.1f}" for n, v in graph_us.items()) + f" -> {graph_backend}; op: "
              + ", ".join(f"{n} {v:.1f}" for n, v in times.items()) + f" -> {backend}", file=sys.stderr)
    return entries


def merge_entries(table: dict, entries: list[dict], command: str) -> dict:
    """``table`` with ``entries`` in place of its entries for the same (H, B, K, kv); the rest kept.
    (``command`` should say what the updating run had: its versions may differ from the table's.)"""
    from dsa_dcp.kernels import dispatch

    dispatch.validate_table(table, "the table to update")
    key = lambda e: (e["kv"], e["H"], e["B"], e["K"])  # noqa: E731
    tuned = {key(e) for e in entries}
    kept = [e for e in table["entries"] if key(e) not in tuned]
    return dict(table, command=f"{table.get('command', '')}; then {command}, for {len(entries)} shape(s)",
                entries=sorted(kept + entries, key=key))


def main(kvs: tuple[str, ...], write_table: str | None, shapes: dict | None = None, candidates: str = "all",
         update_table: str | None = None) -> int:
    """``shapes``: ``heads``/``batches``/``ks`` to tune (default: the table's grid). ``update_table``:
    a table file whose entries for the tuned shapes are replaced (the rest kept)."""
    from dsa_dcp.kernels import dispatch

    entries = tune_sparse_mla(kvs=kvs, candidates=candidates, **(shapes or {}))
    command = "dsa-dcp " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = {"device": torch.cuda.get_device_name(), "arch": dispatch.device_arch(torch.cuda.current_device()),
             "versions": versions(), "command": command, "entries": entries}
    text = json.dumps(table, indent=1)
    print(text)
    if write_table:
        with open(write_table, "w") as f:
            f.write(text + "\n")
    if update_table:
        with open(update_table) as f:
            old = json.load(f)
        if old.get("device") != table["device"]:
            raise ValueError(f"{update_table} was measured on {old.get('device')!r}, not {table['device']!r}")
        with open(update_table, "w") as f:
            run = f"{command} ({', '.join(f'{k} {v}' for k, v in versions().items())}, {time.strftime('%Y-%m-%d')})"
            f.write(json.dumps(dict(merge_entries(old, entries, run), arch=table["arch"]), indent=1) + "\n")
    return 0
