"""The fused encoder layer: ``torch._transformer_encoder_layer_fwd``.

On this path ``TransformerEncoderLayer.forward`` hands the whole layer to one
builtin and ``self_attn``'s own forward never runs, so a hook on it would see
nothing (and a hook on the layer would switch the fused path off). The
wrapper finds the layer in the caller's frame and records the call under
``self_attn``'s name, with its Q/K/V slices.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from qkvtrace.facts import maps, masks, paths, routes
from qkvtrace.records import AttentionCall
from qkvtrace.tracer import registry
from qkvtrace.tracer.build import (
    count_again,
    counts_only,
    deliver,
    frame_of,
    modes,
    nan_count,
    nested_lengths,
    shape,
    wants_maps,
)
from qkvtrace.tracer.monitor import combination_key, mask_kind
from qkvtrace.tracer.observers.mha import arg

__all__ = ["observe_layer"]

_LAYER_FORWARD_CODE = inspect.unwrap(nn.TransformerEncoderLayer.forward).__code__
_EVIDENCE = paths.shared_evidence()

_LAYER_FWD_ARGS = (
    "src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
    "use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2",
    "norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask",
    "mask_type",
)  # fmt: skip


def observe_layer(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not registry.is_active():
        return original(*args, **kwargs)
    frame = frame_of(_LAYER_FORWARD_CODE, sys._getframe(1))
    layer = frame.f_locals.get("self") if frame is not None else None
    mha = getattr(layer, "self_attn", None)
    if not isinstance(layer, nn.Module) or not isinstance(mha, nn.MultiheadAttention):
        return original(*args, **kwargs)
    found = registry.covering(mha)
    if not found:
        return original(*args, **kwargs)
    targets = [(t, name, t.take_index()) for t, name in found]
    src = arg(args, kwargs, _LAYER_FWD_ARGS, "src")
    mask = arg(args, kwargs, _LAYER_FWD_ARGS, "mask")
    mask_type = arg(args, kwargs, _LAYER_FWD_ARGS, "mask_type")
    key = ("layer_fwd", src.device.type, src.dtype, src.is_nested, mask is None, mask_type,
           bool(arg(args, kwargs, _LAYER_FWD_ARGS, "norm_first")))  # fmt: skip
    out, ops, evidence = _EVIDENCE.run(key, original, *args, **kwargs)
    backend = _EVIDENCE.backend_of(src.device.type, ops) if ops is not None else None
    length = src.shape[1] if not src.is_nested else 0
    rows: Any = 0
    blocked = None
    if isinstance(mask, torch.Tensor):
        with torch.no_grad():
            blocked = masks.blocked_by_additive(mask) if mask.is_floating_point() else mask
            kpm = blocked if mask_type == 1 else None
            attn = blocked if mask_type != 1 else None
            rows = masks.count_fully_masked((src.shape[0], mha.num_heads, length), kpm, attn)
    if counts_only(targets):  # a long run: a call with the layer's previous combination is only counted
        combo = combination_key(path="fused_encoder_layer", sdpa_backend=backend, dtype=str(src.dtype),
                                training=bool(layer.training), merged_mask=mask_kind(mask))
        if count_again(targets, combo, backend, lambda: {"nan_count": nan_count(out), "fully_masked_rows": rows}):
            return out
    mask_record = None
    if blocked is not None:  # a mask was given
        with torch.no_grad():
            mask_record = asdict(masks.mask_info(mask, blocked, None))
    first = targets[0][0]
    projection = first.projection(mha)
    call = AttentionCall(
        index=-1,
        module="",
        module_type=type(mha).__name__,
        path="fused_encoder_layer",
        why_not_fast_path=None,
        why_not_fused_layer=None,
        sdpa_backend=backend,
        aten_ops=ops,
        inputs={
            "query_shape": shape(src),
            "nested_lengths": nested_lengths(src),
            "dtype": str(src.dtype),
            "device": src.device.type,
            "batch_first": bool(mha.batch_first),  # the fused path runs only when it is True
            "need_weights": None,
            "merged_mask": mask_record,
            "mask_type": mask_type,
            "is_causal": _is_causal(frame),
            "reasons": {"need_weights": "the fused encoder layer computes no attention weights "
                                        "(torch._transformer_encoder_layer_fwd takes no need_weights)"},
            **modes(layer),
        },
        qkv=first.norms.qkv(projection),
        output={"nan_count": nan_count(out), "fully_masked_rows": rows},
        evidence=evidence,
    )
    source = None
    if wants_maps(targets):  # from the builtin's own arguments: src, its first norm, qkv weights, merged mask
        a = {n: arg(args, kwargs, _LAYER_FWD_ARGS, n) for n in _LAYER_FWD_ARGS}
        source = maps.LayerSource(src, int(a["num_heads"]), a["qkv_weight"], a["qkv_bias"], bool(a["norm_first"]),
                                  float(a["eps"]), a["norm_weight_1"], a["norm_bias_1"], mask, mask_type)  # fmt: skip
    deliver(call, targets, mha, projection, routes.Core(None, _no_backward(out)), source)
    return out


def _is_causal(frame: Any) -> bool | None:
    """``is_causal`` as the layer's forward received it (a hint about ``src_mask``; the fused builtin
    takes the merged mask only)."""
    value = frame.f_locals.get("is_causal") if frame is not None else None
    return None if value is None else bool(value)


def _no_backward(out: Any) -> str:
    reason = routes.no_graph_reason(out)
    # the fused layer runs only where PyTorch builds no graph; say so if that ever changes
    return reason or "the fused encoder layer's output has a grad_fn, but no attention node is recorded for it"
