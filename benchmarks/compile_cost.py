"""What does reading the compile log cost when ``torch.compile`` compiles inside a trace?

Run ``python benchmarks/compile_cost.py`` (``--repeats N``, ``--backends aot_eager,inductor``).

A trace reads what ``torch.compile`` made of attention from PyTorch's
structured compile log, at compile time only (compiled code runs exactly as
without a trace: ``benchmarks/overhead.py`` W4). This measures that one-off
cost: the first call of a freshly compiled model -- Dynamo's capture,
AOTAutograd, inductor's code generation (its on-disk caches as they are) --
untraced and inside a trace, interleaved, ``torch._dynamo.reset()`` before
each. The model is W1's encoder step of ``benchmarks/overhead.py`` made
small (two ``TransformerEncoderLayer(128, 4)``, input ``(4, 64, 128)``) in
training, forward and backward.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch
from torch import nn

import qkvtrace


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, dim_feedforward=256, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train(), torch.randn(4, 64, 128)


def _first_step(backend: str, traced: bool) -> tuple[float, int]:
    model, x = _model()
    torch._dynamo.reset()
    start = time.perf_counter()
    if traced:
        with qkvtrace.trace(model) as t:
            torch.compile(model, backend=backend)(x).sum().backward()
        found = len(t.result.compiled)
    else:
        torch.compile(model, backend=backend)(x).sum().backward()
        found = 0
    return time.perf_counter() - start, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    default = "eager,aot_eager" + (",inductor" if shutil.which("g++") or shutil.which("c++") else "")
    parser.add_argument("--backends", default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; first compiled training step, {args.repeats} interleaved pairs each")
    print(f"{'backend':<10} {'untraced s':>11} {'traced s':>9} {'ratio':>6} {'spread':>13}  records")
    for backend in args.backends.split(","):
        _first_step(backend, False)  # warm the on-disk caches and the imports for both
        plain, traced, ratios, found = [], [], [], 0
        for _ in range(args.repeats):
            a, _ = _first_step(backend, False)
            b, found = _first_step(backend, True)
            plain.append(a)
            traced.append(b)
            ratios.append(b / a)
        ratios.sort()
        print(f"{backend:<10} {statistics.median(plain):>11.2f} {statistics.median(traced):>9.2f} "
              f"{statistics.median(ratios):>6.2f} {ratios[0]:>6.2f}–{ratios[-1]:<6.2f}  {found}")  # fmt: skip
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
