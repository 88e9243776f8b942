"""Attention blocks with the classic mistakes of docs/tutorial.md#common-mistakes, for `qkvtrace check`.

Each model: token ids (B, T) -> embeddings -> one hand-written multi-head
attention -> (B, T, D). ``key_padding_mask`` follows PyTorch's convention
(True = padding) unless the mistake is to invert it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MISTAKES = (
    "correct",
    "reversed_causal",
    "off_by_one",
    "inverted_padding",
    "softmax_wrong_dim",
    "sqrt_d_model",
    "wrong_view",
)


class MistakeLM(nn.Module):
    def __init__(self, mistake: str, causal: bool = True, vocab: int = 50, d_model: int = 32, heads: int = 4) -> None:
        super().__init__()
        assert mistake in MISTAKES, mistake
        self.mistake, self.causal, self.heads, self.d = mistake, causal, heads, d_model
        self.emb = nn.Embedding(vocab, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, ids: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, dh).permute(2, 0, 3, 1, 4)  # [B,H,T,Dh] each
        scale = math.sqrt(d) if self.mistake == "sqrt_d_model" else math.sqrt(dh)
        scores = q @ k.transpose(-2, -1) / scale  # [B,H,T,T]
        allowed = torch.ones(t, t, dtype=torch.bool).tril() if self.causal else torch.ones(t, t, dtype=torch.bool)
        if self.mistake == "reversed_causal":
            allowed = torch.ones(t, t, dtype=torch.bool).triu()
        elif self.mistake == "off_by_one":
            allowed = torch.ones(t, t, dtype=torch.bool).tril(1)  # also sees the next token
        scores = scores.masked_fill(~allowed, float("-inf"))
        if key_padding_mask is not None:
            pad = ~key_padding_mask if self.mistake == "inverted_padding" else key_padding_mask
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-2 if self.mistake == "softmax_wrong_dim" else -1)
        weights = torch.nan_to_num(weights)  # a fully padded row would be NaN
        ctx = weights @ v  # [B,H,T,Dh]
        if self.mistake == "wrong_view":
            ctx = ctx.reshape(b, t, d)  # heads and tokens mixed: no transpose back
        else:
            ctx = ctx.transpose(1, 2).reshape(b, t, d)
        return self.out(ctx)


def build(mistake: str, causal: bool = True) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return MistakeLM(mistake, causal), (torch.randint(0, 50, (2, 8)),)


def build_reversed() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return build("reversed_causal")
