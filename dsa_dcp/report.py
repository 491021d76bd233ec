"""What one compilation did: ``CompileReport``, and the latest one (``dsa_dcp.backend_report()``).

A report is plain data: the options, this rank, each pass's result, the graph's code before and
after, a summary, the warnings shown, and a copy of the final graph (its nodes carry their
metadata, so the inspection tool analyses it without running it). It holds the lowered step only
weakly: a report never keeps a compiled step, its CUDA graphs or their memory pool alive. The
inspection tool (``dsa_dcp.inspection``, called as ``dsa_dcp.inspect``) reads reports; the compiler never imports it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch.fx as fx

from dsa_dcp.config import DCPOptions
from dsa_dcp.passes.base import PassResult


@dataclasses.dataclass
class CompileReport:
    """What one compilation did: the options, this rank, and every pass's result in order."""

    options: DCPOptions
    rank: int
    graph_before: str
    passes: list[PassResult]
    graph_after: str = ""
    summary: dict[str, int] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    graph: fx.GraphModule | None = None  # a copy of the final graph, for the inspection tool
    process_group: str = ""  # the group this rank was compiled in, as seen at compile time
    _lowered: Callable[[], Any] | None = dataclasses.field(default=None, repr=False)

    @property
    def lowered(self) -> Any:
        """What runs each step (a ``CudaGraphStep`` on CUDA), while the compiled function holds it."""
        return self._lowered() if self._lowered is not None else None

    def hold_lowered(self, step: Any) -> None:
        try:
            self._lowered = weakref.ref(step)
        except TypeError:  # a bound method (the fx lowering): nothing worth holding
            self._lowered = None

    def kernels_per_step(self) -> dict | None:
        """CUDA kernels replayed per step, per captured input shape (``None`` without CUDA graphs,
        and for a DCP group: counting runs the step once more, and its collectives would wait for
        ranks that are not counting, or that count at another time)."""
        step = self.lowered
        if self.options.dcp_size > 1 or not hasattr(step, "kernels_per_step"):
            return None
        return step.kernels_per_step()

    def stats(self) -> dict[str, dict[str, Any]]:
        return {p.name: p.stats for p in self.passes}


_last_report: CompileReport | None = None


def last_report() -> CompileReport | None:
    """The report of the most recent compilation in this process."""
    return _last_report


def set_last_report(report: CompileReport) -> None:
    global _last_report
    _last_report = report


def forget_last_report() -> None:
    """Drop the most recent report."""
    global _last_report
    _last_report = None


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (node metadata shared, not copied) that later lowering cannot change."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def process_group_note(dcp_size: int) -> str:
    """The process group this rank compiles in, in words."""
    import torch.distributed as dist

    if dcp_size == 1:
        return "none (dcp_size = 1)"
    if dist.is_available() and dist.is_initialized():
        return f"{dist.get_backend()} backend, rank {dist.get_rank()} of {dist.get_world_size()}"
    return "none"
