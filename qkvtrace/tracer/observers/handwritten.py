"""Attention written by hand: ``softmax(q @ kᵀ · scale + mask) @ v`` in a model's own code (path ``hand_written``).

No PyTorch entry point runs such attention, so no wrapper sees it. While a
traced model's *candidate* modules run -- modules that look like attention
(their name, their class, their projections) and hold none of PyTorch's own
attention modules -- a :class:`~torch.overrides.TorchFunctionMode` watches
the torch functions they call and follows the dataflow:

1. a matmul of two activations (``@``, ``torch.matmul``, ``bmm``,
   ``baddbmm``, a two-operand ``einsum``; never a parameter: that is a
   projection) makes *scores*, remembering its two operands (Q and K);
2. what is done to the scores is kept in order: scalar scaling, masks and
   biases added, ``masked_fill`` and ``where``, soft-capping (``/ c``,
   ``tanh``, ``· c``), casts, reshapes;
3. a softmax over their last axis makes *probabilities* (dropout, casts and
   reshapes keep them so);
4. a matmul of probabilities with an activation (V) is the attention: it is
   recorded now, owned by the innermost traced module on the Python stack,
   with its Q/K/V slices derived from the dataflow like any SDPA call's.

Scores may be assembled from pieces before the softmax (local blocks beside
global tokens, joined by ``torch.cat`` along the keys): the joined tensor is
scores; slices of its probabilities along the keys, each times its values,
summed until every key column is covered, are the attention's output.

Why a mode, and why only there: an active ``TorchFunctionMode`` makes
``nn.MultiheadAttention`` and the encoder layers refuse their fast paths, so
the mode is switched on only by forward hooks of the candidate modules, and
no module holding (or held by) PyTorch's attention modules is a candidate.
A candidate that turns out to call an entry point the tracer wraps (SDPA,
flex, MHA's function) is no longer watched after that call; its first call in
each later trace is checked: if it reaches none, the module is watched from its
next call (and the trace says so), else its hooks go. Nor is a leaf
candidate (a module with no children, a candidate by its name alone, such as
GPT-2's ``c_attn`` projection) once a call of it ended with no product of
two activations in it; while the wrapper runs, the mode steps off the stack, so PyTorch decides the kernel as
it would without it. The mode calls every function with the very arguments
it was given and returns its result untouched; it reads no values (masks and
biases are named when the trace resolves, :mod:`qkvtrace.facts.patterns`).

The same mode writes every torch function a watched module calls into this
thread's :class:`~qkvtrace.facts.lineage.Log`: a call that builds no graph (under
``no_grad``, ``inference_mode``, frozen weights) reads its Q/K/V rows from
there, running no code of the model again. So the mode is also on, while
their layouts are new, in an entry user's calls (the call after one whose
layout was new: a decoding loop's first step) and in the calls of the
outermost modules that hold a projection (*holders*, watched for their rows
only, so that a module of any name that calls SDPA has them).

This module says which modules are watched and switches the mode on and off;
the mode itself, and the dataflow it follows, are
:mod:`~qkvtrace.tracer.observers.handwritten_ops`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts import lineage
from qkvtrace.tracer import registry
from qkvtrace.tracer.observers.handwritten_ops import Recogniser, busy, local, state
from qkvtrace.tracer.observers.handwritten_record import PATH

__all__ = ["PATH", "TORCH_ATTENTION", "entry_point_called", "layouts_new", "stop_watching",
           "stop_watching_for_compile", "suspended", "unwatch", "watch", "watch_refused", "watching_any"]

#: PyTorch's modules whose fast paths an active mode refuses: never inside or around a candidate
TORCH_ATTENTION = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                    nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)  # fmt: skip

#: modules that called an entry point the tracer wraps while watched: their attention is recorded there
_entry_users: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: entry users whose last call built no graph and had a layout not seen before in the trace: their next calls
#: are watched too, so that each new layout's rows are read from its own functions (:mod:`qkvtrace.facts.lineage`)
_learning: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: entry users that made a call with gradients off (under no_grad; in inference mode, whose views keep no base)
#: in a layout seen before: a later such call is not watched for its rows unless it turns out to be new (then
#: the call after it is)
_settled: tuple[weakref.WeakSet[nn.Module], weakref.WeakSet[nn.Module]] = (weakref.WeakSet(), weakref.WeakSet())
#: modules watched only as the outermost holders of projections (:func:`~.candidates.projection_holders`): the
#: mode is on in their calls with gradients off until one such call reads no new layout
_holders: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: holders whose call (with gradients on; under no_grad; in inference mode) read no new layout, with the count of
#: :data:`_news` then: one more new layout of a module no hook watches, anywhere, and they are watched again
_holder_settled: tuple[weakref.WeakKeyDictionary[nn.Module, int], ...] = (
    weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary())


def _kind() -> int:
    """0 with gradients on, 1 under no_grad, 2 in inference mode (whose views keep no base)."""
    return 0 if torch.is_grad_enabled() else 1 + torch.is_inference_mode_enabled()
#: modules whose hooks go when their call under way ends (:func:`stop_watching` came during it)
_ending: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: how many calls with gradients off have had a layout not seen before (in any thread): of any module, and of
#: modules not watched themselves (whose next calls only a projection holder around them can watch)
_news = [0, 0]
#: leaf candidates a call of which, watched, ended with no product of two activations (:func:`_switch_off`)
_quiet: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: threads with the mode on now, and entry users being checked (a wrapper looks no further while 0)
watching = [0]
#: the hooks of every open trace's watched modules, and each module's
_handles: list[Any] = []
_hooks_of: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()

#: what a trace says when a module whose calls reached an entry point made one that did not (``warnings``)
ENTRY_LEFT = (
    "{} made a call that reached none of the attention functions the tracer wraps, after calls of it that did: "
    "it is watched for attention written by hand again from its next call (attention written by hand in that "
    "call is not recorded)"
)
#: what a trace says when it does not watch its model (``warnings``)
NOT_WATCHED = (
    "attention written by hand is not watched while torch.compile holds compiled code (torch._dynamo.reset() "
    "clears it): Dynamo would compile the watching hooks into its graphs and recompile them once the trace ends"
)


# -- which modules are watched -------------------------------------------------------------


def watch_refused() -> bool:
    """Watching would disturb compiled code: Dynamo holds compiled code (until ``torch._dynamo.reset()``).

    Dynamo compiles a module's hooks into its graph and guards on them, so a
    graph compiled while a watched module had its hooks would be compiled
    again once the trace removed them. Code of PyTorch's own that it compiles
    for itself (FlexAttention's eager wrapper) holds no module of the model.
    """
    convert = sys.modules.get("torch._dynamo.convert_frame")
    seen = getattr(getattr(convert, "input_codes", None), "seen", None)
    if not seen:
        return False
    codes = [ref() for ref in list(seen)]
    return any(code is not None and not code.co_filename.startswith(_TORCH_DIR) for code in codes)


#: where PyTorch's own files are
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def watch(module: nn.Module, holder: bool = False) -> list[Any]:
    """Register the hooks that switch the mode on around ``module``'s forward; their handles (none for a leaf
    left unwatched: :func:`_switch_off`). A ``holder`` is watched only for its rows (:data:`_holders`)."""
    if module in _quiet:
        return []
    if holder:
        _holders.add(module)
    pre = module.register_forward_pre_hook(_enter)
    try:
        post = module.register_forward_hook(_leave, always_call=True)
    except TypeError:  # a PyTorch without always_call
        post = module.register_forward_hook(_leave)
    _handles.extend((pre, post))
    live = (module._forward_pre_hooks, module._forward_hooks)
    kept = [h for h in _hooks_of.get(module, ()) if any(h.id in hooks for hooks in live)]  # (ended traces' go)
    _hooks_of[module] = [*kept, pre, post]
    return [pre, post]


def unwatch(handles: list[Any]) -> None:
    """Remove hooks made by :func:`watch` (a trace ends)."""
    for handle in handles:
        handle.remove()
        if handle in _handles:
            _handles.remove(handle)


def watching_any() -> bool:
    """Some open trace watches modules now."""
    return bool(_handles)


def stop_watching_for_compile() -> None:
    """``torch.compile`` is used, or Dynamo starts compiling, while a trace is open: Dynamo must not see the
    hooks that watch for hand-written attention (it would compile them in and compile again once they are
    gone); the open traces say so."""
    if watching_any():
        for t in registry.open_traces():
            t.note(NOT_WATCHED)
    stop_watching()


def stop_watching() -> None:
    """``torch.compile`` is used: remove every watching hook now, before Dynamo traces a module that has one --
    but those of a module whose watched call is under way (Dynamo compiling code of PyTorch's own inside it, as
    FlexAttention does), which go when that call ends: its leaving hook turns the mode off."""
    now = busy()
    keep = [h for m, hs in list(_hooks_of.items()) if id(m) in now for h in hs]
    for m in list(_hooks_of.keys()):
        if id(m) in now:
            _ending.add(m)
    for handle in _handles:
        if handle not in keep:
            handle.remove()
    _handles[:] = keep


def _enter(module: nn.Module, args: Any) -> None:
    try:
        _switch_on(module)
    except Exception as exc:  # a hook never raises into the model's call
        registry.report_failure("hand-written attention", exc)


def _switch_on(module: nn.Module) -> None:
    if compat.is_compiling() or compat.is_jit_tracing() or module in _quiet:
        return
    if module in _holders:
        if _holder_settled[_kind()].get(module) == _news[1]:
            return
        state().holders.append([module, _news[1]])
    elif module in _entry_users:
        state().users.append([module, False, _news[0]])
        watching[0] += 1  # (so that the wrappers say when an entry point is reached)
        if module not in _learning and (
            torch.is_grad_enabled() or module in _settled[torch.is_inference_mode_enabled()]
        ):
            return
    if not registry.covering(module):
        return
    st = state()
    st.active.append(module)
    st.opened_at.append(st.products)
    if st.mode is None:
        lineage.start()
        mode = Recogniser()
        mode.__enter__()
        st.mode = mode
        watching[0] += 1


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    try:
        _switch_off(module, output is not None)
        if module in _ending and id(module) not in busy():  # (torch.compile came during its call)
            _ending.discard(module)
            unwatch(_hooks_of.pop(module, []))
    except Exception as exc:  # a hook never raises into the model's call
        registry.report_failure("hand-written attention", exc)


def _switch_off(module: nn.Module, returned: bool = True) -> None:
    """The mode off once the outermost watched module's call ends. A leaf's call that ``returned`` (PyTorch hands
    an always-called hook no output when the call raised) with no product of two activations in it leaves the
    leaf unwatched from then on: a leaf is a candidate by its name alone, and a projection or a norm named for
    attention (GPT-2's ``c_attn``, a reference Llama's ``attention_norm``) would otherwise run every call of
    its own through the mode. An entry user's call that returned without reaching an entry point makes it a
    candidate again: its attention, from its next call, may be written by hand; one that reached one leaves it
    without hooks until the next trace (an entry user is checked on its first call of each trace), unless its
    layouts are still new (:func:`layouts_new`). A holder's call that met no new layout settles it."""
    st = getattr(local, "state", None)
    if st is None:
        return
    watched = bool(st.active) and st.active[-1] is module
    if watched:
        _mode_off(st, module, returned)
    if st.holders and st.holders[-1][0] is module:
        _, news = st.holders.pop()
        if returned and news == _news[1]:  # no call in it had a new layout: its later calls need not be watched
            _holder_settled[_kind()][module] = news
    if st.users and st.users[-1][0] is module:
        _, reached, news = st.users.pop()
        watching[0] -= 1
        if not returned:
            return
        if news == _news[0] and module in _learning:  # its layout was one seen before: its calls need not be
            _settle(module)  # watched for their rows
        if not reached:
            _entry_users.discard(module)
            for trace, name in registry.covering(module) if not watched else ():  # (watched: its attention
                trace.note(ENTRY_LEFT.format(name or "(root)"))  # written by hand was recorded)
        elif module not in _learning:  # checked in each trace that watches it: its hooks go, its later calls run
            unwatch(_hooks_of.pop(module, []))  # as without them (while its layouts are new, they stay)


def _mode_off(st: Any, module: nn.Module, returned: bool) -> None:
    st.active.pop()
    opened_at = st.opened_at.pop()
    if returned and st.products == opened_at and next(module.children(), None) is None:
        _quiet.add(module)
        unwatch(_hooks_of.pop(module, []))  # (PyTorch calls the hooks it listed before the call: safe here)
    if st.active or st.mode is None:
        return
    mode, st.mode = st.mode, None
    watching[0] -= 1
    st.forget()
    lineage.stop()
    if torch.overrides._get_current_function_mode() is mode:  # type: ignore[attr-defined]
        mode.__exit__(None, None, None)


def layouts_new(module: nn.Module) -> bool:
    """``module`` made a call that built no graph in a layout the trace had not seen: its next call is watched
    (its functions written down) even once it is known to call an entry point; so is the next call of the
    projection holder around it, unless the module is watched itself. Whether a later call will be."""
    _news[0] += 1
    if module in _entry_users and module not in _hooks_of:  # checked already in this trace, its hooks gone:
        covering = registry.covering(module)  # watched again, the hooks owned by the trace that records it
        if covering:
            covering[0][0].own(functools.partial(unwatch, watch(module)))
    if module in _hooks_of and module not in _holders:
        _learning.add(module)
        return True
    _news[1] += 1
    return any(module is m for holder in list(_holders) if holder in _hooks_of for m in holder.modules())


def _settle(module: nn.Module) -> None:
    """A call of ``module`` met no layout not seen before: its later calls need not be watched for their rows."""
    _learning.discard(module)
    if not torch.is_grad_enabled():
        _settled[torch.is_inference_mode_enabled()].add(module)


def entry_point_called() -> bool:
    """An entry point's wrapper runs: the watched modules around it use that entry point, and the entry users being
    checked around it reached one. True when watching."""
    if not watching[0]:
        return False
    st = getattr(local, "state", None)
    if st is None:
        return False
    for user in st.users:
        user[1] = True
    if st.mode is None:
        return False
    for m in st.active:
        if m not in _holders:
            _entry_users.add(m)
    return True


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """The mode off the stack while a wrapped entry point runs (PyTorch picks its path as without it)."""
    st = getattr(local, "state", None)
    if st is None or st.mode is None or torch.overrides._get_current_function_mode() is not st.mode:  # type: ignore[attr-defined]
        yield
        return
    with torch.overrides._pop_mode_temporarily():  # type: ignore[attr-defined]
        yield
