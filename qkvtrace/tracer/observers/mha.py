"""``nn.MultiheadAttention`` and ``F.multi_head_attention_forward``.

``MultiheadAttention.forward`` opens a call (the module and its arguments as
passed); the builtin it then calls says the path: the fast path
(``torch._native_multi_head_attention``) or the fallback
(``F.multi_head_attention_forward``, whose SDPA call reports the kernel).
PyTorch's own ``why_not_fast_path`` and the canonical masks are local
variables of ``MultiheadAttention.forward``: the inner wrappers read them
from that very frame, so the reason is the running version's text.

A custom module that calls ``F.multi_head_attention_forward`` itself opens
the call there: path ``fallback``, owned by that module, with the Q/K/V
slices of the ``in_proj_weight`` it passed.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.facts import paths, routes
from qkvtrace.facts.slices import Projection
from qkvtrace.records import EVIDENCE_WITNESSED, AttentionCall
from qkvtrace.tracer import again, registry, slots
from qkvtrace.tracer.build import (
    Target,
    count_again,
    counts_only,
    deliver,
    dtype_name,
    frame_of,
    nan_count,
    wants_backward,
    wants_maps,
)
from qkvtrace.tracer.monitor import combination_key, mask_kind
from qkvtrace.tracer.observers import mha_facts

__all__ = ["OpenMHA", "ahead_of_function", "observe_forward", "observe_function", "observe_native"]

_MHA_FORWARD_CODE = inspect.unwrap(nn.MultiheadAttention.forward).__code__
_EVIDENCE = paths.shared_evidence()

#: an empty mapping no call writes to (the default of a call's frame locals and bound arguments)
_NOTHING: Mapping[str, Any] = types.MappingProxyType({})

_NATIVE_MHA_ARGS = (
    "query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias",
    "proj_weight", "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type",
)  # fmt: skip


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], name: str, default: Any = None) -> Any:
    i = names.index(name)
    if i < len(args):
        return args[i]
    return kwargs.get(name, default)


class OpenMHA:
    """A multi-head attention call that has started and not yet ended (on this thread).

    What a call does not set keeps the class's default: a steady call sets a handful of its fields, and
    making one is two stores (an instance of ``__slots__`` stores every field on every call)."""

    path: str | None = None
    #: ``why_not_fast_path`` and the canonical masks, read from PyTorch's frame
    local: Mapping[str, Any] = _NOTHING
    backend: str | None = None
    evidence = EVIDENCE_WITNESSED
    #: the call's arguments bound to their names, and whether its tensors are batch-first
    bound: Mapping[str, Any] = _NOTHING
    batch_first = False
    query: Any = None
    kpm: Any = None
    attn_mask: Any = None
    #: masks as PyTorch's ``_canonical_mask`` makes them, for direct calls
    canonical = False
    refusals: dict[str, list[str]] | None = None
    refusals_source: str | None = None
    #: asks PyTorch's reasons for the kernel's call once a record is made (``refusals``, ``refusals_source``)
    ask_refusals: Callable[[], tuple[dict[str, list[str]] | None, str | None]] | None = None
    error: str | None = None
    projection: Projection | str | None = None
    #: the backward side of the call, from its SDPA kernel's output when one ran
    core: routes.Core | None = None
    #: the bound arguments an attention map is computed from (only when a trace asked for maps)
    map_args: dict[str, Any] | None = None
    #: fully-masked query rows of a fallback whose SDPA kernel was given no mask (PyTorch dropped it)
    kernel_rows: Any = None
    #: what a fallback's SDPA kernel received (Q and K projected, masks merged), when maps or health are due
    kernel_source: Any = None
    #: the facts of the call's arguments its module's slot is checked against (:func:`~.mha_facts.steady_key`)
    key: tuple[Any, ...] | None = None
    #: the slot whose key the call has (its kernel may be one the slot knows)
    slot: slots.Slot | None = None
    #: what the call's SDPA kernel said, with the key of its arguments, for its module's slot
    kernel: tuple[Any, ...] | None = None
    #: a steady call's SDPA kernel: its output, Q, K, V and signature (its backward core is found from them only
    #: where the call is recorded: :func:`_steady`, :func:`_core`)
    kernel_call: tuple[Any, Any, Any, Any, Any] | None = None

    def __init__(self, module: nn.Module, targets: list[Target]) -> None:
        self.module = module
        self.targets = targets
        #: the kernels that ran (``None``: not known)
        self.ops: list[str] | None = []
        #: what the record's ``inputs`` gets beside what :func:`.mha_facts.inputs_of` reads from ``bound``
        #: (made with the record)
        self.inputs: dict[str, Any] = {}


_LOCAL = registry.thread_state()


def _innermost() -> OpenMHA | None:
    """This thread's innermost open call when it is a multi-head attention call (asked on every call)."""
    stack = _LOCAL.stack
    if stack:
        ctx = stack[-1]
        if isinstance(ctx, OpenMHA):
            return ctx
    return None


def _pop(ctx: Any, stack: list[Any]) -> None:
    while stack:
        if stack.pop() is ctx:
            break


def _targets(found: list[tuple[Any, str]]) -> list[Target]:
    return [(t, name, t.take_index()) for t, name in found]


def _run(ctx: OpenMHA, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
         slot: slots.Slot | None = None) -> Any:  # fmt: skip
    """Run the call with ``ctx`` open; record it whether it returns or raises (captured by ``slot`` when the call
    says what the slot's call said)."""
    stack = _LOCAL.stack
    stack.append(ctx)
    try:
        out = original(*args, **kwargs)
    except BaseException as exc:
        ctx.error = f"{type(exc).__name__}: {exc}"
        _pop(ctx, stack)
        with contextlib.suppress(Exception):  # the user's exception goes on, unchanged, whatever happens here
            _finish(ctx, None)
        raise
    if stack and stack[-1] is ctx:  # (as :func:`_pop` finds it, but for a nested call that failed to close)
        stack.pop()
    else:
        _pop(ctx, stack)
    if slot is None or not _steady(slot, ctx, out):
        _finish(ctx, out)
    return out


# -- MultiheadAttention.forward ---------------------------------------------------

_MHA_PARAMS: tuple[tuple[str, Any], ...] = tuple(
    (p.name, p.default)
    for p in inspect.signature(inspect.unwrap(nn.MultiheadAttention.forward)).parameters.values()
    if p.name != "self"
)
_MHA_DEFAULTS: dict[str, Any] = {n: (None if d is inspect.Parameter.empty else d) for n, d in _MHA_PARAMS}
_MHA_NAMES: tuple[str, ...] = tuple(n for n, _ in _MHA_PARAMS)


def _bind(
    names: tuple[str, ...], defaults: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))  # positional ones only
    if kwargs:
        bound.update(kwargs)
    return bound


def observe_forward(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    found = registry.covering(args[0]) if args else None  # (none while no trace is open)
    if not found:
        return original(*args, **kwargs)
    module = args[0]
    a = _bind(_MHA_NAMES, _MHA_DEFAULTS, args[1:], kwargs)
    key = None
    if len(found) == 1:  # one trace records the call: its module's slot may know it (:mod:`..slots`)
        key = mha_facts.steady_key(module, a)
        if key is not None:
            trace, name = found[0]
            slot = trace.slots.get(id(module))
            if slot is not None and slot.key == key and slot.facts is not None and slot.holds(trace, name):
                # its own numbers only, once the call said what the slot's said (:func:`_steady`); no map is
                # due (a slot is kept only where no trace computes maps, and a long run's only while no health is)
                ctx = OpenMHA(module, [(trace, name, trace.take_index())])
                ctx.query, ctx.bound, ctx.batch_first, ctx.key = a["query"], a, bool(module.batch_first), key
                ctx.slot = slot
                return _run(ctx, original, args, kwargs, slot)
    ctx = OpenMHA(module, _targets(found))
    ctx.query, ctx.kpm, ctx.attn_mask = a["query"], a["key_padding_mask"], a["attn_mask"]
    ctx.bound, ctx.batch_first, ctx.key = a, bool(module.batch_first), key
    if wants_maps(ctx.targets):
        ctx.map_args = a
    return _run(ctx, original, args, kwargs)


def _read_frame(ctx: OpenMHA, caller: types.FrameType | None) -> None:
    """Copy PyTorch's reason and canonical masks out of ``MultiheadAttention.forward``'s frame."""
    frame = frame_of(_MHA_FORWARD_CODE, caller)
    if frame is not None:
        local = frame.f_locals
        ctx.local = {
            "why_not_fast_path": local.get("why_not_fast_path"),
            "key_padding_mask": local.get("key_padding_mask"),
            "attn_mask": local.get("attn_mask"),
        }


# -- the C++ fast path ---------------------------------------------------------------


def observe_native(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ctx = _innermost()
    if ctx is None or not registry.is_active():
        return original(*args, **kwargs)
    query = arg(args, kwargs, _NATIVE_MHA_ARGS, "query")
    key = ("native_mha", query.device.type, query.dtype, query.is_nested,
           arg(args, kwargs, _NATIVE_MHA_ARGS, "mask") is None,
           bool(arg(args, kwargs, _NATIVE_MHA_ARGS, "need_weights", True)),
           arg(args, kwargs, _NATIVE_MHA_ARGS, "mask_type"))  # fmt: skip
    _read_frame(ctx, sys._getframe(2))  # (the wrapper's frame: PyTorch's is the next)
    ctx.path = "fast"
    out, ops, evidence = _EVIDENCE.run(key, original, *args, **kwargs)
    ctx.ops, ctx.evidence = ops, evidence
    ctx.backend = _EVIDENCE.backend_of(query.device.type, ops) if ops is not None else None
    return out


# -- F.multi_head_attention_forward: the fallback, or a custom module's direct call ---

_FN_PARAMS = inspect.signature(inspect.unwrap(F.multi_head_attention_forward)).parameters
_FN_NAMES: tuple[str, ...] = tuple(_FN_PARAMS)
_FN_DEFAULTS: dict[str, Any] = {
    n: (None if p.default is inspect.Parameter.empty else p.default) for n, p in _FN_PARAMS.items()
}


def ahead_of_function(caller: types.FrameType | None = None) -> bool:
    """What the wrapper of ``F.multi_head_attention_forward`` asks first (its ``ahead``): for the fallback of
    this thread's open ``MultiheadAttention`` call, the path and PyTorch's reason noted -- all there is to
    observe of it, so the wrapper then makes the call itself; ``False`` for any other call. ``caller``: the frame
    PyTorch's is above (the wrapper's, which calls this with none)."""
    stack = _LOCAL.stack
    ctx = stack[-1] if stack else None
    if not isinstance(ctx, OpenMHA):
        return False
    if ctx.path is not None:  # the open call's own function, called again: PyTorch handing it to an override
        return True  # (``__torch_function__`` of a tensor subclass among its arguments), which calls it back
    if caller is None:
        caller = sys._getframe(1)
    ctx.path = "fallback"
    _read_frame(ctx, caller)
    return True


def observe_function(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if ahead_of_function(sys._getframe(2)):  # (the wrapper's frame, or its watch's: PyTorch's is above)
        return original(*args, **kwargs)
    if not registry.is_active():
        return original(*args, **kwargs)
    owner = registry.owner_module(sys._getframe(1))
    if owner is None:
        return original(*args, **kwargs)
    module, found = owner
    a = _bind(_FN_NAMES, _FN_DEFAULTS, args, kwargs)
    ctx = OpenMHA(module, _targets(found))
    ctx.path = "fallback"
    ctx.canonical = True
    ctx.query, ctx.kpm, ctx.attn_mask = a["query"], a["key_padding_mask"], a["attn_mask"]
    ctx.projection = mha_facts.passed_projection(module, a)
    ctx.bound = a  # batch_first stays False: this function takes (L, N, E) or (L, E)
    ctx.inputs["num_heads"] = a["num_heads"]
    ctx.inputs["training"] = bool(a["training"])  # the argument, not the module's flag
    if wants_maps(ctx.targets):
        ctx.map_args = a
    return _run(ctx, original, args, kwargs)


# -- the record ------------------------------------------------------------------------


def _finish(ctx: OpenMHA, out: Any) -> None:
    module = ctx.module
    local = ctx.local
    path = ctx.path
    query = ctx.query
    rows: Any = 0
    kpm_c = attn_c = None
    masked = ctx.error is None and (ctx.kpm is not None or ctx.attn_mask is not None)
    if masked:
        if ctx.canonical:
            kpm_c = mha_facts.canonical(ctx.kpm, "key_padding_mask", query)
            attn_c = mha_facts.canonical(ctx.attn_mask, "attn_mask", query)
        else:  # masks as PyTorch's own _canonical_mask left them in forward's frame (additive floats)
            kpm_c, attn_c = local.get("key_padding_mask"), local.get("attn_mask")
        if ctx.kernel_rows is not None:  # PyTorch may drop a mask (is_causal without padding or weights)
            rows = ctx.kernel_rows
        elif isinstance(query, torch.Tensor) and not query.is_nested:
            rows = mha_facts.fully_masked(ctx, query, kpm_c, attn_c)
    layer_reason = mha_facts.layer_reason(module, ctx.targets)
    facts = mha_facts.facts(ctx, layer_reason) if ctx.key is not None and ctx.error is None else None
    if ctx.error is None and _counted_again(ctx, out, rows, layer_reason):
        if facts is not None:  # (the facts hold the evidence: a slot filled by a witnessed call is not a cached one's)
            trace, name, _ = ctx.targets[0]
            slots.keep_counting(trace, name, ctx.key, ctx.backend, 0, owner=module, facts=facts)  # type: ignore[arg-type]
        _release(ctx)
        return
    built_from = None
    if ctx.error is None and not masked and again.plain(ctx.targets) and _plain_tensor(query):
        # a call like its module's previous one is recorded from that record (:mod:`qkvtrace.tracer.again`)
        first = ctx.targets[0][0]
        projection = ctx.projection if ctx.projection is not None else first.projection(module)
        built_from = mha_facts.built_from(ctx, layer_reason, projection, first)
        found = again.previous(ctx.targets, module, *built_from)
        if found is not None:
            result = out[0] if isinstance(out, tuple) else out
            training = ctx.inputs["training"] if "training" in ctx.inputs else bool(module.training)
            core = _core(ctx, result, ctx.inputs.get("num_heads"), (True, True, training))
            output = {"nan_count": nan_count(result), "fully_masked_rows": rows}
            _release(ctx)
            again.repeat(found, ctx.targets, module, projection, core, output)
            if facts is not None:
                slots.keep_recording(ctx.targets[0][0], ctx.targets[0][1], ctx.key, projection,  # type: ignore[arg-type]
                                     built_from[1], 0, owner=module, facts=facts)  # fmt: skip
            return
    inputs = mha_facts.inputs_of(module, ctx.bound, batch_first=ctx.batch_first)  # read now that a record is made
    inputs.update(ctx.inputs)
    ctx.inputs = inputs
    if ctx.ask_refusals is not None:  # asked now that a record is made (a steady-state call needs none)
        ctx.refusals, ctx.refusals_source = ctx.ask_refusals()
        ctx.ask_refusals = None
    if ctx.error is not None:  # the inputs were refused: record them as given, measure nothing
        rows = None
        inputs["key_padding_mask"] = mha_facts.mask_info(ctx.kpm, None)
        inputs["attn_mask"] = mha_facts.mask_info(ctx.attn_mask, None)
    elif not masked:
        inputs["key_padding_mask"] = inputs["attn_mask"] = None
    else:
        inputs["key_padding_mask"] = mha_facts.mask_info(ctx.kpm, kpm_c)
        inputs["attn_mask"] = mha_facts.mask_info(ctx.attn_mask, attn_c)
    first = ctx.targets[0][0]
    projection = ctx.projection if ctx.projection is not None else first.projection(module)
    call = AttentionCall(
        index=-1,
        module="",
        module_type=type(module).__name__,
        path=path or "unknown",
        why_not_fast_path=None if path == "fast" else local.get("why_not_fast_path"),
        why_not_fused_layer=layer_reason,
        sdpa_backend=ctx.backend,
        aten_ops=ctx.ops,
        inputs=inputs,
        qkv=first.norms.qkv(projection),
        output={
            "nan_count": nan_count(out[0] if isinstance(out, tuple) else out),
            "fully_masked_rows": rows,
        },
        sdpa_refusals=ctx.refusals,
        sdpa_refusals_source=ctx.refusals_source,
        error=ctx.error,
        evidence=ctx.evidence,
    )
    core = ctx.core
    if core is None and ctx.error is None:
        result = out[0] if isinstance(out, tuple) else out
        given = (inputs.get("key_padding_mask") is None, inputs.get("attn_mask") is None, inputs.get("training"))
        core = _core(ctx, result, inputs.get("num_heads"), given)
    source = mha_facts.map_source(ctx, kpm_c, attn_c) if ctx.map_args is not None else None
    if call.sdpa_refusals is None and call.sdpa_refusals_source is not None:  # "not asked" depends on the moment
        built_from = None
    _release(ctx)
    deliver(call, ctx.targets, module, projection, core, source, built_from)
    if facts is not None and built_from is not None:
        slots.keep_recording(ctx.targets[0][0], ctx.targets[0][1], ctx.key, projection, built_from[1], 0,  # type: ignore[arg-type]
                             owner=module, facts=facts)  # fmt: skip


# -- a module's steady calls (:mod:`qkvtrace.tracer.slots`) ------------------------------------


def _steady(slot: slots.Slot, ctx: OpenMHA, out: Any) -> bool:
    """Capture a call its module's slot knows, if it said what the slot's call said; ``False`` if it did not."""
    trace, name, index = ctx.targets[0]
    module = ctx.module
    if mha_facts.facts(ctx, mha_facts.layer_reason(module, ctx.targets)) != slot.facts:
        return False
    if ctx.kernel is not None:  # its kernel was found out in full and said what the slot's said: its key is the slot's
        slot.kernel = ctx.kernel
    result = out[0] if isinstance(out, tuple) else out
    if slot.entry is not None:  # a long run: counted, nothing else
        slot.count(trace, nan_count(result))
        return True
    core = ctx.core
    said = None
    if core is None and trace.record_routes and ctx.kernel_call is not None:  # its SDPA kernel's core
        out, q, k, v, sig = ctx.kernel_call
        said = slot.verdict(trace, index, name, out, (q, k, v), heads=None, key=sig, fused=True)
        if said is None:
            core = routes.sdpa_core(out, q, k, v, key=sig)
    elif core is None and trace.record_routes:  # the way to the core of the slot's calls (its key's: made once)
        found = slot.signature
        if found is None:
            found = slot.signature = mha_facts.core_key(ctx, None, (True, True, bool(module.training)))
        said = slot.verdict(trace, index, name, result, (ctx.query,), heads=found[1], key=found[0])
        if said is None:
            core = routes.find_core(result, (ctx.query,), heads=found[1], key=found[0])
    slot.record(trace, name, index, nan_count(result), core, said)
    return True


def _core(ctx: OpenMHA, result: Any, num_heads: Any, given: tuple[Any, ...]) -> routes.Core | None:
    """The call's backward side: its SDPA kernel's, or found from its output (``given``: which masks it was
    given, and its training flag); ``None`` where no trace wants it."""
    if ctx.core is not None or not wants_backward(ctx.targets):
        return ctx.core
    if ctx.kernel_call is not None:  # a steady call's SDPA kernel, recorded in full
        out, q, k, v, sig = ctx.kernel_call
        return routes.sdpa_core(out, q, k, v, key=sig)
    key, heads = mha_facts.core_key(ctx, num_heads, given)
    return routes.find_core(result, (ctx.query,), heads=heads, key=key)


def _plain_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_nested


def _release(ctx: OpenMHA) -> None:
    """Let go of the call's tensors and frame locals once its record is made, or it was counted."""
    ctx.query = ctx.kpm = ctx.attn_mask = ctx.map_args = ctx.kernel_source = ctx.ask_refusals = ctx.core = None
    ctx.kernel_call = None
    ctx.bound = ctx.local = _NOTHING


def _counted_again(ctx: OpenMHA, out: Any, rows: Any, layer_reason: str | None) -> bool:
    """In long runs, a call with its module's previous combination is counted with no record built."""
    if not counts_only(ctx.targets):
        return False
    path = ctx.path or "unknown"
    extra = ctx.inputs  # as the record's inputs would say them (:func:`.mha_facts.inputs_of`, then the call's)
    training = extra["training"] if "training" in extra else bool(ctx.module.training)
    key = combination_key(path=path, sdpa_backend=ctx.backend, dtype=dtype_name(getattr(ctx.query, "dtype", None)),
                          training=training,
                          why_not_fast_path=None if path == "fast" else ctx.local.get("why_not_fast_path"),
                          why_not_fused_layer=layer_reason, attn_mask=mask_kind(ctx.attn_mask),
                          key_padding_mask=mask_kind(ctx.kpm))  # fmt: skip
    result = out[0] if isinstance(out, tuple) else out
    return count_again(ctx.targets, key, ctx.backend, lambda: {"nan_count": nan_count(result),
                                                               "fully_masked_rows": rows})  # fmt: skip
