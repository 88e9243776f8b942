"""Attention written by hand, made into a record once its probabilities meet V (see :mod:`.handwritten`)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qkvtrace.facts import patterns, routes
from qkvtrace.facts.health import hand_written_inputs
from qkvtrace.records import AttentionCall
from qkvtrace.tracer import folded, registry
from qkvtrace.tracer.build import Target, deliver, modes, nan_count, qkv_info, shape, wants_backward, wants_maps

if TYPE_CHECKING:
    from qkvtrace.tracer.observers.handwritten_ops import Node

__all__ = ["EVIDENCE", "PATH", "record"]

PATH = "hand_written"
#: ``aten_ops`` stay empty: no attention kernel runs; ``inputs["form"]`` lists the torch functions the module called
EVIDENCE = "unavailable: attention written by hand runs no attention kernel; inputs.form lists the functions it called"

#: why the count and the map of scores assembled from pieces (``torch.cat``) are left out
_PIECE_MASKED = "not counted: a piece of the scores was masked before torch.cat joined them (keys are not positions)"
_ASSEMBLED_MAP = ("not computed: the scores were assembled from pieces with torch.cat, so their key axis is the "
                  "pieces side by side, not key positions")  # fmt: skip


#: folders whose frames are not the model's code: PyTorch's and the tracer's own
_NOT_THE_MODEL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _site(frame: Any) -> str | None:
    """``file:line`` of the innermost frame in the model's own code: the line whose ``@ v`` completes the attention."""
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_NOT_THE_MODEL):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def record(node: Node, form: tuple[str, ...], v: torch.Tensor, out: torch.Tensor, seen_heads: int | None) -> None:
    """Record the attention that ``node``'s probabilities times ``v`` made (``out``), for the traces covering
    the innermost traced module on the stack; ``seen_heads``: heads the module was seen folding into dim 0."""
    found = registry.owner_module(sys._getframe())
    if found is None:
        return
    owner, covering = found
    targets: list[Target] = [(t, name, t.take_index()) for t, name in covering]
    q, k, probs = node.q, node.k, node.probs
    assert probs is not None
    first = targets[0][0]
    projection = first.projection(owner, (q, k, v))
    final = tuple(probs.shape)
    blocked, bias = patterns.combine(list(node.terms), final)
    scale, cap = patterns.scale_and_cap(node.steps)
    qkv = qkv_info(first, projection, (q, k, v))
    heads, heads_evidence = _heads_of(node, owner, v, seen_heads) if q.dim() == 3 else (None, None)
    rows: Any = None if node.piece_masked else 0
    mask = None
    if blocked is not None and not node.piece_masked:
        with torch.no_grad():
            rows = blocked.all(dim=-1).expand(final[:-1]).sum()
            dtypes = sorted({str(t.tensor.dtype) for t in node.terms})
            mask = {"kind": "bool" if all(t.kind != "add" for t in node.terms) else "float", "dtype": dtypes[0],
                    "shape": list(blocked.shape), "true_means": None, "blocked": blocked.sum(),
                    "total": blocked.numel(), "blocked_positions": None,
                    "pattern": patterns.mask_kind(blocked)}  # fmt: skip
    call = AttentionCall(
        index=-1,
        module="",
        module_type=type(owner).__name__,
        path=PATH,
        why_not_fast_path=None,
        why_not_fused_layer=None,
        sdpa_backend=None,
        aten_ops=None,
        inputs={
            "query_shape": shape(q),
            "key_shape": shape(k.transpose(-2, -1) if node.transposed else k),
            "value_shape": shape(v),
            "dtype": str(q.dtype),
            "device": q.device.type,
            "attn_mask": mask,
            "bias": patterns.bias_kind(bias, blocked),
            "is_causal": None,
            "dropout_p": node.dropout_p,
            "scale": scale,
            "softcap": cap,
            "softmax_dtype": node.softmax_dtype,
            "form": " → ".join(form),
            "site": _site(sys._getframe()),
            **({"heads": {"count": heads, "evidence": heads_evidence}} if q.dim() == 3 else {}),
            **({"assembled": {"pieces": node.pieces, "keys": final[-1]}} if node.pieces else {}),
            **modes(owner),
        },
        qkv=qkv,
        output={"nan_count": nan_count(out), "fully_masked_rows": rows,
                **({"fully_masked_rows_reason": _PIECE_MASKED} if node.piece_masked else {})},
        evidence=EVIDENCE,
    )
    # routes need one Q, K, V: scores assembled from pieces have a K and a V per piece (rows and norms: the first's)
    core = routes.sdpa_core(out, q, k, v, heads=heads) if wants_backward(targets) and not node.pieces else None
    source: Any = folded.ProbsSource(probs, blocked, node.dropout_p, heads, heads_evidence, hand_written_inputs(
        q, k, node.transposed, heads, scale, cap, bias, blocked)) if wants_maps(targets) else None  # fmt: skip
    if source is not None and node.pieces:
        source = _ASSEMBLED_MAP
    deliver(call, targets, owner, projection, core, source)


def _heads_of(node: Node, owner: nn.Module, v: torch.Tensor, seen: int | None) -> tuple[int | None, str | None]:
    """The heads folded into dimension 0 of ``[B·H, T, d]`` Q, K, V: from the dataflow, else the module's word."""
    if seen is not None:
        return seen, "dataflow: the module reshaped [B, H, T, d] into [B·H, T, d]"
    heads, how = folded.heads_in((node.q, node.k, v))
    if heads is not None:
        return heads, how
    heads = folded.module_heads(owner)
    if heads is not None:
        return heads, f"the module's own attribute ({type(owner).__name__} says {heads} heads)"
    return None, "not shown: no reshape from [B, H, T, d] in the dataflow, and no head count on the module"
