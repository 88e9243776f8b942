"""What a record costs to keep: under a kilobyte a call, and nothing in it but plain values.

Witnesses: ``tracemalloc`` for the Python memory still held after ``gc.collect()``, and
``gc.get_referents`` walked here from the result for any tensor, module or autograd node.
"""

from __future__ import annotations

import gc
import tracemalloc

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
