"""Compile options: one frozen, validated dataclass parsed from ``torch.compile(options=...)``."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

MERGE_MODES = ("ag", "a2a", "ag_rs")
LOWERINGS = ("fx", "inductor")


class OptionsError(ValueError):
    """A compile option is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class DCPOptions:
    """Options of the ``dsa_dcp`` backend.

    dcp_size:     ranks in the DCP group (1 = no context parallelism: the graph is left as written).
    group:        the ``torch.distributed`` process group of the DCP ranks (or its group name);
                  ``None`` means the default (world) group. Its size must equal ``dcp_size``.
    rank:         this rank in the group; ``None`` asks the group. Set it only to compile for a
                  rank without a live group (inspection).
    merge:        how partial attention results are merged: one of ``MERGE_MODES``.
    interleave:   consecutive slots kept together on one rank (slot ``s`` lives on ``(s // I) % N``).
    lowering:     ``"fx"`` runs the rewritten FX graph as Python code; ``"inductor"`` hands it to
                  Inductor (AOT autograd + codegen) with the custom ops as fallback kernels.
    """

    dcp_size: int = 1
    group: Any = None
    rank: int | None = None
    merge: str = "a2a"
    interleave: int = 1
    lowering: str = "fx"

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
        if self.rank is not None and not (
            isinstance(self.rank, int) and isinstance(self.dcp_size, int) and 0 <= self.rank < self.dcp_size
        ):
            p.append(f"rank must be None or in [0, dcp_size), got {self.rank!r}")
        return p

    def cache_key(self) -> str:
        """A digest of everything that changes the compiled graph (the group by its size/name)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "group"}
        fields["group"] = self.group if isinstance(self.group, (str, type(None))) else getattr(self.group, "group_name", repr(self.group))
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]
