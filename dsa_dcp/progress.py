"""A line per stage of long work, with the time since it began: ``[  3.2s] rank 0: compiled``.

Written to stderr (stdout keeps the result), flushed at once so a slow stage shows while it runs.
The start is a wall-clock time, so rank processes report against the time their parent started.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

_compiled = 0  # graphs this process compiled, for the compile lines' numbers


def compile_lines_enabled() -> bool:
    """The backend's two lines per graph (``DSA_DCP_QUIET=1`` turns them off)."""
    return os.environ.get("DSA_DCP_QUIET", "") in ("", "0")


def compiling(what: str, rank: int) -> tuple[int, float]:
    """``dsa_dcp: compiling graph 3 (412 nodes, 4 attention layers) for rank 0 of 2``, on stderr
    (rank 0 only, so a group prints one line); returns (the graph's number, its start time)."""
    global _compiled
    _compiled += 1
    if rank == 0 and compile_lines_enabled():
        print(f"dsa_dcp: compiling graph {_compiled} {what}", file=sys.stderr, flush=True)
    return _compiled, time.time()


def compiled(number: int, start: float, rank: int) -> None:
    """``dsa_dcp: compiled graph 3 in 41.2 s`` (see :func:`compiling`)."""
    if rank == 0 and compile_lines_enabled():
        print(f"dsa_dcp: compiled graph {number} in {time.time() - start:.1f} s", file=sys.stderr, flush=True)


class Progress:
    """``progress("compiled")`` prints ``[ elapsed] {prefix}compiled`` unless disabled."""

    def __init__(self, prefix: str = "", *, start: float | None = None, enabled: bool = True,
                 stream: TextIO | None = None):
        self.prefix = prefix
        self.start = time.time() if start is None else start
        self.enabled = enabled
        self.stream = stream

    def __call__(self, stage: str) -> None:
        if not self.enabled:
            return
        stream = self.stream or sys.stderr
        print(f"[{time.time() - self.start:6.1f}s] {self.prefix}{stage}", file=stream, flush=True)

    def child(self, prefix: str, enabled: bool = True) -> Progress:
        """The same clock under another prefix (a rank's stages), on only where ``enabled``."""
        return Progress(prefix, start=self.start, enabled=self.enabled and enabled, stream=self.stream)
