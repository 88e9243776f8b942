"""The tutorial's warnings, measured on the installed PyTorch.

* :func:`mask_semantics`: what ``True`` means in each API's boolean mask
  (docs/tutorial.md#masks), on a 2x2 example whose expected weights can be checked by hand.
* :func:`fully_masked_rows`: what a query row whose keys are all masked
  returns, per API and per SDPA backend that runs here, and whether the
  gradient through it is finite.
* :func:`agreement`: how far each backend and both MHA paths are from the
  reference ``softmax(QK^T/sqrt(d_head) + M) V``; MHA equals the computation
  done by hand with the three ``in_proj_weight`` slices (docs/tutorial.md#how-pytorch-runs-attention), and the
  three slice gradients differ (docs/tutorial.md#gradients-of-q-k-and-v).

Every value is measured when the function runs; nothing is a table of
expectations. Collection only: no rendering imports.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.base import compat
from qkvtrace.base.errors import first_line

__all__ = ["agreement", "fully_masked_rows", "mask_semantics", "reference_attention", "run_behaviour"]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by hand (docs/tutorial.md#attention-by-hand), written out: ``softmax(Q K^T / sqrt(d_head) + M) V``.

    ``mask`` follows the tutorial's own convention: a bool mask is ``True`` where
    attention is *allowed*; a float mask is added to the scores.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def _backends() -> list[str]:
    return [n for n in compat.sdp_backend_names().values() if n != "ERROR"]


def _check_forced(backend: str | None, *args: Any, **kwargs: Any) -> None:
    """Raise when forcing ``backend`` did not make PyTorch select it for these arguments.

    Releases before ``torch.nn.attention`` force backends with switches that
    some devices ignore (on CPU, 2.0 runs MATH whichever switch is on); a
    result recorded under a backend that did not run would be a false label.
    """
    if backend is None:
        return
    from qkvtrace.facts.paths import sdpa_backend

    selected = sdpa_backend(*args, **kwargs)
    if selected is not None and selected != backend:
        raise compat.MissingCapability(f"{backend} was forced, but this PyTorch selected {selected} here")


def _round(t: torch.Tensor) -> list[Any]:
    return [[None if math.isnan(x) else round(x, 4) for x in row] for row in t.detach().double().tolist()]


# -- mask semantics ---------------------------------------------------------

#: The 2x2 example: each query may see exactly one key, whichever meaning True has.
_EXAMPLE = [[True, False], [False, True]]


def _classify(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """``attend`` if the True positions got the weight, ``ignore`` if the False ones did."""
    w = weights.detach().double()
    zero_at_false = bool(torch.all(w[~mask].abs() < 1e-6))
    zero_at_true = bool(torch.all(w[mask].abs() < 1e-6))
    true_means = "attend" if zero_at_false and not zero_at_true else "ignore" if zero_at_true else "unclear"
    blocked = ~mask if true_means == "attend" else mask
    return {
        "true_means": true_means,
        "masked_prob_zero": bool(torch.all(w[blocked].abs() < 1e-6)),
        "rows_sum_to_one": bool(torch.allclose(w.sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype), atol=1e-5)),
        "observed_weights": _round(w.reshape(-1, w.shape[-1])),
    }


def _sdpa_weights(mask: torch.Tensor) -> torch.Tensor:
    # equal scores (q = 0); V = identity, so output row i is attention row i
    q = torch.zeros(1, 1, 2, 4)
    k = torch.zeros(1, 1, 2, 4)
    v = torch.eye(2).reshape(1, 1, 2, 2)
    with torch.no_grad():
        return compat.raw_sdpa()(q, k, v, attn_mask=mask)[0, 0]


def _mha_weights(**masks: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 1, batch_first=True).eval()
    x = torch.randn(1, 2, 4)
    with torch.no_grad():
        _, w = mha(x, x, x, need_weights=True, **masks)
    return w[0]


def _layer_true_means() -> dict[str, Any]:
    """Perturbation: does the output at position 0 depend on position 1 when it is marked True?"""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).eval()
    x = torch.randn(1, 2, 4)
    y = x.clone()
    y[0, 1] += 3.0
    mask = torch.tensor([[False, True]])
    with torch.no_grad():
        a, b = layer(x, src_key_padding_mask=mask), layer(y, src_key_padding_mask=mask)
    unchanged = bool(torch.allclose(a[0, 0], b[0, 0], atol=1e-6))
    return {
        "true_means": "ignore" if unchanged else "attend",
        "masked_prob_zero": unchanged,
        "rows_sum_to_one": None,
        "observed_weights": None,
        "method": "perturbation: position 1 marked True, its input changed; did position 0's output change?",
    }


def mask_semantics() -> list[dict[str, Any]]:
    """What ``True`` means in each API's boolean mask, measured."""
    example = torch.tensor(_EXAMPLE)
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("F.scaled_dot_product_attention:attn_mask", lambda: _classify(_sdpa_weights(example), example)),
        ("nn.MultiheadAttention:key_padding_mask", lambda: _classify(
            _mha_weights(key_padding_mask=torch.tensor([[True, False]])).expand(2, 2),
            torch.tensor([[True, False], [True, False]]),
        )),
        ("nn.MultiheadAttention:attn_mask", lambda: _classify(_mha_weights(attn_mask=example), example)),
        ("nn.TransformerEncoderLayer:src_key_padding_mask", _layer_true_means),
        ("attention by hand (tutorial)", lambda: _classify(
            reference_attention(torch.zeros(2, 4), torch.zeros(2, 4), torch.eye(2), example)[1], example
        )),
    ]  # fmt: skip
    out = []
    for api, measure in cases:
        record: dict[str, Any] = {"api": api, "example_mask": _EXAMPLE}
        try:
            record.update(measure())
        except Exception as exc:  # an API this PyTorch lacks or refuses
            record.update({"true_means": None, "error": first_line(exc)})
        out.append(record)
    return out


# -- fully masked rows --------------------------------------------------------


def _result_kind(rows: torch.Tensor) -> tuple[str, list[Any] | None]:
    r = rows.detach().double()
    if bool(torch.isnan(r).all()):
        return "nan", None
    if bool((r == 0).all()):
        return "zero", None
    return "other", _round(r.reshape(-1, r.shape[-1])[:2])


def _sdpa_fully_masked(backend: str | None, kind: str, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False  # query 0 may see no key
    if kind == "bool":
        from qkvtrace.facts.masks import sdpa_bool_true_means

        mask = attend if sdpa_bool_true_means() == "attend" else ~attend
    else:
        mask = torch.zeros(3, 3, dtype=dtype).masked_fill(~attend, float("-inf"))
    with compat.forced_backend(backend):
        out = compat.raw_sdpa()(q, k, v, attn_mask=mask)
        _check_forced(backend, q, k, v, mask)
    result, values = _result_kind(out[:, :, 0])
    out.float().nan_to_num(0.0).sum().backward()
    finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v) if t.grad is not None)
    return {"result": result, "values": values, "grad_finite": finite}


def _mha_fully_masked(train: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).train(train)
    x = torch.randn(2, 3, 8, requires_grad=train)
    from qkvtrace.tracer import trace

    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[0] = True  # every key of sequence 0 is padding (True = ignore for this API)
    with torch.set_grad_enabled(train), trace(mha, gradients=False) as t:
        out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    result, values = _result_kind(out[0])
    finite = None
    if train:
        out.nan_to_num(0.0).sum().backward()
        grads = [x.grad, *(p.grad for p in mha.parameters())]
        finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
    return {"result": result, "values": values, "grad_finite": finite, "path": t.calls[0].path if t.calls else None}


def fully_masked_rows() -> list[dict[str, Any]]:
    """What a query row with every key masked returns, per API/backend."""
    cases: list[tuple[str, str | None, Callable[[], dict[str, Any]]]] = [
        (
            f"F.scaled_dot_product_attention ({kind} mask)",
            backend or "default",
            functools.partial(_sdpa_fully_masked, backend, kind, torch.float32),
        )
        for kind in ("bool", "float")
        for backend in [None, *_backends()]
    ]
    cases.append(("nn.MultiheadAttention fast path (eval, no_grad)", None, lambda: _mha_fully_masked(False)))
    cases.append(("nn.MultiheadAttention fallback (train)", None, lambda: _mha_fully_masked(True)))
    cases.append(("attention by hand (tutorial)", None, _seed_fully_masked))
    out = []
    for api, backend, measure in cases:
        record: dict[str, Any] = {"api": api, "backend": backend}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                record.update(measure())
            except Exception as exc:  # backend not available here, or the API refuses the input
                record.update({"result": "error", "values": None, "grad_finite": None, "error": first_line(exc)})
        out.append(record)
    return out  # fmt: skip


def _seed_fully_masked() -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 8, requires_grad=True) for _ in range(3))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False
    out, _ = reference_attention(q, k, v, attend)
    result, values = _result_kind(out[0:1])
    out.nan_to_num(0.0).sum().backward()
    finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v) if t.grad is not None)
    return {"result": result, "values": values, "grad_finite": finite}


# -- agreement ----------------------------------------------------------------


def _sig(x: float) -> float:
    return float(f"{x:.2g}")


def _mha_by_hand(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """MHA's output computed with the three ``in_proj_weight`` slices (docs/tutorial.md#how-pytorch-runs-attention)."""
    e, h = mha.embed_dim, mha.num_heads
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3, dim=0)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3, dim=0)
    b, t, _ = x.shape

    def heads(y: torch.Tensor) -> torch.Tensor:  # [B,T,E] -> [B,H,T,Dh]
        return y.view(b, t, h, e // h).transpose(1, 2)

    q, k, v = heads(F.linear(x, w_q, b_q)), heads(F.linear(x, w_k, b_k)), heads(F.linear(x, w_v, b_v))
    ctx, _ = reference_attention(q, k, v)
    return F.linear(ctx.transpose(1, 2).reshape(b, t, e), mha.out_proj.weight, mha.out_proj.bias)


def agreement() -> dict[str, Any]:
    """Max |difference| to the reference, per backend and dtype, and the packed-weight facts."""
    sdpa: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float64) for _ in range(3))
        ref, _ = reference_attention(q, k, v)
        for backend in [None, *_backends()]:
            record: dict[str, Any] = {"backend": backend or "default", "dtype": str(dtype).replace("torch.", "")}
            try:
                with compat.forced_backend(backend), torch.no_grad():
                    out = compat.raw_sdpa()(q.to(dtype), k.to(dtype), v.to(dtype))
                    _check_forced(backend, q.to(dtype), k.to(dtype), v.to(dtype))
                record["max_abs_diff"] = _sig(float((out.double() - ref).abs().max()))
            except RuntimeError as exc:
                record["max_abs_diff"] = None
                record["error"] = first_line(exc)
            sdpa.append(record)

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        by_hand = _mha_by_hand(mha, x)
        mha.eval()
        fast = mha(x, x, x, need_weights=False)[0]
    mha.train()
    fallback = mha(x, x, x, need_weights=False)[0]
    fallback.square().mean().backward()
    grad = mha.in_proj_weight.grad
    assert grad is not None
    grads = [float(g.norm()) for g in grad.chunk(3, dim=0)]
    return {
        "sdpa": sdpa,
        "mha": [
            {"path": "fast", "max_abs_diff_to_by_hand": _sig(float((fast - by_hand).abs().max()))},
            {"path": "fallback", "max_abs_diff_to_by_hand": _sig(float((fallback.detach() - by_hand).abs().max()))},
        ],
        "slice_gradients_differ": len({round(g, 6) for g in grads}) == 3,
        "slice_gradient_norms": [_sig(g) for g in grads],
    }


def run_behaviour() -> dict[str, Any]:
    """All three measurements, for the report's ``probes`` section."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "mask_semantics": mask_semantics(),
            "fully_masked_rows": fully_masked_rows(),
            "agreement": agreement(),
        }
