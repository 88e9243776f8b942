"""Rich renderables for trace results. Reads records only; never touches torch."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from qkvtrace.records import AttentionCall, GradientRecord, SliceGrad, TraceResult

__all__ = ["summary_line", "trace_table"]

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
