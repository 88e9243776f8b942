"""Why not a faster SDPA backend: PyTorch's own words, asked on a stand-in of the call.

PyTorch says why it refuses a backend only when that backend is forced: with
``sdpa_kernel(FLASH_ATTENTION)`` a CPU call with dropout warns "Flash
attention kernel not used because: ... Both fused kernels do not support
non-zero dropout." and raises "No available kernel". So for each backend
that PyTorch ranks above the one it chose (``torch._C._get_sdp_priority_order``),
qkvtrace forces it on a *stand-in* of the call: tensors of zeros with the
call's device, dtype, rank, batch size, head counts and head sizes, the same
kind, dtype and broadcast pattern of mask, the same ``is_causal``, dropout,
scale, ``enable_gqa``, ``requires_grad``, grad mode and last-dimension stride,
and the call's sequence lengths up to 128 (longer ones are cut to 128,
keeping the query/key order: sizes PyTorch quotes are then the stand-in's).
A backend PyTorch refuses is refused before it computes anything. What PyTorch
warned and raised are its reasons, verbatim (only the "Triggered internally
at file:line" suffix is dropped). On CUDA the ``can_use_*(debug=True)`` checks
are asked as well, where PyTorch has them.

The stand-in never touches the user's tensors; it runs under a forked random
state (dropout draws nothing from the user's generator), outside any
``__torch_function__`` mode, and not at all while a profiler or a dispatch mode
of the user's is active (they would see it). Each call signature is asked
once per process. Stand-ins are built from shapes alone: no value is read
back from the device.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Hashable
from typing import Any

import torch

from qkvtrace.base import compat
from qkvtrace.facts import paths

__all__ = ["NOT_ASKED_NESTED", "SOURCE_CAN_USE", "SOURCE_FORCED", "better_backends", "priority_order", "refusals",
           "signature"]

SOURCE_FORCED = "forced on a stand-in of the call (torch.nn.attention.sdpa_kernel)"
SOURCE_CAN_USE = "torch.backends.cuda.can_use_*(debug=True)"

#: the run-time switch of each backend (``torch.backends.cuda.<name>()``)
_SWITCHES = {
    "FLASH_ATTENTION": "flash_sdp_enabled",
    "EFFICIENT_ATTENTION": "mem_efficient_sdp_enabled",
    "CUDNN_ATTENTION": "cudnn_sdp_enabled",
    "MATH": "math_sdp_enabled",
}
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\s*$")
_MAX_LEN = 128


_PRIORITY = getattr(torch._C, "_get_sdp_priority_order", None)


@functools.lru_cache(maxsize=8)
def _names(order: tuple[int, ...]) -> tuple[str, ...]:
    names = [compat.sdp_backend_name(v) for v in order]
    return tuple(n for n in names if n is not None)


def priority_order() -> list[str]:
    """PyTorch's own order of preference among SDPA backends (``SDPBackend`` names), read at each call."""
    if _PRIORITY is None:
        return []
    return list(_names(tuple(int(v) for v in _PRIORITY())))


#: what a backend that is no kernel of its own is called (MATH is every release's last resort)
_NOT_FUSED = ("MATH", "ERROR", "OVERRIDEABLE")


def better_backends(chosen: str | None) -> list[str]:
    """The backends PyTorch ranks above ``chosen`` (none where it chose none).

    Releases without ``torch._C._get_sdp_priority_order`` (before 2.5) rank
    every fused kernel above MATH and have no order among them to read: there,
    when MATH ran, every fused backend is asked (in ``SDPBackend`` order)."""
    if chosen is None:
        return []
    if _PRIORITY is None and chosen == "MATH":
        names = compat.sdp_backend_names()
        return [names[v] for v in sorted(names) if names[v] not in _NOT_FUSED]
    order = priority_order()
    if chosen not in order:
        return []
    return order[: order.index(chosen)]


def _lengths(lq: int, lk: int) -> tuple[int, int]:
    a, b = min(lq, _MAX_LEN), min(lk, _MAX_LEN)
    if lq < lk and a >= b:
        a = b - 1 if b > 1 else 1
        b = a + 1
    elif lq > lk and a <= b:
        b = a - 1 if a > 1 else 1
        a = b + 1
    elif lq == lk:
        b = a
    return a, b


def _zeros(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    step = int(like.stride(-1)) if like.dim() else 1
    if step != 1:  # the same stride of the last dimension (PyTorch's words quote it)
        t = torch.zeros((*shape, max(step, 2)), dtype=like.dtype, device=like.device)[..., 0]
    else:
        t = torch.zeros(shape, dtype=like.dtype, device=like.device)
    return t.requires_grad_(like.requires_grad and torch.is_grad_enabled() and like.is_floating_point())


def _stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> tuple[Any, ...]:
    lq, lk = _lengths(int(q.shape[-2]), int(k.shape[-2]))
    lead_q = tuple(int(n) for n in q.shape[:-2])
    lead_k = tuple(int(n) for n in k.shape[:-2])
    sq = _zeros(q, (*lead_q, lq, int(q.shape[-1])))
    sk = _zeros(k, (*lead_k, lk, int(k.shape[-1])))
    sv = _zeros(v, (*lead_k, lk, int(v.shape[-1])))
    sm = None
    if isinstance(mask, torch.Tensor):
        full = (*lead_q, lq, lk)
        dims = tuple(1 if int(n) == 1 else full[len(full) - mask.dim() + i] for i, n in enumerate(mask.shape))
        sm = _zeros(mask, dims) if mask.dtype != torch.bool else torch.ones(dims, dtype=torch.bool, device=mask.device)
    return sq, sk, sv, sm


def _flag_getters() -> tuple[Any, ...]:
    cuda = torch.backends.cuda
    return tuple(g for g in (getattr(cuda, n, None) for n in _SWITCHES.values()) if callable(g))


_FLAGS = _flag_getters()


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool,
              scale: Any, gqa: bool, chosen: str | None) -> Hashable:  # fmt: skip
    """What decides the answer: everything the stand-in keeps of the call (read per call: kept cheap)."""
    mask_key = None
    if mask is not None:
        mask_key = (mask.dtype, tuple(n == 1 for n in mask.shape), mask.stride(-1) if mask.dim() else 1)
    qs, ks = q.shape, k.shape
    lq, lk = qs[-2], ks[-2]
    return (q.device, q.dtype, k.dtype, v.dtype, chosen, tuple(g() for g in _FLAGS), qs[:-2], ks[:-2], qs[-1],
            ks[-1], v.shape[-1], min(lq, _MAX_LEN), min(lk, _MAX_LEN), (lq > lk) - (lq < lk), mask_key, is_causal,
            dropout_p > 0, scale, gqa, torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad,
            q.stride(-1), k.stride(-1), v.stride(-1))  # fmt: skip


def _words(caught: list[warnings.WarningMessage], error: BaseException | None) -> list[str]:
    out = [_TRIGGERED.sub("", str(w.message)).strip() for w in caught]
    if error is not None:
        out.append(_TRIGGERED.sub("", f"{type(error).__name__}: {error}").strip())
    return [w for w in out if w]


def _switched_off(backend: str) -> list[str] | None:
    """The switch that turns ``backend`` off at run time, where it is off (forcing it would turn it on)."""
    name = _SWITCHES.get(backend)
    switch = getattr(torch.backends.cuda, name, None) if name else None
    if callable(switch) and switch() is False:
        return [f"torch.backends.cuda.{name}() is False: the backend is switched off"]
    return None


def _force(backend: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """PyTorch's words when ``backend`` alone may run these arguments ([] when it runs them)."""
    off = _switched_off(backend)
    if off is not None:
        return off
    sdpa = compat.raw_sdpa()
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with compat.forced_backend(backend), torch._C.DisableTorchFunction():
                sdpa(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            error = exc
    return _words(list(caught), error) if error is not None else []


def _disturbs_the_user() -> str | None:
    """Why a stand-in call would be seen by something of the user's, or ``None``."""
    if torch.autograd.profiler._is_profiler_enabled:
        return "not asked: a profiler is active (it would record the stand-in call)"
    if torch._C._len_torch_dispatch_stack() > 0:
        return "not asked: a TorchDispatchMode is active (it would see the stand-in call)"
    return None


def refusals(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool,
             scale: Any, gqa: bool, chosen: str | None) -> tuple[dict[str, list[str]] | None, str]:  # fmt: skip
    """For each backend PyTorch ranks above ``chosen``: its words refusing this call ([] = it would run).

    Returns ``(refusals, source)``; ``refusals`` is ``None`` where nothing was
    asked, and ``source`` then says why.
    """
    if any(t.is_nested for t in (q, k, v)):
        return None, NOT_ASKED_NESTED
    if q.device.type not in ("cpu", "cuda"):
        return None, f"not asked: no stand-in is built on {q.device.type}"
    why_not = _disturbs_the_user()
    if why_not is not None:
        return None, why_not
    better = better_backends(chosen)
    if not better:
        return {}, SOURCE_FORCED
    sq, sk, sv, sm = _stand_in(q, k, v, mask)
    kwargs: dict[str, Any] = {"attn_mask": sm, "dropout_p": dropout_p, "is_causal": is_causal}
    if scale is not None:
        kwargs["scale"] = scale
    if gqa:
        kwargs["enable_gqa"] = True
    out: dict[str, list[str]] = {}
    devices = [q.device] if q.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for backend in better:
            out[backend] = _force(backend, (sq, sk, sv), kwargs)
    source = SOURCE_FORCED
    if q.device.type == "cuda":
        checked = paths.sdpa_refusals(sq, sk, sv, sm, dropout_p, is_causal, gqa)
        if checked:
            for backend, words in checked.items():
                if backend in out:
                    out[backend] += [w for w in words if w not in out[backend]]
            source = f"{SOURCE_FORCED}; {SOURCE_CAN_USE}"
    return out, source


#: why nothing is asked for a call on nested tensors
NOT_ASKED_NESTED = "not asked: nested inputs (no stand-in is built for them)"


class RefusalCache:
    """Answers by call signature, asked once per process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[Hashable, tuple[dict[str, list[str]] | None, str]] = {}

    def get(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool,
            scale: Any, gqa: bool, chosen: str | None) -> tuple[dict[str, list[str]] | None, str]:  # fmt: skip
        if not better_backends(chosen):  # PyTorch's first choice ran: nothing to ask, and no signature to build
            return {}, SOURCE_FORCED
        if any(t.is_nested for t in (q, k, v)):  # no signature of ragged sizes, and nothing asked of them
            return None, NOT_ASKED_NESTED
        key = signature(q, k, v, mask, dropout_p, is_causal, scale, gqa, chosen)
        found = self._known.get(key)
        if found is None:
            found = refusals(q, k, v, mask, dropout_p, is_causal, scale, gqa, chosen)
            if found[0] is not None:  # "not asked" answers depend on the moment, not the signature
                with self._lock:
                    self._known[key] = found
        answer = found[0]  # a copy, lists included: a caller editing its record must not edit the next one
        return ({b: list(w) for b, w in answer.items()} if answer is not None else None), found[1]


_CACHE = RefusalCache()


def shared_cache() -> RefusalCache:
    """The process's one cache of answers."""
    return _CACHE
