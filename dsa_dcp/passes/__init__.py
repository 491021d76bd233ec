"""The pass list, in one place. Each pass is one module of this package."""

from __future__ import annotations

from dsa_dcp.passes.base import CompileContext, DCPPass


def build_pipeline(ctx: CompileContext) -> list[DCPPass]:
    """The ordered passes for these options (none when ``dcp_size == 1``: the graph is kept)."""
    return []
