"""An open trace changes no call made anywhere in the process, whichever name the caller used.

Code that imported ``scaled_dot_product_attention`` by name before a trace
opened calls PyTorch's builtin directly, while ``F.scaled_dot_product_attention``
is the tracer's wrapper: every ``__torch_function__`` override must still
take the branch it takes without a trace. This module binds the name at
import time -- before any trace of the test session opens -- as any user
module does.

Witness throughout: the same call made with no trace open (PyTorch's own
result, exception, or the branch the override itself reports).
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name  # bound before any trace

import qkvtrace

CALLERS: dict[str, Callable[..., Any]] = {
    "by_name": lambda *a, **k: sdpa_by_name(*a, **k),
    "attribute": lambda *a, **k: F.scaled_dot_product_attention(*a, **k),
}


def _qkv(lq: int = 23, lk: int = 56, heads: int = 2, d: int = 15) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, n, d, generator=g) for n in (lq, lk, lk))


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "returned", fn()
    except Exception as exc:
        return "raised", (type(exc), str(exc))


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> None:
    assert a[0] == b[0], f"untraced {a[0]} {a[1]!r}, traced {b[0]} {b[1]!r}"
    if a[0] == "raised":
        assert a[1] == b[1]
    else:
        x, y = a[1].as_subclass(torch.Tensor), b[1].as_subclass(torch.Tensor)  # NaN where PyTorch gives NaN
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("shapes", [(23, 56), (56, 23), (7, 7)], ids=["wide", "tall", "square"])
def test_causal_bias_same_result_with_an_idle_trace_open(caller: str, make: Any, shapes: tuple[int, int]) -> None:
    """CausalBias through either name (PyTorch's issue seen in its own TestAttnBiasCPU): witness, the untraced call."""
    q, k, v = _qkv(*shapes)
    call = CALLERS[caller]
    plain = _outcome(lambda: call(q, k, v, attn_mask=make(*shapes)))
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = _outcome(lambda: call(q, k, v, attn_mask=make(*shapes)))
    assert plain[0] == "returned"
    _same(plain, traced)


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize(
    "bad",
    [
        {"is_causal": True},  # CausalBias with is_causal=True
        {"mask_size": (10, 56)},  # a CausalBias of another size than the query
        {"dropout_p": 0.5, "mask_size": (23, 55)},
    ],
    ids=["is_causal", "wrong_size", "dropout_wrong_size"],
)
def test_causal_bias_refused_calls_raise_pytorchs_exception(caller: str, bad: dict[str, Any]) -> None:
    """Invalid CausalBias calls: the exception type and message of the untraced call (the witness)."""
    q, k, v = _qkv()
    call = CALLERS[caller]
    size = bad.get("mask_size", (23, 56))
    extra = {k2: v2 for k2, v2 in bad.items() if k2 != "mask_size"}

    def attend() -> Any:
        torch.manual_seed(0)
        return call(q, k, v, attn_mask=causal_lower_right(*size), **extra)

    plain = _outcome(attend)
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = _outcome(attend)
    _same(plain, traced)


class ByName(nn.Module):
    """A model whose module bound SDPA by name before the trace (this test module's own global), passing the mask
    by keyword or in its place."""

    def __init__(self, positional: bool = False) -> None:
        super().__init__()
        self.positional = positional

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        if self.positional:
            return sdpa_by_name(q, k, v, mask)
        return sdpa_by_name(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("passed", ["keyword", "positional"])
@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
def test_traced_model_calling_by_name_with_causal_bias(make: Any, passed: str) -> None:
    """A traced model's by-name call with CausalBias (the mask by keyword, or fourth in place): output equal to
    the untraced call, and recorded once.

    Witness: the same model's untraced call, and the one CausalBias call the test makes.
    """
    q, k, v = _qkv()
    model = ByName(positional=passed == "positional")
    plain = model(q, k, v, make(23, 56))
    with qkvtrace.trace(model) as t:
        traced = model(q, k, v, make(23, 56))
    assert torch.equal(plain, traced)
    assert [c.path for c in t.calls] == ["sdpa"]
    assert t.calls[0].inputs["attn_mask"]["kind"] == "CausalBias"


def _jagged(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, 2, 8, generator=g) for n in (3, 5)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)


class Jagged(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("who", ["unrelated_trace", "traced_model"])
def test_jagged_nested_sdpa_with_a_trace_open(who: str) -> None:
    """Jagged nested tensors: ``torch.nested`` dispatches on ``func is torch._C._nn.scaled_dot_product_attention``.

    Witness: the untraced call's values. (Handing overrides the wrapper made
    PyTorch raise "If inputs are nested tensors they must be contiguous".)
    """
    q, k, v = _jagged(0), _jagged(1), _jagged(2)
    model = Jagged()
    plain = model(q, k, v)
    with qkvtrace.trace(model if who == "traced_model" else nn.Linear(1, 1)) as t:
        traced = model(q, k, v)
    assert torch.equal(plain.values(), traced.values())
    if who == "traced_model":
        assert [c.path for c in t.calls] == ["sdpa"]


# -- overrides that keep tables or compare at call time ------------------------------------

#: built at import, before any trace, as libraries build their dispatch tables
_TABLE = {torch.nn.functional.scaled_dot_product_attention: "sdpa"}


class TableLookup(torch.Tensor):
    """An override that looks ``func`` up in a table built at import time."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(_TABLE.get(func, "other"))
        return super().__torch_function__(func, types, args, kwargs)


class CallTimeCompare(torch.Tensor):
    """An override that compares ``func`` with the attribute when it runs (as CausalBias does)."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append("sdpa" if func is torch.nn.functional.scaled_dot_product_attention else "other")
        return super().__torch_function__(func, types, args, kwargs)


@functools.cache
def _cached_kind(func: Any) -> str:
    return "sdpa" if func is torch.nn.functional.scaled_dot_product_attention else "other"


class CachedKind(torch.Tensor):
    """An override whose answer is a ``functools.cache`` keyed by ``func`` (first filled untraced)."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(_cached_kind(func))
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("cls", [TableLookup, CallTimeCompare, CachedKind], ids=lambda c: c.__name__)
def test_user_overrides_take_the_untraced_branch(caller: str, cls: Any) -> None:
    """Each override reports the branch it took; witness: the branch (and output) of the untraced call."""
    q, k, v = _qkv(4, 6)
    call = CALLERS[caller]
    cls.seen.clear()
    plain = call(q.as_subclass(cls), k, v)
    untraced_seen = list(cls.seen)
    cls.seen.clear()
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = call(q.as_subclass(cls), k, v)
    assert untraced_seen[0] == "sdpa"
    assert cls.seen[: len(untraced_seen)] == untraced_seen
    assert torch.equal(plain.as_subclass(torch.Tensor), traced.as_subclass(torch.Tensor))


class CallTimeMode(torch.overrides.TorchFunctionMode):
    """A user's function mode that compares ``func`` with the attribute when it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append("sdpa" if func is torch.nn.functional.scaled_dot_product_attention else "other")
        return func(*args, **(kwargs or {}))


class TableMode(torch.overrides.TorchFunctionMode):
    """A user's function mode that looks ``func`` up in a table built at import time."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(_TABLE.get(func, "other"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("mode_type", [CallTimeMode, TableMode], ids=lambda c: c.__name__)
def test_user_function_mode_sees_what_it_sees_untraced(caller: str, mode_type: Any) -> None:
    """Witness: what the mode records for the untraced call ("sdpa" first), and the untraced output."""
    q, k, v = _qkv(4, 6)
    call = CALLERS[caller]
    with mode_type() as mode:
        plain = call(q, k, v)
    with qkvtrace.trace(nn.Linear(1, 1)), mode_type() as traced_mode:
        traced = call(q, k, v)
    assert mode.seen[:1] == ["sdpa"]
    assert traced_mode.seen[:1] == mode.seen[:1]
    assert torch.equal(plain, traced)


def test_override_class_defined_while_a_trace_is_open() -> None:
    """A subclass defined inside the trace, called through ``F.``: witness, the same class's untraced branch."""
    q, k, v = _qkv(4, 6)
    with qkvtrace.trace(nn.Linear(1, 1)):

        class Late(torch.Tensor):
            seen: ClassVar[list[str]] = []

            @classmethod
            def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                cls.seen.append("sdpa" if func is torch.nn.functional.scaled_dot_product_attention else "other")
                return super().__torch_function__(func, types, args, kwargs)

        traced = F.scaled_dot_product_attention(q.as_subclass(Late), k, v)
        traced_seen = list(Late.seen)
    Late.seen.clear()
    plain = F.scaled_dot_product_attention(q.as_subclass(Late), k, v)
    assert traced_seen[:1] == Late.seen[:1] == ["sdpa"]
    assert torch.equal(plain.as_subclass(torch.Tensor), traced.as_subclass(torch.Tensor))


def _compare(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """An override's body that compares ``func`` with the attribute when it runs."""
    cls.seen.append("sdpa" if func is torch.nn.functional.scaled_dot_product_attention else "other")
    return torch.Tensor.__torch_function__.__func__(cls, func, types, args, kwargs)


def _look_up(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """An override's body that looks ``func`` up in a table built at import."""
    cls.seen.append(_TABLE.get(func, "other"))
    return torch.Tensor.__torch_function__.__func__(cls, func, types, args, kwargs)


def _branches(cls: Any) -> tuple[list[str], list[str]]:
    """What ``cls``'s override records for an SDPA call untraced, then inside a trace (that opens then)."""
    q, k, v = _qkv(4, 6)
    cls.seen = []
    plain = F.scaled_dot_product_attention(q.as_subclass(cls), k, v)
    untraced, cls.seen = cls.seen, []
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = F.scaled_dot_product_attention(q.as_subclass(cls), k, v)
    assert torch.equal(plain.as_subclass(torch.Tensor), traced.as_subclass(torch.Tensor))
    return untraced[:1], cls.seen[:1]


def _opened() -> None:
    with qkvtrace.trace(nn.Linear(1, 1)):  # the process's override classes read as they are now
        pass


def test_an_override_given_a_new_torch_function_between_two_traces() -> None:
    """A class read when one trace opened gets a ``__torch_function__`` that compares ``func`` with the attribute
    before the next opens. Witness: its untraced branch ("sdpa")."""

    class Changed(torch.Tensor):
        seen: ClassVar[list[str]] = []

    _opened()
    Changed.__torch_function__ = classmethod(_compare)  # type: ignore[assignment]
    assert _branches(Changed) == (["sdpa"], ["sdpa"])


def test_an_override_defined_between_two_traces() -> None:
    """A class defined after one trace opened and before the next. Witness: its untraced branch ("sdpa")."""
    _opened()

    class Between(torch.Tensor):
        seen: ClassVar[list[str]] = []
        __torch_function__ = classmethod(_compare)  # type: ignore[assignment]

    assert _branches(Between) == (["sdpa"], ["sdpa"])


def test_an_override_in_place_of_one_gone_with_the_very_same_torch_function() -> None:
    """A class freed after one trace and another defined in its place with the very same ``__torch_function__``
    object. Witness: the new class's untraced branch ("sdpa")."""
    shared = classmethod(_compare)
    gc.collect()  # (classes freed only now would move the others)

    class Gone(torch.Tensor):
        seen: ClassVar[list[str]] = []
        __torch_function__ = shared  # type: ignore[assignment]

    gone = weakref.ref(Gone)
    _opened()
    del Gone
    gc.collect()
    assert gone() is None  # (the class is freed: its place among the subclasses is the next one's)

    class Instead(torch.Tensor):
        seen: ClassVar[list[str]] = []
        __torch_function__ = shared  # type: ignore[assignment]

    assert _branches(Instead) == (["sdpa"], ["sdpa"])


def test_an_override_when_the_attribute_was_not_swapped_in_the_trace_before() -> None:
    """A trace that left ``F.scaled_dot_product_attention`` alone (the user had replaced it), then one that swaps it.
    Witness: the comparing class's untraced branch ("sdpa")."""

    class Compares(torch.Tensor):
        seen: ClassVar[list[str]] = []
        __torch_function__ = classmethod(_compare)  # type: ignore[assignment]

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **k)  # a user's own: left alone by the trace
    try:
        _opened()
    finally:
        F.scaled_dot_product_attention = sdpa
    assert _branches(Compares) == (["sdpa"], ["sdpa"])


def test_an_override_that_no_longer_compares_loses_its_shim() -> None:
    """A class shimmed in one trace, its ``__torch_function__`` then replaced by a table lookup: the next traces hand
    it PyTorch's builtin again. Witness: its untraced branch ("sdpa")."""

    class Was(torch.Tensor):
        seen: ClassVar[list[str]] = []
        __torch_function__ = classmethod(_compare)  # type: ignore[assignment]

    _opened()  # shimmed
    Was.__torch_function__ = classmethod(_look_up)  # type: ignore[assignment]
    _opened()  # read again: nothing to shim
    assert _branches(Was) == (["sdpa"], ["sdpa"])


def test_shims_and_wrappers_are_gone_after_the_trace() -> None:
    """After the trace, CausalBias's ``__torch_function__`` is the very object PyTorch defined (identity witness)."""
    from torch.nn.attention.bias import CausalBias

    before = CausalBias.__dict__["__torch_function__"]
    sdpa = F.scaled_dot_product_attention
    with qkvtrace.trace(nn.Linear(1, 1)):
        assert CausalBias.__dict__["__torch_function__"] is not before  # shimmed while open
    assert CausalBias.__dict__["__torch_function__"] is before
    assert F.scaled_dot_product_attention is sdpa is torch._C._nn.scaled_dot_product_attention


def test_pytorch_cached_tables_keep_pytorchs_functions() -> None:
    """``torch.overrides.get_testing_overrides()`` first called inside a trace, in a fresh process.

    Witness: PyTorch's own builtin (``torch._C._nn.scaled_dot_product_attention``)
    must be a key of the cached table after the trace, as it is without one.
    """
    code = textwrap.dedent(
        """
        import torch, torch.nn as nn, qkvtrace
        with qkvtrace.trace(nn.Linear(1, 1)):
            inside = torch.overrides.get_testing_overrides()
        table = torch.overrides.get_testing_overrides()
        print(torch._C._nn.scaled_dot_product_attention in table, inside is table)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]
