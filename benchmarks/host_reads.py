"""Count the host reads a trace adds to a step (each one a device sync on an accelerator).

On CUDA, ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``,
``.numpy()`` and ``.cpu()`` wait for the device. This counts the Python-level
calls of those ``torch.Tensor`` methods during one warmed-up step, untraced
and traced; the difference is what the tracer adds. It counts on the CPU
too, so the guarantee can be checked on a machine without a GPU.

Used by ``benchmarks/overhead.py`` and by the test suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import qkvtrace

__all__ = ["HOST_READS", "HostReads", "added_host_reads"]

HOST_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu")


class HostReads:
    """Counts host reads of tensors while the ``with`` block runs."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostReads:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)

            def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def added_host_reads(model: nn.Module, step: Callable[[], Any]) -> tuple[int, int]:
    """Host reads of one warmed-up ``step``: ``(untraced, traced)``.

    The step runs once plainly and once traced first, so that the traced count
    is the steady state (kernel evidence already cached). Only the step is
    counted, not entering or leaving the trace (records are resolved on exit).
    """
    step()
    with qkvtrace.trace(model):
        step()
    with HostReads() as plain:
        step()
    with qkvtrace.trace(model):
        with HostReads() as traced:
            step()
    return plain.count, traced.count
