"""Refuse inputs whose attention would not fit, before anything is allocated (docs/tutorial.md#limits).

Standard attention materialises a ``[B, H, T, T]`` weight matrix per layer,
so memory grows with the square of the sequence length. ``guard`` estimates
it from the input's shape before the model runs and raises ``ValueError``
naming the limit. It wraps the model's ``forward`` on the instance, adding no
hook: a forward hook on an encoder layer would switch off its fused path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Budget", "attention_estimate", "check_budget", "guard"]

from qkvtrace.base.limits import DEFAULT_MAX_ATTENTION_MB, DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class Budget:
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    max_attention_mb: float | None = DEFAULT_MAX_ATTENTION_MB


def _heads(model: nn.Module) -> int:
    best = 1
    for m in model.modules():
        for attr in ("num_heads", "n_head", "n_heads", "heads", "nhead"):
            value = getattr(m, attr, None)
            if isinstance(value, int) and value > best:
                best = value
    return best


def _width_and_bytes(model: nn.Module) -> tuple[int, int]:
    width, size = 1, 4
    for p in model.parameters():
        if p.is_floating_point():
            size = p.element_size()
            break
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim, size
        if isinstance(m, nn.Embedding):
            width = max(width, m.embedding_dim)
        if isinstance(m, nn.Linear):
            width = max(width, m.in_features)
    return width, size


def _sequence_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_nested:
            return value
    return None


def attention_estimate(model: nn.Module, batch: int, length: int) -> dict[str, float]:
    """Tokens and MB for one layer: ``B·H·T²`` weights plus ``4·B·T·E`` for Q, K, V, output."""
    heads = _heads(model)
    width, size = _width_and_bytes(model)
    weights = batch * heads * length * length * size
    activations = 4 * batch * length * width * size
    return {
        "tokens": float(batch * length),
        "attention_mb": (weights + activations) / 2**20,
        "heads": float(heads),
        "bytes_per_element": float(size),
    }


def check_budget(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], budget: Budget,
                 seq_dim: int = 1) -> None:  # fmt: skip
    """Raise ``ValueError`` when the input's estimate is over ``budget``."""
    x = _sequence_input(args, kwargs)
    if x is None:
        return
    batch_dim = 1 - seq_dim if seq_dim in (0, 1) else 0
    length, batch = int(x.shape[seq_dim]), int(x.shape[batch_dim])
    est = attention_estimate(model, batch, length)
    if budget.max_tokens is not None and est["tokens"] > budget.max_tokens:
        raise ValueError(
            f"input of {batch}x{length} = {int(est['tokens'])} tokens is over max_tokens={budget.max_tokens}; "
            "shorten or split the sequence, lower the batch, or raise the limit"
        )
    if budget.max_attention_mb is not None and est["attention_mb"] > budget.max_attention_mb:
        raise ValueError(
            f"attention for a {batch}x{length} input needs about {est['attention_mb']:.0f} MB "
            f"(B·H·T²·bytes with H={int(est['heads'])}, plus Q/K/V/output), over "
            f"max_attention_mb={budget.max_attention_mb:g}; shorten the sequence or raise the limit"
        )


@contextlib.contextmanager
def guard(
    model: nn.Module,
    *,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_attention_mb: float | None = DEFAULT_MAX_ATTENTION_MB,
    seq_dim: int = 1,
) -> Iterator[nn.Module]:
    """Within the block, calls of ``model`` over budget raise ``ValueError`` before running.

    >>> with qkvtrace.guard(model, max_tokens=4096) as m:   # doctest: +SKIP
    ...     m(token_ids)
    """
    budget = Budget(max_tokens, max_attention_mb)
    had_own = "forward" in model.__dict__
    own = model.__dict__.get("forward")

    def forward(*args: Any, **kwargs: Any) -> Any:
        check_budget(model, args, kwargs, budget, seq_dim)
        # looked up per call, so a class-level wrapper (a trace) still applies
        inner: Any = own if had_own else type(model).forward.__get__(model)
        return inner(*args, **kwargs)

    model.__dict__["forward"] = forward
    try:
        yield model
    finally:
        if had_own:
            model.__dict__["forward"] = own
        else:
            del model.__dict__["forward"]
