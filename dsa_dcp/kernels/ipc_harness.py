"""N processes on one GPU sharing merge buffers through CUDA IPC: the fused merge's test rig.

NCCL and torch symmetric memory both refuse two ranks on one GPU, but CUDA tensors shared
between processes through ``torch.multiprocessing`` can be written by each other, and a kernel
can spin on a flag another process sets. ``run_ipc_ranks`` allocates every rank's
``MergeWorkspace`` buffers in the parent, hands all of them to N spawned processes, and each
process builds its workspace from the mapped buffers (``MergeWorkspace.from_buffers``) and runs
``fn(rank, workspace, *args)``.

What this proves: the kernel's data movement, signalling (release/acquire at system scope
across processes), epochs over repeated merges, and its combine, on real concurrent processes.
What it does not: NVLink traffic between GPUs, symmetric-memory rendezvous, or speed (the
processes time-share one GPU).
"""

from __future__ import annotations

import io
import queue
import traceback

import torch
import torch.multiprocessing as mp

from dsa_dcp.kernels.fused_merge import MergeWorkspace


def _rank_main(fn, rank, all_buffers, args, results):
    try:
        torch.cuda.set_device(all_buffers[rank]["payload"].device)
        ws = MergeWorkspace.from_buffers(rank, all_buffers)
        value = fn(rank, ws, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, None, buf.getvalue()))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc(), None))


def run_ipc_ranks(fn, dcp_size: int, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype, *args,
                  timeout: float = 180.0) -> list:
    """Run ``fn(rank, workspace, *args)`` in ``dcp_size`` processes on the current GPU."""
    ctx = mp.get_context("spawn")
    all_buffers = [MergeWorkspace.buffers(dcp_size, max_rows, heads, head_dim, dtype, "cuda")
                   for _ in range(dcp_size)]
    torch.cuda.synchronize()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, all_buffers, args, results), daemon=True)
             for r in range(dcp_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < dcp_size:
            try:
                rank, error, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"IPC ranks {sorted(set(range(dcp_size)) - set(out))} did not finish "
                                   f"within {timeout:.0f} s") from None
            if error is not None:
                raise RuntimeError(f"IPC rank {rank} failed:\n{error}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(dcp_size)]
