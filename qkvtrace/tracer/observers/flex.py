"""``torch.nn.attention.flex_attention.flex_attention``: path ``flex``.

FlexAttention runs a higher-order operator rather than an SDPA kernel, so a
call records no ``sdpa_backend``; its ``aten_ops`` are the profiler's events
of that operator (e.g. ``FlexAttentionAutogradOp``), with the same evidence
rules as every other call. ``score_mod`` and ``block_mask`` are recorded by
presence and name; the fully masked rows are counted from the block mask's
own ``mask_mod`` (on the device, no host read), and are ``null`` with a
reason where a ``score_mod`` could mask as well.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from qkvtrace.facts import paths, routes
from qkvtrace.records import AttentionCall
from qkvtrace.tracer import registry
from qkvtrace.tracer.build import deliver, modes, nan_count, shape, wants_backward
from qkvtrace.tracer.observers.mha import arg

__all__ = ["observe_flex"]

_FLEX_ARGS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa")
_EVIDENCE = paths.shared_evidence()


def _name(fn: Any) -> str | None:
    if fn is None:
        return None
    return getattr(fn, "__qualname__", None) or type(fn).__name__


#: most (batch x heads x query x key) entries of a block mask evaluated to count its fully masked rows
_MAX_MASK_ENTRIES = 1 << 24


def _fully_masked(q: Any, block_mask: Any, score_mod: Any) -> tuple[Any, str | None]:
    """Query rows whose keys are all masked (a 0-dim tensor on the device), or ``None`` and why.

    No block mask and no ``score_mod``: nothing masks, 0 rows. A block mask: its
    ``mask_mod`` evaluated over every position (``create_mask``), inside the
    blocks it keeps (``to_dense``), counted per (batch, head, query) row of
    the kernel, whatever the mask's own shape. A ``score_mod`` can mask too (by
    returning ``-inf``), and only running it on the scores would tell.
    """
    if not isinstance(q, torch.Tensor) or q.is_nested:
        return None, "not counted: the query is not a plain tensor"
    if score_mod is not None:
        return None, "not counted: a score_mod can mask positions (by returning -inf) that only its scores show"
    if block_mask is None:
        return 0, None
    from torch.nn.attention.flex_attention import create_mask

    b, h, lq, lk = (int(n) for n in block_mask.shape)
    if b * h * lq * lk > _MAX_MASK_ENTRIES:
        return None, f"not counted: the block mask has {b * h * lq * lk} entries (more than {_MAX_MASK_ENTRIES})"
    with torch.no_grad():
        keep = create_mask(block_mask.mask_mod, b, h, lq, lk, device=q.device)  # [b, h, lq, lk], True = attend
        bq, bk = block_mask.BLOCK_SIZE
        blocks = block_mask.to_dense().to(q.device).bool()  # [b, h, lq / bq, lk / bk]
        keep &= blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :lq, :lk]
        fully = (~keep).all(-1)  # [b, h, lq]: b and h are 1 where one mask serves every batch item or head
        try:  # counted per (batch, head, query) row of the kernel
            rows = fully.expand(torch.broadcast_shapes(fully.shape, q.shape[:-1]))
        except RuntimeError:
            return None, f"not counted: a block mask of shape {[b, h, lq, lk]} for a query of {list(q.shape)}"
    return rows.sum(), None


def observe_flex(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not registry.is_active():
        return original(*args, **kwargs)
    found = registry.owner_module(sys._getframe(1))
    if found is None:
        return original(*args, **kwargs)
    owner, covering = found
    targets = [(t, name, t.take_index()) for t, name in covering]
    q = arg(args, kwargs, _FLEX_ARGS, "query")
    k = arg(args, kwargs, _FLEX_ARGS, "key")
    v = arg(args, kwargs, _FLEX_ARGS, "value")
    score_mod = arg(args, kwargs, _FLEX_ARGS, "score_mod")
    block_mask = arg(args, kwargs, _FLEX_ARGS, "block_mask")
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    sig = ("flex", q.device.type, q.dtype, score_mod is None, block_mask is None, grad)
    error = None
    out: Any = None
    try:
        out, ops, evidence = _EVIDENCE.run(sig, original, *args, _select=paths.is_flex_op, **kwargs)
    except BaseException as exc:
        error, ops, evidence = f"{type(exc).__name__}: {exc}", None, "unavailable: the call raised"
        raise
    finally:
        first = targets[0][0]
        projection = first.projection(owner, (q, k, v))
        rows, rows_reason = _fully_masked(q, block_mask, score_mod)
        result = out[0] if isinstance(out, tuple) else out
        call = AttentionCall(
            index=-1,
            module="",
            module_type=type(owner).__name__,
            path="flex",
            why_not_fast_path=None,
            why_not_fused_layer=None,
            sdpa_backend=None,
            aten_ops=ops,
            inputs={
                "query_shape": shape(q),
                "key_shape": shape(k),
                "value_shape": shape(v),
                "dtype": str(getattr(q, "dtype", None)),
                "device": getattr(getattr(q, "device", None), "type", None),
                "score_mod": _name(score_mod),
                "block_mask": None if block_mask is None else type(block_mask).__name__,
                "enable_gqa": bool(arg(args, kwargs, _FLEX_ARGS, "enable_gqa", False)),
                **modes(owner),
            },
            qkv=first.norms.qkv(projection),
            output={"nan_count": nan_count(result) if error is None else None, "fully_masked_rows": rows,
                    "fully_masked_rows_reason": rows_reason},
            error=error,
            evidence=evidence,
        )
        core = routes.find_core(result, (q, k, v)) if error is None and wants_backward(targets) else None
        deliver(call, targets, owner, projection, core)
    return out
