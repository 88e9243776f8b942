"""A decoding loop: each step's keys are one longer, and each step's record is its own.

Eager decoding with a cache hands SDPA, at every step, the same query shape
and keys one token longer. A call whose keys only grew is taken by its
module's slot (:func:`qkvtrace.tracer.observers.sdpa.grown`): PyTorch is asked
again what may depend on the length (the backend, its refusals, the rows of
the call's layout), and the call's own shapes and fully-masked rows are
kept. These tests hold those records to the records built in full, and to
what SDPA itself received, counted by the test's own function mode on the
untraced run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_again import _HAS_GQA, _same_with_and_without
from torch import nn
from torch.overrides import TorchFunctionMode

import qkvtrace
from qkvtrace.tracer.observers import sdpa as sdpa_observer


class Decoder(nn.Module):
    """Attention with its own KV cache: each call's keys and values are joined to the cache's (``torch.cat``: a
    contiguous tensor, one step longer). ``static``: the cache is a buffer of ``static`` positions, written in
    place, and the kernel gets the view of its filled part (strided: not contiguous until it is full).
    ``window``: only the last ``window`` keys are attended (the view is not contiguous from its storage's start)."""

    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 2, causal: bool = False,
                 static: int | None = None, window: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.head = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.head)
        self.causal, self.static, self.window = causal, static, window
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.filled = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        if self.static is not None:
            if self.cache is None:
                self.cache = (x.new_zeros(b, self.kv_heads, self.static, self.head),) * 2
                self.cache = (self.cache[0], self.cache[1].clone())
            ck, cv = self.cache
            with torch.no_grad():
                ck[:, :, self.filled : self.filled + t] = k
                cv[:, :, self.filled : self.filled + t] = v
            self.filled += t
            k, v = ck[:, :, : self.filled], cv[:, :, : self.filled]
        else:
            if self.cache is not None:
                k, v = torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2)
            self.cache = (k.detach(), v.detach())
        if self.window is not None:
            k, v = k[:, :, -self.window :], v[:, :, -self.window :]
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and t > 1, **gqa)


def _decoding(grad: bool = False, **options: Any) -> Callable[[], tuple[nn.Module, Callable[[nn.Module, int], Any]]]:
    """A plan: a prompt of five tokens, then one token a step, under ``no_grad`` unless ``grad``."""

    def make() -> tuple[nn.Module, Callable[[nn.Module, int], Any]]:
        model = Decoder(**options)
        if not _HAS_GQA:
            model = Decoder(**{**options, "kv_heads": 4})
        tokens = torch.randn(1, 5 + 12, 16)

        def step(m: nn.Module, i: int) -> Any:
            x = tokens[:, :5] if i == 0 else tokens[:, 4 + i : 5 + i]
            with torch.enable_grad() if grad else torch.no_grad():
                return m(x).detach()

        return model, step

    return make


class _Grown:
    """How many calls :func:`~qkvtrace.tracer.observers.sdpa.grown` found to be a slot's call with longer keys."""

    def __init__(self) -> None:
        self.taken = 0
        self._real = sdpa_observer.grown

    def __call__(self, before: Any, key: Any) -> bool:
        found = self._real(before, key)
        self.taken += found
        return found


_PLANS = {
    "cat": {},
    "cat causal prompt": {"causal": True},
    "cat with gradients": {"grad": True},
    "static buffer": {"static": 24},
    "sliding window": {"window": 6},
}


@pytest.mark.parametrize("plan", list(_PLANS))
def test_a_decoding_loops_records_equal_records_built_in_full(plan: str) -> None:
    """Witness: the same loop traced with every shortcut switched off (each record built field by field from the
    call), and ``torch.equal`` on the outputs. A cache joined with ``torch.cat`` grows contiguous keys: its steps
    after the first one-token step are taken as grown (counted); a static buffer's filled part and a sliding
    window are views whose strides or offset say more than their length: never taken as grown."""
    options = dict(_PLANS[plan])
    grad = bool(options.pop("grad", False))
    grown = _Grown()
    with mock.patch.object(sdpa_observer, "grown", grown):
        found = _same_with_and_without(_decoding(grad, **options), 12)
    calls = found["calls"]
    assert [c["inputs"]["key_shape"][-2] for c in calls] == [min(n, options.get("window") or n)
                                                             for n in range(5, 17)]  # fmt: skip
    if plan.startswith("cat"):
        assert grown.taken >= 9, grown.taken  # (the prompt, the first one-token step, then grown)
    else:
        assert grown.taken == 0


class _Received(TorchFunctionMode):
    """The test's own witness: the shapes of Q, K and V each SDPA call receives, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[list[list[int]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.shapes.append([list(t.shape) for t in args[:3]])
        return func(*args, **(kwargs or {}))


def test_a_generate_loops_records_say_what_each_step_received() -> None:
    """Witness: a function mode of the test's own, on the untraced ``generate`` of transformers' Llama with its
    dynamic cache, noting the shapes of the Q, K and V of every SDPA call; and the untraced tokens. The traced
    run gives the same tokens, one record per call with those shapes, rows on every call (the attention
    module's own ``q_proj``, ``k_proj`` and ``v_proj``), and its steps after the first were
    taken as grown."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 64, (1, 6))
    kwargs = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    witness = _Received()
    with witness:
        plain = model.generate(prompt, **kwargs)
    grown = _Grown()
    with mock.patch.object(sdpa_observer, "grown", grown), qkvtrace.trace(model) as t:
        out = model.generate(prompt, **kwargs)
    assert torch.equal(out, plain)
    records = [[c.inputs["query_shape"], c.inputs["key_shape"], c.inputs["value_shape"]] for c in t.calls]
    assert records == witness.shapes
    assert [c.inputs["key_shape"][-2] for c in t.calls[::2]] == list(range(6, 16))
    for c in t.calls:
        assert c.module.startswith("model.layers.") and c.qkv.holder is None, c.qkv.reason  # (the module's own)
        assert [c.qkv.q.param, c.qkv.k.param, c.qkv.v.param] == [f"{p}_proj.weight" for p in "qkv"]
    assert grown.taken >= 2 * 8


def test_a_long_runs_grown_calls_are_counted() -> None:
    """Witness: the test's own count of SDPA calls of the untraced loop (its function mode) and its own count of
    NaNs in their outputs (a NaN put into the token of step 7 makes NaN outputs from then on: every later step
    attends to its key): a long run counts every call of the loop, grown ones included, with each call's NaNs."""
    tokens = torch.randn(1, 17, 16)
    tokens[0, 4 + 7, 3] = float("nan")

    def run(model: nn.Module) -> int:
        nans = 0
        with torch.no_grad():
            for i in range(12):
                nans += int(torch.isnan(model(tokens[:, :5] if i == 0 else tokens[:, 4 + i : 5 + i])).sum())
        return nans

    torch.manual_seed(0)
    witness = _Received()
    with witness:
        expected = run(Decoder(kv_heads=4))
    assert expected > 0 and len(witness.shapes) == 12
    torch.manual_seed(0)
    model = Decoder(kv_heads=4)
    grown = _Grown()
    with mock.patch.object(sdpa_observer, "grown", grown), qkvtrace.trace(model, keep="changes") as t:
        assert run(model) == expected
    module = t.summary()["modules"][""]
    assert sum(c["calls"] for c in module["combinations"]) == 12
    assert module["nan_count"] == expected
    assert grown.taken >= 9


def test_a_grown_step_whose_backend_changes_is_recorded_with_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: PyTorch's backend selection, wrapped by the test to answer MATH once the keys are longer than 8
    (as a build whose choice depends on the length would, e.g. a kernel with a bound on the sequence): the
    test's own list of what the selection answered for each step's arguments. Each record names its step's
    answer: a grown step whose answer is not its slot's is recorded in full."""
    real = torch._fused_sdp_choice
    math = int(torch.nn.attention.SDPBackend.MATH)
    answered: list[int] = []

    def selection(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> int:
        found = math if k.shape[-2] > 8 else real(q, k, *args, **kwargs)
        if k.shape[-2] >= 5:  # (the kernel's calls, not the probes of PyTorch's refusals)
            answered.append(found)
        return found

    monkeypatch.setattr(torch, "_fused_sdp_choice", selection)
    torch.manual_seed(0)
    model, step = _decoding()()
    with qkvtrace.trace(model, refusals=False) as t:
        for i in range(12):
            step(model, i)
    backends = [c.sdpa_backend for c in t.calls]
    assert backends[4:] == ["MATH"] * 8  # (keys of 9 to 16)
    assert len(set(backends[:4])) == 1 and backends[0] != "MATH"  # (keys of 5 to 8: the real selection's)
    assert len(answered) >= 12
