"""``benchmarks/torch_tests.py`` reports a changed test outcome truthfully.

The script runs a test file twice (plain, then with a trace open) and prints
every test whose outcome differs. These tests run it, as a user would, on
small test files written here; what each file does is the witness.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch import nn

import qkvtrace

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
    """Run the script as a user would; ``-p no:qkvtrace`` is its own business."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_replaced_function_is_reported_as_a_changed_outcome(tiny: Path, tmp_path: Path) -> None:
    """Witness: the plugin written here replaces ``F.scaled_dot_product_attention`` for the whole
    traced run, so the identity test must flip from passed to failed and the function be left replaced."""
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
    assert report["mode"] == "after-import"
    assert report["runs"]["plain"]["qkvtrace_imported"] is False
    assert "plain run: qkvtrace was not imported" in proc.stdout


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


@pytest.mark.parametrize("mode", ["after-import", "before-import"])
def test_an_open_trace_changes_no_outcome(tmp_path: Path, mode: str) -> None:
    """Witness: the bias test compares SDPA with the CausalBias against SDPA on the bias's own
    materialized mask, both looked up on ``F`` at call time; it passes without a trace."""
    path = tmp_path / "suite" / "test_tiny_bias.py"
    path.parent.mkdir()
    path.write_text(BIAS_TESTS, encoding="utf-8")
    proc = run_script(str(path), "--mode", mode)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no test changed outcome (2 compared)" in proc.stdout


# Identity-sensitive on purpose: the module binds the function by name when it
# is imported (as PyTorch's test_transformers.py does) and compares that object
# with the attribute at test time.
NAME_BOUND_TESTS = textwrap.dedent(
    """
    import torch.nn.functional as F
    from torch.nn.functional import scaled_dot_product_attention


    def test_name_bound_at_import_is_the_attribute():
        assert scaled_dot_product_attention is F.scaled_dot_product_attention
    """
)
NAME_BOUND_TEST = "test_name_bound.py::test_name_bound_at_import_is_the_attribute"


def run_by_hand(path: Path, trace_first: bool) -> str:
    """Import ``path`` as a fresh module and call its test, with a trace opened before or after the import.

    The witness for the script's two session modes, computed without pytest or
    the script: ``passed`` or ``failed``.
    """

    def load() -> object:
        spec = importlib.util.spec_from_file_location(f"name_bound_{uuid.uuid4().hex}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    module = None if trace_first else load()
    with qkvtrace.trace(nn.Linear(1, 1)):
        if module is None:
            module = load()
        try:
            module.test_name_bound_at_import_is_the_attribute()  # type: ignore[attr-defined]
        except AssertionError:
            return "failed"
    return "passed"


def test_after_import_mode_sees_what_a_name_bound_at_import_sees(tmp_path: Path) -> None:
    """Witness: the synthetic module run by hand (``run_by_hand``) with the trace opened after and before
    its import. With today's tracer, which swaps ``F.scaled_dot_product_attention`` for a wrapper while a
    trace is open, the name bound at import is PyTorch's function in the first case (the test fails) and the
    wrapper in the second (it passes): after-import mode reports the flip, before-import mode hides it."""
    path = tmp_path / "suite" / "test_name_bound.py"
    path.parent.mkdir()
    path.write_text(NAME_BOUND_TESTS, encoding="utf-8")
    sdpa = F.scaled_dot_product_attention
    witness = {
        "after-import": run_by_hand(path, trace_first=False),
        "before-import": run_by_hand(path, trace_first=True),
    }
    assert F.scaled_dot_product_attention is sdpa  # the trace closed and put PyTorch's function back

    for mode, traced in witness.items():
        out = tmp_path / f"{mode}.json"
        proc = run_script(str(path), "--mode", mode, "--json", str(out))
        report = json.loads(out.read_text(encoding="utf-8"))
        assert report["outcomes"][NAME_BOUND_TEST] == {"plain": "passed", "traced": traced}, proc.stdout
        assert proc.returncode == (0 if traced == "passed" else 1), proc.stdout + proc.stderr
        assert report["left_replaced"] == {}
        if traced == "failed":
            assert f"{NAME_BOUND_TEST}  passed -> failed" in proc.stdout
        else:
            assert "no test changed outcome (1 compared)" in proc.stdout
    if witness["after-import"] != witness["before-import"]:
        assert witness == {"after-import": "failed", "before-import": "passed"}


def test_a_plain_run_that_imports_qkvtrace_is_no_baseline(tiny: Path) -> None:
    """Witness: the ``conftest.py`` written here imports qkvtrace into every run."""
    (tiny.parent / "conftest.py").write_text("import qkvtrace  # noqa: F401\n", encoding="utf-8")
    proc = run_script(str(tiny))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "torch_tests.py: error: the plain run imported qkvtrace (a conftest.py or a pytest plugin imports it), "
        "so it is no baseline; remove that import from the test setup"
    )
    assert "Traceback" not in proc.stderr
    assert "traced run" not in proc.stderr  # it stopped before the traced run


@pytest.mark.skipif(
    not any(e.name == "qkvtrace" for e in entry_points(group="pytest11")),
    reason="qkvtrace's pytest plugin is not registered in this environment",
)
def test_without_the_flag_pytest_would_import_qkvtrace(tmp_path: Path) -> None:
    """Witness: a test file that asserts qkvtrace is already imported, run by plain pytest in this
    environment (where an installed qkvtrace registers its pytest plugin). It passes, so the script's
    ``-p no:qkvtrace`` and its end-of-run check are not idle."""
    path = tmp_path / "suite" / "test_probe.py"
    path.parent.mkdir()
    path.write_text("import sys\n\n\ndef test_loaded():\n    assert 'qkvtrace' in sys.modules\n", encoding="utf-8")
    args = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider"]
    with_plugin = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=path.parent, check=False)
    without = subprocess.run(
        [*args, "-p", "no:qkvtrace"], capture_output=True, text=True, timeout=300, cwd=path.parent, check=False
    )
    assert with_plugin.returncode == 0, with_plugin.stdout
    assert without.returncode == 1, without.stdout


def test_bad_input_exits_2_with_one_line(tiny: Path) -> None:
    """Witness: a path the test never created, and a ``--model`` that is no nn.Module (``torch.ones(2)``)."""
    nope = tiny.parent / "nope.py"
    missing = run_script(str(nope))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"torch_tests.py: error: {nope}: no such file or folder"]

    model = run_script(str(tiny), "--model", "torch.ones(2)")
    assert model.returncode == 2
    assert "not an nn.Module" in model.stderr
    assert "Traceback" not in model.stderr
