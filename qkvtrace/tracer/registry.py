"""Which traces are open, and which of them a call belongs to.

Traces nest, overlap and live in several threads (DESIGN.md, principle 6).
A call is delivered to every open trace that covers the calling thread
(the thread that entered it, or every thread for ``threads="all"``) and
whose model contains the module that made the call; each of them records
it with its own index and its own name for the module.

State that belongs to one thread -- the attention calls that have started
and not yet ended on it -- lives in a ``threading.local``.
"""

from __future__ import annotations

import threading
import types
from typing import TYPE_CHECKING, Any

from torch import nn

from qkvtrace import replay

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["covering", "is_active", "open_calls", "owner_module", "register", "report_failure", "unregister"]

_lock = threading.Lock()
#: the open traces; replaced, never mutated, so readers need no lock
_traces: tuple[Trace, ...] = ()


class _Local(threading.local):
    def __init__(self) -> None:
        #: this thread's open attention calls (made on the thread's first look)
        self.stack: list[Any] = []


_local = _Local()


def register(trace: Trace) -> None:
    global _traces
    with _lock:
        _traces = (*_traces, trace)


def unregister(trace: Trace) -> None:
    global _traces
    with _lock:
        _traces = tuple(t for t in _traces if t is not trace)


def open_traces() -> tuple[Trace, ...]:
    """Every open trace, in any thread."""
    return _traces


def is_active() -> bool:
    return bool(_traces)


def covering(module: nn.Module) -> list[tuple[Trace, str]]:
    """``(trace, name of module in it)`` for every open trace that records this call."""
    traces = _traces
    if not traces:
        return []
    out = []
    ident = None
    key = id(module)
    for t in traces:
        if t.thread is not None:
            if ident is None:
                ident = threading.get_ident()
            if t.thread != ident:
                continue
        entry = t.names.get(key)  # (:meth:`Trace.name_of`, on every call)
        if entry is not None and entry[1] is module:
            out.append((t, entry[0]))
    return out


def thread_state() -> _Local:
    """The per-thread state whose ``stack`` :func:`open_calls` gives (for a caller that reads it on every call)."""
    return _local


def open_calls() -> list[Any]:
    """This thread's attention calls that have started and not yet ended (innermost last)."""
    return _local.stack


def owner_module(frame: types.FrameType | None) -> tuple[nn.Module, list[tuple[Trace, str]]] | None:
    """The innermost module on the Python stack that an open trace covers, with those traces.

    ``None`` while this thread runs a module again to read its rows (:mod:`qkvtrace.replay`): nothing of
    that run is a call of the traced model.
    """
    if replay.active():
        return None
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module):
                targets = covering(obj)
                if targets:
                    return obj, targets
        frame = frame.f_back
    return None


def report_failure(entry_point: str, error: BaseException) -> None:
    """Tell every open trace of this thread that a call of ``entry_point`` could not be read, and why."""
    ident = threading.get_ident()
    text = (
        f"a call of {entry_point} could not be recorded ({type(error).__name__}: {error}); "
        "it ran and returned to its caller as it would without a trace"
    )
    for t in _traces:
        if t.thread is None or t.thread == ident:
            t.note(text)
