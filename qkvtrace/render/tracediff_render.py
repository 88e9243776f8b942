"""A diff of two traces as a rich renderable and as Markdown."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from qkvtrace.records import kernel_refusal
from qkvtrace.render.terminal import Col, records_view

__all__ = ["tracediff_markdown", "tracediff_renderable"]


def _value(field: str, value: Any) -> str:
    if value is None:
        return "-"
    if field == "sdpa_refusals":
        found = kernel_refusal(value) if isinstance(value, dict) else None
        return f"{found[0]}: {found[1]}" if found else ("{} (nothing ranked above)" if value == {} else "-")
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ", ".join(value) or "(none)"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    return value if isinstance(value, str) else json.dumps(value)


def _name(entry: dict[str, Any]) -> str:
    module = entry["module"] or "(root)"
    return f"{module} (call {entry['occurrence'] + 1})" if entry["occurrence"] else module


def _ran(entry: dict[str, Any]) -> str:
    return f"{entry['path']} ({entry['sdpa_backend'] or 'none'})"


def _rows(d: dict[str, Any]) -> list[list[str | Text]]:
    rows: list[list[str | Text]] = []
    for call in d["changed"]:
        for ch in call["changes"]:
            rows.append([_name(call), ch["label"], _value(ch["field"], ch["was"]), _value(ch["field"], ch["became"])])
    for entry in d["vanished"]:
        rows.append([_name(entry), Text("vanished", style="red"), _ran(entry), "-"])
    for entry in d["appeared"]:
        rows.append([_name(entry), Text("appeared", style="green"), "-", _ran(entry)])
    return rows


def tracediff_renderable(d: dict[str, Any], *, width: int = 200) -> RenderableType:
    """The summary, then one row per change: call, what, was, became."""
    parts: list[RenderableType] = [Text(d["summary"], style="bold")]
    rows = _rows(d)
    if rows:
        cols = [Col("call"), Col("what"), Col("was", "text"), Col("became", "text")]
        parts.append(records_view("what changed, call by call", cols, rows, width=width, title_cols=2))
    return Group(*parts)


def tracediff_markdown(d: dict[str, Any]) -> str:
    lines = [f"# Trace diff: torch {d['a']['torch_version']} → {d['b']['torch_version']}", "", d["summary"], ""]
    rows = _rows(d)
    if rows:
        lines += ["| call | what | was | became |", "|---|---|---|---|"]
        for row in rows:
            cells = [c.plain if isinstance(c, Text) else c for c in row]
            lines.append("| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    lines.append(f"Norms are compared with a relative tolerance of {d['rtol']:g}; everything else exactly.")
    return "\n".join(lines) + "\n"
