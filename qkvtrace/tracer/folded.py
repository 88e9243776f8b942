"""Heads folded into the batch dimension: how many, read from the dataflow of a ``[B·H, T, d]`` tensor.

Attention written by hand with ``bmm`` or ``baddbmm`` needs 3-dim operands, so
it folds the heads into the batch dimension: ``q.reshape(B * H, T, d)`` of a
``[B, H, T, d]`` tensor. The shape ``[B·H, T, d]`` alone does not say where
B ends and H begins; what made the tensor does:

* the reshape itself, seen by the hand-written attention's mode while the
  module runs (:mod:`qkvtrace.tracer.observers.handwritten` keeps it, under
  ``no_grad`` and ``inference_mode`` too);
* view metadata: the tensor is a view of a ``[B, H, T, d]`` tensor (``t._base``);
* the autograd graph: a view or reshape node on the way back from the tensor
  saved the ``[B, H, T, d]`` sizes it was made from (``_saved_self_sym_sizes``),
  through moves and scalings only.

A ``[a, h, T, d]`` shape folded into ``[a·h, T, d]`` (or ``[a·h, d, T]``, K
transposed) says ``h`` heads. Reading sizes and graph nodes reads no values. :class:`ProbsSource`
unfolds a hand-written attention's own probabilities with the number found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qkvtrace.facts import maps

__all__ = ["ProbsSource", "heads_in", "module_heads", "split_heads"]

#: autograd nodes walked back through: moves and scalings keep the folded layout
_WALK = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TransposeBackward0",
                   "TransposeBackward1", "CloneBackward0", "MulBackward0", "MulBackward1", "DivBackward0",
                   "DivBackward1", "ToCopyBackward0", "AliasBackward0"})  # fmt: skip
_STEPS = 8


def split_heads(before: Sequence[int], after: Sequence[int]) -> int | None:
    """The heads of ``before`` (``[a, h, x, y]``) folded into ``after`` (``[a·h, x, y]`` or ``[a·h, y, x]``)."""
    if len(before) != 4 or len(after) != 3:
        return None
    a, h, x, y = (int(n) for n in before)
    if a * h != int(after[0]) or (x, y) not in ((int(after[1]), int(after[2])), (int(after[2]), int(after[1]))):
        return None
    return h


def _from_graph(t: torch.Tensor) -> int | None:
    node: Any = t.grad_fn
    for _ in range(_STEPS):
        if node is None or type(node).__name__ not in _WALK:
            return None
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        if sizes is not None:
            heads = split_heads(tuple(sizes), t.shape)
            if heads is not None:
                return heads
        node = node.next_functions[0][0] if node.next_functions else None
    return None


def heads_in(tensors: Sequence[Any]) -> tuple[int | None, str | None]:
    """The heads folded into dimension 0 of the first of ``tensors`` whose history shows it, and how it shows."""
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            continue
        base = t._base
        if base is not None:
            heads = split_heads(base.shape, t.shape)
            if heads is not None:
                return heads, f"view metadata: a view of a {list(base.shape)} tensor"
        heads = _from_graph(t)
        if heads is not None:
            return heads, "autograd graph: a reshape of a [B, H, T, d] tensor"
    return None, None


@dataclass
class ProbsSource:
    """The probabilities the model computed itself: its map is them, not a recomputation."""

    probs: torch.Tensor
    blocked: torch.Tensor | None
    dropout_p: float
    #: the heads folded into ``[B*H, T, T]`` probabilities (to unfold them), and where that number comes from
    heads: int | None
    heads_evidence: str | None = None
    #: the scores' inputs (Q, K, scale, soft-cap, bias), for the max logit of attention health
    logits: Any = None

    def compute(self, budget: maps.MapBudget, name: str) -> maps.MapResult:
        p, blocked = self.probs.detach(), self.blocked
        if p.dim() == 3 and self.heads and p.shape[0] % self.heads == 0:
            p = p.view(p.shape[0] // self.heads, self.heads, *p.shape[1:])
            if blocked is not None and blocked.dim() == 3 and blocked.shape[0] == self.probs.shape[0]:
                blocked = blocked.view(p.shape[0], self.heads, *blocked.shape[1:])
        unfolded = p.dim() == 4 and self.probs.dim() == 3
        while p.dim() < 4:
            p = p.unsqueeze(0)
        if p.dim() > 4:
            return maps.MapResult(reason=f"not computed: probabilities of {p.dim()} dims (maps are [B, H, T, T])")
        result = maps.from_weights(p, blocked, budget, self.dropout_p)
        if self.probs.dim() == 3 and result.weights is not None:
            result.notes.append(f"[B·H, T, T] unfolded into {self.heads} heads ({self.heads_evidence})" if unfolded
                                else "heads folded into the batch: the split was not shown, [1, B·H, T, T]")
        return result


def module_heads(module: nn.Module) -> int | None:
    """The module's own count of heads, where it keeps one under a usual name."""
    for attr in ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
