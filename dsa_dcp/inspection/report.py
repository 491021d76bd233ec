"""The inspection report of one compilation: summary, passes, collectives, memory plan, picture.

``inspect(compiled)`` finds the ``CompileReport`` the backend filed for a ``torch.compile`` result
(``registry``) and wraps it in an ``Inspection``, which renders as text, JSON (schema in
``docs/inspect.md``; ``SCHEMA`` names its version) or a self-contained HTML page with the dataflow
picture inline, and writes all of them (plus the picture as SVG and PNG, and each graph as
Python code) into a folder.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from typing import Any

import torch

from dsa_dcp import registry
from dsa_dcp.inspection.capacity import CapacityPlan
from dsa_dcp.inspection.memory import MemoryPlan, memory_plan
from dsa_dcp.inspection import render
from dsa_dcp.inspection.render import jsonable

SCHEMA = "dsa-dcp-inspect/1"
NO_KERNEL_COUNT = "n/a (no CUDA graph lowering)"
NO_KERNEL_COUNT_DCP = "n/a (counting runs a step, whose collectives need every rank of the group)"
SHARE_PASS = "share_remaps"


def inspect(compiled: Any, *, config: Any = None, kv_dtype: str | None = None, slots: int | None = None,
            gpu_mem_gib: float | None = None, target: dict | None = None,
            capacity: CapacityPlan | None = None) -> Inspection:
    """The ``Inspection`` of the last ``dsa_dcp`` compilation of ``compiled``.

    ``compiled`` is what ``torch.compile(..., backend="dsa_dcp")`` returned, or the module or
    function given to it; it must have run once (dynamo compiles on the first call). The memory
    plan is included when a ``DSAConfig`` is known: ``config`` (an object or a name), else the
    compiled module's ``cfg`` attribute. ``capacity`` (a ``capacity.capacity_plan``: weights and KV
    tokens per rank under TP with DCP inside it) is carried into the report as it is.
    """
    reports = registry.reports_for(compiled)
    if not reports:
        raise LookupError(
            f"no dsa_dcp compilation found for {_describe(compiled)}: compile it with "
            "torch.compile(..., backend='dsa_dcp') and call it once (dynamo compiles on the first call)"
        )
    report = reports[-1]
    module = getattr(compiled, "_orig_mod", compiled)
    if config is None:
        config = getattr(module, "cfg", None)
    plan = None
    if config is not None and (isinstance(config, str) or hasattr(config, "kv_dim")):
        plan = memory_plan(config, kv_dtype, report.options.dcp_size, slots=slots, gpu_mem_gib=gpu_mem_gib,
                           interleave=report.options.interleave, index_cache=report.options.index_cache)
    if target is None:
        target = {"name": _describe(compiled), "how": "compiled by torch.compile in this process",
                  "process_group": report.process_group or "unknown"}
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters()) \
        if isinstance(module, torch.nn.Module) else None
    return Inspection(report=report, target=target, memory=plan, compilations=len(reports), weight_bytes=weight_bytes,
                      capacity=capacity)


def _describe(obj: Any) -> str:
    inner = getattr(obj, "_orig_mod", None)
    if inner is not None:
        return f"torch.compile({type(inner).__name__})"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return name or type(obj).__name__


@dataclasses.dataclass
class Inspection:
    """One compilation, ready to print: ``to_text()``, ``to_dict()``/``to_json()``, ``to_html()``, ``write(dir)``."""

    report: Any  # dsa_dcp.backend.CompileReport
    target: dict
    memory: MemoryPlan | None = None
    compilations: int = 1  # compilations filed for the object (recompiles); this is the last
    weight_bytes: int | None = None  # the compiled module's parameters (None for a function)
    capacity: CapacityPlan | None = None  # TP capacity, when asked for (``--tp``)

    # ------------------------------------------------------------------ data
    @functools.cached_property
    def analysis(self):
        """Per-layer dataflow and collective bytes of the final graph, computed when first asked."""
        from dsa_dcp.inspection.analysis import analyze

        graph = self.report.graph
        if graph is None:
            return None
        try:
            return analyze(graph, self.report.options.dcp_size, self.report.options.merge,
                           process_group=self.report.process_group)
        except Exception as e:  # noqa: BLE001 - the report says what it could not compute
            import logging

            logging.getLogger("dsa_dcp.inspection").warning("graph analysis failed: %s: %s", type(e).__name__, e)
            return None

    @property
    def note(self) -> str:
        return self.analysis.note if self.analysis is not None else "graph analysis unavailable"

    def kernels_per_step(self) -> Any:
        counter = getattr(self.report, "kernels_per_step", None)
        value = counter() if callable(counter) else counter
        return jsonable(value) if value else None

    def _no_kernel_count(self) -> str:
        lowered = getattr(self.report, "lowered", None)
        if hasattr(lowered, "kernels_per_step") and self.report.options.dcp_size > 1:
            return NO_KERNEL_COUNT_DCP
        return NO_KERNEL_COUNT

    def summary(self) -> dict:
        r, a = self.report, self.analysis
        opts = r.options
        stats = r.stats()
        share = stats.get(SHARE_PASS)
        remaps_after = r.summary.get("remaps", 0)
        groups = [g.layers for g in a.remaps] if a is not None else []
        remaps = {
            "after_sharing": remaps_after,
            "before_sharing": share.get("remaps_before", remaps_after) if share else remaps_after,
            "sharing": "share_remaps" if share is not None else "not run",
            "groups": groups,
            "refusals": jsonable(share.get("refusals", [])) if share else [],
        }
        merges = collections.Counter()
        if a is not None and opts.dcp_size > 1:
            merges[opts.merge] = sum(1 for f in a.layers if f.merge is not None)
        collectives = a.collectives if a is not None else []
        by_op: dict[str, dict] = {}
        for c in collectives:
            entry = by_op.setdefault(c.op, {"count": 0, "sent_bytes_per_rank": 0, "input_bytes": 0})
            entry["count"] += 1
            entry["sent_bytes_per_rank"] += c.sent_bytes_per_rank
            entry["input_bytes"] += c.input_bytes
        kernels = self.kernels_per_step()
        return {
            "sparse_attention_nodes": r.summary.get("sparse_attention_nodes", 0),
            "remaps": remaps,
            "merges": dict(merges),
            "collectives": {
                "per_step": len(collectives),
                "sent_bytes_per_rank_per_step": sum(c.sent_bytes_per_rank for c in collectives),
                "by_op": by_op,
                "shapes_known": a.shapes_known if a is not None else False,
            },
            "kernels_per_step": kernels if kernels is not None else self._no_kernel_count(),
            "kv_writes": r.summary.get("kv_writes", 0),
            "weights": {"bytes_per_rank": self.weight_bytes, "held_by_compiled_step": self.weights_held(),
                        # replicate_q: the other DCP ranks' query weights, part of what the step holds
                        "replicated_query_bytes": stats.get("dcp_rewrite", {}).get("replicated_query_bytes", 0)},
        }

    def weights_held(self) -> int:
        """Bytes of tensors the compiled graph holds itself (constants), beyond the model's parameters:
        0 when the head-sharded epilogue reads its shards as views of the parameters."""
        graph = self.report.graph
        if graph is None:
            return 0
        held = {}
        for node in graph.graph.nodes:
            if node.op == "get_attr":
                value = functools.reduce(getattr, node.target.split("."), graph)
                if isinstance(value, torch.Tensor):
                    held[id(value)] = value.numel() * value.element_size()
        return sum(held.values())

    def dataflow(self) -> dict:
        a = self.analysis
        if a is None:
            return {"layers": [], "sources": [], "remaps": [], "merge": None}
        return {
            "layers": [dataclasses.asdict(f) for f in a.layers],
            "sources": [dataclasses.asdict(s) for s in a.sources],
            "remaps": [dataclasses.asdict(g) for g in a.remaps],
            "merge": a.merge,
        }

    def to_dict(self) -> dict:
        r = self.report
        opts = r.options
        return {
            "schema": SCHEMA,
            "target": dict(self.target),
            "options": {"dcp_size": opts.dcp_size, "rank": r.rank, "merge": opts.merge,
                        "interleave": opts.interleave, "lowering": opts.lowering},
            "compilations": self.compilations,
            "summary": self.summary(),
            "collectives": [dataclasses.asdict(c) for c in (self.analysis.collectives if self.analysis else [])],
            "dataflow": self.dataflow(),
            "graph_input": r.graph_before,
            "passes": [
                {"name": p.name, "stats": jsonable(p.stats), "nodes_added": list(p.nodes_added),
                 "nodes_removed": list(p.nodes_removed), "graph_after": p.code_after}
                for p in r.passes
            ],
            "memory": self.memory.as_dict() if self.memory is not None else None,
            "capacity": self.capacity.as_dict() if self.capacity is not None else None,
            "note": self.note,
        }

    def to_json(self) -> str:
        """Stable JSON: sorted keys, two-space indent, no timestamps or addresses."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    # rendering: dsa_dcp/inspection/render.py
    def layout(self):
        return render.dataflow_layout(self)

    def dataflow_svg(self) -> str:
        return render.to_svg(self.layout())

    def to_text(self) -> str:
        return render.to_text(self)

    def to_html(self) -> str:
        return render.to_html(self)

    def write(self, out_dir: str, png: bool = True) -> dict[str, str]:
        """Write ``report.txt``, ``report.json``, ``report.html``, ``dataflow.svg``, ``dataflow.png``
        (when matplotlib is installed) and ``graphs/NN_<stage>.py``; returns ``{kind: path}``."""
        return render.write(self, out_dir, png)
