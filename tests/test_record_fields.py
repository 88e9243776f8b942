"""Record fields come from what was passed or what ran -- or are null with a reason, never a constant.

Each test passes a value the tracer cannot guess (``is_causal=True`` to a
fused encoder layer, a block mask with a fully masked query row) and checks
the record against the argument itself or a count written here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkvtrace

E, H, B, L = 8, 2, 2, 5


def _encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True).eval()


@pytest.mark.parametrize("is_causal", [True, False])
def test_fused_encoder_layer_records_is_causal_as_passed(is_causal: bool) -> None:
    """Witness: the ``is_causal`` argument this test passes, and the layer's own ``batch_first`` flag."""
    layer = _encoder_layer()
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    with torch.no_grad(), qkvtrace.trace(layer) as t:
        layer(torch.randn(B, L, E), src_mask=mask, is_causal=is_causal)
    [call] = t.calls
    assert call.path == "fused_encoder_layer"
    assert call.inputs["is_causal"] is is_causal
    assert call.inputs["batch_first"] is layer.self_attn.batch_first
    # the fused builtin takes no need_weights: null, and the record says why
    assert call.inputs["need_weights"] is None and "need_weights" in call.inputs["reasons"]["need_weights"]


def test_flex_fully_masked_rows_are_counted_from_the_block_mask() -> None:
    """Witness: the rows whose keys ``mask_mod`` blocks everywhere, counted here with Python loops, in each batch
    item and head of the query (the block mask has one for all)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    d, length, heads = 4, 8, 2

    def mask_mod(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (q != 3) & (q != 6)

    class Flex(nn.Module):
        def forward(self, q: torch.Tensor, bm: object) -> torch.Tensor:
            return flex.flex_attention(q, q, q, block_mask=bm)

    model = nn.Sequential(Flex())
    bm = flex.create_block_mask(mask_mod, None, None, length, length, device="cpu", BLOCK_SIZE=4)
    q = torch.randn(B, heads, length, d)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model[0](q, bm)
        model[0](q, None)
    masked, plain = t.calls
    ti = torch.tensor
    expected = B * heads * sum(all(not bool(mask_mod(0, 0, ti(i), ti(j))) for j in range(length))
                               for i in range(length))  # fmt: skip
    assert expected == 2 * B * heads
    assert masked.output["fully_masked_rows"] == expected
    assert plain.output["fully_masked_rows"] == 0  # nothing masks


def test_flex_with_a_score_mod_says_why_rows_are_not_counted() -> None:
    """Witness: a ``score_mod`` returning ``-inf`` masks rows that no mask argument shows; the record must not
    claim a count."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def score_mod(score: torch.Tensor, b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return torch.where(q == 0, float("-inf"), score)

    class Flex(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return flex.flex_attention(q, q, q, score_mod=score_mod)

    model = nn.Sequential(Flex())
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model[0](torch.randn(B, H, 4, 4))
    [call] = t.calls
    assert call.output["fully_masked_rows"] is None
    assert "score_mod" in call.output["fully_masked_rows_reason"]
