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

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.analyses.grads import measure
from qkvtrace.facts import slices
from qkvtrace.records import QKVInfo, SliceGrad

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


class Mixed(nn.Module):
    """Q from its own ``Linear(E, E)``, K and V packed in one ``Linear(E, 2E)``: neither one weight nor three."""

    truth: ClassVar[Truths] = {"q": ("q.weight", torch.arange(E)), "k": ("kv.weight", torch.arange(E)),
                               "v": ("kv.weight", torch.arange(E, 2 * E))}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(E, E), nn.Linear(E, 2 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = (_heads(t) for t in self.kv(x).split(E, dim=-1))
        return self.out(_merge(F.scaled_dot_product_attention(_heads(self.q(x)), k, v)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "packed": Packed, "interleaved": Interleaved, "grouped_fused": GroupedFused, "permuted": Permuted,
    "decoy": Decoy, "separate": Separate, "conv1d": Conv1DPacked, "parent_held": ParentHeld,
    "mha_packed": MHAPacked, "mha_kdim_vdim": MHASeparate, "mixed": Mixed,
}  # fmt: skip

#: the layout each model has by construction (records.QKVInfo.layout's definitions): one weight and one range
#: per part is packed, one weight and a part in several ranges interleaved, a weight per part separate
LAYOUTS = {"packed": "packed", "interleaved": "interleaved", "grouped_fused": "packed", "permuted": "packed",
           "decoy": "separate", "separate": "separate", "conv1d": "packed", "parent_held": "separate",
           "mha_packed": "packed", "mha_kdim_vdim": "separate", "mixed": "mixed"}  # fmt: skip


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
    """Witness: each model's ``truth`` -- the rows its forward gives Q, K, V, its layout (``LAYOUTS``) -- and
    ``.grad`` of the weight and bias at those rows; the one backward pass starts from no ``.grad``, so the pass's
    own gradient is ``.grad``. Catches a wrong layout name, bias norms or per-pass norms dropped or misread."""
    torch.manual_seed(0)
    model = MODELS[name]()
    t, _ = _run(model)
    [call] = t.calls
    assert call.qkv.layout == LAYOUTS[name]
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
        got = getattr(grad, part)
        assert got.grad_norm == pytest.approx(real, rel=1e-5), part
        assert got.pass_grad_norm == pytest.approx(real, rel=1e-5), part
        if want.bias is None:
            assert got.bias_grad_norm is None and got.pass_bias_grad_norm is None
        else:
            assert want.bias.grad is not None
            bias_real = _norm(want.bias.grad[want.bias_index])
            assert got.bias_grad_norm == pytest.approx(bias_real, rel=1e-5), part
            assert got.pass_bias_grad_norm == pytest.approx(bias_real, rel=1e-5), part
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


# --- slices.py's public helpers, each against a value built in the test -------------------------------------


def test_mha_without_bias_has_no_bias_slices() -> None:
    """Witness: ``nn.MultiheadAttention(bias=False)`` keeps ``in_proj_bias = None`` (its docs), and with
    ``kdim``/``vdim`` three ``*_proj_weight``. Catches a bias named or bias rows given where the module has none,
    and a wrong layout name."""
    for kwargs, layout, params in [({}, "packed", ["in_proj_weight"] * 3),
                                   ({"kdim": 6, "vdim": 5}, "separate", ["q_proj_weight", "k_proj_weight",
                                                                          "v_proj_weight"])]:  # fmt: skip
        mha = nn.MultiheadAttention(E, H, bias=False, **kwargs)
        assert mha.in_proj_bias is None
        projection = slices.mha_projection(mha)
        assert projection.holder is mha and projection.spec.layout == layout
        for (_, ps), param in zip(projection.spec.parts(), params, strict=True):
            assert ps.param == param and ps.bias_param is None and ps.bias_rows == ()
        info = slices.NormCache().qkv(projection)
        assert info.layout == layout
        for part, param in zip("qkv", params, strict=True):
            s = getattr(info, part)
            assert s.param == param and s.bias_param is None and s.bias_norm is None
        assert slices.guess_projection(mha).spec == projection.spec  # an MHA is read by its definition


class _Named(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


@pytest.mark.parametrize("names", [("q_proj", "k_proj", "v_proj"), ("Query", "KEY", "value"), ("wq", "wk", "wv")])
def test_guess_by_name_reads_q_k_v_named_children(names: tuple[str, str, str]) -> None:
    """Witness: the children built here -- a ``Linear(E, E)`` for Q, a bias-free ``Linear(E, 2E)`` for K, a
    ``Linear(E, E)`` for V, plus an unrelated ``Linear(E, 3E)`` -- so each part is the whole of its child's
    weight, ``out_features`` rows. Catches a wrong part order, rows from the input width, a bias named for the
    bias-free child, the case of a name mattering, and the ``Linear(E, 3E)`` read before the names."""
    q, k, v = names
    model = _Named(gate=nn.Linear(E, 3 * E), **{q: nn.Linear(E, E), k: nn.Linear(E, 2 * E, bias=False),
                                               v: nn.Linear(E, E)})  # fmt: skip
    projection = slices.guess_projection(model)
    assert not isinstance(projection, str) and projection.holder is model
    spec = projection.spec
    assert spec.layout == "separate"
    assert spec.q == slices.PartSpec(f"{q}.weight", ((0, E),), f"{q}.bias", ((0, E),), 0, "by name")
    assert spec.k == slices.PartSpec(f"{k}.weight", ((0, 2 * E),), None, (), 0, "by name")
    assert spec.v == slices.PartSpec(f"{v}.weight", ((0, E),), f"{v}.bias", ((0, E),), 0, "by name")


def test_guess_by_name_takes_the_first_matching_child() -> None:
    """Witness: ``named_children`` order, as built: ``q`` is registered before ``query``, both Q names.
    Catches a later match replacing the first."""
    model = _Named(q=nn.Linear(E, E), query=nn.Linear(E, 2 * E), k=nn.Linear(E, E), v=nn.Linear(E, E))
    projection = slices.guess_projection(model)
    assert not isinstance(projection, str)
    assert projection.spec.q.param == "q.weight" and projection.spec.q.rows == ((0, E),)


def test_guess_by_name_of_conv1d_children_reads_columns() -> None:
    """Witness: ``Conv1D`` (GPT-2) stores ``[in, out]`` with ``nf = out``: a part is columns ``[0, nf)``,
    ``dim`` 1; ``v``'s bias is deleted here, so it has no ``bias`` attribute at all. Catches ``[out, in]``
    assumed, the Conv1D test (2-D weight, ``nf`` its second size) weakened, and a missing ``bias`` attribute
    read as an error."""
    model = _Named(q=Conv1D(2 * E, E), k=Conv1D(2 * E, E), v=Conv1D(2 * E, E))
    del model.v.bias
    projection = slices.guess_projection(model)
    assert not isinstance(projection, str)
    assert projection.spec.layout == "separate"
    for part, ps in projection.spec.parts():
        bias_rows = () if part == "v" else ((0, 2 * E),)
        assert ps.rows == ((0, 2 * E),) and ps.dim == 1 and ps.bias_rows == bias_rows
    assert projection.spec.v.bias_param is None and projection.spec.q.bias_param == "q.bias"


@pytest.mark.parametrize("child", ["linear", "conv1d"])
def test_guess_by_shape_reads_contiguous_thirds(child: str) -> None:
    """Witness: a ``Linear(E, 3E)`` (rows) or ``Conv1D(3E, E)`` (columns) built here, only two of q/k/v named:
    by shape the thirds ``[0,E)``, ``[E,2E)``, ``[2E,3E)``. Catches other ranges, a wrong ``dim``, a
    ``Linear(E, 2E)`` or a square one taken for ``(E, 3E)``, and two names taken for three."""
    fused = nn.Linear(E, 3 * E) if child == "linear" else Conv1D(3 * E, E)
    model = _Named(q=nn.Linear(E, E), k=nn.Linear(E, E), pair=nn.Linear(E, 2 * E), square=nn.Linear(3 * E, 3 * E),
                   fused=fused)  # fmt: skip
    projection = slices.guess_projection(model)
    assert not isinstance(projection, str)
    dim = 0 if child == "linear" else 1
    thirds = [((0, E),), ((E, 2 * E),), ((2 * E, 3 * E),)]
    assert projection.spec == slices.ProjectionSpec(
        "packed", *(slices.PartSpec("fused.weight", r, "fused.bias", r, dim, "by shape") for r in thirds)
    )


def test_guess_without_a_projection_says_why() -> None:
    """Witness: children built with no usable q/k/v projection and no ``(E, 3E)`` shape: an ``nn.Embedding``
    named ``q`` (a 2-D weight, no ``nf``), and a ``[E, 2E]`` weight named ``k`` whose ``nf`` says ``3E`` (not its
    second dimension, so no Conv1D). Catches either taken for a projection, by name or as ``(E, 3E)``."""
    odd = Conv1D(2 * E, E)
    odd.nf = 3 * E  # not its second dimension
    model = _Named(q=nn.Embedding(4, E), k=odd, v=nn.Linear(E, 2 * E), c=nn.ReLU())
    reason = slices.guess_projection(model)
    assert reason == "no q/k/v-named projections or Linear(E, 3E) / Conv1D(E, 3E) among its children"


def test_layout_names_by_definition() -> None:
    """Witness: ``layout_of``'s definitions applied by hand to parts built here. Catches each name swapped."""

    def part(param: str, rows: slices.Rows) -> slices.PartSpec:
        return slices.PartSpec(param, rows, None, ())

    assert slices.layout_of([part("w", ((0, 4),)), part("w", ((4, 8),)), part("w", ((8, 12),))]) == "packed"
    assert slices.layout_of([part("w", ((0, 2), (6, 8))), part("w", ((2, 4), (8, 10))),
                             part("w", ((4, 6), (10, 12)))]) == "interleaved"  # fmt: skip
    assert slices.layout_of([part("w", ((0, 2), (6, 8))), part("w", ((2, 4),)), part("w", ((4, 6),))]) == "interleaved"
    assert slices.layout_of([part("a", ((0, 4),)), part("b", ((0, 4),)), part("c", ((0, 4),))]) == "separate"
    assert slices.layout_of([part("a", ((0, 4),)), part("b", ((0, 4),)), part("b", ((4, 8),))]) == "mixed"


def test_rows_of_merges_runs_of_true() -> None:
    """Witness: the mask written here and its runs read off by eye. Catches runs split or merged wrongly."""
    mask = torch.tensor([True, True, False, True, False, False, True, True, True])
    assert slices.rows_of(mask) == ((0, 2), (3, 4), (6, 9))
    assert slices.rows_of(torch.zeros(4, dtype=torch.bool)) == ()


@pytest.mark.parametrize("dim", [0, 1])
def test_slice_norms_and_shapes_of_several_ranges(dim: int) -> None:
    """Witness: ``index_select`` of the ranges' indices and ``torch.linalg.vector_norm`` in the test. Two ranges
    (not one, not four) along rows or columns: catches only the first range read, or the ranges stacked along
    another dimension (a ``Conv1D`` part's shape)."""
    torch.manual_seed(0)
    w = torch.randn(12, 10)
    rows = ((1, 3), (6, 9))
    index = torch.tensor([1, 2, 6, 7, 8])
    want = w.index_select(dim, index)
    [one, two] = slices.slice_norms_of(w, [(rows, dim), (((0, 5),), dim)])
    assert float(one) == pytest.approx(float(torch.linalg.vector_norm(want)), rel=1e-6)
    assert float(two) == pytest.approx(float(torch.linalg.vector_norm(w.narrow(dim, 0, 5))), rel=1e-6)
    holder = _Named(proj=nn.Linear(10, 12) if dim == 0 else Conv1D(10, 12))
    ps = slices.PartSpec("proj.weight", rows, None, (), dim, "test")
    projection = slices.Projection(holder, slices.ProjectionSpec("interleaved", ps, ps, ps))
    info = slices.NormCache().qkv(projection)
    weight = holder.proj.weight.detach()
    assert info.q.shape == list(weight.index_select(dim, index).shape)
    assert info.q.rows == [[1, 3], [6, 9]] and info.q.dim == dim
    assert float(info.q.weight_norm) == pytest.approx(float(torch.linalg.vector_norm(weight.index_select(dim, index))),
                                                      rel=1e-6)  # fmt: skip


def test_param_of_names_what_is_missing() -> None:
    """Witness: the module built here has ``proj.weight`` and no ``proj.nothing``. Catches a wrong owner for
    a dotted name and an error that does not say what is missing."""
    model = _Named(proj=nn.Linear(E, E))
    assert slices.param_of(model, "proj.weight") is model.proj.weight
    assert slices.param_of(model.proj, "bias") is model.proj.bias
    with pytest.raises(AttributeError, match=r"^_Named has no tensor 'proj\.nothing'$"):
        slices.param_of(model, "proj.nothing")
    with pytest.raises(AttributeError, match=r"^Linear has no tensor 'in_features'$"):
        slices.param_of(model.proj, "in_features")


def test_param_of_reads_each_tensor_where_pytorch_finds_it() -> None:
    """Witness: PyTorch's own attribute lookup (``getattr`` through each child) of every name, on a module with
    nested children, a scripted child whose children are not in a plain dict, and a plain tensor set on a child
    (as FSDP sets the views of its flat parameter)."""
    torch.manual_seed(0)
    model = _Named(blk=_Named(inner=nn.Sequential(nn.Linear(E, E))),
                   scripted=torch.jit.script(nn.Sequential(nn.Linear(E, E))))  # fmt: skip
    object.__setattr__(model.blk, "flat_view", torch.zeros(3))  # not registered: found by getattr only
    names = ["blk.inner.0.weight", "blk.inner.0.bias", "scripted.0.weight", "scripted.0.bias", "blk.flat_view"]
    for name in names:
        want = functools.reduce(getattr, name.split("."), model)
        assert slices.param_of(model, name) is want, name
    with pytest.raises(AttributeError, match=r"^_Named has no tensor 'scripted\.0\.nothing'$"):
        slices.param_of(model, "scripted.0.nothing")


def test_param_of_names_a_missing_first_child_as_pytorch_does() -> None:
    """Witness: the error PyTorch's own ``get_submodule`` raises for the same child. Catches the lookup going on
    from no module (an error about ``NoneType``) when the first child of a dotted name is not there."""
    model = _Named(proj=nn.Linear(E, E))
    for name in ["nothing.weight", "nothing.deeper.weight"]:
        with pytest.raises(AttributeError) as pytorch:
            model.get_submodule(name.rpartition(".")[0])
        with pytest.raises(AttributeError, match=f"^{re.escape(str(pytorch.value))}$"):
            slices.param_of(model, name)


def _latent() -> tuple[nn.Module, slices.Projection]:
    """K made of rows of two weights (latent attention's rotary part), built by hand."""
    torch.manual_seed(0)
    model = _Named(kv=nn.Linear(E, 2 * E), rope=nn.Linear(E, 4, bias=False), q=nn.Linear(E, E))
    extra = slices.PartSpec("rope.weight", ((0, 4),), None, (), 0, "test")
    k = slices.PartSpec("kv.weight", ((0, E),), "kv.bias", ((0, E),), 0, "test", also=(extra,))
    v = slices.PartSpec("kv.weight", ((E, 2 * E),), "kv.bias", ((E, 2 * E),), 0, "test")
    q = slices.PartSpec("q.weight", ((0, E),), "q.bias", ((0, E),), 0, "test")
    return model, slices.Projection(model, slices.ProjectionSpec("mixed", q, k, v))


def test_a_part_made_of_two_weights_has_their_joint_norms() -> None:
    """Witness: the norm of the concatenation of both weights' rows (and of the one bias there is), computed
    in the test; ``.grad`` of a real backward for the gradient norms, and for the pass norms the values handed
    in. Catches the joint norm replaced by the first piece's, and pieces without a bias dropped or counted."""
    model, projection = _latent()
    x = torch.randn(B, E)
    (model.kv(x).sum() + model.rope(x).pow(2).sum() + model.q(x).pow(3).sum()).backward()
    kw, rw, kb = model.kv.weight.detach(), model.rope.weight.detach(), model.kv.bias.detach()
    info = slices.NormCache().qkv(projection)
    assert info.layout == "mixed"
    assert float(info.k.weight_norm) == pytest.approx(float(torch.cat([kw[:E], rw]).norm()), rel=1e-6)
    assert float(info.k.bias_norm) == pytest.approx(float(kb[:E].norm()), rel=1e-6)
    assert [a.param for a in info.k.also] == ["rope.weight"] and info.k.also[0].bias_norm is None
    assert info.k.bias_param == "kv.bias" and info.k.also[0].bias_param is None
    assert float(info.v.weight_norm) == pytest.approx(float(kw[E:].norm()), rel=1e-6)
    assert info.q.also is None and info.v.also is None
    g_k, g_r, g_b = model.kv.weight.grad, model.rope.weight.grad, model.kv.bias.grad
    assert g_k is not None and g_r is not None and g_b is not None
    pass_norms = {("kv.weight", ((0, E),)): torch.tensor(3.0), ("rope.weight", ((0, 4),)): torch.tensor(4.0),
                  ("kv.bias", ((0, E),)): torch.tensor(2.0)}  # fmt: skip
    got = slices.grad_slices(projection, pass_norms)
    assert float(got["k"].grad_norm) == pytest.approx(float(torch.cat([g_k[:E], g_r]).norm()), rel=1e-6)
    assert float(got["k"].bias_grad_norm) == pytest.approx(float(g_b[:E].norm()), rel=1e-6)
    assert float(got["k"].pass_grad_norm) == pytest.approx(5.0)  # sqrt(3² + 4²)
    assert float(got["k"].pass_bias_grad_norm) == pytest.approx(2.0)
    assert got["v"].pass_grad_norm is None and got["q"].pass_bias_grad_norm is None  # not handed in
    assert float(got["q"].grad_norm) == pytest.approx(float(model.q.weight.grad.norm()), rel=1e-6)


def test_a_joint_norm_follows_the_one_weight_that_changed() -> None:
    """Witness: the norm of the concatenation of both weights' rows, computed in the test after each change. The
    K bias changed alone (the record is made again; both weight norms are the numbers read at the last settle),
    then the K weight alone (its norm computed again, the other piece's read). Before any settle the joint norm is
    a 0-dim tensor (no host read, DESIGN.md principle 7) made without a warning. Catches the numbers summed
    wrongly or not at all, a number stacked with a tensor unconverted or converted from nothing, the joint of
    tensors read to a number, and a tensor copied through ``new_tensor`` (PyTorch warns)."""
    model, projection = _latent()
    cache = slices.NormCache()
    kw, rw = model.kv.weight.detach().clone(), model.rope.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = cache.qkv(projection)
    assert isinstance(first.k.weight_norm, torch.Tensor) and first.k.weight_norm.dim() == 0
    cache.settle()
    assert first.k.weight_norm == pytest.approx(float(torch.cat([kw[:E], rw]).norm()), rel=1e-6)
    with torch.no_grad():
        model.kv.bias.add_(1.0)
    second = cache.qkv(projection)
    cache.settle()
    assert second is not first
    assert float(second.k.weight_norm) == pytest.approx(float(torch.cat([kw[:E], rw]).norm()), rel=1e-6)
    assert float(second.k.bias_norm) == pytest.approx(float(model.kv.bias.detach()[:E].norm()), rel=1e-6)
    with torch.no_grad():
        model.kv.weight.mul_(2.0)
    third = cache.qkv(projection)
    cache.settle()
    assert float(third.k.weight_norm) == pytest.approx(float(torch.cat([2 * kw[:E], rw]).norm()), rel=1e-6)


def test_grad_slices_before_any_backward_are_none() -> None:
    """Witness: a module never run backward has ``.grad is None`` (PyTorch); the part's weight and rows by
    MultiheadAttention's packing (the thirds of ``in_proj_weight``). Catches a norm read from no gradient."""
    mha = nn.MultiheadAttention(E, H)
    got = slices.grad_slices(slices.mha_projection(mha), {})
    for i, part in enumerate("qkv"):
        assert got[part] == SliceGrad(None, None, None, None, param="in_proj_weight", rows=[[i * E, (i + 1) * E]])


def test_norm_cache_recomputes_after_an_in_place_change_only() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the rows in the test, before and after an in-place update
    (which moves ``_version``), of each module, spec and tensor. Catches a stale norm after the update, a cache
    keyed without rows or ``dim``, a record rebuilt although nothing changed, and a record shared by two modules
    whose parameters are at the same versions, by two specs over one weight, or kept after the weight was replaced
    by another tensor at the same version."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 8))
    cache = slices.NormCache()
    a = cache.norm(w, ((0, 2),))
    assert float(a) == pytest.approx(float(w.detach()[:2].norm()), rel=1e-6)
    assert cache.norm(w, ((0, 2),)) is a  # unchanged: the same tensor
    assert float(cache.norm(w, ((2, 6),))) == pytest.approx(float(w.detach()[2:].norm()), rel=1e-6)
    assert float(cache.norm(w, ((0, 2),), 1)) == pytest.approx(float(w.detach()[:, :2].norm()), rel=1e-6)
    with torch.no_grad():
        w.mul_(2)
    assert float(cache.norm(w, ((0, 2),))) == pytest.approx(2 * float(a), rel=1e-6)
    mha = nn.MultiheadAttention(E, H)
    projection = slices.mha_projection(mha)
    first = cache.qkv(projection)
    assert cache.qkv(projection) is first
    other = nn.MultiheadAttention(E, H)  # parameters at the same versions as mha's
    assert float(cache.qkv(slices.mha_projection(other)).q.weight_norm) == pytest.approx(
        float(other.in_proj_weight.detach()[:E].norm()), rel=1e-6
    )
    with torch.no_grad():
        mha.in_proj_bias.add_(1.0)
    second = cache.qkv(projection)
    assert second is not first
    assert float(second.q.bias_norm) == pytest.approx(float(mha.in_proj_bias.detach()[:E].norm()), rel=1e-6)
    # a second spec over the same weight (K and Q swapped), then the weight swapped for a new tensor
    swapped = slices.ProjectionSpec("packed", projection.spec.k, projection.spec.q, projection.spec.v)
    assert float(cache.qkv(slices.Projection(mha, swapped)).q.weight_norm) == pytest.approx(
        float(mha.in_proj_weight.detach()[E : 2 * E].norm()), rel=1e-6
    )
    new = nn.Parameter(torch.empty_like(mha.in_proj_weight))
    with torch.no_grad():
        new.copy_(mha.in_proj_weight * 3)
    assert new._version == mha.in_proj_weight._version  # the same version: only the tensor differs
    mha.in_proj_weight = new
    assert float(cache.qkv(projection).q.weight_norm) == pytest.approx(float(new.detach()[:E].norm()), rel=1e-6)


def test_norms_of_inference_tensors_are_never_stale() -> None:
    """Witness: the norm computed in the test. Tensors made under ``inference_mode`` keep no version counter
    (PyTorch raises on ``_version``); two different values there must not share a cached norm."""
    cache = slices.NormCache()
    with torch.inference_mode():
        w = torch.ones(4, 4)
        first = float(cache.norm(w, ((0, 4),)))
        w.mul_(3)
        second = float(cache.norm(w, ((0, 4),)))
    assert first == pytest.approx(4.0) and second == pytest.approx(12.0)


def test_norm_cache_tells_apart_two_tensors_from_one_address() -> None:
    """Witness: rows by construction (``arange``): the first two rows of a weight and of its transpose (a tied
    weight), norms computed in the test. Both tensors start at the same address and share one version counter,
    so only the tensor itself tells their norms apart. Catches the cache keyed without the tensor."""
    w = torch.arange(36.0).reshape(6, 6)
    tied = w.t()
    assert tied.data_ptr() == w.data_ptr() and tied._version == w._version  # the case this test is about
    cache = slices.NormCache()
    assert float(cache.norm(w, ((0, 2),))) == pytest.approx(float(torch.linalg.vector_norm(w[:2])), rel=1e-6)
    assert float(cache.norm(tied, ((0, 2),))) == pytest.approx(float(torch.linalg.vector_norm(w[:, :2])), rel=1e-6)


def test_a_settled_norm_is_the_number_read() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the rows in the test. Once :meth:`NormCache.settle` read the
    norms, the norm of an unchanged parameter is that number (a Python float), as its docstring says. Catches
    the number dropped at the settle (the norm computed again, a tensor)."""
    w = torch.randn(6, 8)
    cache = slices.NormCache()
    first = cache.norm(w, ((0, 2),))
    cache.settle()
    again = cache.norm(w, ((0, 2),))
    assert type(again) is float
    assert again == pytest.approx(float(first)) == pytest.approx(float(torch.linalg.vector_norm(w[:2])), rel=1e-6)


def test_settle_after_the_cache_emptied_itself_reads_every_record() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the Q rows in the test. 4,097 records between two settles (as
    tensors swapped on every call, FSDP's, make): the cache empties itself at 4,096, and the settle that follows
    still reads the records made before, skipping the norms the cache no longer holds. Catches the settle
    reading an emptied entry."""
    mha = nn.MultiheadAttention(E, H, bias=False)
    base = slices.mha_projection(mha)
    cache = slices.NormCache()
    first = cache.qkv(base)
    # each a new spec object: a new record
    kept = [slices.Projection(mha, slices.ProjectionSpec("packed", *(ps for _, ps in base.spec.parts())))
            for _ in range(4096)]  # fmt: skip
    last = [cache.qkv(p) for p in kept][-1]
    cache.settle()
    want = float(torch.linalg.vector_norm(mha.in_proj_weight.detach()[:E]))
    assert type(first.q.weight_norm) is float and type(last.q.weight_norm) is float
    assert first.q.weight_norm == pytest.approx(want, rel=1e-6) and last.q.weight_norm == pytest.approx(want, rel=1e-6)


def test_qkv_of_a_scripted_mha_reads_its_parameters_where_pytorch_finds_them() -> None:
    """Witness: ``torch.linalg.vector_norm`` of rows ``[0,E)``, ``[E,2E)``, ``[2E,3E)`` of the scripted module's
    own ``in_proj_weight`` and ``in_proj_bias``, taken in the test. A ScriptModule keeps its parameters in no plain
    dict. Catches that wrapper read as if it were one."""
    scripted = torch.jit.script(nn.MultiheadAttention(E, H))
    assert type(scripted._parameters) is not dict  # the case this test is about
    info = slices.NormCache().qkv(slices.mha_projection(scripted))
    w, b = scripted.in_proj_weight.detach(), scripted.in_proj_bias.detach()
    for i, part in enumerate("qkv"):
        got, rows = getattr(info, part), slice(i * E, (i + 1) * E)
        assert float(got.weight_norm) == pytest.approx(float(torch.linalg.vector_norm(w[rows])), rel=1e-6)
        assert float(got.bias_norm) == pytest.approx(float(torch.linalg.vector_norm(b[rows])), rel=1e-6)


def test_records_of_a_model_made_under_inference_mode_follow_its_weights() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the Q rows, taken in the test before each trace. A model built
    under ``inference_mode`` holds inference tensors, which keep no version counter (PyTorch raises on
    ``_version``); its weights changed in place between two traces must not leave the first record in place.
    Catches the states of such parameters not taken (a stale record, or an error)."""
    with torch.inference_mode():
        mha = nn.MultiheadAttention(E, H)
        x = torch.randn(L, B, E)
    for scale in (1.0, 3.0):
        with torch.inference_mode():
            mha.in_proj_weight.mul_(scale)
            want = float(torch.linalg.vector_norm(mha.in_proj_weight[:E]))
            with qkvtrace.trace(mha) as t:
                mha(x, x, x)
        assert t.calls[0].qkv.q.weight_norm == pytest.approx(want, rel=1e-6), scale


def test_an_unknown_projection_is_recorded_with_its_reason() -> None:
    """Witness: the reason string handed in. Catches it dropped or a layout given."""
    info = slices.NormCache().qkv("no projection here")
    assert info == QKVInfo(layout=None, q=None, k=None, v=None, reason="no projection here")
