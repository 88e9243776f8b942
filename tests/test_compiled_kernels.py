"""Which kernels of inductor's code a compiled attention record lists: those that compute attention, all of them.

Witnesses, obtained here without qkvtrace, on an untraced run of the same model compiled with inductor:

* inductor's own generated code (``torch._inductor.utils.run_and_get_code``), read by the test: in this model
  every ``bmm`` is attention's (the projections are ``Linear``: ``addmm`` forward, ``mm`` backward), and every
  generated kernel named after ``_softmax_backward_data`` is the backward of an attention's softmax;
* ``torch.profiler`` on a second run, forward and backward: the ``aten::bmm`` calls and the SDPA kernels run.
"""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

#: on the tests that compile with inductor only: aot_eager and eager need no compiler, so theirs run everywhere
_NEEDS_CXX = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor needs a C++ compiler on the CPU"
)

E, H, B, T = 16, 4, 2, 6
D = E // H


class Block(nn.Module):
    """A packed Q/K/V projection, an attention written one of three ways, an output projection."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.kind == "by_hand":
            y = (q @ k.transpose(-2, -1) / math.sqrt(D)).softmax(-1) @ v
        elif self.kind == "dropout":  # SDPA with dropout on the CPU: inductor decomposes it into bmm
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25 if self.training else 0.0)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, E))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Block("by_hand"), nn.GELU(), Block("dropout"), nn.GELU(), Block("fused")).train()
    return model, torch.randn(B, T, E)


class Net(nn.Module):
    """The same blocks in a model of the user's own class (Dynamo compiles its ``forward``)."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * 2


def _step(compiled: nn.Module, x: torch.Tensor) -> None:
    compiled(x).sum().backward()


def _calls(code: str) -> list[str]:
    """The test's own reading of a generated ``call``: the callee of each line that calls a kernel."""
    body = code.split("def call(", 1)[1].split("\ndef ", 1)[0]
    found = []
    for line in body.splitlines():
        m = re.match(r"\s*(?:buf\d+ = )?(extern_kernels\.\w+|torch\.ops\.aten\.[\w.]+|cpp_\w+)\(", line)
        if m:
            found.append(m.group(1).removeprefix("torch.ops.").removesuffix(".default"))
    return found


@_NEEDS_CXX
def test_runs_and_backward_list_attention_kernels_and_only_those() -> None:
    """Witness: inductor's generated code and the profiler of an untraced run of the same compiled model (see the
    module docstring). Faults caught: the output projection's ``addmm`` (whose inductor comment names the
    attention output as a fused view) listed in ``runs``; the layout copy after attention listed; a backward
    list missing the bmm, softmax-backward or SDPA-backward kernels the generated code calls for attention (it
    listed one ``bmm`` of four, and nothing for a decomposed dropout SDPA); a projection's gradient ``mm`` listed."""
    from torch._inductor.utils import run_and_get_code

    model, x = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    _, codes = run_and_get_code(_step, compiled, x)
    with torch.profiler.profile() as prof:
        _step(compiled, x)
    profiled = [e.name for e in prof.events()]
    forward_code = next(c for c in codes if "tangents_" not in c.split("def call(", 1)[1].split("\n", 3)[1])
    backward_code = next(c for c in codes if "tangents_" in c.split("def call(", 1)[1].split("\n", 3)[1])
    forward, backward = _calls(forward_code), _calls(backward_code)

    torch._dynamo.reset()
    with qkvtrace.trace(model) as t:
        _step(torch.compile(model, backend="inductor"), x)
    torch._dynamo.reset()
    ops = {op.module: op for op in t.result.compiled}
    assert set(ops) == {"0", "2", "4"}, ops
    runs = [k for op in ops.values() for k in op.runs]
    back = [k for op in ops.values() for k in op.backward]

    # nothing a projection computes: addmm forward, mm backward
    assert not [k for k in runs if "addmm" in k or k.endswith(".mm")], runs
    assert not [k for k in back if "addmm" in k or k.endswith(".mm")], back
    # every bmm of the generated code, forward and backward, is attention's: all listed, each under one record
    assert runs.count("extern_kernels.bmm") == forward.count("extern_kernels.bmm")
    assert back.count("extern_kernels.bmm") == backward.count("extern_kernels.bmm") > 0
    assert runs.count("extern_kernels.bmm") + back.count("extern_kernels.bmm") == profiled.count("aten::bmm")
    # every softmax backward inductor generated, and every SDPA kernel forward and backward, is listed
    softmax_back = [k for k in backward if k.startswith("cpp_") and "_softmax_backward_data" in k]
    assert softmax_back and sorted(k for k in back if k in softmax_back) == sorted(softmax_back)
    for kernel in {k for k in forward + backward if k.startswith("aten._scaled_dot_product")}:
        assert ("aten::" + kernel.removeprefix("aten.")) in profiled
        assert (back if "backward" in kernel else runs).count(kernel) == (backward if "backward" in kernel
                                                                          else forward).count(kernel)  # fmt: skip
    # each record's backward holds the backward of its own forward kernels
    fused = ops["4"]
    if any("_scaled_dot_product" in k for k in fused.runs):
        assert any("_scaled_dot_product" in k and "backward" in k for k in fused.backward), fused.backward
    for name in ("0", "2"):
        if "extern_kernels.bmm" in ops[name].runs:  # decomposed: two bmm forward, four backward
            assert ops[name].runs.count("extern_kernels.bmm") == 2, ops[name].runs
            assert ops[name].backward.count("extern_kernels.bmm") == 4, ops[name].backward
            assert any("_softmax_backward_data" in k for k in ops[name].backward), ops[name].backward


def test_aot_eager_lists_every_attention_op_forward_and_backward() -> None:
    """Witness: torch.profiler on an untraced second run of the same model compiled with aot_eager, forward and
    backward: every ``aten::bmm`` (only attention calls bmm here), ``aten::_softmax_backward_data`` and SDPA
    kernel it shows. Faults caught: a list with each op once however often it runs; a backward list empty because
    AOTAutograd's backward graph names the SDPA node by the name it was made under, not Dynamo's final name."""
    model, x = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    _step(compiled, x)
    with torch.profiler.profile() as prof:
        _step(compiled, x)
    profiled = [e.name.removeprefix("aten::") for e in prof.events() if e.name.startswith("aten::")]
    torch._dynamo.reset()
    with qkvtrace.trace(model) as t:
        _step(torch.compile(model, backend="aot_eager"), x)
    torch._dynamo.reset()
    ops = {op.module: op for op in t.result.compiled}
    assert set(ops) == {"0", "2", "4"} and all(op.compiler == "aot" for op in ops.values()), ops
    listed = [k.removeprefix("aten.") for op in ops.values() for k in op.runs + op.backward]
    assert all(op.backward for op in ops.values()), {m: op.backward for m, op in ops.items()}
    for kernel in {k for k in profiled if k == "bmm" or k == "_softmax_backward_data" or ("_scaled_dot_product" in k
                   and not k.startswith("_scaled_dot_product_attention"))}:  # fmt: skip
        assert listed.count(kernel) == profiled.count(kernel), (kernel, listed, profiled.count(kernel))


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("own_class", [False, True], ids=["sequential", "own-class"])
@pytest.mark.parametrize("traced", ["model", "compiled"])
@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=_NEEDS_CXX), "aot_eager", "eager"])
def test_graphs_compiled_and_run_before_the_trace_are_recorded(backend: str, traced: str, own_class: bool) -> None:
    """The usual way: compiled and warmed up (forward and backward), then a trace opened around one more step.
    Witnesses: torch.profiler on an untraced step of the same compiled model (the ``aten::bmm`` calls, which only
    attention makes here, and the SDPA kernels, forward and backward); Dynamo's ``unique_graphs`` counter before,
    during and after the trace; the untraced step's output under the same seed. Faults caught: graphs compiled
    before the trace listed unobserved (nothing was recorded), a recompile, an output changed."""
    model, x = _model()
    if own_class:
        model = Net(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    _step(compiled, x)  # compiled and run before the trace
    torch.manual_seed(1)
    with torch.profiler.profile() as prof:
        expected = compiled(x)
        expected.sum().backward()
    profiled = [e.name.removeprefix("aten::") for e in prof.events() if e.name.startswith("aten::")]
    graphs = _unique_graphs()
    with qkvtrace.trace(model if traced == "model" else compiled) as t:
        torch.manual_seed(1)
        out = compiled(x)
        out.sum().backward()
        during = _unique_graphs()
    _step(compiled, x)
    after = _unique_graphs()
    torch._dynamo.reset()
    assert torch.equal(out, expected)
    assert graphs == during == after, (graphs, during, after)
    ops = {op.module.removeprefix("layers."): op for op in t.result.compiled}
    assert set(ops) == {"0", "2", "4"}, ops
    assert not t.result.unobserved, t.result.unobserved
    assert all("compiled before the trace opened" in op.evidence[0] for op in ops.values())
    assert ops["0"].entry == "hand_written" and ops["4"].entry == ops["2"].entry == "sdpa"
    if backend == "eager":  # the graph runs as captured: PyTorch picks the SDPA kernel when it runs
        kernels = [k for k in profiled if k.startswith("_scaled_dot_product") and "backward" not in k]
        backend_of = {"_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
                      "_scaled_dot_product_attention_math": "MATH"}  # fmt: skip
        assert [ops["2"].sdpa_backend, ops["4"].sdpa_backend] == [backend_of[k] for k in kernels], kernels
        return
    listed = [k.removeprefix("aten.").removeprefix("extern_kernels.") for op in ops.values()
              for k in op.runs + op.backward]  # fmt: skip
    assert all(op.backward for op in ops.values()), {m: op.backward for m, op in ops.items()}
    assert listed.count("bmm") == profiled.count("bmm") > 0
    for kernel in {k for k in profiled if k.startswith("_scaled_dot_product") and "attention_math" not in k
                   and k != "_scaled_dot_product_attention"}:  # fmt: skip
        assert kernel in listed, (kernel, listed)


@pytest.mark.parametrize("own_class", [False, True], ids=["sequential", "own-class"])
def test_an_eager_twin_of_a_compiled_model_has_no_compiled_records(own_class: bool) -> None:
    """A model of the same class and structure as one compiled and run before, itself run eagerly: Dynamo's cache
    holds graphs for its class's code, but no compiled code runs for it. Witness: torch.profiler on the traced
    run of the twin (its eager attention ops, the same as an untraced eager run's). Fault caught: compiled
    records for a module that runs eagerly."""
    model, x = _model()
    twin, _ = _model()
    if own_class:
        model, twin = Net(model), Net(twin)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    _step(compiled, x)
    with torch.profiler.profile() as untraced:
        twin(x)
    with qkvtrace.trace(twin) as t, torch.profiler.profile() as traced:
        twin(x)
    torch._dynamo.reset()
    assert t.result.compiled == [], [op.module for op in t.result.compiled]
    ops = sorted(e.name for e in untraced.events() if "scaled_dot_product" in e.name or e.name == "aten::bmm")
    assert ops and ops == sorted(e.name for e in traced.events() if "scaled_dot_product" in e.name
                                 or e.name == "aten::bmm")  # fmt: skip
    assert {c.module.removeprefix("layers.") for c in t.result.calls} >= {"2", "4"}


class Broken(nn.Module):
    """Two attention blocks with a graph break between them: Dynamo compiles a graph for each side."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block("fused"), Block("by_hand")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def test_graphs_on_both_sides_of_a_graph_break_compiled_before_the_trace() -> None:
    """Witness: Dynamo's own count of the graphs it compiled for the model (``unique_graphs``: two, one each side
    of the break), and the model's own modules: each block's attention is recorded, from its side's graph. Fault
    caught: only the graph before the break read (the one after it sits on the function Dynamo resumes at)."""
    torch.manual_seed(0)
    model, x = Broken().eval(), torch.randn(B, T, E)
    torch._dynamo.reset()
    before = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(x)
        assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - before == 2
        with qkvtrace.trace(model) as t:
            compiled(x)
    torch._dynamo.reset()
    ops = {op.module: op for op in t.result.compiled}
    assert set(ops) == {"first", "second"}, ops
    assert ops["first"].graph != ops["second"].graph
    assert "resumed after a graph break" in ops["second"].evidence[0]
    assert not t.result.unobserved
