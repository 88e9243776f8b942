"""The tracer where real models run: many traces at once, threads, a user's profiler,
host reads, other entry points, and modules it cannot see.

Every test here failed on the tracer that saved "the original" per trace.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _sdpa_bound_module
import pytest
import torch
import torch.nn.functional as F
from _sdpa_bound_module import BoundSDPAAttention
from _witness import benchmark, profiled
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkvtrace
from qkvtrace.facts.paths import is_attention_op

E, H, B, L = 32, 4, 2, 6

PATCHED = {
    "nn.MultiheadAttention.forward": lambda: nn.MultiheadAttention.__dict__["forward"],
    "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention,
    "F.multi_head_attention_forward": lambda: F.multi_head_attention_forward,
    "torch._native_multi_head_attention": lambda: torch._native_multi_head_attention,
    "torch._transformer_encoder_layer_fwd": lambda: torch._transformer_encoder_layer_fwd,
}


@pytest.fixture
def pytorch_own() -> Iterator[dict[str, Any]]:
    """PyTorch's functions before the test; checked to be the same objects after it."""
    before = {k: get() for k, get in PATCHED.items()}
    yield before
    after = {k: get() for k, get in PATCHED.items()}
    assert after == before, "a wrapper was left installed"


def _mha() -> nn.MultiheadAttention:
    return nn.MultiheadAttention(E, H, batch_first=True)


# -- 1. many traces at once ------------------------------------------------------


@pytest.mark.parametrize("order", ["first-in-first-out", "last-in-first-out"])
def test_two_threads_any_exit_order(order: str, pytorch_own: dict[str, Any]) -> None:
    """Witness: two calls per thread by construction; PyTorch's functions saved before, compared after (fixture)."""
    models = [_mha(), _mha()]
    x = torch.randn(B, L, E)
    entered = [threading.Event(), threading.Event()]
    may_leave = [threading.Event(), threading.Event()]
    left = [threading.Event(), threading.Event()]
    traces: list[Any] = [None, None]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with qkvtrace.trace(models[i]) as t:
                traces[i] = t
                models[i](x, x, x, need_weights=False)
                entered[i].set()
                assert may_leave[i].wait(30)
                models[i](x, x, x, need_weights=False)
            left[i].set()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
            entered[i].set()
            left[i].set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    threads[0].start()
    assert entered[0].wait(30)
    threads[1].start()
    assert entered[1].wait(30)
    first, second = (0, 1) if order == "first-in-first-out" else (1, 0)
    may_leave[first].set()
    assert left[first].wait(30)
    # the other trace still records after the first one left
    may_leave[second].set()
    for th in threads:
        th.join(30)
    assert not errors, errors
    assert [len(t.calls) for t in traces] == [2, 2]
    assert [c.index for c in traces[0].calls] == [0, 1]
    # and PyTorch works afterwards (fixture: its own functions are back)
    nn.MultiheadAttention(E, H)(x, x, x)
    F.scaled_dot_product_attention(x, x, x)


def test_overlapping_traces_in_one_thread_any_order(pytorch_own: dict[str, Any]) -> None:
    """Witness: one call per model by construction; PyTorch's SDPA saved before the traces (fixture), by ``is``."""
    a_model, b_model = _mha(), _mha()
    x = torch.randn(B, L, E)
    a, b = qkvtrace.trace(a_model), qkvtrace.trace(b_model)
    a.__enter__()
    b.__enter__()
    a_model(x, x, x)
    a.__exit__(None, None, None)  # not the last one in
    b_model(x, x, x)
    assert F.scaled_dot_product_attention is not pytorch_own["F.scaled_dot_product_attention"]  # b still open
    b.__exit__(None, None, None)
    assert len(a.calls) == 1 and len(b.calls) == 1


def test_nested_traces_of_a_model_with_bound_sdpa_both_record() -> None:
    """Witness: call order by construction; torch.profiler's attention ops on an untraced run of the model."""
    model = nn.Sequential(BoundSDPAAttention(E, H), BoundSDPAAttention(E, H))
    x = torch.randn(B, L, E)
    untraced = profiled(lambda: model(x)).segments  # one segment per module, each with its kernel
    assert len(untraced) == 2 and all(len(ops) >= 2 for ops in untraced), untraced
    with qkvtrace.trace(model) as outer:
        model(x)
        with qkvtrace.trace(model[1]) as inner:
            model(x)
    assert _sdpa_bound_module.scaled_dot_product_attention is F.scaled_dot_product_attention
    assert [(c.index, c.module) for c in outer.calls] == [(0, "0"), (1, "1"), (2, "0"), (3, "1")]
    assert [(c.index, c.module) for c in inner.calls] == [(0, "")]
    # both see the kernel, not only the dispatcher entry: the ops the profiler saw untraced
    assert [c.aten_ops for c in outer.calls] == untraced * 2
    assert [c.aten_ops for c in inner.calls] == untraced[1:]


def test_threads_all_records_other_threads_and_entering_does_not() -> None:
    """Witness: the thread name given here and ``threading.current_thread().name``."""
    model = _mha()
    x = torch.randn(B, L, E)

    def in_thread() -> None:
        th = threading.Thread(target=lambda: model(x, x, x), name="server-worker")
        th.start()
        th.join(30)

    with qkvtrace.trace(model) as default:
        in_thread()
    with qkvtrace.trace(model, threads="all") as everywhere:
        in_thread()
        model(x, x, x)
    assert default.calls == []
    assert [c.thread for c in everywhere.calls] == ["server-worker", threading.current_thread().name]


def test_threads_argument_is_checked() -> None:
    """Witness: the value passed here is none of the documented choices."""
    with pytest.raises(ValueError, match="threads"):
        qkvtrace.trace(_mha(), threads="some")  # type: ignore[arg-type]


# -- 2. inside a user's own profiler ------------------------------------------


def _user_profiled(fn: Callable[[], Any]) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted((e for e in prof.events() if is_attention_op(e.name)), key=lambda e: e.time_range.start)
    return [e.name for e in events]


def test_under_a_user_profiler_never_an_invented_kernel() -> None:
    """A fresh process: the signature was never witnessed, so there is no evidence, and it says so.

    Witness: the user's own profiler in that process, and the MATH backend forced by ``sdpa_kernel``.
    """
    code = textwrap.dedent(
        """
        import json, torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import qkvtrace
        from conftest import PackedSelfAttention
        model = PackedSelfAttention(32, 4)
        x = torch.randn(2, 6, 32)
        with torch.profiler.profile() as prof, sdpa_kernel(SDPBackend.MATH), qkvtrace.trace(model) as t:
            model(x)
        names = [e.name for e in prof.events() if "scaled_dot_product" in e.name]
        c = t.calls[0]
        print(json.dumps({"ops": c.aten_ops, "evidence": c.evidence, "backend": c.sdpa_backend, "seen": names}))
        """
    )
    tests = str(__import__("pathlib").Path(__file__).parent)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tests)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("math" in n for n in got["seen"])  # the user's profiler saw the math kernel...
    assert got["ops"] is None  # ...and the trace does not pretend it did
    assert got["evidence"].startswith("unavailable: ")
    assert got["backend"] == "MATH"  # PyTorch's own selection needs no profiler


def test_under_a_user_profiler_evidence_from_an_identical_earlier_call(packed_attention_cls: Any) -> None:
    """Witness: torch.profiler's attention ops on an untraced run of the same call, and the user's profiler."""
    model = packed_attention_cls(E, H)
    x = torch.randn(B, L, E)
    with sdpa_kernel(SDPBackend.MATH):
        untraced = profiled(lambda: model(x)).segments
        with qkvtrace.trace(model) as first:
            model(x)
        with torch.profiler.profile() as prof, qkvtrace.trace(model) as t:
            model(x)
    seen = [e.name for e in prof.events() if is_attention_op(e.name)]
    call = t.calls[0]
    assert call.evidence == "cached"
    assert [call.aten_ops] == [first.calls[0].aten_ops] == untraced
    assert set(call.aten_ops or []) <= set(seen)
    assert any("math" in op for op in call.aten_ops or [])


# -- 3. no host reads inside the block ----------------------------------------------

def _host_reads() -> Any:
    """``benchmarks/host_reads.py``: the same counter the overhead benchmark prints."""
    return benchmark("host_reads")


def _encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _scenarios() -> dict[str, tuple[nn.Module, Callable[[nn.Module], Any]]]:
    from conftest import PackedSelfAttention

    x = torch.randn(B, L, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True

    def encoder_step(m: nn.Module) -> Any:
        m(x, src_key_padding_mask=pad).sum().backward()

    def fused(m: nn.Module) -> Any:
        with torch.inference_mode():
            return m(x, src_key_padding_mask=pad)

    def sdpa_step(m: nn.Module) -> Any:
        m(x, is_causal=True).sum().backward()

    return {
        "encoder training step, padding mask": (_encoder().train(), encoder_step),
        "fused encoder inference": (_encoder().eval(), fused),
        "direct SDPA training step": (PackedSelfAttention(E, H).train(), sdpa_step),
    }


def _cpp_and_python_reads() -> None:
    """Six host reads: two from Python (.item(), bool()), four made in C++ (equal, mask indexing, nonzero)."""
    x = torch.arange(-3.0, 3.0)
    torch.ones(()).item()
    bool(torch.ones(()))
    torch.equal(x, x)
    x[x > 0]  # boolean-mask indexing: the kernel calls nonzero
    x.nonzero()
    torch.where(x > 1)


@pytest.mark.parametrize("scenario", list(_scenarios()))
def test_no_host_reads_while_tracing(scenario: str) -> None:
    """Witness: torch.profiler's aten ops (every read to the host goes through _local_scalar_dense,
    nonzero, equal, is_nonzero or a device-to-host copy, C++ callers included), a TorchDispatchMode
    seeing the same ops from outside fused kernels, and the Python-level Tensor methods — on an
    untraced step against the same step traced."""
    model, step = _scenarios()[scenario]
    host_reads = _host_reads()
    for counter in (host_reads.ProfiledHostReads, host_reads.DispatchHostReads, host_reads.HostReads):
        plain, traced = host_reads.added_host_reads(model, lambda: step(model), counter=counter)
        assert traced - plain == 0, f"{traced - plain} host reads added by the trace ({counter.__name__})"
    # the counters are not blind: reads made in C++ are counted at the dispatcher, the Python ones everywhere
    expected = {"ProfiledHostReads": 6, "DispatchHostReads": 5, "HostReads": 2}  # counted by construction above
    for counter in (host_reads.ProfiledHostReads, host_reads.DispatchHostReads, host_reads.HostReads):
        with counter() as probe:
            _cpp_and_python_reads()
        assert probe.count == expected[counter.__name__], (counter.__name__, getattr(probe, "ops", None))
    # and the numbers were measured all the same, once the block ended
    with qkvtrace.trace(model) as t:
        step(model)
    assert t.calls and all(isinstance(c.output["nan_count"], int) for c in t.calls)
    assert all(isinstance(c.qkv.q.weight_norm, float) for c in t.calls if c.qkv.q is not None)


# -- 5. other entry points --------------------------------------------------------------


class DirectFunctionAttention(nn.Module):
    """A custom module that calls ``F.multi_head_attention_forward`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.packed_weight = nn.Parameter(torch.randn(3 * E, E) / E**0.5)
        self.packed_bias = nn.Parameter(torch.zeros(3 * E))
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (L, N, E)
        y, _ = F.multi_head_attention_forward(
            x, x, x, E, H, self.packed_weight, self.packed_bias, None, None, False, 0.0,
            self.out.weight, self.out.bias, training=self.training, need_weights=False,
        )  # fmt: skip
        return y


def test_direct_multi_head_attention_forward_is_a_fallback_call_of_its_module() -> None:
    """Witness: the module's construction, its weight and its real .grad, sliced in the test."""
    model = nn.Sequential(nn.Identity(), DirectFunctionAttention())
    x = torch.randn(L, B, E)
    with qkvtrace.trace(model) as t:
        model(x).sum().backward()
    [call] = t.calls
    assert (call.module, call.path, call.module_type) == ("1", "fallback", "DirectFunctionAttention")
    assert call.why_not_fast_path is None
    assert call.sdpa_backend is not None  # the SDPA call inside reported its kernel to this call
    assert call.qkv.layout == "packed"
    assert [call.qkv.q.param, call.qkv.q.rows] == ["packed_weight", [[0, E]]]
    assert call.qkv.v.rows == [[2 * E, 3 * E]]
    w = model[1].packed_weight.detach()
    assert call.qkv.k.weight_norm == pytest.approx(float(w[E : 2 * E].norm()), rel=1e-6)
    [grad] = t.gradients
    g = model[1].packed_weight.grad
    assert grad.module == "1"
    assert grad.q.grad_norm == pytest.approx(float(g[:E].norm()), rel=1e-6)


class Conv1D(nn.Module):
    """A GPT-2-style projection: weight stored transposed, ``[in, out]``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).reshape(*x.shape[:-1], self.nf)


class Conv1DAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(E, dim=-1)
        q, k, v = (t.reshape(B, L, H, E // H).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, E)


class Attend(nn.Module):
    """The kernel call only; the projections live in the parent."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class ParentHeldAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(E, E), nn.Linear(E, E, bias=False), nn.Linear(E, E)
        self.attend = Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).reshape(B, L, H, E // H).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        return self.attend(q, k, v).transpose(1, 2).reshape(B, L, E)


def test_conv1d_packed_projection_is_sliced_by_columns() -> None:
    """Witness: the Conv1D weight, bias and real .grad, sliced by columns in the test."""
    model = nn.Sequential(Conv1DAttention())
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        model(x).sum().backward()
    [call] = t.calls
    q, k = call.qkv.q, call.qkv.k
    assert call.qkv.layout == "packed" and q.param == "c_attn.weight" and q.dim == 1
    w = model[0].c_attn.weight.detach()
    assert q.shape == [E, E] and q.rows == [[0, E]]
    assert q.weight_norm == pytest.approx(float(w[:, :E].norm()), rel=1e-6)
    assert k.weight_norm == pytest.approx(float(w[:, E : 2 * E].norm()), rel=1e-6)
    assert k.bias_norm == pytest.approx(float(model[0].c_attn.bias.detach()[E : 2 * E].norm()), rel=1e-6)
    [grad] = t.gradients
    assert grad.v.grad_norm == pytest.approx(float(model[0].c_attn.weight.grad[:, 2 * E :].norm()), rel=1e-6)


def test_projections_in_the_parent_of_the_kernel_caller() -> None:
    """Witness: the module's construction, and the weights and real .grad of its projections."""
    model = nn.Sequential(ParentHeldAttention())
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        model(x).sum().backward()
    [call] = t.calls
    assert call.module == "0.attend"
    assert call.qkv.layout == "separate" and call.qkv.holder == "0"
    assert [call.qkv.q.param, call.qkv.k.param, call.qkv.v.param] == ["to_q.weight", "to_k.weight", "to_v.weight"]
    assert call.qkv.k.bias_param is None
    assert call.qkv.v.weight_norm == pytest.approx(float(model[0].to_v.weight.detach().norm()), rel=1e-6)
    [grad] = t.gradients
    assert grad.module == "0.attend"
    assert grad.q.grad_norm == pytest.approx(float(model[0].to_q.weight.grad.norm()), rel=1e-6)


def test_no_projection_found_says_why() -> None:
    """Witness: by construction the module has no projection, so no rows may be reported."""
    model = nn.Sequential(Attend())
    x = torch.randn(B, H, L, E // H)
    with qkvtrace.trace(model) as t:
        model[0](x, x, x)
        leaf = x.clone().requires_grad_()
        model[0](leaf * 1, leaf * 1, leaf * 1)  # a graph, but no projection in it
    plain, graphed = t.calls
    assert plain.qkv.layout is None and plain.qkv.reason and "no autograd history" in plain.qkv.reason
    assert graphed.qkv.layout is None and graphed.qkv.reason and "Linear or Conv1D weight" in graphed.qkv.reason
    assert plain.qkv.q is not None and plain.qkv.q.activation_norm == pytest.approx(float(x.norm()), rel=1e-6)


class HandWritten(nn.Module):
    """Attention as many models' "eager" implementations write it: softmax of QKᵀ."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return torch.softmax(q @ k.transpose(-1, -2) / E**0.5, dim=-1) @ v


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = HandWritten()
        self.cross = _mha()
        self.attn_dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.self_attn(x)
        return self.attn_dropout(self.cross(y, y, y)[0])


def test_hand_written_attention_beside_mha_is_recorded() -> None:
    """Witness: the module order of this Block's forward, and the untraced run (bit for bit)."""
    model = Block()
    x = torch.randn(B, L, E)
    plain = model(x)
    with qkvtrace.trace(model) as t:
        traced = model(x)
    assert torch.equal(plain, traced)
    assert [(c.module, c.path) for c in t.calls] == [("self_attn", "hand_written"), ("cross", "fallback")]
    assert t.result.unobserved == []
    assert t.calls[0].inputs["scale"] == pytest.approx(1 / E**0.5)


class FlexBlock(nn.Module):
    """A module calling FlexAttention eagerly (imported by name, as its docs show)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (t.reshape(B, L, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return flex_attention(q, k, v, score_mod=_relative_bias)


def _relative_bias(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    return score + (q_idx - kv_idx)


def test_flex_attention_is_recorded() -> None:
    """Witness: the untraced output, FlexAttention saved before the trace (by ``is``), the test's score_mod, and
    ``FlexBlock``'s rows by construction."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    model = nn.Sequential(FlexBlock())
    x = torch.randn(B, L, E)
    original = flex.flex_attention  # PyTorch's own function, defined in PyTorch's own file
    assert Path(original.__code__.co_filename) == Path(flex.__file__)
    with torch.no_grad():
        plain = model(x)
        with qkvtrace.trace(model) as t:
            traced = model(x)
    assert torch.equal(plain, traced)
    assert flex.flex_attention is original
    [call] = t.calls
    assert (call.module, call.path, call.sdpa_backend) == ("0", "flex", None)
    assert call.inputs["score_mod"] == "_relative_bias" and call.inputs["block_mask"] is None
    assert call.evidence in ("witnessed", "cached") and call.aten_ops  # FlexAttention's own operator
    # no graph under no_grad, yet the rows are FlexBlock's by construction: thirds of ``qkv.weight``, q first
    assert call.qkv.layout == "packed", call.qkv.reason
    assert [getattr(call.qkv, p).rows for p in "qkv"] == [[[i * E, (i + 1) * E]] for i in range(3)]
