"""The overhead benchmark's judgements: its verdict on a workload's ratios, and its traced-vs-untraced check.

Witnesses: the rule the benchmark prints under its table ("'met' = every repetition within the target; 'median
only' = the median is, some repetitions are not; 'NOT met' = the median is above it; * = the spread is wider than
the margin"), applied here to ratios written here; and, for the identity check, outputs that are equal or that
differ by construction (a module whose output draws fresh random numbers on every call).
"""

from __future__ import annotations

import statistics
from types import ModuleType

import pytest
import torch
from _witness import benchmark
from torch import nn


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    return benchmark("overhead")  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("ratios", "word", "resolved"),
    [
        ([1.00, 1.02, 1.05], "met", True),  # every repetition within 1.05, the last one exactly at it
        ([1.00, 1.02, 1.06], "median only", False),  # one above; spread 0.06 wider than the 0.05 margin
        ([1.04, 1.06, 1.07], "NOT met", True),  # the median above; spread 0.03
        ([0.90, 1.20, 1.01], "median only", False),
    ],
)
def test_verdict_words_and_the_spread(overhead: ModuleType, ratios: list[float], word: str, resolved: bool) -> None:
    """Witness: the printed rule applied here to these ratios against a 1.05 target (margin 0.05)."""
    v = overhead.verdict(ratios, 1.05)
    assert v.word == word
    assert (max(ratios) <= 1.05, statistics.median(ratios) <= 1.05) == (v.every_met, v.median_met)
    assert v.resolved is resolved and v.spread == pytest.approx(max(ratios) - min(ratios))


def test_added_microseconds_per_call_are_paired_per_repetition(overhead: ModuleType) -> None:
    """Witness: (traced - untraced) / calls computed here for each repetition. Fault caught: unpaired medians, or
    a division by something other than the calls of one unit of work."""
    s = overhead.Samples(baseline=[0.30, 0.25])
    s.traced = [overhead.TracedSample(seconds=0.33, first_unit_s=0.0, enter_exit_s=0.0, calls_per_unit=1000),
                overhead.TracedSample(seconds=0.26, first_unit_s=0.0, enter_exit_s=0.0, calls_per_unit=500)]
    assert s.added_us_per_call() == pytest.approx([30.0, 20.0])


def _workload(overhead: ModuleType, module: nn.Module) -> object:
    x = torch.randn(2, 5, 16)
    return overhead.Workload("T", "test", module, lambda: [module(x, x, x, need_weights=False)[0]], target=None)


class _Noisy(nn.MultiheadAttention):
    """Its output plus fresh noise: two runs never agree, traced or not (the witness of 'DIFFERENT')."""

    def forward(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        out, weights = super().forward(*args, **kwargs)  # type: ignore[arg-type]
        return out + torch.randn_like(out), weights


def test_identity_check_says_equal_only_when_the_outputs_are(overhead: ModuleType) -> None:
    """Witness: a deterministic MultiheadAttention (equal by construction: eval, no dropout) and one whose output
    draws fresh noise on every call (different by construction); the recorded path is the MHA's."""
    same = overhead.check_identity(_workload(overhead, nn.MultiheadAttention(16, 4, batch_first=True).eval()))
    assert (same.first_traced_equal, same.steady_traced_equal, same.tensors) == (True, True, 1)
    assert sum(same.paths.values()) == 2  # the two traced runs were recorded
    noisy = overhead.check_identity(_workload(overhead, _Noisy(16, 4, batch_first=True).eval()))
    assert (noisy.first_traced_equal, noisy.steady_traced_equal) == (False, False)
