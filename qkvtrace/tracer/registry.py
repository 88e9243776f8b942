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
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["call_site", "covering", "is_active", "open_calls", "owner_module", "register", "report_failure",
           "unregister"]

_lock = threading.Lock()
#: the open traces; replaced, never mutated, so readers need no lock
_traces: tuple[Trace, ...] = ()
#: the ids of the code objects whose frames may run with a module an open trace covers as ``self``
#: (:func:`owner_module`), replaced with :data:`_traces`; and, per class, its methods' codes
_codes: frozenset[int] = frozenset()
#: (the class's ``forward``, the ids of its methods' codes, those codes: held, so that no id is another code's)
_class_codes: weakref.WeakKeyDictionary[type, tuple[Any, frozenset[int], list[types.CodeType]]] = (
    weakref.WeakKeyDictionary()
)


class _Local(threading.local):
    def __init__(self) -> None:
        #: this thread's open attention calls (made on the thread's first look)
        self.stack: list[Any] = []
        #: where in its module's forward the last call :func:`owner_module` found was made (code, line)
        self.site: tuple[int, int] | None = None


_local = _Local()


def register(trace: Trace) -> None:
    global _traces, _codes
    with _lock:
        _traces = (*_traces, trace)
        _codes = _method_codes(_traces)


def unregister(trace: Trace) -> None:
    global _traces, _codes
    with _lock:
        _traces = tuple(t for t in _traces if t is not trace)
        _codes = _method_codes(_traces)


def _method_codes(traces: tuple[Trace, ...]) -> frozenset[int]:
    """Where a covered module can be ``self``: every method (``self`` its first parameter) of its class and the
    classes it inherits from, up to ``nn.Module`` (through decorators that keep ``__wrapped__``), a ``forward``
    set on the module itself, and ``nn.Module._call_impl``, whose frame every module called has. A class's
    codes are kept while its ``forward`` is the same."""
    found: set[int] = {id(_CALL_IMPL)}
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


_CALL_IMPL: types.CodeType = nn.Module._call_impl.__code__
_MODULE_FILE = _CALL_IMPL.co_filename


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
    """The innermost module on the Python stack that an open trace covers, with those traces; where in its
    forward the call is made is kept for :func:`call_site`."""
    codes = _codes
    called = None
    while frame is not None:
        if id(frame.f_code) in codes:  # (no other frame's locals are read: reading them costs more)
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module):
                targets = covering(obj)
                if targets:
                    # (found at ``Module._call_impl``: the place is in what it called, the forward or its wrapper,
                    # past ``_call_impl``'s own helpers -- whose lines depend on whether the module has hooks)
                    site = called if frame.f_code is _CALL_IMPL and called is not None else frame
                    _local.site = (id(site.f_code), site.f_lineno)
                    return obj, targets
        if frame.f_code.co_filename != _MODULE_FILE:
            called = frame
        frame = frame.f_back
    return None


def call_site() -> tuple[int, int] | None:
    """Where in its module's forward this thread's last call found by :func:`owner_module` was made: a module
    that calls its kernel twice in one forward (differential attention: over each half of V) tells its calls
    apart by it, whatever their tensors' layouts."""
    return _local.site


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
