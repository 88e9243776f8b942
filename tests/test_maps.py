"""Attention maps on the side: ``qkvtrace.trace(model, attention_maps=True)``.

Every map is checked against PyTorch itself: ``nn.MultiheadAttention``'s own
``need_weights=True, average_attn_weights=False`` weights, the MATH SDPA
backend's weights (``aten::_scaled_dot_product_attention_math``, which
returns them), and a float64 softmax written here. The maps-on witness checks
(outputs and kernels unchanged) are in test_witness.py.
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.records import TraceResult
from qkvtrace.records.validation import load_json

B, L, E, H = 2, 5, 32, 4
#: The README's claims (torch 2.13.0 CPU, float32), max abs error of a map against each witness; each test
#: allows twice the claim (one more float32 rounding step on another CPU), far below the 1e-5 used before.
README_CLAIM = {"mha": 6.0e-8, "math": 1.8e-7, "float64": 1.1e-7, "layer": 9.0e-8}
MHA_TOL = 2 * README_CLAIM["mha"]  # against MultiheadAttention's own need_weights=True weights
MATH_TOL = 2 * README_CLAIM["math"]  # against aten::_scaled_dot_product_attention_math's weights
F64_TOL = 2 * README_CLAIM["float64"]  # against the float64 softmax written here
LAYER_TOL = 2 * README_CLAIM["layer"]  # fused encoder layer against each layer's self_attn weights


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


class SDPAModule(nn.Module):
    """A user's attention that calls SDPA with whatever it is given (q/k/v already split)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


#: the torch the README's commands install, which printed the samples in docs/
README_TORCH = "2.13.0"


def _sdpa_takes_gqa() -> bool:
    try:
        F.scaled_dot_product_attention(*(torch.zeros(1, 1, 1, 2) for _ in range(3)), enable_gqa=True)
    except TypeError:
        return False
    return True


def _math_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                  **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """The MATH backend's own weights (SDPA's entry turns a boolean mask into -inf first; so do we)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    _, w = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, **kwargs)
    return w


def _float64_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False,
                     scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(QKᵀ·scale + mask) in float64, written out here; fully-masked rows come out NaN."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each key head serves a group of query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, dim=-1)


def _check_rows(c: Any) -> None:
    """Rows sum to 1 and fully-masked rows are all 0 (never NaN)."""
    w, full = c.attention_map, c.attention_map_fully_masked
    assert w.device.type == "cpu" and w.dtype == torch.float32
    assert not torch.isnan(w).any()
    sums = w.double().sum(-1)  # float32 rows of <= 12 weights: within a few float32 eps of 1
    assert torch.allclose(sums[~full], torch.ones_like(sums[~full]), rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    assert (w[full] == 0).all()


# -- MultiheadAttention against its own returned weights ------------------------------


MHA_CASES = {
    "batch_first": {},
    "seq_first": {"batch_first": False},
    "kdim_vdim": {"kdim": 24, "vdim": 20},
    "bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "no_bias": {"bias": False},
}


@pytest.mark.parametrize("masks", ["none", "bool", "float"])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_mha_maps_equal_pytorchs_weights(case: str, masks: str) -> None:
    """Witness: nn.MultiheadAttention's own need_weights=True, average_attn_weights=False weights from the same
    call; the zeros at masked positions come from the masks built here."""
    opts = {"batch_first": True, **MHA_CASES[case]}
    mha = nn.MultiheadAttention(E, H, **opts).eval()
    bf = opts["batch_first"]
    x = torch.randn(B, L, E) if bf else torch.randn(L, B, E)
    kdim, vdim = opts.get("kdim"), opts.get("vdim")
    k = (torch.randn(B, L + 1, kdim) if bf else torch.randn(L + 1, B, kdim)) if kdim else x
    v = (torch.randn(B, L + 1, vdim) if bf else torch.randn(L + 1, B, vdim)) if vdim else x
    s = L + 1 if kdim else L
    kwargs: dict[str, Any] = {}
    if masks == "bool":  # True = blocked for MultiheadAttention
        kpm = torch.zeros(B, s, dtype=torch.bool)
        kpm[1, -2:] = True
        kwargs = {"key_padding_mask": kpm, "attn_mask": torch.ones(L, s, dtype=torch.bool).triu(1)}
    elif masks == "float":
        kwargs = {"attn_mask": torch.randn(L, s).masked_fill(torch.ones(L, s, dtype=torch.bool).triu(2), -math.inf)}
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        _, w = mha(x, k, v, need_weights=True, average_attn_weights=False, **kwargs)
    (c,) = t.calls
    assert c.attention_map is not None, c.attention_map_reason
    assert c.attention_map.shape == w.shape
    err = _max_err(c.attention_map, w)
    print(f"MHA {case}/{masks}: max abs error {err:.2e}")
    assert err <= MHA_TOL, err
    assert c.attention_map_heads == list(range(H)) and c.attention_map_batch == list(range(B))
    _check_rows(c)
    if masks == "bool":  # masked positions are exactly 0
        assert (c.attention_map[1, :, :, s - 2 : s] == 0).all()  # (bias_k / zero keys come after the s keys)
        assert (c.attention_map[:, :, 0, 1:s] == 0).all()


def test_fast_path_map_equals_the_weights_pytorch_returns_on_its_fallback() -> None:
    """Witness: the same module called again untraced with need_weights=True, average_attn_weights=False on the
    same inputs (PyTorch's fallback weights); the zero column is the padded key built here."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -1] = True
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    (c,) = t.calls
    assert c.path == "fast"
    with torch.no_grad():
        _, w = mha(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    err = _max_err(c.attention_map, w)
    print(f"MHA fast path: max abs error {err:.2e}")
    assert err <= MHA_TOL
    assert (c.attention_map[0, :, :, -1] == 0).all()


def test_is_causal_fallback_uses_the_causal_mask_pytorch_uses() -> None:
    """Witness: the float64 causal softmax(QKᵀ/√d) written here on Q and K projected here with the module's
    in_proj_weight and in_proj_bias."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).train()
    x = torch.randn(B, L, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    with qkvtrace.trace(mha, attention_maps=True) as t:
        mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    (c,) = t.calls
    assert c.path == "fallback"
    q = F.linear(x, mha.in_proj_weight[:E], mha.in_proj_bias[:E]).reshape(B, L, H, E // H).transpose(1, 2)
    k = F.linear(x, mha.in_proj_weight[E : 2 * E], mha.in_proj_bias[E : 2 * E])
    k = k.reshape(B, L, H, E // H).transpose(1, 2)
    ref = _float64_weights(q.detach(), k.detach(), causal=True)
    assert _max_err(c.attention_map, ref) <= F64_TOL
    assert (c.attention_map.triu(1) == 0).all()


def test_unbatched_mha_call() -> None:
    """Witness: nn.MultiheadAttention's own need_weights=True, average_attn_weights=False weights for the same
    unbatched call; the leading batch of 1 is the unbatched input built here."""
    mha = nn.MultiheadAttention(E, H).eval()
    x = torch.randn(L, E)
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        _, w = mha(x, x, x, need_weights=True, average_attn_weights=False)
    (c,) = t.calls
    assert c.attention_map.shape == (1, H, L, L)
    assert _max_err(c.attention_map[0], w) <= MHA_TOL


def test_direct_multi_head_attention_forward_call() -> None:
    """Witness: the weights F.multi_head_attention_forward itself returns (need_weights=True,
    average_attn_weights=False) for the same call."""
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj_weight = nn.Parameter(torch.randn(3 * E, E) / math.sqrt(E))
            self.in_proj_bias = nn.Parameter(torch.randn(3 * E))
            self.out = nn.Linear(E, E)

        def forward(self, x: torch.Tensor) -> Any:
            return F.multi_head_attention_forward(
                x, x, x, E, H, self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
                self.out.weight, self.out.bias, need_weights=True, average_attn_weights=False,
            )  # fmt: skip

    model = Direct()
    x = torch.randn(L, B, E)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        _, w = model(x)
    (c,) = t.calls
    assert c.path == "fallback"
    assert _max_err(c.attention_map, w) <= MHA_TOL


def test_a_fully_masked_row_is_reported_not_nan() -> None:
    """Witness: the mask built here (query 2 blocked), nn.MultiheadAttention's own weights for the other rows, and
    the count of rows PyTorch returned as NaN in every head."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E)
    attn = torch.zeros(L, L, dtype=torch.bool)
    attn[2] = True  # query 2 may attend to nothing
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        _, w = mha(x, x, x, attn_mask=attn, need_weights=True, average_attn_weights=False)
    (c,) = t.calls
    assert torch.isnan(w[:, :, 2]).all()  # what PyTorch returns for that row
    full = c.attention_map_fully_masked
    assert full.shape == (B, H, L)
    assert full[:, :, 2].all() and int(full.sum()) == B * H
    assert (c.attention_map[:, :, 2] == 0).all()
    others = [i for i in range(L) if i != 2]
    assert _max_err(c.attention_map[:, :, others], w[:, :, others]) <= MHA_TOL
    _check_rows(c)
    # (batch, head, query) rows whose weights PyTorch returned as NaN: PyTorch's count, not the map's
    assert c.output["fully_masked_rows"] == int(torch.isnan(w).all(-1).sum()) == B * H


# -- direct SDPA against the MATH backend's weights -----------------------------------


def _qkv(hq: int = H, hk: int = H, lq: int = L, lk: int = L, d: int = 8, lead: tuple[int, ...] = (B,)) -> Any:
    q = torch.randn(*lead, hq, lq, d)
    k = torch.randn(*lead, hk, lk, d)
    v = torch.randn(*lead, hk, lk, d)
    return q, k, v


SDPA_CASES: dict[str, Any] = {
    "plain": lambda: (_qkv(), {}),
    "causal": lambda: (_qkv(), {"is_causal": True}),
    "causal_rectangular": lambda: (_qkv(lq=3, lk=7), {"is_causal": True}),
    "bool_mask": lambda: (_qkv(), {"attn_mask": torch.rand(B, 1, L, L) > 0.3}),
    "float_mask": lambda: (_qkv(), {"attn_mask": torch.randn(L, L)}),
    "scale": lambda: (_qkv(), {"scale": 0.05}),
    "gqa": lambda: (_qkv(hq=4, hk=2), {"enable_gqa": True}),
    "three_dims": lambda: (_qkv(lead=()), {}),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_maps_equal_the_math_backends_weights(case: str) -> None:
    """Witness: the weights of aten::_scaled_dot_product_attention_math and a float64 softmax(QKᵀ·scale + mask)
    written here, both on the call's own inputs."""
    (q, k, v), kwargs = SDPA_CASES[case]()
    if "enable_gqa" in kwargs and not _sdpa_takes_gqa():
        pytest.skip(f"scaled_dot_product_attention of torch {torch.__version__} has no enable_gqa")
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, k, v, **kwargs)
    (c,) = t.calls
    assert c.path == "sdpa" and c.attention_map is not None, c.attention_map_reason
    mask = kwargs.get("attn_mask")
    math_kwargs = {k: kwargs[k] for k in ("is_causal", "scale", "enable_gqa") if k in kwargs}
    math_w = _math_weights(q, k, v, mask, **math_kwargs)
    ours = _float64_weights(q, k, mask, causal=kwargs.get("is_causal", False), scale=kwargs.get("scale"))
    if q.dim() == 3:
        math_w, ours = math_w.unsqueeze(0), ours.unsqueeze(0)
    full = c.attention_map_fully_masked
    err_math = _max_err(c.attention_map, math_w)
    err_ref = _max_err(c.attention_map[~full], ours[~full])
    print(f"SDPA {case}: max abs error {err_math:.2e} vs MATH, {err_ref:.2e} vs float64")
    assert err_math <= MATH_TOL and err_ref <= F64_TOL
    _check_rows(c)


def test_sdpa_fully_masked_row_and_masked_positions() -> None:
    """Witness: the boolean mask built here (row 3 all blocked) and the MATH backend's weights on the same inputs."""
    q, k, v = _qkv()
    mask = torch.ones(L, L, dtype=torch.bool).tril()  # True = attend for SDPA
    mask[3] = False
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, k, v, attn_mask=mask)
    (c,) = t.calls
    full = c.attention_map_fully_masked
    assert full[:, :, 3].all() and int(full.sum()) == B * H
    assert (c.attention_map[..., ~mask] == 0).all()
    math_w = _math_weights(q, k, v, mask)  # MATH returns 0 in the fully-masked row (NaN before torch 2.5)
    assert _max_err(c.attention_map[~full], math_w[~full]) <= MATH_TOL
    assert bool(((math_w[full] == 0) | math_w[full].isnan()).all())
    _check_rows(c)


# -- the fused encoder layer -----------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_fused_encoder_layer_maps(norm_first: bool, padding: bool) -> None:
    """Witness: each layer's own self_attn called with need_weights=True, average_attn_weights=False on the input
    that layer saw (after norm1, applied here, when norm_first)."""
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=padding and not norm_first).eval()
    x = torch.randn(B, 6, E)
    kpm = torch.zeros(B, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kwargs = {"src_key_padding_mask": kpm} if padding else {}
    with qkvtrace.trace(enc, attention_maps=True) as t, torch.inference_mode():
        enc(x, **kwargs)
    assert [c.path for c in t.calls] == ["fused_encoder_layer"] * 2
    # reference: each layer's own self_attn with need_weights on the input the layer saw (after norm1 if norm_first)
    h = x
    with torch.no_grad():
        for c, lay in zip(t.calls, enc.layers, strict=True):
            a = lay.norm1(h) if norm_first else h
            _, w = lay.self_attn(a, a, a, key_padding_mask=kpm if padding else None, need_weights=True,
                                 average_attn_weights=False)  # fmt: skip
            if padding and enc.use_nested_tensor:  # PyTorch dropped the padded queries: rows 0 and flagged
                assert (c.attention_map[1, :, 4:] == 0).all() and c.attention_map_fully_masked[1, :, 4:].all()
                assert c.attention_map_notes and "nested" in c.attention_map_notes[0]
                err = max(_max_err(c.attention_map[0], w[0]), _max_err(c.attention_map[1, :, :4], w[1, :, :4]))
            else:
                err = _max_err(c.attention_map, w)
            print(f"fused layer norm_first={norm_first} padding={padding}: max abs error {err:.2e}")
            assert err <= LAYER_TOL
            h = lay(h, src_key_padding_mask=kpm if padding else None)


# -- what is asked for, and the bound ----------------------------------------------------------


def test_heads_and_batch_index_select_parts_of_the_full_map() -> None:
    """Witness: the weights of aten::_scaled_dot_product_attention_math for the same Q, K, V (PyTorch's own), cut
    here to heads [3, 1] of batch row 1 — the heads=[3, 1], batch_index=1 asked for."""
    q, k, v = _qkv()
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True, heads=[3, 1], batch_index=1) as part, torch.no_grad():
        model(q, k, v)
    (c,) = part.calls
    assert c.attention_map.shape == (1, 2, L, L)
    assert c.attention_map_heads == [3, 1] and c.attention_map_batch == [1]
    w = _math_weights(q, k, v)
    assert _max_err(c.attention_map[0], w[1, [3, 1]]) <= MATH_TOL
    assert _max_err(c.attention_map[0], w[1, [1, 3]]) > 100 * MATH_TOL  # the order asked for, not sorted


def test_asking_for_a_head_the_call_lacks_says_so() -> None:
    """Witness: heads=[7] asked for here against the H=4 heads of the Q, K, V built here, and the fresh module
    instance that the trace was never given."""
    with qkvtrace.trace(SDPAModule(), attention_maps=True, heads=[7]) as t, torch.no_grad():
        SDPAModule()(*_qkv())
    assert not t.calls  # a fresh module instance: not the traced one
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True, heads=[7]) as t, torch.no_grad():
        model(*_qkv())
    (c,) = t.calls
    assert c.attention_map is None
    assert "heads [7]" in c.attention_map_reason and f"has {H} heads" in c.attention_map_reason


def test_maps_over_the_bounds_are_refused_with_a_clear_message() -> None:
    """Witness: the sizes built here (40 x 40 tokens, max_map_tokens=32, a budget of 1.5 maps computed here) and
    the module's own output of an untraced repeat of the call."""
    model = SDPAModule()
    q, k, v = _qkv(lq=40, lk=40)
    with qkvtrace.trace(model, attention_maps=True, max_map_tokens=32) as t, torch.no_grad():
        out = model(q, k, v)
    (c,) = t.calls
    assert c.attention_map is None
    assert "T_query=40, T_key=40 is over max_map_tokens=32" in c.attention_map_reason
    assert f"{B}x{H}x40x40 = {B * H * 1600:,} floats" in c.attention_map_reason
    assert any("max_map_tokens" in w for w in t.result.warnings)
    with torch.no_grad():
        assert torch.equal(out, model(q, k, v))  # the call itself ran as always
    # the trace's memory budget: the first map fits, the second would go over
    one_mb = B * H * 40 * 40 * 4 / 2**20
    with qkvtrace.trace(model, attention_maps=True, max_map_mb=1.5 * one_mb) as t, torch.no_grad():
        model(q, k, v)
        model(q, k, v)
    first, second = t.calls
    assert first.attention_map is not None and second.attention_map is None
    assert "over max_map_mb=" in second.attention_map_reason


@pytest.mark.parametrize("bad", [{"heads": [-1]}, {"batch_index": "0"}, {"max_map_tokens": 0}, {"max_map_mb": -1.0}])
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    """Witness: the invalid values written here (a negative head, a string batch index, bounds of 0 and -1.0)."""
    with pytest.raises(ValueError):
        qkvtrace.trace(nn.Linear(2, 2), attention_maps=True, **bad)


# -- lifetime, other traces, JSON -----------------------------------------------------------------


def test_maps_live_in_the_result_only_and_go_with_it() -> None:
    """Witness: the ids of the module's attributes taken here before the call, and a weakref to the map that
    Python's gc clears once the result is deleted."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    before = {id(v) for v in vars(mha).values()}
    x = torch.randn(B, L, E)
    t = qkvtrace.trace(mha, attention_maps=True)
    with t, torch.no_grad():
        mha(x, x, x)
    ref = weakref.ref(t.calls[0].attention_map)
    assert {id(v) for v in vars(mha).values()} == before  # nothing new on the module
    del t
    gc.collect()
    assert ref() is None


def test_a_trace_without_maps_gets_none_beside_one_with_maps() -> None:
    """Witness: the options of the two traces made here, one without attention_maps and one with it."""
    q, k, v = _qkv()
    model = SDPAModule()
    with qkvtrace.trace(model) as plain, qkvtrace.trace(model, attention_maps=True) as mapped, torch.no_grad():
        model(q, k, v)
    assert mapped.calls[0].attention_map is not None
    assert plain.calls[0].attention_map is None and plain.calls[0].attention_map_reason is None


def test_maps_draw_no_random_numbers_and_note_dropout() -> None:
    """Witness: the same dropout call traced without maps from the same RNG state set here, the next torch.rand
    draw after each run, and the dropout=0.5 given to the module here."""
    mha = nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True).train()
    x = torch.randn(B, L, E)
    runs = []
    for maps in (False, True):
        with qkvtrace.trace(mha, attention_maps=maps) as t:
            torch.manual_seed(7)  # seeded inside the block: the comparison is about the maps alone
            out = mha(x, x, x)[0]
            runs.append((out, torch.rand(3)))
    (plain, after_plain), (mapped, after_mapped) = runs
    assert torch.equal(plain, mapped) and torch.equal(after_plain, after_mapped)
    assert any("dropout_p=0.5" in n for n in t.calls[0].attention_map_notes)


def test_json_has_maps_only_when_asked(tmp_path: Path) -> None:
    """Witness: the trace-3.json schema, the mask built here (query 1 blocked in every batch and head), and for
    the round trip the in-memory result the file was written from."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E)
    attn = torch.zeros(L, L, dtype=torch.bool)
    attn[1] = True
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        mha(x, x, x, attn_mask=attn)
    plain = t.to_dict()["calls"][0]
    assert "attention_map" not in plain and plain["attention_map_heads"] == list(range(H))
    path = t.save(tmp_path / "t.json", maps=True)
    data = load_json(path, "qkvtrace.trace/3")  # validates against trace-3.json
    written = data["calls"][0]["attention_map"]
    assert written["shape"] == [B, H, L, L]
    assert sorted(written["fully_masked"]) == sorted([b, h, 1] for b in range(B) for h in range(H))
    back = TraceResult.from_dict(json.loads(path.read_text()))
    assert torch.equal(back.calls[0].attention_map, t.calls[0].attention_map)
    assert torch.equal(back.calls[0].attention_map_fully_masked, t.calls[0].attention_map_fully_masked)
    # a trace without maps writes none of the map keys
    with qkvtrace.trace(mha) as t2, torch.no_grad():
        mha(x, x, x)
    assert not [key for key in t2.to_dict()["calls"][0] if key.startswith("attention_map")]


# -- the CLI ------------------------------------------------------------------------------------


def _cli(*args: str, pre: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{pre}import sys; from qkvtrace.cli.main import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_cli_maps_writes_pictures_per_call_and_head_and_a_grid(tmp_path: Path) -> None:
    """Witness: the file names implied by the options passed here (the demo's 2 layers x heads 0, 3 and a grid x
    png/svg), the demo's VOCABULARY word for its first token, its input's batch size, and the schema."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "maps"
    r = _cli("trace", "demo:tiny-lm", "--maps", str(out), "--map-heads", "0,3", "--json", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 2 * (2 + 1) * 2  # calls x (heads + grid) x formats
    for call in range(2):
        for head in (0, 3):
            for ext in ("png", "svg"):
                assert any(n.startswith(f"call{call:03d}_") and n.endswith(f"_head{head}.{ext}") for n in names), names
        for ext in ("png", "svg"):
            assert any(n.startswith(f"call{call:03d}_") and n.endswith(f"_grid.{ext}") for n in names), names
    svg = next(p for p in out.iterdir() if p.name.endswith("_head0.svg")).read_text()
    import html

    from qkvtrace.analyses.demos import VOCABULARY, demo_tiny_lm

    first_token = int(demo_tiny_lm()[1][0][0, 0])
    assert "<svg" in svg and f">{html.escape(VOCABULARY[first_token])}</text>" in svg  # the demo's words label the axes
    data = load_json(tmp_path / "t.json", "qkvtrace.trace/3")
    batch = demo_tiny_lm()[1][0].shape[0]  # every batch item by default, as in Python
    assert data["calls"][0]["attention_map"]["shape"] == [batch, 2, 16, 16]  # heads 0 and 3


def test_cli_maps_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    """Witness: matplotlib made unimportable here (a None entry in sys.modules); the hint is pyproject's plot extra."""
    r = _cli("trace", "demo:mha", "--maps", str(tmp_path / "m"), pre="import sys; sys.modules['matplotlib'] = None; ")
    assert r.returncode == 2
    assert 'pip install "qkvtrace[plot]"' in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_show_maps_prints_small_maps_in_the_terminal() -> None:
    """Witness: the --map-heads 0 option passed here; the check is only that the text names a map and head 0."""
    r = _cli("trace", "demo:mha", "--show-maps", "--map-heads", "0")
    assert r.returncode == 0, r.stderr
    assert "attention map" in r.stdout and "head 0" in r.stdout


def test_pictures_name_fully_masked_rows_and_use_the_vocabulary(tmp_path: Path) -> None:
    """Witness: the vocabulary and ids built here (the second item all padding), H heads per call, and the
    rendered text read back here."""
    pytest.importorskip("matplotlib")
    from qkvtrace.render.maps_render import call_labels, terminal_maps, token_labels, write_map_pictures

    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vocabulary = ["<pad>", "the", "cat", "sat", "down"]
            self.emb = nn.Embedding(5, E)
            self.mha = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            return self.mha(x, x, x, key_padding_mask=ids == 0, need_weights=False)[0]

    model = Tagged().eval()
    ids = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])  # the second item is all padding: every row fully masked
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(ids)
    (c,) = t.calls
    assert c.attention_map_fully_masked[1].all() and not c.attention_map_fully_masked[0].any()
    tokens = token_labels(model, (ids,))
    assert tokens == [["the", "cat", "sat", "down"], ["<pad>"] * 4]
    assert call_labels(c, 0, tokens) == (tokens[0], tokens[0])
    files = write_map_pictures(t.result, tmp_path, tokens)
    assert len(files) == 2 * (H + 1) and all(f.stat().st_size > 0 for f in files)
    rendered = terminal_maps(t.result, tokens)
    from rich.console import Console

    console = Console(width=200, record=True)
    for part in rendered:
        console.print(part)
    text = console.export_text()
    assert "cat" in text and "head 0" in text
    # a map of the all-padding item reads "fully masked", not NaN
    with qkvtrace.trace(model, attention_maps=True, batch_index=1) as t2, torch.no_grad():
        model(ids)
    console = Console(width=200, record=True)
    for part in terminal_maps(t2.result, tokens):
        console.print(part)
    assert "fully masked" in console.export_text() and "nan" not in console.export_text().lower()


def test_readme_maps_sample_is_what_trace_prints() -> None:
    """Witness: the sample in docs/maps.md (printed with torch 2.13.0), against a fresh run of the command it shows."""
    import os

    if not torch.__version__.startswith(README_TORCH):
        pytest.skip(f"the documented samples were printed by torch {README_TORCH}, the release its commands install")
    command = "qkvtrace trace demo:mha --show-maps --map-heads 0,1"
    lines = (Path(__file__).resolve().parent.parent / "docs" / "maps.md").read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    shown = [line.rstrip() for line in lines[start : lines.index("```", start)]]
    env = {**os.environ, "COLUMNS": "100", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", *command.split()[1:]], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [line.rstrip() for line in proc.stdout.splitlines()] == shown


def test_causal_bias_override_mask_is_materialised() -> None:
    """Witness: the float64 softmax written here with the lower-right causal mask built here by
    tril(diagonal=6 - 3)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _qkv(lq=3, lk=6)
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, k, v, attn_mask=causal_lower_right(3, 6))
    (c,) = t.calls
    attend = torch.ones(3, 6, dtype=torch.bool).tril(diagonal=6 - 3)  # lower-right aligned, written out here
    assert _max_err(c.attention_map, _float64_weights(q, k, attend)) <= F64_TOL
    assert (c.attention_map[..., ~attend] == 0).all()


def test_a_flex_attention_call_says_why_it_has_no_map() -> None:
    """Witness: the flex_attention call built here, the one path whose score_mod the map cannot read."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    class Flex(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return flex.flex_attention(q, q, q)

    model = Flex()
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns once per process that flex runs uncompiled
        model(torch.randn(1, 2, 8, 8))
    (c,) = t.calls
    assert c.path == "flex" and c.attention_map is None
    assert "not 'flex'" in c.attention_map_reason and "score_mod" in c.attention_map_reason


def test_a_call_that_raises_has_no_map_and_says_so() -> None:
    """Witness: the mismatched key and value lengths built here, which make nn.MultiheadAttention raise."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad(), pytest.raises(AssertionError):
        mha(torch.randn(B, L, E), torch.randn(B, L + 1, E), torch.randn(B, L + 2, E))
    (c,) = t.calls
    assert c.error and c.attention_map is None and c.attention_map_reason == "not computed: the call raised"


@pytest.mark.parametrize("padding", [False, True])
def test_fused_encoder_layer_merged_causal_mask(padding: bool) -> None:
    """A src_mask (and a padding mask) reach the fused builtin merged (mask_type 2): the map reads that mask.
    Witness: each layer's own self_attn with need_weights=True and the same masks on the input that layer saw."""
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(B, 6, E)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    kpm = torch.zeros(B, 6)
    kpm[1, 4:] = -math.inf  # float, like the causal mask
    kwargs = {"mask": causal, **({"src_key_padding_mask": kpm} if padding else {"is_causal": True})}
    with qkvtrace.trace(enc, attention_maps=True) as t, torch.inference_mode():
        enc(x, **kwargs)
    h = x
    with torch.no_grad():
        for c, lay in zip(t.calls, enc.layers, strict=True):
            assert c.path == "fused_encoder_layer" and c.inputs["mask_type"] == 2
            _, w = lay.self_attn(h, h, h, attn_mask=causal, key_padding_mask=kpm if padding else None,
                                 need_weights=True, average_attn_weights=False)  # fmt: skip
            assert _max_err(c.attention_map, w) <= LAYER_TOL
            assert (c.attention_map.triu(1) == 0).all()
            h = lay(h, src_mask=causal, src_key_padding_mask=kpm if padding else None)


def test_demo_tiny_lm_labels_its_maps_with_words() -> None:
    """The demo language model carries a vocabulary, so its pictures show words, not ids.
    Witness: the demo's VOCABULARY looked up here for each id of its input."""

    from qkvtrace.analyses.demos import VOCABULARY, demo_tiny_lm
    from qkvtrace.render.maps_render import token_labels

    model, (ids,) = demo_tiny_lm()
    labels = token_labels(model, (ids,))
    assert labels is not None
    assert labels[0] == [VOCABULARY[i] for i in ids[0].tolist()]
    assert not any(label.startswith("#") for row in labels for label in row)
