"""Which module a model's own SDPA call belongs to: the innermost module on the Python stack that the trace covers.

The witness is the model written here: each test knows, by construction, which
module's code made each call (a forward behind a decorator that keeps no
reference to it, a method called directly, a forward set on the module
itself), and how many calls each made. A module outside the traced model
makes calls no trace records.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

B, H, T, D = 2, 2, 4, 8


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that keeps no ``__wrapped__``: the class holds only this wrapper's code."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


def _kept(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that keeps ``__wrapped__`` (``functools.wraps``)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


class _Hidden(nn.Module):
    @_opaque
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


class _Wrapped(nn.Module):
    @_kept
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


class _Helper(nn.Module):
    """Its SDPA call is made in a method of its own, behind a decorator that keeps ``__wrapped__``, that its holder
    calls directly (not its forward)."""

    @_kept
    def attend(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _own_forward(self: nn.Module, q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = _Hidden()
        self.wrapped = _Wrapped()
        self.helper = _Helper()
        self.own = nn.Module()
        self.own.forward = types.MethodType(_own_forward, self.own)  # type: ignore[method-assign]

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = self.hidden(q)
        q = self.wrapped(q)
        q = self.helper.attend(q)
        return self.own.forward(q)  # (not through ``__call__``: only its own frame names it)


def test_each_call_belongs_to_the_module_whose_code_made_it() -> None:
    """Witness: the model written here (which module's code makes each of its four SDPA calls) and a module
    outside the traced model whose calls belong to no trace."""
    torch.manual_seed(0)
    model, outside, q = _Holder(), _Wrapped(), torch.randn(B, H, T, D)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(q)
        outside(q)
        model(q)
    assert [c.module for c in t.calls] == ["hidden", "wrapped", "helper", "own"] * 2
    assert [c.inputs["is_causal"] for c in t.calls] == [False, False, True, False] * 2


def test_a_call_outside_the_traced_model_is_nobodys_in_a_deep_stack() -> None:
    """Witness: the modules written here. The traced model is one module; the other model, run many modules deep
    inside a wrapper of its own, makes calls no trace records; the traced module's calls in between are
    recorded."""

    class Deep(nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.inner = Deep(depth - 1) if depth else _Wrapped()

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return self.inner(q)

    torch.manual_seed(0)
    traced, other, q = _Wrapped(), Deep(12), torch.randn(B, H, T, D)
    with torch.no_grad(), qkvtrace.trace(traced) as t:
        for _ in range(3):
            other(q)
            traced(q)
    assert [c.module for c in t.calls] == [""] * 3


def test_a_forward_replaced_on_its_class_between_traces_is_its_modules() -> None:
    """Witness: the model written here, whose module's class gets a new forward between two traces; the holder
    calls that forward directly (not through ``__call__``), so only its own frame names the module."""

    class Swapped(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q)

    class Holds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.swapped = Swapped()

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return self.swapped.forward(q)

    def causal(self: nn.Module, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch.manual_seed(0)
    model, q = Holds(), torch.randn(B, H, T, D)
    with torch.no_grad():
        with qkvtrace.trace(model) as before:
            model(q)
        Swapped.forward = causal  # type: ignore[method-assign]
        with qkvtrace.trace(model) as after:
            model(q)
    assert [(c.module, c.inputs["is_causal"]) for c in before.calls + after.calls] == [("swapped", False),
                                                                                       ("swapped", True)]
