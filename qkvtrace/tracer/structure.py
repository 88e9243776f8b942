"""What a traced model's structure tells a trace, read once and kept while that structure holds.

Opening a trace needs the model's modules under the user's names, the
devices its parameters are on, which of its modules run compiled, the
globals its classes' code reads SDPA from, and, at the close, which modules
look like attention. Each of those took a walk over the model, and a trace
opened once per step on the same model walked it a dozen times a step.

They depend only on what the fingerprint holds: the modules in order (each
must still be the very module it was: compared through weak references),
each one's type and its children's names, the identity, storage address and
shape of its parameters, and whether it was compiled in place. One walk at each open
reads the fingerprint; what was derived from an equal fingerprint is reused,
and any change -- a module swapped, added or removed, a parameter replaced
or moved, a module compiled -- makes everything be read again.

Nothing here keeps a module alive: the cache is keyed weakly by the model and
holds names, answers and weak references.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from qkvtrace.base import compat
from qkvtrace.tracer import candidates

__all__ = ["Structure", "Walked", "walk"]

_LOCK = threading.Lock()


@dataclass(eq=False)
class Structure:
    """What one fingerprint of a model gives (names and answers in ``model.modules()`` order)."""

    refs: tuple[weakref.ref[nn.Module], ...]
    key: tuple[Any, ...]
    names: tuple[str, ...]
    devices: tuple[str, ...]
    #: some module was compiled in place (``module.compile()``)
    compiled_in_place: bool
    #: some module runs through ``torch.compile`` (in place, or an ``OptimizedModule``)
    compiled: bool
    #: answers asked later, kept under a name: ``looks_like_attention`` per module, the globals to bind in
    answers: dict[str, Any] = field(default_factory=dict)


_CACHE: weakref.WeakKeyDictionary[nn.Module, Structure] = weakref.WeakKeyDictionary()


class Walked:
    """The modules of one open, and the structure they have: the modules are the open's, the answers shared."""

    __slots__ = ("modules", "structure")

    def __init__(self, modules: list[nn.Module], structure: Structure) -> None:
        self.modules = modules
        self.structure = structure

    def named(self) -> list[tuple[str, nn.Module]]:
        """``(user name, module)`` for every module, as :func:`~qkvtrace.tracer.candidates.user_names` gives."""
        return list(zip(self.structure.names, self.modules, strict=True))

    def answer(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, asked once per structure (it must depend on nothing the fingerprint does not hold)."""
        answers = self.structure.answers
        if name not in answers:
            answers[name] = compute()
        return answers[name]

    def looks_like_attention(self) -> list[bool]:
        """Per module, whether it looks like attention (``candidates.looks_like_attention``)."""
        return self.answer("attention", lambda: [candidates.looks_like_attention(n, m) for n, m in self.named()])  # type: ignore[no-any-return]

    def inside_compiled(self) -> set[int]:
        """Ids of the modules that run inside ``torch.compile`` (none walked when nothing is compiled)."""
        return candidates.inside_compiled(self.modules[0]) if self.structure.compiled else set()


def _fingerprint(modules: list[nn.Module]) -> tuple[tuple[Any, ...], bool]:
    """The fingerprint of ``modules``, and whether one is compiled in place. A parameter is its identity, its
    storage's address (moved to another device, given new data: another address) and its shape."""
    key: list[Any] = []
    add = key.append
    in_place = False
    for m in modules:
        add(type(m))
        add(tuple(m._modules.keys()))  # (a ScriptModule's _modules has keys() but no iteration)
        for p in m._parameters.values():
            if p is not None:
                try:
                    add((id(p), p.data_ptr(), p.shape))
                except RuntimeError:  # no storage of its own (a DTensor): its device says where it is
                    add((id(p), p.shape, p.device))
                except ValueError:  # a lazy module's parameter before its first call: no storage, no shape yet
                    add((id(p), type(p)))
        if m.__dict__.get("_compiled_call_impl") is not None:
            in_place = True
            add(True)
    return tuple(key), in_place


def _devices(modules: list[nn.Module]) -> tuple[str, ...]:
    """The device types of the modules' parameters (``("cpu",)`` for none)."""
    found = {p.device.type for m in modules for p in m._parameters.values() if p is not None}
    return tuple(sorted(found)) or ("cpu",)


def walk(model: nn.Module) -> Walked:
    """``model``'s modules now, with what their structure gives (read again only when it changed)."""
    modules = list(model.modules())
    key, in_place = _fingerprint(modules)
    with _LOCK:
        found = _CACHE.get(model)
    if (
        found is not None
        and found.key == key
        and len(found.refs) == len(modules)
        and all(map(operator.is_, [ref() for ref in found.refs], modules))  # each the very module it was
    ):
        return Walked(modules, found)
    names = [name for name, _ in candidates.user_names(model)]
    optimized = compat.compiled_module_types()
    structure = Structure(
        refs=tuple(weakref.ref(m) for m in modules),
        key=key,
        names=tuple(names),
        devices=_devices(modules),
        compiled_in_place=in_place,
        compiled=in_place or any(candidates.runs_compiled(m, optimized) for m in modules),
    )
    with _LOCK:
        _CACHE[model] = structure
    return Walked(modules, structure)
