"""``qkvtrace grads``: the numbers in the picture and the table are the tracer's, and PyTorch's."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _witness import attention_core
from torch import nn

from qkvtrace.analyses.demos import demo_tiny_lm
from qkvtrace.analyses.grads import measure
from qkvtrace.render.grads_render import grads_dot

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


def four(x: float) -> str:
    """A number as the picture and the table print it: four significant digits."""
    return f"{x:.4g}"


def sdpa_input_grads(out: torch.Tensor, loss: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """dL/dQ, dL/dK, dL/dV of each fused SDPA call of an untraced graph, in call order.

    Read from PyTorch's own backward nodes, hooked here; a call's backward runs
    after the backward of every call its output feeds, so firing order is call order reversed.
    """
    nodes, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "ScaledDotProduct" in type(node).__name__:
            nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    fired: list[tuple[torch.Tensor, ...]] = []
    for node in nodes:
        node.register_hook(lambda grad_inputs, _: fired.append(tuple(g.detach() for g in grad_inputs[:3])))
    loss.backward()
    assert len(fired) == len(nodes)
    return fired[::-1]


def build_hand_written() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return HandWritten(), (torch.randn(2, 5, 8),)


def build_frozen() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    return nn.MultiheadAttention(8, 2, batch_first=True).requires_grad_(False), (x, x, x)


def test_picture_numbers_are_the_trace_records_and_the_real_grad() -> None:
    """Witness: the real .grad sliced here, and dL/dQ, dL/dK, dL/dV from PyTorch's own SDPA backward nodes
    on an untouched copy, with the probe loss written here; labels formatted here."""
    torch.manual_seed(0)
    zero_state = torch.get_rng_state()  # a generator at 0, as the probe loss draws its R
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), 2)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6, 16)
    result = measure(model, (x,))
    dot = grads_dot(result, result.drawable())
    out = reference(x)
    generator = torch.Generator()
    generator.set_state(zero_state)
    probe = torch.randn(out.shape, generator=generator)
    witness = sdpa_input_grads(out, (out * probe).sum())
    assert [r.module for r in result.routes] == ["layers.0.self_attn", "layers.1.self_attn"]
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
            assert f"‖grad‖ {four(s.grad_norm)}" in dot  # ... and the label in the picture
            assert getattr(route, part)["norm"] == getattr(trace_route, part).norm
            # dL/d(part) of this call, from PyTorch's own backward node
            assert getattr(route, part)["norm"] == pytest.approx(witness[route.call][i].norm().item(), rel=1e-5)
            assert four(getattr(route, part)["norm"]) in dot
            assert f"{route.module}.in_proj_weight[{i * e}:{(i + 1) * e}]" in dot
        assert route.backward_kernel in dot


def test_hand_written_attention_gets_its_backward_node_and_routes() -> None:
    """Witness: the untraced graph's nodes, ``torch.autograd.grad`` on Q, K, V recomputed here, the real .grad."""
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
    """Witness: the demo model built here, its next-token loss written here: the real .grad of each ``qkv``
    slice, and dL/dQ, dL/dK, dL/dV (whole and per head) from PyTorch's own SDPA backward nodes."""
    svg, out_json = tmp_path / "routes.svg", tmp_path / "routes.json"
    done = _cli("grads", "demo:tiny-lm", "--svg", svg, "--json", out_json)
    assert done.returncode == 0, done.stderr
    data = json.loads(out_json.read_text())
    assert data["schema"] == "qkvtrace.grads/2" and data["loss"]["kind"] == "lm"
    text = svg.read_text()
    assert text.lstrip().startswith("<")
    model, (ids,) = demo_tiny_lm()
    out = model(ids)
    loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
    assert data["loss"]["value"] == pytest.approx(loss.item(), rel=1e-5)
    witness = sdpa_input_grads(out, loss)
    assert [r["module"] for r in data["routes"]] == ["blocks.0.attention", "blocks.1.attention"]
    for n, route in enumerate(data["routes"]):
        assert route["module"] in done.stdout  # whole, on one line
        assert route["backward_kernel"] in done.stdout and route["backward_kernel"] in text
        grad = model.blocks[n].attention.qkv.weight.grad
        for i, part in enumerate("qkv"):
            assert four(route[part]["norm"]) in done.stdout and four(route[part]["norm"]) in text
            assert len(route[part]["per_head"]) == 4  # the demo has 4 heads
            g = witness[n][i]  # [batch, heads, tokens, head_dim]
            assert route[part]["norm"] == pytest.approx(g.norm().item(), rel=1e-4)
            assert route[part]["per_head"] == pytest.approx([g[:, h].norm().item() for h in range(4)], rel=1e-4)
            assert route["slices"][part]["param"] == f"blocks.{n}.attention.qkv.weight"
            assert route["slices"][part]["rows"] == [[i * 64, (i + 1) * 64]]
            real = grad[i * 64 : (i + 1) * 64].norm().item()
            assert route["slices"][part]["grad_norm"] == pytest.approx(real, rel=1e-4)
    assert _cli("validate", out_json).returncode == 0


def test_cli_one_call_and_bad_call(tmp_path: Path) -> None:
    """Witness: the demo encoder has two layers, named by ``nn.TransformerEncoder`` itself; call 7 does not exist."""
    done = _cli("grads", "demo:encoder", "--call", "1")
    assert done.returncode == 0, done.stderr
    assert "layers.1.self_attn" in done.stdout and "layers.0.self_attn" not in done.stdout
    bad = _cli("grads", "demo:encoder", "--call", "7")
    assert bad.returncode == 2 and "no such call" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_says_why_when_there_is_nothing_to_draw(tmp_path: Path) -> None:
    """Witness: ``build_frozen`` turns ``requires_grad`` off on every weight: PyTorch builds no graph."""
    svg = tmp_path / "r.svg"
    done = _cli("grads", f"{Path(__file__)}:build_frozen", "--svg", svg)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no autograd graph" in done.stderr
    assert not svg.exists()


def test_cli_library_model_by_name_with_separate_projections(tmp_path: Path) -> None:
    """A Hugging Face BERT (q/k/v as separate Linear layers) by name, built from its config alone.

    Witness: the config written here (2 layers; BERT's own ``query``/``value`` Linear names).
    """
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
    """Witness: the sample in docs/gradients.md, compared line by line with the command run now."""
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
