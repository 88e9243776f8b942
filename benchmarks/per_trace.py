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

``--inside``: where a trace per forward goes on a larger forward, where the
model's own work leaves the caches cold for the trace's: the peers' GPT-2
(``benchmarks/peers.py``: d_model 256, 4 layers, 8 heads, ids ``(4, 128)``,
inference), one trace per forward, each part of the trace's open and close
and of its calls timed around its function (by replacing that function for
the run -- a breakdown, not a supported way to run qkvtrace): per trace, the
median over 30 traces of the part's time, and how many times it ran.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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
    if "--inside" in sys.argv:
        _inside()
        return
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


def _parts() -> list[tuple[str, Any, str]]:
    """(label, owner, attribute) of each function timed by ``--inside``, in the order they run."""
    from qkvtrace.base import lazy
    from qkvtrace.facts import slices
    from qkvtrace.tracer import install, registry, session, slots, structure
    from qkvtrace.tracer.observers import sdpa

    trace, inst = session.Trace, install.Installation
    return [
        ("open", trace, "__enter__"),
        ("  the model's structure read", structure, "walk"),
        ("  the wrappers put in place", inst, "acquire"),
        ("    torch.compile's patches", inst, "_patch_compile"),
        ("  names user code imported bound", inst, "bind_names"),
        ("  the trace registered", registry, "register"),
        ("  hooks for attention written by hand", trace, "_watch_hand_written"),
        ("a module's first call: its kept slot", slots, "revive"),
        ("  its Q/K/V weights watched", trace, "adopt"),
        ("a call: the output's NaN count", sdpa, "nan_count"),
        ("a call: a Q, K or V norm", sdpa, "norm_of"),
        ("close", trace, "__exit__"),
        ("  the captured records built", trace, "_build_captured"),
        ("  numbers read", lazy, "read"),
        ("  the wrappers taken away", inst, "release"),
        ("    torch.compile's patches", inst, "_unpatch_compile"),
        ("  modules not seen", trace, "_find_unobserved"),
        ("  slots kept for the next trace", slots, "keep"),
        ("  the trace unregistered", registry, "unregister"),
        ("the Q/K/V weights' norms looked up", slices.NormCache, "qkv"),
    ]


@contextlib.contextmanager
def _timed(owner: Any, attr: str, into: list[tuple[int, int]], trace_number: list[int]) -> Iterator[None]:
    """``owner.attr`` replaced by a function that adds (trace number, nanoseconds) of each call to ``into``."""
    original = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            into.append((trace_number[0], time.perf_counter_ns() - start))

    setattr(owner, attr, timed)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _inside(traces: int = 30) -> None:
    try:
        import transformers
    except ImportError:
        print("--inside: skipped (pip install transformers)")
        return
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=1000, n_positions=1024,
                                     attn_implementation="sdpa")  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
    number = [0]

    def unit() -> None:
        number[0] += 1
        with torch.no_grad(), qkvtrace.trace(model) as t:
            model(ids)
        t.calls  # noqa: B018

    parts = _parts()
    times: list[list[tuple[int, int]]] = [[] for _ in parts]
    for _ in range(5):
        unit()  # warm: kernels learned, structure read, slots kept
    start = number[0] + 1
    with contextlib.ExitStack() as stack:
        for (_, owner, attr), into in zip(parts, times, strict=True):
            stack.enter_context(_timed(owner, attr, into, number))
        for _ in range(traces):
            unit()
    print(f"the peers' GPT-2 (4 layers, ids (4, 128), inference), a trace per forward, {traces} traces:")
    print(f"  {'part':42s} {'median us a trace':>18s} {'calls a trace':>14s}")
    for (label, _, _), into in zip(parts, times, strict=True):
        per_trace = [0] * traces
        calls = 0
        for n, ns in into:
            if n >= start:
                per_trace[n - start] += ns
                calls += 1
        print(f"  {label:42s} {statistics.median(per_trace) / 1e3:18.0f} {calls / traces:14.1f}")


if __name__ == "__main__":
    main()
