"""Run a function on N ranks: N CPU processes over gloo here, or the ranks ``torchrun`` started.

``run_on_ranks(fn, n, *args)`` is the one place that spawns ranks for tests and the demo: it picks
a free port, starts ``n`` processes (spawn), initializes a gloo process group with a timeout in
each, calls ``fn(rank, n, *args)``, and returns the ranks' results in rank order. A rank that
raises fails the caller with a ``RankError`` carrying that rank's traceback; a rank that does not
finish in ``timeout`` seconds fails it too, and every rank left is killed, so nothing hangs.

Under ``torchrun`` (GPUs, NCCL) call ``init_from_env()`` in each rank instead.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank failed (its traceback is in the message) or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, results, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # plain bytes: no shared-memory handles that die with this process
        results.put((rank, None, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankError(f"rank(s) {missing} did not finish within {timeout:.0f} s")
            try:
                rank, error, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
                continue
            if error is not None:
                raise RankError(f"rank {rank} of {world_size} failed:\n{error}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialize the default group from ``torchrun``'s environment; returns ``(rank, world_size)``.

    NCCL with one GPU per local rank when CUDA is available, gloo otherwise.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()
