"""What the masks and biases of attention written by hand are, measured from the tensors.

A hand-written attention adds its masks and biases to the scores in many
ways: a float tensor added (``scores + mask``, with ``-inf`` or the dtype's
minimum where a key is removed), ``masked_fill(mask, value)``,
``torch.where(cond, scores, value)``, a bias tensor in ``baddbmm``. The
recogniser (:mod:`qkvtrace.tracer.observers.handwritten`) hands each term
here as it was applied; this module turns them into two tensors on the
device -- which entries are *blocked* (their weight after the softmax is
exactly 0) and the finite *bias* added to the rest -- and, when the trace
resolves its records, names what they are:

* masks: ``causal`` (key ``j`` blocked exactly when ``j > i + (T_k - T_q)``),
  ``padding`` (the same keys blocked for every query row), ``causal+padding``,
  ``window`` (every row attends to one contiguous band of keys, narrower than
  all of them, and it is not causal), or ``other``;
* biases: ``alibi_like`` (linear along the key axis in every row: a slope
  per head, as ALiBi), ``relative_position`` (constant along every diagonal:
  a function of ``j - i`` only, as T5's buckets), or ``additive``.

An additive value at or below ``-1e4`` counts as blocking: its weight after
the softmax underflows to exactly 0 in every floating dtype.

The numbers the scores were scaled by (a scale, a soft-cap) are read here
too (:func:`scale_and_cap`), without reading a tensor's value.

Nothing is read back to the host while the trace is open: the tensors stay on
the device and the names are :class:`~qkvtrace.base.lazy.Deferred`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkvtrace.base.lazy import Deferred

__all__ = ["BLOCKING", "Term", "bias_kind", "combine", "mask_kind", "same_steps", "scale_and_cap"]

#: an additive value at or below this removes the key: exp(-1e4) is 0 in every floating dtype
BLOCKING = -1e4


@dataclass(frozen=True, slots=True)
class Term:
    """One mask or bias applied to the scores, as the model wrote it.

    ``kind``: ``"add"`` (``tensor`` added, times ``sign``), ``"fill"``
    (``masked_fill(tensor, value)``) or ``"where"`` (``where(tensor, scores,
    value)``, ``keep`` True; or ``where(tensor, value, scores)``, ``keep`` False).
    ``shape``: the scores' shape when it was applied.
    """

    kind: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    value: Any = None
    sign: float = 1.0
    keep: bool = True


def _to_final(t: torch.Tensor, applied: tuple[int, ...], final: tuple[int, ...]) -> torch.Tensor:
    """``t`` (broadcast against scores of shape ``applied``) laid out for scores of shape ``final``."""
    if applied == final:
        return t
    return t.expand(applied).reshape(final)


def _blocking(value: Any, like: torch.Tensor) -> torch.Tensor | bool:
    """Whether a fill value removes a key (a Python bool, or a 0-dim tensor on the device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(like.device) <= BLOCKING
    return float(value) <= BLOCKING


def combine(terms: list[Term], final: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(blocked, bias)`` of ``terms`` for scores of shape ``final`` (``None`` where there is none).

    ``blocked`` is boolean, ``bias`` float32; both broadcast against the scores.
    """
    blocked: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    with torch.no_grad():
        for term in terms:
            t = _to_final(term.tensor.detach(), term.shape, final)
            if term.kind == "add":
                t = t.float() if t.dtype != torch.float32 else t
                if term.sign != 1.0:
                    t = t * term.sign
                removes = t <= BLOCKING
                finite = t.masked_fill(removes, 0.0)
                blocked = removes if blocked is None else blocked | removes
                bias = finite if bias is None else bias + finite
                continue
            cond = t.bool()
            chosen = cond if term.kind == "fill" or not term.keep else ~cond  # where the value replaces scores
            removes = chosen & _blocking(term.value, t)
            blocked = removes if blocked is None else blocked | removes
    return blocked, bias


def _causal(t_q: int, t_k: int) -> torch.Tensor:
    offset = t_k - t_q
    i = torch.arange(t_q).unsqueeze(-1)
    j = torch.arange(t_k).unsqueeze(0)
    return j > i + offset


def _name_mask(blocked: torch.Tensor) -> str | None:
    b = blocked.cpu()
    if not bool(b.any()):
        return None
    t_q, t_k = b.shape[-2], b.shape[-1]
    causal = _causal(t_q, t_k)
    if bool((b == causal).all()):
        return "causal"
    if t_q == 1 or bool((b == b[..., :1, :]).all()):
        return "padding"
    padding = b.all(dim=-2, keepdim=True)
    if bool((b == (causal | padding)).all()):
        return "causal+padding"
    allowed = ~b
    counts = allowed.sum(dim=-1)
    positions = torch.arange(t_k)
    lo = torch.where(allowed, positions, t_k).amin(dim=-1)
    hi = torch.where(allowed, positions, -1).amax(dim=-1)
    live = counts > 0
    if bool(live.any()) and bool((counts[live] == (hi - lo + 1)[live]).all()) and int(counts.max()) < t_k:
        return "window"
    return "other"


def mask_kind(blocked: torch.Tensor | None) -> Deferred | None:
    """The name of what ``blocked`` removes, decided when the records are resolved."""
    if blocked is None:
        return None
    kept = blocked.detach()
    return Deferred(lambda: _name_mask(kept))


def _name_bias(bias: torch.Tensor, blocked: torch.Tensor | None) -> str | None:
    f = bias.detach().double().cpu()
    live = torch.ones(f.shape, dtype=torch.bool) if blocked is None else ~blocked.cpu()
    live, f = torch.broadcast_tensors(live, f)
    if not bool((f.masked_fill(~live, 0.0) != 0).any()):
        return None
    tol = 1e-5 * max(1.0, float(f.abs().max()))
    if f.shape[-1] > 1:
        step = f[..., 1:] - f[..., :-1]
        both = live[..., 1:] & live[..., :-1]
        first = torch.where(both, step, torch.nan).nanmean(dim=-1, keepdim=True).nan_to_num(0.0)
        linear = ((step - first).abs() <= tol) | ~both
        if bool(linear.all()) and bool((first.abs() > tol).any()):
            return "alibi_like"
    if f.shape[-2] > 1 and f.shape[-1] > 1:
        diag = (f[..., 1:, 1:] - f[..., :-1, :-1]).abs() <= tol
        both = live[..., 1:, 1:] & live[..., :-1, :-1]
        if bool((diag | ~both).all()):
            return "relative_position"
    return "additive"


def bias_kind(bias: torch.Tensor | None, blocked: torch.Tensor | None) -> Deferred | None:
    """The name of the finite bias added to the scores, decided when the records are resolved."""
    if bias is None:
        return None
    kept, kept_blocked = bias.detach(), None if blocked is None else blocked.detach()
    return Deferred(lambda: _name_bias(kept, kept_blocked))


# -- the numbers the scores were scaled by ----------------------------------------------------


def scale_and_cap(steps: tuple[tuple[str, Any], ...]) -> tuple[Any, Any]:
    """The scale applied to QKᵀ and the soft-cap (``c · tanh(s / c)``), as numbers or 0-dim tensors."""
    cap = None
    factors = list(steps)
    tanh = next((i for i, (kind, _) in enumerate(factors) if kind == "tanh"), None)
    if tanh is not None:
        after = factors[tanh + 1] if tanh + 1 < len(factors) else None
        cap = after[1] if after is not None and after[0] == "mul" else None
        drop = {tanh, tanh + 1} if cap is not None else {tanh}
        if cap is not None and tanh > 0 and factors[tanh - 1][0] == "div":
            drop.add(tanh - 1)
        factors = [f for i, f in enumerate(factors) if i not in drop and i < tanh]
    scale: Any = 1.0
    for kind, value in factors:
        if kind == "tanh":
            continue
        scale = scale / value if kind == "div" else scale * value
    if isinstance(scale, torch.Tensor):
        scale = scale.detach().float()
    if isinstance(cap, torch.Tensor):
        cap = cap.detach().float()
    return scale, cap


def same_steps(a: tuple[tuple[str, Any], ...], b: tuple[tuple[str, Any], ...]) -> bool:
    """The same factors in the same order: numbers equal, tensors the very same (no value is read)."""
    def same(x: Any, y: Any) -> bool:
        return x is y or (isinstance(x, (int, float)) and isinstance(y, (int, float)) and x == y)

    return len(a) == len(b) and all(k == j and same(x, y) for (k, x), (j, y) in zip(a, b, strict=True))
