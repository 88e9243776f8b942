"""The machine instructions one steady attention call adds when traced: a count, not a timing.

Run ``python benchmarks/instructions.py`` (needs ``valgrind`` on ``PATH``; about eight
minutes on two cores). To compare with another checkout of qkvtrace, run it there
with that checkout first on ``PYTHONPATH``.

A timing of a call of 40-80 µs on a shared machine moves by several microseconds from
run to run, more than most changes to the tracer's per-call path. The number of
instructions the CPU executes for the call does not: valgrind's ``callgrind`` counts
them. Each row runs a loop of small calls twice under it -- 0 and ``--calls`` calls
after the same warm-up, untraced and traced -- and the difference between the runs,
divided by the calls, is what one call costs; traced minus untraced is what the trace
adds. The calls are ``small_calls.py``'s: one ``nn.MultiheadAttention(64, 8)`` in
training mode on a ``(2, 10, 64)`` input, and a model's own SDPA call with dropout on
``(2, 4, 16, 32)``; the garbage collector's long-lived objects are frozen first, so
that no full collection lands in one run and not the other.

A count is not a time: the tracer's Python work runs fewer instructions per
microsecond than PyTorch's kernels (more branches, more memory reads), so the added
share of instructions is smaller than the added share of time. Use it to tell
whether a change to the per-call path removed work; use ``small_calls.py`` and
``overhead.py`` for what it costs in time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

WARM = 20
#: (row, model, trace options or None for untraced)
ROWS: list[tuple[str, str, dict[str, str] | None]] = [
    ("MultiheadAttention, untraced", "mha", None),
    ("MultiheadAttention, records", "mha", {}),
    ('MultiheadAttention, long run (keep="changes")', "mha", {"keep": "changes"}),
    ("own SDPA call, untraced", "sdpa", None),
    ("own SDPA call, records", "sdpa", {}),
    ('own SDPA call, long run (keep="changes")', "sdpa", {"keep": "changes"}),
]


def _child(row: int, calls: int) -> None:
    """Run one row's loop: WARM calls, then ``calls`` more (the part the two runs differ by)."""
    import torch

    import qkvtrace

    class DropoutAttention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, model_name, options = ROWS[row]
    if model_name == "mha":
        model: torch.nn.Module = torch.nn.MultiheadAttention(64, 8)
        x = torch.randn(2, 10, 64)
        inputs: tuple[torch.Tensor, ...] = (x, x, x)
    else:
        model = DropoutAttention().train()
        inputs = tuple(torch.randn(2, 4, 16, 32) for _ in range(3))
    gc.collect()
    gc.freeze()
    observer = contextlib.nullcontext() if options is None else qkvtrace.trace(model, **options)  # type: ignore[arg-type]
    with observer:
        for _ in range(WARM + calls):
            model(*inputs)


def _count(row: int, calls: int) -> int:
    """Instructions of one run of ``row``'s loop with ``calls`` measured calls, as callgrind counts them."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
         "--child", str(row), str(calls)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"row {ROWS[row][0]!r} failed under valgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls measured per run (default 500)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="valgrind runs at once")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH: install it (Debian: apt install valgrind) to count instructions")
    import qkvtrace

    print(f"qkvtrace from {qkvtrace.__file__}; {args.calls} calls a run; instructions per call:")
    runs = [(row, n) for row in range(len(ROWS)) for n in (0, args.calls)]
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(runs, pool.map(lambda r: _count(*r), runs), strict=True))
    per_call = {row: (counts[(row, args.calls)] - counts[(row, 0)]) / args.calls for row in range(len(ROWS))}
    base = 0.0
    for row, (label, _, options) in enumerate(ROWS):
        if options is None:
            base = per_call[row]
            print(f"  {label:48s} {base:10,.0f}")
        else:
            added = per_call[row] - base
            print(f"  {label:48s} {per_call[row]:10,.0f}  (+{added:,.0f}, {per_call[row] / base:.2f}x)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
