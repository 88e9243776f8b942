"""Keeping PyTorch's functions themselves for every ``__torch_function__`` override in the process.

While a trace is open, ``F.scaled_dot_product_attention`` (and the other
wrapped builtins) is the tracer's wrapper, but code that bound the function
by name before the trace (``from torch.nn.functional import
scaled_dot_product_attention``) still calls PyTorch's builtin. Overrides see
``func`` in two ways:

* as an object to look up in their own tables, sets or caches, built at
  import time (``torch.nested``'s ``func is torch._C._nn.scaled_dot_product_attention``,
  ``torch.overrides.get_testing_overrides()``, a user's ``functools.cache``):
  these need PyTorch's builtin, whichever name the caller used. So the
  wrapper hands overrides the builtin itself, as PyTorch's C++ entry does;
* compared at call time with the attribute (``CausalBias``:
  ``func is torch.nn.functional.scaled_dot_product_attention``): while the
  attribute is the wrapper, such a comparison fails for the builtin. These
  overrides are found by reading their code (the attribute's name among the
  names it looks up) and get a thin shim that hands them the attribute's
  current value in place of the builtin -- for calls through either name.

The shims are installed with the wrappers and removed with them. Classes
found later (a subclass defined while a trace is open) get theirs when a
call through the wrapper first meets them. ``functools`` caches of PyTorch
keyed by these functions are filled before the wrappers go in, so that none
of them keeps a wrapper after the trace.
"""

from __future__ import annotations

import operator
import threading
import types
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Shims", "fill_torch_caches"]

#: (owner, attribute, original) of every wrapped builtin whose identity overrides may check
Swapped = tuple[Any, str, Any]


def fill_torch_caches() -> None:
    """Fill PyTorch's cached tables of functions while they still see PyTorch's own objects."""
    overrides = torch.overrides
    for name in ("get_ignored_functions", "get_testing_overrides", "get_default_nowrap_functions",
                 "_get_overridable_functions"):  # fmt: skip
        fill = getattr(overrides, name, None)
        if callable(fill):
            try:
                fill()
            except Exception:  # a table PyTorch cannot build is one it will not use either
                continue


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


#: the names each override's code looks up, read once per code object (each trace's open considers every
#: override in the process again; their code does not change)
_NAMES: weakref.WeakKeyDictionary[types.FunctionType, tuple[types.CodeType, frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def _names_of(fn: types.FunctionType) -> frozenset[str]:
    held = _NAMES.get(fn)
    if held is not None and held[0] is fn.__code__:
        return held[1]
    names = frozenset(_code_names(fn.__code__))
    _NAMES[fn] = (fn.__code__, names)
    return names


def _own_torch_function(cls: type) -> types.FunctionType | None:
    """``cls``'s own ``__torch_function__`` as a plain function (classmethod or method), or None."""
    raw = cls.__dict__.get("__torch_function__")
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return fn if isinstance(fn, types.FunctionType) else None


def _subclasses(root: type) -> Iterator[type]:
    seen: set[type] = set()
    todo = [root]
    while todo:
        cls = todo.pop()
        try:
            subs: list[type] = type.__subclasses__(cls)
        except TypeError:
            continue
        for sub in subs:
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _roots() -> list[type]:
    roots: list[type] = [torch.Tensor]
    mode = getattr(torch.overrides, "TorchFunctionMode", None)
    if isinstance(mode, type):
        roots.append(mode)
    return roots


class Shims:
    """Shims on the overrides that compare ``func`` with a wrapped attribute at call time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: class -> the ``__torch_function__`` entry it had in its ``__dict__``, and the swapped attributes its shim
        #: hands over
        self._shimmed: dict[type, tuple[Any, tuple[Swapped, ...]]] = {}
        #: classes already read (shimmed or not), so a call reads each class once
        self._read: set[type] = set()
        self._swapped: tuple[Swapped, ...] = ()
        #: the last install's reading of the process's override classes (:meth:`install`)
        self._scan: _Scan | None = None

    def install(self, swapped: Iterable[Swapped]) -> None:
        """Shim every override in the process that looks up one of the swapped attributes by name.

        The classes are read again only when they, their own ``__torch_function__`` entries or the swapped
        attributes differ from the last install's: a trace opened once per step finds the same ones."""
        with self._lock:
            self._swapped = tuple(swapped)
            self._read.clear()
            classes = [cls for root in _roots() for cls in _subclasses(root)]
            entries = [cls.__dict__.get("__torch_function__") for cls in classes]
            scan = self._scan
            if scan is not None and scan.holds(self._swapped, classes, entries):
                self._read.update(classes)
                for ref, relevant in scan.shimmed:
                    cls = ref()
                    if cls is not None:
                        self._shim_class(cls, relevant)
                return
            for cls in classes:
                self._consider(cls)
            shimmed = [(weakref.ref(cls), relevant) for cls, (_, relevant) in self._shimmed.items()]
            self._scan = _Scan(self._swapped, [weakref.ref(cls) for cls in classes], entries, shimmed)

    def meet(self, values: Iterable[Any]) -> None:
        """Shim the overrides of these arguments (and the active modes) if they were not read yet."""
        if not self._swapped:
            return
        candidates = [type(v) for v in values]
        stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
        if stack is not None:
            candidates += [type(m) for m in stack()]
        fresh = [c for c in candidates if c not in self._read]
        if fresh:
            with self._lock:
                for cls in fresh:
                    for klass in cls.__mro__:
                        self._consider(klass)

    def remove(self) -> None:
        with self._lock:
            for cls, (entry, _) in self._shimmed.items():
                setattr(cls, "__torch_function__", entry)  # noqa: B010 -- the very object it had
            self._shimmed.clear()
            self._read.clear()
            self._swapped = ()

    def _consider(self, cls: type) -> None:
        if cls in self._read:
            return
        self._read.add(cls)
        fn = _own_torch_function(cls)
        if fn is None:
            return
        names = _names_of(fn)
        relevant = tuple(s for s in self._swapped if s[1] in names)
        if relevant:
            self._shim_class(cls, relevant)

    def _shim_class(self, cls: type, relevant: tuple[Swapped, ...]) -> None:
        entry = cls.__dict__["__torch_function__"]
        try:
            setattr(cls, "__torch_function__", _shim(entry, relevant))  # noqa: B010
        except (TypeError, AttributeError):  # a class that refuses new attributes keeps its own
            return
        self._shimmed[cls] = (entry, relevant)


@dataclass(slots=True, eq=False)
class _Scan:
    """What one reading of the override classes found: the swapped attributes it was read for, the classes in
    the order they were found (held weakly) with their own ``__torch_function__`` entries, and the classes
    shimmed with what each shim hands over."""

    swapped: tuple[Swapped, ...]
    classes: list[weakref.ref[type]]
    entries: list[Any]
    shimmed: list[tuple[weakref.ref[type], tuple[Swapped, ...]]]

    def holds(self, swapped: tuple[Swapped, ...], classes: list[type], entries: list[Any]) -> bool:
        """The same swapped attributes, the very classes in the same order, each with the very entry it had
        (compared by identity: a metaclass may define ``==``)."""
        return (
            swapped == self.swapped
            and len(classes) == len(self.classes)
            and all(map(operator.is_, [ref() for ref in self.classes], classes))
            and all(map(operator.is_, self.entries, entries))
        )


def _shim(entry: Any, swapped: tuple[Swapped, ...]) -> Any:
    """``entry`` (classmethod or function) handed the attribute's current value in place of the builtin."""
    is_classmethod = isinstance(entry, classmethod)
    fn = entry.__func__ if is_classmethod else entry
    _qkv_fn = fn
    _qkv_swapped = swapped

    def __torch_function__(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for owner, attr, original in _qkv_swapped:
            if func is original:
                func = getattr(owner, attr)
                break
        return _qkv_fn(self, func, types, args, kwargs)

    __torch_function__.__qualname__ = getattr(fn, "__qualname__", "__torch_function__")
    __torch_function__.__module__ = getattr(fn, "__module__", __name__)
    __torch_function__.__wrapped__ = fn  # type: ignore[attr-defined]
    return classmethod(__torch_function__) if is_classmethod else __torch_function__
