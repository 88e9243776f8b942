"""Numbers kept on their device while a trace is open become Python values when the records are read.

Witnesses: values written into tensors here (so the expected Python value is the one the test wrote), with
Python's own ``float``/``int`` of them; a record's numbers against ``torch.isnan`` and
``torch.linalg.vector_norm`` computed in the test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import qkvtrace
from qkvtrace.base import lazy


@dataclass
class _Held:
    number: Any
    row: Any


def test_cpu_numbers_read_as_the_python_values_written_into_them() -> None:
    """Witness: the values the test wrote, each dtype's exact value (float16 and bfloat16 hold 0.5 and 3.0
    exactly; an int64 above 2**53, which a float64 cannot hold, comes back whole)."""
    big = 2**53 + 1
    held = _Held(torch.tensor(big), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    values: dict[str, Any] = {
        "f32": torch.tensor(0.25),
        "f16": torch.tensor(0.5, dtype=torch.float16),
        "bf16": torch.tensor(3.0, dtype=torch.bfloat16),
        "f64": torch.tensor(1 / 3, dtype=torch.float64),
        "flag": torch.tensor(True),
        "grad": torch.tensor(2.0, requires_grad=True) * 2,  # (a value with a graph: read all the same)
        "strided": torch.arange(6.0).reshape(2, 3).t(),
        "nested": [torch.tensor(7), {"deep": torch.tensor(-1.5)}],
        "held": held,
        "meta": torch.empty((), device="meta"),
        "text": "kept",
    }
    lazy.resolve([values])
    assert values["f32"] == 0.25 and type(values["f32"]) is float
    assert values["f16"] == 0.5 and type(values["f16"]) is float
    assert values["bf16"] == 3.0 and type(values["bf16"]) is float
    assert values["f64"] == 1 / 3
    assert values["flag"] == 1 and type(values["flag"]) is int
    assert values["grad"] == 4.0 and type(values["grad"]) is float
    assert values["strided"] == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0] and all(type(x) is float for x in values["strided"])
    assert values["nested"] == [7, {"deep": -1.5}] and type(values["nested"][0]) is int
    assert held.number == big and type(held.number) is int
    assert held.row == [1, 2, 3, 4] and all(type(x) is int for x in held.row)
    assert values["meta"] is None and values["text"] == "kept"


def test_complex_numbers_read_as_an_accelerators_are() -> None:
    """Witness: the real parts the test wrote (a complex value is gathered with the others and read as a float,
    its imaginary part dropped with PyTorch's warning, on every device alike); the real numbers beside them."""
    values: dict[str, Any] = {"one": torch.tensor(1.5 + 2j), "row": torch.tensor([1 + 1j, -2 - 1j]),
                              "real": torch.tensor(0.75)}  # fmt: skip
    with pytest.warns(UserWarning, match="imaginary"):
        lazy.resolve([values])
    assert values == {"one": 1.5, "row": [1.0, -2.0], "real": 0.75}
    assert type(values["one"]) is float and all(type(x) is float for x in values["row"])


def test_a_records_numbers_are_the_tests_own() -> None:
    """Witness: the NaN count and the Q, K and V norms of a model's own SDPA calls, computed in the test, for the
    records of a trace whose calls after the first are kept by their module's slot and read at the close."""

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    model = Attention()
    g = torch.Generator().manual_seed(3)
    calls = []
    for i in range(3):
        q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
        v[0, 0, i, 0] = float("nan")
        calls.append((q, k, v))
    with qkvtrace.trace(model) as t:
        outs = [model(*c) for c in calls]
    assert len(t.calls) == 3
    for record, (q, k, v), out in zip(t.calls, calls, outs, strict=True):
        nans = record.output["nan_count"]
        assert nans == int(torch.isnan(out).sum()) > 0 and type(nans) is int
        for part, tensor in zip((record.qkv.q, record.qkv.k, record.qkv.v), (q, k, v), strict=True):
            want = float(torch.linalg.vector_norm(tensor))  # (V's is NaN: a NaN was planted in it)
            assert type(part.activation_norm) is float
            assert part.activation_norm == want or (math.isnan(want) and math.isnan(part.activation_norm))
