"""qkvtrace: what really happens inside PyTorch attention.

The public face is small: :func:`trace` and the record types it produces.
"""

from __future__ import annotations

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
from qkvtrace.trace import Trace, trace

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

__version__ = "0.1.0"
