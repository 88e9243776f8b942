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
    by the model itself), against the record's ``activation_norm`` (computed in float32: relative 1e-5) -- on the
    first call and on the steady calls after it (each on inputs of its own), whose numbers are taken apart from
    the full observer's."""
    torch.manual_seed(0)
    model = _Packed().to(dtype)
    seen = []
    with torch.no_grad(), qkvtrace.trace(model) as t:
        for _ in range(4):
            model(torch.randn(B, T, E, dtype=dtype))
            seen.append([s.contiguous() for s in model.seen])
    assert all(not s.is_contiguous() and s.stride(-1) == 1 for s in model.seen)  # the layout this test is about
    assert len(t.calls) == len(seen)
    for call, tensors in zip(t.calls, seen, strict=True):
        for part, tensor in zip("qkv", tensors, strict=True):
            want = float(torch.linalg.vector_norm(tensor.double()))
            assert getattr(call.qkv, part).activation_norm == pytest.approx(want, rel=1e-5), (call.index, part)


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


def _packed_heads(x: torch.Tensor) -> list[torch.Tensor]:
    """GPT-2's layout: ``[B, T, 3E]`` split along the last dimension, each part viewed as ``[B, H, T, D]``."""
    b, t, _ = x.shape
    return [p.view(b, t, H, -1).transpose(1, 2) for p in x.split(x.shape[-1] // 3, dim=-1)]


def _interleaved_heads(x: torch.Tensor) -> list[torch.Tensor]:
    """Q, K and V interleaved per head (``[B, T, H, 3, D]``): only each head's ``D`` values lie together."""
    b, t, _ = x.shape
    parts = x.view(b, t, H, 3, -1).transpose(1, 2)
    return [parts[:, :, :, i] for i in range(3)]


def _batch_inner(x: torch.Tensor) -> list[torch.Tensor]:
    """``nn.MultiheadAttention``'s layout: ``[T, B, E]`` parts made contiguous, viewed as ``[B·H, T, D]``: dense
    in another order of their dimensions."""
    b, t, e3 = x.shape
    return [p.transpose(0, 1).contiguous().view(t, b * H, -1).transpose(0, 1).reshape(b, H, t, -1)
            for p in x.split(e3 // 3, dim=-1)]  # fmt: skip


def _expanded_key(x: torch.Tensor) -> list[torch.Tensor]:
    """One key/value head shared by every query head (``expand``: stride 0 across the heads)."""
    q, k, v = _packed_heads(x)
    return [q, k[:, :1].expand_as(k), v[:, :1].expand_as(v)]


@pytest.mark.parametrize("layout", [_packed_heads, _interleaved_heads, _batch_inner, _expanded_key])
def test_activation_norms_of_large_views(layout: object) -> None:
    """Views large enough (``[2, 4, 64, 16]``, 8,192 values) to be reduced over their dense runs first, in the
    layouts models hand SDPA. Witness: ``torch.linalg.vector_norm`` in float64 of a contiguous copy of each
    tensor the model passed, against the record's ``activation_norm`` (relative 1e-5)."""
    seen: list[torch.Tensor] = []

    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen[:] = layout(x)  # type: ignore[operator]
            return F.scaled_dot_product_attention(*seen)

    torch.manual_seed(2)
    x = torch.randn(2, 64, 3 * 64)
    model = Views()
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x)
    (call,) = t.calls
    for part, tensor in zip("qkv", seen, strict=True):
        want = float(torch.linalg.vector_norm(tensor.contiguous().double()))
        assert getattr(call.qkv, part).activation_norm == pytest.approx(want, rel=1e-5)


def test_the_dense_run_of_a_view() -> None:
    """Which dimensions of a view are reduced first. Witness: the layouts built here, whose dense runs are known by
    construction (GPT-2's heads: the H·D values of a token's part lie together; interleaved heads: a head's D values;
    a weight's column slice: each row's; a dense view in any order, or one with no unit stride: none)."""
    from qkvtrace.facts.slices import dense_run

    x = torch.zeros(2, 64, 3 * 64)
    q = _packed_heads(x)[0]  # [2, 4, 64, 16], strides (12288, 16, 192, 1)
    assert dense_run(q.shape, q.stride()) == (1, 3)
    q = _interleaved_heads(x)[0]
    assert dense_run(q.shape, q.stride()) == (3,)
    w = torch.zeros(96, 128)[:, 32:64]
    assert dense_run(w.shape, w.stride()) == (1,)
    assert dense_run(_batch_inner(x)[0].shape, _batch_inner(x)[0].stride()) is None  # dense, dimensions reordered
    assert dense_run((4, 8, 1, 16), (128, 16, 999, 1)) is None  # dense once the size-1 dimension is passed over
    assert dense_run((4, 8, 16), (256, 32, 2)) is None  # no unit stride
    assert dense_run((4, 8, 16), (0, 16, 1)) is None  # stride 0 (expand) outermost: the rest is dense
    assert dense_run((4, 3, 8, 16), (512, 0, 16, 1)) == (2, 3)  # heads expanded between dense runs
    # overlapping windows (as ``unfold`` makes): the run ends at the first dimension that does not continue it, even
    # where an outer one would
    assert dense_run((2, 2, 16), (16, 8, 1)) == (2,)
    # permuted, then cut along its dimension 3 (the original dimension 1): the values of the first four of its five
    # [6, 7] blocks lie together, for each of the 4 along dimension 1 (the original outermost, stride 210 > 4·42)
    t = torch.zeros(4, 5, 6, 7).permute(2, 0, 3, 1)[:, :, :, :4]
    assert dense_run(t.shape, t.stride()) == (0, 2, 3)
