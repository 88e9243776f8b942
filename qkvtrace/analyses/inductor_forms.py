"""What inductor does with attention written by hand, measured on the installed PyTorch.

Inductor's pattern matcher (``torch/_inductor/fx_passes/fuse_attention.py``)
can put an SDPA kernel in place of a hand-written
``softmax(Q Kᵀ · scale [+ mask]) V``; which forms it replaces, in inference
and in training, changes between releases. :func:`measure` compiles a few
common forms with inductor inside a trace and reads, from the trace's
compiled records (PyTorch's own compile log), whether the code inductor
generated calls an SDPA kernel for them or keeps the matmuls and a softmax.
Nothing here is a table of expectations: every row is a compilation now.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FORMS", "measure"]

B, H, T, D = 2, 4, 16, 8
_SCALE = 1 / math.sqrt(D)


def _mask() -> torch.Tensor:
    return torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


#: name -> (the form as a user writes it, its forward)
FORMS: dict[str, tuple[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]]] = {
    "matmul-div": (
        "torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(d)).softmax(-1).matmul(v)",
        lambda q, k, v, train: torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(D)).softmax(dim=-1).matmul(v),
    ),
    "at-mul": (
        "(q @ k.transpose(-2, -1) * scale).softmax(-1) @ v",
        lambda q, k, v, train: (q @ k.transpose(-2, -1) * _SCALE).softmax(-1) @ v,
    ),
    "additive-mask": (
        "(q @ k.transpose(-2, -1) * scale + mask).softmax(-1) @ v",
        lambda q, k, v, train: (q @ k.transpose(-2, -1) * _SCALE + _mask()).softmax(-1) @ v,
    ),
    "dropout": (
        "F.dropout((q @ k.transpose(-2, -1) * scale).softmax(-1), 0.1, training) @ v",
        lambda q, k, v, train: F.dropout((q @ k.transpose(-2, -1) * _SCALE).softmax(-1), 0.1, train) @ v,
    ),
}


class _Attention(nn.Module):
    def __init__(self, form: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.form = form

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.form(q, k, v, self.training)


def _one(name: str, train: bool) -> dict[str, Any]:
    from qkvtrace.tracer import trace

    written, form = FORMS[name]
    row: dict[str, Any] = {"form": name, "written": written, "mode": "train" if train else "eval"}
    model = _Attention(form).train(train)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, requires_grad=train) for _ in range(3))
    torch._dynamo.reset()
    try:
        with trace(model) as t, torch.set_grad_enabled(train):
            out = torch.compile(model, backend="inductor")(q, k, v)
            if train:
                out.sum().backward()
    except Exception as e:  # a release whose inductor cannot compile the form: said, not hidden
        return {**row, "fused": None, "kernel": None, "runs": [], "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch._dynamo.reset()
    ops = [op for op in t.result.compiled if op.entry == "hand_written"]
    if not ops:
        return {**row, "fused": None, "kernel": None, "runs": [], "error": "no hand-written attention in the graph"}
    op = ops[0]
    kernel = next((r for r in op.runs if r.startswith("aten.") and "scaled_dot_product" in r), None)
    return {**row, "fused": op.rewritten is not None, "kernel": kernel, "runs": op.runs, "error": None}


def measure(progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One row per form and mode; ``skipped`` says why nothing was measured (no C++ compiler for inductor)."""
    if not torch.cuda.is_available() and not any(shutil.which(c) for c in ("g++", "c++", "clang++", "cl")):
        return {"skipped": "inductor needs a C++ compiler on the CPU; none found", "forms": []}
    rows = []
    for name in FORMS:
        for train in (False, True):
            if progress is not None:
                progress(f"inductor: {name} ({'train' if train else 'eval'})")
            rows.append(_one(name, train))
    return {"skipped": None, "forms": rows}
