"""The pass list, in one place. Each pass is one module of this package.

Every pass has one shape: ``check(gm, ctx)`` returns its ``Plan`` (problems included), ``run(gm,
ctx, plan)`` carries the plan out. A pipeline has three phases, which differ in when the checks run:

- ``normalize`` passes bring the graph to the op vocabulary; they change no value beyond
  floating-point reassociation and the indexer's documented tie rule, and nothing they do depends
  on the rank: one spelling of every ``dsa_dcp`` op call, attention and caches as models written
  elsewhere spell them, the model's indexer as ``index_scores`` + ``topk_select``. Each is checked,
  then run, in turn, so the validation below reads only the vocabulary.
- ``rewrite`` passes make the program DCP: they are all checked in the one validation phase
  (``dsa_dcp.validate``) before any of them runs, so a refused graph is left untouched.
- ``finish`` passes never refuse; each plans on the rewritten graph (``check``), then runs: remap
  sharing and fusion, which remove work the rewrite's per-layer form repeats, and the run-time
  checks inserted where the step's slot ids enter it.
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
from dsa_dcp.passes.recognize_attention import RecognizeSparseAttention
from dsa_dcp.passes.replicated import ReplicatedModules
from dsa_dcp.passes.share_remaps import ShareRemaps
from dsa_dcp.passes.slot_bounds import SlotBounds
from dsa_dcp.passes.step_inputs import StepInputs
from dsa_dcp.position_cache import PositionShardedCache


@dataclasses.dataclass
class Pipeline:
    normalize: list[DCPPass]
    rewrite: list[DCPPass]
    finish: list[DCPPass] = dataclasses.field(default_factory=list)

    def __iter__(self):
        return iter(self.normalize + self.rewrite + self.finish)

    def __len__(self) -> int:
        return len(self.normalize) + len(self.rewrite) + len(self.finish)


def build_pipeline(ctx: CompileContext) -> Pipeline:
    """The ordered passes for these options (at ``dcp_size == 1`` only the indexer's kernels, over
    position caches the sparse attention the model wrote densely, and the replicated modules' checks)."""
    indexer: list[DCPPass] = [IndexerKernels()] if ctx.options.indexer_kernels else []
    # models written elsewhere: dense top-k-masked attention over position caches (docs/models.md)
    recognize: list[DCPPass] = [RecognizeSparseAttention()] \
        if any(isinstance(x, PositionShardedCache) for x in ctx.example_inputs) else []
    # modules left out of the rewrite (a speculative decoding draft): marked last, on the vocabulary
    replicated: list[DCPPass] = [ReplicatedModules()] \
        if ctx.options.replicated_modules or ctx.options.draft_length is not None else []
    if ctx.dcp_size == 1:
        return Pipeline(recognize + indexer + replicated, [])
    normalize: list[DCPPass] = [Canonicalize()] + recognize + indexer + replicated
    rewrite: list[DCPPass] = [IndexCache(), LocalizeKVWrites(), DCPRewrite()]
    finish: list[DCPPass] = [ShareRemaps()] if ctx.options.share_remaps else []
    finish.append(FuseRemaps())
    finish.append(SlotBounds())  # after the others: it checks the global slot ids their nodes read
    if ctx.options.debug_checks:
        finish.append(StepInputs())  # inserts at the graph's start: before every collective
    return Pipeline(normalize, rewrite, finish)
