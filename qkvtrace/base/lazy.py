"""Values measured on the device now and read on the host later.

On an accelerator every ``.item()``, ``float(t)`` or ``.tolist()`` waits for
the device to finish (DESIGN.md, principle 7). While a trace is open its
records therefore hold 0-dim tensors, or :class:`Deferred` values for what
needs more than a number (blocked positions of a small mask). :func:`resolve`
turns them into Python values in one pass: one host read per accelerator for
all its numbers (the CPU's are read where they are: there is no transfer to
wait for), then each deferred value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Deferred", "read", "resolve"]


class Deferred:
    """A value computed when the records are resolved (host reads allowed then)."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], Any]) -> None:
        self.finish = finish


# A place holding a pending value: (container, key) with container a dict, a
# list or a dataclass instance (key is then an attribute name).
_Slot = tuple[Any, Any]


#: types that never hold a pending value: skipped without a look inside
_ATOMS = frozenset({str, int, float, bool, type(None), bytes})
#: the field names of each dataclass met (``None``: not a dataclass); ``dataclasses.fields`` is slow per record
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    try:
        return _FIELDS[cls]
    except KeyError:
        names = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
        _FIELDS[cls] = names
        return names


def _collect(root: Any, tensors: list[tuple[_Slot, torch.Tensor]], deferred: list[tuple[_Slot, Deferred]],
             seen: set[int]) -> None:  # fmt: skip
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        items: Iterable[tuple[Any, Any]]
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        else:
            names = _field_names(type(obj))
            if names is None:
                continue
            items = [(name, getattr(obj, name)) for name in names]
        for key, value in items:
            kind = type(value)
            if kind in _ATOMS:
                continue
            if isinstance(value, torch.Tensor):
                tensors.append(((obj, key), value))
            elif isinstance(value, Deferred):
                deferred.append(((obj, key), value))
            elif isinstance(value, (dict, list)) or _field_names(kind) is not None:
                todo.append(value)


def _store(slot: _Slot, value: Any) -> None:
    obj, key = slot
    if isinstance(obj, (dict, list)):
        obj[key] = value
    else:
        setattr(obj, key, value)


def resolve(roots: Iterable[Any]) -> None:
    """Replace every tensor and :class:`Deferred` inside ``roots`` by a Python value, in place.

    Integer and boolean tensors become ``int``, floating ones ``float``; a
    0-dim tensor becomes a number, any other a flat list. The tensors of one
    device are read back together; those on the ``meta`` device hold no data and become ``None``.
    """
    tensors: list[tuple[_Slot, torch.Tensor]] = []
    deferred: list[tuple[_Slot, Deferred]] = []
    seen: set[int] = set()
    for root in roots:
        _collect(root, tensors, deferred, seen)
    read(tensors)
    for slot, d in deferred:
        _store(slot, d.finish())


def read(places: list[tuple[_Slot, torch.Tensor]]) -> None:
    """Store at each place (a dict and key, a list and index, or an object and attribute name) the Python value of
    its tensor: one host read per accelerator, the 0-dim tensors stacked per dtype (as :func:`resolve` reads
    them); a CPU tensor's values read where they are."""
    by_device: dict[torch.device, list[tuple[_Slot, torch.Tensor]]] = {}
    for slot, t in places:
        by_device.setdefault(t.device, []).append((slot, t))
    for device, group in by_device.items():
        if device.type == "meta":  # shapes without data (a model built on the meta device): nothing to read
            for slot, _ in group:
                _store(slot, None)
            continue
        if device.type == "cpu":  # already in the host's memory: each read as it is, no kernel run to gather them
            group = _read_on_host(group)
        # the 0-dim ones (almost all) stacked in one op per dtype, the others flattened: one read in all
        numbers: dict[torch.dtype, list[tuple[_Slot, torch.Tensor]]] = {}
        others = []
        for slot, t in group:
            if t.dim() == 0:
                numbers.setdefault(t.dtype, []).append((slot, t))
            else:
                others.append((slot, t))
        with torch.no_grad():
            parts = [torch.stack([t for _, t in same]).detach().to(torch.float64) for same in numbers.values()]
            parts += [t.detach().reshape(-1).to(torch.float64) for _, t in others]
            flat = torch.cat(parts).tolist() if parts else []
        at = 0
        for same in numbers.values():  # in the order they were stacked
            for slot, t in same:
                _store(slot, float(flat[at]) if t.is_floating_point() or t.is_complex() else int(flat[at]))
                at += 1
        for slot, t in others:
            n = t.numel()
            is_int = not (t.is_floating_point() or t.is_complex())
            _store(slot, [int(x) if is_int else float(x) for x in flat[at : at + n]])
            at += n


def _read_on_host(group: list[tuple[_Slot, torch.Tensor]]) -> list[tuple[_Slot, torch.Tensor]]:
    """Store the values of the CPU tensors of ``group`` (a read of memory the host holds: gathering them first, as
    an accelerator's are, would cost more kernels than it saves), each as :func:`read` gives it: ``int`` for an
    integer or boolean tensor, ``float`` for a floating one, a flat list for one of more dimensions. The complex
    ones are returned, for the gathered read."""
    rest = []
    for slot, t in group:
        if t.dim() == 0:
            value = t.item()  # (a float for a floating tensor, an int or a bool for the others)
            kind = type(value)
            if kind is complex:
                rest.append((slot, t))
            else:
                _store(slot, value if kind is float else int(value))
        elif t.is_complex():
            rest.append((slot, t))
        else:
            cast = float if t.is_floating_point() else int
            _store(slot, [cast(x) for x in t.reshape(-1).tolist()])
    return rest
