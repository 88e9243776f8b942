"""Which traces are open, and which of them a call belongs to.

Traces nest, overlap and live in several threads (DESIGN.md, principle 6).
A call is delivered to every open trace that covers the calling thread
(the thread that entered it, or every thread for ``threads="all"``) and
whose model contains the module that made the call; each of them records
it with its own index and its own name for the module.

What every call reads of this -- the open traces, the owner on the
Python stack, this thread's open calls (a ``threading.local``) -- lives in
:mod:`.hot`, with a steady call's whole way; this module opens and closes.
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from qkvtrace.tracer.hot import (
    CALL_IMPL,
    OPEN,
    call_site,
    covering,
    is_active,
    open_calls,
    owner_module,
    thread_state,
)

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["call_site", "covering", "is_active", "open_calls", "open_traces", "owner_module", "register",
           "report_failure", "thread_state", "unregister"]

_lock = threading.Lock()
#: (the class's ``forward``, the ids of its methods' codes, those codes: held, so that no id is another code's)
_class_codes: weakref.WeakKeyDictionary[type, tuple[Any, frozenset[int], list[types.CodeType]]] = (
    weakref.WeakKeyDictionary()
)


def register(trace: Trace) -> None:
    with _lock:
        traces = (*OPEN.traces, trace)
        OPEN.codes = _method_codes(traces)  # (the codes first: a reader that sees the trace finds its codes)
        OPEN.traces = traces


def unregister(trace: Trace) -> None:
    with _lock:
        traces = tuple(t for t in OPEN.traces if t is not trace)
        OPEN.traces = traces
        OPEN.codes = _method_codes(traces)


def _method_codes(traces: tuple[Trace, ...]) -> frozenset[int]:
    """Where a covered module can be ``self``: every method (``self`` its first parameter) of its class and the
    classes it inherits from, up to ``nn.Module`` (through decorators that keep ``__wrapped__``), a ``forward``
    set on the module itself, and ``nn.Module._call_impl``, whose frame every module called has. A class's
    codes are kept while its ``forward`` is the same."""
    found: set[int] = {id(CALL_IMPL)}
    classes: set[type] = set()
    for t in traces:
        for _, m in t.names.values():
            classes.add(type(m))
            own = m.__dict__.get("forward")
            if own is not None:
                found.update(_ids(_codes_of(own)))
    for cls in classes:
        kept = _class_codes.get(cls)
        forward = cls.__dict__.get("forward")
        if kept is None or kept[0] is not forward:
            codes: list[types.CodeType] = []
            for klass in cls.__mro__:
                if klass is nn.Module or klass is object:
                    continue
                for value in vars(klass).values():
                    codes += _codes_of(value)
            kept = _class_codes[cls] = (forward, _ids(codes), codes)
        found |= kept[1]
    return frozenset(found)


def _ids(codes: list[types.CodeType]) -> frozenset[int]:
    """The ids of the codes among ``codes`` whose first parameter is ``self`` (the caller keeps the codes)."""
    return frozenset(id(c) for c in codes if c.co_argcount and c.co_varnames[0] == "self")


def _codes_of(value: Any) -> list[types.CodeType]:
    """The code of a function, method, static or class method or property, and of each function it wraps."""
    if isinstance(value, property):
        return [c for f in (value.fget, value.fset, value.fdel) if f is not None for c in _codes_of(f)]
    found = []
    seen = 0
    while value is not None and seen < 16:  # (a chain of ``__wrapped__``; bounded against a loop)
        value = getattr(value, "__func__", value)
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):
            found.append(code)
        value = getattr(value, "__wrapped__", None)
        seen += 1
    return found


def open_traces() -> tuple[Trace, ...]:
    """Every open trace, in any thread."""
    return OPEN.traces


def report_failure(entry_point: str, error: BaseException) -> None:
    """Tell every open trace of this thread that a call of ``entry_point`` could not be read, and why."""
    ident = threading.get_ident()
    text = (
        f"a call of {entry_point} could not be recorded ({type(error).__name__}: {error}); "
        "it ran and returned to its caller as it would without a trace"
    )
    for t in OPEN.traces:
        if t.thread is None or t.thread == ident:
            t.note(text)
