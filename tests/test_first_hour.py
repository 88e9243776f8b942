"""A newcomer's first hour: each friction they met, through the real command line or the public API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def qkv(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkvtrace", *args],
        capture_output=True, text=True, cwd=cwd, env=ENV, timeout=300,
    )  # fmt: skip


class NormedAttention(nn.Module):
    """Self-attention, then a final LayerNorm: each output row sums to a constant, so sum() has no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.attn(x, x, x, need_weights=False)[0])


def normed_attention() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = NormedAttention()
    return model, torch.randn(2, 5, 16)


FACTORIES = textwrap.dedent(
    '''
    import torch
    from torch import nn

    class NormedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(self.attn(x, x, x, need_weights=False)[0])

    def normed_attention():
        torch.manual_seed(0)
        model = NormedAttention()
        return model, torch.randn(2, 5, 16)
    '''
)


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "factories.py").write_text(FACTORIES)
    return tmp_path


def test_trace_backward_through_final_layernorm_is_not_rounding_noise(factories: Path) -> None:
    """`trace --backward` backpropagates a fixed random cotangent, not the output's sum.

    Witness: the same model and inputs built in the test; ``torch.autograd.grad``
    of ``out.sum()`` is ~0 (the LayerNorm makes each row's sum constant), while
    a backward of ``<out, R>`` with R from ``torch.Generator().manual_seed(0)``,
    computed here, gives ``.grad`` rows whose norms the CLI must report.
    """
    model, x = normed_attention()
    w = model.attn.in_proj_weight
    out = model(x)
    (by_sum,) = torch.autograd.grad(out.sum(), w, retain_graph=True)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * r).sum().backward()
    assert by_sum.norm() < 1e-4 * w.grad.norm(), "the witness model must make sum() gradient-free"
    e = 16
    expected = {p: w.grad[i * e:(i + 1) * e].norm().item() for i, p in enumerate("qkv")}

    proc = qkv("trace", "factories.py:normed_attention", "--backward", "--json", "t.json", cwd=factories)
    assert proc.returncode == 0, proc.stderr
    assert "backward of <output, R>" in proc.stdout, proc.stdout
    got = json.loads((factories / "t.json").read_text())["gradients"]
    assert len(got) == 1
    for p in "qkv":
        assert got[0][p]["grad_norm"] == pytest.approx(expected[p], rel=1e-5), p
