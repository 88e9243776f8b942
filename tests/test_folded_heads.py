"""Attention written by hand on ``[B·H, T, d]`` tensors (``bmm``, ``baddbmm``): maps come out ``[B, H, T, T]``
where the dataflow shows how the heads were folded, whether or not the module names its head count.

Witness of every map: ``softmax(q kᵀ · scale)`` computed in the test from the
module's own projection weights, with the test's own reshape to
``[B, H, T, d]``; of every per-head route norm: PyTorch's ``.grad`` of the
tensors the model handed to its attention, reshaped by the test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkvtrace

B, H, T, D = 2, 3, 5, 4
E = H * D
SCALE = D**-0.5


def _expected(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ · scale), [B, H, T, T], from the module's own weights (written here, not read from qkvtrace)."""
    with torch.no_grad():
        w, b = model.qkv.weight, model.qkv.bias
        q, k = ((x @ w[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E]).view(B, T, H, D).transpose(1, 2) for i in (0, 1))
        return (q @ k.transpose(-2, -1) * SCALE).softmax(-1)


def _folded(model: nn.Module, x: torch.Tensor, how: str) -> tuple[torch.Tensor, ...]:
    q, k, v = (p.reshape(B, T, H, D).transpose(1, 2) for p in model.qkv(x).split(E, -1))  # (B, H, T, D)
    if how == "view":  # contiguous, then a view: q is a view of the [B, H, T, D] copy
        return tuple(p.contiguous().view(B * H, T, D) for p in (q, k, v))
    return tuple(p.reshape(B * H, T, D) for p in (q, k, v))  # a copy: (B*H, T, D)


class Folded(nn.Module):
    """qkv projection, heads folded into the batch, bmm or baddbmm; no attribute names the head count."""

    def __init__(self, form: str = "bmm", how: str = "reshape") -> None:
        super().__init__()
        torch.manual_seed(3)
        self.qkv = nn.Linear(E, 3 * E)
        self.form, self.how = form, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _folded(self, x, self.how)
        if self.form == "bmm":
            s = torch.bmm(q, k.transpose(1, 2)) * SCALE
        else:
            s = torch.baddbmm(torch.zeros(B * H, T, T), q, k.transpose(1, 2), beta=0.0, alpha=SCALE)
        return torch.bmm(s.softmax(-1), v).view(B, H, T, D).transpose(1, 2).reshape(B, T, E)


class CoreAttention(nn.Module):
    """The attention alone: it receives Q, K, V already folded by its caller (the reshape runs outside it)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * SCALE).softmax(-1), v)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("form", ["bmm", "baddbmm"])
def test_map_of_folded_heads_is_b_h_t_t(form: str, grad: bool) -> None:
    """Witness: softmax(q kᵀ · scale) computed here from the module's weights, reshaped here to [B, H, T, T]."""
    model, x = Folded(form), torch.randn(B, T, E)
    assert not any(hasattr(model, a) for a in ("num_heads", "n_head", "n_heads", "heads"))
    with torch.set_grad_enabled(grad), qkvtrace.trace(model, attention_maps=True) as t:
        model(x)
    (c,) = t.calls
    assert c.path == "hand_written" and c.inputs["query_shape"] == [B * H, T, D]
    assert c.attention_map is not None and tuple(c.attention_map.shape) == (B, H, T, T)
    torch.testing.assert_close(c.attention_map, _expected(model, x), rtol=1e-5, atol=1e-6)
    assert c.inputs["heads"]["count"] == H


@pytest.mark.parametrize(("how", "grad"), [("reshape", True), ("view", False)], ids=["graph", "view-metadata"])
def test_folded_outside_the_module_is_read_from_the_tensors_history(how: str, grad: bool) -> None:
    """The fold runs in the caller, outside the watched module: the autograd graph (a reshape's saved sizes) or
    the view's base shows it. Witness: softmax(q kᵀ · scale) from the weights, reshaped here."""
    proj, x = Folded(how=how), torch.randn(B, T, E)
    core = CoreAttention()
    with torch.set_grad_enabled(grad):
        q, k, v = _folded(proj, x, how)
        with qkvtrace.trace(core, attention_maps=True) as t:
            core(q, k, v)
    (c,) = t.calls
    assert c.attention_map is not None and tuple(c.attention_map.shape) == (B, H, T, T)
    torch.testing.assert_close(c.attention_map, _expected(proj, x), rtol=1e-5, atol=1e-6)


def test_a_fold_nothing_shows_stays_one_block_and_says_so() -> None:
    """Under no_grad a reshape that copies leaves neither graph nor view behind, and the module names no head
    count: the map stays [1, B·H, T, T]. Witness: the same softmax from the weights, reshaped here to that shape."""
    proj, x = Folded(), torch.randn(B, T, E)
    core = CoreAttention()
    with torch.no_grad():
        q, k, v = _folded(proj, x, "reshape")
        with qkvtrace.trace(core, attention_maps=True) as t:
            core(q, k, v)
    (c,) = t.calls
    assert c.attention_map is not None and tuple(c.attention_map.shape) == (1, B * H, T, T)
    torch.testing.assert_close(c.attention_map, _expected(proj, x).reshape(1, B * H, T, T), rtol=1e-5, atol=1e-6)
    assert c.inputs["heads"]["count"] is None and "not shown" in c.inputs["heads"]["evidence"]


def test_routes_of_folded_heads_are_per_head_from_the_dataflow() -> None:
    """Witness: PyTorch's own .grad of the q, k, v the model handed to its attention (retained here), reshaped here
    to [B, H, T, d] for the per-head norms."""
    kept: dict[str, torch.Tensor] = {}

    class Keeping(Folded):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = _folded(self, x, "reshape")
            kt = k.transpose(1, 2)
            for name, p in zip("qkv", (q, kt, v), strict=True):
                p.retain_grad()
                kept[name] = p
            return torch.bmm((torch.bmm(q, kt) * SCALE).softmax(-1), v)

    model, x = Keeping(), torch.randn(B, T, E)
    with qkvtrace.trace(model) as t:
        (model(x) * torch.randn(B * H, T, D, generator=torch.Generator().manual_seed(1))).sum().backward()
    (route,) = t.routes
    for part in "qkv":
        grad = kept[part].grad
        grad = grad.transpose(1, 2) if part == "k" else grad
        want = grad.reshape(B, H, T, D).transpose(0, 1).reshape(H, -1).norm(dim=1).tolist()
        got = getattr(route, part)
        assert got.per_head == pytest.approx(want, rel=1e-5), part
