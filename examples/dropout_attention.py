"""A small attention block that uses dropout while training (for ``qkvtrace trace examples/dropout_attention.py:build``)."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 16, 64),)
