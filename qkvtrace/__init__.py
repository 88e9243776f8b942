"""qkvtrace: what really happens inside PyTorch attention.

The public face is small: :func:`trace` and the record types it produces,
:func:`guard`, :func:`run_checks`, and the report functions
(:func:`collect_report`, :func:`load_report`, :func:`diff_reports`).
Names are imported on first use, so ``import qkvtrace`` stays cheap and
does not import PyTorch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qkvtrace.base.version import __version__

# how records show themselves (HTML, a terminal line) is put in place by the views, a floor above the records: before
# any record is made or read (it costs no PyTorch import)
from qkvtrace.render import views as _views  # noqa: F401  (isort: skip)

__all__ = [
    "AttentionCall",
    "GradientRecord",
    "MaskInfo",
    "QKVInfo",
    "QkvtraceError",
    "SliceGrad",
    "SliceInfo",
    "Trace",
    "TraceResult",
    "Unobserved",
    "__version__",
    "collect_report",
    "diff_reports",
    "guard",
    "load_report",
    "run_checks",
    "trace",
]

_WHERE = {
    "AttentionCall": "qkvtrace.records",
    "GradientRecord": "qkvtrace.records",
    "MaskInfo": "qkvtrace.records",
    "QKVInfo": "qkvtrace.records",
    "SliceGrad": "qkvtrace.records",
    "SliceInfo": "qkvtrace.records",
    "TraceResult": "qkvtrace.records",
    "Unobserved": "qkvtrace.records",
    "QkvtraceError": "qkvtrace.base.errors",
    "Trace": "qkvtrace.tracer",
    "trace": "qkvtrace.tracer",
    "collect_report": "qkvtrace.analyses.report",
    "diff_reports": "qkvtrace.analyses.diff",
    "guard": "qkvtrace.analyses.guard",
    "load_report": "qkvtrace.analyses.reportio",
    "run_checks": "qkvtrace.analyses.check",
}

if TYPE_CHECKING:
    from qkvtrace.analyses.check import run_checks
    from qkvtrace.analyses.diff import diff_reports
    from qkvtrace.analyses.guard import guard
    from qkvtrace.analyses.report import collect_report
    from qkvtrace.analyses.reportio import load_report
    from qkvtrace.base.errors import QkvtraceError
    from qkvtrace.records import (
        AttentionCall,
        GradientRecord,
        MaskInfo,
        QKVInfo,
        SliceGrad,
        SliceInfo,
        TraceResult,
        Unobserved,
    )
    from qkvtrace.tracer import Trace, trace


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'qkvtrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
