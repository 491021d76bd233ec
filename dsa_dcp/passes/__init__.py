"""The pass list, in one place. Each pass is one module of this package."""

from __future__ import annotations

from dsa_dcp.passes.base import CompileContext, DCPPass
from dsa_dcp.passes.dcp_rewrite import DCPRewrite
from dsa_dcp.passes.fuse_merge import FuseMergeA2A
from dsa_dcp.passes.kv_writes import LocalizeKVWrites
from dsa_dcp.passes.recognize_attention import RecognizeSparseAttention
from dsa_dcp.passes.share_remaps import ShareRemaps
from dsa_dcp.position_cache import PositionShardedCache


def build_pipeline(ctx: CompileContext) -> list[DCPPass]:
    """The ordered passes for these options (none when ``dcp_size == 1``: the graph is kept)."""
    if ctx.dcp_size == 1:
        return []
    passes: list[DCPPass] = [LocalizeKVWrites(), DCPRewrite()]
    if any(isinstance(x, PositionShardedCache) for x in ctx.example_inputs):
        # models written elsewhere (position caches, dense masked attention) are brought to the
        # op vocabulary first (docs/models.md)
        passes.insert(0, RecognizeSparseAttention())
    if ctx.options.share_remaps:
        passes.append(ShareRemaps())
    if ctx.options.merge == "fused_a2a":
        passes.append(FuseMergeA2A())
    return passes
