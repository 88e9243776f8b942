"""One forward and backward pass, and how the loss reached each attention call's W_Q, W_K and W_V.

The tutorial's one-sentence case (docs/tutorial.md#one-sentence-end-to-end) in measurements: the
gradient leaves the loss, enters
``context = attention @ V`` and splits -- straight into V, and through the
softmax and the scores into Q and K -- and each route ends in its slice of
the projection weight. :func:`measure` runs the model once under
:func:`qkvtrace.trace` (which records each call's backward kernel, the
gradients reaching its Q, K and V, and the slice gradients), and adds the
attention written by hand (a softmax of QKᵀ in a module of the model's
own), which the tracer records as calls of path ``hand_written``.

Every number comes from this pass: norms of PyTorch's own gradients, read
by hooks that only read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkvtrace.records import VIEWS, AttentionCall, GradientRecord, TraceResult, atomic_write_text

PARTS_ORDER = ("q", "k", "v")

__all__ = [
    "GRADS_SCHEMA",
    "LOSS_TEXT",
    "GradsResult",
    "NoBackward",
    "Route",
    "SliceGradient",
    "make_loss",
    "measure",
    "probe_like",
    "routes_of",
]

GRADS_SCHEMA = "qkvtrace.grads/2"

#: what each kind of loss made by :func:`make_loss` is, in words
LOSS_TEXT = {
    "lm": "next-token cross-entropy",
    "probe": "<output, R>, R a fixed random N(0, 1) tensor of the output's shape",
}


class NoBackward(ValueError):
    """The model's output has no autograd graph: there is no backward pass to measure."""


@dataclass(slots=True)
class SliceGradient:
    """Where one of Q, K, V lives in the weights, and its gradient after the pass."""

    #: dotted parameter name in the model, e.g. ``layers.0.self_attn.in_proj_weight``
    param: str
    #: ``[start, stop)`` ranges of rows (columns for ``dim`` 1) the part is made of; ``None`` for a whole weight
    rows: list[list[int]] | None
    dim: int
    #: norm of that slice of the parameter's ``.grad`` after the pass
    grad_norm: float | None
    #: its share of the squared Q/K/V weight-gradient norm of the module
    share: float | None
    #: how ``rows`` are known (see :attr:`qkvtrace.records.SliceInfo.evidence`)
    evidence: str | None = None


@dataclass(slots=True)
class Route:
    """One attention call seen from the backward pass."""

    #: the call's index in the trace (``None`` only in files written before attention written by hand was traced)
    call: int | None
    module: str
    path: str
    backward_kernel: str | None
    #: why there is no route for this call (no graph, routes not readable)
    reason: str | None
    #: gradient reaching Q, K, V: ``{"norm", "per_head", "share"}`` each, or ``None``
    q: dict[str, Any] | None = None
    k: dict[str, Any] | None = None
    v: dict[str, Any] | None = None
    #: the Q, K and V slices of the projection weights and their gradients
    slices: dict[str, SliceGradient] = field(default_factory=dict)


@dataclass
class GradsResult:
    """What ``qkvtrace grads`` measured."""

    target: str
    torch_version: str
    #: how the loss was made (``lm``: next-token cross-entropy; ``probe``: ⟨output, R⟩ with a fixed random R;
    #: ``traced``: the backward pass of a trace, whose loss is the user's own and not measured, ``loss`` NaN)
    loss_kind: str
    loss: float
    routes: list[Route]
    #: the full trace of the pass (calls, slice gradients, routes), for readers who want more
    trace: TraceResult

    def drawable(self) -> list[Route]:
        return [r for r in self.routes if r.q is not None or r.k is not None or r.v is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": GRADS_SCHEMA,
            "target": self.target,
            "torch_version": self.torch_version,
            "loss": {"kind": self.loss_kind, "value": self.loss},
            "routes": [asdict(r) for r in self.routes],
        }

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def save_html(self, path: str | Path) -> Path:
        """One self-contained HTML page: the routes picture, each call's routes and slices, then the trace."""
        return VIEWS["save_grads_page"](self, path)

    def _repr_html_(self) -> str:
        return VIEWS["grads_html"](self)


def make_loss(model: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A loss whose gradient reaches every output position.

    A language model (integer token ids in, one score per vocabulary entry
    out) gets its own loss, next-token cross-entropy. Anything else gets
    ⟨output, R⟩ with R drawn from N(0, 1) by a generator set to 0, so every
    run backpropagates the same R: a plain ``sum`` would give a zero gradient
    through a final LayerNorm (each row of its output sums to its bias, a
    constant). :data:`LOSS_TEXT` says each kind in words.
    """
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if (ids is not None and not ids.is_floating_point() and ids.dim() == 2 and out.dim() == 3
            and vocab is not None and out.shape[-1] == vocab and ids.shape[1] > 1):  # fmt: skip
        logits = out[:, :-1].reshape(-1, out.shape[-1]).float()
        return "lm", nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
    return "probe", (out.float() * probe_like(out)).sum()


def probe_like(out: torch.Tensor) -> torch.Tensor:
    """R for ⟨output, R⟩: float32 N(0, 1) of ``out``'s shape from a generator set to 0, on ``out``'s device."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device, torch.float32)


def measure(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
            target: str = "model") -> GradsResult:  # fmt: skip
    """Run ``model(*args, **kwargs)`` forward and backward once, with gradients on, and measure the routes."""
    from qkvtrace.analyses.target import first_tensor
    from qkvtrace.tracer import trace

    kwargs = kwargs or {}
    with trace(model) as t, torch.enable_grad():
        out = first_tensor(model(*args, **kwargs))
        if out is None or out.grad_fn is None:
            raise NoBackward(
                "the output has no autograd graph (nothing in the model requires grad, or it ran without "
                "autograd): there is no backward pass to draw"
            )
        kind, loss = make_loss(model, args, out)
        loss.backward()
    result = t.result
    routes = [_route_of_call(call, result) for call in result.calls]
    return GradsResult(target, str(torch.__version__), kind, float(loss.detach()), routes, result)


def routes_of(result: TraceResult, *, target: str = "trace") -> GradsResult:
    """The routes of a trace's own backward pass (its last one per call), as ``qkvtrace grads`` sets them out."""
    routes = [_route_of_call(call, result) for call in result.calls]
    return GradsResult(target, result.torch_version, "traced", float("nan"), routes, result)


def _route_of_call(call: AttentionCall, result: TraceResult) -> Route:
    found = [r for r in result.routes if r.call == call.index]
    reason = call.backward_reason or call.route_reason
    if not found and reason is None:
        reason = "no gradient reached this call in the backward pass"
    route = Route(call.index, call.module, call.path, call.backward_kernel, reason)
    if found:
        for part in PARTS_ORDER:
            got = getattr(found[-1], part)
            setattr(route, part, asdict(got) if got is not None else None)
    holder = call.qkv.holder if call.qkv.holder is not None else call.module
    grads = [g for g in result.gradients if g.module == call.module]
    if call.qkv.layout is not None and grads:
        route.slices = _slices(call, holder, grads[-1])
    return route


def _slices(call: AttentionCall, holder: str, grad: GradientRecord) -> dict[str, SliceGradient]:
    out: dict[str, SliceGradient] = {}
    for part in PARTS_ORDER:
        info, g = getattr(call.qkv, part), getattr(grad, part)
        if info is None or info.param is None:
            continue
        name = f"{holder}.{info.param}" if holder else info.param
        out[part] = SliceGradient(name, info.rows, info.dim, g.grad_norm, g.pass_share, info.evidence)
    return out
