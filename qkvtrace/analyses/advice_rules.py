"""The changes that could move one recorded attention call to a faster path, read from its facts.

Each rule starts from what the trace recorded for the call -- PyTorch's own
reason (verbatim, so a reason a later PyTorch words differently simply
finds no rule), the path, ``need_weights``, the masks, the modes -- and
says how to make the change on a *copy* of the model. Whether it helps is
not decided here: :mod:`qkvtrace.analyses.advise` measures every candidate.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qkvtrace.analyses.advice_sdpa import forward_site, sdpa_in_place_of
from qkvtrace.records import kernel_refusal

__all__ = ["Candidate", "candidates_for", "combined"]

#: how a change is made on a copy: returns the context the copy then runs in (or None) and where the call is made
Apply = Callable[[nn.Module], tuple[Callable[[], Any] | None, list[str]]]

_WHOLE = None  # the scope of a change made to the whole model or to the way it is called


@dataclass
class Candidate:
    change: str
    gives_up: str
    #: the module the change is made to (its name in the model, ``""`` the root), ``None`` for the whole model
    scope: str | None
    apply: Apply
    #: outputs may differ by this much and the change still keeps the results (float reassociation)
    tolerance: float = 1e-4
    #: for a change to the model's own code: the same computation both ways on tensors of the call's shapes
    pair: Callable[[], Any] | None = None
    #: where the change is made when it is known before running (the forward that holds the code)
    site: str | None = None
    #: the change drops outputs the caller may read (weights): only the outputs both still return are compared
    drops_outputs: bool = False
    #: the single changes a combined one is made of, in the order they are applied (empty: a single change)
    parts: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The single changes this one makes (itself, for a single change)."""
        return self.parts or (self.change,)


def candidates_for(call: Any, model: nn.Module, train: bool) -> tuple[list[Candidate], str]:
    """The candidates for ``call`` (an :class:`~qkvtrace.records.AttentionCall`), or why there are none."""
    path = call.path
    found: list[Candidate] = []
    if "hooks" in (call.why_not_fused_layer or ""):  # the enclosing encoder layer's own fused path is refused
        found.append(_without_hooks(call.module.rpartition(".")[0]))
    if path == "fused_encoder_layer" or (path == "fast" and not found):
        return [], f"already on PyTorch's fused {'encoder layer' if path != 'fast' else 'MultiheadAttention'} path"
    if path == "fallback":
        found += _mha_rules(call, train)
    if path == "hand_written" and _attn_implementation(model) == "eager":
        found.append(_transformers_sdpa())
    if found:
        return found, ""
    if path == "sdpa":
        refused = call.sdpa_refusals or {}
        why = "; ".join(f"{b}: {' '.join(r)}" for b, r in refused.items() if r)
        return [], f"SDPA ran {call.sdpa_backend}" + (f"; PyTorch refused the others: {why}" if why else "")
    if path == "hand_written":
        make, said = sdpa_in_place_of(call, train)
        if make is None:
            return [], f"attention written by hand; SDPA in its place not measured: {said}"
        return [Candidate(
            f"{said} in place of {call.inputs.get('form') or 'the softmax(QKᵀ)V'} in {call.module_type}.forward "
            "(measured on tensors of the call's shapes)",
            "the attention weights the hand-written code computes: SDPA returns none",
            call.module, _no_copy, tolerance=1e-3, pair=make,
            site=call.inputs.get("site") or forward_site(model, call.module))], ""  # fmt: skip
    if path == "fallback" and train:
        why = "training: MultiheadAttention has no faster path for a training step than SDPA inside the fallback"
        refused = kernel_refusal(call.sdpa_refusals)
        if call.sdpa_backend and refused:  # PyTorch's own words for the kernel SDPA did not pick
            why += f"; SDPA ran {call.sdpa_backend}: PyTorch refused {refused[0]}: {refused[1]}"
            if call.inputs.get("dropout_p"):
                why += f" (the module's dropout={call.inputs['dropout_p']:g}; it applies in training only)"
        return [], why
    return [], f"no change known for PyTorch's reason: {call.why_not_fast_path or 'none given'}"


def combined(first: Candidate, then: Candidate) -> Candidate:
    """Both changes at once, ``first`` made first and ``then`` on top of it (a change to a module's calls hands its
    arguments on to the change made before it): PyTorch names only the first reason it meets, so fixing it may
    show the next."""

    def apply(model: nn.Module) -> tuple[Callable[[], Any] | None, list[str]]:
        ctx_a, where_a = first.apply(model)
        ctx_b, where_b = then.apply(model)
        contexts = [c for c in (ctx_a, ctx_b) if c is not None]

        @contextlib.contextmanager
        def both() -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for c in contexts:
                    stack.enter_context(c())
                yield

        return (both if contexts else None), where_a if first.scope is not None else where_b

    scope = first.scope if first.scope == then.scope else _WHOLE
    return Candidate(f"{first.change} + {then.change}", f"{first.gives_up}; {then.gives_up}", scope, apply,
                     max(first.tolerance, then.tolerance), drops_outputs=first.drops_outputs or then.drops_outputs,
                     parts=first.names + then.names)  # fmt: skip


def _no_copy(_model: nn.Module) -> tuple[Callable[[], Any] | None, list[str]]:
    raise NotImplementedError("a change to the model's own code is measured on its shapes, not on a copy")


def _mha_rules(call: Any, train: bool) -> list[Candidate]:
    reason = call.why_not_fast_path or ""
    inputs = call.inputs
    out: list[Candidate] = []
    if not train and "grad is enabled" in reason:
        out.append(Candidate(
            "run the forward under torch.inference_mode()",
            "autograd: no gradients, and tensors made inside cannot be used by autograd later",
            _WHOLE, lambda _m: (torch.inference_mode, [])))  # fmt: skip
    if "get_fastpath_enabled" in reason:
        out.append(Candidate(
            "torch.backends.mha.set_fastpath_enabled(True)",
            "nothing (the switch only exists to turn the fused paths off)",
            _WHOLE, lambda _m: (_fastpath, [])))  # fmt: skip
    if "batch_first" in reason:
        out.append(Candidate(
            f"batch_first=True for {call.module or 'the module'} (inputs as (batch, sequence, features))",
            "the caller's tensors change layout: (L, N, E) becomes (N, L, E)",
            call.module, _wrapped(call.module, _batch_first)))  # fmt: skip
    if "floating-point masks" in reason:
        out.append(Candidate(
            "a boolean mask (True = blocked) instead of a float one",
            "nothing when the float mask holds only 0 and -inf; other values are a bias a boolean mask cannot say",
            call.module, _wrapped(call.module, _bool_masks)))  # fmt: skip
    if inputs.get("need_weights"):
        out.append(Candidate(
            "need_weights=False",
            "the attention weights the call returns (None instead): a caller that reads them breaks",
            call.module, _wrapped(call.module, _no_weights), drops_outputs=True))  # fmt: skip
    return out


# -- making a change on a copy ----------------------------------------------------------------------


_MHA_SIGNATURE = inspect.signature(inspect.unwrap(nn.MultiheadAttention.forward))
_TORCH = os.path.dirname(torch.__file__)
#: the qkvtrace package's own folder
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what a module called by the advisor's own unit of work (the model's root) is called by
CALLED_BY_QKVTRACE = "(called by qkvtrace)"


def _caller() -> str | None:
    """``file:line`` of the first frame outside PyTorch: the code that called the module -- or, where that is
    qkvtrace's own (the unit of work calling the model's root module), :data:`CALLED_BY_QKVTRACE`."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH):
            if name.startswith(_OURS + os.sep) and os.sep + "tests" + os.sep not in name:
                return CALLED_BY_QKVTRACE
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _wrapped(name: str, change: Callable[[nn.Module, inspect.BoundArguments], Callable[[Any], Any]]) -> Apply:
    """Make ``change`` to every call of the copy's module ``name`` (its arguments, then its result)."""

    def apply(model: nn.Module) -> tuple[Callable[[], Any] | None, list[str]]:
        module = model.get_submodule(name)
        where: list[str] = []
        #: a change made to the copy before this one (:func:`combined`): this one hands its arguments on to it
        inner = module.__dict__.get("forward")

        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
            after = change(module, bound)
            if not where:
                found = _caller()
                if found:
                    where.append(found)
            if inner is not None:
                return after(inner(*bound.args[1:], **bound.kwargs))
            # the class's forward as it is now (a trace open around the copy wraps it there)
            return after(type(module).forward(*bound.args, **bound.kwargs))

        module.forward = forward  # type: ignore[method-assign]  # on the copy only
        return None, where

    return apply


def _no_weights(_module: nn.Module, bound: inspect.BoundArguments) -> Callable[[Any], Any]:
    bound.arguments["need_weights"] = False
    return lambda out: out


def _bool_masks(_module: nn.Module, bound: inspect.BoundArguments) -> Callable[[Any], Any]:
    for name in ("attn_mask", "key_padding_mask"):
        mask = bound.arguments.get(name)
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            bound.arguments[name] = torch.isneginf(mask)
    return lambda out: out


def _batch_first(module: nn.Module, bound: inspect.BoundArguments) -> Callable[[Any], Any]:
    module.batch_first = True  # type: ignore[assignment]
    a = bound.arguments
    same_kv = a["key"] is a["value"]
    same_qk = a["query"] is a["key"]
    q = a["query"].transpose(0, 1)
    k = q if same_qk else a["key"].transpose(0, 1)
    a["query"], a["key"], a["value"] = q, k, k if same_kv else a["value"].transpose(0, 1)

    def back(out: Any) -> Any:
        return (out[0].transpose(0, 1), *out[1:]) if isinstance(out, tuple) else out.transpose(0, 1)

    return back


@contextlib.contextmanager
def _fastpath() -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _without_hooks(layer: str) -> Candidate:
    def apply(model: nn.Module) -> tuple[Callable[[], Any] | None, list[str]]:
        for m in model.get_submodule(layer).modules():
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
        return None, []

    return Candidate(f"no forward hooks on {layer or 'the layer'} (move them elsewhere)",
                     "what the hooks did: they do not run on the fused path", layer, apply)  # fmt: skip


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def _transformers_sdpa() -> Candidate:
    def apply(model: nn.Module) -> tuple[Callable[[], Any] | None, list[str]]:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter("sdpa")
        else:
            model.config._attn_implementation = "sdpa"  # type: ignore[union-attr]
        return None, []

    return Candidate('attn_implementation="sdpa" (transformers)',
                     "output_attentions=True: SDPA returns no weights (transformers asks for eager attention then)",
                     _WHOLE, apply, tolerance=1e-3)  # fmt: skip
