"""``benchmarks/torch_tests.py`` reports a changed test outcome truthfully.

The script runs a test file twice (plain, then with a trace open) and prints
every test whose outcome differs. These tests run it, as a user would, on a
two-test file written here: one test passes whatever happens, the other
checks that ``F.scaled_dot_product_attention`` is PyTorch's own builtin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "torch_tests.py"

TINY_TESTS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F


    def test_arithmetic():
        assert torch.ones(2).sum().item() == 2.0


    def test_sdpa_is_pytorchs_own():
        assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    """
)

# A pytest plugin that replaces F.scaled_dot_product_attention for the whole
# run and never puts it back: a change the script must report, whatever the
# tracer does.
REPLACING_PLUGIN = textwrap.dedent(
    """
    import torch.nn.functional as F

    _original = F.scaled_dot_product_attention


    def _replacement(*args, **kwargs):
        return _original(*args, **kwargs)


    def pytest_configure(config):
        F.scaled_dot_product_attention = _replacement
    """
)

IDENTITY_TEST = "test_tiny_torch.py::test_sdpa_is_pytorchs_own"


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    folder = tmp_path / "suite"
    folder.mkdir()
    path = folder / "test_tiny_torch.py"
    path.write_text(TINY_TESTS, encoding="utf-8")
    return path


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_replaced_function_is_reported_as_a_changed_outcome(tiny: Path, tmp_path: Path) -> None:
    plugin = tmp_path / "plugins" / "replace_sdpa.py"
    plugin.parent.mkdir()
    plugin.write_text(REPLACING_PLUGIN, encoding="utf-8")
    out = tmp_path / "result.json"

    proc = run_script(str(tiny), "--plugin", str(plugin), "--json", str(out))

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{IDENTITY_TEST}  passed -> failed" in proc.stdout
    assert "test_arithmetic" not in proc.stdout
    assert "plain: 2 tests: 2 passed" in proc.stdout
    assert "traced: 2 tests: 1 passed, 1 failed" in proc.stdout
    assert "F.scaled_dot_product_attention was not PyTorch's own object" in proc.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [(d["nodeid"], d["plain"], d["traced"]) for d in report["differences"]] == [
        (IDENTITY_TEST, "passed", "failed")
    ]
    assert report["differences"][0]["message"].startswith("AssertionError")
    assert list(report["left_replaced"]) == ["F.scaled_dot_product_attention"]
    assert report["runs"]["plain"]["counts"]["passed"] == 2
    assert report["outcomes"]["test_tiny_torch.py::test_arithmetic"] == {"plain": "passed", "traced": "passed"}


# What an open trace must not change: PyTorch's own CausalBias dispatches on
# `func is F.scaled_dot_product_attention` (the tracer before its one-installation
# rewrite broke exactly this). A bare `F.sdpa is torch._C._nn.sdpa` check does
# change while a trace is open, by design: docs/pytorch-tests.md.
BIAS_TESTS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right


    def test_arithmetic():
        assert torch.ones(2).sum().item() == 2.0


    def test_causal_bias_matches_its_own_mask():
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        bias = causal_lower_right(4, 6)
        expected = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=bias._materialize())
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), expected)
    """
)


def test_an_open_trace_changes_no_outcome(tmp_path: Path) -> None:
    path = tmp_path / "suite" / "test_tiny_bias.py"
    path.parent.mkdir()
    path.write_text(BIAS_TESTS, encoding="utf-8")
    proc = run_script(str(path), "--mode", "session")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no test changed outcome (2 compared)" in proc.stdout


def test_bad_input_exits_2_with_one_line(tiny: Path) -> None:
    nope = tiny.parent / "nope.py"
    missing = run_script(str(nope))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"torch_tests.py: error: {nope}: no such file or folder"]

    model = run_script(str(tiny), "--model", "torch.ones(2)")
    assert model.returncode == 2
    assert "not an nn.Module" in model.stderr
    assert "Traceback" not in model.stderr
