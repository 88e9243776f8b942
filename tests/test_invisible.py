"""Invisible to PyTorch itself (DESIGN.md, principle 8), and to its compilers.

While any trace is open -- even one that traces an unrelated model -- code
that compares PyTorch's functions by identity, TorchScript and
``torch.compile`` must see and do exactly what they do without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from _witness import dynamo_graph
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import qkvtrace

E, H, B, L = 16, 4, 2, 5


@pytest.fixture
def open_trace() -> Iterator[qkvtrace.Trace]:
    """A trace of an unrelated module: every wrapper installed, no test model traced."""
    with qkvtrace.trace(nn.Linear(1, 1)) as t:
        yield t


def _qkv(lq: int = 4, lk: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(B, H, lq, 8), torch.randn(B, H, lk, 8), torch.randn(B, H, lk, 8)


# -- __torch_function__ overrides ---------------------------------------------------


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
def test_causal_bias_outside_the_traced_model(make: Any) -> None:
    """Witness: the same SDPA call with the same CausalBias, run before the trace."""
    q, k, v = _qkv()
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=make(4, 6))
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = F.scaled_dot_product_attention(q, k, v, attn_mask=make(4, 6))
    assert torch.equal(plain, traced)


def test_causal_bias_errors_are_pytorchs(open_trace: qkvtrace.Trace) -> None:
    """Witness: the message PyTorch's ``CausalBias`` raises (torch/nn/attention/bias.py), written here."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(4, 6), is_causal=True)


class Tagged(torch.Tensor):
    """A user's tensor subclass that, like CausalBias, dispatches on SDPA's identity."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            cls.seen.append("sdpa branch")
            args = tuple(a.as_subclass(torch.Tensor) if isinstance(a, Tagged) else a for a in args)
            return func(*args, **kwargs) * 2
        return super().__torch_function__(func, types, args, kwargs)


def test_user_tensor_subclass_takes_the_same_branch() -> None:
    """Witness: the untraced call's output, and the branches the subclass itself logged."""
    q, k, v = _qkv()
    Tagged.seen.clear()
    plain = F.scaled_dot_product_attention(q.as_subclass(Tagged), k, v)
    with qkvtrace.trace(nn.Linear(1, 1)):
        traced = F.scaled_dot_product_attention(q.as_subclass(Tagged), k, v)
    assert Tagged.seen == ["sdpa branch", "sdpa branch"]
    assert torch.equal(plain.as_subclass(torch.Tensor), traced.as_subclass(torch.Tensor))


class CausalBiasLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor, bias: CausalBias) -> torch.Tensor:
        q, k, v = (t.reshape(B, -1, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
def test_traced_model_with_causal_bias_is_recorded_as_a_causal_variant(make: Any) -> None:
    """Witness: the untraced output, the bias's own variant, and the cells its materialised mask blocks."""
    model = nn.Sequential()
    model.add_module("attn", CausalBiasLM())
    x = torch.randn(B, L, E)
    plain = model.attn(x, make(L, L))
    with qkvtrace.trace(model) as t:
        traced = model.attn(x, make(L, L))
    assert torch.equal(plain, traced)
    [call] = t.calls
    mask = call.inputs["attn_mask"]
    assert call.module == "attn" and call.path == "sdpa"
    assert mask["kind"] == "CausalBias" and mask["variant"] == make(L, L).variant.name
    # what it blocks, from CausalBias's own materialised mask: the strict upper triangle for a square one
    own = make(L, L)._materialize()
    assert mask["blocked"] == int((~own).sum()) == L * (L - 1) // 2 and mask["total"] == own.numel() == L * L
    assert call.sdpa_backend is not None  # the SDPA call CausalBias made reported its kernel
    assert call.qkv.layout == "packed"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_causal_bias_under_torch_compile(backend: str, open_trace: qkvtrace.Trace) -> None:
    """Witness: the eager SDPA output with the same CausalBias, outside ``torch.compile``."""
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 6))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 6))

    torch._dynamo.reset()
    got = torch.compile(attend, backend=backend)(q, k, v)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


# -- TorchScript -------------------------------------------------------------------------


def _encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True).eval()


class EncoderSubclass(nn.TransformerEncoderLayer):
    pass


def test_torchscript_during_and_after_a_trace() -> None:
    """Witness: the eager modules' own outputs, computed before the trace, which each scripted or traced copy
    (and the eager modules inside the trace) must reproduce."""
    x = torch.randn(B, L, E)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = _encoder_layer()
    with torch.no_grad():
        mha_eager, layer_eager = mha(x, x, x)[0], layer(x)
    with qkvtrace.trace(mha) as t:
        scripted = torch.jit.script(mha)
        scripted_layer = torch.jit.script(layer)
        traced_fn = torch.jit.trace(mha, (x, x, x))
        with torch.no_grad():
            assert torch.allclose(scripted(x, x, x)[0], mha_eager, atol=1e-6)
            assert torch.allclose(scripted_layer(x), layer_eager, atol=1e-6)
            assert torch.allclose(traced_fn(x, x, x)[0], mha_eager, atol=1e-6)
            assert torch.allclose(mha(x, x, x)[0], mha_eager, atol=1e-6)
            assert torch.allclose(layer(x), layer_eager, atol=1e-6)
    assert t.calls  # the eager calls were recorded
    # afterwards the process is no worse: new classes script as usual and compute what eager PyTorch computes
    sub_eager = EncoderSubclass(E, H, 32, dropout=0.0, batch_first=True).eval()
    kv_eager = nn.MultiheadAttention(E, H, kdim=8, vdim=8).eval()  # in_proj_weight is None
    sub, none_in_proj = torch.jit.script(sub_eager), torch.jit.script(kv_eager)
    kv = torch.randn(B, L, 8)
    with torch.no_grad():
        assert torch.allclose(sub(x), sub_eager(x), atol=1e-6)
        assert torch.allclose(none_in_proj(x, kv, kv)[0], kv_eager(x, kv, kv)[0], atol=1e-6)


def test_scripted_model_is_reported_not_silent() -> None:
    """Witness: the holder is built here with a TorchScript module named ``enc`` (no eager attention to record)."""
    holder = nn.Sequential()
    holder.add_module("enc", torch.jit.script(_encoder_layer()))
    x = torch.randn(B, L, E)
    with qkvtrace.trace(holder) as t:
        holder(x)
    assert t.calls == []
    assert any("enc" in w and "TorchScript" in w for w in t.result.warnings), t.result.warnings


# -- torch.compile -------------------------------------------------------------------------


def _graph_counts(fn: Any, *args: Any) -> tuple[int, int]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_count, ex.graph_break_count


class SDPAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(B, L, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        p = 0.1 if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).sum()


def _compile_cases() -> dict[str, tuple[nn.Module, Any]]:
    x = torch.randn(B, L, E)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 32, dropout=0.1, batch_first=True), 2, enable_nested_tensor=False
    )
    return {
        "encoder training step": (enc.train(), lambda m: m(x).sum()),
        "direct SDPA with dropout": (SDPAModel().train(), lambda m: m(x)),
    }


@pytest.mark.parametrize("case", list(_compile_cases()))
def test_explain_counts_are_unchanged(case: str) -> None:
    """Witness: ``torch._dynamo.explain``'s graph and break counts on the untraced step."""
    model, step = _compile_cases()[case]
    plain = _graph_counts(lambda: step(model))
    with qkvtrace.trace(model):
        traced = _graph_counts(lambda: step(model))
    assert traced == plain


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("case", list(_compile_cases()))
def test_compiled_outputs_bit_for_bit_and_no_recompiles(case: str, backend: str) -> None:
    """Witness: the compiled step's outputs before the trace, Dynamo's own ``unique_graphs`` counter, and the
    model's attention modules found here by type (MultiheadAttention, or the SDPA model itself): each is recorded
    (an eager call, or an operation of a graph compiled in the trace) or listed unobserved, never both."""
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    model, step = _compile_cases()[case]
    compiled_frames: list[int] = []

    def run(n: int) -> list[torch.Tensor]:
        outs = []
        for _ in range(n):
            torch.manual_seed(7)  # same dropout stream for every run
            outs.append(compiled())
        return outs

    torch._dynamo.reset()
    compiled = torch.compile(lambda: step(model), backend=backend)
    plain = run(2)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with qkvtrace.trace(model) as t:
        traced = run(2)
    frames_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with qkvtrace.trace(model):
        run(2)
    after = run(1)
    compiled_frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_first)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert torch.equal(after[0], plain[0])
    assert frames_first - frames_before <= 1  # at most the one recompile for the wrapped attribute
    assert compiled_frames == [0]  # and none after it
    attention = {n for n, m in model.named_modules() if isinstance(m, (nn.MultiheadAttention, SDPAModel))}
    recorded = {c.module for c in t.calls} | {c.module for c in t.result.compiled}
    unseen = {u.module for u in t.result.unobserved}
    assert attention <= recorded | unseen and not recorded & unseen, (attention, recorded, unseen)


def test_compiled_module_is_named_in_the_warnings() -> None:
    """Witness: the name ``body`` given here to the module wrapped by ``torch.compile``, and the graph Dynamo
    hands a backend written here for the same layer: the attention function in it is what the trace records as
    compiled (none there: the release ran the layer eagerly, and the call is recorded as an eager call)."""
    in_graph = [f for _, f, _ in dynamo_graph(_encoder_layer(), torch.randn(B, L, E))]
    kinds = {"_transformer_encoder_layer_fwd": "fused_encoder_layer", "scaled_dot_product_attention":
             "MultiheadAttention", "multi_head_attention_forward": "MultiheadAttention",
             "TransformerEncoderLayer": "fused_encoder_layer"}  # fmt: skip
    written = [kinds[f] for f in in_graph if f in kinds]

    model = nn.Sequential()
    model.add_module("body", torch.compile(_encoder_layer(), backend="eager"))
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t, torch.no_grad():
        model(x)
    torch._dynamo.reset()
    assert any(w.startswith("body runs through torch.compile") for w in t.result.warnings), t.result.warnings
    assert [op.entry for op in t.result.compiled] == written, in_graph
    if written:
        assert all(op.module in ("body", "body.self_attn") for op in t.result.compiled)
        assert not t.calls and not t.result.unobserved
        assert any("recorded under `compiled`" in w for w in t.result.warnings)
    else:  # no attention in the graph (torch 2.4): it ran eagerly between graphs, where the trace stands aside
        assert not t.calls and [u.module for u in t.result.unobserved] == ["body.self_attn"]
        assert "torch.compile" in t.result.unobserved[0].reason


_SEEDED_STEP = """
import sys, torch, qkvtrace
from torch import nn
torch.manual_seed(0)
model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True)  # dropout draws random numbers
x = torch.randn(2, 5, 16)
torch.manual_seed(1)
if sys.argv[1] == "traced":
    with qkvtrace.trace(model):  # the first trace of the process: it calibrates the backends
        out = model(x)
else:
    out = model(x)
print(repr(out.sum().item()), repr(torch.rand(1).item()))
"""


def test_the_first_trace_of_a_process_leaves_the_random_state_alone() -> None:
    """A seeded step draws the same dropout masks, and the same numbers after it, traced or not.

    Witness: the same script run untraced in a fresh process, its printed numbers compared as text.
    """
    import subprocess
    import sys

    runs = {
        how: subprocess.run([sys.executable, "-c", _SEEDED_STEP, how], capture_output=True, text=True, timeout=120)
        for how in ("plain", "traced")
    }
    for done in runs.values():
        assert done.returncode == 0, done.stderr
    assert runs["traced"].stdout == runs["plain"].stdout


class Logged(torch.Tensor):
    """A user's tensor subclass that passes every function on to PyTorch, logging which it was handed."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", ""))
        return super().__torch_function__(func, types, args, kwargs or {})


class DirectMHA(nn.Module):
    """A module of its own that calls ``F.multi_head_attention_forward`` with its inner module's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.MultiheadAttention(E, H)

    def forward(self, x: torch.Tensor, need_weights: bool) -> torch.Tensor:
        m = self.inner
        return F.multi_head_attention_forward(x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, None, None, False,
                                              0.0, m.out_proj.weight, m.out_proj.bias, training=False,
                                              need_weights=need_weights)[0]  # fmt: skip


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kind", ["module", "direct"])
def test_a_multihead_attention_call_handed_to_an_override_is_recorded_once(kind: str, need_weights: bool) -> None:
    """PyTorch hands ``F.multi_head_attention_forward`` to the ``__torch_function__`` of a tensor subclass among its
    arguments, which calls it again: still one call, recorded once. Witness: the number of calls the test makes;
    the subclass's own log (PyTorch handed it the function once a call, untraced and traced); and the untraced
    outputs, equal to the traced."""
    torch.manual_seed(12)
    mha, direct = nn.MultiheadAttention(E, H), DirectMHA()
    x = torch.randn(L, B, E).as_subclass(Logged)

    def call() -> torch.Tensor:
        out = mha(x, x, x, need_weights=need_weights)[0] if kind == "module" else direct(x, need_weights)
        return out.as_subclass(torch.Tensor)

    Logged.seen.clear()
    plain = [call() for _ in range(3)]
    handed = Logged.seen.count("multi_head_attention_forward")
    Logged.seen.clear()
    with qkvtrace.trace(nn.ModuleDict({"mha": mha, "direct": direct})) as t:
        traced = [call() for _ in range(3)]
    assert handed == Logged.seen.count("multi_head_attention_forward") == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert [(c.module, c.path) for c in t.calls] == [(kind if kind == "direct" else "mha", "fallback")] * 3
