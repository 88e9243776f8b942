"""Backward kernels and gradient routes per call, checked against PyTorch.

Witnesses: the autograd graph of an un-instrumented run (for the backward
node), and ``torch.autograd.grad`` on an independent re-computation of the
same call on a copy of the model (for the gradients that reach Q, K, V).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _witness import attention_core, graph_names
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkvtrace
from qkvtrace.records.validation import load_trace

E, H, B, T = 16, 4, 3, 6
D = E // H


def _weights(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


def _loss(out: torch.Tensor) -> torch.Tensor:
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return (out * r).sum()


def _per_head(g: torch.Tensor) -> list[float]:
    """Norm per head of a ``[B, H, L, D]`` gradient."""
    return g.square().sum(dim=(0, 2, 3)).sqrt().tolist()


# -- references: the same call computed by hand, with Q, K, V as leaves ------------------


def _mha_reference(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """d loss / d Q, K, V of one MHA call, on a copy, with explicit softmax attention."""
    m = copy.deepcopy(m)
    e = m.embed_dim
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    bq, bk, bv = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None, None, None)
    if not m.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))

    def heads(x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, m.num_heads, e // m.num_heads).transpose(1, 2).detach().requires_grad_()

    q, k, v = heads(F.linear(query, wq, bq)), heads(F.linear(key, wk, bk)), heads(F.linear(value, wv, bv))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v
    out = m.out_proj(context.transpose(1, 2).reshape(q.shape[0], q.shape[2], e))
    if not m.batch_first:
        out = out.transpose(0, 1)
    gq, gk, gv = torch.autograd.grad(_loss(out), [q, k, v])
    return {"q": gq, "k": gk, "v": gv}


def _assert_routes(route: Any, ref: dict[str, torch.Tensor]) -> None:
    for part in "qkv":
        got, want = getattr(route, part), ref[part]
        assert got is not None, part
        assert got.norm == pytest.approx(want.norm().item(), rel=1e-4, abs=1e-6), part
        assert got.per_head == pytest.approx(_per_head(want), rel=1e-4, abs=1e-6), part
    # each route's share of the call's squared gradient norm, computed here from the reference gradients
    squared = {p: ref[p].double().square().sum().item() for p in "qkv"}
    for part in "qkv":
        assert getattr(route, part).share == pytest.approx(squared[part] / sum(squared.values()), rel=1e-4), part


# -- backward_kernel ------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_backward_kernel_is_the_node_an_uninstrumented_run_builds(need_weights: bool) -> None:
    """Witness: the autograd graph of an un-instrumented run of the same call (attention_core and graph_names)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights()
    witness, _ = m(x, x, x, need_weights=need_weights)
    with qkvtrace.trace(m) as t:
        _out, _ = m(x, x, x, need_weights=need_weights)
    (call,) = t.calls
    assert call.path == "fallback"
    assert call.backward_kernel == attention_core(witness)
    assert call.backward_reason is None
    if need_weights:
        assert "Softmax" in call.backward_kernel and " + " in call.backward_kernel
    else:
        assert call.backward_kernel == next(n for n in graph_names(witness) if "ScaledDotProduct" in n)


@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_sdpa_backward_kernel_per_forced_backend(backend: SDPBackend) -> None:
    """Witness: the autograd graph of an un-instrumented run under the same forced backend, and the backend forced
    here."""
    model = _SeparateProjections()
    x = _weights()
    with sdpa_kernel(backend):
        witness = model(x)
        with qkvtrace.trace(model) as t:
            model(x)
    (call,) = t.calls
    assert call.sdpa_backend == backend.name
    assert call.backward_kernel == attention_core(witness)
    assert ("ScaledDotProductFlash" in call.backward_kernel) == (backend == SDPBackend.FLASH_ATTENTION)


def test_no_graph_says_why() -> None:
    """Witness: the grad state set here for each call: no_grad, inference_mode, and parameters set here not to
    require grad."""
    m = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = nn.TransformerEncoderLayer(E, H, 32, batch_first=True).eval()
    x = _weights()
    with qkvtrace.trace(m) as t, torch.no_grad():
        m(x, x, x)
    (call,) = t.calls
    assert call.path == "fast"
    assert call.backward_kernel is None and "grad is disabled" in call.backward_reason
    with qkvtrace.trace(layer) as t, torch.inference_mode():
        layer(x)
    (call,) = t.calls
    assert call.path == "fused_encoder_layer"
    assert call.backward_kernel is None and "inference mode" in call.backward_reason
    with qkvtrace.trace(m) as t:  # grad on, but nothing requires grad
        m.requires_grad_(False)
        m.train()(x, x, x)
    assert "no grad_fn" in t.calls[0].backward_reason


# -- routes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_routes_equal_autograd_grad_on_a_copy(need_weights: bool) -> None:
    """Witness: torch.autograd.grad of the same loss through explicit softmax attention recomputed here on a copy
    of the module, with Q, K, V as leaves."""
    torch.manual_seed(1)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights(1)
    ref = _mha_reference(m, x, x, x)
    with qkvtrace.trace(m) as t:
        out, _ = m(x, x, x, need_weights=need_weights)
        _loss(out).backward()
    (route,) = t.routes
    assert (route.call, route.module, route.backward_index) == (0, "", 0)
    _assert_routes(route, ref)
    # at initialisation the Q/K route carries far less than the V route (docs/tutorial.md#one-sentence-end-to-end)
    assert route.v.share > route.q.share and route.v.share > route.k.share


def test_mha_with_separate_kdim_vdim_and_a_padding_mask() -> None:
    """Witness: torch.autograd.grad on a copy with explicit softmax attention and the padding mask built here; the
    separate layout follows from the kdim and vdim set here."""
    torch.manual_seed(2)
    m = nn.MultiheadAttention(E, H, kdim=10, vdim=12)  # sequence first, q/k/v_proj_weight separate
    query = torch.randn(T, B, E)
    key, value = torch.randn(T + 2, B, 10), torch.randn(T + 2, B, 12)
    pad = torch.zeros(B, T + 2, dtype=torch.bool)
    pad[:, -2:] = True
    ref = _mha_reference(m, query, key, value, mask=pad[:, None, None, :])
    with qkvtrace.trace(m) as t:
        out, _ = m(query, key, value, key_padding_mask=pad, need_weights=False)
        _loss(out).backward()
    assert t.calls[0].qkv.layout == "separate"
    _assert_routes(t.routes[0], ref)


class _SeparateProjections(nn.Module):
    """A direct SDPA caller with q_proj / k_proj / v_proj, as HuggingFace models are written."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], H, D).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape))


def _separate_reference(model: _SeparateProjections, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    q, k, v = (model.split(p(x)).detach().requires_grad_() for p in (model.q_proj, model.k_proj, model.v_proj))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out = model.o_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(x.shape))
    gq, gk, gv = torch.autograd.grad(_loss(out), [q, k, v])
    return {"q": gq, "k": gk, "v": gv}


@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_direct_sdpa_routes_equal_autograd_grad(backend: SDPBackend) -> None:
    """Witness: torch.autograd.grad on an explicit causal softmax attention recomputed here on a copy of the model."""
    model = _SeparateProjections()
    x = _weights(2)
    ref = _separate_reference(model, x)
    with sdpa_kernel(backend), qkvtrace.trace(model) as t:
        _loss(model(x)).backward()
    (route,) = t.routes
    _assert_routes(route, ref)
    assert t.calls[0].route_reason is None


def test_one_entry_per_forward_call_with_shared_weights_and_accumulation() -> None:
    """Witnesses: gradients recomputed here by autograd on copies (routes), ``.grad`` itself (slices), and
    each pass's own part of ``.grad`` taken here as the difference across that backward (pass shares)."""
    model = _SeparateProjections()
    a, b = _weights(3), _weights(4)
    ref_a, ref_b = _separate_reference(model, a), _separate_reference(model, b)
    with qkvtrace.trace(model) as t:
        _loss(model(a)).backward()  # micro-batch 1
        _loss(model(b)).backward()  # micro-batch 2, gradients accumulate
        before = {p: getattr(model, f"{p}_proj").weight.grad.clone() for p in "qkv"}
        two = _loss(model(a)) + _loss(model(b))  # the same module twice, one backward
        two.backward()
    assert [(r.call, r.backward_index) for r in t.routes] == [(0, 0), (1, 1), (2, 2), (3, 2)]
    for route, ref in zip(t.routes, [ref_a, ref_b, ref_a, ref_b], strict=True):
        _assert_routes(route, ref)
    # the slice records hold the accumulated .grad, and each pass's own part
    q_grad = model.q_proj.weight.grad
    assert t.gradients[-1].q.grad_norm == pytest.approx(q_grad.norm().item(), rel=1e-5)
    # this pass's share of each part: |Δ.grad|² / Σ|Δ.grad|², Δ = .grad after the pass less .grad before it
    squared = {p: float((getattr(model, f"{p}_proj").weight.grad - before[p]).norm()) ** 2 for p in "qkv"}
    for p in "qkv":
        want = squared[p] / sum(squared.values())
        assert getattr(t.gradients[-1], p).pass_share == pytest.approx(want, rel=1e-4), p


def test_routes_keep_no_activation_alive() -> None:
    """Witness: a weakref to Q's projection output taken here by a forward hook, cleared by Python's gc."""
    model = _SeparateProjections()
    x = _weights(5)
    kept: list[weakref.ref[torch.Tensor]] = []
    handle = model.q_proj.register_forward_hook(lambda _m, _i, out: kept.append(weakref.ref(out)))
    try:
        with qkvtrace.trace(model) as t:
            loss = _loss(model(x))
            loss.backward()
            del loss
            gc.collect()
            assert kept[0]() is None  # Q's activation is gone while the trace is still open
    finally:
        handle.remove()
    assert len(t.routes) == 1


def test_routes_off_records_none_and_json_round_trips(tmp_path: Any) -> None:
    """Witness: routes=False given here; for the round trip, the schema and the in-memory result the file was
    saved from."""
    model = _SeparateProjections()
    x = _weights(6)
    with qkvtrace.trace(model, routes=False) as t:
        _loss(model(x)).backward()
    assert t.routes == [] and t.calls[0].backward_kernel is None  # not even looked for
    assert "routes=False" in t.calls[0].backward_reason
    with qkvtrace.trace(model) as t:
        _loss(model(x)).backward()
    path = t.save(tmp_path / "t.json")
    back = load_trace(path)  # validated against the qkvtrace.trace/3 schema, then read
    assert back.routes == t.routes
    assert back.calls[0].backward_kernel == t.calls[0].backward_kernel


def test_steady_calls_on_a_decomposed_kernel_each_get_their_routes() -> None:
    """Witness: torch.autograd.grad on an explicit causal softmax attention recomputed here on a copy, per input.
    On SDPA's MATH kernel the graph is decomposed (no fused node to hook), so each steady call's core is found at
    its tensors: every call, the steady ones too, must hand its core on to be followed in its backward pass.
    Catches a steady call's graph taken for one that builds none."""
    model = _SeparateProjections()
    xs = [_weights(20 + i) for i in range(5)]
    refs = [_separate_reference(model, x) for x in xs]
    with sdpa_kernel(SDPBackend.MATH), qkvtrace.trace(model) as t:
        for x in xs:
            _loss(model(x)).backward()
    assert [r.call for r in t.routes] == list(range(len(xs)))
    for route, ref in zip(t.routes, refs, strict=True):
        _assert_routes(route, ref)


# -- later calls of one signature: the way found on the first, followed when the backward pass comes ----------


@pytest.mark.parametrize("need_weights", [False, True])
def test_repeated_calls_each_get_their_own_routes_once_per_pass(need_weights: bool) -> None:
    """Witness: torch.autograd.grad through explicit softmax attention recomputed here on a copy, per input; a
    second backward through a retained graph doubles nothing (each pass gets its own entry, equal to the first)."""
    torch.manual_seed(4)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    xs = [_weights(10 + i) for i in range(3)]
    refs = [_mha_reference(m, x, x, x) for x in xs]
    with qkvtrace.trace(m) as t:
        outs = [m(x, x, x, need_weights=need_weights)[0] for x in xs]  # three calls of one signature, then...
        for out in outs:  # ...one backward each, the last twice through its retained graph
            _loss(out).backward(retain_graph=True)
        _loss(outs[-1]).backward()
    assert [(r.call, r.backward_index) for r in t.routes] == [(0, 0), (1, 1), (2, 2), (2, 3)]
    for route, ref in zip(t.routes, [*refs, refs[-1]], strict=True):
        _assert_routes(route, ref)


def test_forward_only_calls_name_the_backward_node_of_their_own_graph() -> None:
    """Witness: the autograd graph of an un-instrumented run of each call (attention_core), for calls whose
    backward never runs."""
    torch.manual_seed(5)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights(6)
    witness = [m(x, x, x, need_weights=w)[0] for w in (True, False, True, False)]
    with qkvtrace.trace(m) as t:
        for w in (True, False, True, False):
            m(x, x, x, need_weights=w)
    assert [c.backward_kernel for c in t.calls] == [attention_core(w) for w in witness]


def test_a_later_call_whose_graph_differs_is_searched_again() -> None:
    """Witnesses: the autograd graphs of un-instrumented runs of both modules (graph_names, attention_core); the
    routes by construction: dropout=1.0 drops every attention weight, so no gradient reaches Q, K or V."""
    torch.manual_seed(6)
    plain = nn.MultiheadAttention(E, H, batch_first=True)
    dropped = nn.MultiheadAttention(E, H, batch_first=True, dropout=1.0)  # the same call signature, more nodes
    x = _weights(7)
    witness = dropped(x, x, x)[0]
    assert graph_names(witness) != graph_names(plain(x, x, x)[0])  # dropout puts a node between softmax and bmm
    with qkvtrace.trace(nn.ModuleList([plain, dropped])) as t:
        _loss(plain(x, x, x)[0]).backward()  # the way to the core, found for this signature
        _loss(dropped(x, x, x)[0]).backward()  # same signature: dropout puts a node between softmax and matmul
    assert t.calls[1].backward_kernel == attention_core(witness)
    assert [r.call for r in t.routes] == [0, 1]
    for part in "qkv":
        assert getattr(t.routes[1], part).norm == 0.0, part


@pytest.mark.parametrize("read_before_backward", [False, True])
def test_a_steady_call_whose_graph_differs_is_followed_when_its_backward_runs(read_before_backward: bool) -> None:
    """Witnesses: the autograd graphs of un-instrumented runs of the module before and after its dropout is set
    (graph_names, attention_core); the routes by construction: dropout=1.0 drops every attention weight, so no
    gradient reaches Q, K or V. The module's later calls have its earlier calls' signature (its dropout is not
    part of it), so the trace records them from its earlier record and meets the new graph only when their
    backward pass reaches them -- whether their records were read before it or not."""
    torch.manual_seed(6)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights(7)
    before = m(x, x, x)[0]
    m.dropout = 1.0
    after = m(x, x, x)[0]
    m.dropout = 0.0
    assert graph_names(before) != graph_names(after)  # dropout puts a node between softmax and bmm
    with qkvtrace.trace(m) as t:
        for _ in range(3):  # the way to the core, found for this signature, then followed
            _loss(m(x, x, x)[0]).backward()
        m.dropout = 1.0
        out = m(x, x, x)[0]
        if read_before_backward:
            assert len(t.calls) == 4
        _loss(out).backward()
    assert [c.backward_kernel for c in t.calls] == [attention_core(before)] * 3 + [attention_core(after)]
    assert [(r.call, r.backward_index) for r in t.routes] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    for part in "qkv":
        assert getattr(t.routes[2], part).norm > 0.0, part
        assert getattr(t.routes[3], part).norm == 0.0, part


@pytest.mark.parametrize("read_before_backward", [False, True])
def test_a_steady_call_whose_graph_has_no_core_any_more_says_so_once_its_backward_runs(
    read_before_backward: bool,
) -> None:
    """Witnesses: the autograd graphs of un-instrumented runs of the module (graph_names): before its projection
    is frozen they hold the softmax and the matmul with V (attention_core); after, with an input that needs no
    gradient, no node of the attention at all -- by construction, nothing below the output projection requires
    grad. The frozen calls keep their module's call signature (a parameter's requires_grad is not part of it),
    so the trace takes them as steady calls with the earlier calls' core, and corrects them when their backward
    pass meets the new graph -- whether their records were read before it or not."""
    torch.manual_seed(6)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights(7)
    before = m(x, x, x)[0]
    with torch.no_grad():  # (a frozen copy: the witness of the graph the frozen calls build)
        frozen = copy.deepcopy(m)
    frozen.in_proj_weight.requires_grad_(False)
    frozen.in_proj_bias.requires_grad_(False)
    after = frozen(x, x, x)[0]
    assert not any("Softmax" in n or "Bmm" in n for n in graph_names(after))
    with qkvtrace.trace(m) as t:
        for _ in range(3):  # the way to the core, found for this signature, then followed
            _loss(m(x, x, x)[0]).backward()
        m.in_proj_weight.requires_grad_(False)
        m.in_proj_bias.requires_grad_(False)
        outs = [m(x, x, x)[0] for _ in range(2)]
        if read_before_backward:
            assert len(t.calls) == 5
        for out in outs:
            _loss(out).backward()
    assert [c.backward_kernel for c in t.calls] == [attention_core(before)] * 3 + [None, None]
    assert t.calls[3].backward_reason is not None and t.calls[3].backward_reason == t.calls[4].backward_reason
    assert [c.route_reason for c in t.calls] == [None] * 5
    assert [r.call for r in t.routes] == [0, 1, 2]


@pytest.mark.parametrize("read_before_backward", [False, True])
def test_a_first_call_whose_graph_has_no_core_says_so_once_its_backward_runs(read_before_backward: bool) -> None:
    """Witnesses: the autograd graphs of un-instrumented runs of both modules (graph_names, attention_core): the
    plain one holds the softmax and the matmul with V; the frozen one (its projection frozen, an input that needs
    no gradient), by construction, no node of the attention at all. Its first call has the plain module's call
    signature, so the trace takes the plain call's way to the core for it, to be followed when its backward
    pass reaches it, and corrects its record then -- whether the record was read before or not."""
    torch.manual_seed(6)
    plain = nn.MultiheadAttention(E, H, batch_first=True)
    frozen = nn.MultiheadAttention(E, H, batch_first=True)
    frozen.in_proj_weight.requires_grad_(False)
    frozen.in_proj_bias.requires_grad_(False)
    x = _weights(7)
    assert not any("Softmax" in n or "Bmm" in n for n in graph_names(frozen(x, x, x)[0]))
    witness = attention_core(plain(x, x, x)[0])
    with qkvtrace.trace(nn.ModuleList([plain, frozen])) as t:
        _loss(plain(x, x, x)[0]).backward()  # the way to the core, found for this signature
        out = frozen(x, x, x)[0]
        if read_before_backward:
            assert [c.backward_kernel for c in t.calls] == [witness, witness]  # the way taken, not yet followed
        _loss(out).backward()
    assert [c.backward_kernel for c in t.calls] == [witness, None]
    assert t.calls[1].backward_reason is not None
    assert [r.call for r in t.routes] == [0]


@pytest.mark.parametrize("read_before_backward", [False, True])
def test_a_steady_call_whose_graph_came_back_is_corrected_when_its_backward_runs(read_before_backward: bool) -> None:
    """Witnesses: the autograd graphs of un-instrumented runs of the module in each state of its weights
    (graph_names, attention_core): none with every weight frozen (an input that needs no gradient), the softmax
    and the matmul with V with none frozen, and no node of the attention with only the input projection frozen.
    The call signature stays the same throughout, so every call after the first is a steady one: the slot stops
    leaving the core to the backward pass while there is no graph, finds it when the graph comes back, and takes
    that way for the last call, whose record is corrected by it -- whether it was read before or not."""
    torch.manual_seed(6)
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = _weights(7)

    def trainable(projection: bool, out: bool) -> None:
        for p in (m.in_proj_weight, m.in_proj_bias):
            p.requires_grad_(projection)
        for p in (m.out_proj.weight, m.out_proj.bias):
            p.requires_grad_(out)

    trainable(False, False)
    assert m(x, x, x)[0].grad_fn is None
    trainable(False, True)
    assert not any("Softmax" in n or "Bmm" in n for n in graph_names(m(x, x, x)[0]))
    trainable(True, True)
    witness = attention_core(m(x, x, x)[0])
    with qkvtrace.trace(m) as t:
        trainable(False, False)
        m(x, x, x)
        m(x, x, x)  # no graph: the slot stops asking
        trainable(True, True)
        _loss(m(x, x, x)[0]).backward()  # the graph back: the way to its core found again
        trainable(False, True)
        out = m(x, x, x)[0]  # the way taken, to be followed in its backward pass
        if read_before_backward:
            assert [c.backward_kernel for c in t.calls] == [None, None, witness, witness]
        _loss(out).backward()
    assert [c.backward_kernel for c in t.calls] == [None, None, witness, None]
    assert t.calls[3].backward_reason is not None
    assert [r.call for r in t.routes] == [2]


def _layer_routes(traced: bool) -> tuple[list[float], list[Any]]:
    """Six training steps of an encoder layer with dropout (its SDPA kernel decomposed), PyTorch's fast path
    switched off from the fifth; the norm of the gradient of each step's Q as its SDPA kernel received it
    (retained by a wrapper of ``F.scaled_dot_product_attention``, un-instrumented: ``traced`` False), or the
    trace's routes (``traced``)."""
    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.1, batch_first=True)
    x = _weights(12)
    kept: list[torch.Tensor] = []
    sdpa = F.scaled_dot_product_attention

    def keeping(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        q.retain_grad()
        kept.append(q)
        return sdpa(q, *args, **kwargs)

    steps = contextlib.ExitStack()
    if traced:
        t = steps.enter_context(qkvtrace.trace(layer))
    else:
        steps.callback(setattr, F, "scaled_dot_product_attention", sdpa)
        F.scaled_dot_product_attention = keeping
    steps.callback(torch.backends.mha.set_fastpath_enabled, torch.backends.mha.get_fastpath_enabled())
    with steps:
        for i in range(6):
            torch.backends.mha.set_fastpath_enabled(i < 4)
            _loss(layer(x)).backward()
    if traced:
        return [r.q.norm for r in t.routes], list(t.calls)
    return [q.grad.norm().item() for q in kept], []  # type: ignore[union-attr]


def test_a_steady_encoder_layer_call_recorded_in_full_reads_its_routes_where_its_kernel_received_q() -> None:
    """Witness: PyTorch's own ``.grad`` of the Q each step's attention handed its SDPA kernel, in an
    un-instrumented run of the same seeds (dropout draws alike: tracing changes no output). The fifth step's
    layer reason changes (the fast path switched off), so its call is recorded in full although its kernel is
    its module's steady kernel: its routes are read where that kernel received Q, as on the first call."""
    witness, _ = _layer_routes(traced=False)
    got, calls = _layer_routes(traced=True)
    assert [c.why_not_fused_layer == calls[4].why_not_fused_layer for c in calls] == [False] * 4 + [True] * 2
    assert got == pytest.approx(witness, rel=1e-5)


class _FoldedHeads(nn.Module):
    """Attention written by hand on [B*H, T, d] tensors (heads folded into the batch, as Bloom keeps them); it keeps
    the tensors it hands to the attention, with their .grad retained, for the test to read."""

    def __init__(self, num_heads: int | None) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.qkv = nn.Linear(E, 3 * E)
        if num_heads is not None:
            self.num_heads = num_heads
        self.kept: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p.reshape(b, t, H, D).transpose(1, 2).reshape(b * H, t, D) for p in self.qkv(x).split(E, -1))
        kt = k.transpose(1, 2)
        for name, p in zip("qkv", (q, kt, v), strict=True):  # the very tensors the matmuls receive
            p.retain_grad()
            self.kept[name] = p
        w = torch.baddbmm(torch.zeros(b * H, t, t), q, kt, beta=0.0, alpha=D**-0.5).softmax(-1)
        return torch.bmm(w, v).reshape(b, H, t, D).transpose(1, 2).reshape(b, t, E)


@pytest.mark.parametrize("num_heads", [H, None])
def test_routes_of_folded_heads_are_per_head_whether_or_not_the_module_says_how_many(num_heads: int | None) -> None:
    """The module's reshape from [B, H, T, d] shows the heads when it names no count. Witness: PyTorch's own .grad
    of the q, k, v tensors the model handed to its attention (retained by the model), unfolded here to
    [B, H, T, d] for the per-head norms."""
    model = _FoldedHeads(num_heads)
    x = _weights(9)
    with qkvtrace.trace(model) as t:
        _loss(model(x)).backward()
    (call,) = t.calls
    assert call.path == "hand_written" and call.inputs["query_shape"] == [B * H, T, D]
    (route,) = t.routes
    for part in "qkv":
        grad = model.kept[part].grad
        grad = grad.transpose(1, 2) if part == "k" else grad  # K was kept as the matmul received it, transposed
        got = getattr(route, part)
        assert got.norm == pytest.approx(grad.norm().item(), rel=1e-5), part
        assert got.per_head == pytest.approx(_per_head(grad.reshape(B, H, T, D)), rel=1e-5), part


def test_a_grad_the_model_retains_on_q_k_v_is_its_own() -> None:
    """Witness: the same model run untraced (with the same weights and input): the .grad it retains on the q, k, v
    it hands to its attention."""
    untraced = _FoldedHeads(H)
    _loss(untraced(_weights(9))).backward()
    want = {p: untraced.kept[p].grad.clone() for p in "qkv"}
    model = _FoldedHeads(H)
    with qkvtrace.trace(model):
        out = model(_weights(9))
        assert all(model.kept[p].grad is None for p in "qkv")  # nothing written into them by the forward
        _loss(out).backward()
    for p in "qkv":
        assert torch.equal(model.kept[p].grad, want[p]), p
