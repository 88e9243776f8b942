"""A small model for the HTML tests: one MultiheadAttention and one SDPA call, with known names and inputs.

``mha`` runs in training mode (PyTorch's fallback path, with its reason) and
``attend`` calls ``F.scaled_dot_product_attention`` with ``is_causal=True``
on Q, K, V it projects itself; ``attend`` keeps the Q, K and V it made, so a
test can compute the attention weights and gradients on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, TOKENS, BATCH = 16, 2, 6, 2
WORDS = ["the", "cat", "sat", "on", "a", "mat"]


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.kept: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        self.kept = (q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, WIDTH)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.attend = Attend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.mha(x, x, x, need_weights=False)
        return self.attend(y)


def build() -> tuple[Mixed, torch.Tensor]:
    torch.manual_seed(0)
    return Mixed().train(), torch.randn(BATCH, TOKENS, WIDTH)


def causal_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) with the causal triangle removed, written out here."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    upper = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return scores.masked_fill(upper, float("-inf")).softmax(-1)
