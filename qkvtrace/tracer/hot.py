"""What every wrapped call reads, and the whole way of a call its module's slot knows.

Every call of a wrapped function asks which traces are open, which module
on the Python stack made it and which of those traces cover that module.
Most calls of a loop are then their module's previous call again (a
*steady* call, :mod:`.slots`): the same key of its facts, read from its
arguments before it runs. Such a call's whole way lives in three modules:
the wrapper's (:mod:`.install`), this one (the owner, the key, what the
slot relies on, the call's own numbers) and the place its numbers are kept
-- the trace (:meth:`~qkvtrace.tracer.session.Trace.capture`) or, in a
long run, the monitor (:meth:`~qkvtrace.tracer.monitor.Monitor.count_steady`).
It calls no function of any other module and comes back into none it has
left (``tests/test_floors.py`` lists the modules its frames run in).

Any call this module does not take -- a first call, a miss, a call made
inside an open ``MultiheadAttention`` call or on behalf of a
``__torch_function__`` override, a call several traces record -- goes to
the full observer (:mod:`.observers.sdpa`) with what was found so far.

A steady call in training with routes asks its slot for the hook on its
output's node (:meth:`~qkvtrace.tracer.slots.Slot.verdict`): that one step
goes further, to :mod:`qkvtrace.facts.routes`.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts import paths, routes
from qkvtrace.facts.slices import norm_plan

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace
    from qkvtrace.tracer.slots import Slot

__all__ = ["CALL_IMPL", "OPEN", "PLAIN_SCALES", "call_site", "capture", "covering", "holds", "is_active", "nan_count",
           "open_calls", "owner_module", "sdpa_observer", "steady", "steady_key", "thread_state"]  # fmt: skip


class _Open:
    """The open traces, and the ids of the codes whose frames may run with a module they cover as ``self``;
    both replaced, never mutated, by :mod:`.registry` when a trace opens or closes: readers need no lock."""

    __slots__ = ("codes", "traces")

    def __init__(self) -> None:
        self.traces: tuple[Trace, ...] = ()
        self.codes: frozenset[int] = frozenset()


OPEN = _Open()


class _Local(threading.local):
    def __init__(self) -> None:
        #: this thread's open attention calls (made on the thread's first look)
        self.stack: list[Any] = []
        #: where in its module's forward the last call :func:`owner_module` found was made (code, line)
        self.site: tuple[int, int] | None = None


_local = _Local()
CALL_IMPL: types.CodeType = nn.Module._call_impl.__code__
_MODULE_FILE = CALL_IMPL.co_filename


def is_active() -> bool:
    return bool(OPEN.traces)


def thread_state() -> _Local:
    """The per-thread state whose ``stack`` :func:`open_calls` gives (for a caller that reads it on every call)."""
    return _local


def open_calls() -> list[Any]:
    """This thread's attention calls that have started and not yet ended (innermost last)."""
    return _local.stack


def covering(module: nn.Module) -> list[tuple[Trace, str]]:
    """``(trace, name of module in it)`` for every open trace that records this call."""
    traces = OPEN.traces
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


def owner_module(frame: types.FrameType | None) -> tuple[nn.Module, list[tuple[Trace, str]]] | None:
    """The innermost module on the Python stack that an open trace covers, with those traces; where in its
    forward the call is made is kept for :func:`call_site`."""
    codes = OPEN.codes
    called = None
    while frame is not None:
        if id(frame.f_code) in codes:  # (no other frame's locals are read: reading them costs more)
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module):
                targets = covering(obj)
                if targets:
                    # (found at ``Module._call_impl``: the place is in what it called, the forward or its wrapper,
                    # past ``_call_impl``'s own helpers -- whose lines depend on whether the module has hooks)
                    site = called if frame.f_code is CALL_IMPL and called is not None else frame
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


# -- a call's key ---------------------------------------------------------------------------------

_KEYWORDS = frozenset(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
#: the types of ``scale`` whose value a key compares (a tensor's ``==`` is not a truth value)
PLAIN_SCALES = frozenset((type(None), float, int))
_FLASH, _EFFICIENT, _MATH, _CUDNN = paths.SDP_SWITCHES


def steady_key(owner: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The facts of an unmasked SDPA call that decide everything its record says but its own numbers: what the
    full observer's record key holds (the backend, kernels and PyTorch's reasons follow from them), every
    stride and storage offset (the rows' check of :class:`~qkvtrace.tracer.projections.Projections`, and
    alignment) and the module's children; ``None`` for a call a slot does not take (a mask, nested tensors,
    a tensor ``scale``, arguments passed by other names)."""
    n = len(args)
    if n < 3 or n > 6 or (kwargs and not _KEYWORDS.issuperset(kwargs)):
        return None
    q, k, v = args[0], args[1], args[2]
    if (args[3] if n > 3 else kwargs.get("attn_mask")) is not None or q.is_nested or k.is_nested or v.is_nested:
        return None
    scale = kwargs.get("scale")
    if type(scale) not in PLAIN_SCALES:
        return None
    # (Q's dtype and device: SDPA refuses K and V of others, and a refused call is recorded in full)
    # (K's and V's shapes and strides first, the rest in one tuple: ``grown`` compares it at once)
    # (the backend switches: :func:`qkvtrace.facts.paths.sdp_flags`, read here without a call into it)
    return (q.shape, k.shape, v.shape, k.stride(), v.stride(),
            (q.dtype, q.device, q.stride(), q.storage_offset(), k.storage_offset(), v.storage_offset(),
             k.is_contiguous() and v.is_contiguous(), q.requires_grad, k.requires_grad, v.requires_grad,
             args[4] if n > 4 else kwargs.get("dropout_p", 0.0),
             args[5] if n > 5 else kwargs.get("is_causal", False), scale, kwargs.get("enable_gqa", False),
             owner.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
             (_FLASH(), _EFFICIENT(), _MATH(), _CUDNN()), tuple(map(id, owner._modules.values())),
             _local.site))  # fmt: skip


def holds(slot: Slot, trace: Trace, name: str) -> bool:
    """What a slot relies on beyond the call's key still holds: in a long run, its combination is still the
    module's last and no health is due; in a plain trace, the Q/K/V slice record is the one the weights'
    versions give now."""
    if slot.entry is not None:
        health = trace.monitor.health  # type: ignore[union-attr]
        return slot.entry.last is slot.combination and (health is None or not health.due(name))
    stamp = slot.stamp
    if stamp is None:
        projection = slot.projection
        return isinstance(projection, str) or projection is None or trace.norms.qkv(projection) is slot.base
    steps, pieces = stamp  # the same parameters where PyTorch finds them, at the version and storage read then
    for owner, attr, registered, key, held in steps:
        if registered.get(key) is not held or owner.__dict__.get(attr) is not registered:
            return False
    for p, version, where in pieces:
        if p._version != version or p.data_ptr() != where:
            return False
    return True


# -- a steady call ----------------------------------------------------------------------------------

Full = Callable[..., Any]


#: records a steady call that raised: ``raised(owner, trace, name, index, args, kwargs, exc)``
Raised = Callable[[nn.Module, "Trace", str, int, tuple[Any, ...], dict[str, Any], BaseException], None]


def sdpa_observer(full: Full, raised: Raised) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
    """The observer of ``F.scaled_dot_product_attention``: a call its module's slot knows is taken here
    (:func:`steady`, ``raised`` recording it if it raises); any other goes to ``full(once, args, kwargs,
    found, key)`` -- ``found`` the owner and covering traces where they were looked up (else ``None``:
    ``full`` looks), ``key`` the call's key."""

    def observe_sdpa(once: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        n = len(args)
        if (not OPEN.traces or _local.stack or n < 3 or (args[3] if n > 3 else kwargs.get("attn_mask")) is not None
                or torch._C._has_torch_function(args[:3])):  # fmt: skip
            return full(once, args, kwargs)  # (none open, an enclosing call, a mask, an override: all in full)
        found = owner_module(sys._getframe(1))
        if found is None:  # not made by a traced model
            return once(*args, **kwargs)
        owner, targets = found
        key = steady_key(owner, args, kwargs) if len(targets) == 1 else None
        if key is not None:
            trace, name = targets[0]
            slot = trace.slots.get(id(owner))
            if slot is not None and slot.key == key and holds(slot, trace, name):
                return steady(slot, owner, trace, name, once, args, kwargs, raised)
        return full(once, args, kwargs, found, key)

    return observe_sdpa


#: what a call recorded by a trace opened with ``routes=False`` says of its backward core
_NO_ROUTES = routes.Core(None, "not recorded: the trace was opened with routes=False").verdict()
_norm = torch.linalg.vector_norm
_current_thread = threading.current_thread


def steady(slot: Slot, owner: nn.Module, trace: Trace, name: str, once: Any, args: tuple[Any, ...],
           kwargs: dict[str, Any], raised: Raised, own: tuple[Any, Any] | None = None) -> Any:  # fmt: skip
    """Run a call its module's slot knows, and capture only what is its own: in a long run its NaN count (added
    to its module's count); in a plain trace its index, thread, rank, NaN count, activation norms and what its
    backward core says (the record is built from the slot's when the trace's records are read). ``own``: a call
    whose keys' length is not the slot's, with its own fully-masked rows and Q/K/V shapes. ``once`` keeps how
    the call ended: a failure after it returns its result as without a trace (:mod:`.install`)."""
    index = trace.take_index()
    try:
        out = once.result = once.fn(*args, **kwargs)
    except BaseException as exc:
        once.error = exc
        raised(owner, trace, name, index, args, kwargs, exc)
        raise
    if slot.entry is not None:  # a long run: counted, nothing else
        trace.monitor.count_steady(slot.entry, slot.seen, slot.backend, nan_count(out),  # type: ignore[union-attr, arg-type]
                                   slot.rows if own is None else own[0])  # fmt: skip
        return out
    q, k, v = args[0], args[1], args[2]
    core = None
    said: routes.Verdict | None
    if not trace.record_routes:
        said = _NO_ROUTES
    else:
        said = slot.quiet  # (the key decides that a call builds no graph: what its first steady call's core said)
        if said is None:
            said = slot.verdict(trace, index, name, out, (q, k, v), heads=None, key=slot.signature, fused=True)
            if said is None:
                core = routes.sdpa_core(out, q, k, v, key=slot.signature)
                said = core.verdict()
                if routes.no_graph_reason(out) is not None:
                    slot.quiet, core = said, None
    plans = slot.plans
    if plans is None:  # (the key decides each tensor's plan: its shape, strides and dtype)
        plans = slot.plans = (norm_plan(q), norm_plan(k), norm_plan(v))
    norms = []
    for t, (cast, runs) in zip((q, k, v), plans, strict=True):  # (:func:`qkvtrace.facts.slices.norm_of`, inline)
        if t.requires_grad:
            t = t.detach()
        if cast:
            t = t.float()
        norms.append(_norm(t) if runs is None else _norm(_norm(t, dim=runs)))
    capture(slot, trace, name, index, nan_count(out), tuple(norms), core, said, own)
    return out


def capture(slot: Slot, trace: Trace, name: str, index: int, nan: Any, norms: tuple[Any, Any, Any] | None,
            core: routes.Core | None, said: routes.Verdict | None = None,
            own: tuple[Any, Any] | None = None) -> None:  # fmt: skip
    """Record, in a plain trace, a call its slot knows: captured, its record built when the records are read
    (:func:`qkvtrace.tracer.slots.build`), with what its backward core says then (corrected, when the backward
    pass finds the call's graph differs from its signature's, before or after the record is built).
    ``norms``: the Q, K and V a model's own SDPA call received (``None``: the slot's record's are kept).
    ``said``: what its core says where the core is followed only in the backward pass (``core`` is then
    ``None``). ``own``: its own fully-masked rows and Q/K/V shapes where its keys' length is not the slot's."""
    dist = compat.DIST  # (:func:`qkvtrace.base.compat.distributed_rank`, inline)
    if dist is None or not dist.is_initialized():
        rank = world = None
    else:
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
    if said is None:
        said = _NO_ROUTES if core is None else core.verdict()
    rows, shapes = (slot.rows, None) if own is None else own
    trace.capture((slot.last.record, index, _current_thread().name, rank, world, nan,  # type: ignore[union-attr]
                   rows, norms, said, shapes), name, core)  # fmt: skip


def nan_count(t: Any) -> torch.Tensor | int | None:
    """NaNs in ``t`` as a 0-dim tensor (no host read), ``None`` for non-float results."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    # (``isnan`` and ``count_nonzero`` give no gradient: PyTorch records nothing for them, detached or not)
    if t.is_nested:
        parts = [torch.count_nonzero(torch.isnan(x)) for x in t.detach().unbind()]  # (unbind is recorded)
        return torch.stack(parts).sum() if parts else 0
    if _SUM_FROM <= t.numel() < _SUM_BELOW and t.device.type == "cpu" and t.dtype in _SUMMED:
        # the same count from arithmetic PyTorch's CPU kernels vectorise (``isnan`` there is several times slower
        # on large outputs), in two passes: clamped to [1, 1], every value is 1 but NaN, which clamping keeps;
        # ``nansum`` counts the ones, exactly (whole numbers below 2**24 are exact in float32), and the NaNs are
        # the rest; detached: no autograd record
        return t.numel() - torch.nansum(torch.clamp(t.detach(), 1.0, 1.0)).long()
    return torch.count_nonzero(torch.isnan(t))


#: where :func:`nan_count` sums on the CPU: from the size the sum is faster (measured, float32 values: 8,192,
#: 6.3 against 7.1 µs; 131,072: 20 against 90), to the size its float32 sum stays exact
_SUM_FROM, _SUM_BELOW = 8_192, 2**24
_SUMMED = (torch.float32, torch.float64)
