"""Property: over the whole argument space, a traced call does exactly what the untraced call does.

Hypothesis draws modules and calls of ``nn.MultiheadAttention``,
``F.scaled_dot_product_attention`` (through ``F.`` and through a name bound
before any trace), ``nn.TransformerEncoderLayer``/``nn.TransformerEncoder``
and FlexAttention -- valid calls and calls PyTorch refuses (masks of wrong
sizes, is_causal without a mask, ...). Each is run twice from the same
random state: untraced (the witness) and inside ``qkvtrace.trace`` of the
module that makes it. The outcomes must be the same exception type and
message, or outputs equal bit for bit (NaN where the untraced output has
NaN), and the same random state afterwards.

The default run draws a fixed set of examples (``derandomize``); ``-m slow``
draws a larger random set.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name  # bound before any trace

import qkvtrace

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
given, settings, HealthCheck = hypothesis.given, hypothesis.settings, hypothesis.HealthCheck

FAST = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
LARGE = settings(max_examples=600, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "grad": lambda: torch.enable_grad(),
    "no_grad": lambda: torch.no_grad(),
    "inference_mode": lambda: torch.inference_mode(),
}


def _outcome(call: Callable[[], Any]) -> tuple[str, Any, torch.Tensor]:
    torch.manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result: tuple[str, Any] = ("returned", call())
        except Exception as exc:
            result = ("raised", (type(exc), str(exc)))
    return result[0], result[1], torch.get_rng_state()


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _dense(t: torch.Tensor) -> torch.Tensor:
    if t.is_nested:
        return torch.cat([x.reshape(-1) for x in t.unbind()])
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


def assert_same_outcome(model: nn.Module, call: Callable[[], Any], unrelated: bool = False) -> None:
    """Untraced (the witness), then traced: same exception, or the same values bit for bit.

    ``unrelated``: the open trace is of another model (every wrapper installed,
    this call's module not traced), as when any code in the process opened one.
    """
    plain = _outcome(call)
    with qkvtrace.trace(nn.Linear(1, 1) if unrelated else model):
        traced = _outcome(call)
    _assert_same(plain, traced)


def _assert_same(plain: tuple[str, Any, torch.Tensor], traced: tuple[str, Any, torch.Tensor]) -> None:
    """The same exception, or the same values bit for bit; and the same random state after."""
    assert plain[0] == traced[0], f"untraced {plain[0]} {plain[1]!r}; traced {traced[0]} {traced[1]!r}"
    if plain[0] == "raised":
        assert plain[1] == traced[1]
    else:
        a, b = list(_flat(plain[1])), list(_flat(traced[1]))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor)
                torch.testing.assert_close(_dense(y), _dense(x), rtol=0, atol=0, equal_nan=True)
            else:
                assert x == y
    assert torch.equal(plain[2], traced[2]), "the random state after the call differs"


# -- nn.MultiheadAttention -----------------------------------------------------------------


class SelfOrCross(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = mha

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.attn(*args, **kwargs)


def _mask(draw: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    blocked = torch.rand(shape, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    if dtype == "bool":
        return blocked
    return torch.zeros(shape).masked_fill(blocked, float("-inf"))


@st.composite
def mha_cases(draw: Any) -> tuple[nn.Module, Callable[[], Any]]:
    e = 8
    heads = draw(st.sampled_from([1, 2, 4]))
    separate = draw(st.booleans())
    kdim = vdim = 6 if separate else None
    batch_first = draw(st.booleans())
    mha = nn.MultiheadAttention(e, heads, dropout=draw(st.sampled_from([0.0, 0.5])), bias=draw(st.booleans()),
                                add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()),
                                kdim=kdim, vdim=vdim, batch_first=batch_first)  # fmt: skip
    mha.train(draw(st.booleans()))
    batched = draw(st.booleans())
    b, lq, s = 2, draw(st.integers(1, 4)), draw(st.integers(1, 4))
    self_attention = not separate and lq == s and draw(st.booleans())

    def seq(length: int, width: int, seed: int) -> torch.Tensor:
        x = torch.randn(b, length, width, generator=torch.Generator().manual_seed(seed))
        if not batched:
            return x[0]
        return x if batch_first else x.transpose(0, 1)

    q = seq(lq, e, 1)
    k = q if self_attention else seq(s, kdim or e, 2)
    v = q if self_attention else seq(s, vdim or e, 3)
    extra = draw(st.sampled_from([0, 0, 0, 1]))  # a wrong size, now and then
    attn_mask = None
    if draw(st.booleans()):
        dims = draw(st.sampled_from(["2d", "3d"]))
        shape = (lq + extra, s) if dims == "2d" else (b * heads if batched else heads, lq, s + extra)
        attn_mask = _mask(draw, draw(st.sampled_from(["bool", "float"])), shape)
    kpm = None
    if draw(st.booleans()):
        kpm = _mask(draw, draw(st.sampled_from(["bool", "float"])), (b, s + extra) if batched else (s + extra,))
    kwargs = {"key_padding_mask": kpm, "attn_mask": attn_mask, "need_weights": draw(st.booleans()),
              "average_attn_weights": draw(st.booleans()), "is_causal": draw(st.booleans())}  # fmt: skip
    grad = GRAD_MODES[draw(st.sampled_from(sorted(GRAD_MODES)))]
    model = SelfOrCross(mha)

    def call() -> Any:
        with grad():
            return model(q, k, v, **kwargs)

    return model, call


@FAST
@given(mha_cases(), st.booleans())
def test_multihead_attention_traced_equals_untraced(case: tuple[nn.Module, Callable[[], Any]], unrelated: bool) -> None:
    """Witness: the untraced call (outcome, values, random state)."""
    assert_same_outcome(*case, unrelated=unrelated)


# -- F.scaled_dot_product_attention ---------------------------------------------------------

CALLERS: dict[str, Callable[..., Any]] = {
    "attribute": lambda *a, **k: F.scaled_dot_product_attention(*a, **k),
    "by_name": lambda *a, **k: sdpa_by_name(*a, **k),
}


class Owner(nn.Module):
    """A module that makes the SDPA call (so the trace records it)."""

    def __init__(self, caller: Callable[..., Any]) -> None:
        super().__init__()
        self.caller = caller

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.caller(*args, **kwargs)


@st.composite
def sdpa_cases(draw: Any) -> tuple[nn.Module, Callable[[], Any]]:
    b, hkv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    hq = hkv * (draw(st.sampled_from([1, 2])) if gqa else 1)
    lq, s, d = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.sampled_from([4, 8]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    requires_grad = draw(st.booleans())
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(requires_grad)
               for h, n in ((hq, lq), (hkv, s), (hkv, s)))  # fmt: skip
    kind = draw(st.sampled_from(["none", "bool", "float", "causal_upper_left", "causal_lower_right"]))
    attn_mask: Any = None
    if kind in ("bool", "float"):
        shape = (*(draw(st.sampled_from([full, 1])) for full in (b, hq, lq)), s)
        if draw(st.sampled_from([False, False, False, True])):  # a shape that does not broadcast
            shape = (*shape[:-1], s + 1)
        shape = shape[draw(st.integers(0, 2)) :]  # fewer leading dimensions
        attn_mask = _mask(draw, kind, shape)
        if kind == "float":
            attn_mask = attn_mask.to(dtype)
    elif kind != "none":
        make = causal_upper_left if kind == "causal_upper_left" else causal_lower_right
        attn_mask = make(lq + draw(st.sampled_from([0, 0, 0, 1])), s)
    kwargs: dict[str, Any] = {"attn_mask": attn_mask, "is_causal": draw(st.booleans()),
                              "dropout_p": draw(st.sampled_from([0.0, 0.0, 0.4]))}  # fmt: skip
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.sampled_from([0.1, 1.0]))
    if gqa:
        kwargs["enable_gqa"] = True
    model = Owner(CALLERS[draw(st.sampled_from(sorted(CALLERS)))])
    grad = GRAD_MODES[draw(st.sampled_from(sorted(GRAD_MODES)))]

    def call() -> Any:
        with grad():
            return model(q, k, v, **kwargs)

    return model, call


@FAST
@given(sdpa_cases(), st.booleans())
def test_sdpa_traced_equals_untraced(case: tuple[nn.Module, Callable[[], Any]], unrelated: bool) -> None:
    """Witness: the untraced call (outcome, values, random state), through ``F.`` and a name bound before."""
    assert_same_outcome(*case, unrelated=unrelated)


# -- the encoder layer and encoder -------------------------------------------------------------


@st.composite
def encoder_cases(draw: Any) -> tuple[nn.Module, Callable[[], Any]]:
    e, heads, b, length = 8, draw(st.sampled_from([1, 2])), 2, draw(st.integers(1, 5))
    batch_first = draw(st.booleans())
    layer = nn.TransformerEncoderLayer(e, heads, 16, dropout=draw(st.sampled_from([0.0, 0.3])),
                                       batch_first=batch_first, norm_first=draw(st.booleans()))  # fmt: skip
    stacked = draw(st.booleans())
    model: nn.Module = (
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=draw(st.booleans())) if stacked else layer
    )
    model.train(draw(st.booleans()))
    x = torch.randn(b, length, e, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if not batch_first:
        x = x.transpose(0, 1)
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        kpm = torch.zeros(b, length, dtype=torch.bool)
        kpm[0, draw(st.integers(0, length - 1)) :] = True
        kwargs["src_key_padding_mask"] = kpm
    mask_kind = draw(st.sampled_from(["none", "causal", "bool"]))
    if mask_kind == "causal":
        kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(length)
        kwargs["is_causal"] = draw(st.booleans())
    elif mask_kind == "bool":
        kwargs["mask"] = torch.rand(length, length, generator=torch.Generator().manual_seed(5)) < 0.3
    if not stacked and "mask" in kwargs:
        kwargs["src_mask"] = kwargs.pop("mask")
    grad = GRAD_MODES[draw(st.sampled_from(sorted(GRAD_MODES)))]

    def call() -> Any:
        with grad():
            return model(x, **kwargs)

    return model, call


@FAST
@given(encoder_cases(), st.booleans())
def test_encoder_traced_equals_untraced(case: tuple[nn.Module, Callable[[], Any]], unrelated: bool) -> None:
    """Witness: the untraced call (outcome, values -- nested outputs included --, random state)."""
    assert_same_outcome(*case, unrelated=unrelated)


# -- FlexAttention -----------------------------------------------------------------------------


def _flex() -> Any:
    module = pytest.importorskip("torch.nn.attention.flex_attention")
    return module.flex_attention


def _causal_score(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


@st.composite
def flex_cases(draw: Any) -> tuple[nn.Module, Callable[[], Any]]:
    flex = _flex()
    lq, s = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (lq, s, s))
    kwargs = {"score_mod": _causal_score} if draw(st.booleans()) else {}
    model = Owner(flex)

    def call() -> Any:
        with torch.no_grad():
            return model(q, k, v, **kwargs)

    return model, call


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(flex_cases())
def test_flex_traced_equals_untraced(case: tuple[nn.Module, Callable[[], Any]]) -> None:
    """Witness: the untraced call (outcome, values, random state)."""
    assert_same_outcome(*case)


# -- the larger budget ---------------------------------------------------------------------------


@pytest.mark.slow
@LARGE
@given(st.one_of(mha_cases(), sdpa_cases(), encoder_cases()), st.booleans())
def test_every_entry_point_traced_equals_untraced_large(
    case: tuple[nn.Module, Callable[[], Any]], unrelated: bool
) -> None:
    """Witness: the untraced call; a larger random draw over all three spaces."""
    assert_same_outcome(*case, unrelated=unrelated)


# -- with the trace's options, backward, and attention written by hand ----------------------------


class HandWritten(nn.Module):
    """Attention written by hand, as eager models do: packed projection, ``softmax(q kᵀ · scale + mask) v``."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.qkv, self.heads, self.drop = nn.Linear(d, 3 * d), heads, nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))  # (B, H, T, D)
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        if blocked is not None:
            scores = scores.masked_fill(blocked, float("-inf"))
        return (self.drop(scores.softmax(dim=-1)) @ v).transpose(1, 2).reshape(b, t, d)


@st.composite
def hand_written_cases(draw: Any) -> tuple[nn.Module, Callable[[], Any]]:
    b, t, heads = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.sampled_from([1, 2]))
    model = HandWritten(8, heads, draw(st.sampled_from([0.0, 0.3])))
    model.train(draw(st.booleans()))
    k = draw(st.integers(1, 10_000))  # inputs spread over [-1, 1] differently for each k
    x = torch.sin(torch.arange(b * t * 8, dtype=torch.float32) * (0.618 * k)).view(b, t, 8)
    blocked = None
    if draw(st.booleans()):
        blocked = torch.ones(t, t, dtype=torch.bool).triu(1) if draw(st.booleans()) else _mask(draw, "bool", (t, t))
    grad = GRAD_MODES[draw(st.sampled_from(sorted(GRAD_MODES)))]

    def call() -> Any:
        with grad():
            return model(x, blocked)

    return model, call


def _with_backward(model: nn.Module, call: Callable[[], Any]) -> Callable[[], Any]:
    """The call, then a backward pass of a fixed weighting of its outputs: the outputs and every parameter's
    .grad (None where none reached it)."""

    def run() -> Any:
        for p in model.parameters():
            p.grad = None
        out = call()
        leaves = [t for t in _flat(out) if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_nested]
        if leaves:
            loss = sum((t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).nansum() for t in leaves)
            loss.backward()  # type: ignore[union-attr]
        return out, [p.grad for p in model.parameters()]

    return run


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(st.one_of(mha_cases(), encoder_cases(), hand_written_cases()), st.booleans(),
       st.sampled_from(["all", "changes"]))  # fmt: skip
def test_traced_with_maps_long_run_and_backward_equals_untraced(
    case: tuple[nn.Module, Callable[[], Any]], maps: bool, keep: str
) -> None:
    """Witness: the untraced call and its backward pass (outcome, outputs, every parameter's gradient, random
    state) against the same inside a trace with ``attention_maps`` and ``keep="changes"`` drawn; MHA, encoder
    layers and attention written by hand."""
    model, call = case
    run = _with_backward(model, call)
    plain = _outcome(run)
    with qkvtrace.trace(model, attention_maps=maps, keep=keep):
        traced = _outcome(run)
    _assert_same(plain, traced)
