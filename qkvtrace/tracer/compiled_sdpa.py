"""The SDPA backend of an SDPA call in a Dynamo graph that runs it as PyTorch's own function.

Backends that run the captured graph eagerly (``eager``, ``aot_eager``
before it decomposes, a custom backend that calls the graph) call
``torch._C._nn.scaled_dot_product_attention`` at run time, and PyTorch picks
the kernel then, from the arguments' shapes, strides, dtypes, device and
flags -- nothing in the values. The graph keeps an example of each argument
(``example_value``), so PyTorch's own choice (``torch._fused_sdp_choice``) can
be asked at compile time, once, on empty tensors made to match them: no
guard, no recompile, no call of the graph.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from qkvtrace.facts import paths

__all__ = ["EVIDENCE", "backend_of_node"]

EVIDENCE = ("PyTorch's own choice (torch._fused_sdp_choice) asked at compile time on empty tensors with the "
            "graph's shapes, strides, dtypes and device")  # fmt: skip

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _real(value: Any) -> Any:
    """An empty tensor like the graph's example ``value`` (a fake tensor), or the constant itself."""
    if not isinstance(value, torch.Tensor):
        return value
    t = torch.empty_strided(tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()),
                            dtype=value.dtype, device=value.device)  # fmt: skip
    return t.requires_grad_(value.requires_grad) if value.is_floating_point() else t


def backend_of_node(node: Any) -> str | None:
    """The ``SDPBackend`` name PyTorch picks for the graph's SDPA ``node``; ``None`` when it cannot be asked."""
    args = {name: node.args[i] for i, name in enumerate(_NAMES) if i < len(node.args)}
    args.update({k: v for k, v in node.kwargs.items()})
    values = {}
    for name, arg in args.items():
        values[name] = arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else arg
    if not all(isinstance(values.get(n), torch.Tensor) for n in ("query", "key", "value")):
        return None
    if any(isinstance(v, torch.Tensor) and v.is_nested for v in values.values()):
        return None
    unset = getattr(torch._subclasses.fake_tensor, "unset_fake_temporarily", contextlib.nullcontext)
    try:
        with unset(), torch.no_grad():
            real = {k: _real(v) for k, v in values.items()}
            return paths.sdpa_backend(real["query"], real["key"], real["value"], real.get("attn_mask"),
                                      float(real.get("dropout_p") or 0.0), bool(real.get("is_causal") or False),
                                      real.get("scale"), bool(real.get("enable_gqa") or False))  # fmt: skip
    except (RuntimeError, TypeError, ValueError):  # a symbolic size or an argument it cannot stand in for
        return None
