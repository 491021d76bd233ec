"""Compile options: one frozen, validated dataclass parsed from ``torch.compile(options=...)``."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

MERGE_MODES = ("ag", "a2a", "ag_rs", "fused_a2a")
LOWERINGS = ("fx", "inductor")
# torch.compile's ``mode=`` values this backend maps; anything else ("lite", a typo) is refused.
# reduce-overhead: CUDA graphs on a CUDA step (this backend's default there anyway);
# max-autotune(-no-cudagraphs): Inductor lowering with its autotuning (without CUDA graphs).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
INDEX_CACHES = ("replicated", "sharded")
# Sizes reach the kernels as 32-bit integer arguments (Triton's default for Python ints), and a slot
# id's owner is computed with ``dcp_size * interleave``: both must fit.
MAX_SIZE = 2**31 - 1


class OptionsError(ValueError):
    """A compile option is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class DCPOptions:
    """Options of the ``dsa_dcp`` backend.

    dcp_size:     ranks in the DCP group (1 = no context parallelism: the graph is left as written).
    group:        the ``torch.distributed`` process group of the DCP ranks, or its group name (a
                  string naming a group of this process, checked at compile time); ``None`` means
                  the default (world) group. Its size must equal ``dcp_size``.
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
    debug_checks: check at run time, before every collective the rewrite adds, that the ranks are at
                  the same point of the same step, that top-k slots are in range and that every rank
                  computed the same top-k (host syncs; off by default). They run Python between
                  kernels, so unless given, ``lowering`` becomes ``"fx"`` and ``cuda_graphs`` False.
    indexer_kernels: replace the lightning indexer as the model writes it (gather, einsums, relu,
                  mask, ``torch.topk``) with the ``index_scores`` and ``topk_select`` ops (the
                  ``indexer_kernels`` pass, at every ``dcp_size``); ``False`` keeps it as written.
    index_cache:  ``"replicated"`` (every rank holds every index key and computes the global
                  top-k) or ``"sharded"`` (each rank holds the keys of the slots it owns, scores
                  those, and the group agrees on the top-k with one all-gather per indexer layer;
                  the caches must be allocated for it, and it needs ``indexer_kernels``).
    replicate_q:  for layers that hold a tensor-parallel shard of the heads (DCP inside TP): each
                  rank holds its DCP group's query weights (``wq_b`` rows and absorbed ``W_UK`` of
                  the group's heads, gathered once at compile time) and computes the group's query
                  itself (default); ``False`` all-gathers the query over the DCP group each layer.
    mode:         ``torch.compile``'s ``mode=`` (one of ``MODES``), also given as an option:
                  ``"reduce-overhead"`` keeps CUDA graphs on for a CUDA step (refuses
                  ``cuda_graphs=False``); ``"max-autotune"`` and ``"max-autotune-no-cudagraphs"``
                  lower with Inductor (``lowering="inductor"`` unless ``lowering`` is given, and
                  ``"fx"`` is refused) and turn on its autotuning (``inductor_config()``);
                  ``-no-cudagraphs`` also means ``cuda_graphs=False`` unless given.
    replicated_modules: names of modules (``"mtp"``: ``model.get_submodule(name)``) left out of the
                  DCP rewrite: their attention stays single-rank attention over caches every rank
                  holds whole (the ``replicated_modules`` pass; a speculative decoding draft).
    draft_length: the draft length k of speculative decoding, when the program serves one: a step
                  whose attention is split over the group (the verify step) must have a multiple of
                  ``k + 1`` rows (each request verifies its k drafted tokens and the token before them).
    draft_topk:   drafted candidates per step: 1 (a chain); tree drafts are not supported.

    Every value is checked by type: flags are ``True``/``False`` (not ``1``/``0``), sizes are
    ``int`` (not ``bool`` or ``float``) in ``[1, MAX_SIZE]``, and ``dcp_size * interleave <= MAX_SIZE``.
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
    mode: str = "default"
    indexer_kernels: bool = True
    index_cache: str = "replicated"
    replicate_q: bool = True
    replicated_modules: tuple[str, ...] = ()
    draft_length: int | None = None
    draft_topk: int = 1

    @classmethod
    def parse(cls, options: dict[str, Any] | DCPOptions | None) -> DCPOptions:
        """Build options from a user's dict; every problem is reported in one ``OptionsError``."""
        if isinstance(options, DCPOptions):
            problems = options.problems()
            if problems:
                raise OptionsError("invalid dsa_dcp options:\n  " + "\n  ".join(problems))
            return options
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise OptionsError(
                f"options must be a dict of dsa_dcp options (or a DCPOptions), got {type(options).__name__} "
                f"{options!r}; e.g. options={{'dcp_size': 2, 'merge': 'a2a'}}"
            )
        options = dict(options)
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted((k for k in options if k not in valid), key=repr)
        if unknown:
            raise OptionsError(f"unknown dsa_dcp option(s) {unknown}; valid options are {valid}")
        for name in ("batch_sizes", "replicated_modules"):
            if isinstance(options.get(name), list):
                options[name] = tuple(options[name])
        mode = options.get("mode")
        if mode in _AUTOTUNE_MODES:  # the mode picks what the user left unsaid
            options.setdefault("lowering", "inductor")
            if mode == "max-autotune-no-cudagraphs":
                options.setdefault("cuda_graphs", False)
        if options.get("debug_checks") is True:  # the checks run Python between kernels
            options.setdefault("lowering", "fx")
            options.setdefault("cuda_graphs", False)
        opts = cls(**options)
        problems = opts.problems()
        if problems:
            raise OptionsError("invalid dsa_dcp options:\n  " + "\n  ".join(problems))
        return opts

    def problems(self) -> list[str]:
        """One message per bad value: the option, the value given and what is allowed."""
        p = []

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def positive_int(value: object) -> bool:
            return is_int(value) and 1 <= value <= MAX_SIZE

        def size_problem(name: str, value: object, what: str = "an integer >= 1") -> str:
            if is_int(value) and value > MAX_SIZE:
                return (f"{name} must be at most {MAX_SIZE} (sizes reach the kernels as 32-bit integers), got "
                        f"{value!r}")
            return f"{name} must be {what}, got {value!r}"

        if not positive_int(self.dcp_size):
            p.append(size_problem("dcp_size", self.dcp_size))
        if not _is_group(self.group):
            p.append(f"group must be None (the world group), a torch.distributed ProcessGroup or a group "
                     f"name (str), got {type(self.group).__name__} {self.group!r}")
        if self.rank is not None and not (is_int(self.rank) and is_int(self.dcp_size) and 0 <= self.rank < self.dcp_size):
            allowed = f" (with dcp_size={self.dcp_size}: an int 0 to {self.dcp_size - 1})" if positive_int(self.dcp_size) else ""
            p.append(f"rank must be None or in [0, dcp_size), got {self.rank!r}{allowed}")
        if not _member(self.merge, MERGE_MODES):
            p.append(f"merge must be one of {list(MERGE_MODES)}, got {self.merge!r}")
        if not positive_int(self.interleave):
            p.append(size_problem("interleave", self.interleave))
        elif positive_int(self.dcp_size) and self.dcp_size * self.interleave > MAX_SIZE:
            p.append(f"dcp_size * interleave must be at most {MAX_SIZE} (the kernels compute slot owners with it "
                     f"in 32-bit integers), got {self.dcp_size} * {self.interleave}")
        if not _member(self.lowering, LOWERINGS):
            p.append(f"lowering must be one of {list(LOWERINGS)}, got {self.lowering!r}")
        for flag in ("share_remaps", "allow_multi_host", "debug_checks", "indexer_kernels", "replicate_q"):
            if not isinstance(getattr(self, flag), bool):
                p.append(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            p.append(f"cuda_graphs must be None, True or False, got {self.cuda_graphs!r}")
        if not (
            isinstance(self.batch_sizes, tuple)
            and self.batch_sizes
            and all(positive_int(b) for b in self.batch_sizes)
            and list(self.batch_sizes) == sorted(set(self.batch_sizes))
        ):
            p.append(f"batch_sizes must be a non-empty increasing list of integers >= 1 (at most {MAX_SIZE}), got "
                     f"{self.batch_sizes!r}")
        if self.page_size is not None and not positive_int(self.page_size):
            p.append(size_problem("page_size", self.page_size, "None or an integer >= 1"))
        if not _member(self.mode, MODES):
            p.append(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        elif self.mode in _AUTOTUNE_MODES and self.lowering == "fx":
            p.append(f"mode={self.mode!r} autotunes Inductor's kernels, so it needs lowering='inductor', "
                     f"got lowering='fx'")
        if self.mode == "reduce-overhead" and self.cuda_graphs is False:
            p.append("mode='reduce-overhead' means CUDA graphs, but cuda_graphs=False; drop one of them")
        if self.mode == "max-autotune-no-cudagraphs" and self.cuda_graphs is True:
            p.append("mode='max-autotune-no-cudagraphs' means no CUDA graphs, but cuda_graphs=True; drop one of them")
        if not _member(self.index_cache, INDEX_CACHES):
            p.append(f"index_cache must be one of {list(INDEX_CACHES)}, got {self.index_cache!r}")
        elif self.index_cache == "sharded" and self.indexer_kernels is False:
            p.append("index_cache='sharded' needs indexer_kernels=True: the sharded scores and the top-k "
                     "agreement replace the indexer the indexer_kernels pass recognizes")
        if not (isinstance(self.replicated_modules, tuple) and all(
                isinstance(m, str) and m and not m.startswith(".") and not m.endswith(".")
                for m in self.replicated_modules) and len(set(self.replicated_modules)) == len(self.replicated_modules)):
            p.append(f"replicated_modules must be a list of distinct module names (dotted paths such as 'mtp' or "
                     f"'mtp.layer'), got {self.replicated_modules!r}")
        if self.draft_length is not None and not positive_int(self.draft_length):
            p.append(size_problem("draft_length", self.draft_length, "None or an integer >= 1"))
        if not is_int(self.draft_topk) or self.draft_topk != 1:
            p.append(f"draft_topk must be 1: the draft is a chain (one token a step, top-k 1); tree drafts "
                     f"(several candidates a step) are not supported, got {self.draft_topk!r}")
        return p

    def inductor_config(self) -> dict[str, Any]:
        """Inductor config patches for the ``inductor`` lowering (what ``mode`` asks of it).

        Over a group of more than one rank, Inductor's deterministic mode as well: it skips the
        on-device benchmarking whose choice changes numerics (a reduction's block sizes), so every
        rank computes the values the ranks replicate (the merged hidden state, the logits, a
        draft's cache) bit for bit alike. Each rank benchmarking on its own picks by timing noise,
        and two ranks that round a hidden state differently write different draft-cache rows or,
        on a near tie, decode different tokens.
        """
        import torch._inductor.config as inductor  # torch's own import, kept off this module's

        config: dict[str, Any] = {}
        if self.mode in _AUTOTUNE_MODES:
            config.update(max_autotune=True, coordinate_descent_tuning=True)
        if self.dcp_size > 1 and hasattr(inductor, "deterministic"):
            config["deterministic"] = True
        return config

    def cache_key(self) -> str:
        """A digest of everything that changes the compiled graph (the group by its size/name)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "group"}
        fields["group"] = self.group if isinstance(self.group, (str, type(None))) else getattr(self.group, "group_name", repr(self.group))
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def _member(value: object, allowed: tuple[str, ...]) -> bool:
    return isinstance(value, str) and value in allowed


def _is_group(group: object) -> bool:
    if group is None or isinstance(group, str):
        return True
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # a torch built without distributed: only None and names parse
        return False
    return isinstance(group, ProcessGroup)


def resolve_group(group: Any) -> Any:
    """The ``ProcessGroup`` an option names (``None``: the world group); compile time, with
    ``torch.distributed`` initialized. An unknown group name is an ``OptionsError`` listing the
    names of this process's groups."""
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if not isinstance(group, str):
        return group
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group)
    except (RuntimeError, ValueError, KeyError) as e:
        try:
            from torch.distributed.distributed_c10d import _world

            names = sorted(_world.pg_names.values())
        except Exception:  # noqa: BLE001 - the list is a courtesy; the refusal stands without it
            names = []
        raise OptionsError(
            f"group={group!r} names no process group of this process; the groups here are {names} "
            "(the world group is named by its group_name, or pass group=None)"
        ) from e
