"""What a ``MultiheadAttention`` call's record is made of, read from its arguments, its module and its frames.

The observers of :mod:`.mha` open, run and close a call; these read what
it is: the key a module's slot is checked by, the inputs and masks of its
record, what the call said, the Q/K/V slices of the weights a direct call
passed, its encoder layer's reason and where its attention map comes from.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Hashable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.facts import maps, masks, paths
from qkvtrace.facts.slices import PartSpec, Projection, ProjectionSpec, Rows, whole
from qkvtrace.tracer.build import Target, dtype_name, frame_of, modes, nested_lengths, shape

if TYPE_CHECKING:
    from qkvtrace.tracer.observers.mha import OpenMHA

__all__ = [
    "built_from", "canonical", "core_key", "facts", "fully_masked", "inputs_of", "layer_reason", "map_source",
    "mask_info", "passed_projection", "steady_key",
]  # fmt: skip

_LAYER_FORWARD_CODE = inspect.unwrap(nn.TransformerEncoderLayer.forward).__code__


def steady_key(module: nn.Module, a: dict[str, Any]) -> tuple[Any, ...] | None:
    """The facts of an unmasked ``MultiheadAttention`` call that its record's inputs are made of (:func:`inputs_of`)
    and the backend switches, read from its arguments and module; its slot is checked against them and against
    what the call itself then says (path, reasons, backend, evidence, kernels, what its kernel received).
    ``None`` for a masked call or nested tensors."""
    q, k, v = a["query"], a["key"], a["value"]
    if a["key_padding_mask"] is not None or a["attn_mask"] is not None:
        return None
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)) or q.is_nested or \
            k.is_nested or v.is_nested:  # fmt: skip
        return None
    return (q.shape, k.shape, v.shape, q.dtype, q.device, q is k, k is v, bool(a["need_weights"]),
            bool(a["average_attn_weights"]), bool(a["is_causal"]), module.training, module.batch_first,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
            paths.sdp_flags())  # the switches: PyTorch's refusals of a switched-off backend say so  # fmt: skip


def inputs_of(module: nn.Module, a: Mapping[str, Any], batch_first: bool) -> dict[str, Any]:
    """Shapes, dtype, device, flags and modes of an MHA call, from its bound arguments."""
    query, key, value = a["query"], a["key"], a["value"]
    return {
        "query_shape": shape(query),
        "key_shape": shape(key),
        "value_shape": shape(value),
        "nested_lengths": nested_lengths(query),
        "dtype": dtype_name(getattr(query, "dtype", None)),
        "device": getattr(getattr(query, "device", None), "type", None),
        "batch_first": batch_first,
        "need_weights": bool(a["need_weights"]),
        "average_attn_weights": bool(a["average_attn_weights"]),
        "is_causal": bool(a["is_causal"]),
        "self_attention": query is key and key is value,
        **modes(module),
    }


def passed_projection(module: nn.Module, a: dict[str, Any]) -> Projection | str:
    """The Q/K/V slices of the weights a direct call passed, named as ``module``'s parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    bias = a["in_proj_bias"]
    bias_name = names.get(id(bias)) if bias is not None else None
    query = a["query"]
    e = int(query.shape[-1]) if isinstance(query, torch.Tensor) and not query.is_nested else None
    if e is None:
        return "the query is a nested tensor; the embedding width is unknown"
    rows: list[Rows] = [((0, e),), ((e, 2 * e),), ((2 * e, 3 * e),)]
    if a["use_separate_proj_weight"]:
        weights = [a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]]
        wnames = [names.get(id(w)) if w is not None else None for w in weights]
        if any(n is None for n in wnames):
            return "the q/k/v_proj_weight passed are not parameters of the calling module"
        parts = [PartSpec(n, whole(w), bias_name, r if bias_name else (), 0, _PASSED)  # type: ignore[arg-type]
                 for n, w, r in zip(wnames, weights, rows, strict=True)]  # fmt: skip
        return Projection(module, ProjectionSpec("separate", *parts))
    weight = a["in_proj_weight"]
    wname = names.get(id(weight)) if weight is not None else None
    if wname is None:
        return "the in_proj_weight passed is not a parameter of the calling module"
    parts = [PartSpec(wname, r, bias_name, r if bias_name else (), 0, _PASSED) for r in rows]
    return Projection(module, ProjectionSpec("packed", *parts))


#: the evidence of the slices of weights passed to ``F.multi_head_attention_forward``
_PASSED = "by definition: F.multi_head_attention_forward (in_proj_weight chunked in q, k, v order)"


def fully_masked(ctx: OpenMHA, query: torch.Tensor, kpm_c: Any, attn_c: Any) -> Any:
    """Query rows of an MHA call whose keys are all blocked by PyTorch's canonical masks."""
    module = ctx.module
    batch_first = ctx.batch_first
    if query.dim() == 3:
        b, length = (query.shape[0], query.shape[1]) if batch_first else (query.shape[1], query.shape[0])
    else:
        b, length = 1, query.shape[0]
    heads = int(getattr(module, "num_heads", 0) or ctx.inputs.get("num_heads") or 1)
    with torch.no_grad():
        return masks.count_fully_masked(
            (b, heads, length),
            masks.blocked_by_additive(kpm_c) if isinstance(kpm_c, torch.Tensor) else None,
            masks.blocked_by_additive(attn_c) if isinstance(attn_c, torch.Tensor) else None,
        )


def mask_info(original: Any, canonical: Any) -> dict[str, Any] | None:
    if not isinstance(original, torch.Tensor):
        return None
    with torch.no_grad():
        if isinstance(canonical, torch.Tensor) and canonical.is_floating_point():
            blocked = masks.blocked_by_additive(canonical)
            true_means = masks.true_means_from_canonical(original, canonical)
        else:
            blocked = masks.blocked_by_additive(original) if original.is_floating_point() else original
            true_means = None
        return asdict(masks.mask_info(original, blocked, true_means))


def canonical(mask: Any, name: str, query: Any) -> Any:
    """PyTorch's own reading of a mask (``F._canonical_mask``), for calls whose frame holds none."""
    canonical_mask = getattr(F, "_canonical_mask", None)
    if not isinstance(mask, torch.Tensor) or canonical_mask is None or not isinstance(query, torch.Tensor):
        return None
    try:
        return canonical_mask(mask=mask, mask_name=name, other_type=None, other_name="", target_type=query.dtype)
    except (RuntimeError, TypeError, AssertionError):
        return None


def facts(ctx: OpenMHA, layer_reason: str | None) -> tuple[Any, ...]:
    """What a call said beyond its key (:func:`steady_key`): a slot's call is one that says the same."""
    ops = None if ctx.ops is None else tuple(ctx.ops)
    return (ctx.path, ctx.local.get("why_not_fast_path"), layer_reason, ctx.backend, ctx.evidence, ops,
            tuple(ctx.inputs.items()))  # fmt: skip


def core_key(ctx: OpenMHA, num_heads: Any, given: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None]:
    """The signature the call's backward core is found by, and its number of heads."""
    heads = getattr(ctx.module, "num_heads", None) or num_heads
    a = ctx.bound
    key = ("mha", ctx.path or "unknown", bool(a["need_weights"]), a["query"] is a["key"] and a["key"] is a["value"],
           given)  # fmt: skip
    return key, int(heads) if heads else None


def built_from(ctx: OpenMHA, layer_reason: str | None, projection: Projection | str,
                first: Any) -> tuple[Hashable, tuple[Any, ...]]:  # fmt: skip
    """Everything an unmasked call's record is made from (:func:`inputs_of` and what its kernel added, the path,
    reasons, backend and kernels, the slices) and what PyTorch's refusals for its kernel are asked from, but
    the per-call numbers: a call with the same key and refs is recorded from its module's previous record.
    The kernel's tensors follow from the query's shape, dtype and device, the module and the modes; the
    facts that decide its backend beyond those (dropout, scale, head size, grad, strides) are in
    ``ctx.inputs``."""
    a, module, path = ctx.bound, ctx.module, ctx.path or "unknown"
    q, k, v = a["query"], a["key"], a["value"]
    added = tuple((n, tuple(x) if type(x) is list else x) for n, x in ctx.inputs.items())
    key = (path, None if path == "fast" else ctx.local.get("why_not_fast_path"), layer_reason, ctx.backend,
           None if ctx.ops is None else tuple(ctx.ops), ctx.evidence, q.shape, shape(k), shape(v), q.dtype, q.device,
           ctx.batch_first, bool(a["need_weights"]), bool(a["average_attn_weights"]), bool(a["is_causal"]),
           q is k and k is v, bool(module.training), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
           torch.is_autocast_enabled(), paths.sdp_flags(), added,
           projection if isinstance(projection, str) else None)  # fmt: skip
    if isinstance(projection, str):
        return key, (module,)
    return key, (module, projection, first.norms.qkv(projection))


def map_source(ctx: OpenMHA, kpm_c: Any, attn_c: Any) -> Any:
    """Where this call's attention map comes from (masks as PyTorch canonicalised them), or why none."""
    a = ctx.map_args
    if a is None or ctx.error is not None:
        return None
    if ctx.path not in ("fast", "fallback"):
        return "not computed: no MultiheadAttention path was observed for this call"
    if ctx.path == "fallback" and ctx.kernel_source is not None:
        return ctx.kernel_source  # the Q and K the fallback projected: not projected a second time
    if ctx.kpm is not None and kpm_c is None:
        kpm_c = canonical(ctx.kpm, "key_padding_mask", ctx.query)
    if ctx.attn_mask is not None and attn_c is None:
        attn_c = canonical(ctx.attn_mask, "attn_mask", ctx.query)
    if (ctx.kpm is not None and kpm_c is None) or (ctx.attn_mask is not None and attn_c is None):
        return "not computed: PyTorch's canonical form of the masks could not be read"
    # the fallback hands SDPA is_causal=True instead of the mask when there is no padding mask and no weights
    causal = ctx.path == "fallback" and bool(a["is_causal"]) and kpm_c is None and not a["need_weights"]
    if ctx.canonical:
        return maps.function_source(a, kpm_c, attn_c, causal)
    module = ctx.module
    return maps.mha_source(module, a["query"], a["key"], kpm_c, attn_c, batch_first=bool(module.batch_first),
                           causal=causal)  # fmt: skip


def layer_reason(mha: nn.Module, targets: list[Target]) -> str | None:
    """The enclosing encoder layer's ``why_not_sparsity_fast_path``, verbatim, read from its frame; ``None``
    without looking where no trace recording the call has an encoder layer."""
    for t, _, _ in targets:
        if t.has_layers:
            break
    else:
        return None
    frame = frame_of(_LAYER_FORWARD_CODE, sys._getframe(2))
    if frame is None:
        return None
    local = frame.f_locals
    if getattr(local.get("self"), "self_attn", None) is not mha:
        return None
    reason = local.get("why_not_sparsity_fast_path")
    return reason if isinstance(reason, str) else None
