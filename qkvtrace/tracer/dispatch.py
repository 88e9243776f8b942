"""SDPA's own dispatch, as PyTorch's C++ entry makes it: ``__torch_function__`` overrides first.

Read by the wrappers (:mod:`.install`) and by the SDPA observer
(:mod:`.observers.sdpa`), on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from qkvtrace.tracer import identity

__all__ = ["SHIMS", "overridden", "redispatch_sdpa", "relevant_overrides"]

_SDPA_TENSORS = ("query", "key", "value", "attn_mask")
#: what ``F.scaled_dot_product_attention`` is without qkvtrace: overrides are handed this, as PyTorch's C++ does
_SDPA_BUILTIN = F.scaled_dot_product_attention
#: the stand-ins PyTorch's own code finds in place of the builtin functions while wrappers are installed
SHIMS = identity.Shims()


def relevant_overrides(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """SDPA's tensor arguments that may carry ``__torch_function__`` (as PyTorch's C++ entry checks them)."""
    found = [a for a in args[:4] if a is not None]
    if kwargs:
        found += [kwargs[n] for n in _SDPA_TENSORS[len(args[:4]) :] if kwargs.get(n) is not None]
    return tuple(found)


def overridden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether SDPA's tensor arguments carry ``__torch_function__`` or a mode is active: PyTorch's own check on
    them (which passes over ``None``), asked on every call."""
    n = len(args)
    if n >= 4 or not kwargs:
        return torch.overrides.has_torch_function(args[:4])
    return torch.overrides.has_torch_function((*args, *map(kwargs.get, _SDPA_TENSORS[n:])))


def redispatch_sdpa(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call SDPA as PyTorch would: ``__torch_function__`` overrides first, with ``func`` = PyTorch's builtin."""
    if overridden(args, kwargs):
        relevant = relevant_overrides(args, kwargs)
        SHIMS.meet(relevant)
        return torch.overrides.handle_torch_function(_SDPA_BUILTIN, relevant, *args, **kwargs)
    return original(*args, **kwargs)
