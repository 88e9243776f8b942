"""Claims docs/probe.md makes about PyTorch's behaviour, measured here without qkvtrace.

docs/probe.md says what a query row whose keys are all masked returns, naming
the PyTorch version each statement was measured on. Each statement is listed
below with its version; the tests check that docs/probe.md still says it, that
the committed report of that version says the same, and — when the installed
PyTorch is that version — that it is what the installed PyTorch does now.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
TORCH = torch.__version__.split("+")[0]

#: docs/probe.md statements about fully-masked rows: version → (sentence, measured facts it states)
CLAIMS: dict[str, tuple[str, dict[str, Any]]] = {
    "2.13.0": (
        "Note what it found on torch 2.13.0: SDPA returns zeros for a fully-masked row, "
        "**the MHA fast path returns NaN** for the same input",
        {"sdpa": "zero", "mha_fast": "nan"},
    ),
    "2.4.1": (
        "on torch 2.4.1 SDPA itself returned NaN with a non-finite gradient",
        {"sdpa": "nan", "sdpa_grad_finite": False},
    ),
}

#: the committed report's probe rows holding the same facts
REPORT_ROWS = {
    "sdpa": ("F.scaled_dot_product_attention (bool mask)", "default", "result"),
    "sdpa_grad_finite": ("F.scaled_dot_product_attention (bool mask)", "default", "grad_finite"),
    "mha_fast": ("nn.MultiheadAttention fast path (eval, no_grad)", None, "result"),
}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _kind(rows: torch.Tensor) -> str:
    rows = rows.detach()
    if bool(torch.isnan(rows).all()):
        return "nan"
    if bool((rows == 0).all()):
        return "zero"
    return "other"


def _report(version: str) -> dict[str, Any] | None:
    found = sorted((ROOT / "reports").glob(f"torch-{version}+*/report.json")) + sorted(
        (ROOT / "reports").glob(f"torch-{version}/report.json")
    )
    return json.loads(found[0].read_text()) if found else None


def _from_report(report: dict[str, Any], fact: str) -> Any:
    api, backend, key = REPORT_ROWS[fact]
    [row] = [r for r in report["probes"]["fully_masked_rows"] if r["api"] == api and r["backend"] == backend]
    return row[key]


def measure() -> dict[str, Any]:
    """What the installed PyTorch returns for a fully-masked row, with no qkvtrace involved."""
    torch.manual_seed(0)
    # SDPA, default backend: query 0 may attend to no key (True = attend, PyTorch's documentation)
    q, k, v = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
    sdpa = _kind(out[:, :, 0])
    out.nan_to_num(0.0).sum().backward()  # the kernel's own backward, not NaN fed back in
    grads_finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v) if t.grad is not None)
    # MHA in eval under no_grad, every key of sequence 0 padded (True = ignore, PyTorch's documentation)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[0] = True
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        mha_out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    ops = {e.key for e in prof.key_averages()}
    return {
        "sdpa": sdpa,
        "sdpa_grad_finite": grads_finite,
        "mha_fast": _kind(mha_out[0]),
        "mha_fast_path_ran": "aten::_native_multi_head_attention" in ops,
        "sequence_1_finite": bool(torch.isfinite(mha_out[1]).all()),
    }


@pytest.mark.parametrize("version", sorted(CLAIMS))
def test_readme_states_it_and_the_committed_report_agrees(version: str) -> None:
    """Witness: the text of docs/probe.md and the committed report file, against CLAIMS written here."""
    sentence, facts = CLAIMS[version]
    assert _flat(sentence) in _flat((ROOT / "docs" / "probe.md").read_text()), "docs/probe.md changed: update CLAIMS"
    report = _report(version)
    assert report is not None, f"no committed report for torch {version} under reports/"
    assert {fact: _from_report(report, fact) for fact in facts} == facts


def test_the_installed_pytorch_does_what_the_readme_says() -> None:
    """Witness: ``measure()``: PyTorch's own outputs, gradients and profiler, with no qkvtrace involved."""
    if TORCH not in CLAIMS:
        pytest.skip(f"docs/probe.md states no fully-masked-row behaviour for torch {TORCH}")
    _, facts = CLAIMS[TORCH]
    measured = measure()
    assert measured["mha_fast_path_ran"], "MHA did not take its fast path: the claim is about the fast path"
    assert measured["sequence_1_finite"]
    assert {fact: measured[fact] for fact in facts} == facts


def test_the_committed_report_of_this_version_matches_this_pytorch() -> None:
    """Witness: ``measure()``: PyTorch's own outputs, gradients and profiler, with no qkvtrace involved."""
    report = _report(TORCH)
    if report is None:
        pytest.skip(f"no committed report for torch {TORCH}")
    measured = measure()
    assert measured["mha_fast_path_ran"]
    assert {fact: _from_report(report, fact) for fact in REPORT_ROWS} == {fact: measured[fact] for fact in REPORT_ROWS}
