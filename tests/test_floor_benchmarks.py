"""The floors the benchmarks set beside qkvtrace: each does the work it claims, and leaves PyTorch as it was.

Witnesses: a model written here that calls ``F.scaled_dot_product_attention`` a known number of times on inputs
made here (one of them with NaNs planted at known places), the test's own ``torch.linalg.vector_norm`` and NaN
counts of those tensors, and PyTorch's own function, compared by identity before and after.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from _witness import benchmark


class _TwoCalls(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        first = F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(first, k, v, dropout_p=0.0)


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return benchmark("peers")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def small_calls() -> ModuleType:
    return benchmark("small_calls")  # type: ignore[no-any-return]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    v[0, 1, 2, 3] = v[1, 2, 0, 0] = float("nan")  # NaN in V: the rows of every query that attends there
    return q, k, v


def test_the_numbers_alone_are_each_calls_norms_and_nan_count(peers: ModuleType) -> None:
    """Witness: the outputs of two SDPA calls made here, their inputs' norms and their NaN counts, computed in
    the test; PyTorch's function, the same object after the block."""
    model, (q, k, v) = _TwoCalls(), _inputs()
    before = F.scaled_dot_product_attention
    kept: list[tuple[torch.Tensor, ...]] = []
    with peers.numbers_alone(kept):
        assert F.scaled_dot_product_attention is not before
        out = model(q, k, v)
    assert F.scaled_dot_product_attention is before
    first = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out.nan_to_num(7.0), before(first, k, v).nan_to_num(7.0))  # the call's result, unchanged
    assert len(kept) == 2
    for (nans, nq, nk, nv), (a, b, c, o) in zip(kept, ((q, k, v, first), (first, k, v, out)), strict=True):
        assert int(nans) == int(torch.isnan(o).sum()) > 0
        for got, t in ((nq, a), (nk, b), (nv, c)):
            want = torch.linalg.vector_norm(t)
            assert torch.allclose(got, want, equal_nan=True), (got, want)


class _OneCall(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def test_the_sdpa_floor_counts_and_keeps_the_numbers_of_the_traced_modules_calls_only(small_calls: ModuleType) -> None:
    """Witness: a traced module called here three times (twice alike, once on other shapes) and a module left
    out of the floor; PyTorch's own outputs, and the norms and NaN counts computed in the test."""
    traced, other, (q, k, v) = _OneCall(), _OneCall(), _inputs()
    before = F.scaled_dot_product_attention
    calls = [(q, k, v), (q, k, v), (q[:1], k[:1], v[:1])]
    with small_calls._sdpa_floor((traced,)) as state:
        outs = [traced(*c) for c in calls]
        passed = other(q, k, v)
    assert F.scaled_dot_product_attention is before
    for out, c in zip([*outs, passed], [*calls, (q, k, v)], strict=True):
        assert torch.equal(out.nan_to_num(7.0), before(*c).nan_to_num(7.0))
    assert (state["calls"], state["changes"], len(state["records"])) == (3, 2, 3)
    for (_number, _key, (nans, nq, nk, nv)), c, out in zip(state["records"], calls, outs, strict=True):
        assert int(nans) == int(torch.isnan(out).sum()) > 0
        for got, t in zip((nq, nk, nv), c, strict=True):
            assert torch.allclose(got, torch.linalg.vector_norm(t), equal_nan=True)
    assert [r[0] for r in state["records"]] == [1, 2, 3]
