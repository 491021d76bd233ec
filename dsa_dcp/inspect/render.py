"""The dataflow picture: layers, their top-k sources, remaps and merges, as SVG and PNG.

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

import dataclasses
from html import escape

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
