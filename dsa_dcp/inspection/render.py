"""How an inspection is shown: as text, HTML and files, and its dataflow picture (layers, their
top-k sources, remaps and merges) as SVG and PNG. The data is ``report.Inspection``'s.

One layout (``layout``) feeds both writers. Layers are rows, top to bottom in graph order; four
columns read left to right: the top-k source (an indexer's output, or a graph input), the
``topk_remap`` that turns it into this rank's local rows, the sparse attention node, and its merge.
A source or remap sits on the row of the first layer that uses it, with an edge to every layer
that uses it, so shared top-k (GLM-5.2's IndexShare) shows as one box fanning out to its layers.

The SVG is written here by hand (no graphviz); every box is a ``<g class="node KIND">`` with
``data-*`` attributes, so tests and scripts can count them. The PNG is drawn from the same layout
with matplotlib (the ``inspect`` extra); without matplotlib ``write_png`` raises ``ImportError``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from html import escape
from typing import Any

import torch

ROW_H = 16
TOP = 52
COLUMNS = {  # kind -> (x, width, header)
    "source": (10, 170, "top-k source"),
    "remap": (220, 170, "topk_remap (this rank)"),
    "layer": (430, 190, "sparse attention"),
    "merge": (660, 190, "merge"),
}
WIDTH = 860
COLORS = {"source": "#dbeafe", "remap": "#fde68a", "layer": "#d1fae5", "merge": "#fbcfe8"}
STROKE = "#334155"


@dataclasses.dataclass
class Box:
    kind: str
    id: str
    x: float
    y: float
    w: float
    h: float
    label: str
    data: dict


@dataclasses.dataclass
class Layout:
    title: str
    width: float
    height: float
    boxes: list[Box]
    edges: list[tuple[float, float, float, float, str]]  # x1, y1, x2, y2, kind


# The functions below render a ``report.Inspection`` (passed in as ``self``; report.py imports this
# module, not the other way around).
Inspection = Any


def layout(dataflow: dict, title: str = "") -> Layout:
    """Place the boxes of ``dataflow`` (the ``"dataflow"`` section of an inspection's JSON)."""
    layers = dataflow["layers"]
    boxes: list[Box] = []
    edges: list[tuple[float, float, float, float, str]] = []

    def box(kind: str, ident: str, row: int, label: str, **data) -> Box:
        x, w, _ = COLUMNS[kind]
        b = Box(kind, ident, x, TOP + row * ROW_H + 1, w, ROW_H - 3, label, data)
        boxes.append(b)
        return b

    def edge(a: Box, b: Box, kind: str) -> None:
        edges.append((a.x + a.w, a.y + a.h / 2, b.x, b.y + b.h / 2, kind))

    sources = {s["id"]: s for s in dataflow["sources"]}
    source_box = {sid: box("source", sid, s["first_layer"], f"top-k of L{s['first_layer']} ({len(s['layers'])} layers)",
                           layers=len(s["layers"]))
                  for sid, s in sources.items()}
    remap_box = {}
    for r in dataflow["remaps"]:
        first = r["layers"][0]
        remap_box[r["node"]] = box("remap", r["node"], first, f"remap -> {len(r['layers'])} layer"
                                   + ("s" if len(r["layers"]) > 1 else ""), layers=len(r["layers"]))
        edge(source_box[r["topk_source"]], remap_box[r["node"]], "topk")
    for flow in layers:
        i = flow["layer"]
        lb = box("layer", str(i), i, f"L{i} {flow['op'].split('.')[0]}", layer=i)
        if flow["remap"] is not None:
            edge(remap_box[flow["remap"]], lb, "remap")
        else:
            edge(source_box[flow["topk_source"]], lb, "topk")
        if flow["merge"] is not None:
            mode = dataflow.get("merge") or "merge"
            mb = box("merge", str(i), i, f"{mode}: {len(flow['collectives'])} collective"
                     + ("s" if len(flow["collectives"]) != 1 else ""), layer=i)
            edge(lb, mb, "merge")
    height = TOP + max(len(layers), 1) * ROW_H + 24
    return Layout(title=title, width=WIDTH, height=height, boxes=boxes, edges=edges)


def to_svg(lay: Layout) -> str:
    """The layout as a standalone SVG document."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="dataflow" width="{lay.width}" height="{lay.height}" '
        f'viewBox="0 0 {lay.width} {lay.height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="10">',
        f'<rect x="0" y="0" width="{lay.width}" height="{lay.height}" fill="#ffffff"/>',
        f'<text x="10" y="18" font-size="13" font-weight="bold">{escape(lay.title)}</text>',
    ]
    for kind, (x, w, header) in COLUMNS.items():
        out.append(f'<text class="header" x="{x + w / 2}" y="{TOP - 10}" text-anchor="middle" '
                   f'font-weight="bold">{escape(header)}</text>')
    for x1, y1, x2, y2, kind in lay.edges:
        out.append(f'<line class="edge {kind}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                   f'stroke="#64748b" stroke-width="1"/>')
    for b in lay.boxes:
        data = " ".join(f'data-{k}="{escape(str(v))}"' for k, v in b.data.items())
        out.append(
            f'<g class="node {b.kind}" id="{escape(b.kind)}-{escape(b.id)}" {data}>'
            f'<rect x="{b.x}" y="{b.y}" width="{b.w}" height="{b.h}" rx="3" fill="{COLORS[b.kind]}" '
            f'stroke="{STROKE}" stroke-width="0.6"/>'
            f'<text x="{b.x + 5}" y="{b.y + b.h - 3}">{escape(b.label)}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out)


def write_png(lay: Layout, path: str, dpi: int = 100) -> str:
    """Draw the layout with matplotlib (Agg) into ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig = plt.figure(figsize=(lay.width / dpi, lay.height / dpi), dpi=dpi)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, lay.width)
    ax.set_ylim(lay.height, 0)
    ax.axis("off")
    ax.text(10, 18, lay.title, fontsize=10, fontweight="bold", va="baseline")
    for x, w, header in COLUMNS.values():
        ax.text(x + w / 2, TOP - 10, header, fontsize=7.5, fontweight="bold", ha="center", va="baseline")
    for x1, y1, x2, y2, _ in lay.edges:
        ax.plot([x1, x2], [y1, y2], color="#64748b", linewidth=0.6)
    for b in lay.boxes:
        ax.add_patch(FancyBboxPatch((b.x, b.y), b.w, b.h, boxstyle="round,pad=0,rounding_size=2",
                                    facecolor=COLORS[b.kind], edgecolor=STROKE, linewidth=0.5))
        ax.text(b.x + 5, b.y + b.h - 3, b.label, fontsize=6.5, va="baseline")
    fig.savefig(path, dpi=dpi, facecolor="white")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- an inspection as text, HTML, files


def jsonable(value: Any) -> Any:
    """Stats as plain JSON values (tuples and sets become lists, anything else its ``str``)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
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
        parts.append(f"{k}={jsonable(v)}")
    return ", ".join(parts)


def dataflow_layout(self: Inspection) -> Layout:
    """The dataflow picture of an inspection, titled with what was compiled."""
    r = self.report
    title = (f"{self.target.get('name')}: rank {r.rank} of {r.options.dcp_size}, merge={r.options.merge}"
             if r.options.dcp_size > 1 else f"{self.target.get('name')}: dcp_size=1 (no rewrite)")
    return layout(self.dataflow(), title)


def summary_rows(self: Inspection) -> list[tuple[str, str]]:
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
        rows.append(("weight bytes per rank", f"{w['bytes_per_rank']:,} (the model's parameters at tp 1; "
                     f"{w['held_by_compiled_step']:,} more held by the compiled step)"))
    if w.get("replicated_query_bytes"):
        rows.append(("replicated query weights per rank", f"{w['replicated_query_bytes']:,} bytes (replicate_q: the "
                     f"other DCP ranks' heads' query weights, held by the compiled step)"))
    return rows

def pass_rows(self: Inspection) -> list[str]:
    out = []
    for i, p in enumerate(self.report.passes, 1):
        added, removed = _target_counts(p.nodes_added), _target_counts(p.nodes_removed)
        fmt = lambda c: ", ".join(f"{n} {t}" for t, n in list(c.items())[:6]) + (", ..." if len(c) > 6 else "")
        out.append(f"{i}. {p.name}: {_brief(p.stats)}")
        out.append(f"     + {len(p.nodes_added)} nodes" + (f" ({fmt(added)})" if added else ""))
        out.append(f"     - {len(p.nodes_removed)} nodes" + (f" ({fmt(removed)})" if removed else ""))
    return out or ["(no passes: dcp_size = 1 keeps the graph as written)"]

def to_text(self: Inspection) -> str:
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
    rows = summary_rows(self)
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"  {k:<{width}}{v}" for k, v in rows]
    lines += ["", "passes (graph before/after each: --out DIR writes graphs/*.py and report.html)"]
    lines += [f"  {row}" for row in pass_rows(self)]
    if self.memory is not None:
        lines += ["", "memory plan (from the config; nothing allocated)"]
        width = max(len(k) for k, _ in self.memory.rows()) + 2
        lines += [f"  {k:<{width}}{v}" for k, v in self.memory.rows()]
    if self.capacity is not None:
        lines += ["", *capacity_lines(self.capacity)]
    note = self.note
    if note:
        lines += ["", f"note: {note}"]
    return "\n".join(lines)

CAPACITY_TITLE = "capacity at tp {t}, dcp {n} (from the config's shapes; nothing allocated{more})"


def capacity_lines(plan, compiled: bool = True) -> list[str]:
    """The capacity section of the text report (a ``capacity.CapacityPlan``); ``compiled``: the report
    above it shows a compiled graph (which is not TP-sharded)."""
    rows = plan.rows()
    width = max(len(k) for k, _ in rows) + 2
    more = "; the compiled graph above is not TP-sharded" if compiled else ""
    return [CAPACITY_TITLE.format(t=plan.tp_size, n=plan.dcp_size, more=more)] + \
        [f"  {k:<{width}}{v}" for k, v in rows]


def to_html(self: Inspection) -> str:
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
            f"<p>stats: <code>{escape(json.dumps(jsonable(p.stats), sort_keys=True))}</code></p>"
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
    if self.capacity is not None:
        memory += (f"<h2>Capacity at tp {self.capacity.tp_size}, dcp {self.capacity.dcp_size}</h2>"
                   "<p>From the config's shapes; nothing allocated; the compiled graph is not TP-sharded.</p>"
                   + table(self.capacity.rows()))
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
{table(summary_rows(self))}
<h2>Dataflow</h2>
<p>Rows are layers in graph order: top-k source, remap, sparse attention, merge.</p>
<div class="figure">{to_svg(dataflow_layout(self))}</div>
{memory}
<h2>Passes</h2>
{''.join(passes)}
<h2>Collectives</h2>
<details><summary>{len(coll)} collectives (bytes per rank)</summary>
<table><tr><th>layer</th><th>node</th><th>op</th><th>input shape</th><th>dtype</th><th>input bytes</th><th>sent bytes per rank</th></tr>
{coll_rows}</table></details>
</body></html>
"""

def write(self: Inspection, out_dir: str, png: bool = True) -> dict[str, str]:
    """Write ``report.txt``, ``report.json``, ``report.html``, ``dataflow.svg``, ``dataflow.png``
    (when matplotlib is installed) and ``graphs/NN_<stage>.py``; returns ``{kind: path}``."""
    os.makedirs(os.path.join(out_dir, "graphs"), exist_ok=True)
    paths = {}

    def put(kind: str, name: str, text: str) -> None:
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        paths[kind] = path

    put("text", "report.txt", to_text(self) + "\n")
    put("json", "report.json", self.to_json() + "\n")
    put("html", "report.html", to_html(self))
    put("svg", "dataflow.svg", to_svg(dataflow_layout(self)))
    put("graph_00", os.path.join("graphs", "00_input.py"), self.report.graph_before)
    for i, p in enumerate(self.report.passes, 1):
        put(f"graph_{i:02d}", os.path.join("graphs", f"{i:02d}_after_{p.name}.py"), p.code_after)
    if png:
        try:
            paths["png"] = write_png(dataflow_layout(self), os.path.join(out_dir, "dataflow.png"))
        except ImportError:
            paths["png_missing"] = "matplotlib is not installed (pip install 'dsa-dcp[inspect]')"
    return paths
