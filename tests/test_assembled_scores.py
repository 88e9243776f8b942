"""Attention written by hand whose scores are assembled from pieces before the softmax is recorded.

The model here keeps G global tokens and blocks of W local keys, as
Longformer- and BigBird-style attention does: the scores of the global keys
and of each query's own block are joined with ``torch.cat`` along the keys,
one softmax runs over them, and each slice of the probabilities meets its
own values; the two products are summed. Witnesses: the model written here
(its path through the code, its scale, its pieces), the untraced run (bit
for bit), the packed projection's thirds by construction, and a mask built
here after the join.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkvtrace

B, H, T, D, G, W = 2, 2, 8, 4, 2, 4
E = H * D
SCALE = D**-0.5


class LocalGlobalAttention(nn.Module):
    def __init__(self, blocked_row: int | None = None) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.blocked_row = blocked_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(E, -1))  # (B, H, T, D)
        s_global = q @ k[:, :, :G].transpose(-2, -1)  # (B, H, T, G): every query, the global keys
        qb, kb, vb = (t.reshape(B, H, T // W, W, D) for t in (q, k, v))  # blocks of W
        s_local = (qb @ kb.transpose(-2, -1)).reshape(B, H, T, W)  # (B, H, T, W): each query, its own block
        s = torch.cat([s_global, s_local], dim=-1) * SCALE  # (B, H, T, G + W)
        if self.blocked_row is not None:
            blocked = torch.zeros(T, G + W, dtype=torch.bool)
            blocked[self.blocked_row] = True
            s = s.masked_fill(blocked, float("-inf"))
        p = s.softmax(-1)
        local = (p[..., G:].reshape(B, H, T // W, W, W) @ vb).reshape(B, H, T, D)
        return p[..., :G] @ v[:, :, :G] + local


class Net(nn.Module):
    def __init__(self, blocked_row: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = LocalGlobalAttention(blocked_row)
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x).transpose(1, 2).reshape(B, T, E))


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_scores_joined_with_cat_are_recorded_as_hand_written(train: bool) -> None:
    """Witness: the model above (two pieces, scale 1/sqrt(D), G + W keys a query sees, the qkv thirds) and the
    untraced run, whose output the traced one equals bit for bit."""
    model, x = Net(), torch.randn(B, T, E)
    with torch.set_grad_enabled(train):
        want = model(x)
        with qkvtrace.trace(model) as t:
            got = model(x)
    assert torch.equal(got, want)
    assert [(c.path, c.module, c.module_type) for c in t.calls] == [("hand_written", "attn", "LocalGlobalAttention")]
    assert t.result.unobserved == []
    (c,) = t.calls
    assert c.inputs["scale"] == pytest.approx(SCALE)
    assert c.inputs["assembled"] == {"pieces": 2, "keys": G + W}
    assert "cat 2 pieces" in c.inputs["form"] and c.inputs["form"].endswith("add")
    assert c.output["nan_count"] == 0 and c.output["fully_masked_rows"] == 0
    if train:  # Q, K, V are the thirds of the packed projection, by construction
        assert [getattr(c.qkv, p).rows for p in "qkv"] == [[[0, E]], [[E, 2 * E]], [[2 * E, 3 * E]]]


def test_a_row_masked_after_the_join_is_counted_and_the_map_says_why_there_is_none() -> None:
    """Witness: the mask built in the model after the join (row 3 blocks every key it has) counted here in each of
    the B x H (batch, head) pairs; the map is refused because the key axis is pieces, not positions."""
    model, x = Net(blocked_row=3), torch.randn(B, T, E)
    with torch.no_grad(), qkvtrace.trace(model, attention_maps=True) as t:
        out = model(x)
    (c,) = t.calls
    assert c.path == "hand_written"
    assert c.output["fully_masked_rows"] == 1 * B * H
    assert c.output["nan_count"] == int(torch.isnan(out).sum()) > 0
    assert c.attention_map is None and "torch.cat" in c.attention_map_reason
