"""Shared helpers for the tracer tests: a user's own SDPA module, seeding."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn


class PackedSelfAttention(nn.Module):
    """A user's own attention: one packed ``Linear(E, 3E)``, then ``F.scaled_dot_product_attention``.

    SDPA is looked up on ``F`` at call time, the way most user code calls it.
    """

    def __init__(self, embed_dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        b, length, e = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, length, self.num_heads, e // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.out(y.transpose(1, 2).reshape(b, length, e))


@pytest.fixture
def packed_attention_cls() -> type[PackedSelfAttention]:
    return PackedSelfAttention


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same seed; one thread keeps CPU kernels deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_compiled_code_from_earlier_tests():
    """Each test starts with Dynamo holding no compiled code of an earlier test in this process: while it
    holds some, a trace does not watch for attention written by hand (see docs/trace.md)."""
    convert = sys.modules.get("torch._dynamo.convert_frame")
    if getattr(getattr(convert, "input_codes", None), "seen", None):
        torch._dynamo.reset()
    yield
