"""A user's module that binds SDPA to a global name of its own.

``from torch.nn.functional import scaled_dot_product_attention`` makes a
module-level global that patching ``F.scaled_dot_product_attention`` alone
would not reach; the tracer must find it, and put it back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention


class BoundSDPAAttention(nn.Module):
    def __init__(self, embed_dim: int = 32, num_heads: int = 4, fail_after_attention: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.fail_after_attention = fail_after_attention
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        b, length, e = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, length, self.num_heads, e // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        if self.fail_after_attention:
            raise KeyError("bound-sdpa model failed after its attention")
        return self.out(y.transpose(1, 2).reshape(b, length, e))
