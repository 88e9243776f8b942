"""Built-in demo models for ``qkvtrace trace demo:NAME``.

Each factory returns ``(model, example_inputs)``, the same contract a user's
factory may follow. They are small enough to run in a second on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEMOS", "CausalSelfAttention", "TinyTransformerLM", "demo_encoder", "demo_mha", "demo_tiny_lm"]


def demo_mha() -> tuple[nn.Module, tuple[Any, ...]]:
    """One ``nn.MultiheadAttention(64, 8, batch_first=True)`` on ``(2, 10, 64)``."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 8, batch_first=True)
    x = torch.randn(2, 10, 64)
    return mha, (x, x, x)


def demo_encoder() -> tuple[nn.Module, tuple[Any, ...]]:
    """A 2-layer ``nn.TransformerEncoder`` (d_model 64, 4 heads) on ``(2, 12, 64)``."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    x = torch.randn(2, 12, 64)
    return encoder, (x,)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a packed QKV projection, via SDPA."""

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # [B,T,3D] -> [B,T,3,H,Dh] -> [3,B,H,T,Dh]
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [B,H,T,Dh]
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, num_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyTransformerLM(nn.Module):
    """The minimal causal language model of docs/tutorial.md#a-tiny-language-model (pre-norm, tied head)."""

    def __init__(self, vocab_size: int = 100, max_len: int = 128, d_model: int = 64,
                 num_heads: int = 4, num_layers: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.max_len = max_len
        #: token strings by id, when known (pictures label their axes with them)
        self.vocabulary: list[str] | None = None
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying
        self.scale = math.sqrt(d_model)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        _, t = token_ids.shape
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.max_len}")
        positions = torch.arange(t, device=token_ids.device)
        x = self.token_embedding(token_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))  # [B,T,V]


#: The demo language model's 100 tokens (id -> string), so pictures can label positions with words.
VOCABULARY: list[str] = [
    "<pad>", "<bos>", "<eos>", "<unk>", ".", ",", "the", "a", "an", "and", "or", "but", "of", "to", "in", "on",
    "at", "by", "for", "with", "from", "is", "are", "was", "were", "be", "has", "have", "had", "it", "this",
    "that", "he", "she", "they", "we", "you", "i", "not", "no", "yes", "cat", "dog", "bird", "fish", "robot",
    "model", "token", "query", "key", "value", "head", "layer", "mask", "weight", "attention", "sees", "reads",
    "writes", "finds", "keeps", "drops", "learns", "moves", "runs", "sleeps", "eats", "likes", "sat", "mat",
    "tree", "house", "road", "river", "book", "word", "sentence", "story", "day", "night", "red", "blue",
    "green", "small", "big", "old", "new", "fast", "slow", "first", "last", "next", "one", "two", "three",
    "here", "there", "now", "then", "again",
]  # fmt: skip


def demo_tiny_lm() -> tuple[nn.Module, tuple[Any, ...]]:
    """:class:`TinyTransformerLM` on token ids ``(2, 16)``, with a vocabulary of words."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab_size=len(VOCABULARY))
    model.vocabulary = list(VOCABULARY)  # read by the attention-map pictures for their axes
    tokens = torch.randint(0, len(VOCABULARY), (2, 16))
    return model, (tokens,)


DEMOS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "encoder": demo_encoder,
    "mha": demo_mha,
    "tiny-lm": demo_tiny_lm,
}
