"""``output.fully_masked_rows`` means one thing on every path: the (batch, head, query) rows that see no key.

A ``[T, T]`` mask broadcast over B and H blocks a row in each of the B·H
(batch, head) pairs the kernel runs, so it counts B·H per blocked row
whatever API received it. Every expected count here is written in the test
from the mask it builds (which rows block every key, times the batch items
and heads the mask is broadcast over); the same mask must give the same
count on SDPA, MHA's fast path and fallback, the fused encoder layer and
attention written by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _witness import sdpa_refusal_of_mask_with_causal
from torch import nn

import qkvtrace

B, H, T, D = 2, 4, 5, 4
E = H * D

# rows 1 and 3 see no key; row 3 also keeps nothing from key 4 (it is blocked everywhere)
BLOCKED = torch.zeros(T, T, dtype=torch.bool)
BLOCKED[1] = True
BLOCKED[3] = True
BLOCKED[0, 2:] = True  # a row with some keys left is not fully masked
ROWS_BLOCKED = 2  # counted by eye from the three lines above
ADDITIVE = torch.zeros(T, T).masked_fill(BLOCKED, float("-inf"))


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], H, D).transpose(1, 2)  # (B, H, T, D)


class _SDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False,
                keys: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        kv = x if keys is None else keys
        q, k, v = _heads(self.q_proj(x)), _heads(self.k_proj(kv)), _heads(self.v_proj(kv))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class _HandWritten(nn.Module):
    """softmax(q kᵀ / √d + mask) v, in [B, H, T, D] or, with ``flat``, in [B·H, T, D] with bmm."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.num_heads, self.flat = H, flat

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads(self.q_proj(x)), _heads(self.k_proj(x)), _heads(self.v_proj(x))
        if self.flat:
            q, k, v = (t.reshape(B * H, T, D) for t in (q, k, v))
            scores = torch.baddbmm(mask.expand(B * H, T, T), q, k.transpose(1, 2), alpha=D**-0.5)
            return torch.bmm(scores.softmax(-1), v)
        return ((q @ k.transpose(-2, -1)) * D**-0.5 + mask).softmax(-1) @ v


def _count(model: nn.Module, *args: object, **kwargs: object) -> tuple[str, int]:
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(*args, **kwargs)
    (call,) = t.calls
    return call.path, call.output["fully_masked_rows"]


def test_one_mask_one_count_on_every_path() -> None:
    """Witness: the ``[T, T]`` mask built above (2 rows block every key), times B·H: every path counts 2·B·H."""
    torch.manual_seed(0)
    x = torch.randn(B, T, E)
    want = ROWS_BLOCKED * B * H
    assert int(BLOCKED.all(-1).sum()) == ROWS_BLOCKED
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=8, batch_first=True, dropout=0.0).eval()
    seen = {
        "sdpa": _count(_SDPA(), x, ADDITIVE),
        "sdpa, bool mask (True = attend)": _count(_SDPA(), x, ~BLOCKED),
        "fast": _count(mha.eval(), x, x, x, attn_mask=BLOCKED, need_weights=False),
        "fallback": _count(mha.eval(), x, x, x, attn_mask=ADDITIVE, need_weights=True),
        "fused_encoder_layer": _count(layer, x, src_mask=BLOCKED),
        "hand_written": _count(_HandWritten(), x, ADDITIVE),
        "hand_written, bmm": _count(_HandWritten(flat=True), x, ADDITIVE),
    }
    paths = {name: path for name, (path, _) in seen.items()}
    assert paths == {"sdpa": "sdpa", "sdpa, bool mask (True = attend)": "sdpa", "fast": "fast",
                     "fallback": "fallback", "fused_encoder_layer": "fused_encoder_layer",
                     "hand_written": "hand_written", "hand_written, bmm": "hand_written"}  # fmt: skip
    assert {name: rows for name, (_, rows) in seen.items()} == dict.fromkeys(seen, want)


@pytest.mark.parametrize("form", ["[B, 1, T, T]", "[B, H, T, T]"])
def test_sdpa_masks_per_batch_item_and_per_head(form: str) -> None:
    """Witness: a mask built here per batch item (and head), its fully blocked rows summed here, times the heads
    it is broadcast over."""
    torch.manual_seed(1)
    heads = 1 if form == "[B, 1, T, T]" else H
    blocked = torch.zeros(B, heads, T, T, dtype=torch.bool)
    blocked[0, :, 2] = True  # batch item 0: row 2 in every head the mask has
    blocked[1, 0, 4] = True  # batch item 1: row 4 in the mask's first head only
    blocked[1, -1, 0, :3] = True  # not fully blocked
    per_mask_row = int(blocked.all(-1).sum())
    assert per_mask_row == heads + 1
    want = per_mask_row * (H // heads)  # a one-head mask serves all H heads
    path, rows = _count(_SDPA(), torch.randn(B, T, E), ~blocked)
    assert want == (2 * H if heads == 1 else H + 1)  # by eye: rows (0, 2) and (1, 4), in H heads or as listed
    assert (path, rows) == ("sdpa", want)


def test_is_causal_with_more_queries_than_keys() -> None:
    """Witness: SDPA's documented causal mask, ``torch.ones(Tq, Tk).tril()`` (top-left aligned), built here: every
    query row keeps key 0, so no row is fully masked (a bottom-right alignment would block Tq - Tk rows)."""
    tq, tk = 6, 3
    attend = torch.ones(tq, tk, dtype=torch.bool).tril()
    assert int((~attend).all(-1).sum()) == 0
    assert int((~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)).all(-1).sum()) == tq - tk  # the other reading
    path, rows = _count(_SDPA(), torch.randn(B, tq, E), causal=True, keys=torch.randn(B, tk, E))
    assert (path, rows) == ("sdpa", 0)


@pytest.mark.parametrize("mode", ["fast", "fallback"])
def test_mha_key_padding_mask(mode: str) -> None:
    """Witness: a key padding mask built here that pads every key of batch item 1: its T query rows see no key in
    each of the H heads (T·H rows), and batch item 0 keeps its keys."""
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(E, H, batch_first=True).train(mode == "fallback")
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1] = True  # True = padding (nn.MultiheadAttention's documented meaning)
    kpm[0, :2] = True
    x = torch.randn(B, T, E)
    with torch.set_grad_enabled(mode == "fallback"), qkvtrace.trace(mha) as t:
        mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    (call,) = t.calls
    assert call.path == mode
    assert call.output["fully_masked_rows"] == int(kpm.all(-1).sum()) * T * H == T * H


def test_a_mask_changed_in_place_or_made_anew_is_counted_again() -> None:
    """A count made for one mask is shared only with later calls of the very same, unchanged mask: a mask changed
    in place, new masks of the same shape (each old one freed, its memory free to be handed out again) and the
    same mask with and without ``is_causal`` each get their own (where the installed PyTorch takes the two
    together). Witness: the rows each mask built here blocks, counted in the test by construction, times the B·H
    (batch, head) pairs it is broadcast over."""
    refused = sdpa_refusal_of_mask_with_causal()
    torch.manual_seed(3)
    model, x = _SDPA(), torch.randn(B, T, E)
    attend = ~BLOCKED  # rows 1 and 3 see no key
    first_key_blocked = torch.ones(T, T, dtype=torch.bool)
    first_key_blocked[:, 0] = False  # with is_causal, row 0 keeps only key 0: then it sees none
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x, attend)
        model(x, attend)
        attend[1] = True  # in place: row 1 sees every key again
        model(x, attend)
        del attend
        for n in (1, 3, 2):
            fresh = torch.ones(T, T, dtype=torch.bool)
            fresh[:n] = False  # the first n rows see no key
            model(x, fresh)
            del fresh
        model(x, first_key_blocked)
        if refused is None:
            model(x, first_key_blocked, causal=True)
        else:  # PyTorch 2.14 on refuses a mask with is_causal: its own error, unchanged
            with pytest.raises(RuntimeError, match="is_causal"):
                model(x, first_key_blocked, causal=True)
        model(x, first_key_blocked)
    want = [2, 2, 1, 1, 3, 2, 0, 1, 0] if refused is None else [2, 2, 1, 1, 3, 2, 0, 0]
    assert [c.output["fully_masked_rows"] for c in t.calls if c.error is None] == [n * B * H for n in want]


def test_a_mask_met_again_is_not_counted_again() -> None:
    """The second call with the very same mask reuses the first one's count: it runs no counting operation.
    Witness: ``torch.profiler``'s ``aten::all`` operations (the reduction that finds rows with no key) in the
    traced call, against the same call untraced -- one more for a new mask, none more for the same mask again."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(4)
    model, x = _SDPA(), torch.randn(B, T, E)

    def reductions(mask: torch.Tensor) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x, mask)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::all")

    with torch.no_grad():
        untraced = reductions(~BLOCKED)
        with qkvtrace.trace(model) as t:
            model(x, ~BLOCKED)  # the signature's first call: its kernels are learned here, not profiled below
            mask = ~BLOCKED
            new, again = reductions(mask), reductions(mask)
    assert (new, again) == (untraced + 1, untraced)
    assert [c.output["fully_masked_rows"] for c in t.calls] == [ROWS_BLOCKED * B * H] * 3


def test_masks_made_anew_for_each_trace_are_each_counted() -> None:
    """One trace per step, each with a new mask of the same shape (the old one freed with its trace: CPython
    hands its address to the next tensor object, so the new mask often has the old one's ``id``). Witness: the
    rows each mask built here blocks, by construction, times B·H."""
    torch.manual_seed(5)
    model, x = _SDPA(), torch.randn(B, T, E)
    seen = []
    for n in (1, 3, 2, 4, 1):
        mask = torch.ones(T, T, dtype=torch.bool)
        mask[:n] = False  # the first n rows see no key
        with torch.no_grad(), qkvtrace.trace(model) as t:
            model(x, mask)
        seen.append(t.calls[0].output["fully_masked_rows"])
        del mask, t
    assert seen == [n * B * H for n in (1, 3, 2, 4, 1)]
