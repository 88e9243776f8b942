"""The instruction-count benchmark's loops run, and without valgrind it says what is missing.

Witnesses: the exit status of each row's loop run as the benchmark runs it under valgrind (here without it),
and the message of a run with no valgrind on ``PATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "instructions.py"


@pytest.mark.parametrize("row", range(6))
def test_each_rows_loop_runs(row: int) -> None:
    """Witness: the loop's exit status (a row that raised would make every count of the benchmark fail)."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--child", str(row), "3"], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_without_valgrind_it_says_what_to_install(tmp_path: Path) -> None:
    """Witness: the message and exit status of a run whose ``PATH`` holds no valgrind."""
    env = {**os.environ, "PATH": str(tmp_path)}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300,
                         check=False)  # fmt: skip
    assert run.returncode != 0
    assert "valgrind is not on PATH" in run.stderr
