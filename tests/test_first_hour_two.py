"""A newcomer's first hour, second round: what they tripped on, through the real command line."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from _witness import qkv

MYMODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        return nn.Sequential(nn.Linear(8, 8), layer), torch.randn(2, 5, 8)
    """
)


@pytest.fixture
def mymodels(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    return tmp_path


@pytest.mark.parametrize("target", ["mymodels.py:build", "mymodels:build"])
def test_compare_reads_a_relative_target_as_trace_does(mymodels: Path, target: str) -> None:
    """Witness: ``qkvtrace trace`` run in the same folder on the same TARGET (its JSON read with json), and the
    same interpreter twice (so no change): compare must find the model of the file written here."""
    traced = qkv("trace", target, "--json", "t.json", cwd=mymodels)
    assert traced.returncode == 0, traced.stderr
    proc = qkv("compare", "--python", sys.executable, "--python", sys.executable, target, "--out", "out", cwd=mymodels)
    assert proc.returncode == 0, proc.stderr
    written = sorted((mymodels / "out" / "traces").glob("*.json"))
    assert len(written) == 2
    ours = json.loads(written[0].read_text())
    theirs = json.loads((mymodels / "t.json").read_text())
    assert [c["module"] for c in ours["calls"]] == [c["module"] for c in theirs["calls"]] == ["1.self_attn"]


BAD = "missing.py:build"


@pytest.mark.parametrize(
    "command",
    [
        ["trace", BAD],
        ["grads", BAD],
        ["check", BAD, "--causal"],
        ["advise", BAD],
        ["compare", "--python", sys.executable, "--python", sys.executable, BAD, "--out", "out"],
    ],
    ids=lambda c: c[0],
)
def test_every_command_refuses_a_missing_target_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """Witness: the file name given here, which does not exist in the folder the command runs in."""
    proc = qkv(*command, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'missing.py'" in lines[0] and "does not exist" in lines[0]
