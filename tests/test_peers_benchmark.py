"""The peer benchmark runs, in its quick mode, and says what every contender saw or why it was skipped.

Witness: the benchmark's own printed table, read here for each contender it must name (the peers that are
not installed must be skipped with a line, not silently left out).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_peer_benchmark_names_every_contender() -> None:
    """Witness: the printed table, parsed here; the ratios are positive numbers (measured, not judged)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--quick", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    for title in ("encoder T=128 train", "encoder T=128 infer", "encoder T=128 weights"):
        assert title in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  qkvtrace")]
    assert len(rows) == 3 and all(float(r[2] if r[1] == "maps" else r[1]) > 0 for r in rows)
    for name in ("torch.profiler", "nnsight", "output_attentions", "TransformerLens"):
        lines = [line for line in out.splitlines() if line.strip().startswith(name)]
        assert lines, name
        assert all("skipped:" in line or any(ch.isdigit() for ch in line) for line in lines), lines
    assert "4 maps" in out  # every encoder layer's map, computed on the side
