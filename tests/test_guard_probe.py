"""The length/memory guard (docs/tutorial.md#limits) and `qkvtrace probe`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import qkvtrace
from qkvtrace.analyses.behaviour import agreement, fully_masked_rows, mask_semantics
from qkvtrace.analyses.guard import attention_estimate, guard

ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def _layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).eval()


def test_guard_keeps_the_fused_path_within_budget() -> None:
    """Witness: the unguarded layer's output computed here, and torch.profiler's record of the fused op."""
    layer, x = _layer(), torch.randn(2, 6, 32)
    with torch.inference_mode():
        plain = layer(x)
    with guard(layer, max_tokens=100) as g, qkvtrace.trace(layer) as t, torch.inference_mode():
        guarded = g(x)
    assert torch.equal(plain, guarded)
    assert [c.path for c in t.calls] == ["fused_encoder_layer"]  # a forward hook would have refused it
    with guard(layer, max_tokens=100) as g, profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        g(x)
    assert "aten::_transformer_encoder_layer_fwd" in {e.name for e in prof.events()}  # PyTorch's fused path
    assert "forward" not in layer.__dict__ and not layer._forward_pre_hooks and not layer._forward_hooks


def test_guard_refuses_before_running() -> None:
    """Witness: torch.profiler sees no op of the layer run; the memory limit is half of B·H·T²·4 + 4·B·T·E·4
    bytes, computed here."""
    layer = _layer()
    x = torch.randn(4, 64, 32)
    with guard(layer, max_tokens=100), qkvtrace.trace(layer) as t, pytest.raises(ValueError, match="max_tokens=100"):
        layer(x)
    assert t.calls == []  # nothing ran
    with (
        guard(layer, max_tokens=100),
        profile(activities=[ProfilerActivity.CPU]) as prof,
        pytest.raises(ValueError, match="max_tokens=100"),
    ):
        layer(x)
    assert not [e.name for e in prof.events() if e.name.startswith("aten::")]  # no PyTorch op ran
    mb = (4 * 4 * 64 * 64 * 4 + 4 * 4 * 64 * 32 * 4) / 2**20  # weights B·H·T² and Q, K, V, output in float32
    est = attention_estimate(layer, 4, 64)
    assert est["attention_mb"] == pytest.approx(mb)
    with (
        guard(layer, max_tokens=None, max_attention_mb=mb / 2),
        pytest.raises(ValueError, match="max_attention_mb"),
    ):
        layer(x)
    assert "forward" not in layer.__dict__


def test_estimate_grows_with_the_square_of_length() -> None:
    """Witness: B·H·T² weights plus 4·B·T·E activations in float32 bytes, computed here for the layer built here
    (4 heads, E = 32)."""
    layer = _layer()
    small, big = attention_estimate(layer, 1, 1024), attention_estimate(layer, 1, 2048)

    def mb(length: int) -> float:
        return (1 * 4 * length * length * 4 + 4 * 1 * length * 32 * 4) / 2**20

    assert (small["attention_mb"], big["attention_mb"]) == pytest.approx((mb(1024), mb(2048)))
    assert mb(2048) / mb(1024) > 3.5
    assert small["heads"] == 4 and small["bytes_per_element"] == 4


def _true_means(weights: torch.Tensor, true_at: torch.Tensor) -> str:
    """``attend`` if the weight sits where the mask is True, ``ignore`` if where it is False (written here)."""
    on_true = float(weights[true_at].abs().sum())
    on_false = float(weights[~true_at].abs().sum())
    assert (on_true == 0) != (on_false == 0), weights  # one of the two got all the weight
    return "attend" if on_false == 0 else "ignore"


def _witnessed_mask_semantics() -> dict[str, tuple[str, torch.Tensor | None]]:
    """What True means in each API, measured on PyTorch's own outputs with no qkvtrace involved,
    with the attention weights each API returned (``None`` where it returns none)."""
    example = torch.tensor([[True, False], [False, True]])
    found: dict[str, tuple[str, torch.Tensor | None]] = {}
    # SDPA: equal scores (q = k = 0), V = identity, so output row i is attention row i
    zeros = torch.zeros(1, 1, 2, 4)
    with torch.no_grad():
        w = F.scaled_dot_product_attention(zeros, zeros, torch.eye(2).reshape(1, 1, 2, 2), attn_mask=example)[0, 0]
    found["F.scaled_dot_product_attention:attn_mask"] = (_true_means(w, example), w)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 1, batch_first=True).eval()
    x = torch.randn(1, 2, 4)
    with torch.no_grad():
        _, w = mha(x, x, x, key_padding_mask=torch.tensor([[True, False]]), need_weights=True)
    kpm = torch.tensor([[True, False], [True, False]])
    found["nn.MultiheadAttention:key_padding_mask"] = (_true_means(w[0], kpm), w[0])
    with torch.no_grad():
        _, w = mha(x, x, x, attn_mask=example, need_weights=True)
    found["nn.MultiheadAttention:attn_mask"] = (_true_means(w[0], example), w[0])
    # the encoder layer returns no weights: does position 0 read position 1 when 1 is marked True?
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).eval()
    a = torch.randn(1, 2, 4)
    b = a.clone()
    b[0, 1] += 3.0
    marked = torch.tensor([[False, True]])
    with torch.no_grad():
        moved = not torch.allclose(layer(a, src_key_padding_mask=marked)[0, 0],
                                   layer(b, src_key_padding_mask=marked)[0, 0], atol=1e-6)  # fmt: skip
    found["nn.TransformerEncoderLayer:src_key_padding_mask"] = ("attend" if moved else "ignore", None)
    return found


def test_mask_semantics_are_measured() -> None:
    """Witness: each API's own output on the 2x2 example, classified here (no qkvtrace code)."""
    records = {r["api"]: r for r in mask_semantics()}
    witnessed = _witnessed_mask_semantics()
    for api, (true_means, weights) in witnessed.items():
        r = records[api]
        assert r["true_means"] == true_means, api
        assert r["masked_prob_zero"] is True, api  # _true_means asserted the blocked side got exactly 0
        if weights is None:
            assert r["rows_sum_to_one"] is None, api  # measured by perturbation: no weights to sum
        else:
            sums_to_one = bool(torch.allclose(weights.double().sum(-1), torch.ones(2, dtype=torch.float64)))
            assert sums_to_one and r["rows_sum_to_one"] is True, (api, weights)
    # the hand-written reference is True = may attend by its definition
    assert records["attention by hand (tutorial)"]["true_means"] == "attend"
    # and PyTorch's two conventions differ, as the tutorial warns
    assert witnessed["F.scaled_dot_product_attention:attn_mask"][0] == "attend"
    assert witnessed["nn.MultiheadAttention:key_padding_mask"][0] == "ignore"


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√d)V written here, in the inputs' dtype."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def test_fully_masked_rows_and_agreement_are_measured() -> None:
    """Witness: SDPA's MATH backend on an all-masked row, and every agreement number recomputed here
    from PyTorch's own outputs against softmax(QKᵀ/√d)V written in this test."""
    rows = {(r["api"], r["backend"]): r for r in fully_masked_rows()}
    math_row = rows[("F.scaled_dot_product_attention (bool mask)", "MATH")]
    q = torch.randn(1, 1, 2, 4)
    attend = torch.tensor([[False, False], [True, True]])  # query 0 may attend to nothing
    mask = attend if _witnessed_mask_semantics()["F.scaled_dot_product_attention:attn_mask"][0] == "attend" else ~attend
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[0, 0, 0]
    expected = "nan" if torch.isnan(out).all() else "zero" if (out == 0).all() else "other"
    assert math_row["result"] == expected
    assert rows[("attention by hand (tutorial)", None)]["result"] == "nan"  # softmax over all -inf

    ag = agreement()
    # SDPA, default backend, float32: the same inputs (manual_seed(0), float64 cast down), the error recomputed here
    torch.manual_seed(0)
    q64, k64, v64 = (torch.randn(2, 4, 16, 32, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        sdpa_err = _max_abs(F.scaled_dot_product_attention(q64.float(), k64.float(), v64.float()),
                            _by_hand(q64, k64, v64))  # fmt: skip
    [default32] = [r for r in ag["sdpa"] if r["backend"] == "default" and r["dtype"] == "float32"]
    assert default32["max_abs_diff"] == pytest.approx(sdpa_err, rel=0.06)  # the record keeps 2 digits
    assert sdpa_err < 1e-6
    # MHA: both paths against the three in_proj_weight slices applied by hand
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
        b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
        heads = [(x @ w.T + b).view(2, 6, 4, 8).transpose(1, 2) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))]
        ctx = _by_hand(*heads).transpose(1, 2).reshape(2, 6, 32)
        by_hand = ctx @ mha.out_proj.weight.T + mha.out_proj.bias
        fast = mha.eval()(x, x, x, need_weights=False)[0]
    mha.train()
    fallback = mha(x, x, x, need_weights=False)[0]
    fallback.square().mean().backward()
    errors = {"fast": _max_abs(fast, by_hand), "fallback": _max_abs(fallback.detach(), by_hand)}
    for r in ag["mha"]:
        assert r["max_abs_diff_to_by_hand"] == pytest.approx(errors[r["path"]], rel=0.06, abs=1e-12), r
    assert max(errors.values()) < 1e-6
    assert mha.in_proj_weight.grad is not None
    norms = [float(g.norm()) for g in mha.in_proj_weight.grad.chunk(3)]
    assert ag["slice_gradient_norms"] == pytest.approx(norms, rel=0.06)
    assert len({round(n, 6) for n in norms}) == 3  # three different slice gradients, measured here
    assert ag["slice_gradients_differ"] is True


def test_probe_cli(tmp_path: Path) -> None:
    """Witness: the file the command wrote, read here, and the running PyTorch's version."""
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "probe", "--json", str(out)], capture_output=True,
                          text=True, env=ENV, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["torch_version"] == torch.__version__
    assert len(data["scenarios"]) >= 12
    assert "what True means" in proc.stdout and "all masked" in proc.stdout
