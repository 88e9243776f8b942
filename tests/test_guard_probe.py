"""The length/memory guard (docs/tutorial.md#limits) and `qkvtrace probe`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qkvtrace
from qkvtrace.behaviour import agreement, fully_masked_rows, mask_semantics
from qkvtrace.guard import attention_estimate, guard

ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def _layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).eval()


def test_guard_keeps_the_fused_path_within_budget() -> None:
    layer, x = _layer(), torch.randn(2, 6, 32)
    with torch.inference_mode():
        plain = layer(x)
    with guard(layer, max_tokens=100) as g, qkvtrace.trace(layer) as t, torch.inference_mode():
        guarded = g(x)
    assert torch.equal(plain, guarded)
    assert [c.path for c in t.calls] == ["fused_encoder_layer"]  # a forward hook would have refused it
    assert "forward" not in layer.__dict__ and not layer._forward_pre_hooks and not layer._forward_hooks


def test_guard_refuses_before_running() -> None:
    layer = _layer()
    x = torch.randn(4, 64, 32)
    with guard(layer, max_tokens=100), qkvtrace.trace(layer) as t, pytest.raises(ValueError, match="max_tokens=100"):
        layer(x)
    assert t.calls == []  # nothing ran
    est = attention_estimate(layer, 4, 64)
    with (
        guard(layer, max_tokens=None, max_attention_mb=est["attention_mb"] / 2),
        pytest.raises(ValueError, match="max_attention_mb"),
    ):
        layer(x)
    assert "forward" not in layer.__dict__


def test_estimate_grows_with_the_square_of_length() -> None:
    layer = _layer()
    small, big = attention_estimate(layer, 1, 1024), attention_estimate(layer, 1, 2048)
    assert big["attention_mb"] / small["attention_mb"] > 3.5
    assert small["heads"] == 4 and small["bytes_per_element"] == 4


def test_mask_semantics_are_measured() -> None:
    records = {r["api"]: r for r in mask_semantics()}
    # the tutorial warns the two conventions differ; each is what this PyTorch does, checked on its 2x2 example
    sdpa = records["F.scaled_dot_product_attention:attn_mask"]
    kpm = records["nn.MultiheadAttention:key_padding_mask"]
    assert {sdpa["true_means"], kpm["true_means"]} == {"attend", "ignore"}
    for r in records.values():
        assert r["masked_prob_zero"] is True
        assert r.get("rows_sum_to_one") in (True, None)
    assert records["attention by hand (tutorial)"]["true_means"] == "attend"


def test_fully_masked_rows_and_agreement_are_measured() -> None:
    rows = {(r["api"], r["backend"]): r for r in fully_masked_rows()}
    math_row = rows[("F.scaled_dot_product_attention (bool mask)", "MATH")]
    # recompute independently: MATH on an all-masked row
    q = torch.randn(1, 1, 2, 4)
    attend = torch.tensor([[False, False], [True, True]])
    from qkvtrace.masks import sdpa_bool_true_means

    mask = attend if sdpa_bool_true_means() == "attend" else ~attend
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0, 0, 0]
    expected = "nan" if torch.isnan(out).all() else "zero" if (out == 0).all() else "other"
    assert math_row["result"] == expected
    assert rows[("attention by hand (tutorial)", None)]["result"] == "nan"  # softmax over all -inf
    ag = agreement()
    assert ag["slice_gradients_differ"] is True
    assert all(r["max_abs_diff_to_by_hand"] < 1e-4 for r in ag["mha"])
    f32 = [r for r in ag["sdpa"] if r["dtype"] == "float32" and r["max_abs_diff"] is not None]
    assert f32 and all(r["max_abs_diff"] < 1e-4 for r in f32)


def test_probe_cli(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "probe", "--json", str(out)], capture_output=True,
                          text=True, env=ENV, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["torch_version"] == torch.__version__
    assert len(data["scenarios"]) >= 12
    assert "what True means" in proc.stdout and "all masked" in proc.stdout
