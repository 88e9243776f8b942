"""What one trace per forward costs on tiny models, where opening and closing a trace is most of it.

Run ``python benchmarks/per_trace.py`` (from any folder; to compare with another
checkout of qkvtrace, run it there with that checkout first on ``PYTHONPATH``).

Two models of 4 layers, d_model 32, built with random weights, in ``eval()``
under ``torch.no_grad()``, batch 1, sequence 8: a transformers
``GPT2LMHeadModel`` with SDPA attention (skipped without transformers) and an
``nn.TransformerEncoder`` (its fused encoder layers). For each: the untraced
forward; an empty ``with qkvtrace.trace(model)`` (opened, closed, its records
read); and one forward inside a trace of its own, the way a loop that opens a
trace per step runs it. A sample is the CPU time of 200 units back to back;
the fastest of 7 samples of each gives microseconds per unit, and the ratio
is to the untraced forward of the same run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import qkvtrace

UNITS, SAMPLES = 200, 7


def _models() -> list[tuple[str, nn.Module, Any]]:
    torch.manual_seed(0)
    found: list[tuple[str, nn.Module, Any]] = []
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_inner=64, vocab_size=100, n_positions=16,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_implementation="sdpa")  # fmt: skip
        found.append(("transformers GPT-2", transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 100, (1, 8))))
    except ImportError:
        print("transformers GPT-2: skipped (pip install transformers)")
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
    found.append(("nn.TransformerEncoder", encoder, torch.randn(1, 8, 32)))
    return found


def _fastest(unit: Callable[[], Any]) -> float:
    """Microseconds per unit: the fastest of the samples (the one least disturbed by the machine)."""
    best = float("inf")
    for _ in range(SAMPLES):
        gc.collect()
        start = time.process_time()
        for _ in range(UNITS):
            unit()
        best = min(best, (time.process_time() - start) / UNITS * 1e6)
    return best


def main() -> None:
    torch.set_num_threads(1)
    print(f"qkvtrace from {qkvtrace.__file__}, torch {torch.__version__}")
    for label, model, x in _models():

        def forward(model: nn.Module = model, x: Any = x) -> None:
            with torch.no_grad():
                model(x)

        def empty(model: nn.Module = model) -> None:
            with qkvtrace.trace(model) as t:
                pass
            t.calls  # noqa: B018 -- the records read, as a user reads them

        def traced(model: nn.Module = model, forward: Callable[[], None] = forward) -> None:
            with qkvtrace.trace(model) as t:
                forward()
            t.calls  # noqa: B018

        for unit in (forward, empty, traced):
            unit()  # warm: kernels learned, structure read
        base, open_close, one = _fastest(forward), _fastest(empty), _fastest(traced)
        print(f"{label}: untraced forward {base:.0f} us")
        print(f"  empty trace (open, close, read)      {open_close:7.0f} us")
        print(f"  one forward in a trace of its own  + {one - base:7.0f} us  ({one / base:.2f}x), of which its calls"
              f" + {one - base - open_close:.0f} us")


if __name__ == "__main__":
    main()
