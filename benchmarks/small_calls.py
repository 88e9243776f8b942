"""What recording one small attention call costs, taken apart: records with routes, without, without gradients.

Run ``python benchmarks/small_calls.py`` (from any folder; to compare with another
checkout of qkvtrace, run it there with that checkout first on ``PYTHONPATH``).

One ``nn.MultiheadAttention(64, 8)`` in training mode on a ``(2, 10, 64)`` input,
``need_weights`` left at its default: 200 calls per sample, 25 samples per arm,
interleaved untraced / traced; the CPU time of the fastest sample of each arm (the
one least disturbed by the machine) gives the cost per call in microseconds.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

import qkvtrace

CALLS, SAMPLES = 200, 25


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 8)
    x = torch.randn(2, 10, 64)

    def work() -> None:
        for _ in range(CALLS):
            mha(x, x, x)

    def cpu(fn: Callable[[], None]) -> float:
        gc.collect()
        start = time.process_time()
        fn()
        return time.process_time() - start

    work()
    print(f"qkvtrace from {qkvtrace.__file__}, torch {torch.__version__}")
    for label, options in (("records, routes on", {}), ("routes=False", {"routes": False}),
                           ("gradients=False, routes=False", {"gradients": False, "routes": False})):  # fmt: skip
        plain, traced = [], []
        for _ in range(SAMPLES):
            plain.append(cpu(work))
            with qkvtrace.trace(mha, **options):  # type: ignore[arg-type]
                mha(x, x, x)  # the first call of a signature: its kernels profiled once, not timed
                traced.append(cpu(work))
        base, with_trace = min(plain), min(traced)
        print(f"  {label:32s} +{(with_trace - base) / CALLS * 1e6:4.0f} us a call "
              f"({with_trace / base:.2f}x of a {base / CALLS * 1e6:.0f} us call)")  # fmt: skip


if __name__ == "__main__":
    main()
