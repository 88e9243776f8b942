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
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace import maps, masks, paths
from qkvtrace.monitor import combination_key, mask_kind
from qkvtrace.records import EVIDENCE_WITNESSED, AttentionCall
from qkvtrace.slices import PartSpec, Projection, ProjectionSpec, Rows, whole
from qkvtrace.tracer import again, registry, routes, slots
from qkvtrace.tracer.build import (
    Target,
    count_again,
    counts_only,
    deliver,
    dtype_name,
    frame_of,
    modes,
    nan_count,
    nested_lengths,
    shape,
    wants_backward,
    wants_maps,
)

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["OpenMHA", "ahead_of_function", "observe_forward", "observe_function", "observe_native"]

_MHA_FORWARD_CODE = inspect.unwrap(nn.MultiheadAttention.forward).__code__
_LAYER_FORWARD_CODE = inspect.unwrap(nn.TransformerEncoderLayer.forward).__code__
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
    #: the facts of the call's arguments its module's slot is checked against (:func:`_steady_key`)
    key: tuple[Any, ...] | None = None
    #: the slot whose key the call has (its kernel may be one the slot knows)
    slot: slots.Slot | None = None
    #: what the call's SDPA kernel said, with the key of its arguments, for its module's slot
    kernel: tuple[Any, ...] | None = None

    def __init__(self, module: nn.Module, targets: list[Target]) -> None:
        self.module = module
        self.targets = targets
        #: the kernels that ran (``None``: not known)
        self.ops: list[str] | None = []
        #: what the record's ``inputs`` gets beside what :func:`_inputs` reads from ``bound`` (made with the record)
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


def _run(ctx: OpenMHA, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the call with ``ctx`` open; record it whether it returns or raises."""
    stack = registry.open_calls()
    stack.append(ctx)
    try:
        out = original(*args, **kwargs)
    except BaseException as exc:
        ctx.error = f"{type(exc).__name__}: {exc}"
        _pop(ctx, stack)
        with contextlib.suppress(Exception):  # the user's exception goes on, unchanged, whatever happens here
            _finish(ctx, None)
        raise
    _pop(ctx, stack)
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
    if not registry.is_active() or not args:
        return original(*args, **kwargs)
    module = args[0]
    found = registry.covering(module)
    if not found:
        return original(*args, **kwargs)
    a = _bind(_MHA_NAMES, _MHA_DEFAULTS, args[1:], kwargs)
    key = None
    if len(found) == 1:  # one trace records the call: its module's slot may know it (:mod:`..slots`)
        key = _steady_key(module, a)
        if key is not None:
            trace, name = found[0]
            slot = trace.slots.get(id(module))
            if slot is not None and slot.key == key and slot.facts is not None and slot.holds(trace, name):
                return _steady_call(slot, trace, name, module, a, original, args, kwargs)
    ctx = OpenMHA(module, _targets(found))
    ctx.query, ctx.kpm, ctx.attn_mask = a["query"], a["key_padding_mask"], a["attn_mask"]
    ctx.bound, ctx.batch_first, ctx.key = a, bool(module.batch_first), key
    if wants_maps(ctx.targets):
        ctx.map_args = a
    return _run(ctx, original, args, kwargs)


def _steady_key(module: nn.Module, a: dict[str, Any]) -> tuple[Any, ...] | None:
    """The facts of an unmasked ``MultiheadAttention`` call that its record's inputs are made of (:func:`_inputs`)
    and the backend switches, read from its arguments and module; its slot is checked against them and against
    what the call itself then says (path, reasons, backend, evidence, kernels, what its kernel received).
    ``None`` for a masked call or nested tensors."""
    q, k, v = a["query"], a["key"], a["value"]
    if a["key_padding_mask"] is not None or a["attn_mask"] is not None:
        return None
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)) or q.is_nested or \
            k.is_nested or v.is_nested:  # fmt: skip
        return None
    return (q.shape, k.shape, v.shape, q.dtype, q.device, q is k, k is v, bool(a["need_weights"]),
            bool(a["average_attn_weights"]), bool(a["is_causal"]), module.training, module.batch_first,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
            paths.sdp_flags())  # the switches: PyTorch's refusals of a switched-off backend say so  # fmt: skip


def _inputs(module: nn.Module, a: Mapping[str, Any], batch_first: bool) -> dict[str, Any]:
    """Shapes, dtype, device, flags and modes of an MHA call, from its bound arguments."""
    query, key, value = a["query"], a["key"], a["value"]
    return {
        "query_shape": shape(query),
        "key_shape": shape(key),
        "value_shape": shape(value),
        "nested_lengths": nested_lengths(query),
        "dtype": dtype_name(getattr(query, "dtype", None)),
        "device": getattr(getattr(query, "device", None), "type", None),
        "batch_first": batch_first,
        "need_weights": bool(a["need_weights"]),
        "average_attn_weights": bool(a["average_attn_weights"]),
        "is_causal": bool(a["is_causal"]),
        "self_attention": query is key and key is value,
        **modes(module),
    }


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


def ahead_of_function() -> bool:
    """What the wrapper of ``F.multi_head_attention_forward`` asks first (its ``ahead``): for the fallback of
    this thread's open ``MultiheadAttention`` call, the path and PyTorch's reason noted -- all there is to
    observe of it, so the wrapper then makes the call itself; ``False`` for any other call."""
    return _fallback_noted(sys._getframe(1))


def _fallback_noted(caller: types.FrameType | None) -> bool:
    ctx = _innermost()
    if ctx is None or ctx.path is not None:  # (a direct call's is the fallback already)
        return False
    ctx.path = "fallback"
    _read_frame(ctx, caller)
    return True


def observe_function(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _fallback_noted(sys._getframe(2)):  # (the wrapper's frame, or its watch's: PyTorch's is above)
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
    ctx.projection = _passed_projection(module, a)
    ctx.bound = a  # batch_first stays False: this function takes (L, N, E) or (L, E)
    ctx.inputs["num_heads"] = a["num_heads"]
    ctx.inputs["training"] = bool(a["training"])  # the argument, not the module's flag
    if wants_maps(ctx.targets):
        ctx.map_args = a
    return _run(ctx, original, args, kwargs)


def _passed_projection(module: nn.Module, a: dict[str, Any]) -> Projection | str:
    """The Q/K/V slices of the weights a direct call passed, named as ``module``'s parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    bias = a["in_proj_bias"]
    bias_name = names.get(id(bias)) if bias is not None else None
    query = a["query"]
    e = int(query.shape[-1]) if isinstance(query, torch.Tensor) and not query.is_nested else None
    if e is None:
        return "the query is a nested tensor; the embedding width is unknown"
    rows: list[Rows] = [((0, e),), ((e, 2 * e),), ((2 * e, 3 * e),)]
    if a["use_separate_proj_weight"]:
        weights = [a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]]
        wnames = [names.get(id(w)) if w is not None else None for w in weights]
        if any(n is None for n in wnames):
            return "the q/k/v_proj_weight passed are not parameters of the calling module"
        parts = [PartSpec(n, whole(w), bias_name, r if bias_name else (), 0, _PASSED)  # type: ignore[arg-type]
                 for n, w, r in zip(wnames, weights, rows, strict=True)]  # fmt: skip
        return Projection(module, ProjectionSpec("separate", *parts))
    weight = a["in_proj_weight"]
    wname = names.get(id(weight)) if weight is not None else None
    if wname is None:
        return "the in_proj_weight passed is not a parameter of the calling module"
    parts = [PartSpec(wname, r, bias_name, r if bias_name else (), 0, _PASSED) for r in rows]
    return Projection(module, ProjectionSpec("packed", *parts))


#: the evidence of the slices of weights passed to ``F.multi_head_attention_forward``
_PASSED = "by definition: F.multi_head_attention_forward (in_proj_weight chunked in q, k, v order)"


# -- the record ------------------------------------------------------------------------


def _fully_masked(ctx: OpenMHA, query: torch.Tensor, kpm_c: Any, attn_c: Any) -> Any:
    """Query rows of an MHA call whose keys are all blocked by PyTorch's canonical masks."""
    module = ctx.module
    batch_first = ctx.batch_first
    if query.dim() == 3:
        b, length = (query.shape[0], query.shape[1]) if batch_first else (query.shape[1], query.shape[0])
    else:
        b, length = 1, query.shape[0]
    heads = int(getattr(module, "num_heads", 0) or ctx.inputs.get("num_heads") or 1)
    with torch.no_grad():
        return masks.count_fully_masked(
            (b, heads, length),
            masks.blocked_by_additive(kpm_c) if isinstance(kpm_c, torch.Tensor) else None,
            masks.blocked_by_additive(attn_c) if isinstance(attn_c, torch.Tensor) else None,
        )


def _mask_info(original: Any, canonical: Any) -> dict[str, Any] | None:
    if not isinstance(original, torch.Tensor):
        return None
    with torch.no_grad():
        if isinstance(canonical, torch.Tensor) and canonical.is_floating_point():
            blocked = masks.blocked_by_additive(canonical)
            true_means = masks.true_means_from_canonical(original, canonical)
        else:
            blocked = masks.blocked_by_additive(original) if original.is_floating_point() else original
            true_means = None
        return asdict(masks.mask_info(original, blocked, true_means))


def _canonical(mask: Any, name: str, query: Any) -> Any:
    """PyTorch's own reading of a mask (``F._canonical_mask``), for calls whose frame holds none."""
    canonical_mask = getattr(F, "_canonical_mask", None)
    if not isinstance(mask, torch.Tensor) or canonical_mask is None or not isinstance(query, torch.Tensor):
        return None
    try:
        return canonical_mask(mask=mask, mask_name=name, other_type=None, other_name="", target_type=query.dtype)
    except (RuntimeError, TypeError, AssertionError):
        return None


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
            kpm_c = _canonical(ctx.kpm, "key_padding_mask", query)
            attn_c = _canonical(ctx.attn_mask, "attn_mask", query)
        else:  # masks as PyTorch's own _canonical_mask left them in forward's frame (additive floats)
            kpm_c, attn_c = local.get("key_padding_mask"), local.get("attn_mask")
        if ctx.kernel_rows is not None:  # PyTorch may drop a mask (is_causal without padding or weights)
            rows = ctx.kernel_rows
        elif isinstance(query, torch.Tensor) and not query.is_nested:
            rows = _fully_masked(ctx, query, kpm_c, attn_c)
    layer_reason = None
    for t, _, _ in ctx.targets:
        if t.has_layers:
            layer_reason = _layer_reason(module)
            break
    facts = _facts(ctx, layer_reason) if ctx.key is not None and ctx.error is None else None
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
        built_from = _built_from(ctx, layer_reason, projection, first)
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
    inputs = _inputs(module, ctx.bound, batch_first=ctx.batch_first)  # read now that a record is made
    inputs.update(ctx.inputs)
    ctx.inputs = inputs
    if ctx.ask_refusals is not None:  # asked now that a record is made (a steady-state call needs none)
        ctx.refusals, ctx.refusals_source = ctx.ask_refusals()
        ctx.ask_refusals = None
    if ctx.error is not None:  # the inputs were refused: record them as given, measure nothing
        rows = None
        inputs["key_padding_mask"] = _mask_info(ctx.kpm, None)
        inputs["attn_mask"] = _mask_info(ctx.attn_mask, None)
    elif not masked:
        inputs["key_padding_mask"] = inputs["attn_mask"] = None
    else:
        inputs["key_padding_mask"] = _mask_info(ctx.kpm, kpm_c)
        inputs["attn_mask"] = _mask_info(ctx.attn_mask, attn_c)
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
    source = _map_source(ctx, kpm_c, attn_c) if ctx.map_args is not None else None
    if call.sdpa_refusals is None and call.sdpa_refusals_source is not None:  # "not asked" depends on the moment
        built_from = None
    _release(ctx)
    deliver(call, ctx.targets, module, projection, core, source, built_from)
    if facts is not None and built_from is not None:
        slots.keep_recording(ctx.targets[0][0], ctx.targets[0][1], ctx.key, projection, built_from[1], 0,  # type: ignore[arg-type]
                             owner=module, facts=facts)  # fmt: skip


# -- a module's steady calls (:mod:`qkvtrace.tracer.slots`) ------------------------------------


def _steady_call(slot: slots.Slot, trace: Trace, name: str, module: nn.Module, a: dict[str, Any],
                 original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """Run a call whose key its module's slot holds, and capture only what is its own once the call said what the
    slot's call said (path, reasons, backend, evidence, kernels, what its kernel received); else record it in
    full. (No map is due: a slot is kept only where no trace computes maps, and a long run's holds only while
    no health is due.)"""
    ctx = OpenMHA(module, [(trace, name, trace.take_index())])
    ctx.query, ctx.bound, ctx.batch_first, ctx.key = a["query"], a, bool(module.batch_first), slot.key
    ctx.slot = slot
    stack = registry.open_calls()
    stack.append(ctx)
    try:
        out = original(*args, **kwargs)
    except BaseException as exc:
        ctx.error = f"{type(exc).__name__}: {exc}"
        _pop(ctx, stack)
        with contextlib.suppress(Exception):  # the user's exception goes on, unchanged, whatever happens here
            _finish(ctx, None)
        raise
    _pop(ctx, stack)
    if _facts(ctx, _layer_reason(module) if trace.has_layers else None) != slot.facts:
        _finish(ctx, out)
        return out
    if ctx.kernel is not None:  # its kernel was found out in full and said what the slot's said: its key is the slot's
        slot.kernel = ctx.kernel
    result = out[0] if isinstance(out, tuple) else out
    if slot.entry is not None:  # a long run: counted, nothing else
        slot.count(trace, nan_count(result))
        return out
    core = ctx.core
    if core is None and trace.record_routes:  # the way to the core of the slot's calls (its key's: made once)
        found = slot.signature
        if found is None:
            found = slot.signature = _core_key(ctx, None, (True, True, bool(module.training)))
        core = routes.find_core(result, (ctx.query,), heads=found[1], key=found[0])
    slot.record(trace, module, name, ctx.targets[0][2], nan_count(result), None, core)
    return out


def _facts(ctx: OpenMHA, layer_reason: str | None) -> tuple[Any, ...]:
    """What a call said beyond its key (:func:`_steady_key`): a slot's call is one that says the same."""
    ops = None if ctx.ops is None else tuple(ctx.ops)
    return (ctx.path, ctx.local.get("why_not_fast_path"), layer_reason, ctx.backend, ctx.evidence, ops,
            tuple(ctx.inputs.items()))  # fmt: skip


def _core(ctx: OpenMHA, result: Any, num_heads: Any, given: tuple[Any, ...]) -> routes.Core | None:
    """The call's backward side: its SDPA kernel's, or found from its output (``given``: which masks it was
    given, and its training flag); ``None`` where no trace wants it."""
    if ctx.core is not None or not wants_backward(ctx.targets):
        return ctx.core
    key, heads = _core_key(ctx, num_heads, given)
    return routes.find_core(result, (ctx.query,), heads=heads, key=key)


def _core_key(ctx: OpenMHA, num_heads: Any, given: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None]:
    """The signature the call's backward core is found by, and its number of heads."""
    heads = getattr(ctx.module, "num_heads", None) or num_heads
    a = ctx.bound
    key = ("mha", ctx.path or "unknown", bool(a["need_weights"]), a["query"] is a["key"] and a["key"] is a["value"],
           given)  # fmt: skip
    return key, int(heads) if heads else None


def _plain_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_nested


def _built_from(ctx: OpenMHA, layer_reason: str | None, projection: Projection | str,
                first: Any) -> tuple[Hashable, tuple[Any, ...]]:  # fmt: skip
    """Everything an unmasked call's record is made from (:func:`_inputs` and what its kernel added, the path,
    reasons, backend and kernels, the slices) and what PyTorch's refusals for its kernel are asked from, but
    the per-call numbers: a call with the same key and refs is recorded from its module's previous record.
    The kernel's tensors follow from the query's shape, dtype and device, the module and the modes; the
    facts that decide its backend beyond those (dropout, scale, head size, grad, strides) are in
    ``ctx.inputs``."""
    a, module, path = ctx.bound, ctx.module, ctx.path or "unknown"
    q, k, v = a["query"], a["key"], a["value"]
    added = tuple((n, tuple(x) if type(x) is list else x) for n, x in ctx.inputs.items())
    key = (path, None if path == "fast" else ctx.local.get("why_not_fast_path"), layer_reason, ctx.backend,
           None if ctx.ops is None else tuple(ctx.ops), ctx.evidence, q.shape, shape(k), shape(v), q.dtype, q.device,
           ctx.batch_first, bool(a["need_weights"]), bool(a["average_attn_weights"]), bool(a["is_causal"]),
           q is k and k is v, bool(module.training), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
           torch.is_autocast_enabled(), paths.sdp_flags(), added,
           projection if isinstance(projection, str) else None)  # fmt: skip
    if isinstance(projection, str):
        return key, (module,)
    return key, (module, projection, first.norms.qkv(projection))


def _release(ctx: OpenMHA) -> None:
    """Let go of the call's tensors and frame locals once its record is made, or it was counted."""
    ctx.query = ctx.kpm = ctx.attn_mask = ctx.map_args = ctx.kernel_source = ctx.ask_refusals = ctx.core = None
    ctx.bound = ctx.local = _NOTHING


def _counted_again(ctx: OpenMHA, out: Any, rows: Any, layer_reason: str | None) -> bool:
    """In long runs, a call with its module's previous combination is counted with no record built."""
    if not counts_only(ctx.targets):
        return False
    path = ctx.path or "unknown"
    extra = ctx.inputs  # as the record's inputs would say them (:func:`_inputs`, then what the call added)
    training = extra["training"] if "training" in extra else bool(ctx.module.training)
    key = combination_key(path=path, sdpa_backend=ctx.backend, dtype=dtype_name(getattr(ctx.query, "dtype", None)),
                          training=training,
                          why_not_fast_path=None if path == "fast" else ctx.local.get("why_not_fast_path"),
                          why_not_fused_layer=layer_reason, attn_mask=mask_kind(ctx.attn_mask),
                          key_padding_mask=mask_kind(ctx.kpm))  # fmt: skip
    result = out[0] if isinstance(out, tuple) else out
    return count_again(ctx.targets, key, ctx.backend, lambda: {"nan_count": nan_count(result),
                                                               "fully_masked_rows": rows})  # fmt: skip


def _map_source(ctx: OpenMHA, kpm_c: Any, attn_c: Any) -> Any:
    """Where this call's attention map comes from (masks as PyTorch canonicalised them), or why none."""
    a = ctx.map_args
    if a is None or ctx.error is not None:
        return None
    if ctx.path not in ("fast", "fallback"):
        return "not computed: no MultiheadAttention path was observed for this call"
    if ctx.path == "fallback" and ctx.kernel_source is not None:
        return ctx.kernel_source  # the Q and K the fallback projected: not projected a second time
    if ctx.kpm is not None and kpm_c is None:
        kpm_c = _canonical(ctx.kpm, "key_padding_mask", ctx.query)
    if ctx.attn_mask is not None and attn_c is None:
        attn_c = _canonical(ctx.attn_mask, "attn_mask", ctx.query)
    if (ctx.kpm is not None and kpm_c is None) or (ctx.attn_mask is not None and attn_c is None):
        return "not computed: PyTorch's canonical form of the masks could not be read"
    # the fallback hands SDPA is_causal=True instead of the mask when there is no padding mask and no weights
    causal = ctx.path == "fallback" and bool(a["is_causal"]) and kpm_c is None and not a["need_weights"]
    if ctx.canonical:
        return maps.function_source(a, kpm_c, attn_c, causal)
    module = ctx.module
    return maps.mha_source(module, a["query"], a["key"], kpm_c, attn_c, batch_first=bool(module.batch_first),
                           causal=causal)  # fmt: skip


def _layer_reason(mha: nn.Module) -> str | None:
    """The enclosing encoder layer's ``why_not_sparsity_fast_path``, verbatim, read from its frame."""
    frame = frame_of(_LAYER_FORWARD_CODE, sys._getframe(2))
    if frame is None:
        return None
    local = frame.f_locals
    if getattr(local.get("self"), "self_attn", None) is not mha:
        return None
    reason = local.get("why_not_sparsity_fast_path")
    return reason if isinstance(reason, str) else None
