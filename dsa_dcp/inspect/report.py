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
import os
from html import escape
from typing import Any

import torch

from dsa_dcp import registry
from dsa_dcp.inspect.memory import MemoryPlan, memory_plan
from dsa_dcp.inspect.render import layout, to_svg, write_png

SCHEMA = "dsa-dcp-inspect/1"
NO_KERNEL_COUNT = "n/a (no CUDA graph lowering)"
NO_KERNEL_COUNT_DCP = "n/a (counting runs a step, whose collectives need every rank of the group)"
SHARE_PASS = "share_remaps"


def inspect(compiled: Any, *, config: Any = None, kv_dtype: str = "bf16", slots: int | None = None,
            gpu_mem_gib: float | None = None, target: dict | None = None) -> Inspection:
    """The ``Inspection`` of the last ``dsa_dcp`` compilation of ``compiled``.

    ``compiled`` is what ``torch.compile(..., backend="dsa_dcp")`` returned, or the module or
    function given to it; it must have run once (dynamo compiles on the first call). The memory
    plan is included when a ``DSAConfig`` is known: ``config`` (an object or a name), else the
    compiled module's ``cfg`` attribute.
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
    return Inspection(report=report, target=target, memory=plan, compilations=len(reports), weight_bytes=weight_bytes)


def _describe(obj: Any) -> str:
    inner = getattr(obj, "_orig_mod", None)
    if inner is not None:
        return f"torch.compile({type(inner).__name__})"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return name or type(obj).__name__


def _jsonable(value: Any) -> Any:
    """Stats as plain JSON values (tuples and sets become lists, anything else its ``str``)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.fx.Node):
        return value.name
    return str(value)


def _target_counts(nodes: list[str]) -> dict[str, int]:
    """``["name = op:target", ...]`` -> ``{target: count}`` (how a pass diff reads best)."""
    counts = collections.Counter(key.split(" = ", 1)[-1].split(":", 1)[-1] for key in nodes)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _ranges(layers: list[int]) -> str:
    """``[2, 3, 4, 5]`` -> ``"2-5"``; ``[0, 7]`` -> ``"0,7"``."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def _brief(stats: dict) -> str:
    """Stats on one line: scalars as they are, long lists as their length."""
    parts = []
    for k, v in sorted(stats.items()):
        if isinstance(v, (list, tuple, set, dict)) and len(v) > 4:
            v = f"<{len(v)} items>"
        parts.append(f"{k}={_jsonable(v)}")
    return ", ".join(parts)


@dataclasses.dataclass
class Inspection:
    """One compilation, ready to print: ``to_text()``, ``to_dict()``/``to_json()``, ``to_html()``, ``write(dir)``."""

    report: Any  # dsa_dcp.backend.CompileReport
    target: dict
    memory: MemoryPlan | None = None
    compilations: int = 1  # compilations filed for the object (recompiles); this is the last
    weight_bytes: int | None = None  # the compiled module's parameters (None for a function)

    # ------------------------------------------------------------------ data
    @functools.cached_property
    def analysis(self):
        """Per-layer dataflow and collective bytes of the final graph, computed when first asked."""
        from dsa_dcp.inspect.analysis import analyze

        graph = self.report.graph
        if graph is None:
            return None
        try:
            return analyze(graph, self.report.options.dcp_size, self.report.options.merge,
                           process_group=self.report.process_group)
        except Exception as e:  # noqa: BLE001 - the report says what it could not compute
            import logging

            logging.getLogger("dsa_dcp.inspect").warning("graph analysis failed: %s: %s", type(e).__name__, e)
            return None

    @property
    def note(self) -> str:
        return self.analysis.note if self.analysis is not None else "graph analysis unavailable"

    def kernels_per_step(self) -> Any:
        counter = getattr(self.report, "kernels_per_step", None)
        value = counter() if callable(counter) else counter
        return _jsonable(value) if value else None

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
            "refusals": _jsonable(share.get("refusals", [])) if share else [],
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
            "weights": {"bytes_per_rank": self.weight_bytes, "held_by_compiled_step": self.weights_held()},
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
                {"name": p.name, "stats": _jsonable(p.stats), "nodes_added": list(p.nodes_added),
                 "nodes_removed": list(p.nodes_removed), "graph_after": p.code_after}
                for p in r.passes
            ],
            "memory": self.memory.as_dict() if self.memory is not None else None,
            "note": self.note,
        }

    def to_json(self) -> str:
        """Stable JSON: sorted keys, two-space indent, no timestamps or addresses."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def layout(self):
        r = self.report
        title = (f"{self.target.get('name')}: rank {r.rank} of {r.options.dcp_size}, merge={r.options.merge}"
                 if r.options.dcp_size > 1 else f"{self.target.get('name')}: dcp_size=1 (no rewrite)")
        return layout(self.dataflow(), title)

    def dataflow_svg(self) -> str:
        return to_svg(self.layout())

    # ------------------------------------------------------------------ text
    def summary_rows(self) -> list[tuple[str, str]]:
        s = self.summary()
        rm, coll = s["remaps"], s["collectives"]
        groups = " ".join(f"[{_ranges(g)}]" for g in rm["groups"])
        rows = [
            ("sparse attention nodes", str(s["sparse_attention_nodes"])),
            ("remaps before sharing", str(rm["before_sharing"])),
            ("remaps after sharing", f"{rm['after_sharing']} ({rm['sharing']}"
             + (f"; {len(rm['refusals'])} candidate pairs refused" if rm["refusals"] else "") + ")"),
            ("remap groups (layers)", groups or "-"),
            ("merges", ", ".join(f"{n} {mode}" for mode, n in s["merges"].items()) or "none (dcp_size = 1)"),
            ("collectives per step", str(coll["per_step"])),
        ]
        for op, e in coll["by_op"].items():
            each = e["input_bytes"] // e["count"] if e["count"] else 0
            rows.append((f"  {op}", f"{e['count']} x {each:,} B in, {e['sent_bytes_per_rank']:,} B sent per rank"))
        rows += [
            ("bytes sent per rank per step", f"{coll['sent_bytes_per_rank_per_step']:,}"
             + ("" if coll["shapes_known"] else " (shapes unknown)")),
            ("kernels per step", str(s["kernels_per_step"])),
            ("KV writes per step", str(s["kv_writes"])),
        ]
        w = s["weights"]
        if w["bytes_per_rank"] is not None:
            rows.append(("weight bytes per rank", f"{w['bytes_per_rank']:,} (the model's parameters; "
                         f"{w['held_by_compiled_step']:,} more held by the compiled step)"))
        return rows

    def pass_rows(self) -> list[str]:
        out = []
        for i, p in enumerate(self.report.passes, 1):
            added, removed = _target_counts(p.nodes_added), _target_counts(p.nodes_removed)
            fmt = lambda c: ", ".join(f"{n} {t}" for t, n in list(c.items())[:6]) + (", ..." if len(c) > 6 else "")
            out.append(f"{i}. {p.name}: {_brief(p.stats)}")
            out.append(f"     + {len(p.nodes_added)} nodes" + (f" ({fmt(added)})" if added else ""))
            out.append(f"     - {len(p.nodes_removed)} nodes" + (f" ({fmt(removed)})" if removed else ""))
        return out or ["(no passes: dcp_size = 1 keeps the graph as written)"]

    def to_text(self) -> str:
        r, t = self.report, self.target
        opts = r.options
        lines = [
            f"dsa-dcp inspect {t.get('name')}",
            f"  model          {t.get('how')}",
            f"  compiled for   rank {r.rank} of a {opts.dcp_size}-rank DCP group; process group: {t.get('process_group')}",
            f"  options        dcp_size={opts.dcp_size} merge={opts.merge} interleave={opts.interleave} lowering={opts.lowering}",
            "",
            "summary (one step, this rank)",
        ]
        rows = self.summary_rows()
        width = max(len(k) for k, _ in rows) + 2
        lines += [f"  {k:<{width}}{v}" for k, v in rows]
        lines += ["", "passes (graph before/after each: --out DIR writes graphs/*.py and report.html)"]
        lines += [f"  {row}" for row in self.pass_rows()]
        if self.memory is not None:
            lines += ["", "memory plan (from the config; nothing allocated)"]
            width = max(len(k) for k, _ in self.memory.rows()) + 2
            lines += [f"  {k:<{width}}{v}" for k, v in self.memory.rows()]
        note = self.note
        if note:
            lines += ["", f"note: {note}"]
        return "\n".join(lines)

    # ------------------------------------------------------------------ html
    def to_html(self) -> str:
        r, t = self.report, self.target

        def table(rows):
            return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows) + "</table>"

        def code(title, text):
            return f"<details><summary>{escape(title)}</summary><pre>{escape(text)}</pre></details>"

        passes = [code("input graph (from dynamo)", r.graph_before)]
        for i, p in enumerate(r.passes, 1):
            added, removed = _target_counts(p.nodes_added), _target_counts(p.nodes_removed)
            passes.append(
                f'<section class="pass" data-pass="{escape(p.name)}"><h3>{i}. {escape(p.name)}</h3>'
                f"<p>stats: <code>{escape(json.dumps(_jsonable(p.stats), sort_keys=True))}</code></p>"
                + table([("nodes added", f"{len(p.nodes_added)}: " + ", ".join(f"{n} {k}" for k, n in added.items())),
                         ("nodes removed", f"{len(p.nodes_removed)}: " + ", ".join(f"{n} {k}" for k, n in removed.items()))])
                + code("nodes added and removed", "\n".join([f"+ {n}" for n in p.nodes_added]
                                                             + [f"- {n}" for n in p.nodes_removed]))
                + code(f"graph after {p.name}", p.code_after) + "</section>"
            )
        coll = self.analysis.collectives if self.analysis is not None else []
        coll_rows = "".join(
            f"<tr><td>{c.layer}</td><td>{escape(c.node)}</td><td>{escape(c.op)}</td><td>{c.input_shape}</td>"
            f"<td>{escape(c.dtype)}</td><td>{c.input_bytes:,}</td><td>{c.sent_bytes_per_rank:,}</td></tr>" for c in coll)
        memory = ("<h2>Memory plan</h2><p>From the config; nothing allocated.</p>" + table(self.memory.rows())
                  if self.memory is not None else "")
        return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dsa-dcp inspect {escape(str(t.get('name')))}</title>
<style>
body {{ font-family: DejaVu Sans, Arial, sans-serif; margin: 24px; color: #0f172a; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
th, td {{ border: 1px solid #cbd5e1; padding: 3px 8px; text-align: left; font-size: 13px; vertical-align: top; }}
th {{ background: #f1f5f9; }}
pre {{ background: #f8fafc; border: 1px solid #e2e8f0; padding: 8px; font-size: 11px; overflow: auto; max-height: 480px; }}
.figure {{ border: 1px solid #e2e8f0; display: inline-block; }}
</style></head><body>
<h1>dsa-dcp inspect {escape(str(t.get('name')))}</h1>
{table([("model", str(t.get("how"))), ("compiled for", f"rank {r.rank} of a {r.options.dcp_size}-rank DCP group"),
        ("process group", str(t.get("process_group"))),
        ("options", f"dcp_size={r.options.dcp_size} merge={r.options.merge} interleave={r.options.interleave} "
                    f"lowering={r.options.lowering}")])}
<h2>Summary (one step, this rank)</h2>
{table(self.summary_rows())}
<h2>Dataflow</h2>
<p>Rows are layers in graph order: top-k source, remap, sparse attention, merge.</p>
<div class="figure">{self.dataflow_svg()}</div>
{memory}
<h2>Passes</h2>
{''.join(passes)}
<h2>Collectives</h2>
<details><summary>{len(coll)} collectives (bytes per rank)</summary>
<table><tr><th>layer</th><th>node</th><th>op</th><th>input shape</th><th>dtype</th><th>input bytes</th><th>sent bytes per rank</th></tr>
{coll_rows}</table></details>
</body></html>
"""

    # ------------------------------------------------------------------ files
    def write(self, out_dir: str, png: bool = True) -> dict[str, str]:
        """Write ``report.txt``, ``report.json``, ``report.html``, ``dataflow.svg``, ``dataflow.png``
        (when matplotlib is installed) and ``graphs/NN_<stage>.py``; returns ``{kind: path}``."""
        os.makedirs(os.path.join(out_dir, "graphs"), exist_ok=True)
        paths = {}

        def put(kind: str, name: str, text: str) -> None:
            path = os.path.join(out_dir, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            paths[kind] = path

        put("text", "report.txt", self.to_text() + "\n")
        put("json", "report.json", self.to_json() + "\n")
        put("html", "report.html", self.to_html())
        put("svg", "dataflow.svg", self.dataflow_svg())
        put("graph_00", os.path.join("graphs", "00_input.py"), self.report.graph_before)
        for i, p in enumerate(self.report.passes, 1):
            put(f"graph_{i:02d}", os.path.join("graphs", f"{i:02d}_after_{p.name}.py"), p.code_after)
        if png:
            try:
                paths["png"] = write_png(self.layout(), os.path.join(out_dir, "dataflow.png"))
            except ImportError:
                paths["png_missing"] = "matplotlib is not installed (pip install 'dsa-dcp[inspect]')"
        return paths
