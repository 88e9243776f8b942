"""The versions of the trace JSON (``qkvtrace.trace/N``), and what a reader of today makes of older ones.

Nothing here needs PyTorch: :mod:`qkvtrace.records` and :mod:`qkvtrace.analyses.tracediff`
both read files written by other versions of qkvtrace. What each version
changed is listed in ``docs/json.md`` ("Changes to the trace JSON").
"""

from __future__ import annotations

from typing import Any

__all__ = ["OLD_FULLY_MASKED", "TRACE_SCHEMA", "TRACE_SCHEMAS", "fully_masked_comparable", "read_older_call"]

TRACE_SCHEMA = "qkvtrace.trace/3"
#: the schemas :meth:`~qkvtrace.records.TraceResult.from_dict` reads, oldest first (``/1``: one ``[start, stop)``
#: pair as a slice's rows; ``/1`` and ``/2``: ``fully_masked_rows`` counted per row of the mask, see below)
TRACE_SCHEMAS = ("qkvtrace.trace/1", "qkvtrace.trace/2", TRACE_SCHEMA)

#: ``fully_masked_rows_reason`` of a call read from a ``/1`` or ``/2`` file, whose count is not read
OLD_FULLY_MASKED = (
    "not read: written as {schema}, which counted a mask's rows once per batch item, and per head only where the "
    "mask had heads (attention written by hand counted every head); {current} counts every (batch, head, query) "
    "row -- trace again to count them"
)


def _counts_per_kernel_row(schema: Any) -> bool:
    return schema not in TRACE_SCHEMAS[:2]


def read_older_call(call: dict[str, Any], schema: Any) -> dict[str, Any]:
    """``call`` as a record of today: from a ``/1`` or ``/2`` file, ``fully_masked_rows`` is ``None``, with why."""
    output = call.get("output")
    if _counts_per_kernel_row(schema) or not isinstance(output, dict) or output.get("fully_masked_rows") is None:
        return call
    reason = OLD_FULLY_MASKED.format(schema=schema, current=TRACE_SCHEMA)
    return {**call, "output": {**output, "fully_masked_rows": None, "fully_masked_rows_reason": reason}}


def fully_masked_comparable(a: Any, b: Any) -> bool:
    """Traces of schemas ``a`` and ``b`` count ``fully_masked_rows`` alike (both ``/3`` or later, or both older)."""
    return _counts_per_kernel_row(a) == _counts_per_kernel_row(b)
