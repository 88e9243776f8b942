"""Attention health over a long run: logit growth, entropy collapse and Q/K/V slice norms, every N steps.

What people who train transformers watch attention for is whether it is
going wrong: the largest pre-softmax logit growing without bound (Dehghani
et al. 2023; Wortsman et al. 2023), attention entropy collapsing (Zhai et al.
2023), a Q or K slice whose weight or gradient norm runs away. They need Q
and K, which a trace sees at every call, and the slices, which it derives.

With ``qkvtrace.trace(model, keep="changes", health_every=N)``, on every N-th
step (``t.step()`` counts them; step 0 is one) the first call of each
attention module is measured on the call's own device, after the call ran,
from what it received (the *score inputs* of :mod:`qkvtrace.facts.maps`: its Q and
K -- projected again for ``nn.MultiheadAttention`` and the fused encoder
layer --, the masks as PyTorch canonicalised them, ``is_causal``, the scale):

* ``max_logit`` per head: the largest ``scale·q·kᵀ + bias`` over the
  positions the masks and the causal triangle leave open;
* ``entropy_mean`` per head: the mean over query rows that see at least one
  key of ``-Σ p log p`` (nats) of the row's softmax;
* ``entropy_min`` per head: the least over the rows that see at least two keys;
* per module, the Q/K/V slice weight norms of the call, and after the step's
  backward the slice gradient norms (read by a hook that runs when each
  parameter's ``.grad`` is accumulated, so ``zero_grad()`` before
  ``t.step()`` does not hide them).

Scores are made a block of query rows at a time, so memory stays
``O(T·block)``, never the full ``[T, T]`` map. Nothing is read on the host
during the step: the numbers stay 0-dim device tensors until ``t.step()``.
Attention written by hand gives its entropies from the probabilities the
model computed itself, and its max logit from logits rebuilt from its Q, K,
scale, soft-cap and bias -- kept only when their softmax is the model's own
probabilities (the order the model applied them in is not recorded), else
``None`` with the reason.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qkvtrace.base import compat, lazy
from qkvtrace.facts.maps import ScoreInputs
from qkvtrace.facts.patterns import BLOCKING
from qkvtrace.facts.slices import Projection, grad_slices, param_of
from qkvtrace.records import VIEWS, AttentionCall
from qkvtrace.records.health_alerts import (
    ENTROPY_ALERT,
    ENTROPY_DROP,
    LOGIT_ALERT,
    LOGIT_GROWTH,
    alert,
    series_of,
)

__all__ = [
    "ENTROPY_ALERT",
    "ENTROPY_DROP",
    "LOGIT_ALERT",
    "LOGIT_GROWTH",
    "HeadHealth",
    "Health",
    "HealthRecord",
    "HealthRecords",
    "alert",
    "hand_written_inputs",
    "measure",
]


#: floats of one block of scores ``[B, H, rows, S]`` (16 MB in float32)
_BLOCK_FLOATS = 1 << 22

_PARTS = ("q", "k", "v")


@dataclass
class HeadHealth:
    """One head of one module at one step."""

    head: int
    #: the largest ``scale·q·kᵀ`` (+ additive mask or bias) over open positions; ``None`` when not computed
    max_logit: float | None
    #: mean attention entropy (nats) over query rows that see at least one key
    entropy_mean: float | None
    #: least attention entropy (nats) over query rows that see at least two keys (``None``: no such row)
    entropy_min: float | None


@dataclass
class HealthRecord:
    """The health of one module's first call of a step: per head, and its Q/K/V slice norms."""

    step: int
    module: str
    #: the call's index in the trace, and its path
    call: int
    path: str
    heads: list[HeadHealth]
    #: ``{"q": ..., "k": ..., "v": ...}``: slice weight norms of the call (``None`` where the slice is not known)
    weight_norms: dict[str, float | None]
    #: slice gradient norms after the step's backward (``None`` where there was no backward or no slice)
    grad_norms: dict[str, float | None]
    #: why something is missing (``None`` when every value is there)
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "module": self.module, "call": self.call, "path": self.path,
            "heads": [asdict(h) for h in self.heads],
            "weight_norms": dict(self.weight_norms), "grad_norms": dict(self.grad_norms), "reason": self.reason,
        }  # fmt: skip


class HealthRecords(list[HealthRecord]):
    """``t.health``: the records; a notebook shows them as small per-module curves
    (:mod:`qkvtrace.render.health_render`)."""

    def _repr_html_(self) -> str:
        return VIEWS["health"]([r.to_dict() for r in self])

    @property
    def alerts(self) -> list[dict[str, str]]:
        """Per module whose series crossed a threshold (:func:`alert`, the rule ``qkvtrace summarize`` applies to
        the stream), ``{"module": ..., "alert": ...}``: what crossed, at which step, against what; modules in the
        order of their first record."""
        series = series_of([r.to_dict() for r in self])
        found = ((module, alert(points)) for module, points in series.items())
        return [{"module": module, "alert": text} for module, text in found if text is not None]


# -- the one computation ---------------------------------------------------------------------


def measure(inputs: ScoreInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """Per head ``(max_logit, entropy_mean, entropy_min)``, three ``[H]`` float32 tensors on the call's device.

    Scores are made ``rows`` query rows at a time (``B·H·rows·S`` floats at
    most ``_BLOCK_FLOATS``); NaN where a head has no open row, ``inf`` in
    ``entropy_min`` where no row sees two keys.
    """
    q, k = inputs.q, inputs.k
    b, h, length, _ = q.shape
    s, hk = k.shape[-2], k.shape[1]
    if h % hk:
        return f"not computed: {h} query heads cannot share {hk} key heads"
    with torch.no_grad():
        kf = k.float()
        if h != hk:  # grouped-query attention: key head h // group serves query head h
            kf = kf.repeat_interleave(h // hk, dim=1)
        kt = kf.transpose(-2, -1)  # [B, H, d, S]
        rows = max(1, min(length, _BLOCK_FLOATS // max(1, b * h * s)))
        device = q.device
        top = torch.full((h,), float("-inf"), device=device)
        total = torch.zeros(h, device=device)
        seen = torch.zeros(h, device=device)
        least = torch.full((h,), float("inf"), device=device)
        keys = torch.arange(s, device=device)
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            scores = torch.matmul(q[:, :, start:stop].float() * inputs.scale, kt)  # [B, H, r, S]
            if inputs.cap is not None:
                scores.div_(inputs.cap).tanh_().mul_(inputs.cap)
            block = None
            if inputs.additive is not None:
                bias = _rows(inputs.additive, start, stop).float()
                scores.add_(bias)
                block = bias <= BLOCKING  # -inf, or a large negative number standing for it
            if inputs.blocked is not None:
                removed = _rows(inputs.blocked, start, stop)
                block = removed if block is None else block | removed
            if inputs.causal:  # top-left aligned, as SDPA's is_causal
                upper = keys[None, :] > torch.arange(start, stop, device=device)[:, None]  # [r, S]
                block = upper if block is None else block | upper
            if block is not None:
                scores.masked_fill_(block, float("-inf"))
            row_top = scores.amax(dim=-1, keepdim=True)  # [B, H, r, 1]; -inf on a row that sees no key
            top = torch.maximum(top, row_top.amax(dim=(0, 2, 3)))
            # entropy = log z - Σ e·(s - m) / z with e = exp(s - m), z = Σ e: each pass in place on the block
            scores.sub_(torch.nan_to_num(row_top, nan=0.0, neginf=0.0, posinf=0.0))
            weights = scores.exp()  # 0 where a key is removed
            if block is not None:
                scores.masked_fill_(block, 0.0)  # e·(s - m) is 0 there, not 0·-inf
            z = weights.sum(-1)  # [B, H, r]
            entropy = z.log() - weights.mul_(scores).sum(-1) / z  # NaN on a row that sees no key
            rows_here = (b, h, stop - start)
            n_open = torch.full(rows_here, s, device=device) if block is None else (~block).sum(-1).expand(rows_here)
            some, two = n_open >= 1, n_open >= 2
            total += torch.where(some, entropy, 0.0).sum(dim=(0, 2))
            seen += some.sum(dim=(0, 2))
            least = torch.minimum(least, torch.where(two, entropy, float("inf")).amin(dim=(0, 2)))
        return top, total / seen, least


def _rows(mask: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Query rows ``[start, stop)`` of a mask broadcastable to ``[B, H, L, S]`` (a view, no copy)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask if mask.shape[-2] == 1 else mask[:, :, start:stop]


def measure_probs(probs: torch.Tensor, blocked: torch.Tensor | None,
                  heads: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:  # fmt: skip
    """``(NaN, entropy_mean, entropy_min)`` per head from probabilities a model computed itself."""
    with torch.no_grad():
        p = probs.detach().float()
        if p.dim() == 3 and heads and p.shape[0] % heads == 0:
            p = p.view(p.shape[0] // heads, heads, *p.shape[1:])
            if blocked is not None and blocked.dim() == 3 and blocked.shape[0] == probs.shape[0]:
                blocked = blocked.view(p.shape[0], heads, *blocked.shape[1:])
        while p.dim() < 4:
            p = p.unsqueeze(0)
        if p.dim() > 4:
            return f"not computed: probabilities of {p.dim()} dims"
        h = p.shape[1]
        if blocked is None:
            open_ = torch.ones_like(p, dtype=torch.bool)
        else:
            b4 = blocked
            while b4.dim() < 4:
                b4 = b4.unsqueeze(0)
            open_ = ~b4.expand(p.shape)
        entropy = -torch.where(p > 0, p * p.clamp_min(1e-45).log(), 0.0).sum(-1)
        n_open = open_.sum(-1)
        some, two = n_open >= 1, n_open >= 2
        mean = torch.where(some, entropy, 0.0).sum(dim=(0, 2)) / some.sum(dim=(0, 2))
        least = torch.where(two, entropy, float("inf")).amin(dim=(0, 2))
        return torch.full((h,), float("nan"), device=p.device), mean, least


def _probs_gap(inputs: ScoreInputs, probs: torch.Tensor, heads: int | None) -> torch.Tensor:
    """Largest difference between the softmax of the rebuilt logits and the model's probabilities (0-dim)."""
    with torch.no_grad():
        p = probs.detach().float()
        if p.dim() == 3 and heads and p.shape[0] % heads == 0:
            p = p.view(p.shape[0] // heads, heads, *p.shape[1:])
        scores = torch.matmul(inputs.q.float() * inputs.scale, inputs.k.float().transpose(-2, -1))
        if inputs.k.shape[1] != inputs.q.shape[1]:
            return torch.tensor(float("nan"), device=p.device)
        if inputs.cap is not None:
            scores = torch.tanh(scores / inputs.cap) * inputs.cap
        if inputs.additive is not None:
            scores = scores + inputs.additive.float()
        if inputs.blocked is not None:
            scores = scores.masked_fill(inputs.blocked, float("-inf"))
        return (torch.softmax(scores, dim=-1).nan_to_num(0.0) - p).abs().amax()


#: the softmax of rebuilt logits may differ from the model's probabilities by rounding only
_PROBS_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
_REBUILT = (
    "max_logit not computed for attention written by hand: the logits rebuilt from its Q, K, scale, "
    "soft-cap and bias (in that order) do not give its probabilities (largest difference {gap:.2g})"
)


# -- a trace's health ---------------------------------------------------------------------------


@dataclass
class _Pending:
    step: int
    module: str
    call: int
    path: str
    values: Any  # (max_logit, entropy_mean, entropy_min) tensors, or None
    weight_norms: dict[str, Any]
    grad_norms: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    #: how far a hand-written attention's rebuilt softmax may be from its own probabilities
    tolerance: float = 1e-2


_HAND_WRITTEN_LOGITS = ("max_logit not computed for attention written by hand: its Q and K could not be paired "
                        "with its heads")  # fmt: skip


def hand_written_inputs(q: torch.Tensor, k: torch.Tensor, transposed: bool, heads: int | None, scale: Any,
                        cap: Any, bias: Any, blocked: Any) -> ScoreInputs | None:  # fmt: skip
    """The score inputs of attention written by hand (``[B·H, T, d]`` unfolded by ``heads``), or ``None``."""

    def unfold(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            return t
        if heads and t.shape[0] % heads == 0:
            return t.view(t.shape[0] // heads, heads, *t.shape[1:])
        if t.shape[0] == 1:
            return t.unsqueeze(0)
        raise ValueError("heads not known")

    try:
        q4, k4, bias4, blocked4 = map(unfold, (q, k.transpose(-2, -1) if transposed else k, bias, blocked))
    except (ValueError, RuntimeError):  # heads not known, or a layout that does not unfold: no max logit
        return None
    if q4.dim() != 4 or k4.dim() != 4:
        return None
    return ScoreInputs(q4.detach(), k4.detach(), bias4, blocked4, False, scale, cap)


class Health:
    """The health measurements of one trace: due, taken, resolved at the step's end."""

    def __init__(self, every: int, *, max_records: int = 100_000) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"health_every must be None or an int >= 0, got {every!r}")
        self.every = every
        self.max_records = max_records
        self.records: list[HealthRecord] = []
        self.dropped_records = 0
        self._active = every > 0  # step 0 is measured
        self._done: set[str] = set()
        self._pending: list[_Pending] = []
        self._handles: list[Any] = []

    def due(self, module: str) -> bool:
        """This step is measured and ``module`` has not been yet (cheap: asked on every call)."""
        return self._active and module not in self._done

    def take(self, call: AttentionCall, projection: Projection | str, source: Any, step: int) -> None:
        """Measure ``call`` from ``source`` (a score source of :mod:`qkvtrace.facts.maps`, or the probabilities of
        attention written by hand) on its device; hook its slices' gradients for the step's backward."""
        self._done.add(call.module)
        qkv = call.qkv
        weights = {p: getattr(getattr(qkv, p, None), "weight_norm", None) for p in _PARTS}
        entry = _Pending(step, call.module, call.index, call.path, None, weights)
        self._pending.append(entry)
        try:
            values, entry.reason = self._values(call, source)
            entry.values = None if values is None else list(values)  # a list: resolved in place at the step's end
            if hasattr(source, "probs"):
                entry.tolerance = _PROBS_TOLERANCE.get(source.probs.dtype, 1e-2)
        except Exception as exc:  # the user's run goes on whatever happens here
            entry.reason = f"not computed: {type(exc).__name__}: {exc}"
        if isinstance(projection, Projection):
            self._watch_grads(projection, entry)
        elif entry.reason is None:
            entry.reason = f"slice norms not known: {projection}"

    @staticmethod
    def _values(call: AttentionCall, source: Any) -> tuple[Any, str | None]:
        if call.error is not None:
            return None, "not computed: the call raised"
        if source is None:
            if call.path == "flex":
                return None, "not computed: flex attention's score_mod and block_mask are the user's functions"
            return None, f"not computed: no score inputs for a {call.path!r} call"
        if isinstance(source, str):
            return None, source
        if hasattr(source, "probs"):  # attention written by hand: entropies from the model's own probabilities
            found = measure_probs(source.probs, source.blocked, source.heads)
            if isinstance(found, str):
                return None, found
            logits: ScoreInputs | None = getattr(source, "logits", None)
            if logits is None:
                return found, _HAND_WRITTEN_LOGITS
            top = measure(logits)
            if isinstance(top, str):
                return found, top
            # the logits are rebuilt from Q, K, scale, soft-cap and bias, whose order the model chose: they count
            # only if their softmax is the model's own probabilities (checked when the step ends)
            return (top[0], found[1], found[2], _probs_gap(logits, source.probs, source.heads)), None
        inputs = source.scores()
        if isinstance(inputs, str):
            return None, inputs
        found = measure(inputs)
        return (None, found) if isinstance(found, str) else (found, None)

    def _watch_grads(self, projection: Projection, entry: _Pending) -> None:
        """Slice gradient norms after each accumulation into ``.grad`` (the last one of the step stays)."""
        if not compat.post_accumulate_grad_hooks():
            return
        module, spec = projection.holder, projection.spec
        names = {n for _, ps in spec.parts() for p in ps.pieces() for n in (p.param,) if n}
        found = [param_of(module, n) for n in sorted(names)]
        params = [p for p in found if isinstance(p, torch.nn.Parameter) and p.requires_grad]

        def read(_: torch.Tensor) -> None:
            with torch.no_grad():
                parts = grad_slices(projection, {})
            entry.grad_norms = {p: parts[p].grad_norm for p in _PARTS}

        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(read))

    def arm(self, step: int) -> None:
        """Step ``step`` begins: it is measured when it is a multiple of ``every``."""
        self._done.clear()
        self._active = self.every > 0 and step % self.every == 0

    def end_step(self) -> list[HealthRecord]:
        """The step's records, resolved (the host reads happen here, after the step's backward)."""
        self.unhook()
        pending, self._pending = self._pending, []
        self._active = False
        if not pending:
            return []
        lazy.resolve([pending])
        made = [_record(p) for p in pending]
        room = max(0, self.max_records - len(self.records))
        self.records.extend(made[:room])
        self.dropped_records += len(made) - min(room, len(made))
        return made

    def unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _record(p: _Pending) -> HealthRecord:
    heads: list[HeadHealth] = []
    reason = p.reason
    if p.values is not None and len(p.values) == 4:  # attention written by hand: rebuilt logits, checked
        top, mean, least, gap = p.values
        if not (isinstance(gap, float) and gap <= p.tolerance):
            top, reason = [None] * len(mean), _REBUILT.format(gap=gap)
        p.values = [top, mean, least]
    if p.values is not None:
        top, mean, least = p.values
        per_head = zip(top, mean, least, strict=True)
        heads = [HeadHealth(i, _number(a), _number(b), _number(c)) for i, (a, b, c) in enumerate(per_head)]
    grads = {k: _number(p.grad_norms.get(k)) for k in _PARTS}
    if not p.grad_norms and reason is None:
        reason = "no gradient norms: no backward reached the slices in this step"
    return HealthRecord(p.step, p.module, p.call, p.path, heads, {k: _number(v) for k, v in p.weight_norms.items()},
                        grads, reason)  # fmt: skip
