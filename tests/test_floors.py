"""The code's floors import one way, and a change that breaks that is caught.

Witness: import-linter, a tool made for this, reading the contracts in
``pyproject.toml`` (``[tool.importlinter]``): the floors in order (command
line, views, analyses, capture, facts, records, ground floor: each imports
only those below it) and no import cycle inside any package. Each breach is
tried on a copy of the package with one import added.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]

#: runs ``lint-imports`` on the ``qkvtrace`` found first on ``sys.path`` (an editable install's finder set aside)
_LINT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in repr(f)]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[1] + "/pyproject.toml", no_cache=True, no_logo=True))
"""


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LINT, str(tree)], capture_output=True, text=True, timeout=300,
                          cwd=tree)  # fmt: skip


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "qkvtrace", tree / "qkvtrace", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_the_floors_hold(tmp_path: Path) -> None:
    """The package as it is keeps both contracts (a copy: the very files of the checkout)."""
    found = _lint(_copy(tmp_path))
    assert found.returncode == 0, found.stdout + found.stderr
    assert "2 kept, 0 broken" in found.stdout


@pytest.mark.parametrize(("where", "line", "says"), [
    ("facts/slices.py", "from qkvtrace.analyses import advise",
     "qkvtrace.facts is not allowed to import qkvtrace.analyses"),
    ("records/__init__.py", "from qkvtrace.render import views",
     "qkvtrace.records is not allowed to import qkvtrace.render"),
    ("facts/lineage.py", "from qkvtrace.facts import dataflow", "No import cycles"),
])  # fmt: skip
def test_an_import_against_the_floors_is_caught(tmp_path: Path, where: str, line: str, says: str) -> None:
    """One import added to a copy: a floor importing one above it (a lazy import inside a function counts too),
    and two modules of one floor importing each other (``dataflow`` already imports ``lineage``)."""
    tree = _copy(tmp_path)
    path = tree / "qkvtrace" / where
    path.write_text(path.read_text() + f"\n\ndef _added() -> None:\n    {line}  # noqa\n")
    found = _lint(tree)
    assert found.returncode == 1, found.stdout + found.stderr
    assert says in found.stdout and "BROKEN" in found.stdout


def _modules_of_a_steady_call(keep: str) -> list[str]:
    """The file of each function of qkvtrace a steady SDPA call enters (after four first calls), in order,
    read by the interpreter's own profile hook (``sys.setprofile``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import qkvtrace

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(1, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v)

    model, x = Attention(), torch.randn(1, 4, 16)
    seen: list[str] = []

    def note(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and f"{os.sep}qkvtrace{os.sep}" in name:
            seen.append(name.split(f"{os.sep}qkvtrace{os.sep}", 1)[1])

    with qkvtrace.trace(model, keep=keep), torch.no_grad():  # type: ignore[arg-type]
        for _ in range(4):
            model(x)
        sys.setprofile(note)
        try:
            model(x)
        finally:
            sys.setprofile(None)
    return seen


@pytest.mark.parametrize("keep", ["all", "changes"])
def test_a_steady_call_runs_in_at_most_three_modules_and_never_comes_back(keep: str) -> None:
    """The house's rule for a steady call: wrapper, slot, where its numbers are kept -- its functions in at most
    three of qkvtrace's modules, and no module entered again once left. Witness: ``sys.setprofile``, every
    function entered during the call, in order."""
    entered = _modules_of_a_steady_call(keep)
    runs = [m for i, m in enumerate(entered) if i == 0 or entered[i - 1] != m]  # (each stay in a module, once)
    assert len(set(entered)) <= 3, entered
    assert len(runs) == len(set(runs)), runs
