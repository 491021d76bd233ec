"""The pass list, in one place. Each pass is one module of this package.

A pipeline has two phases: ``normalize`` passes change no value and cannot refuse a graph (they
run first, so every check sees one spelling of the op vocabulary); ``rewrite`` passes are all
checked before any of them runs (``DCPPass.check`` returns the plan ``run`` carries out), so a
refused graph is left untouched.
"""

from __future__ import annotations

import dataclasses

from dsa_dcp.passes.base import CompileContext, DCPPass
from dsa_dcp.passes.canonicalize import Canonicalize
from dsa_dcp.passes.dcp_rewrite import DCPRewrite
from dsa_dcp.passes.kv_writes import LocalizeKVWrites
from dsa_dcp.passes.share_remaps import ShareRemaps


@dataclasses.dataclass
class Pipeline:
    normalize: list[DCPPass]
    rewrite: list[DCPPass]

    def __iter__(self):
        return iter(self.normalize + self.rewrite)

    def __len__(self) -> int:
        return len(self.normalize) + len(self.rewrite)


def build_pipeline(ctx: CompileContext) -> Pipeline:
    """The ordered passes for these options (none when ``dcp_size == 1``: the graph is kept)."""
    if ctx.dcp_size == 1:
        return Pipeline([], [])
    rewrite: list[DCPPass] = [LocalizeKVWrites(), DCPRewrite()]
    if ctx.options.share_remaps:
        rewrite.append(ShareRemaps())
    return Pipeline([Canonicalize()], rewrite)
