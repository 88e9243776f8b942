"""qkvtrace: what really happens inside PyTorch attention.

The public face is small: :func:`trace` and the record types it produces.
Names are imported on first use, so ``import qkvtrace`` stays cheap and
does not import PyTorch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
    "__version__",
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
    "QkvtraceError": "qkvtrace.errors",
    "Trace": "qkvtrace.tracer",
    "trace": "qkvtrace.tracer",
}

if TYPE_CHECKING:
    from qkvtrace.errors import QkvtraceError
    from qkvtrace.records import (
        AttentionCall,
        GradientRecord,
        MaskInfo,
        QKVInfo,
        SliceGrad,
        SliceInfo,
        TraceResult,
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
