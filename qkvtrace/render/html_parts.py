"""HTML fragments of trace results: the calls table, one call's details, heatmaps, routes.

Static HTML only -- no script, no external resource -- so a fragment shows the
same in a Jupyter output cell (``_repr_html_``), in a trusted or untrusted
notebook, and inside the self-contained page of :mod:`qkvtrace.render.html_page`.
Reads records only; never touches torch except to read a map's numbers.

Every fact is written as text: a path or backend has a colour *and* its name, a
heatmap cell has a shade *and* its value (in its tooltip), a fully masked row is
grey *and* labelled (the heatmaps: :mod:`qkvtrace.render.html_maps`). Module
names are never shortened.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

from qkvtrace.records import (
    AttentionCall,
    CompiledAttention,
    RouteRecord,
    SliceInfo,
    TraceResult,
    rows_label,
)
from qkvtrace.render.html_maps import DEFAULT_BOUNDS, DrawBudget, MapBounds, call_maps, tensors_maps
from qkvtrace.render.terminal import compiled_why_cell, grad_norms_cell, summary_line, why_cell
from qkvtrace.render.terminal import fmt_number as fmt

__all__ = [
    "DEFAULT_BOUNDS",
    "MapBounds",
    "call_details",
    "calls_table",
    "compiled_details",
    "fragment",
    "routes_table",
    "tensors_maps",
    "trace_fragment",
]

#: the stylesheet of every fragment (the page adds its own layout around it)
STYLE = """
.qk { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; font-size: 14px; color: #1a1a1a;
      line-height: 1.4; max-width: 100%; }
.qk table { border-collapse: collapse; margin: 0.4em 0; }
.qk th, .qk td { border: 1px solid #d0d0d0; padding: 3px 8px; text-align: left; vertical-align: top; }
.qk th { background: #f3f3f3; font-weight: 600; }
.qk td.num { text-align: right; font-variant-numeric: tabular-nums; }
.qk .scroll { overflow-x: auto; max-width: 100%; }
.qk .name { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: nowrap; }
.qk .reason { white-space: pre-wrap; min-width: 16em; }
.qk .dim { color: #5f5f5f; }
.qk .tag { display: inline-block; padding: 0 6px; border-radius: 3px; border: 1px solid; white-space: nowrap; }
.qk .p-fast, .qk .p-fused_encoder_layer { border-color: #2e7d32; color: #1b5e20; background: #e8f5e9; }
.qk .p-fallback { border-color: #ef6c00; color: #8a3c00; background: #fff3e0; }
.qk .p-sdpa, .qk .p-flex { border-color: #1565c0; color: #0d47a1; background: #e3f2fd; }
.qk .p-hand_written, .qk .p-other { border-color: #6a6a6a; color: #333; background: #f5f5f5; }
.qk .b-none { border-color: #9e9e9e; color: #555; background: #fafafa; }
.qk .b-kernel { border-color: #4a148c; color: #4a148c; background: #f3e5f5; }
.qk dl.facts { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 2px 12px; margin: 0.4em 0; }
.qk dl.facts dt { font-weight: 600; }
.qk dl.facts dd { margin: 0; overflow-wrap: anywhere; }
.qk details.call { border: 1px solid #d0d0d0; border-radius: 4px; margin: 6px 0; padding: 4px 10px; }
.qk details.call[open] { border-color: #1565c0; }
.qk details.call > summary { cursor: pointer; font-weight: 600; }
.qk details.inputs { margin: 8px 0; }
.qk details.inputs > summary { cursor: pointer; font-weight: 600; }
.qk .maps { display: flex; flex-wrap: wrap; gap: 12px; }
.qk figure { margin: 0; }
.qk figcaption { font-size: 12px; }
.qk .bar { display: inline-block; height: 10px; background: #1565c0; vertical-align: middle; }
.qk .note { background: #fff8e1; border-left: 3px solid #f9a825; padding: 2px 8px; margin: 4px 0; }
"""

_PATH_CLASS = {"fast", "fused_encoder_layer", "fallback", "sdpa", "flex", "hand_written"}
_PARTS = ("q", "k", "v")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def path_tag(path: str, label: str | None = None) -> str:
    css = path if path in _PATH_CLASS else "other"
    return f'<span class="tag p-{css}">{esc(label or path)}</span>'


def backend_tag(backend: str | None) -> str:
    if not backend:
        return '<span class="tag b-none">none</span>'
    return f'<span class="tag b-kernel">{esc(backend)}</span>'


def module_name(name: str) -> str:
    return name or "(root)"


def _th(label: str, key: str, kind: str = "text") -> str:
    # a button in the header: the page's script sorts by it; keyboard users reach it with Tab
    button = f'<button type="button" class="sort">{esc(label)}</button>'
    return f'<th scope="col" data-key="{key}" data-kind="{kind}">{button}</th>'


def calls_table(result: TraceResult, *, limit: int | None = None, link: bool = True) -> str:
    """One row per call (and per compiled operation): #, module, path, backend, |dW| q/k/v, why not fast.

    The columns and names of the terminal's table. Each row carries its call's
    path, backend and module as ``data-*`` attributes (the page filters by them)
    and links to the call's details (``#call-N``) when ``link``.
    """
    grads = bool(result.gradients)
    head = [_th("#", "index", "num"), _th("module", "module"), _th("path", "path"), _th("backend", "backend")]
    if grads:
        head.append(_th("|dW| q/k/v", "grads"))
    head.append(_th("why not fast", "why"))
    compiled = bool(result.compiled)
    if compiled:
        head.append(_th("compiled code runs", "compiled"))
    rows = []
    calls = result.calls if limit is None else result.calls[:limit]
    for call in calls:
        anchor = f"call-{call.index}"
        index = f'<a href="#{anchor}">#{call.index}</a>' if link else f"#{call.index}"
        cells = [
            f'<td class="num" data-value="{call.index}">{index}</td>',
            f'<td class="name">{esc(module_name(call.module))}</td>',
            f"<td>{path_tag(call.path)}</td>",
            f"<td>{backend_tag(call.sdpa_backend)}</td>",
        ]
        if grads:
            cells.append(f'<td class="num">{grad_norms_cell(result.gradients, call.module)}</td>')
        cells.append(f'<td class="reason">{esc(why_cell(call).plain)}</td>')
        if compiled:
            cells.append('<td class="reason">-</td>')
        rows.append(
            f'<tr data-call="{anchor}" data-index="{call.index}" data-module="{esc(module_name(call.module))}" '
            f'data-path="{esc(call.path)}" data-backend="{esc(call.sdpa_backend or "none")}">{"".join(cells)}</tr>'
        )
    for op in result.compiled if limit is None else result.compiled[: max(0, limit - len(calls))]:
        anchor = f"compiled-{op.index}"
        index = f'<a href="#{anchor}">#c{op.index}</a>' if link else f"#c{op.index}"
        path = f"compiled {op.entry}"
        cells = [
            f'<td class="num" data-value="{len(result.calls) + op.index}">{index}</td>',
            f'<td class="name">{esc(module_name(op.module))}</td>',
            f"<td>{path_tag(op.entry, path)}</td>",
            f"<td>{backend_tag(op.sdpa_backend)}</td>",
        ]
        if grads:
            cells.append('<td class="num">-</td>')
        cells.append('<td class="reason">-</td>')
        cells.append(f'<td class="reason">{esc(compiled_why_cell(op).plain)}</td>')
        rows.append(
            f'<tr data-call="{anchor}" data-index="{len(result.calls) + op.index}" '
            f'data-module="{esc(module_name(op.module))}" data-path="{esc(path)}" '
            f'data-backend="{esc(op.sdpa_backend or "none")}">{"".join(cells)}</tr>'
        )
    return (
        f'<div class="scroll"><table class="calls"><thead><tr>{"".join(head)}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _facts(pairs: Iterable[tuple[str, str | None]]) -> str:
    """A definition list of the pairs whose value is known (values are HTML already)."""
    items = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in pairs if v is not None)
    return f'<dl class="facts">{items}</dl>' if items else ""


def _reasons(call: AttentionCall) -> str:
    pairs: list[tuple[str, str | None]] = []
    if call.path in ("fast", "fused_encoder_layer"):
        pairs.append(("why not fast", "(fast path taken)"))
    elif call.why_not_fast_path is not None:
        pairs.append(("why not fast (PyTorch)", f'<span class="reason">{esc(call.why_not_fast_path)}</span>'))
    if call.why_not_fused_layer:
        pairs.append(
            ("why not the fused layer (PyTorch)", f'<span class="reason">{esc(call.why_not_fused_layer)}</span>')
        )
    if call.sdpa_refusals == {} and call.sdpa_backend:
        pairs.append(("faster SDPA kernels", f"none: PyTorch ranks no backend above {esc(call.sdpa_backend)} here"))
    for backend, words in (call.sdpa_refusals or {}).items():
        text = "\n".join(words) if words else "(would have run it)"
        pairs.append((f"not {backend}", f'<span class="reason">{esc(text)}</span>'))
    if call.sdpa_refusals_source:
        pairs.append(("refusals from", esc(call.sdpa_refusals_source)))
    return _facts(pairs)


def _slice_row(part: str, info: SliceInfo | None) -> str:
    if info is None:
        return f'<tr><th scope="row">{part.upper()}</th><td colspan="8" class="dim">not known</td></tr>'
    cells = [
        f'<td class="name">{esc(info.param or "-")}</td>',
        f'<td class="name">{esc(rows_label(info.rows, most=6))}{" (columns)" if info.dim == 1 else ""}</td>',
        f'<td class="name">{esc(info.shape or "-")}</td>',
        f'<td class="num">{fmt(info.weight_norm)}</td>',
        f'<td class="name">{esc(info.bias_param or "-")}</td>',
        f'<td class="num">{fmt(info.bias_norm)}</td>',
        f'<td class="num">{fmt(info.activation_norm)}</td>',
        f"<td>{esc(info.evidence or '-')}</td>",
    ]
    return f'<tr><th scope="row">{part.upper()}</th>{"".join(cells)}</tr>'


def _slices(call: AttentionCall) -> str:
    qkv = call.qkv
    if qkv.layout is None:
        return f'<p class="dim">Q/K/V slices not known: {esc(qkv.reason or "no projection was found")}</p>'
    head = "".join(f"<th scope=\"col\">{h}</th>" for h in
                   ("", "parameter", "rows", "shape", "|W|", "bias", "|b|", "|activation|", "evidence"))  # fmt: skip
    body = "".join(_slice_row(p, getattr(qkv, p)) for p in _PARTS)
    holder = f', held by <span class="name">{esc(qkv.holder)}</span>' if qkv.holder else ""
    return (
        f"<p>Q/K/V projection: {esc(qkv.layout)}{holder}</p>"
        f'<div class="scroll"><table class="slices"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


def _inputs(call: AttentionCall) -> str:
    pairs = []
    for key, value in call.inputs.items():
        if isinstance(value, dict):  # a mask's facts
            value = ", ".join(f"{k} {v}" for k, v in value.items() if k != "blocked_positions" and v is not None)
        pairs.append((key, esc("none" if value is None else value)))
    return _facts(pairs)


def _gradients(call: AttentionCall, result: TraceResult) -> str:
    mine = [g for g in result.gradients if g.module == call.module]
    if not mine:
        return ""
    head = "".join(f'<th scope="col">{h}</th>' for h in ("backward", "part", "|dW| after", "|dW| this pass",
                                                          "|db| after", "share of the pass"))  # fmt: skip
    rows = []
    for g in mine:
        for part in _PARTS:
            s = getattr(g, part)
            rows.append(
                f'<tr><td class="num">{g.backward_index}</td><th scope="row">{part.upper()}</th>'
                f'<td class="num">{fmt(s.grad_norm)}</td><td class="num">{fmt(s.pass_grad_norm)}</td>'
                f'<td class="num">{fmt(s.bias_grad_norm)}</td><td class="num">{_share(s.pass_share)}</td></tr>'
            )
    return (
        "<h4>Q/K/V slice gradients</h4>"
        f'<div class="scroll"><table class="grads"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
        "</table></div>"
    )


def _share(share: float | None) -> str:
    if share is None:
        return "-"
    width = max(1, round(share * 80))
    return f'<span class="bar" style="width:{width}px" aria-hidden="true"></span> {share:.0%}'


def routes_table(routes: Sequence[RouteRecord]) -> str:
    """The gradient that reached each call's Q, K and V, per backward pass, with each route's share."""
    if not routes:
        return ""
    head = "".join(f'<th scope="col">{h}</th>' for h in ("call", "module", "backward", "part", "|grad|", "share",
                                                          "per head"))  # fmt: skip
    rows = []
    for r in routes:
        for part in _PARTS:
            g = getattr(r, part)
            if g is None:
                continue
            heads = " ".join(fmt(h) for h in g.per_head) if g.per_head else "-"
            rows.append(
                f'<tr><td class="num">#{r.call}</td><td class="name">{esc(module_name(r.module))}</td>'
                f'<td class="num">{r.backward_index}</td><th scope="row">{part.upper()}</th>'
                f'<td class="num">{fmt(g.norm)}</td><td>{_share(g.share)}</td><td class="name">{esc(heads)}</td></tr>'
            )
    return (
        f'<div class="scroll"><table class="routes"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
        "</table></div>"
    )


# -- one call --------------------------------------------------------------------------


def call_details(call: AttentionCall, result: TraceResult | None = None, *, tokens: list[list[str]] | None = None,
                 open_: bool = False, budget: DrawBudget | None = None) -> str:  # fmt: skip
    """Everything recorded of one call: PyTorch's reason, the kernel and its evidence, inputs, slices, gradients."""
    result = result or TraceResult(calls=[call])
    budget = budget or DrawBudget(DEFAULT_BOUNDS)
    ops = ", ".join(call.aten_ops) if call.aten_ops else None
    facts = _facts([
        ("module", f'<span class="name">{esc(module_name(call.module))}</span> ({esc(call.module_type)})'),
        ("path", path_tag(call.path)),
        ("SDPA backend", backend_tag(call.sdpa_backend)),
        ("kernels (aten)", esc(ops) if ops else None),
        ("evidence", esc(call.evidence)),
        ("thread", esc(call.thread) if call.thread else None),
        ("rank", f"{call.rank} of {call.world_size}" if call.rank is not None else None),
        ("backward kernel", esc(call.backward_kernel) if call.backward_kernel else None),
        ("no backward", esc(call.backward_reason) if call.backward_reason else None),
        ("no routes", esc(call.route_reason) if call.route_reason else None),
        ("output", esc(", ".join(f"{k} {v}" for k, v in call.output.items()))),
        ("error", esc(call.error) if call.error else None),
    ])  # fmt: skip
    routes = [r for r in result.routes if r.call == call.index]
    body = [
        facts,
        "<h4>Why this path and kernel</h4>",
        _reasons(call) or '<p class="dim">PyTorch gave no reason for this call.</p>',
        ("<h4>Attention map</h4>" + call_maps(call, tokens, budget))
        if call.attention_map is not None or call.attention_map_reason else "",
        "<h4>Q/K/V slices</h4>",
        _slices(call),
        _gradients(call, result),
        ("<h4>Gradient routes into Q, K, V</h4>" + routes_table(routes)) if routes else "",
        f'<details class="inputs"><summary>Inputs: shapes, dtype, masks, modes</summary>{_inputs(call)}</details>',
    ]  # fmt: skip
    summary = (f'#{call.index} <span class="name">{esc(module_name(call.module))}</span> '
               f"{path_tag(call.path)} {backend_tag(call.sdpa_backend)}")  # fmt: skip
    return (f'<details class="call" id="call-{call.index}"{" open" if open_ else ""}><summary>{summary}</summary>'
            f'{"".join(body)}</details>')  # fmt: skip


def compiled_details(op: CompiledAttention) -> str:
    facts = _facts([
        ("module", f'<span class="name">{esc(module_name(op.module))}</span> ({esc(op.module_type)})'),
        ("as written", esc(f"{op.entry}: {op.written}")),
        ("graph", esc(f"{op.compiler} graph {op.graph}")),
        ("shapes", esc(op.shapes)),
        ("dtypes", esc(", ".join(op.dtypes))),
        ("mask", esc(op.mask)),
        ("runs (forward)", esc(", ".join(op.runs) or "-")),
        ("runs (backward)", esc(", ".join(op.backward)) if op.backward else None),
        ("SDPA backend", backend_tag(op.sdpa_backend)),
        ("rewritten", esc(op.rewritten) if op.rewritten else None),
        ("evidence", esc("; ".join(op.evidence))),
        ("how often it ran", esc(op.runtime)),
    ])  # fmt: skip
    summary = (f'#c{op.index} <span class="name">{esc(module_name(op.module))}</span> '
               f"{path_tag(op.entry, 'compiled ' + op.entry)} {backend_tag(op.sdpa_backend)}")  # fmt: skip
    return f'<details class="call" id="compiled-{op.index}"><summary>{summary}</summary>{facts}</details>'


# -- a whole result -----------------------------------------------------------------------


def blind_spots_html(result: TraceResult) -> str:
    items = [f"<li>warning: {esc(w)}</li>" for w in result.warnings]
    items += [f'<li>unobserved: <span class="name">{esc(module_name(u.module))}</span> ({esc(u.module_type)}): '
              f"{esc(u.reason)}</li>" for u in result.unobserved]  # fmt: skip
    return f'<ul class="blind">{"".join(items)}</ul>' if items else ""


def trace_fragment(result: TraceResult, *, tokens: list[list[str]] | None = None,
                   bounds: MapBounds = DEFAULT_BOUNDS, max_calls: int = 2000, controls: str = "") -> str:  # fmt: skip
    """A trace as static HTML: summary, blind spots, the calls table and each call's details (closed).

    ``controls``: HTML put just above the table (the page's filters).
    """
    budget = DrawBudget(bounds)
    calls = result.calls[:max_calls]
    left_out = len(result.calls) - len(calls)
    parts = [
        f'<p class="summary">{esc(summary_line(result))} · torch {esc(result.torch_version)}</p>',
        blind_spots_html(result),
        controls,
        calls_table(result, limit=max_calls),
    ]
    if left_out:
        parts.append(f'<p class="note">{left_out} more call(s) not shown (bound: {max_calls} calls a page); '
                     "the JSON of the trace holds them all.</p>")  # fmt: skip
    if calls and all(c.attention_map is None and c.attention_map_reason is None for c in calls):
        parts.append('<p class="dim">No attention maps were asked for: <code>qkvtrace trace TARGET --show-maps '
                     "--html FILE</code>, or <code>qkvtrace.trace(model, attention_maps=True)</code>, adds each "
                     "call's map to its details (the model keeps its kernel).</p>")  # fmt: skip
    parts.append('<section class="details"><h3>Each call</h3>')
    parts += [call_details(c, result, tokens=tokens, budget=budget) for c in calls]
    parts += [compiled_details(op) for op in result.compiled]
    parts.append("</section>")
    return "".join(parts)


def fragment(body: str) -> str:
    """``body`` with the stylesheet, in one ``<div class="qk">`` (what a notebook cell shows)."""
    return f'<div class="qk"><style>{STYLE}</style>{body}</div>'
