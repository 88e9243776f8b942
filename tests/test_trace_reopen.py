"""A trace opened again and again on the same model (one trace per step) sees the model as it is at each open.

What a model's structure gives a trace is read once and kept between traces
(:mod:`qkvtrace.tracer.structure`); these tests change the structure between
two traces and check that the second trace sees the change, and that the kept
answers hold no module alive.
"""

from __future__ import annotations

import copy
import gc
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace


class Block(nn.Module):
    """Attention written around SDPA, with a packed projection named ``qkv`` (its rows looked up by name)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class Silent(nn.Module):
    """Looks like attention (a packed ``qkv`` projection) and calls nothing the tracer wraps."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)[..., : x.shape[-1]]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _traced(model: nn.Module, x: torch.Tensor) -> qkvtrace.TraceResult:
    with qkvtrace.trace(model) as t:
        model(x)
    return t.result


def test_a_module_swapped_between_traces_is_seen_under_its_name() -> None:
    """Witness: the names ``named_modules()`` gives the swapped model, and the test's own count of SDPA calls
    (one per ``Block`` by construction)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 5, 16)
    first = _traced(model, x)
    assert [c.module for c in first.calls] == ["blocks.0", "blocks.1"]
    model.blocks.append(Block())  # a third block: a module the first trace never saw
    model.blocks[0] = Silent()  # and the first one swapped for one that calls nothing wrapped
    names = {n for n, m in model.named_modules() if isinstance(m, Block)}
    second = _traced(model, x)
    assert {c.module for c in second.calls} == names == {"blocks.1", "blocks.2"}
    assert [u.module for u in second.unobserved] == ["blocks.0"]
    assert all(u.module != "blocks.0" for u in first.unobserved)


class Narrow(nn.Module):
    """Calls nothing the tracer wraps; its projection ``qkv`` is as wide as its input until the test widens it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)[..., : x.shape[-1]]


def test_a_parameter_given_new_data_between_traces_is_seen() -> None:
    """Witness: the same model, as it is at the second trace, traced by a trace that never saw it (a deep
    copy). Its projection's parameters are the same objects throughout; only their data is replaced, three
    times wider, so that the module then looks like attention (a packed projection) and, silent, is said so."""
    model = nn.Sequential(Narrow())
    x = torch.randn(2, 5, 16)
    assert [u.module for u in _traced(model, x).unobserved] == []  # not attention-looking yet
    proj = model[0].qkv
    weight, bias = proj.weight, proj.bias
    with torch.no_grad():
        proj.weight.data = torch.randn(48, 16)
        proj.bias.data = torch.randn(48)
    proj.out_features = 48
    assert proj.weight is weight and proj.bias is bias  # the same parameters, new data
    again = _traced(model, x)
    fresh = _traced(copy.deepcopy(model), x)
    assert [u.module for u in fresh.unobserved] == ["0"]
    assert [(u.module, u.reason) for u in again.unobserved] == [(u.module, u.reason) for u in fresh.unobserved]


def test_the_same_modules_under_a_new_name_are_recorded_under_it() -> None:
    """Witness: the names ``named_modules()`` gives once the test moved the very same blocks to another
    attribute (no module is new: only a name changed)."""
    torch.manual_seed(1)
    model, x = Net(), torch.randn(2, 5, 16)
    assert [c.module for c in _traced(model, x).calls] == ["blocks.0", "blocks.1"]
    blocks = model.blocks
    del model.blocks
    model.layers = blocks
    model.forward = lambda x: blocks[1](x + blocks[0](x))  # type: ignore[method-assign]
    expected = [n for n, m in model.named_modules() if isinstance(m, Block)]
    assert [c.module for c in _traced(model, x).calls] == expected == ["layers.0", "layers.1"]


def test_a_module_compiled_in_place_between_traces_is_not_recompiled_in_the_next() -> None:
    """Witness: Dynamo's own count of the graphs it compiled (``counters["stats"]["unique_graphs"]``), the same
    before and after the compiled module runs inside the second trace, and PyTorch's own mark of a module
    compiled in place (``_compiled_call_impl``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(2)
    model, x = Net(), torch.randn(2, 5, 16)
    assert not any("torch.compile" in w for w in _traced(model, x).warnings)
    model.blocks[1].compile(backend="eager")
    assert model.blocks[1]._compiled_call_impl is not None
    model(x)  # compiled here, before the trace
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    try:
        result = _traced(model, x)
        assert counters["stats"]["unique_graphs"] == graphs  # the graph compiled before is the one that ran
        assert any(w.startswith("blocks.1 runs through torch.compile") for w in result.warnings)
    finally:
        torch._dynamo.reset()


def test_what_is_kept_between_traces_holds_no_module() -> None:
    """Witness: a weak reference to the model the test made, after two traces of it and the model deleted."""
    model, x = Net(), torch.randn(2, 5, 16)
    _traced(model, x)
    _traced(model, x)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_weight_norms_kept_between_traces_follow_the_weights() -> None:
    """Witness: the float64 norm the test computes of each weight's Q, K and V rows just before each trace, the
    weights changed between traces in each way a training or conversion script changes them: an optimizer
    step (the version moves), ``param.data`` replaced (a new storage), the model converted to float64 (a new
    dtype), and a trace under ``inference_mode``; the norms are numbers in each trace's records."""
    torch.manual_seed(11)
    mha = nn.MultiheadAttention(16, 2)
    opt = torch.optim.SGD(mha.parameters(), lr=0.5)
    x = torch.randn(5, 2, 16)
    changes = ["", "", "step", "data", "double", "inference_mode", ""]
    for change in changes:
        if change == "step":
            mha(x, x, x)[0].sum().backward()
            opt.step()
        elif change == "data":
            with torch.no_grad():
                mha.in_proj_weight.data = torch.randn_like(mha.in_proj_weight)
        elif change == "double":
            mha.double()
            x = x.double()
        w = mha.in_proj_weight.detach().double()
        expected = [float(torch.linalg.vector_norm(w[i * 16 : (i + 1) * 16])) for i in range(3)]
        with qkvtrace.trace(mha) as t, torch.inference_mode() if change == "inference_mode" else nullcontext():
            mha(x, x, x)
        got = [t.calls[0].qkv.q.weight_norm, t.calls[0].qkv.k.weight_norm, t.calls[0].qkv.v.weight_norm]
        assert all(type(g) is float for g in got), (change, got)
        assert all(abs(g - e) <= 1e-5 * e for g, e in zip(got, expected, strict=True)), (change, got, expected)


class _Projected(nn.Module):
    """A model's own SDPA call on Q, K and V it projects with one Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("kind", ["mha", "projected"])
def test_weight_norms_follow_new_data_between_two_calls_of_one_trace(kind: str) -> None:
    """Witness: the float64 norm the test computes of the Q, K and V rows of the weight before each call. Between
    the calls the weight is given new data (``param.data = ...``: the same parameter, a new storage, its version
    unchanged), inside one open trace: the second call's record must say the new norms, not its slot's."""
    torch.manual_seed(12)
    model: nn.Module = nn.MultiheadAttention(16, 2) if kind == "mha" else _Projected()
    weight = model.in_proj_weight if kind == "mha" else model.qkv.weight  # type: ignore[union-attr]
    x = torch.randn(5, 2, 16)

    def call() -> None:
        if kind == "mha":
            model(x, x, x)
        else:
            model(x)

    expected = []
    with qkvtrace.trace(model) as t:
        for i in range(4):
            if i == 3:
                version = weight._version
                with torch.no_grad():
                    weight.data = torch.randn_like(weight) * 3
                assert weight._version == version  # only the storage says it changed
            w = weight.detach().double()
            expected.append([float(torch.linalg.vector_norm(w[j * 16 : (j + 1) * 16])) for j in range(3)])
            call()
    for record, want in zip(t.calls, expected, strict=True):
        got = [record.qkv.q.weight_norm, record.qkv.k.weight_norm, record.qkv.v.weight_norm]
        assert got == pytest.approx(want, rel=1e-5), (record.index, got, want)


@pytest.mark.parametrize("kind", ["mha", "sdpa"])
def test_a_closed_trace_leaves_no_tensor_alive_in_what_it_keeps_for_the_next(kind: str) -> None:
    """Witness: the interpreter's own list of live objects (``gc.get_objects``), counting tensors before a
    trace opens and after it closed (its records still held): what a trace keeps for the next trace of the
    same model (names, answers, weight norms) holds numbers, not tensors."""
    torch.manual_seed(12)
    model: nn.Module
    if kind == "mha":
        mha = model = nn.MultiheadAttention(16, 2)
        x = torch.randn(5, 2, 16)

        def run() -> None:
            mha(x, x, x)
    else:
        model = _Projected()
        x = torch.randn(2, 5, 16)

        def run() -> None:
            model(x)

    def tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    run()
    before = tensors()
    with qkvtrace.trace(model) as t:
        run()
    assert t.calls and t.calls[0].qkv.q.param is not None
    assert tensors() == before


@pytest.mark.parametrize("kind", ["mha", "encoder"])
def test_what_is_kept_between_traces_does_not_grow_with_the_traces(kind: str) -> None:
    """Witness: the interpreter's own list of live objects (``gc.get_objects``), counting the slice records
    (``QKVInfo``) alive after 10 traces of one unchanged model and after 60 more: one trace per step keeps what
    the first traces kept, not one more record a trace (a MultiheadAttention's spec made anew at each open used
    to file its weights' norms under a new key every time)."""
    torch.manual_seed(13)
    model: nn.Module
    if kind == "mha":
        model = nn.MultiheadAttention(16, 2)
        x = torch.randn(5, 2, 16)
        inputs: tuple[torch.Tensor, ...] = (x, x, x)
    else:
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
        inputs = (torch.randn(1, 4, 16),)

    def records_alive(traces: int) -> int:
        for _ in range(traces):
            with qkvtrace.trace(model) as t, torch.no_grad():
                model(*inputs)
            assert t.calls
        del t
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, qkvtrace.records.QKVInfo))

    first = records_alive(10)
    assert records_alive(60) == first
