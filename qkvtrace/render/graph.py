"""Call graphs: report edges -> ``networkx.DiGraph`` -> Graphviz DOT/SVG.

Collection stores plain edges; this module is the only place that builds a
graph object from them and draws it.

Drawing (DOT -> SVG) needs a Graphviz layout program. qkvtrace depends on
``graphviz-pure``, a self-contained port of Graphviz's ``dot`` that pip
installs as a wheel, and uses it first: it needs no system Graphviz, and it
writes the same bytes on every machine, because it measures text with fonts
it carries instead of the fonts installed on the machine (a committed
``callgraph.svg`` does not change when someone else runs ``inspect``).
Graphviz's own ``dot`` on PATH is the fallback where graphviz-pure has no
wheel, and ``QKVTRACE_DOT`` names another program to use instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

import graphviz
import networkx as nx

__all__ = [
    "ENGINE_ENV",
    "PATH_COLOURS",
    "Drawing",
    "how_to_get_an_engine",
    "layout_engine",
    "render_svg",
    "report_graph",
    "to_dot",
]

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


#: Environment variable naming the layout program to use (a name on PATH or a path).
ENGINE_ENV = "QKVTRACE_DOT"
_PURE = "graphviz-pure"


def _script_dirs() -> list[str]:
    """Where pip puts the console programs of this interpreter's packages (venv, then user installs)."""
    dirs = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    try:
        dirs.append(sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user")))
    except KeyError:  # an interpreter built without a user scheme
        pass
    return [d for d in dict.fromkeys(dirs) if d]


def layout_engine() -> str | None:
    """Path of the program that turns DOT into SVG, or ``None`` when there is none.

    ``$QKVTRACE_DOT`` when set; else graphviz-pure installed with this Python
    (found even when its scripts folder is not on PATH, as when a virtual
    environment's ``qkvtrace`` is run without activating it), else on PATH;
    else Graphviz's ``dot`` on PATH.
    """
    chosen = os.environ.get(ENGINE_ENV)
    if chosen:
        return shutil.which(chosen)
    for folder in _script_dirs():
        found = shutil.which(_PURE, path=folder)
        if found:
            return found
    return shutil.which(_PURE) or shutil.which("dot")


def how_to_get_an_engine() -> str:
    """One sentence on why no layout program was found and how to get one."""
    chosen = os.environ.get(ENGINE_ENV)
    if chosen:
        return f"{ENGINE_ENV}={chosen!r} names no program that can be run; point it at Graphviz's dot or unset it"
    return (
        "no Graphviz layout program was found: `pip install graphviz-pure` (wheels for Linux x86-64/aarch64, "
        "macOS and Windows x64), or install Graphviz (`apt-get install graphviz`, `brew install graphviz`, "
        "`conda install graphviz`)"
    )


@dataclass(frozen=True)
class Drawing:
    """The outcome of drawing a DOT graph: the SVG, or why there is none."""

    svg: str | None
    #: the program that drew it (its file name), ``None`` when none ran
    engine: str | None
    #: why ``svg`` is ``None``, as a sentence that says what to do
    problem: str | None = None


def render_svg(dot_source: str, timeout: float = 120.0) -> Drawing:
    """Lay out DOT and return the SVG; never raises for a missing or failing layout program."""
    exe = layout_engine()
    if exe is None:
        return Drawing(None, None, how_to_get_an_engine())
    name = os.path.basename(exe)
    try:
        proc = subprocess.run([exe, "-Tsvg"], input=dot_source.encode("utf-8"), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Drawing(None, name, f"{name} did not finish within {timeout:.0f} s")
    except OSError as exc:  # not executable, wrong architecture, vanished between lookup and start
        return Drawing(None, name, f"{exe} could not be started ({exc.strerror or exc})")
    if proc.returncode != 0 or not proc.stdout.lstrip().startswith(b"<"):
        last = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        return Drawing(None, name, f"{name} failed (exit {proc.returncode}: {last[0]})")
    return Drawing(proc.stdout.decode("utf-8"), name)
