"""``qkvtrace grads``: the numbers in the picture and the table are the tracer's, and PyTorch's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _witness import attention_core
from torch import nn

from qkvtrace.grads import measure
from qkvtrace.render.grads_render import fmt, grads_dot, slice_label

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip


class HandWritten(nn.Module):
    """Attention by hand (docs/tutorial.md#attention-by-hand): softmax(QKᵀ/√d)V with three projections."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(x.size(-1)), dim=-1)
        return weights @ v


def build_hand_written() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return HandWritten(), (torch.randn(2, 5, 8),)


def build_frozen() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    return nn.MultiheadAttention(8, 2, batch_first=True).requires_grad_(False), (x, x, x)


def test_picture_numbers_are_the_trace_records_and_the_real_grad() -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), 2)
    result = measure(model, (torch.randn(2, 6, 16),))
    dot = grads_dot(result, result.drawable())
    assert len(result.routes) == 2
    for route in result.routes:
        grad = next(g for g in result.trace.gradients if g.module == route.module)
        trace_route = next(r for r in result.trace.routes if r.call == route.call)
        weight = model.get_parameter(route.slices["q"].param)
        for part in "qkv":
            s = route.slices[part]
            assert s.grad_norm == getattr(grad, part).grad_norm  # the tracer's record ...
            e, i = weight.shape[0] // 3, "qkv".index(part)  # the demo's qkv(x).view(b, t, 3, H, d): thirds
            assert s.rows == [[i * e, (i + 1) * e]]
            real = weight.grad[i * e : (i + 1) * e].norm().item()
            assert s.grad_norm == pytest.approx(real, rel=1e-6)  # ... is the slice of the real .grad
            assert f"‖grad‖ {fmt(s.grad_norm)}" in dot  # ... and the label in the picture
            assert getattr(route, part)["norm"] == getattr(trace_route, part).norm
            assert fmt(getattr(route, part)["norm"]) in dot
            assert slice_label(s) in dot
        assert route.backward_kernel in dot


def test_hand_written_attention_gets_its_backward_node_and_routes() -> None:
    model, (x,) = build_hand_written()
    witness = model(x)  # un-instrumented: the nodes PyTorch builds
    result = measure(model, (x,))
    (route,) = result.routes
    assert route.path == "hand_written" and route.call == 0
    assert route.backward_kernel == attention_core(witness) == "SoftmaxBackward0 + BmmBackward0"
    # the routes equal autograd.grad with respect to Q, K, V of the same computation
    q, k, v = (p(x).detach().requires_grad_() for p in (model.q_proj, model.k_proj, model.v_proj))
    out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((out * probe).sum(), [q, k, v])
    for part, g in zip("qkv", grads, strict=True):
        assert getattr(route, part)["norm"] == pytest.approx(g.norm().item(), rel=1e-5)
    assert route.slices["v"].param == "v_proj.weight"
    assert route.slices["v"].grad_norm == pytest.approx(model.v_proj.weight.grad.norm().item(), rel=1e-6)


def test_cli_writes_svg_json_and_a_table(tmp_path: Path) -> None:
    svg, out_json = tmp_path / "routes.svg", tmp_path / "routes.json"
    done = _cli("grads", "demo:tiny-lm", "--svg", svg, "--json", out_json)
    assert done.returncode == 0, done.stderr
    data = json.loads(out_json.read_text())
    assert data["schema"] == "qkvtrace.grads/2" and data["loss"]["kind"] == "lm"
    text = svg.read_text()
    assert text.lstrip().startswith("<")
    for route in data["routes"]:
        assert route["module"] in done.stdout  # whole, on one line
        assert route["backward_kernel"] in done.stdout and route["backward_kernel"] in text
        for part in "qkv":
            assert fmt(route[part]["norm"]) in done.stdout and fmt(route[part]["norm"]) in text
            assert len(route[part]["per_head"]) == 4  # the demo has 4 heads
    assert _cli("validate", out_json).returncode == 0


def test_cli_one_call_and_bad_call(tmp_path: Path) -> None:
    done = _cli("grads", "demo:encoder", "--call", "1")
    assert done.returncode == 0, done.stderr
    assert "layers.1.self_attn" in done.stdout and "layers.0.self_attn" not in done.stdout
    bad = _cli("grads", "demo:encoder", "--call", "7")
    assert bad.returncode == 2 and "no such call" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_says_why_when_there_is_nothing_to_draw(tmp_path: Path) -> None:
    svg = tmp_path / "r.svg"
    done = _cli("grads", f"{Path(__file__)}:build_frozen", "--svg", svg)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no autograd graph" in done.stderr
    assert not svg.exists()


def test_cli_library_model_by_name_with_separate_projections(tmp_path: Path) -> None:
    """A Hugging Face BERT (q/k/v as separate Linear layers) by name, built from its config alone."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, attn_implementation="sdpa")  # fmt: skip
    config.save_pretrained(tmp_path / "bert")
    out_json = tmp_path / "g.json"
    done = _cli("grads", f"hf:{tmp_path / 'bert'}", "--random-init", "--json", out_json, "--input-shape", "2,8")
    assert done.returncode == 0, done.stderr
    routes = json.loads(out_json.read_text())["routes"]
    assert len(routes) == 2 and all(r["path"] == "sdpa" for r in routes)
    for r in routes:
        assert "ScaledDotProduct" in r["backward_kernel"] or "Softmax" in r["backward_kernel"]  # fused or MATH
        params = {part: r["slices"][part]["param"] for part in "qkv"}
        assert params["q"].endswith("query.weight") and params["v"].endswith("value.weight")
        assert all(r[part]["norm"] > 0 for part in "qkv")


def test_readme_grads_sample_is_what_grads_prints(tmp_path: Path) -> None:
    if not torch.__version__.startswith("2.13.0"):  # the numbers and kernels differ by release
        pytest.skip("the documented samples were printed by torch 2.13.0, the release its commands install")
    command = "qkvtrace grads demo:tiny-lm --svg docs/grads-tiny-lm.svg"
    lines = (ROOT / "docs" / "gradients.md").read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    shown = lines[start : lines.index("```", start)]
    done = _cli("grads", "demo:tiny-lm", "--svg", tmp_path / "g.svg")
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert shown[-1].startswith("wrote docs/grads-tiny-lm.svg")  # the last line names the SVG written ...
    assert printed[: len(shown) - 1] == shown[:-1]  # ... every line before it is printed as shown
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<")
