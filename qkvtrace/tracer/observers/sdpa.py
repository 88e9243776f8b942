"""``F.scaled_dot_product_attention``: a model's own call, or the kernel of an MHA fallback.

A call made inside an open ``MultiheadAttention`` call reports its kernel to
it. A call made by a module of a traced model is a call of its own (path
``sdpa``), owned by the innermost traced module on the Python stack.

The backend is PyTorch's own choice on the very arguments
(``torch._fused_sdp_choice``, what SDPA's C++ entry calls to pick its
kernel), evaluated before the call runs; the ``aten::`` kernels come from
:class:`~qkvtrace.facts.paths.KernelEvidence`.

Arguments that override ``__torch_function__`` (``CausalBias`` from
``torch.nn.attention.bias``, a user's own tensor subclass, an active mode)
are dispatched as PyTorch's C++ entry would, with ``func`` the public
``F.scaled_dot_product_attention`` (see :mod:`qkvtrace.tracer.install`).
Such a call is recorded once, with its mask described as what it is (a
causal variant, not a tensor); the SDPA calls the override makes on its
behalf report their kernel to it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Hashable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from qkvtrace.facts import maps, masks, paths, refusals, routes
from qkvtrace.facts.dataflow import signature
from qkvtrace.facts.lineage import lasting
from qkvtrace.facts.slices import Projection, norm_of
from qkvtrace.records import EVIDENCE_CACHED, AttentionCall
from qkvtrace.tracer import again, hot, registry, slots
from qkvtrace.tracer.build import (
    Target,
    count_again,
    counts_only,
    deliver,
    modes,
    nan_count,
    qkv_info,
    shape,
    wants_backward,
    wants_maps,
)
from qkvtrace.tracer.dispatch import overridden, redispatch_sdpa, relevant_overrides
from qkvtrace.tracer.hot import PLAIN_SCALES, steady_key
from qkvtrace.tracer.monitor import combination_key, mask_kind
from qkvtrace.tracer.observers.mha import OpenMHA, arg

__all__ = ["OpenOverride", "fully_masked_rows", "observe_sdpa"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_EVIDENCE = paths.shared_evidence()
_REFUSALS = refusals.shared_cache()


class OpenOverride:
    """An SDPA call dispatched to a ``__torch_function__`` override, not yet ended."""

    __slots__ = ("backend", "owner_trace", "refusals")

    def __init__(self, owner_trace: Any) -> None:
        self.backend: str | None = None
        #: the first trace that records the call (whose options say whether refusals are asked)
        self.owner_trace = owner_trace
        self.refusals: tuple[dict[str, list[str]] | None, str | None] = (None, None)


def _overrides(value: Any) -> bool:
    """A tensor subclass with a ``__torch_function__`` of its own."""
    tf = getattr(type(value), "__torch_function__", None)
    return tf is not None and getattr(tf, "__func__", tf) is not torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]


class _Args:
    __slots__ = ("dropout_p", "gqa", "is_causal", "k", "mask", "projection", "projection_of", "q", "scale", "v")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.q = arg(args, kwargs, _SDPA_ARGS, "query")
        self.k = arg(args, kwargs, _SDPA_ARGS, "key")
        self.v = arg(args, kwargs, _SDPA_ARGS, "value")
        self.mask = arg(args, kwargs, _SDPA_ARGS, "attn_mask")
        self.dropout_p = float(arg(args, kwargs, _SDPA_ARGS, "dropout_p", 0.0))
        self.is_causal = bool(arg(args, kwargs, _SDPA_ARGS, "is_causal", False))
        self.scale = kwargs.get("scale")
        self.gqa = bool(kwargs.get("enable_gqa", False))
        #: where the call's Q/K/V rows live (set by ``_record``)
        self.projection: Projection | str = "not derived: the call was not recorded"
        #: the module ``projection`` was read for, once it was
        self.projection_of: nn.Module | None = None

    def backend(self) -> str | None:
        return paths.sdpa_backend(self.q, self.k, self.v, self.mask, self.dropout_p, self.is_causal, self.scale,
                                  self.gqa)  # fmt: skip

    def refusals(self, owner: Any, backend: str | None) -> tuple[dict[str, list[str]] | None, str | None]:
        """PyTorch's words refusing each backend it ranks above ``backend`` for this call (and their source)."""
        if not owner.record_refusals:
            return None, None
        return _REFUSALS.get(self.q, self.k, self.v, self.mask, self.dropout_p, self.is_causal, self.scale, self.gqa,
                             backend)  # fmt: skip

    def decisive(self) -> dict[str, Any]:
        """The arguments, beyond shapes and masks, that decide the backend."""
        q, k, v = self.q, self.k, self.v
        return {
            "scale": None if self.scale is None else float(self.scale),
            "head_dim": None if q.is_nested else int(q.shape[-1]),
            "requires_grad": [bool(t.requires_grad) for t in (q, k, v)],
            "last_dim_contiguous": None if q.is_nested else [t.stride(-1) == 1 for t in (q, k, v)],
        }

    def map_source(self, targets: list[Target], override: bool = False) -> maps.SDPASource | None:
        """The q/k/mask handed to the kernel, for the traces that asked for attention maps."""
        if not wants_maps(targets):
            return None
        return maps.SDPASource(self.q, self.k, self.mask, self.is_causal, self.scale, self.gqa, self.dropout_p,
                               override)  # fmt: skip

    def grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (self.q, self.k, self.v)
        )


def _observe(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             found: tuple[nn.Module, list[tuple[Any, str]]] | None = None, key: tuple[Any, ...] | None = None) -> Any:
    """A call :mod:`qkvtrace.tracer.hot` did not take: ``found`` and ``key`` where it looked them up."""
    if found is None:
        if not registry.is_active():
            return redispatch_sdpa(original, args, kwargs)
        if overridden(args, kwargs):
            return _observe_override(original, args, kwargs, relevant_overrides(args, kwargs))
        stack = registry.open_calls()
        enclosing = stack[-1] if stack else None
        if isinstance(enclosing, OpenOverride):  # made on behalf of an override that is being recorded
            made = _Args(args, kwargs)
            enclosing.backend = made.backend()
            enclosing.refusals = made.refusals(enclosing.owner_trace, enclosing.backend)
            return original(*args, **kwargs)
        if isinstance(enclosing, OpenMHA):  # the kernel of a MultiheadAttention fallback
            return _kernel_of_mha(enclosing, original, args, kwargs)
        found = registry.owner_module(sys._getframe(1))
        if found is None:  # not made by a traced model
            return original(*args, **kwargs)
        key = steady_key(found[0], args, kwargs) if len(found[1]) == 1 else None
    owner, covering = found
    a: _Args | None = None
    if key is not None:  # one trace records the call: its module's slot may know it (:mod:`..slots`)
        trace, name = covering[0]
        slot = trace.slots.get(id(owner))
        if slot is None:  # its first call in this trace: a slot an earlier trace of the model kept, if it holds
            slot = slots.revive(trace, owner, name, key)
            if slot is not None:
                return hot.steady(slot, owner, trace, name, original, args, kwargs, _raised)
        elif slot.key == key and slot.holds(trace, name):
            return hot.steady(slot, owner, trace, name, original, args, kwargs, _raised)
        elif grown(slot.key, key) and slot.holds(trace, name):
            a = _Args(args, kwargs)
            backend = a.backend()
            if _grown_holds(slot, owner, trace, a, backend):
                slot.key = key
                own = (fully_masked_rows(a.q, a.k, None, a.is_causal), (a.q.shape, a.k.shape, a.v.shape))
                return hot.steady(slot, owner, trace, name, original, args, kwargs, _raised, own)
    if a is None:
        a = _Args(args, kwargs)
        backend = a.backend()
    targets = [(t, name, t.take_index()) for t, name in covering]
    sig = ("sdpa", a.q.device.type, a.q.dtype, backend, None if a.mask is None else a.mask.dtype,
           a.is_causal, a.dropout_p > 0, a.grad(), a.q.is_nested)  # fmt: skip
    try:
        out, ops, evidence = _EVIDENCE.run(sig, original, *args, **kwargs)
    except BaseException as exc:  # record the refused call, then let the error go on unchanged
        _record_raised(owner, targets, a, backend, exc)
        raise
    _learn(a, backend, ops)
    # a long run's call with its module's previous combination is only counted: no reasons asked, no record
    if counts_only(targets) and count_again(targets, _combination(owner, a, backend), backend,
                                            lambda: _measured(a, out)):  # fmt: skip
        if key is not None and evidence == EVIDENCE_CACHED:
            slots.keep_counting(covering[0][0], covering[0][1], key, backend,
                                fully_masked_rows(a.q, a.k, None, a.is_causal), owner=owner)
        return out
    core = routes.sdpa_core(out, a.q, a.k, a.v, key=sig) if wants_backward(targets) else None
    built_from = None
    if again.plain(targets) and a.mask is None and not a.q.is_nested and type(a.scale) in PLAIN_SCALES:
        # a call like its module's previous one is recorded from that record (:mod:`qkvtrace.tracer.again`)
        first = targets[0][0]
        if a.projection_of is not owner:  # (found already where a grown call missed its slot)
            a.projection = first.projection(owner, (a.q, a.k, a.v))
            a.projection_of = owner
        projection = a.projection
        base = None if isinstance(projection, str) else first.norms.qkv(projection)
        built_from = _built_from(owner, a, backend, ops, evidence, projection, base)
        previous = again.previous(targets, owner, *built_from)
        if previous is not None:
            output = {"nan_count": nan_count(out), "fully_masked_rows": fully_masked_rows(a.q, a.k, None, a.is_causal)}
            again.repeat(previous, targets, owner, projection, core, output, (norm_of(a.q), norm_of(a.k), norm_of(a.v)))
            if key is not None and evidence == EVIDENCE_CACHED:
                _keep_recording(owner, covering[0], key, a, sig, built_from[1])
            return out
    refused = a.refusals(targets[0][0], backend)  # asked once a record is made, as for a fallback's kernel
    record = _record(owner, targets, a, backend, ops, evidence, out, refused)
    if refused[0] is None and refused[1] is not None:  # "not asked" depends on the moment: not a record to copy
        built_from = None
    _deliver(record, owner, targets, a, core, a.map_source(targets), built_from)
    if key is not None and built_from is not None and evidence == EVIDENCE_CACHED:
        _keep_recording(owner, covering[0], key, a, sig, built_from[1])
    return out


def _record_raised(owner: nn.Module, targets: list[Target], a: _Args, backend: str | None,
                   exc: BaseException) -> None:  # fmt: skip
    """Record a call that raised (its arguments as given, PyTorch's refusals, the error); measure nothing."""
    refused = a.refusals(targets[0][0], backend)
    call = _record(owner, targets, a, backend, None, "unavailable: the call raised", None, refused)
    call.error = f"{type(exc).__name__}: {exc}"
    _deliver(call, owner, targets, a)


# -- a module's steady calls (:mod:`qkvtrace.tracer.slots`) --------------------------------------

def _keep_recording(owner: nn.Module, covering: tuple[Any, str], key: tuple[Any, ...], a: _Args, sig: Any,
                    refs: tuple[Any, ...]) -> None:  # fmt: skip
    """Keep the module's slot after its record was remembered, unless its rows are an answer of the moment."""
    if lasting(a.projection):
        slots.keep_recording(covering[0], covering[1], key, a.projection, refs,
                             fully_masked_rows(a.q, a.k, None, a.is_causal), owner=owner, signature=sig)  # fmt: skip


def grown(before: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    """Whether a call with :func:`steady_key` ``key`` is the call of the slot keyed ``before`` but for the length of
    its keys: a decoding loop's next step, whose cache grew by one token. Its K and V differ from the slot's only in
    their next-to-last dimension, and are contiguous from their storage's start in both (so their strides follow
    from their shapes); everything else in the key is the slot's. What may depend on the length is asked again
    (:func:`_grown_holds`)."""
    rest = key[5]
    if before[5] != rest or before[0] != key[0] or not rest[6] or rest[4] or rest[5]:  # (contiguous, offset 0)
        return False
    for was, now in ((before[1], key[1]), (before[2], key[2])):  # K, V
        if len(was) != len(now) or len(now) < 2 or was[:-2] != now[:-2] or was[-1] != now[-1]:
            return False
    return True


def _grown_holds(slot: slots.Slot, owner: nn.Module, trace: Any, a: _Args, backend: str | None) -> bool:
    """Whether a grown call (:func:`grown`) says what its slot's call said, asked of PyTorch for this call as the
    full observer asks it: the backend it selects (and in a plain trace PyTorch's refusals and the Q/K/V rows the
    call's layout gives). ``a`` keeps the rows found, for the full observer to use where it does not."""
    if slot.entry is not None:  # a long run counts by combination: the backend decides it beyond the key
        return backend == slot.backend
    record = slot.last.record  # type: ignore[union-attr]
    if backend != record.sdpa_backend:
        return False
    qkv = (a.q, a.k, a.v)
    layout = signature(owner, qkv)  # (what the trace's rows are kept by: the same one gives the same rows)
    a.projection_of = owner
    if layout != slot.layout:
        a.projection = trace.projection(owner, qkv)
        if a.projection is not slot.projection and a.projection != slot.projection:
            return False
        slot.layout = layout
    a.projection = slot.projection  # type: ignore[assignment]
    return a.refusals(trace, backend) == (record.sdpa_refusals, record.sdpa_refusals_source)


def _raised(owner: nn.Module, trace: Any, name: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any],
            exc: BaseException) -> None:  # fmt: skip
    """Record a call its module's slot took that raised, as the full observer records one."""
    a = _Args(args, kwargs)
    _record_raised(owner, [(trace, name, index)], a, a.backend(), exc)


observe_sdpa = hot.sdpa_observer(_observe, _raised)


def _built_from(owner: nn.Module, a: _Args, backend: str | None, ops: list[str] | None, evidence: str,
                projection: Projection | str, base: Any) -> tuple[Hashable, tuple[Any, ...]]:  # fmt: skip
    """Everything an unmasked call's record (:func:`_record`) and PyTorch's refusals for it
    (:func:`qkvtrace.facts.refusals.signature`) are made from, but the per-call numbers: a call with the same key
    and refs is recorded from its module's previous record."""
    q, k, v = a.q, a.k, a.v
    # (one dtype and one device: SDPA refuses Q, K and V of different ones, and such a call is never copied)
    key = (backend, evidence, None if ops is None else tuple(ops), q.shape, k.shape, v.shape, q.dtype, q.device,
           q.stride(-1), k.stride(-1), v.stride(-1), q.requires_grad, k.requires_grad, v.requires_grad, a.is_causal,
           a.dropout_p, a.scale, a.gqa, bool(owner.training), torch.is_grad_enabled(),
           torch.is_inference_mode_enabled(), torch.is_autocast_enabled(), paths.sdp_flags(),
           projection if isinstance(projection, str) else None)  # fmt: skip
    return key, (owner,) if isinstance(projection, str) else (owner, projection, base)


def _combination(owner: nn.Module, a: _Args, backend: str | None) -> tuple[Any, ...]:
    """The key of the combination the record of this call would have (:func:`~qkvtrace.tracer.monitor.combination`)."""
    mask = a.mask
    kind = (type(mask).__name__ if _overrides(mask) else mask_kind(mask)) if isinstance(mask, torch.Tensor) else None
    return combination_key(path="sdpa", sdpa_backend=backend, dtype=str(a.q.dtype), training=bool(owner.training),
                           attn_mask=kind)


def _measured(a: _Args, out: Any) -> dict[str, Any]:
    """A call's NaN count and fully-masked rows, as :func:`_record` measures them."""
    with torch.no_grad():
        rows = fully_masked_rows(a.q, a.k, None if _overrides(a.mask) else a.mask, a.is_causal)
    return {"nan_count": nan_count(out), "fully_masked_rows": rows}


def _learn(a: _Args, backend: str | None, ops: list[str] | None) -> None:
    if backend is not None and ops is not None:
        for op in ops:
            if op != "aten::scaled_dot_product_attention":
                _EVIDENCE.learn(a.q.device.type, op, backend)


def _kernel_of_mha(ctx: OpenMHA, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Report a fallback's kernel to its call: the backend, kernels, evidence and what the kernel received; for a
    call its module's slot knows, what the slot's kernel said when the kernel's arguments have the slot kernel's
    key (:func:`steady_key`: everything that decides them), else found out anew."""
    key = steady_key(ctx.module, args, kwargs) if ctx.key is not None else None  # (a call a slot may take)
    slot = ctx.slot
    if key is not None and slot is not None and slot.kernel is not None and slot.kernel[0] == key:
        return _steady_kernel(ctx, slot.kernel, original, args, kwargs)
    a = _Args(args, kwargs)
    backend = a.backend()
    ctx.backend = backend
    owner = ctx.targets[0][0]
    ctx.ask_refusals = lambda: a.refusals(owner, backend)
    added = {"dropout_p": a.dropout_p, **a.decisive()}  # what the fallback handed its kernel
    ctx.inputs.update(added)
    if a.mask is None:  # PyTorch dropped the masks it was given (is_causal, no padding mask, no weights)
        ctx.kernel_rows = fully_masked_rows(a.q, a.k, None, a.is_causal)
    if ctx.map_args is not None:
        ctx.kernel_source = a.map_source(ctx.targets)
    sig = ("sdpa", a.q.device.type, a.q.dtype, backend, None if a.mask is None else a.mask.dtype,
           a.is_causal, a.dropout_p > 0, a.grad(), a.q.is_nested)  # fmt: skip
    out, ops, evidence = _EVIDENCE.run(sig, original, *args, **kwargs)
    _learn(a, backend, ops)
    ctx.ops = list(ops) if ops is not None else None
    ctx.evidence = evidence
    ctx.core = routes.sdpa_core(out, a.q, a.k, a.v, key=sig) if wants_backward(ctx.targets) else None
    if key is not None and evidence == EVIDENCE_CACHED:  # (a witnessed kernel's evidence is its call's own)
        ctx.kernel = (key, backend, None if ops is None else tuple(ops), evidence, added, sig)
    return out


def _steady_kernel(ctx: OpenMHA, kernel: tuple[Any, ...], original: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """The kernel of a steady call, with the key of its module's slot's kernel: what that kernel said, and its call
    made (PyTorch's reasons asked, and its backward core found, only where the call is recorded: its
    ``kernel_call``)."""
    _, backend, ops, evidence, added, sig = kernel
    ctx.backend, ctx.evidence = backend, evidence  # (no rows: the kernel of an unmasked call is given no mask)
    ctx.ops = None if ops is None else list(ops)
    ctx.inputs.update(added)
    owner = ctx.targets[0][0]
    ctx.ask_refusals = lambda: _Args(args, kwargs).refusals(owner, backend)
    out = original(*args, **kwargs)
    ctx.kernel_call = (out, args[0], args[1], args[2], sig)
    return out


def _observe_override(
    original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], relevant: tuple[Any, ...]
) -> Any:
    found = registry.owner_module(sys._getframe(2))
    if found is None or not any(_overrides(x) for x in relevant):
        # not a traced module's call, or only a mode is active: the SDPA calls it makes are observed as usual
        return redispatch_sdpa(original, args, kwargs)
    owner, covering = found
    targets = [(t, name, t.take_index()) for t, name in covering]
    a = _Args(args, kwargs)
    ctx = OpenOverride(targets[0][0])
    stack = registry.open_calls()
    stack.append(ctx)
    sig = ("sdpa-override", type(a.mask).__name__, str(getattr(a.mask, "variant", None)), a.q.device.type,
           a.q.dtype, a.is_causal, a.dropout_p > 0, a.grad())  # fmt: skip
    try:
        out, ops, evidence = _EVIDENCE.run(sig, redispatch_sdpa, original, args, kwargs)
    except BaseException as exc:
        _pop(stack, ctx)
        call = _record(owner, targets, a, ctx.backend, None, "unavailable: the call raised", None, (None, None))
        call.error = f"{type(exc).__name__}: {exc}"
        _deliver(call, owner, targets, a)
        raise
    _pop(stack, ctx)
    backend = ctx.backend
    if backend is None and ops is not None:
        backend = _EVIDENCE.backend_of(a.q.device.type, ops)
    if ctx.refusals == (None, None) and ctx.owner_trace.record_refusals:  # the override made no SDPA call
        ctx.refusals = (None, _not_asked(a, relevant))
    core = routes.sdpa_core(out, a.q, a.k, a.v, key=sig) if wants_backward(targets) else None
    record = _record(owner, targets, a, backend, ops, evidence, out, ctx.refusals)
    _deliver(record, owner, targets, a, core, a.map_source(targets, override=_overrides(a.mask)))
    return out


def _not_asked(a: _Args, relevant: tuple[Any, ...]) -> str:
    """Why no reasons were asked for a call its ``__torch_function__`` override ran without SDPA's entry."""
    if any(isinstance(t, torch.Tensor) and t.is_nested for t in (a.q, a.k, a.v)):
        return refusals.NOT_ASKED_NESTED
    kind = next((type(x).__name__ for x in relevant if _overrides(x)), "an override")
    return f"not asked: {kind}'s __torch_function__ ran the call without SDPA's own entry"


def _pop(stack: list[Any], ctx: Any) -> None:
    while stack:
        if stack.pop() is ctx:
            break


def _deliver(call: AttentionCall, owner: nn.Module, targets: list[Target], a: _Args, core: routes.Core | None = None,
             source: maps.SDPASource | None = None,
             built_from: tuple[Hashable, tuple[Any, ...]] | None = None) -> None:  # fmt: skip
    """Hand the call to its traces, with the projection :func:`_record` found for it (asked once a call)."""
    deliver(call, targets, owner, a.projection, core, source, built_from)


def _override_mask(mask: Any, device: torch.device) -> dict[str, Any]:
    """A ``__torch_function__`` mask described as what it is (e.g. ``CausalBias`` and its variant)."""
    info: dict[str, Any] = {"kind": type(mask).__name__, "dtype": None, "shape": None, "true_means": None,
                            "blocked": None, "total": None, "blocked_positions": None}  # fmt: skip
    variant = getattr(mask, "variant", None)
    if variant is not None:
        info["variant"] = getattr(variant, "name", str(variant))
    lq, lk = getattr(mask, "seq_len_q", None), getattr(mask, "seq_len_kv", None)
    materialize = getattr(mask, "_materialize", None)
    if isinstance(lq, int) and isinstance(lk, int) and callable(materialize):
        with torch.no_grad():
            attend = materialize(device)  # the override's own boolean mask: True = attend
        if isinstance(attend, torch.Tensor) and attend.dtype == torch.bool:
            described = asdict(masks.mask_info(attend, ~attend, "attend", kind=type(mask).__name__))
            described["dtype"] = None
            info.update(described)
    return info


def fully_masked_rows(q: Any, k: Any, mask: Any, is_causal: bool) -> Any:
    """Query rows whose keys are all blocked by what SDPA received (a 0-dim tensor), ``None`` for nested inputs.

    Counted as the kernel sees them: one per (batch, head, query) row of ``q``,
    whatever the mask's own shape (a ``[T, T]`` mask blocking one row counts ``B * H``).
    The count depends only on the shapes, ``is_causal`` and the mask: a call
    with the same ones as an earlier call (the very mask tensor, unchanged
    since) shares that call's count instead of counting again (:class:`_Counted`).
    """
    if q.is_nested:
        return None
    if mask is None and not is_causal:
        return 0
    key = _COUNTED.key(q, k, mask, is_causal)
    found = _COUNTED.get(key, mask)
    if found is not None:
        return found
    with torch.no_grad():
        blocked = None
        if isinstance(mask, torch.Tensor):
            if mask.dtype == torch.bool:
                blocked = ~mask if masks.sdpa_bool_true_means() == "attend" else mask
            else:
                blocked = masks.blocked_by_additive(mask)
        if is_causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril().logical_not()
            blocked = causal if blocked is None else (blocked | causal)
        if blocked is None:
            return 0
        fully = blocked.all(dim=-1)  # what the mask blocks, per query row of its own shape
        rows = torch.broadcast_shapes(fully.shape, q.shape[:-1])  # every (batch..., head, query) row of the kernel
        count = fully.expand(rows).sum()
    _COUNTED.put(key, mask, count)
    return count


class _Counted:
    """Fully-masked row counts made, by what decides them: the query's rows, the keys' length, ``is_causal``
    and the mask -- the very tensor (held weakly: a freed mask's entry is never read again) at the same
    storage and version (an in-place change moves the version). A mask made under ``inference_mode`` keeps
    no version: its calls are counted each time. Bounded: emptied when full."""

    MAX = 256

    def __init__(self) -> None:
        self._held: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor] | None, torch.Tensor]] = {}

    @staticmethod
    def key(q: torch.Tensor, k: torch.Tensor, mask: Any, is_causal: bool) -> tuple[Any, ...] | None:
        if not isinstance(mask, torch.Tensor):
            return (tuple(q.shape[:-1]), k.shape[-2], q.device, is_causal)
        try:
            version = mask._version
        except RuntimeError:  # an inference tensor
            return None
        return (tuple(q.shape[:-1]), k.shape[-2], q.device, is_causal, id(mask), version, mask.data_ptr())

    def get(self, key: tuple[Any, ...] | None, mask: Any) -> torch.Tensor | None:
        held = self._held.get(key) if key is not None else None
        if held is None:
            return None
        ref, count = held
        if ref is not None and ref() is not mask:  # another tensor at a freed mask's address
            return None
        return count

    def put(self, key: tuple[Any, ...] | None, mask: Any, count: torch.Tensor) -> None:
        if key is None:
            return
        if len(self._held) >= self.MAX:
            self._held.clear()
        self._held[key] = (weakref.ref(mask) if isinstance(mask, torch.Tensor) else None, count)


_COUNTED = _Counted()


def _record(
    owner: nn.Module, targets: list[Target], a: _Args, backend: str | None, ops: list[str] | None,
    evidence: str, out: Any, refused: tuple[dict[str, list[str]] | None, str | None],
) -> AttentionCall:  # fmt: skip
    q, k, v, mask = a.q, a.k, a.v, a.mask
    mask_record: dict[str, Any] | None = None
    first = targets[0][0]
    projection = a.projection
    if a.projection_of is not owner:  # read from the call's graph (outside no_grad), once a call
        projection = a.projection = first.projection(owner, (q, k, v))
    with torch.no_grad():
        if isinstance(mask, torch.Tensor) and _overrides(mask):
            mask_record = _override_mask(mask, q.device)
        elif isinstance(mask, torch.Tensor):
            if mask.dtype == torch.bool:
                true_means = masks.sdpa_bool_true_means()
                blocked = ~mask if true_means == "attend" else mask
            else:
                true_means = None
                blocked = masks.blocked_by_additive(mask)
            mask_record = asdict(masks.mask_info(mask, blocked, true_means))
        rows = fully_masked_rows(q, k, None if _overrides(mask) else mask, a.is_causal)
    qkv = qkv_info(first, projection, (q, k, v))
    return AttentionCall(
        index=-1,
        module="",
        module_type=type(owner).__name__,
        path="sdpa",
        why_not_fast_path=None,
        why_not_fused_layer=None,
        sdpa_backend=backend,
        aten_ops=list(ops) if ops is not None else None,
        inputs={
            "query_shape": shape(q),
            "key_shape": shape(k),
            "value_shape": shape(v),
            "dtype": str(q.dtype),
            "device": q.device.type,
            "attn_mask": mask_record,
            "is_causal": a.is_causal,
            "dropout_p": a.dropout_p,
            "enable_gqa": a.gqa,
            **a.decisive(),
            **modes(owner),
        },
        qkv=qkv,
        output={"nan_count": nan_count(out), "fully_masked_rows": rows},
        sdpa_refusals=refused[0],
        sdpa_refusals_source=refused[1],
        evidence=evidence,
    )
