"""`qkvtrace check`: which classic mistakes (seed section 13) each check catches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mistakes import MISTAKES, build
from torch import nn

from qkvtrace.check import run_checks

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}

#: what each check is expected to catch — the README table states the same
CAUGHT_BY_CAUSAL = {"reversed_causal", "off_by_one", "softmax_wrong_dim", "wrong_view"}
CAUGHT_BY_PADDING = {"inverted_padding", "softmax_wrong_dim", "wrong_view"}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_causal_check(mistake: str) -> None:
    """Causal LMs (every mistake applied to a causally masked block)."""
    model, args = build(mistake)
    report = run_checks(model, args, causal=True, trials=1)
    causal = [f for f in report.findings if f.check == "causal"]
    assert {f.mode for f in causal} == {"inference", "training"}
    assert all(not f.passed for f in causal) is (mistake in CAUGHT_BY_CAUSAL)
    assert all(f.passed for f in causal) is (mistake not in CAUGHT_BY_CAUSAL)


@pytest.mark.parametrize("causal", [True, False], ids=["causal-lm", "encoder"])
@pytest.mark.parametrize("mistake", MISTAKES)
def test_padding_check(mistake: str, causal: bool) -> None:
    model, args = build(mistake, causal=causal)
    report = run_checks(model, args, padding=True, trials=1)
    padding = [f for f in report.findings if f.check == "padding"]
    assert {f.mode for f in padding} == {"inference", "training"}
    caught = mistake in CAUGHT_BY_PADDING or (mistake in CAUGHT_BY_CAUSAL and not causal and False)
    assert all(not f.passed for f in padding) is caught, [f.detail for f in padding]


def test_leak_pairs_name_positions() -> None:
    model, args = build("off_by_one")
    report = run_checks(model, args, causal=True, trials=1, modes=("inference",))
    finding = report.findings[0]
    assert set(finding.leaks) == {(i, i + 1) for i in range(7)}
    assert "position 0 reads position 1" in finding.detail


def test_training_mode_with_dropout_is_reproducible() -> None:
    """Dropout is reseeded per forward: a correct model does not 'leak' in training."""
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.3, batch_first=True)
    x = torch.randn(2, 6, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    model = _Causal(layer, mask)
    report = run_checks(model, (x,), causal=True, trials=1)
    assert report.ok, [f.detail for f in report.findings]
    assert {c["path"] for c in report.calls["training"]} == {"fallback"}


class _Causal(nn.Module):
    def __init__(self, layer: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.mask = layer, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=self.mask, is_causal=True)


def test_mha_fast_path_padding_nan_is_reported() -> None:
    """The fast path returns NaN for a fully padded sequence here? Whatever it does is reported, not assumed."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 8, 16)
    report = run_checks(mha, (x, x, x), padding=True, trials=1)
    paths = {m: {c["path"] for c in calls} for m, calls in report.calls.items()}
    assert paths == {"inference": {"fast"}, "training": {"fallback"}}
    assert all(f.passed for f in report.findings if f.check == "padding")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, env=ENV,
                          cwd=HERE.parent, timeout=300)  # fmt: skip


def test_cli_exit_codes(tmp_path: Path) -> None:
    bad = _cli("check", "tests/mistakes.py:build_reversed", "--causal", "--json", str(tmp_path / "r.json"))
    assert bad.returncode == 1, bad.stderr
    assert "FAIL" in bad.stdout and "reads position" in bad.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] is False and data["schema"] == "qkvtrace.check/1"
    good = _cli("check", "demo:tiny-lm", "--causal", "--mode", "inference")
    assert good.returncode == 0, good.stdout + good.stderr
    usage = _cli("check", "demo:tiny-lm")
    assert usage.returncode == 2 and "--causal" in usage.stderr


def test_cli_refuses_over_budget_before_running() -> None:
    proc = _cli("trace", "demo:tiny-lm", "--input-shape", "64,128", "--max-tokens", "1000")
    assert proc.returncode == 2
    assert "max_tokens=1000" in proc.stderr and "Traceback" not in proc.stderr
