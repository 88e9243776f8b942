"""Q/K/V rows of a call that built no autograd graph: the module's forward run again, on copies, with grad on.

Under ``torch.no_grad()``, ``inference_mode()`` or with frozen weights a
call leaves no graph to read its rows from (:mod:`qkvtrace.dataflow`). The
module's forward is still on the Python stack when its kernel is called, so
its frame holds the arguments it is running with. This module

1. copies the module -- and, when the projections sit in a parent, the
   parent whose forward is on the stack -- with every parameter a new
   ``nn.Parameter`` that shares the real one's storage and requires grad
   (no weight is copied), with no hooks, and copies the frame's arguments
   (a KV cache too: the real one is never touched);
2. runs the frame's own code on the copies under ``torch.enable_grad()``,
   outside inference mode, with the random state forked and put back;
3. stops at the copy's kernel call that matches the real one -- the same
   Q, K and V, or failing that the same layout (a module that keeps state,
   such as a KV cache, gives other values on a second run) -- and reads the
   rows from that call's graph as :mod:`qkvtrace.dataflow` does in training.

Nothing the model owns changes: no parameter, buffer, ``.grad``, hook or
random state of the model, and no argument the caller passed. Only the
kernel entry points the tracer wraps (SDPA, FlexAttention) and attention
written by hand are stopped at; every other call in the replay runs as
written. A forward that rebinds its arguments before the kernel, or that
cannot be copied, says so in the reason instead of rows.
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from qkvtrace.slices import Projection

__all__ = ["EVIDENCE", "EVIDENCE_LAYOUT", "PROFILING", "active", "derive", "offer"]

EVIDENCE = "dataflow: autograd graph of the call run again on copies with gradients on"
EVIDENCE_LAYOUT = (
    "dataflow: autograd graph of the module run again on copies with gradients on "
    "(the run gave this call's layout but other values: the module keeps state, such as a KV cache)"
)

#: why a call's rows wait for a later call: a profiler records (its reason is not kept for later calls)
PROFILING = "a profiler is recording, and running the module again to read them would show in its profile"

_local = threading.local()


class _Stop(BaseException):
    """Ends a replay at the kernel call it was run for (a BaseException: a model's ``except Exception`` lets it by)."""


class _Capture:
    """One replay in progress on this thread."""

    __slots__ = ("copies", "holders", "layout", "real", "result", "target")

    def __init__(self, target: nn.Module, holders: list[nn.Module], real: Sequence[torch.Tensor],
                 layout: Hashable) -> None:  # fmt: skip
        self.target = target
        self.holders = holders
        self.real = real
        self.layout = layout
        self.result: Projection | str | None = None
        self.copies: set[int] = set()


def active() -> bool:
    """Whether this thread is running a replay (the tracer records nothing then)."""
    return getattr(_local, "capture", None) is not None


def offer(qkv: Sequence[Any]) -> None:
    """A kernel call made during a replay with ``qkv``, by the innermost copied module on the stack.

    The call the replay was run for ends the replay; any other returns and runs as written.
    """
    cap: _Capture | None = getattr(_local, "capture", None)
    if cap is None:
        return
    module = _owner_on_stack(sys._getframe(1), cap)
    if module is not cap.target or len(qkv) != 3 or not all(isinstance(t, torch.Tensor) for t in qkv):
        return
    from qkvtrace import dataflow

    if all(_equal(a, b) for a, b in zip(qkv, cap.real, strict=True)):
        cap.result = dataflow.derive_projection(qkv, cap.holders, EVIDENCE)
        raise _Stop
    if cap.result is None and _layout(qkv) == cap.layout:  # kept unless a later call is the same exactly
        cap.result = dataflow.derive_projection(qkv, cap.holders, EVIDENCE_LAYOUT)


def _layout(qkv: Sequence[torch.Tensor]) -> Hashable:
    """Shapes but the sequence length (a cache the real call filled makes the run's K and V longer)."""
    return tuple((t.dim(), t.shape[:-2], t.shape[-1:], t.dtype, t.device) for t in qkv)


def _owner_on_stack(frame: types.FrameType | None, cap: _Capture) -> nn.Module | None:
    while frame is not None:
        obj = frame.f_locals.get("self") if frame.f_code.co_argcount else None
        if isinstance(obj, nn.Module) and id(obj) in cap.copies:
            return obj
        frame = frame.f_back
    return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    with torch.no_grad():
        return bool(torch.equal(a.detach(), b))


def _frames(holders: Sequence[nn.Module]) -> Iterator[tuple[nn.Module, types.FrameType]]:
    """The innermost forward frame of each of ``holders`` on this thread's stack, innermost holder first."""
    wanted = {id(h): h for h in holders}
    found: dict[int, types.FrameType] = {}
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and not code.co_flags & inspect.CO_GENERATOR:
            obj = frame.f_locals.get("self")
            if id(obj) in wanted and id(obj) not in found:
                found[id(obj)] = frame
        frame = frame.f_back
    for h in holders:
        if id(h) in found:
            yield h, found[id(h)]


def _arguments(frame: types.FrameType) -> tuple[list[Any], dict[str, Any]]:
    """The frame's arguments as they are now: positional (``self`` first) and keyword."""
    code, names, local = frame.f_code, frame.f_code.co_varnames, frame.f_locals
    n, kw = code.co_argcount, code.co_kwonlyargcount
    args = [local[name] for name in names[:n]]
    kwargs = {name: local[name] for name in names[n : n + kw]}
    i = n + kw
    if code.co_flags & inspect.CO_VARARGS:
        args += list(local[names[i]])
        i += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[i]])
    return args, kwargs


def _function(frame: types.FrameType) -> types.FunctionType:
    """A function running the frame's code, with its globals and the values of its free variables."""
    code = frame.f_code
    cells = tuple(types.CellType(frame.f_locals[name]) for name in code.co_freevars)
    return types.FunctionType(code, frame.f_globals, code.co_name, None, cells or None)


#: a module's hook tables: emptied on the copies, so no hook of the user's runs twice
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")  # fmt: skip


def _copy(module: nn.Module, args: list[Any], kwargs: dict[str, Any]) -> tuple[dict[int, Any], Any]:
    """Copies of ``module`` (parameters sharing storage, requiring grad; no hooks) and of the arguments."""
    memo: dict[int, Any] = {}
    with torch.inference_mode(False), torch.no_grad():
        for p in module.parameters():
            # a weight made under inference_mode cannot enter a graph: that one alone is copied
            shared = p.detach().clone() if p.is_inference() else p.detach()
            memo[id(p)] = nn.Parameter(shared, requires_grad=p.is_floating_point() or p.is_complex())
        copied = copy.deepcopy((module, args[1:], kwargs), memo)
    for m in copied[0].modules():
        for name in _HOOKS:
            if isinstance(getattr(m, name, None), dict):
                setattr(m, name, OrderedDict())
    return memo, copied


#: argument names that hold a cache the call writes into before its kernel (a second run would read it back)
_CACHE_NAMES = frozenset({"past_key_value", "past_key_values", "layer_past", "cache", "kv_cache", "cache_params"})


def _without_cache(args: list[Any], kwargs: dict[str, Any],
                   names: Sequence[str]) -> tuple[list[Any], dict[str, Any]] | None:  # fmt: skip
    """The arguments with each cache (a ``...Cache`` object, or a list or ``None``-able value under a cache's
    name) left out: ``None``, or an empty list. ``None`` when the call was given none."""

    def empty(name: str | None, value: Any) -> Any:
        if type(value).__name__.endswith("Cache") or (name in _CACHE_NAMES and value is not None):
            return type(value)() if isinstance(value, (list, dict)) else None
        return value

    new_args = [empty(names[i] if i < len(names) else None, v) for i, v in enumerate(args)]
    new_kwargs = {k: empty(k, v) for k, v in kwargs.items()}
    changed = any(a is not b for a, b in zip(args, new_args, strict=True)) or any(
        new_kwargs[k] is not kwargs[k] for k in kwargs
    )
    return (new_args, new_kwargs) if changed else None


def derive(module: nn.Module, qkv: Sequence[Any], holders: Sequence[nn.Module], why: str) -> Projection | str:
    """``module``'s rows for this call, from a replay of the innermost holder whose forward gives them.

    Each holder's forward is run without the cache it was given, if any, and
    then as it was called: the real call wrote into its cache before its
    kernel, so a run with a copy of that cache reads the new keys back, and
    can even give the call's very Q, K, V out of the cache rather than from
    the projections. The first run that reaches the call gives the rows: one
    that reproduces its Q, K, V exactly, or else its layout (the evidence
    says which).

    ``why``: why the call itself gave none (returned, with what the replay met, when no replay gives them).
    """
    if active():
        return why
    if torch.autograd._profiler_enabled():  # the run's operations would show in the profile being recorded
        return f"{why}; {PROFILING}"
    from qkvtrace import dataflow

    tried: list[str] = []
    layout = _layout(qkv)
    for holder, frame in _frames(holders):
        try:
            args, kwargs = _arguments(frame)
            function = _function(frame)
        except Exception as exc:  # a frame that cannot be read back: said, not raised
            tried.append(f"{type(holder).__name__} could not be run again ({type(exc).__name__}: {exc})")
            continue
        inside = list(holders[: holders.index(holder) + 1])
        variants = [(args, kwargs, "")]
        bare = _without_cache(args, kwargs, frame.f_code.co_varnames)
        if bare is not None:  # first: a copy of a cache the call already wrote to can give its Q, K, V by chance
            variants.insert(0, (*bare, ", without its cache"))
        for vargs, vkwargs, how in variants:
            try:
                memo, (copied, cargs, ckwargs) = _copy(holder, vargs, vkwargs)
            except Exception as exc:  # a module or an argument that cannot be copied: said, not raised
                tried.append(f"{type(holder).__name__} could not be copied ({type(exc).__name__}: {exc})")
                break
            target = memo.get(id(module))
            if target is None:
                break
            cap = _Capture(target, [memo[id(h)] for h in inside], [t.detach() for t in qkv], layout)
            cap.copies = {id(m) for m in copied.modules()}
            result = _run(cap, function, copied, cargs, ckwargs)
            if isinstance(result, Projection):  # the first run that reached the call: one with the cache is no better
                back = {id(memo[id(m)]): m for m in holder.modules() if id(m) in memo}
                return Projection(back[id(result.holder)], result.spec)
            tried.append(result + how)
        if tried and not (tried[-1].startswith("not derived: no nn.Linear") or dataflow.no_graph(tried[-1])):
            break  # the run could not reach the call: a parent's would not either
        # else Q, K, V came into this forward made: the projections are its parent's
    said = "; ".join(dict.fromkeys(tried))
    return f"{why}, and running the module again on copies with gradients on gave none: {said}" if said else why


def _run(cap: _Capture, function: types.FunctionType, module: nn.Module, args: Any, kwargs: Any) -> Projection | str:
    from qkvtrace.tracer.observers import handwritten

    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"} - {None})
    _local.capture = cap
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad(), \
                handwritten.recognising():  # fmt: skip
            function(module, *args, **kwargs)
    except _Stop:
        pass
    except Exception as exc:
        return f"the run raised {type(exc).__name__}: {exc}"
    finally:
        _local.capture = None
    if cap.result is None:
        return "the run made no kernel call with this call's Q, K, V or their layout (the forward depends on state)"
    return cap.result

