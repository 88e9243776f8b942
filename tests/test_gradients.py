"""Per-slice Q/K/V gradients (docs/tutorial.md#gradients-of-q-k-and-v), measured against the real ``.grad``.

Every expected number here is computed by the test itself from the
parameters' ``.grad`` (or, for one pass alone, with ``torch.autograd.grad``
on an untouched copy of the model), never taken from the tracer.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.records import TraceResult

E, H, B, L = 32, 4, 2, 5
PARTS = ("q", "k", "v")


def approx(x: Any) -> Any:
    return pytest.approx(float(x), rel=1e-5, abs=1e-7)


def loss_of(module: nn.Module, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
            target: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A loss that depends on Q, K and V differently (so their gradients differ)."""
    k = q if k is None else k
    v = q if v is None else v
    out = module(q, k, v, need_weights=False)[0] if isinstance(module, nn.MultiheadAttention) else module(q)
    if target is None:
        target = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return (out * target).sum() + out.square().mean()


def slice_norms(weight_grad: Any, bias_grad: Any) -> dict[str, tuple[float, float | None]]:
    """Norms of rows [0,E), [E,2E), [2E,3E) of a packed weight's and bias's gradient."""
    assert weight_grad is not None
    w = weight_grad.chunk(3)
    if bias_grad is None:
        return {p: (float(w[i].norm()), None) for i, p in enumerate(PARTS)}
    b = bias_grad.chunk(3)
    return {p: (float(w[i].norm()), float(b[i].norm())) for i, p in enumerate(PARTS)}


def assert_record(record: Any, expected: dict[str, tuple[float, float | None]], *, pass_alone: bool = False) -> None:
    for part in PARTS:
        sg = getattr(record, part)
        w, b = expected[part]
        got_w = sg.pass_grad_norm if pass_alone else sg.grad_norm
        got_b = sg.pass_bias_grad_norm if pass_alone else sg.bias_grad_norm
        assert got_w == approx(w), (part, "weight", pass_alone)
        if b is None:
            assert got_b is None, (part, "bias", pass_alone)
        else:
            assert got_b == approx(b), (part, "bias", pass_alone)


def test_packed_mha_slices_match_in_proj_grad() -> None:
    """Witness: thirds of ``in_proj_weight.grad`` and ``in_proj_bias.grad``, sliced in the test."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x).backward()

    assert len(t.gradients) == 1
    record = t.gradients[0]
    assert (record.module, record.backward_index) == ("", 0)
    expected = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)
    assert_record(record, expected)
    assert_record(record, expected, pass_alone=True)  # first pass: .grad is this pass alone
    # q, k and v are different slices with different gradients
    norms = [getattr(record, p).grad_norm for p in PARTS]
    assert all(n > 0 for n in norms)
    assert len({round(n, 6) for n in norms}) == 3, norms
    # and they are slices of one packed parameter, not three copies of its norm
    assert mha.in_proj_weight.grad is not None
    whole = float(mha.in_proj_weight.grad.norm())
    assert sum(n * n for n in norms) == approx(whole * whole)

    call = t.calls[0]
    assert call.qkv.layout == "packed"
    assert [getattr(call.qkv, p).rows for p in PARTS] == [[[0, E]], [[E, 2 * E]], [[2 * E, 3 * E]]]
    assert {getattr(call.qkv, p).param for p in PARTS} == {"in_proj_weight"}


def test_module_run_twice_before_one_backward() -> None:
    """Witness: the real .grad, and ``torch.autograd.grad`` on an untouched copy of the module."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    reference = copy.deepcopy(mha)
    x1, x2 = torch.randn(B, L, E), torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        (loss_of(mha, x1) + 2 * loss_of(mha, x2)).backward()

    assert len(t.calls) == 2
    assert [(g.module, g.backward_index) for g in t.gradients] == [("", 0)]
    expected = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)
    assert_record(t.gradients[0], expected)
    assert_record(t.gradients[0], expected, pass_alone=True)
    # both uses are in it: independently, on an untouched copy
    gw, gb = torch.autograd.grad(
        loss_of(reference, x1) + 2 * loss_of(reference, x2), [reference.in_proj_weight, reference.in_proj_bias]
    )
    assert_record(t.gradients[0], slice_norms(gw, gb))
    gw1, _ = torch.autograd.grad(loss_of(reference, x1), [reference.in_proj_weight, reference.in_proj_bias])
    assert t.gradients[0].q.grad_norm != approx(gw1[:E].norm())


def test_two_backwards_without_zero_grad() -> None:
    """Witness: .grad read after each backward, and ``torch.autograd.grad`` of each pass on an untouched copy."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    reference = copy.deepcopy(mha)
    x1, x2 = torch.randn(B, L, E), torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x1).backward()
        after_first = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)
        loss_of(mha, x2).backward()  # no zero_grad: .grad accumulates
        after_second = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)

    assert [(g.module, g.backward_index) for g in t.gradients] == [("", 0), ("", 1)]
    first, second = t.gradients
    params = [reference.in_proj_weight, reference.in_proj_bias]
    pass1 = slice_norms(*torch.autograd.grad(loss_of(reference, x1), params))
    pass2 = slice_norms(*torch.autograd.grad(loss_of(reference, x2), params))

    assert_record(first, after_first)
    assert_record(first, pass1, pass_alone=True)
    # grad_norm: what .grad holds now (both passes); pass_grad_norm: the second pass alone
    assert_record(second, after_second)
    assert_record(second, pass2, pass_alone=True)
    assert second.q.grad_norm != approx(second.q.pass_grad_norm)


def test_zero_grad_between_backwards_gives_each_pass() -> None:
    """Witness: the real .grad after the second pass, sliced in the test."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x1, x2 = torch.randn(B, L, E), torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x1).backward()
        mha.zero_grad()
        loss_of(mha, x2).backward()
    assert [g.backward_index for g in t.gradients] == [0, 1]
    expected = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)
    assert_record(t.gradients[1], expected)
    assert_record(t.gradients[1], expected, pass_alone=True)


def test_separate_layout_uses_q_k_v_proj_weights() -> None:
    """Witness: the real .grad of ``q/k/v_proj_weight`` and of the packed bias; the shapes passed here."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, kdim=24, vdim=20)
    assert mha.in_proj_weight is None
    q, k, v = torch.randn(B, L, E), torch.randn(B, L + 2, 24), torch.randn(B, L + 2, 20)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, q, k, v).backward()

    call = t.calls[0]
    assert call.qkv.layout == "separate"
    assert [getattr(call.qkv, p).param for p in PARTS] == ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    assert [getattr(call.qkv, p).shape for p in PARTS] == [[E, E], [E, 24], [E, 20]]

    [record] = t.gradients
    bias = mha.in_proj_bias.grad.chunk(3)  # the bias stays packed
    weights = [mha.q_proj_weight.grad, mha.k_proj_weight.grad, mha.v_proj_weight.grad]
    expected = {p: (float(weights[i].norm()), float(bias[i].norm())) for i, p in enumerate(PARTS)}
    assert_record(record, expected)
    assert_record(record, expected, pass_alone=True)


def test_no_bias_gives_null_bias_grad() -> None:
    """Witness: the real .grad of ``in_proj_weight``, sliced in the test; ``bias=False`` given here."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, bias=False)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x).backward()
    [record] = t.gradients
    assert_record(record, slice_norms(mha.in_proj_weight.grad, None))


def test_custom_packed_linear_module_calling_sdpa(packed_attention_cls: Any) -> None:
    """Witness: the real .grad of ``qkv``, and ``torch.autograd.grad`` of the second pass on an untouched copy."""
    model = nn.Sequential(nn.Linear(E, E), packed_attention_cls(E, H))
    attn: Any = model[1]
    reference = copy.deepcopy(model)
    x1, x2 = torch.randn(B, L, E), torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        loss_of(model, x1).backward()
        loss_of(model, x2).backward()

    assert [(c.module, c.path) for c in t.calls] == [("1", "sdpa"), ("1", "sdpa")]
    assert t.calls[0].qkv.layout == "packed"
    assert {getattr(t.calls[0].qkv, p).param for p in PARTS} == {"qkv.weight"}
    assert [(g.module, g.backward_index) for g in t.gradients] == [("1", 0), ("1", 1)]
    assert_record(t.gradients[1], slice_norms(attn.qkv.weight.grad, attn.qkv.bias.grad))
    ref: Any = reference[1].qkv
    pass2 = slice_norms(*torch.autograd.grad(loss_of(reference, x2), [ref.weight, ref.bias]))
    assert_record(t.gradients[1], pass2, pass_alone=True)


def test_each_module_of_an_encoder_gets_its_own_record() -> None:
    """Witness: each layer's real ``in_proj`` .grad, sliced in the test."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(enc) as t:
        enc(x).square().sum().backward()
    assert [(g.module, g.backward_index) for g in t.gradients] == [
        ("layers.0.self_attn", 0),
        ("layers.1.self_attn", 0),
    ]
    for record, lyr in zip(t.gradients, enc.layers, strict=True):
        assert_record(record, slice_norms(lyr.self_attn.in_proj_weight.grad, lyr.self_attn.in_proj_bias.grad))


def test_only_modules_reached_by_the_backward_get_a_record() -> None:
    """Witness: PyTorch leaves ``b``'s .grad None: the backward never reached it."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.MultiheadAttention(E, H, batch_first=True)
            self.b = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x, x, x)[0], self.b(x, x, x)[0]

    model = Two()
    with qkvtrace.trace(model) as t:
        ya, _ = model(torch.randn(B, L, E))
        ya.sum().backward()
    assert [g.module for g in t.gradients] == ["a"]
    assert model.b.in_proj_weight.grad is None


def test_gradients_in_json() -> None:
    """Witness: the real .grad after both passes, sliced in the test."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x1, x2 = torch.randn(B, L, E), torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x1).backward()
        loss_of(mha, x2).backward()
    data = json.loads(json.dumps(t.to_dict()))
    assert data["schema"] == "qkvtrace.trace/3"
    grads = data["gradients"]
    assert [(g["module"], g["backward_index"]) for g in grads] == [("", 0), ("", 1)]
    expected = slice_norms(mha.in_proj_weight.grad, mha.in_proj_bias.grad)
    for g in grads:
        assert {"module", "backward_index", "q", "k", "v"} <= g.keys()
        for part in PARTS:
            assert {"grad_norm", "bias_grad_norm"} <= g[part].keys()
            assert isinstance(g[part]["grad_norm"], float)
            assert isinstance(g[part]["bias_grad_norm"], float)
    for part in PARTS:
        assert grads[1][part]["grad_norm"] == approx(expected[part][0])
        assert grads[1][part]["bias_grad_norm"] == approx(expected[part][1])
    # and it reads back to the same records, still holding the real .grad
    read_back = TraceResult.from_dict(data).gradients
    assert read_back == t.gradients
    assert_record(read_back[1], expected)


class _Attend(nn.Module):
    """A small "attend" module with no weights of its own: its parent holds the projection."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class _Block(nn.Module):
    """Q, K and V from one packed ``qkv`` of the block, attended by its child ``attend``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.attend = _Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, E // H).permute(2, 0, 3, 1, 4)
        return self.attend(q, k, v)


def test_gradient_records_name_their_weights_rows_and_holder() -> None:
    """Witness: the layouts by construction -- MultiheadAttention packs Q, K and V as the thirds of
    ``in_proj_weight`` (rows [0, E), [E, 2E), [2E, 3E)); with ``kdim``/``vdim`` they are ``q_proj_weight``,
    ``k_proj_weight`` and ``v_proj_weight``, each whole; the test's block packs them in ``qkv.weight`` and its
    child ``attend`` calls the kernel, so the records' holder is the block's name. Each gradient record says what
    the call's own slices say, in the JSON too, and reads back the same."""
    third = [[[0, E]], [[E, 2 * E]], [[2 * E, 3 * E]]]
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        loss_of(mha, x).backward()
    [record] = t.gradients
    assert record.holder is None
    assert [(getattr(record, p).param, getattr(record, p).rows) for p in PARTS] == [
        ("in_proj_weight", rows) for rows in third
    ]
    separate = nn.MultiheadAttention(E, H, batch_first=True, kdim=24, vdim=20)
    q, k, v = torch.randn(B, L, E), torch.randn(B, L + 2, 24), torch.randn(B, L + 2, 20)
    with qkvtrace.trace(separate) as t:
        loss_of(separate, q, k, v).backward()
    [record] = t.gradients
    assert [(getattr(record, p).param, getattr(record, p).rows) for p in PARTS] == [
        ("q_proj_weight", [[0, E]]), ("k_proj_weight", [[0, E]]), ("v_proj_weight", [[0, E]])
    ]
    model = nn.Sequential(nn.Linear(E, E), _Block())
    with qkvtrace.trace(model) as t:
        model(x).square().mean().backward()
    [record] = t.gradients
    assert (record.module, record.holder) == ("1.attend", "1")
    assert [(getattr(record, p).param, getattr(record, p).rows) for p in PARTS] == [
        ("qkv.weight", rows) for rows in third
    ]
    data = json.loads(json.dumps(t.to_dict()))
    assert data["gradients"][0]["holder"] == "1" and data["gradients"][0]["k"]["rows"] == third[1]
    assert TraceResult.from_dict(data).gradients == t.gradients
