"""Q/K/V slices are derived from what the model does, whatever the layout of its projection.

Each model below lays its Q/K/V projection out differently; each says, by
construction, which rows (columns for a ``Conv1D`` ``[in, out]`` weight) of
which weight become Q, K and V. That index -- written in the test, from the
model's own forward, never from qkvtrace -- is the witness: the recorded
rows, the weight and bias norms, the gradient norms (against ``.grad`` taken
at those indices) and the endpoints of ``qkvtrace grads`` routes must all
match it, in training and under ``torch.no_grad`` and ``inference_mode``,
where the call itself builds no graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.grads import measure

E, H, B, L = 16, 4, 2, 5
D = E // H
KV = 2  # key/value heads of the grouped-query model

#: per part: (weight name in the module holding it, the indices of its rows that the part is made of)
Truths = dict[str, tuple[str, torch.Tensor]]


def _heads(t: torch.Tensor, heads: int = H) -> torch.Tensor:
    """[B, L, heads*D] -> [B, heads, L, D]"""
    return t.reshape(B, L, heads, D).transpose(1, 2)


def _merge(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2).reshape(B, L, E)


class Packed(nn.Module):
    """``qkv(x).view(B, L, 3, H, D)``: contiguous thirds, q first."""

    truth: ClassVar[Truths] = {"q": ("qkv.weight", torch.arange(0, E)), "k": ("qkv.weight", torch.arange(E, 2 * E)),
                               "v": ("qkv.weight", torch.arange(2 * E, 3 * E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))


def _interleaved(part: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * 3 * D + part * D, h * 3 * D + (part + 1) * D) for h in range(H)])


class Interleaved(nn.Module):
    """Bloom-style ``[..., heads, 3, head_dim]``: Q is rows ``h*3D + [0, D)`` of every head."""

    truth: ClassVar[Truths] = {p: ("query_key_value.weight", _interleaved(i)) for i, p in enumerate("qkv")}

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value, self.dense = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(x).view(B, L, H, 3, D).permute(3, 0, 2, 1, 4)  # each [B, H, L, D]
        return self.dense(_merge(F.scaled_dot_product_attention(q, k, v)))


class GroupedFused(nn.Module):
    """One projection ``(H + 2*KV) * D`` wide, split into H query heads and KV key/value heads."""

    truth: ClassVar[Truths] = {"q": ("wqkv.weight", torch.arange(0, H * D)),
                               "k": ("wqkv.weight", torch.arange(H * D, (H + KV) * D)),
                               "v": ("wqkv.weight", torch.arange((H + KV) * D, (H + 2 * KV) * D))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.wqkv, self.wo = nn.Linear(E, (H + 2 * KV) * D, bias=False), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).split([H * D, KV * D, KV * D], dim=-1)
        k, v = _heads(k, KV), _heads(v, KV)
        if not _HAS_GQA:  # before 2.5 SDPA has no enable_gqa: each K/V head is repeated for its queries by hand
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            out = F.scaled_dot_product_attention(_heads(q), k, v)
        else:
            out = F.scaled_dot_product_attention(_heads(q), k, v, enable_gqa=True)
        return self.wo(_merge(out))


_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class Permuted(nn.Module):
    """``k, v, q = proj(x).split(E)``: the order is not q, k, v."""

    truth: ClassVar[Truths] = {"k": ("proj.weight", torch.arange(0, E)), "v": ("proj.weight", torch.arange(E, 2 * E)),
             "q": ("proj.weight", torch.arange(2 * E, 3 * E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v, q = (_heads(t) for t in self.proj(x).split(E, dim=-1))
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))


class Decoy(nn.Module):
    """A ``Linear(E, 3E)`` gate beside the real q/k/v projections: the gate never reaches the kernel."""

    truth: ClassVar[Truths] = {"q": ("q_proj.weight", torch.arange(E)), "k": ("k_proj.weight", torch.arange(E)),
             "v": ("v_proj.weight", torch.arange(E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(E, 3 * E)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        g = self.gate(x).sigmoid()  # [B, L, 3E]
        return _merge(F.scaled_dot_product_attention(q, k, v)) * g[..., :E] + g[..., E:].sum(-1, keepdim=True)


class Separate(nn.Module):
    """Three projections with names no lookup would recognise."""

    truth: ClassVar[Truths] = {"q": ("alpha.weight", torch.arange(E)), "k": ("beta.weight", torch.arange(E)),
             "v": ("gamma.weight", torch.arange(E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.alpha, self.beta, self.gamma = nn.Linear(E, E), nn.Linear(E, E, bias=False), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(p(x)) for p in (self.alpha, self.beta, self.gamma))
        return _merge(F.scaled_dot_product_attention(q, k, v))


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: the weight is stored ``[in, out]`` and applied with ``addmm``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class Conv1DPacked(nn.Module):
    """``c_attn(x).split(E)`` over a ``Conv1D`` ``[E, 3E]`` weight: Q is *columns* ``[0, E)``."""

    truth: ClassVar[Truths] = {p: ("c_attn.weight", torch.arange(i * E, (i + 1) * E)) for i, p in enumerate("qkv")}
    dim = 1

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in self.c_attn(x).split(E, dim=2))
        return _merge(F.scaled_dot_product_attention(q, k, v))


class _Attend(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ParentHeld(nn.Module):
    """The kernel is called by a small child; the projections belong to its parent."""

    truth: ClassVar[Truths] = {"q": ("to_q.weight", torch.arange(E)), "k": ("to_k.weight", torch.arange(E)),
             "v": ("to_v.weight", torch.arange(E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.attend = _Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _merge(self.attend(*(_heads(p(x)) for p in (self.to_q, self.to_k, self.to_v))))


class MHAPacked(nn.Module):
    """``nn.MultiheadAttention``: ``in_proj_weight`` rows ``[0,E)``, ``[E,2E)``, ``[2E,3E)`` (its docs)."""

    truth: ClassVar[Truths] = {p: ("in_proj_weight", torch.arange(i * E, (i + 1) * E)) for i, p in enumerate("qkv")}

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


class MHASeparate(nn.Module):
    """``nn.MultiheadAttention`` with ``kdim``/``vdim``: three whole ``q/k/v_proj_weight``."""

    truth: ClassVar[Truths] = {"q": ("q_proj_weight", torch.arange(E)), "k": ("k_proj_weight", torch.arange(E)),
             "v": ("v_proj_weight", torch.arange(E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True, kdim=6, vdim=5)
        self.k_in, self.v_in = nn.Linear(E, 6), nn.Linear(E, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, self.k_in(x), self.v_in(x), need_weights=False)[0]


MODELS: dict[str, Callable[[], nn.Module]] = {
    "packed": Packed, "interleaved": Interleaved, "grouped_fused": GroupedFused, "permuted": Permuted,
    "decoy": Decoy, "separate": Separate, "conv1d": Conv1DPacked, "parent_held": ParentHeld,
    "mha_packed": MHAPacked, "mha_kdim_vdim": MHASeparate,
}  # fmt: skip


@dataclass
class Truth:
    """Where one part lives, by construction: the weight, its bias, and the indices along ``dim``."""

    param: str
    weight: torch.Tensor
    index: torch.Tensor
    dim: int
    bias: torch.Tensor | None
    bias_index: torch.Tensor


def _truth(model: nn.Module) -> dict[str, Truth]:
    out = {}
    mha = getattr(model, "mha", None)
    for part, (param, index) in model.truth.items():  # type: ignore[union-attr, operator]
        if isinstance(mha, nn.MultiheadAttention):  # its bias stays packed: rows i*E + [0, E) either way
            shift = torch.arange(E) + "qkv".index(part) * E
            out[part] = Truth(param, mha.get_parameter(param), index, 0, mha.in_proj_bias, shift)
            continue
        owner = model.get_submodule(param.rpartition(".")[0])
        bias = getattr(owner, "bias", None)
        out[part] = Truth(param, model.get_parameter(param), index, getattr(model, "dim", 0), bias, index)
    return out


def _expand(rows: list[list[int]] | None) -> list[int]:
    assert rows is not None
    return [i for a, b in rows for i in range(a, b)]


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


def _run(model: nn.Module) -> tuple[qkvtrace.Trace, torch.Tensor]:
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        model(x).pow(2).sum().backward()
    return t, x


@pytest.mark.parametrize("name", list(MODELS))
def test_slices_weight_norms_and_gradients_match_the_rows_by_construction(name: str) -> None:
    """Witness: each model's ``truth`` -- the rows its forward gives Q, K, V -- and ``.grad`` at those rows."""
    torch.manual_seed(0)
    model = MODELS[name]()
    t, _ = _run(model)
    [call] = t.calls
    truth: ClassVar[Truths] = _truth(model)
    for part, want in truth.items():
        info = getattr(call.qkv, part)
        assert info is not None and info.param is not None, (part, call.qkv.reason)
        assert info.param == want.param, part
        assert sorted(_expand(info.rows)) == sorted(want.index.tolist()), (part, info.rows)
        assert info.dim == want.dim
        assert info.weight_norm == pytest.approx(_norm(want.weight.index_select(want.dim, want.index)), rel=1e-5)
        if want.bias is None:
            assert info.bias_norm is None
        else:
            assert info.bias_norm == pytest.approx(_norm(want.bias[want.bias_index]), rel=1e-5)
    [grad] = t.gradients
    for part, want in truth.items():
        assert want.weight.grad is not None
        real = _norm(want.weight.grad.index_select(want.dim, want.index))
        assert getattr(grad, part).grad_norm == pytest.approx(real, rel=1e-5), part
    by_definition = name.startswith("mha")
    assert call.qkv.q.evidence.startswith("by definition" if by_definition else "dataflow: autograd graph")


@pytest.mark.parametrize("name", [n for n in MODELS if not n.startswith("mha")])
def test_routes_end_at_the_rows_by_construction(name: str) -> None:
    """Witness: the model's ``truth`` and ``.grad`` at those rows, for ``qkvtrace grads``' W_Q/W_K/W_V endpoints."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(B, L, E)
    result = measure(model, (x,))
    [route] = [r for r in result.routes if r.slices]
    for part, want in _truth(model).items():
        s = route.slices[part]
        assert s.param == want.param  # the holder is the model itself
        assert sorted(_expand(s.rows)) == sorted(want.index.tolist())
        assert want.weight.grad is not None
        assert s.grad_norm == pytest.approx(_norm(want.weight.grad.index_select(want.dim, want.index)), rel=1e-5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", [n for n in MODELS if not n.startswith("mha")])
def test_without_a_graph_the_rows_are_derived_on_the_first_call(name: str, mode: str) -> None:
    """Witness: the model's ``truth`` (rows by construction) and its parameters read in the test. Under
    ``no_grad``/``inference_mode`` PyTorch builds no graph (``grad_fn is None``) and the module never ran with
    one: the rows must still be those of the construction, the weight norms those of those rows, and the
    output bit-identical to an untraced run of the same module."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    x = torch.randn(B, L, E)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        plain = model(x)
    with ctx, qkvtrace.trace(model) as t:
        out = model(x)
    assert out.grad_fn is None  # the witness: no graph
    assert torch.equal(out, plain)
    [call] = t.calls
    assert call.qkv.layout is not None, call.qkv.reason
    for part, want in _truth(model).items():
        s = getattr(call.qkv, part)
        assert s.param == want.param
        assert sorted(_expand(s.rows)) == sorted(want.index.tolist())
        assert s.weight_norm == pytest.approx(_norm(want.weight.index_select(want.dim, want.index)), rel=1e-5)
    assert all(p.grad is None for p in model.parameters())  # nothing written to the real weights


def test_a_derived_layout_serves_later_calls_without_a_graph() -> None:
    """Witness: ``Interleaved.truth``; a no_grad call after a training call of the same module reads the
    rows derived from the training call's graph (the module's code did not change)."""
    torch.manual_seed(0)
    model = Interleaved()
    _run(model)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(torch.randn(B, L, E))
    [call] = t.calls
    assert call.qkv.layout == "interleaved"
    assert _expand(call.qkv.q.rows) == Interleaved.truth["q"][1].tolist()


def test_tracing_does_not_change_outputs_grads_or_rng() -> None:
    """Witness: the same model run untraced -- outputs, every ``.grad`` and the RNG state after the step are
    bit-identical (the derivation's probe uses a private generator and touches no ``.grad``)."""
    def step(traced: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = Interleaved()
        x = torch.randn(B, L, E)
        if traced:
            with qkvtrace.trace(model):
                out = model(x)
                out.pow(2).sum().backward()
        else:
            out = model(x)
            out.pow(2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return out.detach(), grads, torch.get_rng_state()

    plain, traced = step(False), step(True)
    assert torch.equal(plain[0], traced[0])
    assert len(plain[1]) == len(traced[1]) and all(torch.equal(a, b) for a, b in zip(plain[1], traced[1], strict=True))
    assert torch.equal(plain[2], traced[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on the CPU")
def test_flex_attention_slices_in_training() -> None:
    """Witness: ``Interleaved``'s construction, with FlexAttention as the kernel."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    class FlexInterleaved(Interleaved):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.query_key_value(x).view(B, L, H, 3, D).permute(3, 0, 2, 1, 4)
            return self.dense(_merge(flex.flex_attention(q, k, v)))

    torch.manual_seed(0)
    model = FlexInterleaved().cuda()
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, L, E, device="cuda")).pow(2).sum().backward()
    [call] = t.calls
    assert call.path == "flex" and call.qkv.layout == "interleaved"
    for i, part in enumerate("qkv"):
        assert _expand(getattr(call.qkv, part).rows) == _interleaved(i).tolist()


class RawParameter(nn.Module):
    """Q/K/V made by ``x @ w_qkv`` with a bare parameter, after an ``nn.Linear`` that feeds all three."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(E, E)
        self.w_qkv = nn.Parameter(torch.randn(E, 3 * E) / E**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in (self.inp(x) @ self.w_qkv).split(E, dim=-1))
        return _merge(F.scaled_dot_product_attention(q, k, v))


def test_a_projection_it_cannot_name_is_unknown_not_an_earlier_layer() -> None:
    """Witness: by construction Q, K, V come from ``w_qkv`` (no ``nn.Linear``); every row of ``inp`` reaches
    all three, so naming ``inp`` would be a wrong answer. The record must be unknown, with a reason."""
    model = RawParameter()
    t, _ = _run(model)
    [call] = t.calls
    assert call.qkv.layout is None and call.qkv.q.param is None
    assert call.qkv.reason and "Linear or Conv1D weight" in call.qkv.reason
    assert t.gradients == []


def test_frozen_projection_rows_are_derived() -> None:
    """Witness: ``Interleaved.truth``. With every weight frozen (``requires_grad=False``) PyTorch gives Q no
    ``grad_fn``; the rows must still be the construction's, and the weights stay frozen."""
    model = Interleaved().requires_grad_(False)
    x = torch.randn(B, L, E, requires_grad=False)
    with qkvtrace.trace(model) as t:
        model(x)
    [call] = t.calls
    assert call.qkv.layout == "interleaved", call.qkv.reason
    assert _expand(call.qkv.q.rows) == Interleaved.truth["q"][1].tolist()
    assert not any(p.requires_grad for p in model.parameters())
