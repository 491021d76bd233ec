"""The pass list, in one place. Each pass is one module of this package.

A pipeline has two phases: ``normalize`` passes cannot refuse a graph and change no value beyond
floating-point reassociation and the indexer's documented tie rule (they run first, so every check
sees one spelling of the op vocabulary: ``dsa_dcp`` ops called one way, the model's indexer as
``index_scores`` + ``topk_select``); ``rewrite`` passes are all checked before any of them runs
(``DCPPass.check`` returns the plan ``run`` carries out), so a refused graph is left untouched.
"""

from __future__ import annotations

import dataclasses

from dsa_dcp.passes.base import CompileContext, DCPPass
from dsa_dcp.passes.canonicalize import Canonicalize
from dsa_dcp.passes.dcp_rewrite import DCPRewrite
from dsa_dcp.passes.fuse_remaps import FuseRemaps
from dsa_dcp.passes.index_cache import IndexCache
from dsa_dcp.passes.indexer import IndexerKernels
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
    """The ordered passes for these options (at ``dcp_size == 1`` only the indexer's kernels)."""
    indexer: list[DCPPass] = [IndexerKernels()] if ctx.options.indexer_kernels else []
    if ctx.dcp_size == 1:
        return Pipeline(indexer, [])
    rewrite: list[DCPPass] = [IndexCache(), LocalizeKVWrites(), DCPRewrite()]
    if ctx.options.share_remaps:
        rewrite.append(ShareRemaps())
    rewrite.append(FuseRemaps())
    return Pipeline([Canonicalize(), *indexer], rewrite)
