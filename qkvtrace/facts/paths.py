"""Which attention kernel ran for a call, from evidence.

Two sources of evidence, both from the running PyTorch:

* ``torch._fused_sdp_choice``: PyTorch's own SDPA backend selection,
  evaluated on the very arguments of an SDPA call.
* ``torch.autograd.profiler``: the ``aten::`` ops a call really dispatched.
  Profiling every call would cost far more than the call (DESIGN.md), so the
  first call of each *signature* (op, device, dtype, mask kind, grad mode,
  backend choice...) is run under the profiler and later calls with the same
  signature reuse what it saw. The profiler does not change what runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from qkvtrace.base import compat
from qkvtrace.records import EVIDENCE_CACHED, EVIDENCE_WITNESSED

__all__ = [
    "SDP_SWITCHES",
    "UNAVAILABLE_PROFILER",
    "KernelEvidence",
    "is_attention_op",
    "is_flex_op",
    "quiet_native_stderr",
    "sdp_flags",
    "sdpa_backend",
    "sdpa_refusals",
    "shared_evidence",
    "warnings_to_reasons",
]

_ATTENTION_WORDS = ("attention", "transformer_encoder_layer", "multi_head")


def is_flex_op(name: str) -> bool:
    """A profiler event of FlexAttention's higher-order operator (it runs no ``aten::`` attention kernel)."""
    return "flexattention" in name.replace("_", "").lower()


def is_attention_op(name: str) -> bool:
    """An ``aten::`` op that is an attention kernel (not a matmul or a view)."""
    return name.startswith("aten::") and any(w in name for w in _ATTENTION_WORDS)


def sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> str | None:
    """The ``SDPBackend`` name PyTorch selects for exactly these arguments."""
    choice = compat.fused_sdp_choice()
    if choice is None:
        return None
    kwargs: dict[str, Any] = {}
    if scale is not None:
        kwargs["scale"] = scale
    if enable_gqa:
        kwargs["enable_gqa"] = True
    try:
        value_ = choice(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        # The selection refused arguments that the kernel itself accepted
        # (should not happen); report "unknown" rather than guess.
        return None
    return compat.sdp_backend_name(value_)


def warnings_to_reasons(check: Callable[..., bool], params: Any) -> list[str] | None:
    """Run a ``can_use_*(params, debug=True)`` check; its warnings are the reasons.

    Returns ``[]`` when the backend would be accepted, the warning texts in
    the order PyTorch emitted them when it is refused, ``None`` if the check
    itself failed.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ok = check(params, debug=True)
        except (RuntimeError, TypeError) as exc:
            return [f"check failed: {exc}"]
    if ok:
        return []
    reasons = [str(w.message).strip() for w in caught]
    return reasons or ["refused (PyTorch gave no reason)"]


def sdpa_refusals(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool = False,
) -> dict[str, list[str]] | None:
    """For each faster SDPA backend, PyTorch's reasons to refuse it ([] = usable)."""
    checks = compat.sdpa_refusal_checks()
    if not checks:
        return None
    params = compat.sdpa_params(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if params is None:
        return None
    out: dict[str, list[str]] = {}
    for backend, check in checks.items():
        reasons = warnings_to_reasons(check, params)
        if reasons is not None:
            out[backend] = reasons
    return out


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence file descriptor 2 briefly (some builds log each profiler start/stop)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_MARK = "qkvtrace::evidence"
UNAVAILABLE_PROFILER = "unavailable: another profiler was active and this call signature was not witnessed before"


class KernelEvidence:
    """Attention ``aten::`` ops per call signature, seen by the profiler once each.

    Thread-safe: one profiler run at a time (profilers do not nest), and only
    the events of the calling thread inside a marker range are kept, so a
    call in another thread cannot lend its kernels to this one.
    """

    def __init__(self) -> None:
        self._ops: dict[Hashable, list[str]] = {}
        self._kernel_backend: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def run(
        self, key: Hashable, fn: Callable[..., Any], *args: Any, _select: Callable[[str], bool] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, list[str] | None, str]:
        """Call ``fn``; return its result, the attention ops it ran and the evidence for them.

        The evidence is ``"witnessed"`` (profiled now), ``"cached"`` (an
        identical signature was profiled earlier in this process) or
        ``"unavailable: ..."`` with ``None`` for the ops (another profiler was
        running: profilers do not nest, and nothing is made up in its place).
        """
        key = (key, sdp_flags())  # switching a backend off can change what runs
        known = self._ops.get(key)
        if known is not None:
            return fn(*args, **kwargs), known, EVIDENCE_CACHED
        if torch.autograd._profiler_enabled() or not self._lock.acquire(blocking=False):
            return fn(*args, **kwargs), None, UNAVAILABLE_PROFILER
        try:
            if torch.autograd._profiler_enabled():
                return fn(*args, **kwargs), None, UNAVAILABLE_PROFILER
            prof = torch.autograd.profiler.profile()
            with quiet_native_stderr():
                prof.__enter__()
            try:
                with torch.autograd.profiler.record_function(_MARK):
                    result = fn(*args, **kwargs)
            finally:
                with quiet_native_stderr():
                    prof.__exit__(None, None, None)
        finally:
            self._lock.release()
        ops = _ops_inside_mark(prof.function_events, _select or is_attention_op)
        self._ops[key] = ops
        return result, ops, EVIDENCE_WITNESSED

    def learn(self, device_type: str, kernel_op: str, backend: str) -> None:
        """Remember that ``kernel_op`` is how ``backend`` ran on this device."""
        self._kernel_backend[(device_type, kernel_op)] = backend

    def backend_of(self, device_type: str, ops: list[str]) -> str | None:
        """The SDPA backend whose kernel appears in ``ops`` (calibrating if needed)."""
        if not any("scaled_dot_product" in op for op in ops):
            return None
        if not any(dev == device_type for dev, _ in self._kernel_backend):
            self._calibrate(device_type)
        for op in ops:
            backend = self._kernel_backend.get((device_type, op))
            if backend is not None:
                return backend
        return None

    def calibrate_once(self, device_type: str) -> None:
        """Learn each backend's kernel on this device, if not yet learned."""
        if not any(dev == device_type for dev, _ in self._kernel_backend):
            self._calibrate(device_type)

    def _calibrate(self, device_type: str) -> None:
        """Force each SDPA backend on a tiny input and note the kernel it runs."""
        if torch.autograd._profiler_enabled():
            return
        dtype = torch.float16 if device_type == "cuda" else torch.float32
        # fixed values, not torch.randn: the user's random state must be the same with and without a trace
        q = torch.linspace(-1.0, 1.0, 256, device=device_type, dtype=dtype).reshape(1, 2, 8, 16)
        for name in compat.sdp_backend_names().values():
            if name == "ERROR":
                continue
            try:
                with compat.forced_backend(name):
                    _, ops, _ = KernelEvidence().run(("calibrate",), compat.raw_sdpa(), q, q, q)
            except RuntimeError:  # backend not available on this device/build
                continue
            for op in ops or []:
                if op != "aten::scaled_dot_product_attention":
                    self.learn(device_type, op, name)


def _ops_inside_mark(events: Any, select: Callable[[str], bool]) -> list[str]:
    """Attention ops of the marker's thread inside the marker's time range, in order."""
    marks = [e for e in events if e.name == _MARK]
    if not marks:
        return []
    mark = marks[0]
    start, end = mark.time_range.start, mark.time_range.end
    inside = [
        e for e in events
        if e.thread == mark.thread and start <= e.time_range.start <= end and select(e.name)
    ]  # fmt: skip
    inside.sort(key=lambda e: e.time_range.start)
    return [e.name for e in inside]


def _switch(name: str) -> Callable[[], bool | None]:
    """What reads PyTorch's switch ``torch.backends.cuda.<name>``: the builtin that function returns
    (``torch._C._get_<name>``, one call fewer on every call's key) where there is one, else the function, or a
    stand-in saying ``None`` where this release has no such switch."""
    fn = getattr(torch.backends.cuda, name, None)
    if fn is None:
        return lambda: None
    builtin: Callable[[], bool] | None = getattr(torch._C, f"_get_{name}", None)
    return builtin if builtin is not None else fn


#: the switches read by :func:`sdp_flags`, looked up once: the key of every call reads them
SDP_SWITCHES = tuple(_switch(n) for n in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled",
                                          "cudnn_sdp_enabled"))  # fmt: skip
_FLASH, _EFFICIENT, _MATH, _CUDNN = SDP_SWITCHES


def sdp_flags() -> tuple[bool | None, ...]:
    """The SDPA backend switches in force (``torch.backends.cuda.*_sdp_enabled``)."""
    return _FLASH(), _EFFICIENT(), _MATH(), _CUDNN()


_SHARED = KernelEvidence()


def shared_evidence() -> KernelEvidence:
    """One evidence cache per process: a signature's kernels do not change while it runs."""
    return _SHARED
