"""The independent witness of the tracer tests: ``torch.profiler`` on an un-instrumented run.

``profiled`` keeps the ``aten::`` attention ops a run executed, in order, and
groups them per outermost attention op; ``learn_kernel_backends`` maps each
SDPA kernel op to its ``SDPBackend`` by forcing every backend under the
profiler; ``local_at_return`` reads PyTorch's own local variables (the fast-path
reason strings) on an un-instrumented run; ``dynamo_graph`` reads the graph Dynamo
hands a backend written here. Nothing here asks qkvtrace anything.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from qkvtrace.facts.paths import is_attention_op

SDPA = "aten::scaled_dot_product_attention"


def benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` loaded as a module (registered under a name of its own: dataclasses look their
    module up by name); the folder a benchmark puts first on ``sys.path`` is taken off again."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"qkvtrace_benchmark_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = [p for p in sys.path if p != str(path.parent)]
    return module


@dataclass
class Witness:
    out: Any
    ops: list[str]  # attention aten ops, in execution order
    segments: list[list[str]]  # one per outermost attention op, with its attention descendants


def profiled(fn: Callable[[], Any]) -> Witness:
    """Run ``fn`` under the CPU profiler; keep its attention ops in order."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    events = [e for e in prof.events() if is_attention_op(e.name)]
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    segments: list[list[str]] = []
    for e in events:
        parent = e.cpu_parent
        while parent is not None and not is_attention_op(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            segments.append([e.name])
        else:
            assert segments, "a nested attention op before any outer one"
            segments[-1].append(e.name)
    return Witness(out, [e.name for e in events], segments)


def learn_kernel_backends(batch: int, heads: int, length: int, head_dim: int) -> dict[str, str]:
    """Kernel op -> SDPBackend name, learned by forcing each backend under the profiler."""
    seen: dict[str, set[str]] = {}
    x = torch.randn(batch, heads, length, head_dim, generator=torch.Generator().manual_seed(0))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for name, backend in SDPBackend.__members__.items():
        if name == "ERROR":
            continue
        for requires_grad in (False, True):
            q = x.clone().requires_grad_(requires_grad)
            for kwargs in ({}, {"is_causal": True}, {"attn_mask": causal}, {"dropout_p": 0.1}):
                try:
                    # a forced backend that refuses the arguments warns why, then raises
                    with sdpa_kernel(backend), warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        w = profiled(lambda: F.scaled_dot_product_attention(q, q, q, **kwargs))  # noqa: B023
                except RuntimeError:  # this backend cannot run here
                    continue
                assert w.segments == [w.ops] and w.ops[0] == SDPA, w.ops
                kernels = w.ops[1:]
                assert len(kernels) == 1, f"{name}: expected one kernel under SDPA, saw {w.ops}"
                seen.setdefault(kernels[0], set()).add(name)
    ambiguous = {k: v for k, v in seen.items() if len(v) != 1}
    assert not ambiguous, f"one kernel op for several backends: {ambiguous}"
    mapping = {k: next(iter(v)) for k, v in seen.items()}
    assert "MATH" in mapping.values(), mapping
    return mapping


def graph_names(out: torch.Tensor) -> list[str]:
    """Every node name of ``out``'s autograd graph, breadth first (an un-instrumented run's backward)."""
    names, queue, seen, kept = [], deque([out.grad_fn]), set(), []
    while queue:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        kept.append(node)  # ids are unique only while the nodes live (torch 2.4 frees them when unheld)
        seen.add(id(node))
        names.append(node.name())
        queue.extend(child for child, _ in node.next_functions)
    return names


def attention_core(out: torch.Tensor) -> str:
    """The attention core of an un-instrumented graph, said as the tracer says it."""
    names = graph_names(out)
    fused = [n for n in names if "ScaledDotProduct" in n]
    if fused:
        return fused[0]
    softmax = next(n for n in names if "Softmax" in n)
    # the product with V is the first matmul met above the softmax, breadth first from the output
    matmul = next(n for n in names if n.startswith(("Bmm", "Mm", "Matmul")))
    return f"{softmax} + {matmul}"


def local_at_return(code: Any, var: str, fn: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """Run ``fn`` un-instrumented except for a trace function reading local ``var``
    of every frame of ``code`` as it returns (a second, independent reader of
    PyTorch's own reason variables)."""
    seen: list[Any] = []
    previous = sys.gettrace()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            seen.append(frame.f_locals.get(var))
        return local

    def global_(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is code:
            frame.f_trace_lines = False
            return local
        return None

    sys.settrace(global_)
    try:
        out = fn()
    finally:
        sys.settrace(previous)
    return out, seen


#: the environment the CLI runs in for tests: a wide terminal, no warnings in its output
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def qkv(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``qkvtrace ARGS`` in a subprocess of this interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "qkvtrace", *args],
        capture_output=True, text=True, cwd=cwd, env=ENV, timeout=300,
    )  # fmt: skip


def dynamo_graph(model: torch.nn.Module, *args: Any, **kwargs: Any) -> list[tuple[str, str, str | None]]:
    """(node name, function name, innermost module path) of every call in the graph(s) Dynamo hands a backend
    written here -- the witness for what the model wrote where."""
    nodes: list[tuple[str, str, str | None]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method", "call_module"):
                stack = n.meta.get("nn_module_stack")
                path = list(stack.values())[-1][0] if stack else None
                if n.op == "call_module":  # a module kept whole (releases that do not inline torch.nn modules)
                    name = type(gm.get_submodule(n.target)).__name__
                else:
                    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                nodes.append((n.name, name, path))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(*args, **kwargs)
    torch._dynamo.reset()
    return nodes


def sdpa_choice(*args: Any, **kwargs: Any) -> str:
    """The backend PyTorch's own chooser picks for these SDPA arguments (``torch._fused_sdp_choice``), by name."""
    value = torch._fused_sdp_choice(*args, **kwargs)
    return {int(b): n for n, b in SDPBackend.__members__.items()}[int(value)]


def ranked_above(chosen: str) -> list[str]:
    """The SDPA backends PyTorch ranks above ``chosen`` (its own priority order)."""
    names = {int(b): n for n, b in SDPBackend.__members__.items()}
    order = [names[int(v)] for v in torch._C._get_sdp_priority_order()]
    return order[: order.index(chosen)]


def sdpa_refusal_of_mask_with_causal() -> str | None:
    """PyTorch's own error for an SDPA call given both ``attn_mask`` and ``is_causal=True`` (releases from 2.14 refuse
    it), ``None`` where it takes the two together: asked of the installed PyTorch, untraced."""
    q = torch.randn(1, 1, 3, 4)
    try:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    except RuntimeError as exc:
        return str(exc)
    return None


class DirectSDPA(nn.Module):
    """A model whose forward is one SDPA call on the tensors ``make()`` gives, with ``kwargs``."""

    def __init__(self, make: Callable[[], tuple[Any, ...]], **kwargs: Any) -> None:
        super().__init__()
        self.make = make
        self.kwargs = kwargs

    def forward(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(*self.make(), **self.kwargs)
