"""Run a function on N ranks: N CPU processes over gloo here, or the ranks ``torchrun`` started.

``run_on_ranks(fn, n, *args)`` is the one place that spawns ranks for tests and the demo: it starts
``n`` processes, initializes a gloo process group in each, calls ``fn(rank, n, *args)``, and
returns the ranks' results in rank order. The processes are started by multiprocessing's
``forkserver`` on Linux (``spawn`` elsewhere): a server process imports torch and
dsa_dcp once, and each rank is a fork of it, so a rank starts in a fraction of a second instead of
importing torch again. A rank runs with the caller's environment variables and writes to the
caller's standard output and error as they are when it starts, as a spawned rank does (what was
read while importing stays as the server read it, when it first started). Either
way each rank imports the caller's main module again: a script that calls ``run_on_ranks`` must
do so under ``if __name__ == "__main__":``.

The group's store (a ``TCPStore``) is served by rank 0 on the loopback interface only
(127.0.0.1), from a socket rank 0 binds to port 0 itself and hands to the store, so no other
process can take the port in between; rank 0 publishes the port to the other ranks through
shared memory the caller created. A rank waits for the port up to ``collective_timeout``.

Nothing hangs. Each rank reports over its own pipe (joining, joined, result or traceback) and the
caller also watches every process's exit, so it learns at once when a rank raises or dies. The
process group's ``collective_timeout`` bounds how long a rank waits for the others, both to join
(gloo's store waits) and inside every collective; ``timeout`` bounds the whole run. On the first
failure the caller waits a moment (at most ``FAILURE_GRACE_S``) for the other ranks' reports,
stops every rank still running, and raises one ``RankError`` naming each rank that died (exit
code or signal), raised (its traceback), never joined, or was still running.

Under ``torchrun`` (GPUs, NCCL) call ``init_from_env()`` in each rank instead.
"""

from __future__ import annotations

import datetime
import io
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# After the first failure, how long the caller keeps listening for the other ranks' reports (a
# dead peer makes gloo fail the survivors' collectives within milliseconds) before stopping them.
FAILURE_GRACE_S = 2.0
# How long a finished run waits for its ranks to exit before it kills them.
EXIT_GRACE_S = 5.0
# The process group's timeout when none is given (``run_on_ranks``, and ``init_from_env`` on gloo):
# how long a rank waits for a peer that hangs (a peer that dies is seen at once) before it fails,
# so a run with a hung rank ends within about a minute. Long enough for one rank to compile a step
# (Inductor included) while another waits in the collective or the compile-time agreement after it.
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """One or more ranks failed, died, never joined, or did not finish in time.

    ``ranks`` maps every rank that did not return a result to what happened to it:
    ``"failed"`` (raised; its traceback is in the message), ``"died"`` (exited without a result),
    ``"not joined"`` (still running, never called ``init_process_group``), ``"joining"`` (still
    inside ``init_process_group``) or ``"running"`` (joined, still running when stopped).
    ``exceptions`` maps each rank that raised to ``(type, message)`` of what it raised, the type
    as ``"module.QualName"`` (so a caller can report one refusal once, not once per rank).
    """

    def __init__(self, message: str, ranks: dict[int, str] | None = None,
                 exceptions: dict[int, tuple[str, str]] | None = None):
        super().__init__(message)
        self.ranks = dict(ranks or {})
        self.exceptions = dict(exceptions or {})


STORE_HOST = "127.0.0.1"  # the ranks are local: the store is reachable from this host only


def _store(rank: int, world_size: int, port_cell, timeout_s: float) -> dist.TCPStore:
    """The group's store: rank 0 serves it on a loopback socket it bound to port 0 and publishes
    the port in ``port_cell``; the other ranks wait for the port, then connect."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((STORE_HOST, 0))
        listener.listen(max(world_size, 64))  # clients wait in the backlog until the store accepts
        port = listener.getsockname()[1]
        port_cell.value = port
        return dist.TCPStore(STORE_HOST, port, world_size, is_master=True, timeout=timeout, wait_for_workers=True,
                             master_listen_fd=listener.detach())  # the store owns the socket now
    deadline = time.monotonic() + timeout_s
    while port_cell.value == 0:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank {rank} of {world_size} timed out after {timeout_s:g} s waiting for rank 0 to "
                               "open the group's store (rank 0 serves it)")
        time.sleep(0.005)
    return dist.TCPStore(STORE_HOST, port_cell.value, world_size, is_master=False, timeout=timeout)


def _send(conn, msg) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, OSError):  # the caller is gone: nobody to tell
        pass


def _start_method():
    """multiprocessing's context for ranks: ``forkserver`` on Linux, with torch and dsa_dcp imported
    in the server before it forks (see the module docstring), else ``spawn`` (macOS's system
    libraries are not safe to use in a forked child)."""
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dsa_dcp"])  # no effect once the server runs
    return ctx


class _CallersSurroundings:
    """What a rank takes from its caller as it starts (``take()``, first thing in the rank): the
    environment variables and standard output and error (file descriptors 1 and 2). A spawned rank
    has them anyway; a forked one would have the server's, from whenever the server started."""

    def __init__(self, forked: bool, environ: dict[str, str], fds=()):
        self.forked, self.environ, self.fds = forked, environ, fds

    @classmethod
    def now(cls, ctx) -> "_CallersSurroundings":
        """The caller's, as they are now, for a rank ``ctx`` starts."""
        return cls(ctx.get_start_method() == "forkserver", dict(os.environ))

    def __reduce__(self):  # pickled as the rank starts: the descriptors travel with it
        fds = tuple(reduction.DupFd(fd) for fd in (1, 2)) if self.forked else ()
        return type(self), (self.forked, self.environ, fds)

    def take(self) -> None:
        if not self.forked:
            return
        os.environ.clear()
        os.environ.update(self.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.fds):
            source = fd.detach()
            os.dup2(source, target)
            os.close(source)


def _rank_main(fn, rank, world_size, port_cell, args, conn, collective_timeout, before_join, surroundings):
    surroundings.take()
    torch.set_num_threads(1)
    try:
        if before_join is not None:
            before_join(rank, world_size)
        _send(conn, ("joining", None))
        store = _store(rank, world_size, port_cell, collective_timeout)
        os.environ.update(MASTER_ADDR=STORE_HOST, MASTER_PORT=str(port_cell.value))  # for code that reads them
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        _send(conn, ("joined", None))
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # plain bytes: no shared-memory handles that die with this process
        _send(conn, ("result", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        _send(conn, ("exception", (f"{type(e).__module__}.{type(e).__qualname__}", str(e))))
        _send(conn, ("error", traceback.format_exc()))
    finally:
        conn.close()
        if dist.is_initialized():
            _leave_store_last(rank, world_size, collective_timeout)
            dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """Leave without the interpreter's teardown: after the exit handlers (which stop any worker
    processes) and a flush, ``os._exit``. Tearing down a process that imported torch takes
    seconds (freeing every module and C++ static), which the caller would wait for each run."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed: nothing to flush
            pass
    os._exit(0)


def _leave_store_last(rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0's process serves the group's store, which a rank still compiling reads (the backend's
    host check): rank 0 waits, up to ``timeout_s``, until every rank has said it is leaving."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
        store.set(f"dsa_dcp/leaving/{rank}", "1")
        if rank == 0:
            keys = [f"dsa_dcp/leaving/{r}" for r in range(world_size)]
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a rank that died never says so; leave anyway
        pass


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Ranks:
    """What the caller knows about each rank: its phase, result, traceback or exit."""

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        n = len(procs)
        self.phase = ["starting"] * n  # starting -> joining -> joined
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, str] = {}  # insertion order = arrival order
        self.exceptions: dict[int, tuple[str, str]] = {}
        self.dead: dict[int, int | None] = {}
        self.open = set(range(n))  # pipes not yet at EOF

    def pending(self) -> list[int]:
        done = self.results.keys() | self.errors.keys() | self.dead.keys()
        return [r for r in range(len(self.procs)) if r not in done]

    def failed(self) -> bool:
        return bool(self.errors or self.dead)

    def drain(self, r: int) -> None:
        conn = self.conns[r]
        while r in self.open and conn.poll():
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                self.open.discard(r)
                break
            if kind in ("joining", "joined"):
                self.phase[r] = kind
            elif kind == "result":
                self.results[r] = payload
            elif kind == "exception":
                self.exceptions[r] = payload
            else:
                self.errors[r] = payload

    def wait(self, timeout: float) -> None:
        """Block until some pending rank reports or exits (or ``timeout`` passes); record it."""
        pending = self.pending()
        by_handle = {}
        for r in pending:
            if r in self.open:
                by_handle[self.conns[r]] = r
            by_handle[self.procs[r].sentinel] = r
        for handle in wait_ready(list(by_handle), timeout=max(timeout, 0.0)):
            r = by_handle[handle]
            self.drain(r)
            if handle == self.procs[r].sentinel:
                # its pipes close a moment before it can be reaped
                self.procs[r].join(5.0)
                self.drain(r)  # everything it sent before exiting is in the pipe already
                if r not in self.results and r not in self.errors:
                    self.dead[r] = self.procs[r].exitcode

    def report(self, world_size: int, timed_out: float | None) -> RankError:
        ranks: dict[int, str] = {}
        lines: list[str] = []
        details: list[str] = []
        for r, code in self.dead.items():
            before = " before joining the process group" if self.phase[r] != "joined" else ""
            lines.append(f"rank {r} of {world_size} died ({_exit_reason(code)}) without returning a result{before}")
            ranks[r] = "died"
        for r in self.pending():
            if self.phase[r] == "starting":
                lines.append(
                    f"rank {r} of {world_size} never joined the process group (it never called init_process_group)"
                )
                ranks[r] = "not joined"
            elif self.phase[r] == "joining":
                lines.append(f"rank {r} of {world_size} was still inside init_process_group")
                ranks[r] = "joining"
            else:
                lines.append(f"rank {r} of {world_size} was still running")
                ranks[r] = "running"
        for r, tb in self.errors.items():
            lines.append(f"rank {r} of {world_size} raised (traceback below)")
            details.append(f"rank {r} of {world_size} failed:\n{tb}")
            ranks[r] = "failed"
        if timed_out is not None:
            head = f"rank(s) {sorted(self.pending())} did not finish within {timed_out:.0f} s"
        else:
            head = f"{len(ranks)} of {world_size} rank(s) did not return a result"
        stopped = "; every rank still running was stopped" if self.pending() else ""
        message = "\n".join([head + stopped, *("  " + line for line in lines), *details])
        return RankError(message, ranks, {r: self.exceptions[r] for r in self.errors if r in self.exceptions})


def _stop(procs, grace: float) -> None:
    """Terminate what is still running, wait up to ``grace`` s in all, then kill what is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _refuse_unguarded_main() -> None:
    """Each rank is a spawned process that imports the main script again: a script that calls
    ``run_on_ranks`` at its top level, outside ``if __name__ == "__main__":``, would start ranks from
    every rank, which multiprocessing stops with a long error in each. Refuse it here, at once."""
    import ast
    import inspect

    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            break
        frame = frame.f_back
    if frame is None:
        return
    path, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):  # python -c, a notebook, a frozen program: nothing to read
        return

    def guards_main(node) -> bool:
        test = node.test
        return isinstance(test, ast.Compare) and len(test.comparators) == 1 and \
            {ast.unparse(test.left), ast.unparse(test.comparators[0])} in ({"__name__", "'__main__'"},
                                                                           {"__name__", '"__main__"'})

    for node in tree.body:
        if isinstance(node, ast.If) and guards_main(node) and node.lineno <= line <= node.end_lineno:
            return
    raise RuntimeError(
        f"run_on_ranks was called at the top level of the script {path} (line {line}), outside "
        f"`if __name__ == \"__main__\":`. Each rank is a new process that imports the script again, so it "
        f"would start ranks of its own. Put the call under `if __name__ == \"__main__\":`")


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    collective_timeout: float | None = None,
    before_join: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn``, ``args`` and ``before_join`` must be picklable (module-level functions).

    - ``timeout``: seconds for the whole run; ranks not done by then are stopped.
    - ``collective_timeout``: the process group's timeout (default ``DEFAULT_COLLECTIVE_TIMEOUT_S``,
      60 s, or ``timeout`` when that is shorter): how long a rank waits for the others to join,
      inside any one collective, and in the backend's compile-time agreement, before it raises.
    - ``before_join``: called as ``before_join(rank, world_size)`` in each rank before it calls
      ``init_process_group`` (environment set-up; tests use it to make a rank never join).

    Raises ``RankError`` (see the module docstring) when any rank does not return a result. While
    ``keep_ranks()`` is on, the ranks may be kept ones (see there).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _refuse_unguarded_main()
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if _keep and before_join is None and collective_timeout is None and timeout >= DEFAULT_COLLECTIVE_TIMEOUT_S:
        return _run_kept(fn, world_size, args, timeout)
    if collective_timeout is None:
        collective_timeout = min(timeout, DEFAULT_COLLECTIVE_TIMEOUT_S)
    if collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be > 0 seconds, got {collective_timeout}")
    ctx = _start_method()
    port_cell = ctx.Value("i", 0, lock=False)  # rank 0 writes its store's port here, once
    procs, conns = [], []
    try:
        for r in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, port_cell, args, child_end, collective_timeout, before_join,
                      _CallersSurroundings.now(ctx)),
                daemon=True,
            )
            p.start()
            child_end.close()  # the child holds its own copy: EOF here once it is gone
            procs.append(p)
            conns.append(parent_end)
        ranks = _collect(_Ranks(procs, conns), world_size, timeout)
        _stop_after_success(procs)
        return _results(ranks, world_size)
    finally:
        _stop(procs, grace=1.0)
        for c in conns:
            c.close()


def _collect(ranks: _Ranks, world_size: int, timeout: float) -> _Ranks:
    """Wait for every rank's result; raise the ``RankError`` of the first failure (after a grace
    period for the others' reports) or of the timeout."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while ranks.pending():
        now = time.monotonic()
        if now >= deadline:
            raise ranks.report(world_size, timed_out=timeout)
        if ranks.failed():
            if failed_at is None:
                failed_at = now
            if now - failed_at >= FAILURE_GRACE_S:
                break
            ranks.wait(min(deadline, failed_at + FAILURE_GRACE_S) - now)
        else:
            ranks.wait(deadline - now)
    if ranks.failed():
        raise ranks.report(world_size, timed_out=None)
    return ranks


def _results(ranks: _Ranks, world_size: int) -> list[Any]:
    return [torch.load(io.BytesIO(ranks.results[r]), weights_only=False) for r in range(world_size)]


def _stop_after_success(procs) -> None:
    # every rank has returned; give them time to tear down the group and exit on their own
    deadline = time.monotonic() + EXIT_GRACE_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))


# --------------------------------------------------------------------------- ranks kept between runs


_pools: dict[int, "_RankPool"] = {}  # kept ranks, by world size
_keep = False  # whether run_on_ranks uses them now


def keep_ranks(enabled: bool = True) -> None:
    """Keep ranks between ``run_on_ranks`` calls while enabled (a test session's many short runs):
    the ranks of a world size start once and run one function after another, each run in a process
    group of its own (a fresh default group over a fresh part of the store, after
    ``torch.compiler.reset()`` and with torch's generator reseeded as a new process seeds it), so a
    run sees what it would see in new processes except the modules already imported — and except
    where its output goes: kept ranks print where the first run's ranks printed. A run with a
    ``before_join``, its own ``collective_timeout`` or a ``timeout`` under a minute starts its own
    ranks as always; a run in which a rank fails, dies or times out ends that world size's ranks,
    and the next run starts new ones. Disabling keeps them for later; ``stop_kept_ranks()`` ends
    them."""
    global _keep
    _keep = enabled


def stop_kept_ranks() -> None:
    """End every kept rank (``keep_ranks``)."""
    while _pools:
        _pools.popitem()[1].stop()


def _pooled_rank_main(rank, world_size, port_cell, conn, collective_timeout, surroundings):
    """A kept rank: joins the store once, then runs each ``("run", fn, args)`` it is sent in a
    process group of its own, until ``("stop",)``."""
    surroundings.take()
    torch.set_num_threads(1)
    seed = torch.initial_seed()  # what a new process starts its generator with
    store = _store(rank, world_size, port_cell, collective_timeout)
    os.environ.update(MASTER_ADDR=STORE_HOST, MASTER_PORT=str(port_cell.value))
    runs = 0
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] != "run":
            break
        _, fn, args = message
        runs += 1
        try:
            torch.compiler.reset()
            torch.manual_seed(seed)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"run/{runs}/", store), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout))
            value = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(value, buf)
            _send(conn, ("result", buf.getvalue()))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            _send(conn, ("exception", (f"{type(e).__module__}.{type(e).__qualname__}", str(e))))
            _send(conn, ("error", traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    conn.close()
    _exit_now()


class _RankPool:
    """``world_size`` kept ranks (``keep_ranks``)."""

    def __init__(self, world_size: int):
        ctx = _start_method()
        port_cell = ctx.Value("i", 0, lock=False)
        self.world_size, self.procs, self.conns = world_size, [], []
        for r in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_pooled_rank_main, daemon=True,
                            args=(r, world_size, port_cell, child_end, DEFAULT_COLLECTIVE_TIMEOUT_S,
                                  _CallersSurroundings.now(ctx)))
            p.start()
            child_end.close()
            self.procs.append(p)
            self.conns.append(parent_end)

    def run(self, fn, args, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send(("run", fn, args))
        ranks = _Ranks(self.procs, self.conns)
        ranks.phase = ["joined"] * self.world_size
        return _results(_collect(ranks, self.world_size, timeout), self.world_size)

    def stop(self) -> None:
        for conn in self.conns:
            _send(conn, ("stop",))
        _stop_after_success(self.procs)
        _stop(self.procs, grace=1.0)
        for conn in self.conns:
            conn.close()


def _run_kept(fn, world_size: int, args, timeout: float) -> list[Any]:
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _pools.pop(world_size, None)  # a failed run may leave its ranks anywhere: start new ones next time
        pool.stop()
        raise


def init_from_env(backend: str | None = None, timeout: float | None = None) -> tuple[int, int]:
    """Initialize the default group from ``torchrun``'s environment; returns ``(rank, world_size)``.

    NCCL with one GPU per local rank when CUDA is available, gloo otherwise. ``timeout`` (seconds)
    is the process group's timeout for joining and for each collective; ``None`` means
    ``DEFAULT_COLLECTIVE_TIMEOUT_S`` on gloo (CPU ranks: a hung peer ends the run within about a
    minute) and torch's default on NCCL (its watchdog and ``TORCH_NCCL_*`` settings apply).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if timeout is None and backend == "gloo":
            timeout = DEFAULT_COLLECTIVE_TIMEOUT_S
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()
