"""Which modules stay watched for attention written by hand, call after call.

A module is watched by switching a ``TorchFunctionMode`` on around its
forward. The witness of whether a module's call was watched is PyTorch's own
``torch.overrides._is_torch_function_mode_enabled()``, read by the module
itself inside its forward; the witness of what was recorded is the number of
forward calls made here, and the kind of attention each module was written
with.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

E, H, T, B = 16, 2, 5, 2
D = E // H


def _mode_on() -> bool:
    return bool(torch.overrides._is_torch_function_mode_enabled())


class _Packed(nn.Module):
    """A projection of a library's own (not ``nn.Linear``), as GPT-2's ``Conv1D``: a leaf."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.watched: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.watched.append(_mode_on())
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class _GPT2Like(nn.Module):
    """GPT-2's attention: a projection named ``c_attn`` (a leaf named for attention), then SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = _Packed(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.c_attn(x).split(E, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, E)


class _Model(nn.Module):
    """Attention written by hand (products of two activations seen before each ``c_attn`` call), then GPT-2's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _HoldsAttend(_Attend())
        self.attn = _GPT2Like()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.first(x))


def test_a_leaf_named_for_attention_that_makes_no_scores_is_watched_once() -> None:
    """Witness: the leaf reads PyTorch's own function-mode switch in its forward. Its first call runs inside
    its holder's first, watched call; every later one, in this trace or the next, runs with no mode on. The
    calls (the number made here, each of a hand-written attention and an SDPA call) keep their paths, their
    outputs the untraced run's."""
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(B, T, E)
    with torch.no_grad():
        want = model(x)
        model.attn.c_attn.watched.clear()
        with qkvtrace.trace(model) as first, qkvtrace.trace(model) as inner:
            hooks = [len(model.attn.c_attn._forward_pre_hooks) + len(model.attn.c_attn._forward_hooks)]
            got = [model(x)]
            hooks.append(len(model.attn.c_attn._forward_pre_hooks) + len(model.attn.c_attn._forward_hooks))
            got += [model(x) for _ in range(2)]
        with qkvtrace.trace(model) as second:
            hooked = len(model.attn.c_attn._forward_pre_hooks), len(model.attn._forward_pre_hooks)
            model(x)
    assert hooked == (0, 1)
    # under no_grad the call after one whose layout was new is watched too (its functions give the rows of a
    # layout new again, as a decoding loop's first step is); then no mode is on while the leaf runs
    assert model.attn.c_attn.watched == [True, True, False, False]
    assert hooks == [4, 0]  # PyTorch's own lists: each trace's two hooks, then none once the leaf made no scores
    assert [(c.module, c.path) for c in first.calls + second.calls] == [("first.attn", "hand_written"),
                                                                        ("attn", "sdpa")] * 4  # fmt: skip
    assert [(c.module, c.path) for c in inner.calls] == [(c.module, c.path) for c in first.calls]
    assert all(torch.equal(g, want) for g in got)


class _Attend(nn.Module):
    """Attention written by hand in a leaf (no children), named ``attn`` by its holder; it notes whether each of
    its calls was watched."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[bool] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.watched.append(_mode_on())
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


class _HoldsAttend(nn.Module):
    """Not a candidate itself (no projection, not named for attention): only its leaf is watched."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(B, T, H, D).transpose(1, 2)
        out = self.attn(heads, heads.flip(-1), heads.flip(-2))
        return out.transpose(1, 2).reshape(B, T, E)


def test_a_leaf_that_attends_by_hand_stays_watched() -> None:
    """Witness: the number of forward calls made here, each of a leaf written here with ``q @ kᵀ``, a
    softmax and ``@ v``."""
    torch.manual_seed(0)
    model, x = _HoldsAttend(_Attend()), torch.randn(B, T, E)
    with qkvtrace.trace(model) as t:
        for _ in range(3):
            model(x)
    assert [(c.module, c.path) for c in t.calls] == [("attn", "hand_written")] * 3
    assert model.attn.watched == [True] * 3


class _RaisesFirst(_Attend):
    """A leaf that attends by hand, whose first call raises before any product."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the model's own error")
        return super().forward(q, k, v)


def test_a_leaf_whose_call_raised_is_still_watched() -> None:
    """Witness: the error raised here on the first call, and the two forward calls made after it."""
    torch.manual_seed(0)
    model, x = _HoldsAttend(_RaisesFirst()), torch.randn(B, T, E)
    with qkvtrace.trace(model) as t:
        try:
            model(x)
        except RuntimeError as exc:
            assert str(exc) == "the model's own error"
        model(x)
        model(x)
    assert [(c.module, c.path) for c in t.calls] == [("attn", "hand_written")] * 2
    assert model.attn.watched == [True] * 2


class _LateAttention(nn.Module):
    """An attention module (it has a child) whose first call only projects, and whose later ones attend."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        if self.calls == 1:
            return v
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v


def test_a_module_with_children_stays_watched_after_a_call_without_scores() -> None:
    """Witness: the number of forward calls made here; only the first (which the module written here makes
    without attention) has none."""
    torch.manual_seed(0)
    model, x = _LateAttention(), torch.randn(B, T, E)
    with qkvtrace.trace(model) as t:
        for _ in range(3):
            model(x)
    assert [c.path for c in t.calls] == ["hand_written"] * 2


class _SwitchableAttention(nn.Module):
    """An attention module that calls SDPA, or (``by_hand``) writes the same attention by hand; its projection
    notes whether each call was watched."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = _Packed(E, 3 * E)
        self.by_hand = False
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        if self.fail:
            raise RuntimeError("the model's own error")
        if self.by_hand:
            out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(B, T, E)


def test_a_module_switched_from_sdpa_to_attention_by_hand_is_watched_again() -> None:
    """Witness: the kind of attention each call was written with, set here between traces (as a model's
    ``attn_implementation`` switched from ``"sdpa"`` to ``"eager"``), and the number of calls made. The first
    call written by hand after calls that used SDPA is not seen, and the trace says so; every later one is
    recorded, in the same trace and in the next; switched back, its SDPA calls are recorded as before."""
    torch.manual_seed(0)
    model, x = _SwitchableAttention(), torch.randn(B, T, E)
    with torch.no_grad():
        with qkvtrace.trace(model) as first:
            for _ in range(3):
                model(x)
        model.by_hand = True
        with qkvtrace.trace(model) as second:
            for _ in range(3):
                model(x)
        with qkvtrace.trace(model) as third:
            model(x)
        model.by_hand = False
        with qkvtrace.trace(model) as fourth:
            model(x)
            model(x)
    assert [c.path for c in first.calls] == ["sdpa"] * 3
    assert [c.path for c in second.calls] == ["hand_written"] * 2
    (note,) = [w for w in second.result.warnings if "(root) made a call that reached none" in w]
    assert "not recorded" in note
    assert [c.path for c in third.calls] == ["hand_written"]
    assert [c.path for c in fourth.calls] == ["sdpa"] * 2
    for t in (first, third, fourth):
        assert not any("reached none" in w for w in t.result.warnings)


def test_an_sdpa_user_keeps_its_hooks_for_its_first_call_of_each_trace_only() -> None:
    """Witness: PyTorch's own lists of the module's forward hooks, read between the calls made here."""
    torch.manual_seed(0)
    model, x = _SwitchableAttention(), torch.randn(B, T, E)
    hooks = []
    with torch.no_grad():
        for _ in range(2):
            with qkvtrace.trace(model):
                for _ in range(3):
                    hooks.append(len(model._forward_pre_hooks) + len(model._forward_hooks))
                    model(x)
    assert hooks == [2, 2, 0, 2, 0, 0]  # watched, then checked once (the first trace); checked once (the next)


def test_a_call_that_raised_leaves_an_sdpa_user_unwatched() -> None:
    """Witness: the error raised here before the SDPA call, and PyTorch's own function-mode switch read in the
    module's projection: after the failed call, the next calls run with no mode on and say nothing of it."""
    torch.manual_seed(0)
    model, x = _SwitchableAttention(), torch.randn(B, T, E)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x)
        model.fail = True
        try:
            model(x)
        except RuntimeError as exc:
            assert str(exc) == "the model's own error"
        model.fail = False
        model(x)
        model(x)
    # under no_grad a call whose layout was new is followed by a watched one (its functions give the next
    # layout's rows); the failed call says nothing of its layout, so the call after it is watched too
    assert model.qkv.watched == [True, True, True, False]
    assert [c.path for c in t.calls] == ["sdpa"] * 3
    assert not any("reached none" in w for w in t.result.warnings)


class _CrossAttention(nn.Module):
    """Attention written by hand in a module of its own (it has a projection child)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Linear(E, 2 * E)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.kv(x).split(E, dim=-1))
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v


class _BothAttention(nn.Module):
    """An SDPA user holding attention written by hand, which runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.cross = _CrossAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        return F.scaled_dot_product_attention(self.cross(q, x), k, v).transpose(1, 2).reshape(B, T, E)


def test_attention_by_hand_inside_an_sdpa_user_is_recorded_on_every_call() -> None:
    """Witness: the number of calls made here, each with one attention written by hand and one SDPA call, and
    PyTorch's own function-mode switch, off once each call returned."""
    torch.manual_seed(0)
    model, x = _BothAttention(), torch.randn(B, T, E)
    modes = []
    with torch.no_grad(), qkvtrace.trace(model) as t:
        for _ in range(3):
            model(x)
            modes.append(_mode_on())
    assert [(c.module, c.path) for c in t.calls] == [("cross", "hand_written"), ("", "sdpa")] * 3
    assert modes == [False] * 3
    assert not any("reached none" in w for w in t.result.warnings)


def test_a_trace_a_step_leaves_no_hook_behind() -> None:
    """Witness: Python's garbage collector, counting PyTorch's hook handles alive after 5 and after 45 traces of a
    model whose module attends by hand (so it keeps its hooks while each trace is open)."""
    from torch.utils.hooks import RemovableHandle

    torch.manual_seed(0)
    model, x = _SwitchableAttention(), torch.randn(B, T, E)
    model.by_hand = True

    def handles_after(traces: int) -> int:
        for _ in range(traces):
            with torch.no_grad(), qkvtrace.trace(model):
                model(x)
        gc.collect()
        return sum(type(o) is RemovableHandle for o in gc.get_objects())

    assert handles_after(5) == handles_after(40)


class _ByHandKeepsRefs(nn.Module):
    """Attention written by hand whose Q and K are made inside its forward; it keeps weak references to them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(E, dim=-1)
        self.refs = [weakref.ref(q), weakref.ref(k)]
        return (q @ k.transpose(-2, -1) / math.sqrt(E)).softmax(-1) @ v


def test_a_watched_call_that_ended_holds_none_of_its_tensors() -> None:
    """While the trace stays open, the Q and K a watched call made (followed from its scores to its output) are
    freed once the call has returned and its output is dropped. Witness: Python's weak references to them, taken by
    the module itself, and the call's record (the attention was recognised)."""
    torch.manual_seed(0)
    model, x = _ByHandKeepsRefs(), torch.randn(B, T, E)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        out = model(x)
        del out
        gc.collect()
        alive = [r() is not None for r in model.refs]
    assert [c.path for c in t.calls] == ["hand_written"]
    assert alive == [False, False]


class _OwnSdpa(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


def test_another_threads_sdpa_call_does_not_count_for_a_module_being_checked() -> None:
    """Witness: the kind of attention each call was written with (set here), and the order of the two threads,
    set here with events: while the switched module's first call in a trace is paused inside its forward,
    another thread's model makes an SDPA call. That call is not this module's: the module is watched again,
    and its later calls written by hand are recorded."""
    torch.manual_seed(0)
    model, other, x = _SwitchableAttention(), _OwnSdpa(), torch.randn(B, T, E)
    paused, resumed = threading.Event(), threading.Event()
    projection = model.qkv.forward

    def pausing(inp: torch.Tensor) -> torch.Tensor:
        if not paused.is_set():
            paused.set()
            assert resumed.wait(10)
        return projection(inp)

    with torch.no_grad():
        with qkvtrace.trace(model):
            model(x)  # an SDPA user now
            model(x)  # (in a layout seen before: not watched for its rows in the next trace)
        model.by_hand = True
        model.qkv.forward = pausing  # type: ignore[method-assign]
        with qkvtrace.trace(model, threads="all") as t, qkvtrace.trace(other, threads="all") as o:
            first = threading.Thread(target=model, args=(x,))
            first.start()
            assert paused.wait(10)
            second = threading.Thread(target=other, args=(torch.randn(B, H, T, D),))
            second.start()
            second.join()
            resumed.set()
            first.join()
            model(x)
            model(x)
    assert [c.path for c in o.calls] == ["sdpa"]
    assert [c.path for c in t.calls] == ["hand_written"] * 2
    assert any("(root) made a call that reached none" in w for w in t.result.warnings)


_CHECKED_THEN_COUNTED = """
import contextlib, sys, torch
sys.path.insert(0, sys.argv[1])
import qkvtrace
from test_hand_written_watch import B, D, E, H, T, _OwnSdpa, _SwitchableAttention

torch.manual_seed(0)
plain, user, q, x = _OwnSdpa(), _SwitchableAttention(), torch.randn(B, H, T, D), torch.randn(B, T, E)

def functions_in_a_call():
    ran = 0
    def count(frame, event, arg):
        nonlocal ran
        if event == "call" and "qkvtrace" in frame.f_code.co_filename:
            ran += 1
    with qkvtrace.trace(plain):
        plain(q)
        sys.setprofile(count)
        try:
            plain(q)
        finally:
            sys.setprofile(None)
    return ran

with torch.no_grad():
    functions_in_a_call()  # (the model's first trace: what later traces keep of it is made here)
    before = functions_in_a_call()
    for fail in (False, False, True):
        user.fail = fail
        with qkvtrace.trace(user), contextlib.suppress(RuntimeError):
            user(x)
    print(before, functions_in_a_call())
"""


def test_a_checked_module_leaves_the_wrappers_as_they_were() -> None:
    """Witness: the interpreter's profile hook (``sys.setprofile``), counting calls of qkvtrace's functions in one
    traced SDPA call of a model with nothing to watch, before and after another model's SDPA user was checked
    (its first call of a trace), the last time with a call that raised while it was checked. In a fresh
    interpreter, so that no other test's modules were checked before."""
    done = subprocess.run([sys.executable, "-c", _CHECKED_THEN_COUNTED, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert after == before
