"""A trace never recompiles a compiled model, nor changes what it computes.

Dynamo guards each compiled graph on the identity of the functions it
loaded, so a trace that left its wrappers in place while a compiled module
runs would recompile it (and a model compiled inside a trace would recompile
after it). Witnesses, all independent of qkvtrace:

* the number of graphs Dynamo hands its backend -- counted by a backend
  written here that counts, then hands the graph to PyTorch's own backend
  of that name (``torch._dynamo.lookup_backend``);
* ``torch._dynamo.explain``: graph and graph-break counts of the same model,
  traced and untraced;
* the outputs and gradients of the same compiled model run untraced, with
  the same seed (``torch.equal``: bit for bit), dropout included.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

E, H, B, T = 16, 4, 2, 5

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor needs a C++ compiler on the CPU"
)
BACKENDS = ["eager", "aot_eager", pytest.param("inductor", marks=[needs_compiler, pytest.mark.slow])]


class PackedBlock(nn.Module):
    """Packed Q/K/V projection into SDPA (dropout in training), then a MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.mha = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, E)
        return self.mha(y, y, y, need_weights=False)[0]


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


MODELS: dict[str, Callable[[], nn.Module]] = {"packed-sdpa+mha": PackedBlock, "encoder": _encoder}


class Counting:
    """A backend that counts the graphs Dynamo compiles, then compiles them with PyTorch's ``name`` backend."""

    def __init__(self, name: str) -> None:
        self.graphs = 0
        self.inner = torch._dynamo.lookup_backend(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _step(model: nn.Module, x: torch.Tensor, train: bool) -> list[torch.Tensor]:
    """One forward (and in training a backward) with a fixed seed: the output and every gradient."""
    torch.manual_seed(123)
    if not train:
        with torch.no_grad():
            return [model(x)]
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.square().mean().backward()
    return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _fresh(kind: str, train: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[kind]().train(train)
    return model, torch.randn(B, T, E)


#: inductor compiles C++ on a CPU (measured cold on a loaded 2-core machine: 19 s for the eval encoder, about a
#: minute for each of the others): the eval encoder witnesses "no recompile under inductor" in the default run,
#: the other inductor cases under ``-m slow``
_BEFORE = [
    pytest.param(backend, kind, train, id=f"{backend}-{kind}-{'train' if train else 'eval'}",
                 marks=([needs_compiler, *([] if (kind, train) == ("encoder", False) else [pytest.mark.slow])]
                        if backend == "inductor" else []))
    for backend in ("eager", "aot_eager", "inductor") for kind in MODELS for train in (True, False)
]  # fmt: skip


@pytest.mark.parametrize(("backend", "kind", "train"), _BEFORE)
def test_compiled_before_the_trace_is_not_recompiled_inside_it(backend: str, kind: str, train: bool) -> None:
    """Compiled and run before the trace: no graph compiled inside it or after it; outputs and grads bit-equal.

    Witness: the graph count of the counting backend written here, and the same compiled model run untraced.
    """
    torch._dynamo.reset()
    model, x = _fresh(kind, train)
    counting = Counting(backend)
    compiled = torch.compile(model, backend=counting)
    plain = _step(compiled, x, train)
    before = counting.graphs
    assert before >= 1
    with qkvtrace.trace(compiled) as t:
        traced = _step(compiled, x, train)
    assert counting.graphs == before, "the trace made Dynamo compile again"
    after = _step(compiled, x, train)
    assert counting.graphs == before
    assert _same(plain, traced) and _same(plain, after)
    assert any("runs through torch.compile" in w for w in t.result.warnings)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_inside_the_trace_is_reused_after_it(backend: str) -> None:
    """Compiled inside a trace: reused after it closes with no new graph, as one compiled without a trace.

    Witness: the counting backend's graph count, and an untraced twin compiled with no trace open.
    """
    torch._dynamo.reset()
    model, x = _fresh("packed-sdpa+mha", True)
    twin = _fresh("packed-sdpa+mha", True)[0]
    counting = Counting(backend)
    with qkvtrace.trace(model):
        compiled = torch.compile(model, backend=counting)
        inside = _step(compiled, x, True)
    graphs = counting.graphs
    after = _step(compiled, x, True)
    assert counting.graphs == graphs, "closing the trace made Dynamo compile again"
    untraced = _step(torch.compile(twin, backend=Counting(backend)), x, True)
    assert _same(inside, untraced) and _same(after, untraced)


def test_module_compiled_in_place_before_the_trace_is_not_recompiled() -> None:
    """``module.compile()`` (compiled in place) before the trace: no new graph inside or after it.

    Witness: the counting backend's graph count, and the same model's untraced run before the trace.
    """
    torch._dynamo.reset()
    model, x = _fresh("packed-sdpa+mha", True)
    counting = Counting("eager")
    model.compile(backend=counting)
    plain = _step(model, x, True)
    graphs = counting.graphs
    with qkvtrace.trace(model):
        traced = _step(model, x, True)
    assert counting.graphs == graphs
    assert _same(plain, traced) and _same(plain, _step(model, x, True))
    assert not getattr(model._compiled_call_impl, "_qkv_stands_aside", False)  # put back as it was


def test_module_compiled_in_place_inside_the_trace_is_reused_after_it() -> None:
    """``module.compile()`` inside the trace: no new graph after it closes; outputs equal an untraced twin's.

    Witness: the counting backend's graph count, and an untraced twin compiled in place with no trace open.
    """
    torch._dynamo.reset()
    model, x = _fresh("packed-sdpa+mha", True)
    twin = _fresh("packed-sdpa+mha", True)[0]
    counting = Counting("eager")
    with qkvtrace.trace(model):
        model.compile(backend=counting)
        inside = _step(model, x, True)
    graphs = counting.graphs
    after = _step(model, x, True)
    assert counting.graphs == graphs, "closing the trace made Dynamo compile again"
    assert not getattr(model._compiled_call_impl, "_qkv_stands_aside", False)  # what PyTorch made, put back
    twin.compile(backend=Counting("eager"))
    untraced = _step(twin, x, True)
    assert _same(inside, untraced) and _same(after, untraced)


def test_a_trace_leaves_the_module_class_alone() -> None:
    """An open trace sets no attribute of ``nn.Module`` (every module class's attribute caches stay valid), and a
    module compiled in place inside it still stands aside (the test above).

    Witness: ``nn.Module``'s class attributes read before the trace, compared by identity.
    """
    model, x = _fresh("packed-sdpa+mha", False)
    before = dict(vars(nn.Module))
    with qkvtrace.trace(model):
        inside = dict(vars(nn.Module))
        model(x)
    assert inside.keys() == before.keys()
    assert all(inside[name] is before[name] for name in before)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_explain_counts_graphs_and_breaks_alike_traced_and_untraced(train: bool) -> None:
    """``torch._dynamo.explain`` of a compiled call: the same graph and break counts inside a trace as outside.

    Witness: ``torch._dynamo.explain`` of the same model with no trace open.
    """
    torch._dynamo.reset()
    model, x = _fresh("encoder", train)
    compiled = torch.compile(model, backend="eager")
    compiled(x)

    def explained() -> tuple[int, int]:
        result = torch._dynamo.explain(model)(x)
        return result.graph_count, result.graph_break_count

    plain = explained()
    with qkvtrace.trace(compiled):
        traced = explained()
        compiled(x)
    assert traced == plain


def test_eager_calls_are_observed_again_after_a_compiled_call_returns() -> None:
    """Inside one trace: a compiled module's call, then an eager one -- the eager call is recorded
    (the wrappers stand aside only while compiled code runs). Witness: the number of calls made."""
    torch._dynamo.reset()
    model, x = _fresh("packed-sdpa+mha", False)
    eager_mha = nn.MultiheadAttention(E, H, batch_first=True)
    compiled = torch.compile(model, backend="eager")
    root = nn.ModuleDict({"compiled": compiled, "eager": eager_mha})
    with qkvtrace.trace(root) as t:
        compiled(x)
        eager_mha(x, x, x)
        compiled(x)
        eager_mha(x, x, x)
    assert [c.module for c in t.calls] == ["eager", "eager"]
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
