"""Norms of the tensors an attention call receives when they are views whose rows lie apart in memory.

A packed projection split into Q, K and V and viewed as heads (GPT-2's
layout: ``[B, T, 3E]`` split along the last dimension, then ``[B, H, T, D]``
by a transpose) hands SDPA strided views; the records' ``activation_norm``
of each must be the norm of exactly those values. The witness is the norm
computed here in float64 from a contiguous copy of each tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

B, T, H, D = 2, 7, 4, 8
E = H * D


class _Packed(nn.Module):
    """One ``[E, 3E]`` projection, split into Q, K and V and viewed as heads: strided views go to SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        self.seen = [q, k, v]
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_activation_norms_of_strided_heads(dtype: torch.dtype) -> None:
    """Witness: ``torch.linalg.vector_norm`` in float64 of a contiguous copy of each tensor SDPA received (kept
    by the model itself), against the record's ``activation_norm`` (computed in float32: relative 1e-5)."""
    torch.manual_seed(0)
    model = _Packed().to(dtype)
    x = torch.randn(B, T, E, dtype=dtype)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x)
    assert all(not s.is_contiguous() and s.stride(-1) == 1 for s in model.seen)  # the layout this test is about
    (call,) = t.calls
    for part, tensor in zip("qkv", model.seen, strict=True):
        want = float(torch.linalg.vector_norm(tensor.contiguous().double()))
        assert getattr(call.qkv, part).activation_norm == pytest.approx(want, rel=1e-5)


def test_a_conv1d_weight_used_by_columns_and_its_gradient() -> None:
    """transformers' ``Conv1D`` (GPT-2's projection: ``[E, 3E]`` weight, ``x @ W``, so a part's rows are columns):
    each part's weight norm and gradient norm are those of its columns, strided slices of the weight. Witness:
    float64 norms of column slices of the weight and of its ``.grad`` taken here."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(1)

    class Conv1DAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = conv1d(3 * E, E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.c_attn(x).split(E, dim=-1))
            return F.scaled_dot_product_attention(q, k, v)

    model = Conv1DAttention()
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, T, E)).square().sum().backward()
    (call,) = t.calls
    (grads,) = t.gradients
    weight = model.c_attn.weight
    assert weight.grad is not None and weight.shape == (E, 3 * E)
    for i, part in enumerate("qkv"):
        cols = slice(i * E, (i + 1) * E)
        info = getattr(call.qkv, part)
        assert (info.param, info.rows, info.dim) == ("c_attn.weight", [[i * E, (i + 1) * E]], 1)
        assert info.weight_norm == pytest.approx(float(weight.detach()[:, cols].double().norm()), rel=1e-6)
        grad = getattr(grads, part).grad_norm
        assert grad == pytest.approx(float(weight.grad[:, cols].double().norm()), rel=1e-6)
