"""The tracer: ``with qkvtrace.trace(model) as t: ...``.

How it observes without disturbing what runs (DESIGN.md, principle 1):

* No module hooks. PyTorch's encoder layer refuses its fused path when any
  forward (pre-)hook sits on it or a child, so hooks are out.
* No ``TorchFunctionMode`` and no tensor subclass: both make
  ``MultiheadAttention`` refuse its fast path.
* Thin wrappers replace a few attributes for the duration of the block:
  ``MultiheadAttention.forward`` (to know the module and the arguments as
  passed), ``torch._native_multi_head_attention``,
  ``torch._transformer_encoder_layer_fwd``, ``F.multi_head_attention_forward``
  and ``F.scaled_dot_product_attention`` (also where a model's module bound
  it to a name of its own). Each wrapper calls the original with the very
  same arguments and returns its result untouched.
* PyTorch's own reason strings (``why_not_fast_path``,
  ``why_not_sparsity_fast_path``) are local variables of those forwards.
  ``MultiheadAttention.forward`` itself calls the fast-path builtin or
  ``F.multi_head_attention_forward``, and the encoder layer's forward
  (up the stack) is running when its ``self_attn`` runs, so the wrappers
  read the variable from that very frame: the running version's own text,
  never a re-implementation, and no trace function is installed.
* Kernels: see :mod:`qkvtrace.paths`. Gradients: a hook on each Q/K/V
  parameter notes this pass's gradient, and a callback queued on the
  autograd engine reads the real ``.grad`` once the backward pass is over.

Everything is undone in ``__exit__`` through one ``ExitStack``, on every
exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace import masks, paths
from qkvtrace.records import AttentionCall, GradientRecord, QKVInfo, SliceInfo, TraceResult
from qkvtrace.slices import NormCache, ProjectionSpec, find_projection, grad_slices, slice_norms_of

__all__ = ["Trace", "trace"]

_MHA_FORWARD_CODE = nn.MultiheadAttention.forward.__code__
_LAYER_FORWARD_CODE = nn.TransformerEncoderLayer.forward.__code__

# Argument names of the wrapped builtins, for reading positional arguments.
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_NATIVE_MHA_ARGS = (
    "query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias",
    "proj_weight", "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type",
)  # fmt: skip
_LAYER_FWD_ARGS = (
    "src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
    "use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2",
    "norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask",
    "mask_type",
)  # fmt: skip


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], name: str, default: Any = None) -> Any:
    i = names.index(name)
    if i < len(args):
        return args[i]
    return kwargs.get(name, default)


def _shape(t: Any) -> list[int] | None:
    if not isinstance(t, torch.Tensor):
        return None
    if t.is_nested:
        return None
    return list(t.shape)


def _nested_lengths(t: torch.Tensor) -> list[int] | None:
    if not t.is_nested:
        return None
    return [int(x.shape[0]) for x in t.unbind()]


def _nan_count(t: Any) -> int | None:
    """NaNs in ``t``; a sum first, so the common all-finite case costs one reduction."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    t = t.detach()
    if t.is_nested:
        return sum(int(torch.isnan(x).sum()) for x in t.unbind())
    if math.isfinite(t.sum().item()):  # a NaN anywhere makes the sum NaN
        return 0
    return int(torch.isnan(t).sum())


def _modes(module: nn.Module) -> dict[str, bool]:
    """The switches that decide PyTorch's paths, as they were when the call ran."""
    return {
        "training": bool(module.training),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled(),
    }


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _frame_of(code: types.CodeType, frame: types.FrameType | None, depth: int = 12) -> types.FrameType | None:
    """The nearest frame running ``code``, looking at most ``depth`` frames up."""
    while frame is not None and depth > 0:
        if frame.f_code is code:
            return frame
        frame = frame.f_back
        depth -= 1
    return None


class _Open:
    """A ``MultiheadAttention`` call that has started and not yet ended."""

    __slots__ = ("attn_mask", "backend", "error", "index", "inputs", "kpm", "local", "module", "name", "ops",
                 "path", "query", "refusals")  # fmt: skip

    def __init__(self, index: int, module: nn.MultiheadAttention, name: str) -> None:
        self.index = index
        self.module = module
        self.name = name
        self.path: str | None = None
        #: ``why_not_fast_path`` and the canonical masks, read from PyTorch's frame
        self.local: dict[str, Any] = {}
        self.backend: str | None = None
        self.ops: list[str] = []
        self.inputs: dict[str, Any] = {}
        self.query: Any = None
        self.kpm: Any = None
        self.attn_mask: Any = None
        self.refusals: dict[str, list[str]] | None = None
        self.error: str | None = None


class Trace:
    """Records every attention call of ``model`` while the ``with`` block runs.

    Use :func:`trace` to make one. After (or during) the block:

    * ``calls``: :class:`~qkvtrace.records.AttentionCall` records, in execution order;
    * ``gradients``: :class:`~qkvtrace.records.GradientRecord` per traced module
      and backward pass;
    * ``to_dict()`` / ``save(path)``: the ``qkvtrace.trace/1`` JSON.
    """

    def __init__(self, model: nn.Module, *, gradients: bool = True, refusals: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"qkvtrace.trace() needs an nn.Module, got {type(model).__name__}")
        self._model: nn.Module | None = model
        self.record_gradients = gradients
        self.record_refusals = refusals
        self.result = TraceResult(torch_version=str(torch.__version__))
        self._names: dict[int, tuple[str, nn.Module]] = {}
        self._stack: list[_Open] = []
        self._next_index = 0
        self._norms = NormCache()
        self._evidence = paths.shared_evidence()
        self._specs: dict[int, ProjectionSpec | None] = {}
        self._exit: contextlib.ExitStack | None = None
        self._thread: int | None = None
        # gradient bookkeeping
        self._grad_modules: set[int] = set()
        self._pending: dict[int, dict[tuple[str, tuple[int, int] | None], float]] = {}
        self._callback_queued = False
        self._backward_index = 0
        self._originals: dict[str, Any] = {}
        self._has_layers = False

    # -- public face -------------------------------------------------------

    @property
    def calls(self) -> list[AttentionCall]:
        return self.result.calls

    @property
    def gradients(self) -> list[GradientRecord]:
        return self.result.gradients

    def to_dict(self) -> dict[str, Any]:
        return self.result.to_dict()

    def save(self, path: str | Path) -> Path:
        return self.result.save(path)

    def __enter__(self) -> Trace:
        if self._exit is not None:
            raise RuntimeError("this trace is already active; make a new qkvtrace.trace(model)")
        masks.sdpa_bool_true_means()  # measure once, before anything is patched
        if self._model is None:
            raise RuntimeError("this trace has ended; make a new qkvtrace.trace(model)")
        self._names = {id(m): (name, m) for name, m in self._model.named_modules()}
        self._has_layers = any(isinstance(m, nn.TransformerEncoderLayer) for _, m in self._names.values())
        self._thread = threading.get_ident()
        stack = contextlib.ExitStack()
        try:
            self._install(stack)
        except BaseException:
            stack.close()
            raise
        self._exit = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._exit = self._exit, None
        try:
            if stack is not None:
                stack.close()
        finally:
            # keep only the records: no module, parameter or tensor outlives the block through the trace
            self._stack.clear()
            self._pending.clear()
            self._names.clear()
            self._specs.clear()
            self._norms = NormCache()
            self._originals.clear()
            self._model = None
            self.result.calls.sort(key=lambda c: c.index)

    # -- installation ------------------------------------------------------

    def _patch(self, stack: contextlib.ExitStack, owner: Any, name: str, wrapper: Any) -> Any:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, wrapper)
        stack.callback(setattr, owner, name, original)
        return original

    def _install(self, stack: contextlib.ExitStack) -> None:
        o = self._originals
        o["mha_forward"] = self._patch(stack, nn.MultiheadAttention, "forward", self._make_mha_forward())
        o["native_mha"] = self._patch(stack, torch, "_native_multi_head_attention", self._native_mha)
        o["layer_fwd"] = self._patch(stack, torch, "_transformer_encoder_layer_fwd", self._layer_fwd)
        o["mha_fn"] = self._patch(stack, F, "multi_head_attention_forward", self._mha_function)
        o["sdpa"] = self._patch(stack, F, "scaled_dot_product_attention", self._sdpa)
        # Modules that bound the SDPA builtin to a name of their own
        # (``from torch.nn.functional import scaled_dot_product_attention``).
        seen: set[int] = {id(F.__dict__)}
        model = self._model
        assert model is not None
        for module in model.modules():
            for cls in type(module).__mro__:
                if cls in (nn.Module, object):
                    break
                for attr in vars(cls).values():
                    globs = getattr(attr, "__globals__", None)
                    if globs is None or id(globs) in seen:
                        continue
                    seen.add(id(globs))
                    for gname, value in list(globs.items()):
                        if value is o["sdpa"]:
                            globs[gname] = self._sdpa
                            stack.callback(globs.__setitem__, gname, value)
        if self.record_gradients:
            for module in model.modules():
                if isinstance(module, nn.MultiheadAttention):
                    spec = self._spec(module)
                    assert spec is not None
                    self._register_grad_hooks(stack, module, spec)

    # -- helpers -----------------------------------------------------------

    def _name_of(self, module: nn.Module | None) -> str | None:
        if module is None:
            return None
        entry = self._names.get(id(module))
        return entry[0] if entry is not None and entry[1] is module else None

    def _spec(self, module: nn.Module) -> ProjectionSpec | None:
        key = id(module)
        if key not in self._specs:
            self._specs[key] = find_projection(module)
        return self._specs[key]

    def _owner_module(self, frame: types.FrameType | None) -> nn.Module | None:
        """The innermost traced module whose method is on the Python stack."""
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = frame.f_locals.get("self")
                if isinstance(obj, nn.Module) and self._name_of(obj) is not None:
                    return obj
            frame = frame.f_back
        return None

    def _enclosing(self) -> _Open | None:
        """The innermost open ``MultiheadAttention`` call, if any."""
        return self._stack[-1] if self._stack else None

    def _take_index(self) -> int:
        i = self._next_index
        self._next_index += 1
        return i

    def _active(self) -> bool:
        return self._exit is not None and threading.get_ident() == self._thread

    # -- MultiheadAttention.forward ---------------------------------------

    def _make_mha_forward(self) -> Callable[..., Any]:
        original = nn.MultiheadAttention.forward
        tracer = self

        def forward(self: nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
            name = tracer._name_of(self) if tracer._active() else None
            if name is None:
                return original(self, *args, **kwargs)
            return tracer._run_mha(original, self, name, args, kwargs)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward

    def _run_mha(
        self,
        original: Callable[..., Any],
        module: nn.MultiheadAttention,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        ctx = _Open(self._take_index(), module, name)
        a = _bind_mha(args, kwargs)
        query, key, value = a["query"], a["key"], a["value"]
        ctx.query, ctx.kpm, ctx.attn_mask = query, a["key_padding_mask"], a["attn_mask"]
        ctx.inputs = {
            "query_shape": _shape(query),
            "key_shape": _shape(key),
            "value_shape": _shape(value),
            "nested_lengths": _nested_lengths(query) if isinstance(query, torch.Tensor) else None,
            "dtype": _dtype_name(getattr(query, "dtype", None)),
            "device": getattr(getattr(query, "device", None), "type", None),
            "batch_first": bool(module.batch_first),
            "need_weights": bool(a["need_weights"]),
            "average_attn_weights": bool(a["average_attn_weights"]),
            "is_causal": bool(a["is_causal"]),
            "self_attention": query is key and key is value,
            **_modes(module),
        }
        self._stack.append(ctx)
        try:
            out = original(module, *args, **kwargs)
        except BaseException as exc:
            ctx.error = f"{type(exc).__name__}: {exc}"
            self._pop(ctx)
            with contextlib.suppress(Exception):  # the user's exception goes on, unchanged, whatever happens here
                self._finish_mha(ctx, None)
            raise
        self._pop(ctx)
        self._finish_mha(ctx, out)
        return out

    def _read_mha_frame(self, ctx: _Open, caller: types.FrameType | None) -> None:
        """Copy PyTorch's reason and canonical masks out of ``MultiheadAttention.forward``'s frame."""
        frame = _frame_of(_MHA_FORWARD_CODE, caller)
        if frame is not None:
            local = frame.f_locals
            ctx.local = {k: local.get(k) for k in ("why_not_fast_path", "key_padding_mask", "attn_mask")}

    def _pop(self, ctx: _Open) -> None:
        while self._stack:
            if self._stack.pop() is ctx:
                break

    def _finish_mha(self, ctx: _Open, out: Any) -> None:
        module = ctx.module
        local = ctx.local
        path = ctx.path
        query = ctx.query
        inputs = ctx.inputs
        rows: int | None = 0
        if ctx.error is not None:  # the inputs were refused: record them as given, measure nothing
            rows = None
            inputs["key_padding_mask"] = _mha_mask_info(ctx.kpm, None)
            inputs["attn_mask"] = _mha_mask_info(ctx.attn_mask, None)
        elif ctx.kpm is None and ctx.attn_mask is None:
            inputs["key_padding_mask"] = inputs["attn_mask"] = None
        else:
            # masks as PyTorch's own _canonical_mask left them (additive floats)
            kpm_c, attn_c = local.get("key_padding_mask"), local.get("attn_mask")
            inputs["key_padding_mask"] = _mha_mask_info(ctx.kpm, kpm_c)
            inputs["attn_mask"] = _mha_mask_info(ctx.attn_mask, attn_c)
            if isinstance(query, torch.Tensor) and not query.is_nested:
                rows = _mha_fully_masked(module, query, kpm_c, attn_c)
        call = AttentionCall(
            index=ctx.index,
            module=ctx.name,
            module_type=type(module).__name__,
            path=path or "unknown",
            why_not_fast_path=None if path == "fast" else local.get("why_not_fast_path"),
            why_not_fused_layer=self._layer_reason(module) if self._has_layers else None,
            sdpa_backend=ctx.backend,
            aten_ops=ctx.ops,
            inputs=inputs,
            qkv=self._norms.qkv(module, self._spec(module)),
            output={
                "nan_count": _nan_count(out[0] if isinstance(out, tuple) else out),
                "fully_masked_rows": rows,
            },
            sdpa_refusals=ctx.refusals,
            error=ctx.error,
        )
        ctx.query = ctx.kpm = ctx.attn_mask = None
        ctx.local = {}
        self.result.calls.append(call)

    def _layer_reason(self, mha: nn.Module) -> str | None:
        """The enclosing encoder layer's ``why_not_sparsity_fast_path``, verbatim, read from its frame."""
        frame = _frame_of(_LAYER_FORWARD_CODE, sys._getframe(2))
        if frame is None:
            return None
        local = frame.f_locals
        if getattr(local.get("self"), "self_attn", None) is not mha:
            return None
        reason = local.get("why_not_sparsity_fast_path")
        return reason if isinstance(reason, str) else None

    # -- TransformerEncoderLayer.forward ----------------------------------

    def _layer_fwd(self, *args: Any, **kwargs: Any) -> Any:
        """Wrapper of ``torch._transformer_encoder_layer_fwd`` (the fused layer)."""
        original = self._originals["layer_fwd"]
        if not self._active():
            return original(*args, **kwargs)
        frame = _frame_of(_LAYER_FORWARD_CODE, sys._getframe(1))
        layer = frame.f_locals.get("self") if frame is not None else None
        mha = getattr(layer, "self_attn", None)
        if not isinstance(layer, nn.Module) or not isinstance(mha, nn.MultiheadAttention) or self._name_of(mha) is None:
            return original(*args, **kwargs)
        src = _arg(args, kwargs, _LAYER_FWD_ARGS, "src")
        mask = _arg(args, kwargs, _LAYER_FWD_ARGS, "mask")
        mask_type = _arg(args, kwargs, _LAYER_FWD_ARGS, "mask_type")
        index = self._take_index()
        key = ("layer_fwd", src.device.type, src.dtype, src.is_nested, mask is None, mask_type,
               bool(_arg(args, kwargs, _LAYER_FWD_ARGS, "norm_first")))  # fmt: skip
        out, ops = self._evidence.run(key, original, *args, **kwargs)
        ops = ops if ops is not None else ["aten::_transformer_encoder_layer_fwd"]
        length = src.shape[1] if not src.is_nested else 0
        rows = 0
        mask_record = None
        if isinstance(mask, torch.Tensor):
            blocked = masks.blocked_by_additive(mask) if mask.is_floating_point() else mask
            mask_record = asdict(masks.mask_info(mask, blocked, None))
            kpm = blocked if mask_type == 1 else None
            attn = blocked if mask_type != 1 else None
            with torch.no_grad():
                rows = masks.count_fully_masked((src.shape[0], mha.num_heads, length), kpm, attn)
        call = AttentionCall(
            index=index,
            module=self._name_of(mha) or "",
            module_type=type(mha).__name__,
            path="fused_encoder_layer",
            why_not_fast_path=None,
            why_not_fused_layer=None,
            sdpa_backend=self._evidence.backend_of(src.device.type, ops),
            aten_ops=ops,
            inputs={
                "query_shape": _shape(src),
                "nested_lengths": _nested_lengths(src),
                "dtype": str(src.dtype),
                "device": src.device.type,
                "batch_first": True,
                "need_weights": False,
                "merged_mask": mask_record,
                "mask_type": mask_type,
                "is_causal": False,
                **_modes(layer),
            },
            qkv=self._norms.qkv(mha, self._spec(mha)),
            output={"nan_count": _nan_count(out), "fully_masked_rows": rows},
        )
        self.result.calls.append(call)
        return out

    # -- the C++ fast path of MultiheadAttention --------------------------

    def _native_mha(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["native_mha"]
        ctx = self._enclosing()
        if not self._active() or ctx is None:
            return original(*args, **kwargs)
        query = _arg(args, kwargs, _NATIVE_MHA_ARGS, "query")
        key = ("native_mha", query.device.type, query.dtype, query.is_nested,
               _arg(args, kwargs, _NATIVE_MHA_ARGS, "mask") is None,
               bool(_arg(args, kwargs, _NATIVE_MHA_ARGS, "need_weights", True)),
               _arg(args, kwargs, _NATIVE_MHA_ARGS, "mask_type"))  # fmt: skip
        self._read_mha_frame(ctx, sys._getframe(1))
        ctx.path = "fast"
        out, ops = self._evidence.run(key, original, *args, **kwargs)
        ctx.ops = ops if ops is not None else ["aten::_native_multi_head_attention"]
        ctx.backend = self._evidence.backend_of(query.device.type, ctx.ops)
        return out

    # -- F.multi_head_attention_forward (the fallback) --------------------

    def _mha_function(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["mha_fn"]
        ctx = self._enclosing()
        if self._active() and ctx is not None and ctx.path is None:
            ctx.path = "fallback"
            self._read_mha_frame(ctx, sys._getframe(1))
        return original(*args, **kwargs)

    # -- F.scaled_dot_product_attention -----------------------------------

    def _sdpa(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["sdpa"]
        if not self._active():
            return original(*args, **kwargs)
        ctx = self._enclosing()
        owner = None
        if ctx is None:
            owner = self._owner_module(sys._getframe(1))
            if owner is None:  # not made by the traced model
                return original(*args, **kwargs)
        q = _arg(args, kwargs, _SDPA_ARGS, "query")
        k = _arg(args, kwargs, _SDPA_ARGS, "key")
        v = _arg(args, kwargs, _SDPA_ARGS, "value")
        mask = _arg(args, kwargs, _SDPA_ARGS, "attn_mask")
        dropout_p = float(_arg(args, kwargs, _SDPA_ARGS, "dropout_p", 0.0))
        is_causal = bool(_arg(args, kwargs, _SDPA_ARGS, "is_causal", False))
        scale = kwargs.get("scale")
        gqa = bool(kwargs.get("enable_gqa", False))
        index = self._take_index() if ctx is None else -1
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        # PyTorch's own choice on the very arguments, before the call runs:
        # the same function SDPA's C++ entry calls to pick its kernel.
        backend = paths.sdpa_backend(q, k, v, mask, dropout_p, is_causal, scale, gqa)
        refusals = None
        if self.record_refusals and q.device.type == "cuda":
            refusals = paths.sdpa_refusals(q, k, v, mask, dropout_p, is_causal, gqa)
        sig = ("sdpa", q.device.type, q.dtype, backend, None if mask is None else mask.dtype,
               is_causal, dropout_p > 0, grad, q.is_nested)  # fmt: skip
        try:
            out, ops = self._evidence.run(sig, original, *args, **kwargs)
        except BaseException as exc:  # record the refused call, then let the error go on unchanged
            error = f"{type(exc).__name__}: {exc}"
            if ctx is not None:
                ctx.backend, ctx.refusals = backend, refusals
            elif owner is not None:
                call = self._sdpa_call(index, owner, q, k, v, mask, is_causal, dropout_p, backend, [], None, refusals)
                call.error = error
                self.result.calls.append(call)
            raise
        ops = ops if ops is not None else ["aten::scaled_dot_product_attention"]
        if backend is not None:
            for op in ops:
                if op != "aten::scaled_dot_product_attention":
                    self._evidence.learn(q.device.type, op, backend)
        if ctx is not None:  # the kernel of a MultiheadAttention fallback
            ctx.backend = backend
            ctx.ops = list(ops)
            ctx.refusals = refusals
            return out
        assert owner is not None
        self.result.calls.append(
            self._sdpa_call(index, owner, q, k, v, mask, is_causal, dropout_p, backend, ops, out, refusals)
        )
        return out

    def _sdpa_call(
        self, index: int, owner: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor | None, is_causal: bool, dropout_p: float, backend: str | None,
        ops: list[str], out: torch.Tensor | None, refusals: dict[str, list[str]] | None,
    ) -> AttentionCall:  # fmt: skip
        mask_record = None
        rows = 0
        with torch.no_grad():
            blocked = None
            if isinstance(mask, torch.Tensor):
                if mask.dtype == torch.bool:
                    true_means = masks.sdpa_bool_true_means()
                    blocked = ~mask if true_means == "attend" else mask
                else:
                    true_means = None
                    blocked = masks.blocked_by_additive(mask)
                mask_record = asdict(masks.mask_info(mask, blocked, true_means))
            if is_causal and not q.is_nested:
                length, s = q.shape[-2], k.shape[-2]
                causal = torch.ones(length, s, dtype=torch.bool, device=q.device).tril().logical_not()
                blocked = causal if blocked is None else (blocked | causal)
            if blocked is not None and not q.is_nested:
                lead = q.shape[:-2]
                b = int(lead[0]) if len(lead) >= 1 else 1
                h = int(lead[1]) if len(lead) >= 2 else 1
                attn = blocked
                while attn.dim() < 4:
                    attn = attn.unsqueeze(0)
                rows = masks.count_fully_masked((b, h, q.shape[-2]), None, attn)
            spec = self._spec(owner)
            base = self._norms.qkv(owner, spec)
            parts = {}
            for part, t in (("q", q), ("k", k), ("v", v)):
                norm = None if t.is_nested else float(torch.linalg.vector_norm(t.detach().float()))
                info = getattr(base, part) or SliceInfo(None, None, None, None)
                parts[part] = dataclasses.replace(info, activation_norm=norm)
            qkv = QKVInfo(layout=base.layout, **parts)
        self._ensure_grad_hooks(owner, spec)
        return AttentionCall(
            index=index,
            module=self._name_of(owner) or "",
            module_type=type(owner).__name__,
            path="sdpa",
            why_not_fast_path=None,
            why_not_fused_layer=None,
            sdpa_backend=backend,
            aten_ops=list(ops),
            inputs={
                "query_shape": _shape(q),
                "key_shape": _shape(k),
                "value_shape": _shape(v),
                "dtype": str(q.dtype),
                "device": q.device.type,
                "attn_mask": mask_record,
                "is_causal": is_causal,
                "dropout_p": dropout_p,
                **_modes(owner),
            },
            qkv=qkv,
            output={"nan_count": _nan_count(out), "fully_masked_rows": rows},
            sdpa_refusals=refusals,
        )

    # -- gradients ---------------------------------------------------------

    def _ensure_grad_hooks(self, module: nn.Module, spec: ProjectionSpec | None) -> None:
        """Hook the Q/K/V parameters of a module seen calling SDPA (once)."""
        if (
            self.record_gradients
            and spec is not None
            and self._exit is not None
            and id(module) not in self._grad_modules
        ):
            self._register_grad_hooks(self._exit, module, spec)

    def _register_grad_hooks(self, stack: contextlib.ExitStack, module: nn.Module, spec: ProjectionSpec) -> None:
        self._grad_modules.add(id(module))
        by_param: dict[str, list[tuple[int, int] | None]] = {}
        for _, ps in spec.parts():
            by_param.setdefault(ps.param, []).append(ps.rows)
            if ps.bias_param is not None:
                by_param.setdefault(ps.bias_param, []).append(ps.bias_rows)
        for pname, rows_list in by_param.items():
            param = module.get_parameter(pname)
            if param.requires_grad:
                handle = param.register_hook(self._make_grad_hook(id(module), pname, rows_list))
                stack.callback(handle.remove)

    def _make_grad_hook(
        self, mid: int, pname: str, rows_list: list[tuple[int, int] | None]
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._exit is None:
                return
            norms = slice_norms_of(grad, rows_list)
            pending = self._pending.setdefault(mid, {})
            for rows, norm in zip(rows_list, norms, strict=True):
                pending[(pname, rows)] = norm
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self._pending:
            return
        for mid, pass_norms in self._pending.items():
            name, module = self._names[mid]
            spec = self._spec(module)
            assert spec is not None
            parts = grad_slices(module, spec, pass_norms)
            self.result.gradients.append(GradientRecord(module=name, backward_index=self._backward_index, **parts))
        self.result.gradients.sort(key=lambda g: (g.backward_index, g.module))
        self._pending = {}
        self._backward_index += 1


_MHA_PARAMS: tuple[tuple[str, Any], ...] = tuple(
    (p.name, p.default)
    for p in inspect.signature(nn.MultiheadAttention.forward).parameters.values()
    if p.name != "self"
)


_MHA_DEFAULTS: dict[str, Any] = {n: (None if d is inspect.Parameter.empty else d) for n, d in _MHA_PARAMS}
_MHA_NAMES: tuple[str, ...] = tuple(n for n, _ in _MHA_PARAMS)


def _bind_mha(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``MultiheadAttention.forward``'s arguments by name (signature read from PyTorch once)."""
    bound = dict(_MHA_DEFAULTS)
    bound.update(zip(_MHA_NAMES, args, strict=False))  # positional ones only
    if kwargs:
        bound.update(kwargs)
    return bound


def _mha_fully_masked(module: nn.MultiheadAttention, query: torch.Tensor, kpm_c: Any, attn_c: Any) -> int:
    """Query rows of an MHA call whose keys are all blocked by PyTorch's canonical masks."""
    if query.dim() == 3:
        b, length = (query.shape[0], query.shape[1]) if module.batch_first else (query.shape[1], query.shape[0])
    else:
        b, length = 1, query.shape[0]
    with torch.no_grad():
        return masks.count_fully_masked(
            (b, module.num_heads, length),
            masks.blocked_by_additive(kpm_c) if isinstance(kpm_c, torch.Tensor) else None,
            masks.blocked_by_additive(attn_c) if isinstance(attn_c, torch.Tensor) else None,
        )


def _mha_mask_info(original: Any, canonical: Any) -> dict[str, Any] | None:
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


def trace(model: nn.Module, *, gradients: bool = True, refusals: bool = True) -> Trace:
    """Trace every attention call ``model`` makes inside a ``with`` block.

    >>> with qkvtrace.trace(model) as t:        # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> t.calls[0].path, t.calls[0].why_not_fast_path   # doctest: +SKIP

    ``gradients``: record Q/K/V slice gradients after each backward pass.
    ``refusals``: on CUDA, record PyTorch's reasons for refusing each faster
    SDPA backend (costs a few checks per SDPA call).
    """
    return Trace(model, gradients=gradients, refusals=refusals)
