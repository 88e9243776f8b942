"""Rich renderables for trace results, checks and probes. Reads records only; never touches torch.

Readable at any width: the facts a command exists to show — a module's name, the
path, the SDPA backend, PyTorch's reason — are never cut. Names are never wrapped
or folded (a name is searched for and copied whole); reasons wrap between words.
When the identifying columns and a readable reason column do not fit the width,
a table becomes one block per row, its name as the title (:func:`records_view`).
Print the renderables with ``console.print(x, crop=False)`` so a name longer than
the terminal runs on rather than being cropped.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from qkvtrace.records import AttentionCall, CompiledAttention, GradientRecord, SliceGrad, TraceResult, kernel_refusal

__all__ = [
    "COLUMNS",
    "Col",
    "agreement_table",
    "blind_spots",
    "calls_table",
    "compiled_why_cell",
    "convention_lines",
    "findings_table",
    "fmt_number",
    "fully_masked_table",
    "grad_norms_cell",
    "mask_semantics_table",
    "records_view",
    "scenarios_table",
    "summary_line",
    "trace_table",
    "why_cell",
]

_PATH_STYLE = {
    "fast": "bold green",
    "fused_encoder_layer": "bold green",
    "fallback": "yellow",
    "sdpa": "cyan",
    "flex": "cyan",
}

#: secondary columns of ``qkvtrace trace`` (``--columns``), in display order
COLUMNS = {
    "type": "module type",
    "weights": "|W| q/k/v",
    "grads": "|dW| q/k/v",
    "ops": "aten ops",
}

#: a reason column narrower than this reads as a word per line: switch to blocks instead
_MIN_TEXT = 24


@dataclass(frozen=True)
class Col:
    """A column: ``name`` (never wrapped: identifiers, numbers) or ``text`` (wraps between words)."""

    header: str
    kind: str = "name"
    justify: str = "left"


def _plain(cell: str | Text) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _cell_width(cell: str | Text) -> int:
    return max((len(line) for line in _plain(cell).split("\n")), default=0)


def _table_width(cols: Sequence[Col], rows: Sequence[Sequence[str | Text]]) -> int:
    """The width a boxed table needs with every name column whole and text columns at ``_MIN_TEXT``."""
    total = len(cols) + 1  # vertical rules
    for i, col in enumerate(cols):
        natural = max([len(col.header)] + [_cell_width(r[i]) for r in rows])
        total += 2 + (min(natural, _MIN_TEXT) if col.kind == "text" else natural)
    return total


def _as_text(cell: str | Text, **kw: Any) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(cell, **kw)


def records_view(
    title: str | None,
    cols: Sequence[Col],
    rows: Sequence[Sequence[str | Text]],
    *,
    width: int,
    title_cols: int = 1,
) -> RenderableType:
    """A table when it fits ``width`` with every name whole; else one block per row.

    In a block the first ``title_cols`` cells make the title line (never wrapped), and
    every other cell is a ``header  value`` line; text values wrap under themselves.
    """
    head: list[RenderableType] = [Text(title, style="bold", no_wrap=True, overflow="ignore")] if title else []
    if _table_width(cols, rows) <= width:
        table = Table(expand=False)
        for i, col in enumerate(cols):
            natural = max([len(col.header)] + [_cell_width(r[i]) for r in rows])
            if col.kind == "name":
                table.add_column(col.header, no_wrap=True, min_width=natural, justify=col.justify)  # type: ignore[arg-type]
            else:
                table.add_column(col.header, overflow="fold", min_width=min(natural, _MIN_TEXT))
        for row in rows:
            table.add_row(*row)
        return Group(*head, table)
    blocks: list[RenderableType] = list(head)
    key_width = max((len(c.header) for c in cols[title_cols:]), default=0)
    indent = 2 + key_width + 2
    for row in rows:
        block = Text(no_wrap=True, overflow="ignore")
        for j, cell in enumerate(row[:title_cols]):
            if j:
                block.append("  ")
            block.append(_as_text(cell, style="bold") if j == title_cols - 1 else _as_text(cell))
        for col, cell in zip(cols[title_cols:], row[title_cols:], strict=True):
            value = _as_text(cell)
            lines = value.plain.split("\n")
            if col.kind == "text":  # wrap between words under the value's first column; never cut a word
                lines = [w for line in lines for w in (textwrap.wrap(line, max(width - indent, _MIN_TEXT),
                         break_long_words=False, break_on_hyphens=False) or [""])]  # fmt: skip
            block.append("\n  " + col.header.ljust(key_width) + "  ", style="dim")
            block.append(lines[0], style=value.style)
            for line in lines[1:]:
                block.append("\n" + " " * indent + line, style=value.style)
        blocks.append(block)
    return Group(*blocks)


def fmt_number(x: float | None) -> str:
    """Numbers take little room: three significant digits, no padded exponent (``2.96e-7``)."""
    if x is None:
        return "-"
    return f"{x:.3g}".replace("e-0", "e-").replace("e+0", "e+")


def _qkv_norms(call: AttentionCall) -> str:
    parts = (call.qkv.q, call.qkv.k, call.qkv.v)
    if all(p is None or p.weight_norm is None for p in parts):
        return "-"
    return "/".join(fmt_number(p.weight_norm if p else None) for p in parts)


def grad_norms_cell(grads: list[GradientRecord], module: str) -> str:
    mine = [g for g in grads if g.module == module]
    if not mine:
        return "-"
    last = mine[-1]
    slices: tuple[SliceGrad, ...] = (last.q, last.k, last.v)
    return "/".join(fmt_number(s.grad_norm) for s in slices)


def why_cell(call: AttentionCall) -> Text:
    """PyTorch's reason against the fast path, then its words against a faster SDPA kernel (one cell)."""
    if call.path in ("fast", "fused_encoder_layer"):
        return Text("(fast path taken)", style="dim")
    kernel = kernel_refusal(call.sdpa_refusals)
    if call.why_not_fast_path is None:
        text = Text("-", style="dim") if kernel is None else Text()
    else:
        text = Text(" ".join(call.why_not_fast_path.split()))
        if call.why_not_fused_layer and call.why_not_fused_layer != call.why_not_fast_path:
            text.append(f"\nlayer: {' '.join(call.why_not_fused_layer.split())}", style="dim")
    if kernel is not None:  # PyTorch refused a backend it ranks above the one it chose, in its own words
        text.append("\n" if text.plain else "")
        text.append(f"not {kernel[0]}: ", style="dim")
        text.append(kernel[1])
    return text


def _path(path: str) -> Text:
    return Text(path, style=_PATH_STYLE.get(path, ""))


def _backend(backend: str | None) -> Text:
    return Text(backend) if backend else Text("none", style="dim")


def trace_table(
    result: TraceResult,
    *,
    title: str | None = None,
    width: int = 200,
    columns: Sequence[str] | None = None,
) -> RenderableType:
    """One row (or block) per attention call: module, path, backend, PyTorch's reason.

    ``columns`` adds secondary columns (keys of :data:`COLUMNS`); by default the gradient
    norms are shown when gradients were recorded.
    """
    extra = list(columns) if columns is not None else (["grads"] if result.gradients else [])
    unknown = [c for c in extra if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; choose from {', '.join(COLUMNS)}")
    extra = [c for c in COLUMNS if c in extra]
    cols = [Col("#", justify="right"), Col("module"), Col("path"), Col("backend")]
    cols += [Col(COLUMNS[c], justify="left" if c in ("type", "ops") else "right") for c in extra]
    cols.append(Col("why not fast", "text"))
    compiled = bool(result.compiled)
    if compiled:  # what the compiled code runs is not a reason: a column of its own
        cols.append(Col("compiled code runs", "text"))
    rows: list[list[str | Text]] = []
    for call in result.calls:
        cells: dict[str, str | Text] = {
            "type": call.module_type,
            "weights": _qkv_norms(call),
            "grads": grad_norms_cell(result.gradients, call.module),
            "ops": "\n".join(call.aten_ops) if call.aten_ops else Text(call.evidence or "-", style="dim"),
        }
        rows.append([Text(f"#{call.index}", style="dim"), call.module or "(root)", _path(call.path),
                     _backend(call.sdpa_backend), *(cells[c] for c in extra), why_cell(call),
                     *([Text("-", style="dim")] if compiled else [])])  # fmt: skip
    for op in result.compiled:  # what torch.compile made of attention, marked "compiled"
        runs = "\n".join(op.runs) or "-"
        cells = {"type": op.module_type, "weights": "-", "grads": "-", "ops": runs}
        rows.append([Text(f"#c{op.index}", style="dim"), op.module or "(root)",
                     Text(f"compiled {op.entry}", style=_PATH_STYLE.get(op.entry, "")), _backend(op.sdpa_backend),
                     *(cells[c] for c in extra), Text("-", style="dim"), compiled_why_cell(op)])  # fmt: skip
    return records_view(title, cols, rows, width=width, title_cols=2)


def compiled_why_cell(op: CompiledAttention) -> Text:
    """For a compiled operation: what it runs, which compiler's graph holds it, and what the compiler changed."""
    text = Text(", ".join(op.runs) or "-")
    if op.backward:
        text.append("\nbackward: " + ", ".join(op.backward))
    text.append(f"\n(in {op.compiler} graph {op.graph})", style="dim")
    if op.rewritten:
        text.append("\n" + op.rewritten)
    return text


def summary_line(result: TraceResult, *, width: int | None = None) -> str:
    """``"4 calls · paths: fallback 2, fast 2 · backends: FLASH_ATTENTION 2, none 2"``.

    With ``width``, lines break only between the ``·``-separated parts.
    """
    s = result.summary()
    n = len(result.calls)
    paths = ", ".join(f"{k} {v}" for k, v in s["paths"].items()) or "none"
    backends = ", ".join(f"{k} {v}" for k, v in s["backends"].items()) or "none"
    grads = len({g.backward_index for g in result.gradients})
    parts = [f"{n} attention call{'s' if n != 1 else ''}", f"paths: {paths}", f"backends: {backends}"]
    parts += [f"backward passes recorded: {grads}"] if grads else []
    if result.compiled:
        k = len(result.compiled)
        rewritten = sum(1 for op in result.compiled if op.rewritten)
        parts += [f"compiled: {k} attention op{'s' if k != 1 else ''} ({rewritten} rewritten by the compiler)"]
    if width is None:
        return " · ".join(parts)
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.append("· " + part)
    return "\n".join(lines)


def blind_spots(result: TraceResult) -> list[str]:
    """What the trace could not see, one line each: warnings, then modules that made no recorded call."""
    lines = [f"warning: {w}" for w in result.warnings]
    for u in result.unobserved:
        lines.append(f"unobserved: {u.module or '(root)'} ({u.module_type}): {u.reason}")
    return lines


def findings_table(findings: list[Any], title: str, *, width: int = 200) -> RenderableType:
    """One row per check and mode: PASS/FAIL and the evidence."""
    cols = [Col("check"), Col("mode"), Col("result"), Col("evidence", "text")]
    rows: list[list[str | Text]] = []
    for f in findings:
        result = Text("PASS", style="bold green") if f.passed else Text("FAIL", style="bold red")
        rows.append([f.check, f.mode, result, f.detail])
    return records_view(title, cols, rows, width=width, title_cols=3)


def convention_lines(convention: Any) -> list[Text]:
    """The padding mask's convention and whether the model was seen to honour it (nothing without one)."""
    if convention is None:
        return []
    source = {
        "given": "as given",
        "known": f"the known convention of {convention.mask_arg}",
        "assumed": "assumed: PyTorch's convention; say --mask-true-means to be sure",
    }[convention.source]
    meaning = "padding" if convention.true_means == "ignore" else "a real token"
    line = Text(f"padding mask: {convention.mask_arg}=, True means {convention.true_means} (True on {meaning}; ")
    line.append(f"{source})")
    style = {True: "green", False: "bold red", None: "yellow"}[convention.confirmed]
    return [line, Text(f"convention {convention.evidence}", style=style)]


def calls_table(calls: dict[str, list[dict[str, Any]]], title: str, *, width: int = 200) -> RenderableType:
    """Per mode, the attention calls the tracer saw during a check."""
    cols = [Col("mode"), Col("module"), Col("path"), Col("backend"), Col("fully-masked rows", justify="right"),
            Col("NaN", justify="right"), Col("why not fast", "text")]  # fmt: skip
    rows: list[list[str | Text]] = []
    for mode, found in calls.items():
        for c in found:
            rows.append([mode, c["module"] or "(root)", _path(c["path"]), _backend(c["sdpa_backend"]),
                         str(c["fully_masked_rows"]), str(c["nan_count"]),
                         " ".join((c["why_not_fast_path"] or "-").split())])  # fmt: skip
    if not rows:  # say so rather than draw an empty table
        return Text(f"{title}: none recorded (no attention entry point ran, and no attention written by hand "
                    "was recognised)")
    return records_view(title, cols, rows, width=width, title_cols=2)


def scenarios_table(scenarios: list[dict[str, Any]], *, width: int = 200) -> RenderableType:
    cols = [Col("scenario", "text"), Col("path"), Col("backend"), Col("why not fast (PyTorch's words)", "text")]
    rows: list[list[str | Text]] = []
    for s in scenarios:
        if s.get("error"):
            rows.append([s["description"], Text("error", style="red"), "", s["error"]])
            continue
        calls = s["calls"]
        whys = sorted({" ".join((c["why_not_fast_path"] or "").split()) for c in calls} - {""})
        # and PyTorch's words against a faster SDPA kernel than the one it chose
        whys += sorted({f"not {b}: {r}" for c in calls if (found := kernel_refusal(c.get("sdpa_refusals")))
                        for b, r in [found]})  # fmt: skip
        rows.append([
            s["description"],
            "\n".join(sorted({c["path"] for c in calls})),
            "\n".join(sorted({c["sdpa_backend"] or "none" for c in calls})),
            "; ".join(whys) or "-",
        ])  # fmt: skip
    return records_view("what runs when (measured)", cols, rows, width=width)


def mask_semantics_table(records: list[dict[str, Any]], *, width: int = 200) -> RenderableType:
    cols = [Col("API"), Col("True means"), Col("masked → 0"), Col("rows sum to 1"), Col("observed weights", "text")]
    rows: list[list[str | Text]] = []
    for r in records:
        weights = r.get("observed_weights")
        rows.append([
            r["api"],
            Text(str(r.get("true_means")), style="bold"),
            str(r.get("masked_prob_zero")),
            "n/a" if r.get("rows_sum_to_one") is None else str(r["rows_sum_to_one"]),
            str(weights) if weights else (r.get("error") or "by perturbation"),
        ])  # fmt: skip
    return records_view("boolean masks: what True means (measured on [[T, F], [F, T]])", cols, rows, width=width)


def fully_masked_table(records: list[dict[str, Any]], *, width: int = 200) -> RenderableType:
    cols = [Col("API"), Col("backend"), Col("result", "text"), Col("grad finite")]
    styles = {"nan": "bold red", "zero": "green", "other": "yellow", "error": "dim"}
    rows: list[list[str | Text]] = []
    for r in records:
        result = r["result"] if r["result"] != "error" else f"error: {r.get('error', '')}"
        rows.append([
            r["api"],
            r.get("backend") or "",
            Text(result, style=styles.get(r["result"], "")),
            "n/a" if r.get("grad_finite") is None else str(r["grad_finite"]),
        ])  # fmt: skip
    return records_view("a query row whose keys are all masked returns (measured)", cols, rows, width=width,
                        title_cols=2)  # fmt: skip


def agreement_table(data: dict[str, Any], *, width: int = 200) -> RenderableType:
    cols = [Col("computation"), Col("dtype"), Col("max abs diff", justify="right")]
    rows: list[list[str | Text]] = []
    for r in data.get("sdpa", []):
        diff = "error" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2g}"
        rows.append([f"SDPA {r['backend']}", r["dtype"], diff])
    for r in data.get("mha", []):
        by_hand = f"{r['max_abs_diff_to_by_hand']:.2g}"
        rows.append([f"MHA {r['path']} vs. by hand (3 in_proj slices)", "float32", by_hand])
    return records_view("max |difference| to softmax(QKᵀ/√d_head + M)V (float64)", cols, rows, width=width)
