"""The peer benchmark: its ratios are what the contenders cost, and its quick mode runs what is installed.

Witnesses: contenders whose cost is set by construction (one and two runs of the baseline's own work, in CPU
time, which other programs on the machine do not add to), and for the quick mode the printed table read here:
``torch.profiler`` ships with torch and must be measured, not skipped; a peer is skipped exactly when the test
cannot import it, or when the encoder has no such option (as the benchmark's table says).
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _witness import benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return benchmark("peers")  # type: ignore[no-any-return]


def test_ratios_are_the_contenders_cost_over_the_baseline(peers: ModuleType) -> None:
    """Witness: a baseline of matrix products written here, a contender running it once and one running it twice
    (by construction 1x and 2x the baseline's CPU time), and one the benchmark must leave out (skipped)."""
    a = torch.randn(96, 96)

    def work() -> None:
        for _ in range(20):
            a @ a

    def twice() -> None:
        work()
        work()

    once_c, twice_c = peers.Contender("once", work), peers.Contender("twice", twice)
    skipped = peers.Contender("absent", None, skip="not installed")
    base = peers.measure(work, [once_c, skipped, twice_c], repeats=5)
    assert base > 0 and skipped.ratios == []
    assert len(once_c.ratios) == len(twice_c.ratios) == 5
    once, double = statistics.median(once_c.ratios), statistics.median(twice_c.ratios)
    # bounds wide enough for a loaded machine, narrow enough to tell 1x from 2x and a ratio from its inverse
    assert 0.6 < once < 1.5 and 1.5 < double < 3.0, (once_c.ratios, twice_c.ratios)
    assert all(t > o for o, t in zip(once_c.ratios, twice_c.ratios, strict=True))


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_quick_peer_benchmark_measures_what_is_installed() -> None:
    """Witness: the printed table, parsed here, against what this environment can import."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--quick", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout.splitlines()
    tables = {line.split("  (")[0]: i for i, line in enumerate(out) if line.startswith("encoder T=128 ")}
    assert sorted(tables) == ["encoder T=128 infer", "encoder T=128 train", "encoder T=128 weights"]

    def row(table: str, name: str) -> list[str]:
        start = tables[table] + 2
        rows = [ln.split() for ln in out[start:] if ln.startswith("  ") and ln.split()[0] == name.split()[0]]
        assert rows, (table, name)
        return rows[0]

    for table in ("encoder T=128 train", "encoder T=128 infer"):
        for name in ("qkvtrace", "torch.profiler"):
            cells = row(table, name)
            assert cells[1] != "skipped:" and float(cells[1]) > 0, cells  # measured: a ratio, not a skip
    maps = row("encoder T=128 weights", "qkvtrace")
    assert float(maps[2]) > 0 and "4 maps" in " ".join(maps)  # every encoder layer's map, computed on the side
    for table in ("encoder T=128 infer", "encoder T=128 weights"):
        nnsight = row(table, "nnsight")
        assert (nnsight[1] == "skipped:") is (not _importable("nnsight")), nnsight
    for name in ("output_attentions", "TransformerLens"):  # the encoder has neither: skipped, with the reason
        assert row("encoder T=128 weights", name)[1] == "skipped:"
