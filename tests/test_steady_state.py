"""Long runs in their steady state: a call with its module's previous combination is counted, not recorded.

``keep="changes"`` counts every call and keeps the record of firsts and
changes only; a call whose path, backend, reasons, dtype, masks and mode are
those of its module's previous call is now counted without any record being
built. These tests hold that shortcut to what a full record would have said,
each against a witness of its own.
"""

from __future__ import annotations

import gc
import itertools
import sys
from collections import Counter
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace import records


class Direct(nn.Module):
    """A model's own SDPA call, with an optional mask."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _built(run: Any) -> int:
    """How many call records ``run()`` builds (each built record is one ``AttentionCall``)."""
    made = 0
    real = records.AttentionCall.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal made
        made += 1
        real(self, *args, **kwargs)

    with mock.patch.object(records.AttentionCall, "__init__", counting):
        run()
    return made


def test_a_steady_call_builds_no_record_and_is_counted() -> None:
    """Witness: the number of record objects constructed (one per module: its first call), and the test's own
    count of the calls it made (its loop)."""
    torch.manual_seed(0)
    mha, direct = nn.MultiheadAttention(16, 2), Direct()
    x = torch.randn(5, 2, 16)
    q = k = v = torch.randn(2, 2, 5, 8)
    with qkvtrace.trace(nn.ModuleList([mha, direct]), keep="changes") as t:

        def run() -> None:
            for _ in range(200):
                mha(x, x, x)
                direct(q, k, v)

        assert _built(run) == 2  # the first call of each module; the other 398 are counted only
        assert _built(run) == 0
    modules = t.summary()["modules"]
    assert [c["calls"] for c in modules["0"]["combinations"]] == [400]
    assert [c["calls"] for c in modules["1"]["combinations"]] == [400]


def test_steady_counts_nans_and_masked_rows_equal_the_tests_own() -> None:
    """Witness: per module the test's own tally of each mode it ran (training or not, mask or none, weights
    asked or not), the NaNs it counts in the outputs it holds (``torch.isnan``), and the fully-masked rows it
    counts from its own masks (a row whose keys are all blocked, per batch, head and query)."""
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    direct = Direct()
    model = nn.ModuleList([mha, direct])
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True  # every key of batch item 1 blocked: 5 query rows x 2 heads fully masked per call
    q = k = v = torch.randn(2, 2, 5, 8)
    q_nan = q.clone()
    q_nan[0, 0, 0, 0] = float("nan")
    blocked = torch.zeros(5, 5, dtype=torch.bool)
    blocked[2] = True  # query row 2 sees no key (True = blocked here; SDPA's bool mask means attend)
    attend = ~blocked
    plan = [("train", None, None)] * 30 + [("eval", pad, attend)] * 20 + [("train", pad, None)] * 10 + \
        [("eval", None, attend)] * 15  # fmt: skip
    nans = Counter[str]()
    rows = Counter[str]()
    modes = Counter[tuple[str, str, bool]]()
    with qkvtrace.trace(model, keep="changes") as t:
        for i, (mode, kpm, mask) in enumerate(plan):
            model.train(mode == "train")
            out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=i % 2 == 0)
            y = direct(q_nan if i % 3 == 0 else q, k, v, mask)
            nans["0"] += int(torch.isnan(out).sum())
            nans["1"] += int(torch.isnan(y).sum())
            if kpm is not None:
                rows["0"] += 2 * 5  # batch item 1: its 5 query rows in each of 2 heads
            if mask is not None:
                rows["1"] += 2 * 2  # query row 2, in each of 2 batch items x 2 heads
            modes[("0", mode, kpm is not None)] += 1
            modes[("1", mode, mask is not None)] += 1
    summary = t.summary()["modules"]
    for name in ("0", "1"):
        assert summary[name]["nan_count"] == nans[name]
        assert summary[name]["fully_masked_rows"] == rows[name]
        assert sum(c["calls"] for c in summary[name]["combinations"]) == len(plan)
    # each combination's calls are those of the test's (mode, mask) kinds it stands for
    for name, mask_field in (("0", "key_padding_mask"), ("1", "attn_mask")):
        by_kind = Counter[tuple[str, bool]]()
        for c in summary[name]["combinations"]:
            combo = c["combo"]
            by_kind[("train" if combo["training"] else "eval", combo[mask_field] is not None)] += c["calls"]
        assert by_kind == Counter({(m, has): n for (mod, m, has), n in modes.items() if mod == name})


def test_a_steady_state_keeps_no_more_python_objects_the_longer_it_runs() -> None:
    """Witness: the interpreter's own count of allocated memory blocks (``sys.getallocatedblocks``) after
    1,000 and after 2,000 steady calls: what a call leaves behind does not grow with the calls."""
    torch.manual_seed(2)
    direct = Direct()
    q = k = v = torch.randn(1, 2, 4, 8)
    with qkvtrace.trace(direct, keep="changes") as t:
        for _ in range(300):
            direct(q, k, v)
        t.step()
        blocks = []
        for _ in range(3):
            gc.collect()
            blocks.append(sys.getallocatedblocks())
            for _ in range(1000):
                direct(q, k, v)
            t.step()
        gc.collect()
        blocks.append(sys.getallocatedblocks())
    grown = [b - a for a, b in itertools.pairwise(blocks)]
    # a record kept per call would be tens of blocks a call (tens of thousands here); the interpreter's own
    # caches move a few dozen either way
    assert max(grown) < 300, grown


def test_a_fused_encoder_layers_steady_calls_are_counted_with_their_masked_rows() -> None:
    """An eval ``TransformerEncoderLayer`` under ``inference_mode`` (PyTorch's fused layer), with and without a
    padding mask. Witness: PyTorch's profiler sees its fused op (``aten::_transformer_encoder_layer_fwd``) in the
    untraced call, the number of record objects made (one per combination), and the test's own count of calls and
    of fully-masked rows (batch item 1 fully padded: its 6 query rows in each of 2 heads)."""
    from torch.profiler import profile

    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :] = True
    pad[0, 5] = True
    with torch.inference_mode(), profile() as prof:
        layer(x, src_key_padding_mask=pad)
    assert "aten::_transformer_encoder_layer_fwd" in {e.name for e in prof.events()}
    with torch.inference_mode(), qkvtrace.trace(layer, keep="changes") as t:

        def run() -> None:
            for i in range(60):
                layer(x, src_key_padding_mask=pad if i >= 40 else None)

        built = _built(run)
    assert built == 2  # the first call, and the change to a padding mask
    (module,) = t.summary()["modules"].values()
    assert sorted(c["calls"] for c in module["combinations"]) == [20, 40]
    assert module["fully_masked_rows"] == 20 * 2 * 6


def test_steady_calls_with_a_mask_build_no_record_either() -> None:
    """A model's own SDPA call with a float (additive) mask, then with a boolean one, 50 calls each. Witness: the
    number of record objects made — one per mask kind, the first call of each — and the test's own count of
    calls per kind."""
    torch.manual_seed(4)
    direct = Direct()
    q = k = v = torch.randn(1, 2, 4, 8)
    additive = torch.zeros(4, 4)
    additive[0, 3] = float("-inf")
    attend = torch.ones(4, 4, dtype=torch.bool)
    with qkvtrace.trace(direct, keep="changes") as t:

        def run() -> None:
            for mask in (additive, attend):
                for _ in range(50):
                    direct(q, k, v, mask)

        assert _built(run) == 2
    (module,) = t.summary()["modules"].values()
    by_mask = {c["combo"]["attn_mask"]: c["calls"] for c in module["combinations"]}
    assert by_mask == {f"float {additive.dtype}": 50, f"bool {attend.dtype}": 50}
