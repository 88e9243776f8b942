"""What torch.compile made of each attention: records read from PyTorch's compile log while a trace is open.

Witnesses, all obtained here without qkvtrace:

* the FX graph Dynamo produced, captured by a backend written in the test (its nodes' functions and their
  ``nn_module_stack``), for which module wrote which attention entry point;
* ``torch.profiler`` on an untraced run of the same compiled model: which ATen attention op the compiled code
  calls (an SDPA kernel, or ``bmm`` and no SDPA kernel), hence whether inductor replaced a hand-written
  attention;
* shapes computed here from the model's own sizes; the eager model's output for bit-identical results.
"""

from __future__ import annotations

import math
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _witness import dynamo_graph as _dynamo_graph
from torch import nn

import qkvtrace

E, H, B, T = 16, 4, 2, 6
D = E // H

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor needs a C++ compiler on the CPU"
)
SDPA_OPS = ("scaled_dot_product", "_efficient_attention", "flash_attention")


class PackedSDPA(nn.Module):
    """A packed Q/K/V projection into SDPA, causal."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, E)


class ByHand(nn.Module):
    """softmax(Q Kᵀ / √d) V written out, on Q, K, V handed in."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(D)).softmax(dim=-1).matmul(v)


class ByHandMasked(nn.Module):
    """The same with a float32 upcast and a masked_fill before the softmax."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * D**-0.5
        blocked = torch.ones(T, T, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(blocked, float("-inf")).float().softmax(-1)
        return probs @ v


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.packed = PackedSDPA()
        self.by_hand = ByHand()
        self.masked = ByHandMasked()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor, need_weights: bool = False) -> torch.Tensor:
        y = self.packed(x)
        q, k, v = (y.view(B, T, H, D).transpose(1, 2) + i for i in range(3))
        z = self.by_hand(q, k, v) + self.masked(q * 2, k * 3, v)  # not the same scores: no common subexpression
        z = z.transpose(1, 2).reshape(B, T, E)
        return self.mha(z, z, z, need_weights=need_weights)[0]


class OnInputs(nn.Module):
    """The same written attention on a projected query and the key and value as given (a form inductor's pattern
    matcher may replace with an SDPA kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.by_hand = ByHand()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.by_hand(self.q_proj(q), k, v)


def _model(train: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Model().train(train), torch.randn(B, T, E)


def _module_name(path: str | None) -> str:
    """``L['self'].mha`` -> ``mha`` (the witness's own reading of Dynamo's path)."""
    if path is None:
        return ""
    return path.split("]", 1)[1].lstrip(".").replace("[", ".").replace("]", "")


def _profiled_ops(model: nn.Module, backend: str, *args: Any, train: bool = False) -> set[str]:
    """ATen ops of the second run of the compiled model, untraced (the first run compiles)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(train):
        compiled(*args)
        with torch.profiler.profile() as prof:
            compiled(*args)
    torch._dynamo.reset()
    return {e.name for e in prof.events()}


def _traced(model: nn.Module, backend: str, *args: Any, train: bool = False, fullgraph: bool = False
            ) -> tuple[qkvtrace.Trace, Any]:  # fmt: skip
    torch._dynamo.reset()
    with qkvtrace.trace(model) as t, torch.set_grad_enabled(train):
        out = torch.compile(model, backend=backend, fullgraph=fullgraph)(*args)
        if train:
            out.sum().backward()
    torch._dynamo.reset()
    return t, out


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_every_attention_in_the_graph_is_recorded_with_its_module(backend: str, fullgraph: bool) -> None:
    """Witness: the FX graph Dynamo hands a backend written here -- its SDPA nodes and its softmax nodes with
    their innermost module -- and the shapes computed from the model's sizes."""
    model, x = _model()
    graph = _dynamo_graph(model, x)
    sdpa_modules = {_module_name(p) for _, f, p in graph if f == "scaled_dot_product_attention"}
    softmax_modules = {_module_name(p) for _, f, p in graph if f in ("softmax", "_softmax")}
    assert {"packed"} <= sdpa_modules <= {"packed", "mha"} and {"by_hand", "masked"} <= softmax_modules
    # MultiheadAttention is in the graph as SDPA, as its function, or kept whole -- or not at all where Dynamo
    # broke the graph before it (the release decides)
    mha_in_graph = any(_module_name(p) == "mha" and f not in ("getitem", "transpose", "contiguous")
                       for _, f, p in graph)  # fmt: skip

    t, _ = _traced(model, backend, x, fullgraph=fullgraph)
    ops = t.result.compiled
    assert all(op.compiled for op in ops)
    by_module = {op.module: op for op in ops}
    assert set(by_module) == {"packed", "by_hand", "masked"} | ({"mha"} if mha_in_graph else set())
    assert by_module["packed"].entry == "sdpa" and by_module["packed"].mask == "is_causal"
    assert by_module["packed"].shapes == [[B, H, T, D]] * 3
    assert by_module["by_hand"].entry == by_module["masked"].entry == "hand_written"
    assert by_module["masked"].mask != "none" and "masked_fill" in by_module["masked"].mask
    assert by_module["by_hand"].mask == "none"
    assert not mha_in_graph or by_module["mha"].entry == "MultiheadAttention"
    assert {op.graph for op in ops} and all(op.runtime.startswith("not observed") for op in ops)
    assert t.calls == []  # what ran eagerly between graphs ran while the trace stood aside
    assert not {u.module for u in t.result.unobserved} & set(by_module)


def test_aot_eager_names_the_kernel_the_profiler_sees() -> None:
    """Witness: torch.profiler on an untraced run of the same model compiled with aot_eager -- the SDPA kernel
    it calls; and the hand-written attention runs as bmm, no SDPA kernel, under aot_eager (no pattern matcher)."""
    model, x = _model()
    seen = _profiled_ops(model, "aot_eager", x)
    kernel = next(op for op in seen if op.startswith("aten::") and any(s in op for s in SDPA_OPS)
                  and op != "aten::scaled_dot_product_attention")  # fmt: skip
    t, _ = _traced(model, "aot_eager", x)
    packed = next(op for op in t.result.compiled if op.module == "packed")
    assert packed.compiler == "aot"
    assert "aten." + kernel.split("::")[1] in packed.runs, (packed.runs, kernel)
    backend = {"_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
               "_scaled_dot_product_attention_math": "MATH"}.get(kernel.split("::")[1])  # fmt: skip
    if backend is not None:
        assert packed.sdpa_backend == backend
    by_hand = next(op for op in t.result.compiled if op.module == "by_hand")
    assert "aten.bmm" in by_hand.runs and by_hand.rewritten is None and by_hand.sdpa_backend is None


@needs_compiler
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_inductor_rewrites_are_what_the_profiler_sees(train: bool) -> None:
    """Witness: torch.profiler on an untraced run of the same model compiled with inductor. A hand-written
    attention recorded as rewritten must run an SDPA kernel in that profile, and the model's only SDPA kernels
    otherwise come from its own SDPA calls; the outputs equal the untraced compiled run's, bit for bit."""
    model, x = _model(train)
    seen = _profiled_ops(model, "inductor", x, train=train)
    sdpa_kernels = sum(1 for op in seen if op.startswith("aten::_scaled_dot_product") and "backward" not in op)
    torch._dynamo.reset()
    with torch.set_grad_enabled(train):  # the traced run's grad mode: inductor compiles another graph without grad
        expected = torch.compile(model, backend="inductor")(x)
    t, out = _traced(model, "inductor", x, train=train)
    assert torch.equal(out, expected)
    ops = {op.module: op for op in t.result.compiled}
    assert all(op.compiler == "inductor" for op in ops.values())
    packed = ops["packed"]
    assert any("scaled_dot_product" in r for r in packed.runs) == bool(sdpa_kernels)
    rewritten = [op for op in ops.values() if op.rewritten]
    for op in rewritten:
        assert op.entry in ("hand_written", "MultiheadAttention") and "replaced" in op.rewritten
        assert any(r.startswith("aten._scaled_dot_product") for r in op.runs), op.runs
    # the profile holds one distinct SDPA kernel name per kind; the records say which attention runs one
    kinds = {op.split("::")[1] for op in seen if op.startswith("aten::_scaled_dot_product") and "backward" not in op}
    recorded = {r.split("aten.")[-1] for op in ops.values() for r in op.runs
                if r.startswith("aten.") and "_scaled_dot_product" in r}  # fmt: skip
    assert recorded == kinds
    if train:
        assert any(op.backward for op in ops.values())
    for op in ops.values():
        if not op.rewritten and op.entry == "hand_written":
            assert any("bmm" in r for r in op.runs), op.runs


@needs_compiler
def test_a_hand_written_attention_inductor_replaces_is_said_to_be() -> None:
    """Witness: torch.profiler on an untraced inductor run of the same module: an SDPA kernel runs (the module
    calls none itself) exactly when the record says inductor replaced the written attention with one; the output
    equals the untraced compiled run's and is close to the eager module's."""
    torch.manual_seed(0)
    model = OnInputs().eval()
    q, k, v = (torch.randn(B, H, 16, D) for _ in range(3))
    seen = _profiled_ops(model, "inductor", q, k, v)
    fused = [op for op in seen if op.startswith("aten::_scaled_dot_product") and "backward" not in op]
    torch._dynamo.reset()
    with torch.no_grad():
        expected = torch.compile(model, backend="inductor")(q, k, v)
        eager = model(q, k, v)
    torch._dynamo.reset()
    with qkvtrace.trace(model) as t, torch.no_grad():
        out = torch.compile(model, backend="inductor")(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(out, expected) and torch.allclose(out, eager, atol=1e-5)
    (op,) = t.result.compiled
    assert op.module == "by_hand" and op.entry == "hand_written"
    assert bool(op.rewritten) == bool(fused), (op.rewritten, fused)
    if fused:
        assert op.runs == ["aten." + fused[0].split("::")[1]] and op.sdpa_backend is not None
    print(f"inductor {'replaced' if fused else 'kept'} the hand-written attention: {op.runs}")


def test_mha_with_and_without_weights() -> None:
    """Witness: the Dynamo graph (a backend written here) for the function the record says module mha called,
    and torch.profiler on an untraced aot_eager run: an SDPA kernel runs for MultiheadAttention exactly when the
    record's ``runs`` names one (need_weights=False), bmm and softmax otherwise."""

    class OnlyMHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x: torch.Tensor, need_weights: bool) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=need_weights)[0]

    torch.manual_seed(0)
    model, x = OnlyMHA().eval(), torch.randn(B, T, E)
    for need in (False, True):
        graph = _dynamo_graph(model, x, need)
        in_mha = [f for _, f, p in graph if _module_name(p) == "mha"]
        written = next((f for f in ("scaled_dot_product_attention", "multi_head_attention_forward", "softmax",
                                    "MultiheadAttention") if f in in_mha), None)  # fmt: skip
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            compiled(x, need)
            with torch.profiler.profile() as prof:
                compiled(x, need)
        sdpa_ran = any(e.name.startswith("aten::_scaled_dot_product") for e in prof.events())
        torch._dynamo.reset()
        with qkvtrace.trace(model) as t, torch.no_grad():
            torch.compile(model, backend="aot_eager")(x, need)
        torch._dynamo.reset()
        if written is None:  # Dynamo broke the graph before MultiheadAttention (some releases): nothing compiled
            assert t.result.compiled == []
            continue
        (op,) = t.result.compiled
        assert op.module == "mha" and op.entry == "MultiheadAttention"
        assert written in op.written, (written, op.written)
        assert any("_scaled_dot_product" in r for r in op.runs) == sdpa_ran, (need, op.runs)
        assert sdpa_ran != need  # PyTorch's MultiheadAttention: weights asked for, no fused kernel


def test_compiled_records_reach_the_json_and_the_cli(tmp_path: Any) -> None:
    """Witness: the trace/3 JSON schema (jsonschema) and the Dynamo graph of demo:tiny-lm (a backend written
    here) for the modules `qkvtrace trace --compile aot_eager` must list as compiled rows."""
    import json
    import os
    import subprocess
    import sys

    jsonschema = pytest.importorskip("jsonschema")
    from qkvtrace.analyses.demos import DEMOS

    model, args = DEMOS["tiny-lm"]()
    model.eval()
    graph = _dynamo_graph(model, *args)
    modules = sorted({_module_name(p) for _, f, p in graph if f == "scaled_dot_product_attention"})
    assert modules
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "trace", "demo:tiny-lm", "--compile", "aot_eager",
                           "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "compiled sdpa" in proc.stdout and "compiled: aot_eager" in proc.stdout
    data = json.loads(out.read_text())
    from importlib.resources import files

    schema = json.loads((files("qkvtrace") / "schemas" / "trace-3.json").read_text())
    jsonschema.validate(data, schema)
    assert sorted(c["module"] for c in data["compiled"]) == modules
    again = qkvtrace.TraceResult.from_dict(data)
    assert [c.module for c in again.compiled] == modules
    bad = subprocess.run([sys.executable, "-m", "qkvtrace", "trace", "demo:tiny-lm", "--compile", "no-such"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "not a torch.compile backend" in bad.stderr


class _Broken(nn.Module):
    """Two attention calls with a graph break the model asks for between them (``torch._dynamo.graph_break``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.MultiheadAttention(E, H, batch_first=True), nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x, x, x, need_weights=False)[0]
        torch._dynamo.graph_break()
        return self.b(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("model", ["encoder", "broken"])
def test_a_graph_break_is_said(model: str) -> None:
    """Witness: torch._dynamo.explain on the same model (untraced) counts its graph breaks: one in the model that
    asks for it (checked: explain must count it), none in the eval encoder on this PyTorch; the trace says one
    happened exactly where explain counts one."""
    if model == "broken":
        module: nn.Module = _Broken().eval()
    else:
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
        module = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(B, T, E)
    torch._dynamo.reset()
    with torch.no_grad():
        breaks = torch._dynamo.explain(module)(x).graph_break_count
    if model == "broken":
        assert breaks >= 1  # the premise: the break the model asks for is one Dynamo makes
    torch._dynamo.reset()
    with qkvtrace.trace(module) as t, torch.no_grad():
        torch.compile(module, backend="eager")(x)
    torch._dynamo.reset()
    said = [w for w in t.result.warnings if "broke a graph" in w]
    assert bool(said) == bool(breaks), (breaks, t.result.warnings)


def test_no_recompile_and_same_results_with_the_log_read() -> None:
    """Witness: a backend written here counts the graphs Dynamo compiles, traced and untraced, and the outputs
    of the untraced compiled model (torch.equal)."""
    model, x = _model(train=True)
    counts = []
    outs = []
    for traced in (False, True):
        compiled_graphs = 0

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            nonlocal compiled_graphs
            compiled_graphs += 1
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        torch._dynamo.reset()
        torch.manual_seed(1)
        compiled = torch.compile(model, backend=backend)
        if traced:
            with qkvtrace.trace(model) as t:
                out = compiled(x)
                out.sum().backward()
            assert t.result.compiled
        else:
            out = compiled(x)
            out.sum().backward()
        outs.append(out.detach())
        counts.append(compiled_graphs)
    torch._dynamo.reset()
    assert counts[0] == counts[1]
    assert torch.equal(outs[0], outs[1])


@needs_compiler
def test_inspect_says_which_written_forms_inductor_replaces() -> None:
    """Witness: torch.profiler on an untraced run of each form compiled with inductor (the report's own forms,
    run here through a module written in the test): an SDPA kernel runs exactly when the row names one, and a
    row that says 'not replaced' runs bmm and no SDPA kernel."""
    from qkvtrace.analyses.inductor_forms import FORMS, measure

    data = measure()
    assert data["skipped"] is None and len(data["forms"]) == 2 * len(FORMS)

    class Form(nn.Module):
        def __init__(self, fn: Any) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.fn(q, k, v, self.training)

    for row in data["forms"]:
        assert row["error"] is None, row
        train = row["mode"] == "train"
        q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=train) for _ in range(3))
        seen = _profiled_ops(Form(FORMS[row["form"]][1]).train(train), "inductor", q, k, v, train=train)
        kernels = sorted(op.split("::")[1] for op in seen if op.startswith("aten::_scaled_dot_product")
                         and "backward" not in op)  # fmt: skip
        assert (row["kernel"] is not None) == bool(kernels), (row, kernels)
        if row["kernel"] is not None:
            assert row["kernel"] == "aten." + kernels[0] and row["fused"] is True
        if row["fused"] is False:
            assert "aten::bmm" in seen and not kernels
    print({(r["form"], r["mode"]): r["fused"] for r in data["forms"]})


def _flex_or_skip() -> Any:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FlexAttention")
    return flex_attention


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=needs_compiler)])
def test_flex_attention_compiled(backend: str) -> None:
    """Witness: the graph Dynamo hands a backend written here (a flex_attention node in module ``attn``), and
    the eager module's output (the compiled one is close to it)."""
    flex_attention = _flex_or_skip()

    class Causal(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(qi >= ki, s, -float("inf")))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Causal()

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attn(q, k, v)

    model = Model()
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    graph = _dynamo_graph(model, q, k, v)
    flex_nodes = [_module_name(p) for _, f, p in graph if "flex_attention" in f]
    assert flex_nodes == ["attn"], graph
    torch._dynamo.reset()
    with qkvtrace.trace(model) as t, torch.no_grad():
        out = torch.compile(model, backend=backend)(q, k, v)
    torch._dynamo.reset()
    assert torch.allclose(out, model(q, k, v), atol=1e-5)
    (op,) = t.result.compiled
    assert (op.module, op.entry, op.shapes) == ("attn", "flex", [[1, 2, 128, 16]] * 3)
    assert op.runs and op.rewritten is None
    if backend == "inductor":  # flex's natural mode: one kernel generated from its template
        assert any("flex_attention" in r for r in op.runs), op.runs


def test_a_transformers_model_compiled() -> None:
    """Witness: GPT-2's attention modules found here by class name (GPT2Attention), and the graph Dynamo hands
    a backend written here (its SDPA nodes' modules); the compiled output equals the untraced compiled run's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 64, (2, 12))
    attention = sorted(n for n, m in model.named_modules() if type(m).__name__ == "GPT2Attention")
    graph = _dynamo_graph(model, ids)
    in_graph = sorted({_module_name(p) for _, f, p in graph if f == "scaled_dot_product_attention"})
    assert in_graph == attention, (in_graph, attention)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = torch.compile(model, backend="aot_eager")(ids).last_hidden_state
    torch._dynamo.reset()
    with qkvtrace.trace(model) as t, torch.no_grad():
        out = torch.compile(model, backend="aot_eager")(ids).last_hidden_state
    torch._dynamo.reset()
    assert torch.equal(out, expected)
    assert sorted(op.module for op in t.result.compiled) == attention
    assert all(op.entry == "sdpa" and op.compiler == "aot" and op.sdpa_backend for op in t.result.compiled)
    assert not {u.module for u in t.result.unobserved} & set(attention)


def test_transformer_encoder_in_training() -> None:
    """Witness: the graph Dynamo hands a backend written here for the same encoder in training (the modules of
    its attention nodes), and torch.profiler on an untraced aot_eager step (an SDPA kernel runs exactly when the
    records name one)."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    x = torch.randn(B, T, E)
    graph = _dynamo_graph(enc, x)
    kinds = ("scaled_dot_product_attention", "multi_head_attention_forward", "MultiheadAttention")
    in_graph = sorted({_module_name(p) for _, f, p in graph if f in kinds})
    if not in_graph:  # the release keeps the encoder whole in its graph (torch 2.4): no attention node to read
        assert [f for _, f, _ in graph] == ["TransformerEncoder"], graph
        t, _ = _traced(enc, "aot_eager", x, train=True)
        assert t.result.compiled == []
        assert {"layers.0.self_attn", "layers.1.self_attn"} <= {u.module for u in t.result.unobserved}
        return
    assert in_graph == ["layers.0.self_attn", "layers.1.self_attn"], graph
    seen = _profiled_ops(enc, "aot_eager", x, train=True)
    sdpa_ran = any(op.startswith("aten::_scaled_dot_product") for op in seen)
    t, _ = _traced(enc, "aot_eager", x, train=True)
    assert sorted(op.module for op in t.result.compiled) == in_graph
    for op in t.result.compiled:
        assert op.entry == "MultiheadAttention" and op.compiler == "aot"
        assert any("_scaled_dot_product" in r for r in op.runs) == sdpa_ran, op.runs


def test_counting_runs_of_compiled_code_misses_them_or_recompiles() -> None:
    """Why ``runtime`` says "not observed", measured with the only per-call hook a module offers, a forward hook
    that counts. Witnesses: the hook's own count and Dynamo's ``unique_graphs`` counter. Added after the graph was
    compiled, the hook never runs (the count says 0 for calls that happened); present when it is compiled, it runs
    but the frame is compiled again (and once more when the hook goes)."""
    model, x = _model()
    counters = torch._dynamo.utils.counters
    outcomes = {}
    for when in ("after", "before"):
        torch._dynamo.reset()
        counters.clear()
        calls = [0]

        def hook(*args: Any, calls: list[int] = calls) -> None:
            calls[0] += 1

        compiled = torch.compile(model, backend="eager")
        handle = model.by_hand.register_forward_hook(hook) if when == "before" else None
        with torch.no_grad():
            compiled(x)
            handle = handle or model.by_hand.register_forward_hook(hook)
            first = counters["stats"]["unique_graphs"]
            for _ in range(3):
                compiled(x)
            handle.remove()
            compiled(x)
        outcomes[when] = (calls[0], counters["stats"]["unique_graphs"] - first)
    torch._dynamo.reset()
    missed, recompiled_after = outcomes["after"]
    seen, recompiled_before = outcomes["before"]
    assert missed == 0 or recompiled_after > 0, outcomes  # three calls happened; a free hook saw none of them
    assert seen >= 4 and recompiled_before > 0, outcomes  # a hook that sees them costs compilations
    print(f"hook added after compiling: {missed} of 3 calls counted, {recompiled_after} recompiles; "
          f"present when compiled: {seen} counted, {recompiled_before} recompiles")


def test_sdpa_decomposed_by_aot_autograd_is_said() -> None:
    """Witness: torch.profiler on an untraced aot_eager training step of the same module: whether an SDPA kernel
    runs. SDPA with dropout in training is decomposed into ATen ops on this CPU on some releases; the record
    says "decomposed" exactly when no SDPA kernel runs, and names the kernel when one does."""

    class Dropping(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)

    model = Dropping().train()
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    seen = _profiled_ops(model, "aot_eager", q, k, v, train=True)
    kernels = [op for op in seen if op.startswith("aten::_scaled_dot_product") and "backward" not in op]
    t, _ = _traced(model, "aot_eager", q, k, v, train=True)
    (op,) = t.result.compiled
    assert op.entry == "sdpa" and op.compiler == "aot"
    if kernels:
        assert op.rewritten is None and "aten." + kernels[0].split("::")[1] in op.runs, (op.runs, kernels)
    else:
        assert op.rewritten and op.rewritten.startswith("decomposed into ATen ops"), op
        assert not any("scaled_dot_product" in r for r in op.runs)
    print("kernels:", kernels, "| record:", op.runs, op.rewritten)
