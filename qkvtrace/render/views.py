"""How records show themselves, handed to the records' floor by name (:data:`qkvtrace.records.VIEWS`).

The records sit below the views and never import them: a record asked for
its HTML (a notebook's ``_repr_html_``), its page or its terminal line finds
the function here, put in place when this module is imported -- and the
package imports it first (``qkvtrace/__init__.py``). Each view imports what
draws it when first asked: a process that never shows a record (the report
collector run in another environment) needs none of the drawing libraries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkvtrace.records import VIEWS, AttentionCall, RouteRecord, TraceResult

__all__: list[str] = []


def _call(call: AttentionCall) -> str:
    from qkvtrace.render.html_parts import call_details, fragment

    return fragment(call_details(call, open_=True))


def _map_tensors(weights: Any, fully_masked: Any) -> str:
    from qkvtrace.render.html_parts import fragment, tensors_maps

    return fragment(tensors_maps(weights, fully_masked))


def _routes(routes: list[RouteRecord]) -> str:
    from qkvtrace.render.html_parts import fragment, routes_table

    return fragment(routes_table(routes))


def _summary_line(result: TraceResult) -> str:
    from qkvtrace.render.terminal import summary_line

    return summary_line(result)


def _trace_html(result: TraceResult, **options: Any) -> str:
    from qkvtrace.render.html_page import trace_html

    return trace_html(result, **options)


def _save_trace_page(result: TraceResult, path: Any, *, title: str, tokens: Any) -> Path:
    from qkvtrace.render.html_page import save_page, trace_page

    return save_page(trace_page(result, title=title, tokens=tokens), path)


def _save_grads_page(result: Any, path: Any) -> Path:
    from qkvtrace.render.html_page import grads_page, save_page

    return save_page(grads_page(result), path)


def _grads_html(result: Any) -> str:
    from qkvtrace.render.html_page import grads_html

    return grads_html(result)


def _health(records: list[dict[str, Any]]) -> str:
    from qkvtrace.render.health_render import health_fragment

    return health_fragment(records)


VIEWS.update(call=_call, map_tensors=_map_tensors, routes=_routes, summary_line=_summary_line, trace_html=_trace_html,
             save_trace_page=_save_trace_page, save_grads_page=_save_grads_page, grads_html=_grads_html,
             health=_health)  # fmt: skip
