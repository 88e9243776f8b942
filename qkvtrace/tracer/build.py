"""Turning what a wrapper saw into records, without reading the device.

Numbers measured here (NaN counts, norms, blocked entries) stay 0-dim
tensors until the trace resolves its records (:mod:`qkvtrace.base.lazy`). One
call is observed once, however many traces record it: :func:`deliver` gives
each of them its own copy with its own index and its own module name.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts import routes
from qkvtrace.facts.slices import Projection, norm_of
from qkvtrace.records import AttentionCall, QKVInfo, SliceInfo
from qkvtrace.tracer import again
from qkvtrace.tracer.hot import nan_count

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = [
    "Target", "count_again", "counts_only", "deliver", "dtype_name",
    "frame_of", "modes", "nan_count", "nested_lengths", "qkv_info", "shape",
    "wants_backward", "wants_maps",
]  # fmt: skip

#: an open trace that records a call, its name for the module, and the call's index in it
Target = tuple["Trace", str, int]


def shape(t: Any) -> list[int] | None:
    if not isinstance(t, torch.Tensor) or t.is_nested:
        return None
    return list(t.shape)


def nested_lengths(t: Any) -> list[int] | None:
    if not isinstance(t, torch.Tensor) or not t.is_nested:
        return None
    return [int(x.shape[0]) for x in t.unbind()]


def qkv_info(trace: Trace, projection: Projection | str, tensors: tuple[Any, Any, Any]) -> QKVInfo:
    """The call's Q/K/V slices (``projection``'s, shared while its parameters are unchanged) with the norm of
    each tensor the attention received (a 0-dim tensor, read when the trace resolves; ``None`` when nested)."""
    parts = {}
    with torch.no_grad():
        base = trace.norms.qkv(projection)
        for part, t in zip(("q", "k", "v"), tensors, strict=True):
            norm = None if t.is_nested else norm_of(t)
            info = getattr(base, part) or SliceInfo(None, None, None, None)
            values = {name: getattr(info, name) for name in _SLICE_FIELDS}  # dataclasses.replace: 10x slower
            values["activation_norm"] = norm
            parts[part] = SliceInfo(**values)
    return QKVInfo(layout=base.layout, holder=base.holder, reason=base.reason, **parts)


_SLICE_FIELDS = tuple(f.name for f in dataclasses.fields(SliceInfo))


_SHARED: dict[tuple[Any, ...], dict[str, Any]] = {}
_MAX_SHARED = 1024
_ATOMIC = frozenset((bool, int, float, str, type(None)))


def shared_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """One dict for the calls whose inputs are equal (a loop of like calls holds one, not one each).

    Only plain values are shared (numbers, strings, lists of them): inputs
    holding a mask's description (numbers measured on the device, resolved
    in place later) stay the call's own.
    """
    key: list[Any] = []
    for name, value in inputs.items():
        kind = type(value)
        if kind is list:
            if not _ATOMIC.issuperset(map(type, value)):
                return inputs
            value = (list, *value)
        elif kind not in _ATOMIC:
            return inputs
        key += (name, value)
    frozen = tuple(key)
    found = _SHARED.get(frozen)
    if found is not None:
        return found
    if len(_SHARED) < _MAX_SHARED:
        _SHARED[frozen] = inputs
    return inputs


def modes(module: nn.Module) -> dict[str, bool]:
    """The switches that decide PyTorch's paths, as they were when the call ran."""
    return {
        "training": bool(module.training),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled(),
    }


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def frame_of(code: types.CodeType, frame: types.FrameType | None, depth: int = 12) -> types.FrameType | None:
    """The nearest frame running ``code``, looking at most ``depth`` frames up."""
    while frame is not None and depth > 0:
        if frame.f_code is code:
            return frame
        frame = frame.f_back
        depth -= 1
    return None


def wants_maps(targets: list[Target]) -> bool:
    """Some trace that records the call asked for attention maps, or measures its module's health now."""
    for t, name, _ in targets:  # (a loop, not any(): asked on every call)
        if t.maps is not None or t.health_due(name):
            return True
    return False


def wants_backward(targets: list[Target]) -> bool:
    """Whether any trace recording this call wants its backward side (kernel and routes)."""
    for t, _, _ in targets:
        if t.record_routes:
            return True
    return False


def counts_only(targets: list[Target]) -> bool:
    """Every trace recording the call is a long run (``keep="changes"``) that wants neither its map nor its
    health now: a call that changes nothing for them needs no record (:func:`count_again`)."""
    for t, name, _ in targets:
        if t.monitor is None or t.maps is not None or t.health_due(name):
            return False
    return True


def count_again(targets: list[Target], key: tuple[Any, ...], backend: str | None, output: Any) -> bool:
    """The steady state of long runs: when ``key`` (:func:`qkvtrace.tracer.monitor.combination_key`) is the combination
    of the module's previous call in every trace of ``targets`` (all :func:`counts_only`), count the call there
    and return ``True``; no record is built. ``output``: a function giving its NaN count and fully-masked rows."""
    if not all(t.monitor.is_last(name, key) for t, name, _ in targets):  # type: ignore[union-attr]
        return False
    measured = output()
    for t, name, _ in targets:
        t.monitor.again(name, key, backend, measured)  # type: ignore[union-attr]
    return True


def deliver(
    call: AttentionCall,
    targets: list[Target],
    owner: nn.Module,
    projection: Projection | str,
    core: routes.Core | None = None,
    maps: Any = None,
    built_from: tuple[Hashable, tuple[Any, ...]] | None = None,
) -> None:
    """Hand one observed call to every trace that records it (``core``: its backward side).

    ``maps``: where the call's attention map comes from (a source of
    :mod:`qkvtrace.facts.maps`, or a string saying why there is none), for the
    traces that asked for maps; each computes its own from it, now, after the call.
    ``built_from``: the key and refs the record was built from, kept with it as its module's previous
    record so that a call like it is recorded from it (:mod:`qkvtrace.tracer.again`).
    """
    call.inputs = shared_inputs(call.inputs)
    call.thread = threading.current_thread().name
    call.rank, call.world_size = compat.distributed_rank()
    if core is None:
        why = "the call raised" if call.error else "not recorded: the trace was opened with routes=False"
        core = routes.Core(None, why)
    core.stamp(call)
    for i, (trace, name, index) in enumerate(targets):
        record = call if i == 0 else again.clone(call)
        record.index, record.module = index, name
        if core.deferred is not None:
            core.deferred.records.append(record)
        trace.attach_map(record, maps)
        trace.attach_health(record, projection, maps)
        if isinstance(projection, Projection) and projection.holder is not owner:
            holder = trace.name_of(projection.holder)
            record.qkv = dataclasses.replace(record.qkv, holder=holder)
        trace.add_call(record, owner, projection, core)
        if built_from is not None:
            trace.remember(owner, again.Last(built_from[0], built_from[1], record))
