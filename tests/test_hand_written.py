"""Attention written by hand is recorded (path ``hand_written``), and recording it changes nothing.

Each form is a module written here the way models write attention: ``@``,
``torch.matmul``, ``bmm``, ``baddbmm``, ``einsum``; ``F.softmax``,
``.softmax``, ``nn.Softmax``; a scale, a soft-cap, ``masked_fill``,
``where``, float masks and biases, a float32 upcast, dropout. The witnesses:

* the probabilities the module computed itself (it keeps them, as a model
  returning ``output_attentions`` does) for the recorded map;
* rows by construction for the Q/K/V slices (one packed ``nn.Linear``: Q is
  rows ``[0, E)``, K ``[E, 2E)``, V ``[2E, 3E)``);
* the scale, soft-cap, mask and bias each form was written with, for what
  the record says of them;
* the same module run without a trace (bit-identical outputs, gradients and
  RNG state) and, for PyTorch's own fast paths next to it, ``torch.profiler``
  on the un-instrumented run;
* a ``TorchDispatchMode`` written here that counts the host reads PyTorch
  performs (``aten::_local_scalar_dense``) while the forward runs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import qkvtrace

E, H, T, B = 16, 2, 5, 2
D = E // H
SCALE = 1 / math.sqrt(D)


def _causal_blocked() -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).triu(1)


def _window_blocked(width: int = 2) -> torch.Tensor:
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    return (j > i) | (i - j >= width)


def _padding_additive() -> torch.Tensor:
    pad = torch.zeros(B, 1, 1, T)
    pad[1, ..., -2:] = torch.finfo(torch.float32).min
    return pad


def _alibi() -> torch.Tensor:
    slopes = torch.tensor([0.5, 0.25]).view(H, 1, 1)
    return (slopes * torch.arange(T).view(1, 1, T)).repeat(B, 1, 1)  # [B*H, 1, T]: slope · key position


def _relative() -> torch.Tensor:
    table = torch.randn(2 * T - 1, generator=torch.Generator().manual_seed(3))
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    return table[j - i + T - 1].view(1, 1, T, T)  # a function of j - i only


def form_at(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    p = (q @ k.transpose(-2, -1) * SCALE).softmax(-1)
    return p @ v, p


def form_matmul_causal(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(_causal_blocked(), float("-inf"))
    p = F.softmax(s, dim=-1)
    return torch.matmul(p, v), p


def form_bmm(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
    p = m.softmax(torch.bmm(q3, k3.transpose(1, 2)) * SCALE)
    return torch.bmm(p, v3).view(B, H, T, D), p


def form_baddbmm_alibi(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
    s = torch.baddbmm(_alibi(), q3, k3.transpose(1, 2), beta=1.0, alpha=SCALE).view(B, H, T, T)
    p = F.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.bmm(p.view(B * H, T, T), v3).view(B, H, T, D), p


def form_einsum_padding(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * SCALE + _padding_additive()
    p = F.softmax(s, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", p, v), p


def form_softcap_where(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    s = q @ k.transpose(-2, -1) * SCALE
    s = torch.tanh(s / 3.0) * 3.0
    s = torch.where(~_causal_blocked(), s, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1)
    return m.dropout(p) @ v, p


def form_window(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(_window_blocked(), float("-inf"))
    p = s.softmax(dim=-1)
    return p @ v, p


def form_relative(q: Any, k: Any, v: Any, m: nn.Module) -> tuple[Any, Any]:
    s = q @ k.transpose(-2, -1)
    s += _relative()
    p = F.softmax(s.float(), dim=-1).type_as(s)
    return p @ v, p


#: form -> (function, scale, soft-cap, mask pattern, bias kind), each as the form was written
FORMS: dict[str, tuple[Callable[..., tuple[Any, Any]], float, float | None, str | None, str | None]] = {
    "at": (form_at, SCALE, None, None, None),
    "matmul_causal": (form_matmul_causal, SCALE, None, "causal", None),
    "bmm": (form_bmm, SCALE, None, None, None),
    "baddbmm_alibi": (form_baddbmm_alibi, SCALE, None, None, "alibi_like"),
    "einsum_padding": (form_einsum_padding, SCALE, None, "padding", None),
    "softcap_where": (form_softcap_where, SCALE, 3.0, "causal", None),
    "window": (form_window, SCALE, None, "window", None),
    "relative": (form_relative, 1.0, None, None, "relative_position"),
}


class SelfAttention(nn.Module):
    """One attention layer written by hand: a packed projection, ``form`` for the core, an output projection."""

    def __init__(self, form: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.form = FORMS[form][0]
        self.num_heads = H
        self.probs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(E, dim=-1)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y, p = self.form(q, k, v, self)
        self.probs.append(p.detach().clone())
        return self.out(y.transpose(1, 2).reshape(B, T, E))


class Net(nn.Module):
    def __init__(self, form: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = SelfAttention(form, dropout)
        self.head = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def build(form: str, dropout: float = 0.0) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(form, dropout), torch.randn(B, T, E)


def run(model: nn.Module, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train(train)
    with torch.set_grad_enabled(train):
        out = model(x)
        if train:
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_recorded_with_what_it_was_written_with(form: str, train: bool) -> None:
    """Witnesses: the module's own probabilities, rows by construction, the constants and shapes each form was
    written with, and the untraced run (outputs and gradients bit for bit)."""
    _, scale, cap, pattern, bias = FORMS[form]
    model, x = build(form)
    want_out, want_grads = run(model, x, train)
    model, x = build(form)
    with qkvtrace.trace(model, attention_maps=True) as t:
        got_out, got_grads = run(model, x, train)
    assert torch.equal(got_out, want_out)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(want_grads[n], got_grads[n]) for n in want_grads)

    assert [(c.path, c.module, c.module_type) for c in t.calls] == [("hand_written", "attn", "SelfAttention")]
    assert t.result.unobserved == []
    c = t.calls[0]
    # the shapes the form's first product got: (B·H, T, D) where it reshaped for bmm, else (B, H, T, D)
    shape = [B * H, T, D] if form in ("bmm", "baddbmm_alibi") else [B, H, T, D]
    assert [c.inputs[f"{p}_shape"] for p in ("query", "key", "value")] == [shape] * 3
    assert c.inputs["scale"] == pytest.approx(scale, rel=1e-6)
    assert c.inputs["softcap"] == (None if cap is None else pytest.approx(cap))
    assert (c.inputs["attn_mask"] or {}).get("pattern") == pattern
    assert c.inputs["bias"] == bias
    assert c.inputs["training"] is train
    # the map is the module's own probabilities
    assert c.attention_map is not None
    assert torch.equal(c.attention_map, model.attn.probs[0].float().reshape(B, H, T, T))
    # Q, K, V are rows of the packed projection, by construction, in training and under no_grad alike
    assert c.qkv.layout == "packed", c.qkv.reason
    assert [getattr(c.qkv, p).rows for p in "qkv"] == [[[0, E]], [[E, 2 * E]], [[2 * E, 3 * E]]]
    if train:
        assert c.backward_kernel is not None and "Softmax" in c.backward_kernel
        assert [r.call for r in t.routes] == [0]
        assert all(getattr(t.routes[0], p) is not None for p in "qkv")


def test_fully_masked_rows_and_nan_are_counted() -> None:
    """Witness: a mask built here that removes every key of query row 0 (softmax of all -inf is NaN)."""

    class Attn(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            blocked = torch.zeros(T, T, dtype=torch.bool)
            blocked[0] = True
            s = (q @ k.transpose(-2, -1)).masked_fill(blocked, float("-inf"))
            return s.softmax(-1) @ v

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attn()
            self.proj = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return self.attention(y, y * 1.0, y * 2.0)

    model, x = Outer(), torch.randn(B, H, T, D)
    with torch.no_grad():
        want = model(x)
    with qkvtrace.trace(model) as t, torch.no_grad():
        got = model(x)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    (c,) = t.calls
    assert c.module == "attention" and c.path == "hand_written"
    assert c.output["fully_masked_rows"] == B * H  # row 0 of every batch item and head
    assert c.output["nan_count"] == int(torch.isnan(want).sum())
    assert c.inputs["attn_mask"]["pattern"] == "other"


class _Reads(TorchDispatchMode):
    """Counts the aten calls that read a value back to the host (``.item()``, ``bool(t)``, ``float(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "_local_scalar_dense" in str(func):
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("form", ["matmul_causal", "softcap_where", "einsum_padding", "baddbmm_alibi"])
def test_recording_reads_nothing_back_while_the_model_runs(form: str) -> None:
    """Witness: PyTorch's dispatcher, counting ``_local_scalar_dense`` calls in the untraced and traced forward."""
    model, x = build(form)
    with _Reads() as untraced, torch.no_grad():
        model(x)
    with qkvtrace.trace(model) as t:
        with _Reads() as traced, torch.no_grad():
            model(x)
    assert len(t.calls) == 1
    assert traced.reads == untraced.reads


def _profiled_ops(fn: Callable[[], Any]) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


class Mixed(nn.Module):
    """PyTorch's fused paths next to attention written by hand, in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)
        layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.attn = SelfAttention("matmul_causal")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn(x)
        y = y + self.mha(y, y, y, need_weights=False)[0]
        y = self.attn(y)
        return self.encoder(y)


def test_fast_paths_next_to_hand_written_attention_are_unchanged() -> None:
    """Witness: torch.profiler on the untraced eval run (the fast MHA and fused encoder-layer kernels ran)."""
    torch.manual_seed(0)
    model, x = Mixed().eval(), torch.randn(B, T, E)
    with torch.inference_mode():
        want = model(x)
        untraced = _profiled_ops(lambda: model(x))
    assert "aten::_native_multi_head_attention" in untraced
    assert "aten::_transformer_encoder_layer_fwd" in untraced
    with qkvtrace.trace(model) as t, torch.inference_mode():
        got = model(x)
        traced = _profiled_ops(lambda: model(x))
    assert torch.equal(got, want)
    for op in ("aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd"):
        assert traced.count(op) == untraced.count(op), op
    paths = [(c.module, c.path) for c in t.calls]
    assert paths[:4] == [("attn", "hand_written"), ("mha", "fast"), ("attn", "hand_written"),
                         ("encoder.layers.0.self_attn", "fused_encoder_layer")]  # fmt: skip


def test_fallbacks_next_to_hand_written_attention_are_one_call_each() -> None:
    """In training, next to attention written by hand, a MultiheadAttention and an encoder layer's take their
    fallback: each is one call of its module, in the order the model makes them. Witness: the model's own
    forward (the calls it makes, by construction) and its untraced output."""
    torch.manual_seed(0)
    model, x = Mixed().train(), torch.randn(B, T, E)
    want = model(x)
    with qkvtrace.trace(model) as t:
        got = model(x)
    assert torch.equal(got, want)
    assert [(c.module, c.path) for c in t.calls] == [("attn", "hand_written"), ("mha", "fallback"),
                                                      ("attn", "hand_written"),
                                                      ("encoder.layers.0.self_attn", "fallback")]  # fmt: skip


class CallsSharedMHA(SelfAttention):
    """Attention written by hand whose output then goes through a MultiheadAttention its parent owns (shared,
    not a child of this module)."""

    def __init__(self, shared: nn.MultiheadAttention) -> None:
        super().__init__("matmul_causal")
        object.__setattr__(self, "shared", shared)  # not registered here: the parent owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.shared(y, y, y, need_weights=False)[0]  # type: ignore[operator]


class SharesMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)
        self.attn = CallsSharedMHA(self.mha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def test_a_multihead_attention_called_inside_a_watched_module_is_one_call() -> None:
    """A MultiheadAttention called (in training: its fallback) inside a module watched for attention written by
    hand is one call of its own. Witness: the model's own forward (the calls it makes, by construction) and
    its untraced output."""
    torch.manual_seed(0)
    model, x = SharesMHA().train(), torch.randn(B, T, E)
    want = model(x)
    with qkvtrace.trace(model) as t:
        got = [model(x) for _ in range(3)][-1]
    assert torch.equal(got, want)
    assert [c.path for c in t.calls if c.module == "mha"] == ["fallback"] * 3, [(c.module, c.path) for c in t.calls]


class SdpaAttention(nn.Module):
    """An attention-looking module that calls SDPA itself: watched until its first SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, E)


def test_sdpa_inside_a_watched_module_keeps_its_kernel() -> None:
    """Witness: torch.profiler on the untraced run (the SDPA kernel op), and on a traced call once the module's
    first call has shown it uses SDPA."""
    torch.manual_seed(0)
    model, x = SdpaAttention(), torch.randn(B, T, E)
    untraced = [op for op in _profiled_ops(lambda: model(x)) if "attention" in op]
    assert untraced
    with qkvtrace.trace(model) as t:
        model(x)
        again = [op for op in _profiled_ops(lambda: model(x)) if "attention" in op]
    assert again == untraced
    assert [c.path for c in t.calls] == ["sdpa", "sdpa"]
    assert [c.aten_ops for c in t.calls] == [untraced, untraced]


def test_dropout_rng_is_untouched() -> None:
    """Witness: the untraced run with the same seed (outputs, gradients and the global RNG state after it)."""
    model, x = build("softcap_where", dropout=0.3)
    torch.manual_seed(11)
    want_out, want_grads = run(model, x, True)
    want_rng = torch.get_rng_state()
    model, x = build("softcap_where", dropout=0.3)
    torch.manual_seed(11)
    with qkvtrace.trace(model) as t:
        got_out, got_grads = run(model, x, True)
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(want_grads[n], got_grads[n]) for n in want_grads)
    assert t.calls[0].inputs["dropout_p"] == 0.3


def test_an_exception_inside_leaves_nothing_switched_on() -> None:
    """Witness: torch.profiler -- after a hand-written module raised inside a trace, MHA still takes its fast path."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = SelfAttention("at")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.attention(x)
            raise RuntimeError("the model's own error")

    model = Broken()
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, T, E)
    with qkvtrace.trace(model) as t:
        with pytest.raises(RuntimeError, match="the model's own error"):
            model(x)
        assert not torch.overrides._is_torch_function_mode_enabled()
        with torch.inference_mode():
            ops = _profiled_ops(lambda: mha(x, x, x, need_weights=False))
    assert "aten::_native_multi_head_attention" in ops
    assert [c.path for c in t.calls] == ["hand_written"]


def test_nested_traces_and_threads_each_record_the_call() -> None:
    """Witness: the number of forward calls made here (one per thread, seen by both traces)."""
    model, x = build("matmul_causal")
    with qkvtrace.trace(model, threads="all") as outer, qkvtrace.trace(model, threads="all") as inner:
        workers = [threading.Thread(target=lambda: model(x)) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert len(outer.calls) == len(inner.calls) == 3
    assert {c.thread for c in outer.calls} == {w.name for w in workers}
    assert all(c.path == "hand_written" and c.module == "attn" for c in outer.calls + inner.calls)


def test_a_module_without_recognised_attention_stays_unobserved() -> None:
    """Witness: the module written here has no softmax over its keys (linear attention), so no record."""

    class LinearAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(E, 3 * E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split(E, dim=-1)
            return F.elu(q) @ (F.elu(k).transpose(-2, -1) @ v)

    model = LinearAttention()
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, T, E))
    assert t.calls == []
    (u,) = t.result.unobserved
    assert u.module == "" and u.module_type == "LinearAttention" and "recognised" in u.reason


def test_saved_trace_validates_and_reads_back(tmp_path: Any) -> None:
    """Witness: the JSON schema shipped with the package (checked by ``jsonschema``), and the file read back."""
    import json
    from pathlib import Path

    from jsonschema import Draft202012Validator

    from qkvtrace.records import TraceResult

    model, x = build("einsum_padding")
    with qkvtrace.trace(model) as t:
        model(x)
    data = json.loads(t.save(tmp_path / "t.json").read_text())
    schema = json.loads((Path(qkvtrace.__file__).parent / "schemas" / "trace-3.json").read_text())
    Draft202012Validator(schema).validate(data)
    back = TraceResult.from_dict(data)
    assert back.calls[0].path == "hand_written"
    assert back.calls[0].inputs["attn_mask"]["pattern"] == "padding"


def _t5() -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
                                   attn_implementation="eager")  # fmt: skip
    ids = torch.randint(0, 100, (B, 6), generator=torch.Generator().manual_seed(1))
    return transformers.T5Model(config), {"input_ids": ids, "decoder_input_ids": ids}


def _bloom() -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=100, attn_implementation="eager")
    ids = torch.randint(0, 100, (B, 6), generator=torch.Generator().manual_seed(1))
    return transformers.BloomModel(config), {"input_ids": ids}


#: model -> the (module class, mask pattern, bias kind) of its attention calls, in order, as the library builds them:
#: T5 adds a bias looked up from buckets of j - i (and a causal mask in its decoder's self-attention); Bloom adds
#: ALiBi (slope · key position, per head) through ``baddbmm`` and a causal mask
LIBRARY_KINDS = {
    "t5": (_t5, [("T5Attention", None, "relative_position")] * 2
           + [("T5Attention", "causal", "relative_position"), ("T5Attention", None, None)] * 2),
    "bloom": (_bloom, [("BloomAttention", "causal", "alibi_like")] * 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LIBRARY_KINDS))
def test_library_eager_attention_mask_and_bias_kinds(name: str) -> None:
    """Witnesses: the untraced run (bit for bit), the library's own ``output_attentions`` probabilities, and
    how each library builds its masks and biases (see ``LIBRARY_KINDS``)."""
    make, kinds = LIBRARY_KINDS[name]
    torch.manual_seed(0)
    model, inputs = make()
    model.eval()
    with torch.no_grad():
        want = model(**inputs, output_attentions=True)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        got = model(**inputs)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    returned = list(getattr(want, "encoder_attentions", None) or ()) + [
        a for pair in zip(want.decoder_attentions or (), want.cross_attentions or (), strict=True) for a in pair
    ] if name == "t5" else list(want.attentions)  # fmt: skip
    assert [(c.module_type, (c.inputs["attn_mask"] or {}).get("pattern"), c.inputs["bias"]) for c in t.calls] == kinds
    assert all(c.path == "hand_written" for c in t.calls)
    for c, probs in zip(t.calls, returned, strict=True):
        assert torch.equal(c.attention_map, probs.float()), c.module


def test_a_long_run_counts_hand_written_calls_and_reports_the_change(tmp_path: Any) -> None:
    """Witness: the steps at which the test itself switched the model from training to eval."""
    import json

    model, x = build("matmul_causal")
    with qkvtrace.trace(model, keep="changes", stream_to=tmp_path / "run.jsonl") as t:
        for step in range(5):
            model.train(step < 3)
            model(x).sum().backward()
            t.step()
    assert [(e.kind, e.step, e.became["path"], e.became["training"]) for e in t.changes] == [
        ("first", 0, "hand_written", True), ("change", 3, "hand_written", False)]  # fmt: skip
    combos = t.summary()["modules"]["attn"]["combinations"]
    assert [(c["calls"], c["first_step"], c["last_step"]) for c in combos] == [(3, 0, 2), (2, 3, 4)]
    first = next(json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()
                 if json.loads(line).get("kind") == "first")  # fmt: skip
    assert first["record"]["inputs"]["attn_mask"]["pattern"] == "causal"  # resolved before it was written


def test_torch_compile_inside_a_later_trace_does_not_claim_watching_stopped() -> None:
    """Witness: the second trace's model built here, which holds no attention module, so nothing was watched."""
    model, x = build("at")
    with qkvtrace.trace(model) as t:
        model(x)
    assert [c.path for c in t.calls] == ["hand_written"]
    plain = nn.Sequential(nn.Linear(E, E))
    with qkvtrace.trace(plain) as later:
        torch.compile(lambda: None)  # made, never run: Dynamo compiles nothing
    assert not any("not watched" in w for w in later.result.warnings), later.result.warnings


class _ScaledQuery(nn.Module):
    """Attention that scales Q (or K) before QKᵀ, as BART, Whisper and OPT scale their query projection."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E) for _ in range(3))
        self.where = where
        self.scaling = D**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x) * self.scaling if self.where == "projection" else self.q_proj(x)
        q = q.view(b, t, H, D).transpose(1, 2)
        k = self.k_proj(x).view(b, t, H, D).transpose(1, 2)
        v = self.v_proj(x).view(b, t, H, D).transpose(1, 2)
        if self.where == "heads":
            q = q / D**0.5
        if self.where == "both":  # half the scale on each side, as some models split it
            q, k = q * D**-0.25, k * D**-0.25
        probs = torch.matmul(q, k.transpose(-2, -1)).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(b, t, E)


@pytest.mark.parametrize("where", ["projection", "heads", "both"])
def test_a_scale_applied_to_q_or_k_before_the_product_is_the_scale(where: str) -> None:
    """Witness: the scale the test's module applies (1/sqrt(D), to Q's projection, to Q's heads, or split between
    Q and K), by construction."""
    model = _ScaledQuery(where)
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, T, E))
    (call,) = t.calls
    assert call.path == "hand_written"
    assert call.inputs["scale"] == pytest.approx(D**-0.5, rel=1e-6)
    assert call.inputs["form"].split(" → ")[0] in ("mul q", "div q")


def test_a_number_before_a_tanh_of_q_is_not_a_scale_of_the_scores() -> None:
    """Witness: by construction, tanh(2·q) is not 2·tanh(q): the scores this module makes are scaled by nothing."""

    class SquashedQuery(_ScaledQuery):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = torch.tanh(self.q_proj(x) * 2.0).view(b, t, H, D).transpose(1, 2)
            k, v = (p(x).view(b, t, H, D).transpose(1, 2) for p in (self.k_proj, self.v_proj))
            return (torch.matmul(q, k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(b, t, E)

    model = SquashedQuery("none")
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, T, E))
    (call,) = t.calls
    assert call.inputs["scale"] == 1.0 and call.inputs["form"].startswith("matmul")
