"""What a record costs to keep: under a kilobyte a call, nothing in it but plain values, and nothing saved for
the backward pass.

Witnesses: ``tracemalloc`` for the Python memory still held after ``gc.collect()``,
``gc.get_referents`` walked here from the result for any tensor, module or autograd node, and PyTorch's
saved-tensor hooks for what autograd saves.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest
import torch
from torch import nn

import qkvtrace

CALLS = 2000


def _reachable(root: object) -> list[object]:
    seen, todo, out = {id(root)}, [root], []
    while todo:
        obj = todo.pop()
        out.append(obj)
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, type):
                seen.add(id(ref))
                todo.append(ref)
    return out


def test_a_loop_of_small_calls_holds_under_a_kilobyte_a_call_and_no_tensor() -> None:
    """Witness: tracemalloc's count of the bytes still allocated (after gc) by a trace that recorded CALLS
    calls of one small MultiheadAttention (training mode, grad on: routes and slice gradients armed), and the
    objects reachable from its result, walked here."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 8)
    x = torch.randn(2, 10, 64)
    with qkvtrace.trace(mha):  # the one-off work of a first call (its kernels profiled once) is not counted
        mha(x, x, x)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = qkvtrace.trace(mha, max_records=CALLS)
        with t:
            for _ in range(CALLS):
                mha(x, x, x)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(t.calls) == CALLS
    assert held / CALLS <= 1024, f"{held / CALLS:.0f} B a call"
    objects = _reachable(t.result)
    kinds = {type(o).__name__ for o in objects}
    assert not any(isinstance(o, (torch.Tensor, nn.Module)) for o in objects), kinds
    assert not any("Backward" in k or k == "Node" for k in kinds), kinds


class _OwnSDPA(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _saves(step: Any) -> int:
    """Tensors PyTorch's autograd saves for the backward pass while ``step`` runs."""
    packed = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packed
        packed += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return packed


@pytest.mark.parametrize("keep", ["all", "changes"])
@pytest.mark.parametrize("case", ["mha", "sdpa", "sdpa large"])
def test_a_traced_call_saves_for_backward_only_what_the_untraced_call_saves(case: str, keep: str) -> None:
    """A record's numbers (NaN counts, the norms of the Q, K and V a call received, which need grad here) are
    computed without autograd: no node of theirs saves a tensor, so no activation outlives its pass for them.
    Witness: PyTorch's own saved-tensor hooks counting what autograd saves during each of several calls (the
    first ones and the steady ones after them), traced and untraced. ``sdpa large``: an output of 32,768 values,
    whose NaNs are counted by arithmetic rather than by ``isnan``."""
    torch.manual_seed(0)
    if case == "mha":
        model: nn.Module = nn.MultiheadAttention(64, 8)
        x = torch.randn(2, 10, 64)
        inputs: tuple[torch.Tensor, ...] = (x, x, x)
    else:
        model = _OwnSDPA()
        shape = (2, 4, 64, 64) if case == "sdpa large" else (2, 4, 16, 32)
        inputs = tuple(torch.randn(shape, requires_grad=True) for _ in range(3))
    untraced = [_saves(lambda: model(*inputs)) for _ in range(4)]
    with qkvtrace.trace(model, keep=keep) as t:
        traced = [_saves(lambda: model(*inputs)) for _ in range(4)]
    assert untraced[0] > 0
    assert traced == untraced
    if keep == "all":
        assert len(t.calls) == 4
        assert all(c.qkv.q.activation_norm is not None for c in t.calls) == (case != "mha")
