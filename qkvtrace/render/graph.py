"""Call graphs: report edges -> ``networkx.DiGraph`` -> Graphviz DOT/SVG.

Collection stores plain edges; this module is the only place that builds a
graph object from them and draws it.
"""

from __future__ import annotations

import shutil
from typing import Any

import graphviz
import networkx as nx

__all__ = ["PATH_COLOURS", "dot_available", "render_svg", "report_graph", "to_dot"]

#: Edge colours per path (DESIGN.md vocabulary).
PATH_COLOURS = {
    "fast": "#2e7d32",
    "fused_encoder_layer": "#2e7d32",
    "fallback": "#ef6c00",
    "sdpa": "#1565c0",
}
_STATIC = "#9e9e9e"


def report_graph(report: dict[str, Any]) -> nx.DiGraph:
    """The report's call graph; edges carry ``kind``, ``paths`` and ``scenarios``."""
    graph = nx.DiGraph()
    for node in report["callgraph"]["nodes"]:
        graph.add_node(node["name"], kind=node["kind"], file=node["file"])
    for edge in report["callgraph"]["edges"]:
        graph.add_edge(
            edge["caller"], edge["callee"],
            kind=tuple(edge["kind"]), paths=tuple(edge["paths"]), scenarios=tuple(edge["scenarios"]),
        )  # fmt: skip
    return graph


def short_name(name: str) -> str:
    """``torch.nn.modules.activation.MultiheadAttention.forward`` -> ``MultiheadAttention.forward``."""
    if name.startswith("aten::"):
        return name
    parts = name.split(".")
    tail = [p for p in parts[-2:] if p]
    if len(tail) == 2 and not tail[0][:1].isupper():
        tail = tail[1:]
    return ".".join(tail)


def _cluster_of(data: dict[str, Any]) -> str:
    if data.get("kind") == "aten":
        return "C++ / aten ops"
    if data.get("kind") == "builtin":
        return "C++ builtins (Python bindings)"
    return str(data.get("file") or "other")


def _edge_attrs(data: dict[str, Any]) -> dict[str, str]:
    if data.get("colour"):  # an explicit mark (a diff's added/removed edge)
        return {"color": data["colour"], "style": "solid", "penwidth": "2.5", "tooltip": data.get("tooltip", "")}
    colours = sorted({PATH_COLOURS[p] for p in data.get("paths", ()) if p in PATH_COLOURS})
    dynamic = "dynamic" in data.get("kind", ())
    attrs = {
        "color": ":".join(colours) if colours else _STATIC,
        "style": "solid" if dynamic else "dashed",
        "penwidth": "2" if colours else "1",
        "tooltip": (
            f"{'/'.join(data.get('kind', ()))}"
            + (f"; seen in: {', '.join(data.get('scenarios', ()))}" if data.get("scenarios") else "")
        ),
    }
    return attrs


_PATH_LEGEND = (
    "green: fast path / fused encoder layer\\lorange: fallback (F.multi_head_attention_forward)\\l"
    "blue: direct SDPA\\lgrey dashed: in the source only (static)\\lsolid: observed running (dynamic)\\l"
)


def to_dot(graph: nx.DiGraph, title: str, legend: str = _PATH_LEGEND) -> str:
    """Left-to-right DOT with one cluster per source file, a legend, marked paths."""
    dot = graphviz.Digraph("callgraph", graph_attr={
        "rankdir": "LR", "label": title, "labelloc": "t", "fontname": "Helvetica", "fontsize": "18",
        "nodesep": "0.25", "ranksep": "0.6", "newrank": "true",
    }, node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white", "fontname": "Helvetica",
                  "fontsize": "11"}, edge_attr={"arrowsize": "0.6"})  # fmt: skip
    # Plain IDs: a ':' in a DOT node ID would be read as a port (aten::op).
    ids = {name: f"n{i}" for i, name in enumerate(sorted(graph.nodes))}
    clusters: dict[str, list[str]] = {}
    for node, data in graph.nodes(data=True):
        clusters.setdefault(_cluster_of(data), []).append(node)
    fills = {"python": "#ffffff", "builtin": "#fff8e1", "aten": "#f3e5f5", "unknown": "#eeeeee"}
    for i, (cluster, nodes) in enumerate(sorted(clusters.items())):
        with dot.subgraph(name=f"cluster_{i}") as sub:
            sub.attr(label=cluster, style="rounded,dashed", color="#bdbdbd", fontsize="12")
            for node in sorted(nodes):
                kind = graph.nodes[node].get("kind", "unknown")
                fill = graph.nodes[node].get("fill") or fills.get(kind, "#ffffff")
                sub.node(ids[node], label=short_name(node), tooltip=node, fillcolor=fill)
    for a, b, data in sorted(graph.edges(data=True), key=lambda e: (e[0], e[1])):
        dot.edge(ids[a], ids[b], **_edge_attrs(data))
    with dot.subgraph(name="cluster_legend") as box:
        box.attr(label="legend", style="rounded", color="#bdbdbd", fontsize="12")
        box.node("legend_text", shape="plaintext", style="", label=legend)
    return str(dot.source)


def dot_available() -> bool:
    return shutil.which("dot") is not None


def render_svg(dot_source: str) -> str | None:
    """SVG text from DOT via Graphviz's ``dot``; ``None`` when ``dot`` is missing."""
    if not dot_available():
        return None
    svg = graphviz.Source(dot_source).pipe(format="svg", encoding="utf-8")
    return str(svg)
