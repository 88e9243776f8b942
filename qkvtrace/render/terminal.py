"""Rich renderables for trace results. Reads records only; never touches torch."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from qkvtrace.records import AttentionCall, GradientRecord, SliceGrad, TraceResult

__all__ = [
    "agreement_table",
    "blind_spots",
    "calls_table",
    "findings_table",
    "fully_masked_table",
    "mask_semantics_table",
    "scenarios_table",
    "summary_line",
    "trace_table",
]

_PATH_STYLE = {
    "fast": "bold green",
    "fused_encoder_layer": "bold green",
    "fallback": "yellow",
    "sdpa": "cyan",
}


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"


def _qkv_norms(call: AttentionCall) -> str:
    parts = (call.qkv.q, call.qkv.k, call.qkv.v)
    if all(p is None or p.weight_norm is None for p in parts):
        return "-"
    return " / ".join(_fmt(p.weight_norm if p else None) for p in parts)


def _grad_norms(grads: list[GradientRecord], module: str) -> str:
    mine = [g for g in grads if g.module == module]
    if not mine:
        return "-"
    last = mine[-1]
    slices: tuple[SliceGrad, ...] = (last.q, last.k, last.v)
    return " / ".join(_fmt(s.grad_norm) for s in slices)


def _why(call: AttentionCall) -> Text:
    if call.path in ("fast", "fused_encoder_layer"):
        return Text("(fast path taken)", style="dim")
    if call.why_not_fast_path is None:
        return Text("-", style="dim")
    text = Text(" ".join(call.why_not_fast_path.split()))
    if call.why_not_fused_layer and call.why_not_fused_layer != call.why_not_fast_path:
        text.append(f"\nlayer: {' '.join(call.why_not_fused_layer.split())}", style="dim")
    return text


def trace_table(result: TraceResult, *, title: str | None = None) -> Table:
    """One row per attention call: module, path, why, backend, Q/K/V and grad norms."""
    table = Table(title=title, show_lines=False, expand=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("module")
    table.add_column("path")
    table.add_column("why not fast", overflow="fold", max_width=44)
    table.add_column("backend")
    table.add_column("|Wq| / |Wk| / |Wv|", justify="right")
    table.add_column("|dWq| / |dWk| / |dWv|", justify="right")
    for call in result.calls:
        table.add_row(
            str(call.index),
            call.module or "(root)",
            Text(call.path, style=_PATH_STYLE.get(call.path, "")),
            _why(call),
            call.sdpa_backend or Text("none", style="dim"),
            _qkv_norms(call),
            _grad_norms(result.gradients, call.module),
        )
    return table


def summary_line(result: TraceResult) -> str:
    """``"4 calls · paths: fallback 2, fast 2 · backends: FLASH_ATTENTION 2, none 2"``."""
    s = result.summary()
    n = len(result.calls)
    paths = ", ".join(f"{k} {v}" for k, v in s["paths"].items()) or "none"
    backends = ", ".join(f"{k} {v}" for k, v in s["backends"].items()) or "none"
    grads = len({g.backward_index for g in result.gradients})
    tail = f" · backward passes recorded: {grads}" if grads else ""
    return f"{n} attention call{'s' if n != 1 else ''} · paths: {paths} · backends: {backends}{tail}"


def blind_spots(result: TraceResult) -> list[str]:
    """What the trace could not see, one line each: warnings, then modules that made no recorded call."""
    lines = [f"warning: {w}" for w in result.warnings]
    for u in result.unobserved:
        lines.append(f"unobserved: {u.module or '(root)'} ({u.module_type}): {u.reason}")
    return lines


def findings_table(findings: list[Any], title: str) -> Table:
    """One row per check and mode: PASS/FAIL and the evidence."""
    table = Table(title=title)
    table.add_column("check")
    table.add_column("mode")
    table.add_column("result")
    table.add_column("evidence", overflow="fold")
    for f in findings:
        result = Text("PASS", style="bold green") if f.passed else Text("FAIL", style="bold red")
        table.add_row(f.check, f.mode, result, f.detail)
    return table


def calls_table(calls: dict[str, list[dict[str, Any]]], title: str) -> Table:
    """Per mode, the attention calls the tracer saw during a check."""
    table = Table(title=title)
    for col in ("mode", "module", "path", "backend", "why not fast", "fully-masked rows", "NaN"):
        table.add_column(col, overflow="fold")
    for mode, rows in calls.items():
        for c in rows:
            table.add_row(
                mode,
                c["module"] or "(root)",
                Text(c["path"], style=_PATH_STYLE.get(c["path"], "")),
                c["sdpa_backend"] or "none",
                " ".join((c["why_not_fast_path"] or "-").split()),
                str(c["fully_masked_rows"]),
                str(c["nan_count"]),
            )
    return table


def scenarios_table(scenarios: list[dict[str, Any]]) -> Table:
    table = Table(title="what runs when (measured)")
    for col in ("scenario", "path", "backend", "why not fast (PyTorch's words)"):
        table.add_column(col, overflow="fold")
    for s in scenarios:
        if s.get("error"):
            table.add_row(s["description"], Text("error", style="red"), "", s["error"])
            continue
        calls = s["calls"]
        table.add_row(
            s["description"],
            ", ".join(sorted({c["path"] for c in calls})),
            ", ".join(sorted({c["sdpa_backend"] or "none" for c in calls})),
            "; ".join(sorted({" ".join((c["why_not_fast_path"] or "").split()) for c in calls} - {""})) or "-",
        )
    return table


def mask_semantics_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="boolean masks: what True means (measured on [[T, F], [F, T]])")
    for col in ("API", "True means", "masked → 0", "rows sum to 1", "observed weights"):
        table.add_column(col, overflow="fold")
    for r in records:
        weights = r.get("observed_weights")
        table.add_row(
            r["api"],
            Text(str(r.get("true_means")), style="bold"),
            str(r.get("masked_prob_zero")),
            "n/a" if r.get("rows_sum_to_one") is None else str(r["rows_sum_to_one"]),
            str(weights) if weights else (r.get("error") or "by perturbation"),
        )
    return table


def fully_masked_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="a query row whose keys are all masked returns (measured)")
    for col in ("API", "backend", "result", "grad finite"):
        table.add_column(col, overflow="fold")
    styles = {"nan": "bold red", "zero": "green", "other": "yellow", "error": "dim"}
    for r in records:
        result = r["result"] if r["result"] != "error" else f"error: {r.get('error', '')[:60]}"
        table.add_row(
            r["api"],
            r.get("backend") or "",
            Text(result, style=styles.get(r["result"], "")),
            "n/a" if r.get("grad_finite") is None else str(r["grad_finite"]),
        )
    return table


def agreement_table(data: dict[str, Any]) -> Table:
    table = Table(title="max |difference| to softmax(QKᵀ/√d_head + M)V (float64)")
    for col in ("computation", "dtype", "max abs diff"):
        table.add_column(col)
    for r in data.get("sdpa", []):
        diff = "error" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2g}"
        table.add_row(f"SDPA {r['backend']}", r["dtype"], diff)
    for r in data.get("mha", []):
        table.add_row(
            f"MHA {r['path']} vs. by hand (3 in_proj slices)", "float32", f"{r['max_abs_diff_to_by_hand']:.2g}"
        )
    return table
