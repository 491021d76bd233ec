"""The error the passes raise for a graph they refuse to rewrite."""

from __future__ import annotations

import torch.fx as fx


class DCPRewriteError(ValueError):
    """The model's graph cannot be rewritten for these options (raised at compile time)."""


def where(node: fx.Node) -> str:
    """``"\\n  at <user source line>"`` for error messages, when dynamo recorded it."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    return "\n  at " + " | ".join(lines[-2:])
