"""A line per stage of long work, with the time since it began: ``[  3.2s] rank 0: compiled``.

Written to stderr (stdout keeps the result), flushed at once so a slow stage shows while it runs.
The start is a wall-clock time, so rank processes report against the time their parent started.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
