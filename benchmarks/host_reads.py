"""Count the host reads a trace adds to a step (each one a device sync on an accelerator).

Every read of a tensor's value back to the host goes through one of a few
dispatcher operations: ``aten::_local_scalar_dense`` (``.item()``,
``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``), ``aten::nonzero``
(boolean-mask indexing, ``torch.where(mask)``), ``aten::equal``,
``aten::is_nonzero``, or a copy from a device to the host (``.cpu()``,
``.to("cpu")``, ``copy_`` into a CPU tensor). Those are counted here at the
dispatcher, so reads made inside PyTorch's C++ code count as much as reads
made from Python, and they count on the CPU too (except device-to-host
copies, which a CPU-only machine cannot make): the guarantee can be checked
on a machine without a GPU.

Three counters, each an independent witness:

* :class:`ProfiledHostReads`: ``torch.profiler`` records every aten op,
  including those PyTorch's own kernels call; the outermost host-read ops
  are counted (``.item()`` inside ``is_nonzero`` is one read, not two).
* :class:`DispatchHostReads`: a pass-through ``TorchDispatchMode`` sees
  each op that reaches the dispatcher from outside a fused kernel, with its
  arguments, so it also counts device-to-host copies.
* :class:`HostReads`: the Python-level ``torch.Tensor`` methods patched —
  blind to reads made in C++, kept as a second opinion.

Used by ``benchmarks/overhead.py`` and by the test suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import qkvtrace

__all__ = [
    "HOST_READS",
    "HOST_READ_OPS",
    "DispatchHostReads",
    "HostReads",
    "ProfiledHostReads",
    "added_host_reads",
]

#: Python-level ``torch.Tensor`` methods that read a value back to the host.
HOST_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu")

#: Dispatcher operations that read a tensor's value back to the host (besides device-to-host copies).
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero")

_COPIES = ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize")


class HostReads:
    """Counts Python-level host reads of tensors while the ``with`` block runs (blind to C++)."""

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


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """A copy whose source is not on the CPU and whose result is."""
    if name not in _COPIES:
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    src = tensors[1] if name != "_to_copy" and len(tensors) > 1 else (tensors[0] if tensors else None)
    return (
        isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
        and isinstance(out, torch.Tensor)
        and out.device.type == "cpu"
    )


class DispatchHostReads(TorchDispatchMode):
    """Counts host-read ops (and device-to-host copies) that reach the dispatcher in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        if f"aten::{name}" in HOST_READ_OPS or _device_to_host(name, args, kwargs, out):
            self.count += 1
            self.ops.append(f"aten::{name}")
        return out


class ProfiledHostReads:
    """Counts the outermost host-read aten ops ``torch.profiler`` records in the block (C++ calls included)."""

    def __init__(self) -> None:
        self.count = 0
        self.ops: list[str] = []
        self._prof: Any = None

    def __enter__(self) -> ProfiledHostReads:
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        for event in self._prof.events():
            if event.name not in HOST_READ_OPS:
                continue
            parent = event.cpu_parent
            while parent is not None and parent.name not in HOST_READ_OPS:
                parent = parent.cpu_parent
            if parent is None:  # a read inside another read (item under is_nonzero) is the same read
                self.count += 1
                self.ops.append(event.name)


Counter = Callable[[], Any]


def added_host_reads(
    model: nn.Module, step: Callable[[], Any], counter: Counter = ProfiledHostReads
) -> tuple[int, int]:
    """Host reads of one warmed-up ``step``: ``(untraced, traced)``, counted by ``counter``.

    The step runs once plainly and once traced first, so that the traced count
    is the steady state (kernel evidence already cached). Only the step is
    counted, not entering or leaving the trace (records are resolved on exit).
    """
    step()
    with qkvtrace.trace(model):
        step()
    with counter() as plain:
        step()
    with qkvtrace.trace(model):
        with counter() as traced:
            step()
    return plain.count, traced.count
