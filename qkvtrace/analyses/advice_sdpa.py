"""Attention written by hand, and ``F.scaled_dot_product_attention`` in its place: measured on its shapes.

A hand-written attention is code in the model, so no change can be made to
a copy of the model; what can be measured is the same computation both
ways on tensors of the call's recorded shapes, dtype and device: the form
the trace recorded (matmul, scale, causal mask, softmax in the recorded
dtype, matmul) against SDPA with the same scale and ``is_causal``. The
kernel SDPA picks for them is read by tracing that SDPA call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Pair", "sdpa_in_place_of"]

#: the computation as written, the computation with SDPA, and the kernel SDPA ran (traced), for one unit each
Pair = tuple[Callable[[], Any], Callable[[], Any], Callable[[], tuple[str | None, str | None]]]


def sdpa_in_place_of(call: Any, train: bool) -> tuple[Callable[[], Pair] | None, str]:
    """How to measure SDPA in place of hand-written ``call`` (a maker of the pair) and the SDPA call as it would
    be written, or ``None`` and why it cannot be."""
    a = call.inputs
    if a.get("softcap"):
        return None, "soft-capped logits: SDPA has no soft-capping (FlexAttention's score_mod can say it)"
    if a.get("bias") is not None:
        return None, ("an additive bias: SDPA takes it as attn_mask=bias, which qkvtrace cannot measure without the "
                      "bias itself (it keeps no tensor)")  # fmt: skip
    mask = a.get("attn_mask")
    causal = isinstance(mask, dict) and mask.get("pattern") == "causal"
    if mask is not None and not causal:
        kind = (mask.get("pattern") or mask.get("kind")) if isinstance(mask, dict) else "a"
        return None, f"a {kind} mask: SDPA takes it as attn_mask, not measured here (qkvtrace keeps no tensor)"
    shapes = [a.get(f"{p}_shape") for p in ("query", "key", "value")]
    if any(s is None or len(s) != 4 for s in shapes):
        return None, "not [B, H, T, d] tensors (heads folded into the batch, or unknown shapes)"
    dtype = getattr(torch, str(a.get("dtype", "torch.float32")).removeprefix("torch."), torch.float32)
    softmax_dtype = getattr(torch, str(a.get("softmax_dtype") or a.get("dtype")).removeprefix("torch."), dtype)
    scale = float(a.get("scale") or 1.0)
    device = torch.device(a.get("device") or "cpu")

    def make() -> Pair:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes)
        if train:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        blocked = torch.ones(shapes[0][2], shapes[1][2], dtype=torch.bool, device=device).triu(1) if causal else None

        def written() -> Any:
            scores = (q @ k.transpose(-2, -1)) * scale
            if blocked is not None:
                scores = scores.masked_fill(blocked, float("-inf"))
            return _unit(torch.softmax(scores.to(softmax_dtype), dim=-1).to(v.dtype) @ v, (q, k, v), train)

        def sdpa() -> Any:
            return _unit(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), (q, k, v), train)

        def kernel() -> tuple[str | None, str | None]:
            from qkvtrace.tracer import trace

            wrapper = _SDPA(causal, scale)
            with trace(wrapper, gradients=False, routes=False) as t:
                wrapper(q.detach(), k.detach(), v.detach())
            return (t.calls[0].path, t.calls[0].sdpa_backend) if t.calls else (None, None)

        return written, sdpa, kernel

    return make, f"F.scaled_dot_product_attention(q, k, v{', is_causal=True' if causal else ''}, scale={scale:.4g})"


def _unit(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], train: bool) -> tuple[list[torch.Tensor], list[Any]]:
    if not train:
        return [out.detach()], []
    grads = torch.autograd.grad(out.float().sum(), inputs)
    return [out.detach()], list(grads)


class _SDPA(nn.Module):
    def __init__(self, causal: bool, scale: float) -> None:
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)


def forward_site(model: nn.Module, name: str) -> str | None:
    """``file:line`` of the forward of module ``name``, where the hand-written attention is."""
    try:
        forward = type(model.get_submodule(name)).forward
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (AttributeError, OSError, TypeError):
        return None
