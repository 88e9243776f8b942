"""Compiled models as they run in production: compiled before the trace, traced by the user's own module.

The pattern people use: ``compiled = torch.compile(model)`` early, then a
trace opened around the first compiled call(s), as ``trace(model)`` or
``trace(compiled)``. Witnesses, independent of qkvtrace:

* the graphs Dynamo hands its backend (a counting backend written here that
  then calls PyTorch's own backend of that name) and Dynamo's own counters
  (``torch._dynamo.utils.counters``): no graph more after the trace closes
  than a twin run with no trace at all;
* the outputs of an untraced twin compiled the same way (``torch.equal``);
* ``torch.profiler`` on the untraced compiled run: the SDPA kernel that ran,
  named by backend through a table learned by forcing each backend.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from _witness import learn_kernel_backends
from test_compiled import Counting
from torch import nn

import qkvtrace
from qkvtrace.analyses.demos import demo_tiny_lm

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor needs a C++ compiler on the CPU"
)


def _run(compiled: nn.Module, tokens: torch.Tensor, train: bool) -> torch.Tensor:
    torch.manual_seed(5)
    with torch.set_grad_enabled(train):
        out = compiled(tokens)
        if train:
            out.square().mean().backward()
    return out.detach()


def _graphs_of(backend: str, train: bool, traced: str | None) -> tuple[list[int], list[torch.Tensor], Any]:
    """Compile the tiny LM before any trace; run it 3 times, the first inside a trace of ``traced`` (``"model"``,
    ``"compiled"`` or ``None``): the graph count after each run, the outputs, and the trace."""
    torch._dynamo.reset()
    model, (tokens,) = demo_tiny_lm()
    model.train(train)
    counting = Counting(backend)
    compiled = torch.compile(model, backend=counting)
    counts, outs, t = [], [], None
    for i in range(3):
        if i == 0 and traced is not None:
            with qkvtrace.trace(model if traced == "model" else compiled) as t:
                outs.append(_run(compiled, tokens, train))
        else:
            outs.append(_run(compiled, tokens, train))
        counts.append(counting.graphs)
    return counts, outs, t


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("traced", ["model", "compiled"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_no_graph_after_the_trace_whatever_is_traced(backend: str, traced: str, train: bool) -> None:
    """Witness: the counting backend and an untraced twin run of the same compiled model: the graph counts
    after each of three runs, the first inside the trace, equal the twin's; the outputs are bit-identical."""
    plain_counts, plain_outs, _ = _graphs_of(backend, train, None)
    counts, outs, t = _graphs_of(backend, train, traced)
    assert counts == plain_counts, f"graphs after each run: {counts}, untraced {plain_counts}"
    assert all(torch.equal(a, b) for a, b in zip(outs, plain_outs, strict=True))
    assert t is not None and len(t.result.compiled) == 2  # one SDPA per block, seen in the graph compiled inside


@needs_compiler
def test_no_graph_after_the_trace_with_inductor() -> None:
    """Witness: Dynamo's own counters (``unique_graphs`` and ``recompiles``) and the counting backend: the tiny
    LM compiled before the trace, first run inside ``trace(model)``, then twice after it, compiles once."""
    from torch._dynamo.utils import counters

    counters.clear()
    counts, _, t = _graphs_of("inductor", False, "model")
    assert counts == [1, 1, 1]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert t is not None and {c.sdpa_backend for c in t.result.compiled} != {None}


def test_eager_backend_records_the_sdpa_backend_that_runs() -> None:
    """Witness: ``torch.profiler`` on the untraced compiled run (``eager`` backend): the kernel under
    ``aten::scaled_dot_product_attention``, named by backend through a table learned by forcing each one."""
    kernels = learn_kernel_backends(2, 4, 16, 16)
    torch._dynamo.reset()
    model, (tokens,) = demo_tiny_lm()
    model.eval()
    twin = torch.compile(demo_tiny_lm()[0].eval(), backend="eager")
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        twin(tokens)
    ran = {kernels[e.name] for e in prof.events() if e.name in kernels}
    assert len(ran) == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), qkvtrace.trace(model) as t:
        compiled(tokens)
    assert [c.sdpa_backend for c in t.result.compiled] == [next(iter(ran))] * 2
    assert all(any("_fused_sdp_choice" in e for e in c.evidence) for c in t.result.compiled)
