"""Compile options: one frozen, validated dataclass parsed from ``torch.compile(options=...)``."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

MERGE_MODES = ("ag", "a2a", "ag_rs", "fused_a2a")
LOWERINGS = ("fx", "inductor")
INDEX_CACHES = ("replicated", "sharded")


class OptionsError(ValueError):
    """A compile option is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class DCPOptions:
    """Options of the ``dsa_dcp`` backend.

    dcp_size:     ranks in the DCP group (1 = no context parallelism: the graph is left as written).
    group:        the ``torch.distributed`` process group of the DCP ranks (or its group name);
                  ``None`` means the default (world) group. Its size must equal ``dcp_size``.
    rank:         this rank in the group; ``None`` asks the group. A value is checked against the
                  group's (inspection compiles for rank 0 of a fake group).
    merge:        how partial attention results are merged: one of ``MERGE_MODES``.
    interleave:   consecutive slots kept together on one rank (slot ``s`` lives on ``(s // I) % N``).
    lowering:     ``"inductor"`` (default) hands the rewritten graph to Inductor (AOT autograd +
                  codegen: everything stock torch.compile gives the model, the custom ops as
                  fallback kernels); ``"fx"`` runs it as Python code (for debugging, and what
                  ``debug_checks`` needs).
    share_remaps: layers that read the same top-k share one ``topk_remap`` (the ``share_remaps``
                  pass); ``False`` keeps one remap per attention layer.
    cuda_graphs:  replay the step from CUDA graphs: ``None`` = when the step runs on CUDA; ``True``
                  on a CPU step is an error.
    batch_sizes:  row buckets: an engine pads a step's rows up to one of these (one CUDA graph
                  each); a step with more rows than the largest runs uncaptured.
    page_size:    the KV pool's page size, when known: ``interleave`` must divide it.
    allow_multi_host: compile a DCP group whose ranks are on several hosts (refused by default).
    debug_checks: check at run time that top-k slots are in range and that every rank computed the
                  same top-k (one checksum all-gather per attention layer; off by default).
    indexer_kernels: replace the lightning indexer as the model writes it (gather, einsums, relu,
                  mask, ``torch.topk``) with the ``index_scores`` and ``topk_select`` ops (the
                  ``indexer_kernels`` pass, at every ``dcp_size``); ``False`` keeps it as written.
    index_cache:  ``"replicated"`` (every rank holds every index key and computes the global
                  top-k) or ``"sharded"`` (each rank holds the keys of the slots it owns, scores
                  those, and the group agrees on the top-k with one all-gather per indexer layer;
                  the caches must be allocated for it, and it needs ``indexer_kernels``).
    """

    dcp_size: int = 1
    group: Any = None
    rank: int | None = None
    merge: str = "a2a"
    interleave: int = 1
    lowering: str = "inductor"
    share_remaps: bool = True
    cuda_graphs: bool | None = None
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    page_size: int | None = None
    allow_multi_host: bool = False
    debug_checks: bool = False
    indexer_kernels: bool = True
    index_cache: str = "replicated"

    @classmethod
    def parse(cls, options: dict[str, Any] | DCPOptions | None) -> DCPOptions:
        """Build options from a user's dict; every problem is reported in one ``OptionsError``."""
        if isinstance(options, DCPOptions):
            return options
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise OptionsError(f"unknown dsa_dcp option(s) {unknown}; valid options are {valid}")
        if isinstance(options.get("batch_sizes"), list):
            options["batch_sizes"] = tuple(options["batch_sizes"])
        opts = cls(**options)
        problems = opts.problems()
        if problems:
            raise OptionsError("invalid dsa_dcp options:\n  " + "\n  ".join(problems))
        return opts

    def problems(self) -> list[str]:
        p = []

        def positive_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        if not positive_int(self.dcp_size):
            p.append(f"dcp_size must be an integer >= 1, got {self.dcp_size!r}")
        if not positive_int(self.interleave):
            p.append(f"interleave must be an integer >= 1, got {self.interleave!r}")
        if self.merge not in MERGE_MODES:
            p.append(f"merge must be one of {list(MERGE_MODES)}, got {self.merge!r}")
        if self.lowering not in LOWERINGS:
            p.append(f"lowering must be one of {list(LOWERINGS)}, got {self.lowering!r}")
        for flag in ("allow_multi_host", "debug_checks"):
            if not isinstance(getattr(self, flag), bool):
                p.append(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.page_size is not None and not positive_int(self.page_size):
            p.append(f"page_size must be None or an integer >= 1, got {self.page_size!r}")
        if self.cuda_graphs not in (None, True, False):
            p.append(f"cuda_graphs must be None, True or False, got {self.cuda_graphs!r}")
        if not (
            isinstance(self.batch_sizes, tuple)
            and self.batch_sizes
            and all(positive_int(b) for b in self.batch_sizes)
            and list(self.batch_sizes) == sorted(set(self.batch_sizes))
        ):
            p.append(f"batch_sizes must be a non-empty increasing list of integers >= 1, got {self.batch_sizes!r}")
        if not isinstance(self.share_remaps, bool):
            p.append(f"share_remaps must be True or False, got {self.share_remaps!r}")
        if self.rank is not None and not (
            isinstance(self.rank, int) and isinstance(self.dcp_size, int) and 0 <= self.rank < self.dcp_size
        ):
            p.append(f"rank must be None or in [0, dcp_size), got {self.rank!r}")
        if not isinstance(self.indexer_kernels, bool):
            p.append(f"indexer_kernels must be True or False, got {self.indexer_kernels!r}")
        if self.index_cache not in INDEX_CACHES:
            p.append(f"index_cache must be one of {list(INDEX_CACHES)}, got {self.index_cache!r}")
        elif self.index_cache == "sharded" and self.indexer_kernels is False:
            p.append("index_cache='sharded' needs indexer_kernels=True: the sharded scores and the top-k "
                     "agreement replace the indexer the indexer_kernels pass recognizes")
        return p

    def cache_key(self) -> str:
        """A digest of everything that changes the compiled graph (the group by its size/name)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "group"}
        fields["group"] = self.group if isinstance(self.group, (str, type(None))) else getattr(self.group, "group_name", repr(self.group))
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]
