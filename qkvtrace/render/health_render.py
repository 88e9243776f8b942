"""Small per-module curves of a long run's attention health, as static HTML with inline SVG.

Per module: its max logit (any head) and its lowest head's mean entropy over
the measured steps, each a polyline whose every point carries its step and
value as text (a ``<title>`` tooltip), with first -> last in words and the
alert of :func:`qkvtrace.facts.health.alert`. No script, no external resource: the
same fragment shows in a notebook cell and in a saved page. Reads
``health`` lines (or :meth:`HealthRecord.to_dict`) only.
"""

from __future__ import annotations

from typing import Any

from qkvtrace.records.health_alerts import alert, series_of
from qkvtrace.render.html_parts import esc, fragment

__all__ = ["curve_svg", "health_html", "health_page"]

_W, _H, _PAD = 180, 44, 4


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def curve_svg(points: list[tuple[int, float]], label: str) -> str:
    """A ``_W`` x ``_H`` polyline of ``(step, value)`` points; each point's step and value in its tooltip."""
    if not points:
        return f'<span class="qk-none">no {esc(label)}</span>'
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    s0, s1 = min(steps), max(steps)
    lo, hi = min(values), max(values)

    def xy(s: int, v: float) -> tuple[float, float]:
        x = _PAD + (0.0 if s1 == s0 else (s - s0) / (s1 - s0)) * (_W - 2 * _PAD)
        y = _H - _PAD - (0.5 if hi == lo else (v - lo) / (hi - lo)) * (_H - 2 * _PAD)
        return round(x, 1), round(y, 1)

    coords = [xy(s, v) for s, v in points]
    line = " ".join(f"{x},{y}" for x, y in coords)
    dots = "".join(
        f'<circle cx="{x}" cy="{y}" r="2"><title>{esc(label)} at step {s}: {v:.4g}</title></circle>'
        for (x, y), (s, v) in zip(coords, points, strict=True)
    )
    return (
        f'<svg class="qk-curve" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{esc(label)}, steps {s0} to {s1}, from {values[0]:.3g} to {values[-1]:.3g}">'
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{line}"/>{dots}</svg>'
    )


def health_html(lines: list[dict[str, Any]]) -> str:
    """A table: per module, its two curves with first -> last, and its alert (or none)."""
    rows = []
    for module, series in series_of(lines).items():
        logits = [(s, x) for s, x, _ in series if x is not None]
        entropies = [(s, y) for s, _, y in series if y is not None]
        said = alert(series) or "no alert"
        first, last = series[0], series[-1]
        rows.append(
            f"<tr><td><code>{esc(module or '(root)')}</code></td>"
            f"<td>{curve_svg(logits, 'max logit')}<br>{_fmt(first[1])} → {_fmt(last[1])}</td>"
            f"<td>{curve_svg(entropies, 'entropy (nats)')}<br>{_fmt(first[2])} → {_fmt(last[2])}</td>"
            f"<td>{esc(said)}</td></tr>"
        )
    if not rows:
        return "<p>no attention health measured (open the trace with keep='changes' and health_every=N)</p>"
    steps = len({line["step"] for line in lines})
    return (
        f"<section><h2>attention health, {steps} measured step(s)</h2><table>"
        "<thead><tr><th>module</th><th>max logit (any head)</th><th>entropy, nats (lowest head's mean)</th>"
        "<th>alert</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></section>"
    )


def health_fragment(lines: list[dict[str, Any]]) -> str:
    """:func:`health_html` with the stylesheet (what a notebook cell shows)."""
    return fragment(health_html(lines))


def health_page(lines: list[dict[str, Any]], *, title: str = "qkvtrace attention health") -> str:
    """A self-contained page of :func:`health_html`."""
    from qkvtrace.render.html_page import _document

    return _document(title, health_html(lines))
