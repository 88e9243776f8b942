"""Diffs of two reports as Markdown, a rich renderable, and a union call-graph picture."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

import networkx as nx
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.syntax import Syntax
from rich.text import Text

from qkvtrace.render.graph import report_graph, short_name, to_dot
from qkvtrace.render.terminal import Col, records_view

__all__ = ["SourceDiff", "diff_dot", "diff_markdown", "diff_renderable"]

_ADDED, _REMOVED = "#2e7d32", "#c62828"


def _short(value: Any) -> str:
    if value is None:
        return "absent"
    if isinstance(value, dict) and "error" in value and len(value) == 1:
        return f"error: {value['error']}"
    if isinstance(value, list) and value and isinstance(value[0], dict) and "path" in value[0]:
        return "; ".join(
            f"{c['path']}" + (f" ({c['sdpa_backend']})" if c.get("sdpa_backend") else "")
            + (f" — {' '.join(c['why_not_fast_path'].split())}" if c.get("why_not_fast_path") else "")
            for c in value
        )  # fmt: skip
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return json.dumps(value) if not isinstance(value, str) else value


def _words(value: Any) -> str:
    if isinstance(value, dict):  # sdpa_refusals: backend -> PyTorch's lines
        return "; ".join(f"{k}: {_words(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return " ".join(" ".join(v.split()) for v in value) or "none"
    return "absent" if value is None else " ".join(str(value).split())


def _fields_apart(was: Any, became: Any) -> tuple[list[str], list[str]]:
    """The fields of two call lists (or dicts, nested) that differ, as ``name: value`` on each side."""
    if isinstance(was, dict) and isinstance(became, dict):
        a: list[str] = []
        b: list[str] = []
        for k in sorted(was.keys() | became.keys()):
            x, y = was.get(k), became.get(k)
            if x == y:
                continue
            if isinstance(x, dict) and isinstance(y, dict):  # e.g. sdpa_refusals: only the backends that differ
                xa, yb = _fields_apart(x, y)
                a += [f"{k} {t}" for t in xa]
                b += [f"{k} {t}" for t in yb]
            else:
                a.append(f"{k}: {_words(x)}")
                b.append(f"{k}: {_words(y)}")
        return a, b
    if isinstance(was, list) and isinstance(became, list) and len(was) == len(became):
        a, b = [], []
        for i, (x, y) in enumerate(zip(was, became, strict=True)):
            xa, yb = _fields_apart(x, y)
            label = f"call {i} " if len(was) > 1 else ""
            a += [label + t for t in xa]
            b += [label + t for t in yb]
        return a, b
    return [_words(was)], [_words(became)]


def shown_change(was: Any, became: Any) -> tuple[str, str]:
    """The was and became cells of a changed row: their short form, and the fields that differ when those read
    the same (a scenario whose path and backend stayed but whose refusals changed)."""
    a, b = _short(was), _short(became)
    if a != b:
        return a, b
    fa, fb = _fields_apart(was, became)
    return f"{a}; {'; '.join(fa)}", f"{b}; {'; '.join(fb)}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def diff_markdown(diff: dict[str, Any], *, svg_name: str | None = "diff.svg") -> str:
    """Behaviour first (what users feel), then fast-path conditions, the call graph, and the sources."""
    s, c, g, p = diff["sources"], diff["fast_path_conditions"], diff["callgraph"], diff["probes"]["changed"]
    lines = [f"# Attention in PyTorch {diff['a']} → {diff['b']}", "", f"**{diff['summary']}**", ""]
    lines += ["## Behaviour", ""]
    if p:
        lines += ["| probe | case | was | became |", "|---|---|---|---|"]
        for x in p:
            was, became = shown_change(x["was"], x["became"])
            lines.append(f"| {x['kind']} | {_cell(x['key'])} | {_cell(was)} | {_cell(became)} |")
        lines.append("")
    else:
        lines += ["Every probe behaved the same.", ""]
    lines += ["## Fast-path conditions", ""]
    if not (c["added"] or c["removed"] or c["reworded"]):
        lines += ["The fast-path conditions are the same.", ""]
    else:
        lines += ["| change | function | reason | condition |", "|---|---|---|---|"]
        for kind in ("added", "removed"):
            for x in c[kind]:
                lines.append(
                    f"| {kind} | {short_name(x['function'])} | `{_cell(x['reason'])}` | `{_cell(x['condition'])}` |"
                )
        for x in c["reworded"]:
            reason, condition = (
                " → ".join(f"`{_cell(part.removesuffix(' (unchanged)'))}`" for part in cell.split("\n→ "))
                + (" (unchanged)" if cell.endswith(" (unchanged)") else "")
                for cell in _reworded(x)
            )
            lines.append(f"| reworded | {short_name(x['function'])} | {reason} | {condition} |")
        lines.append("")
    lines += ["## Call graph", ""]
    if g["edges_added"] or g["edges_removed"]:
        lines += ["| change | caller | callee |", "|---|---|---|"]
        lines += [f"| added | `{e['caller']}` | `{e['callee']}` |" for e in g["edges_added"]]
        lines += [f"| removed | `{e['caller']}` | `{e['callee']}` |" for e in g["edges_removed"]]
        lines.append("")
    else:
        lines += ["No call edge appeared or vanished.", ""]
    if svg_name:
        lines += [f"![union call graph: added edges green, removed red]({svg_name})", ""]
    lines += ["## Sources", ""]
    if not (s["changed"] or s["added"] or s["removed"]):
        lines += ["No function on the attention path changed its source.", ""]
    for label, names in (("added", s["added"]), ("removed", s["removed"])):
        if names:
            lines += [f"{label.capitalize()}: " + ", ".join(f"`{n}`" for n in names), ""]
    for name in s["changed"]:
        text = diff["source_diffs"].get(name, "")
        fence = "```"
        while fence in text:
            fence += "`"
        lines += ["<details>", f"<summary>changed: <code>{name}</code></summary>", "", f"{fence}diff",
                  text.rstrip("\n"), fence, "", "</details>", ""]  # fmt: skip
    return "\n".join(lines).rstrip("\n") + "\n"


class SourceDiff:
    """A unified diff of Python source: code in syntax colour, ``+``/``-`` lines marked green/red.

    On a colour terminal with 256 or more colours the changed lines also get a tinted background.
    Lines are never wrapped or cut (print with ``crop=False``): the terminal wraps them, and piped
    output is the plain unified diff, line for line.
    """

    _MARK: ClassVar[dict[str, tuple[str, str]]] = {"+": ("bold green", "on #0f2f14"), "-": ("bold red", "on #3a1214")}

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        tint = console.color_system in ("256", "truecolor")
        code = Syntax("", "python", theme="ansi_dark", background_color="default")
        for line in self.text.splitlines():
            if line.startswith(("---", "+++")):
                yield Text(line, style="bold", no_wrap=True, overflow="ignore")
            elif line.startswith("@@"):
                yield Text(line, style="magenta", no_wrap=True, overflow="ignore")
            else:
                mark, body = line[:1], line[1:]
                text = Text(no_wrap=True, overflow="ignore", end="\n")
                style, background = self._MARK.get(mark, ("dim", ""))
                text.append(mark or " ", style=style)
                highlighted = code.highlight(body)
                if highlighted.plain.endswith("\n"):  # the lexer ends every snippet with a newline
                    highlighted.right_crop(1)
                text.append_text(highlighted)
                if tint and background:
                    text.stylize(background)
                yield text


def _reworded(x: dict[str, str]) -> tuple[str, str]:
    """The reason and condition cells of a reworded condition: only what changed, was → became."""
    same_reason = " ".join(x["was"].split()) == " ".join(x["became"].split())
    same_condition = " ".join(x["condition_was"].split()) == " ".join(x["condition_became"].split())
    reason = f"{x['was']} (unchanged)" if same_reason else f"{x['was']}\n→ {x['became']}"
    condition = f"{x['condition_was']} (unchanged)" if same_condition else (
        f"{x['condition_was']}\n→ {x['condition_became']}"
    )
    return reason, condition


def diff_renderable(diff: dict[str, Any], *, width: int = 200, full: bool = False) -> RenderableType:
    """What users feel first: the summary, behaviour probes, conditions, call edges, then sources.

    Source diffs are printed whole only with ``full``; otherwise the changed
    functions are named (their diffs are in the JSON and Markdown outputs).
    """
    parts: list[RenderableType] = [Text(diff["summary"], style="bold")]
    s, c, g, p = diff["sources"], diff["fast_path_conditions"], diff["callgraph"], diff["probes"]["changed"]
    if p:
        probes: list[list[str | Text]] = [[x["kind"], x["key"], *shown_change(x["was"], x["became"])] for x in p]
        cols = [Col("probe"), Col("case"), Col("was", "text"), Col("became", "text")]
        parts.append(Text(""))
        parts.append(records_view("behaviour that changed (measured)", cols, probes, width=width, title_cols=2))
    if c["added"] or c["removed"] or c["reworded"]:
        rows: list[list[str | Text]] = []
        for kind in ("added", "removed"):
            for x in c[kind]:
                rows.append([kind, short_name(x["function"]), x["reason"], x["condition"]])
        for x in c["reworded"]:
            rows.append(["reworded", short_name(x["function"]), *_reworded(x)])
        cols = [Col("change"), Col("function"), Col("reason", "text"), Col("condition", "text")]
        parts.append(Text(""))
        parts.append(records_view("fast-path conditions", cols, rows, width=width, title_cols=2))
    if g["edges_added"] or g["edges_removed"]:
        edges: list[list[str | Text]] = [[Text("added", style="green"), e["caller"], e["callee"]]
                                         for e in g["edges_added"]]  # fmt: skip
        edges += [[Text("removed", style="red"), e["caller"], e["callee"]] for e in g["edges_removed"]]
        parts.append(Text(""))
        parts.append(records_view("call-graph edges", [Col("change"), Col("caller"), Col("callee")], edges,
                                  width=width, title_cols=2))  # fmt: skip
    if s["added"] or s["removed"]:
        parts.append(Text(""))
        parts.append(Text("functions added: " + (", ".join(s["added"]) or "-")))
        parts.append(Text("functions removed: " + (", ".join(s["removed"]) or "-")))
    if s["changed"] and full:
        for name in s["changed"]:
            parts.append(Text(f"\nchanged: {name}", style="bold cyan", no_wrap=True, overflow="ignore"))
            parts.append(SourceDiff(diff["source_diffs"].get(name, "")))
    elif s["changed"]:
        parts.append(Text(""))
        parts.append(Text("source changed: " + ", ".join(s["changed"])))
        parts.append(Text("(--full prints each unified diff; --md FILE writes them)", style="dim"))
    return Group(*parts)


def diff_dot(a: dict[str, Any], b: dict[str, Any], diff: dict[str, Any]) -> str:
    """DOT of the union of both call graphs: added edges green, removed red, the rest grey."""
    ga, gb = report_graph(a), report_graph(b)
    union = nx.compose(ga, gb)
    added = {(e["caller"], e["callee"]) for e in diff["callgraph"]["edges_added"]}
    removed = {(e["caller"], e["callee"]) for e in diff["callgraph"]["edges_removed"]}
    for u, v, data in union.edges(data=True):
        data.update(paths=(), kind=("static",))  # unchanged edges: grey
        if (u, v) in added:
            data.update(colour=_ADDED, tooltip=f"added in {diff['b']}")
        elif (u, v) in removed:
            data.update(colour=_REMOVED, tooltip=f"gone in {diff['b']}")
    for node in union.nodes:
        if node not in ga:
            union.nodes[node]["fill"] = "#c8e6c9"
        elif node not in gb:
            union.nodes[node]["fill"] = "#ffcdd2"
    legend = "green: added (edge or function)\\lred: removed\\lgrey dashed: in both\\l"
    return to_dot(union, f"attention call graph: torch {diff['a']} → {diff['b']}", legend=legend)
