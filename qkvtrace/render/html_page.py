"""One self-contained HTML page of a trace (``qkvtrace trace --html``, ``TraceResult.save_html``).

Everything is inline -- styles, the small script that sorts and filters the
calls table, the heatmaps and route pictures as SVG -- so the file opens from
``file://`` with no network and can be sent as it is. Without its script the
page still reads: every call's details are there, closed, under the table.

Sizes are bounded (:class:`~qkvtrace.render.html_parts.MapBounds`, ``max_calls``);
what is past a bound is named on the page, never dropped silently.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from qkvtrace.records import TraceResult, atomic_write_text, rows_label
from qkvtrace.render.html_parts import DEFAULT_BOUNDS, STYLE, MapBounds, esc, fmt, fragment, trace_fragment

if TYPE_CHECKING:
    from qkvtrace.analyses.grads import GradsResult

__all__ = ["grads_html", "grads_page", "grads_section", "save_page", "trace_html", "trace_page"]

_PAGE_STYLE = """
body { margin: 0; background: #fff; }
.qk.page { padding: 12px 20px 40px; }
.qk h1 { font-size: 20px; margin: 4px 0 8px; overflow-wrap: anywhere; }
.qk h2 { font-size: 17px; margin: 18px 0 6px; }
.qk h4 { margin: 10px 0 4px; }
.qk .controls { display: flex; flex-wrap: wrap; gap: 8px 16px; align-items: end; margin: 8px 0; }
.qk .controls label { display: flex; flex-direction: column; font-size: 12px; font-weight: 600; }
.qk .controls select, .qk .controls input { font-size: 14px; padding: 2px 4px; min-width: 10em; }
.qk table.calls tbody tr { cursor: pointer; }
.qk table.calls tbody tr:hover { background: #f5f9ff; }
.qk table.calls tbody tr.selected { background: #e3f2fd; outline: 2px solid #1565c0; }
.qk th button.sort { all: unset; cursor: pointer; font-weight: 600; }
.qk th button.sort:focus-visible { outline: 2px solid #1565c0; }
.qk th[aria-sort=ascending] button.sort::after { content: " ▲"; }
.qk th[aria-sort=descending] button.sort::after { content: " ▼"; }
.qk details.call > summary .name, .qk dd .name { white-space: normal; overflow-wrap: anywhere; }
.qk figure { max-width: 100%; overflow-x: auto; }
.qk .picture { max-width: 100%; overflow-x: auto; }
.qk .picture svg { max-width: 100%; height: auto; }
.qk footer { margin-top: 24px; font-size: 12px; color: #5f5f5f; }
"""

_SCRIPT = """
(function () {
  "use strict";
  var table = document.querySelector("table.calls");
  if (!table) { return; }
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var path = document.getElementById("filter-path");
  var backend = document.getElementById("filter-backend");
  var module = document.getElementById("filter-module");
  var count = document.getElementById("shown");
  function apply() {
    var p = path.value, b = backend.value, m = module.value.trim().toLowerCase(), n = 0;
    rows.forEach(function (r) {
      var ok = (!p || r.dataset.path === p) && (!b || r.dataset.backend === b) &&
               (!m || r.dataset.module.toLowerCase().indexOf(m) >= 0);
      r.hidden = !ok;
      if (ok) { n += 1; }
    });
    count.textContent = n + " of " + rows.length + " rows shown";
  }
  path.addEventListener("change", apply);
  backend.addEventListener("change", apply);
  module.addEventListener("input", apply);
  var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
  heads.forEach(function (th, col) {
    th.querySelector("button").addEventListener("click", function () {
      var ascending = th.getAttribute("aria-sort") !== "ascending";
      heads.forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      var numeric = th.dataset.kind === "num";
      function key(r) {
        var c = r.cells[col];
        return numeric ? parseFloat(c.dataset.value || c.textContent) : c.textContent.trim().toLowerCase();
      }
      rows.slice().sort(function (a, b) {
        var x = key(a), y = key(b);
        return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
      }).forEach(function (r) { body.appendChild(r); });
    });
  });
  function show(id) {
    var details = document.getElementById(id);
    if (!details) { return; }
    details.open = true;
    rows.forEach(function (r) { r.classList.toggle("selected", r.dataset.call === id); });
    details.scrollIntoView({ block: "start" });
  }
  rows.forEach(function (r) {
    r.addEventListener("click", function (event) {
      if (event.target.closest("a")) { return; }
      history.replaceState(null, "", "#" + r.dataset.call);
      show(r.dataset.call);
    });
  });
  window.addEventListener("hashchange", function () { show(location.hash.slice(1)); });
  if (location.hash) { show(location.hash.slice(1)); }
  apply();
})();
"""


def _options(values: list[str]) -> str:
    return '<option value="">all</option>' + "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)


def _controls(result: TraceResult) -> str:
    paths = sorted({c.path for c in result.calls} | {f"compiled {op.entry}" for op in result.compiled})
    backends = sorted({c.sdpa_backend or "none" for c in result.calls} |
                      {op.sdpa_backend or "none" for op in result.compiled})  # fmt: skip
    return (
        '<div class="controls" role="search">'
        f'<label for="filter-path">path<select id="filter-path">{_options(paths)}</select></label>'
        f'<label for="filter-backend">backend<select id="filter-backend">{_options(backends)}</select></label>'
        '<label for="filter-module">module contains<input id="filter-module" type="search" '
        'placeholder="e.g. layers.0" autocomplete="off"></label>'
        '<span id="shown" aria-live="polite"></span></div>'
    )


def _document(title: str, body: str) -> str:
    from qkvtrace.base.version import __version__

    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}{_PAGE_STYLE}</style></head>"
        f'<body><main class="qk page"><h1>{esc(title)}</h1>{body}'
        f"<footer>Written by qkvtrace {esc(__version__)}. One file: no network, nothing loaded from elsewhere."
        f"</footer></main><script>{_SCRIPT}</script></body></html>\n"
    )


def trace_page(result: TraceResult, *, title: str = "qkvtrace trace", tokens: list[list[str]] | None = None,
               bounds: MapBounds = DEFAULT_BOUNDS, max_calls: int = 2000, extra: str = "") -> str:  # fmt: skip
    """The page of a trace: summary, blind spots, a sortable and filterable calls table, each call's details.

    ``tokens``: labels of the maps' axes per batch item. ``extra``: HTML put
    before the calls (e.g. the routes picture of ``qkvtrace grads``).
    """
    body = (
        (extra or _routes_of_trace(result)) + "<h2>Attention calls</h2>"
        "<p class=\"dim\">Click a row (or its #) for the call's details: PyTorch's reason, the kernel's evidence, "
        "Q/K/V slices, gradients and the attention map when one was recorded. Sort by a column's header.</p>"
        + trace_fragment(result, tokens=tokens, bounds=bounds, max_calls=max_calls, controls=_controls(result))
    )
    return _document(title, body)


def _inline_svg(svg: str) -> str:
    """An SVG document as an element of the page: no XML prolog, no DOCTYPE (nothing to fetch)."""
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    return svg.strip()


#: the smallest text a picture on the page may show, in CSS pixels
MIN_TEXT_PX = 12.0


def readable_svg(svg: str, min_text_px: float = MIN_TEXT_PX) -> str:
    """The SVG with a ``min-width`` that keeps its smallest text at ``min_text_px`` or more.

    The page's CSS shrinks a picture to its box (``max-width: 100%``); a wide
    one (a routes picture is thousands of points wide) then shows its text a
    few pixels high. ``min-width`` wins over ``max-width``, so the picture
    stops shrinking there and its box scrolls sideways instead.
    """
    head = re.search(r"<svg\b[^>]*>", svg)
    box = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) [\d.]+"', head.group(0)) if head else None
    sizes = [float(x) for x in re.findall(r'font-size="([\d.]+)"', svg)]
    if head is None or box is None or not sizes:
        return svg
    # a user unit shows at (shown width / viewBox width) px: the smallest text reaches min_text_px at this width
    need = float(box.group(1)) * min_text_px / min(sizes)
    tag = head.group(0)
    styled = tag.replace("<svg", f'<svg style="min-width: {need:.0f}px"', 1)
    return svg.replace(tag, styled, 1)


def grads_page(result: GradsResult, *, title: str | None = None) -> str:
    """The page of ``qkvtrace grads``: the routes picture, each call's routes and slices, then the trace."""
    return trace_page(result.trace, title=title or f"qkvtrace grads {result.target}", extra=grads_section(result))


def grads_section(result: GradsResult) -> str:
    """The routes picture (Graphviz, inline SVG) and a row per call: its backward kernel, route shares, slices."""
    from qkvtrace.render.grads_render import grads_dot
    from qkvtrace.render.graph import render_svg

    drawable = result.drawable()
    parts = [] if result.loss_kind == "traced" else [_loss_line(result)]
    if drawable:
        drawing = render_svg(grads_dot(result, drawable))
        if drawing.svg is not None:
            parts.append('<h2>How the loss reaches W_Q, W_K, W_V</h2><div class="picture" role="img" '
                         f'aria-label="gradient routes">{readable_svg(_inline_svg(drawing.svg))}</div>')  # fmt: skip
        else:
            parts.append(f'<p class="note">Routes picture not drawn: {esc(drawing.problem)}</p>')
    rows = []
    for r in result.routes:
        shares = " · ".join(f"{p.upper()} {_percent((getattr(r, p) or {}).get('share'))}" for p in ("q", "k", "v"))
        slices = "\n".join(f"{p.upper()} {s.param}[{rows_label(s.rows)}] |dW| {fmt(s.grad_norm)}"
                           for p, s in r.slices.items())  # fmt: skip
        rows.append(f'<tr><td class="num">#{r.call}</td><td class="name">{esc(r.module or "(root)")}</td>'
                    f"<td>{esc(r.backward_kernel or '-')}</td><td>{esc(shares if r in drawable else r.reason)}</td>"
                    f'<td class="reason">{esc(slices or "-")}</td></tr>')  # fmt: skip
    head = "".join(f'<th scope="col">{h}</th>' for h in ("call", "module", "backward kernel", "route shares",
                                                          "weight slices"))  # fmt: skip
    parts.append(f'<h2>Routes per call</h2><div class="scroll"><table class="routes-summary"><thead><tr>{head}</tr>'
                 f'</thead><tbody>{"".join(rows)}</tbody></table></div>')  # fmt: skip
    return "".join(parts)


def _loss_line(result: GradsResult) -> str:
    from qkvtrace.analyses.grads import LOSS_TEXT

    loss = LOSS_TEXT.get(result.loss_kind, result.loss_kind)
    return f"<p>Loss: {esc(loss)} = {fmt(result.loss)} · torch {esc(result.torch_version)}</p>"


def trace_html(result: TraceResult, *, tokens: list[list[str]] | None = None) -> str:
    """A trace as a notebook shows it: the routes picture when a backward pass was traced, then the trace."""
    return fragment(_routes_of_trace(result) + trace_fragment(result, tokens=tokens))


def grads_html(result: GradsResult) -> str:
    """What ``qkvtrace grads`` measured as a notebook shows it: the routes picture and rows, then the trace."""
    return fragment(grads_section(result) + trace_fragment(result.trace))


def _routes_of_trace(result: TraceResult) -> str:
    """The routes picture and a row per call, for a trace whose backward pass reached its calls; else nothing."""
    if not result.routes:
        return ""
    from qkvtrace.analyses.grads import routes_of

    return grads_section(routes_of(result))


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def save_page(text: str, path: str | os.PathLike[str]) -> Path:
    """Write a page atomically (complete or absent)."""
    return atomic_write_text(Path(path), text)
