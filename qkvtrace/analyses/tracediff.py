"""What changed between two traces of a model: ``qkvtrace diff A.json B.json``.

Two traces of the same model -- made under two PyTorch releases, before and
after a change of yours, in training and in eval -- are set side by side
call by call. Calls are matched by module name and by their order among the
calls of that module (the second call of ``layers.3.self_attn`` in A with
the second in B); a call present on one side only appeared or vanished.

For each matched pair the facts PyTorch decides are compared exactly (path,
SDPA backend, PyTorch's reasons, the words refusing faster backends, the
aten kernels, how each mask was read, dtype, NaN and fully-masked rows --
these only between traces that count them alike, see docs/json.md) and
the measured norms within a relative tolerance (Q/K/V weight and activation
norms per slice, and the gradient norms of the module's last backward pass).
Nothing here needs PyTorch: traces made elsewhere compare anywhere.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from qkvtrace.base.errors import SchemaError
from qkvtrace.base.traceversions import fully_masked_comparable

__all__ = ["TRACEDIFF_SCHEMA", "diff_traces", "is_trace"]

TRACEDIFF_SCHEMA = "qkvtrace.tracediff/1"

#: facts compared exactly, with the words used for them in the output
_EXACT = (
    ("path", "path"),
    ("sdpa_backend", "SDPA backend"),
    ("why_not_fast_path", "why not fast"),
    ("why_not_fused_layer", "why not the fused layer"),
    ("sdpa_refusals", "why not a faster kernel"),
    ("aten_ops", "aten kernels"),
    ("backward_kernel", "backward kernel"),
    ("error", "error"),
)
_INPUTS = ("dtype", "device", "training", "grad_enabled", "need_weights", "is_causal", "dropout_p")
_MASKS = ("attn_mask", "key_padding_mask", "merged_mask")
_MASK_FACTS = ("kind", "dtype", "shape", "true_means", "blocked", "variant")
_OUTPUT = ("nan_count", "fully_masked_rows")
_NORMS = ("weight_norm", "bias_norm", "activation_norm")
_GRAD_NORMS = ("grad_norm", "bias_grad_norm")


def is_trace(document: Any) -> bool:
    """A ``qkvtrace.trace/N`` document (any version of the trace schema)."""
    return isinstance(document, dict) and str(document.get("schema", "")).startswith("qkvtrace.trace/")


def _keyed_calls(trace: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    seen: dict[str, int] = defaultdict(int)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for call in sorted(trace.get("calls", []), key=lambda c: c.get("index", 0)):
        module = call.get("module", "")
        out[(module, seen[module])] = call
        seen[module] += 1
    return out


def _last_grads(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per module, the gradient record of its last backward pass."""
    out: dict[str, dict[str, Any]] = {}
    for g in sorted(trace.get("gradients", []), key=lambda g: g.get("backward_index", 0)):
        out[g.get("module", "")] = g
    return out


def _moved(x: Any, y: Any, rtol: float) -> bool:
    if x is None or y is None:
        return (x is None) != (y is None)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) != math.isnan(y)
        return abs(x - y) > rtol * max(abs(x), abs(y), 1e-12)
    return bool(x != y)


def _mask_view(mask: Any) -> Any:
    if not isinstance(mask, dict):
        return mask
    return {k: mask.get(k) for k in _MASK_FACTS if k in mask}


def _call_changes(a: dict[str, Any], b: dict[str, Any], ga: dict[str, Any] | None, gb: dict[str, Any] | None,
                  rtol: float, outputs: tuple[str, ...] = _OUTPUT) -> list[dict[str, Any]]:  # fmt: skip
    changes: list[dict[str, Any]] = []

    def note(field: str, label: str, was: Any, became: Any, kind: str) -> None:
        changes.append({"field": field, "label": label, "was": was, "became": became, "kind": kind})

    both_sdpa = a.get("sdpa_backend") is not None and b.get("sdpa_backend") is not None
    for key, label in _EXACT:
        if key == "sdpa_refusals" and not both_sdpa:  # no SDPA kernel on one side: the backend change says it
            continue
        if a.get(key) != b.get(key):
            note(key, label, a.get(key), b.get(key), "exact")
    ia, ib = a.get("inputs") or {}, b.get("inputs") or {}
    for key in _INPUTS:
        if key in ia and key in ib and ia[key] != ib[key]:  # a fact one path does not record is not a change
            note(f"inputs.{key}", key.replace("_", " "), ia[key], ib[key], "exact")
    for key in _MASKS:
        ma, mb = _mask_view(ia.get(key)), _mask_view(ib.get(key))
        if ma != mb:
            note(f"inputs.{key}", key.replace("_", " "), ma, mb, "exact")
    oa, ob = a.get("output") or {}, b.get("output") or {}
    for key in outputs:
        if oa.get(key) != ob.get(key):
            note(f"output.{key}", key.replace("_", " "), oa.get(key), ob.get(key), "exact")
    qa, qb = a.get("qkv") or {}, b.get("qkv") or {}
    if qa.get("layout") != qb.get("layout"):
        note("qkv.layout", "Q/K/V layout", qa.get("layout"), qb.get("layout"), "exact")
    for part in ("q", "k", "v"):
        pa, pb = qa.get(part) or {}, qb.get(part) or {}
        for key in _NORMS:
            if _moved(pa.get(key), pb.get(key), rtol):
                note(f"qkv.{part}.{key}", f"|{part.upper()}| {key.removesuffix('_norm')}", pa.get(key),
                     pb.get(key), "norm")  # fmt: skip
    if ga is not None or gb is not None:
        for part in ("q", "k", "v"):
            pa = (ga or {}).get(part) or {}
            pb = (gb or {}).get(part) or {}
            for key in _GRAD_NORMS:
                if _moved(pa.get(key), pb.get(key), rtol):
                    note(f"gradients.{part}.{key}", f"|d{part.upper()}| {key.removesuffix('_norm')}",
                         pa.get(key), pb.get(key), "norm")  # fmt: skip
    return changes


def diff_traces(a: dict[str, Any], b: dict[str, Any], *, rtol: float = 1e-4) -> dict[str, Any]:
    """The ``qkvtrace.tracediff/1`` object of trace ``a`` → trace ``b``.

    ``rtol``: the relative change a norm may make without being reported.
    """
    for name, doc in (("trace A", a), ("trace B", b)):
        if not is_trace(doc):
            raise SchemaError(f"{name}: expected a qkvtrace.trace file, got {doc.get('schema')!r}")
    ca, cb = _keyed_calls(a), _keyed_calls(b)
    gra, grb = _last_grads(a), _last_grads(b)
    comparable = fully_masked_comparable(a.get("schema"), b.get("schema"))
    outputs = _OUTPUT if comparable else tuple(k for k in _OUTPUT if k != "fully_masked_rows")
    changed: list[dict[str, Any]] = []
    for key in sorted(ca.keys() & cb.keys(), key=lambda k: ca[k].get("index", 0)):
        module = key[0]
        found = _call_changes(ca[key], cb[key], gra.get(module) if key[1] == 0 else None,
                              grb.get(module) if key[1] == 0 else None, rtol, outputs)  # fmt: skip
        if found:
            changed.append({"module": module, "occurrence": key[1], "index_a": ca[key].get("index"),
                            "index_b": cb[key].get("index"), "changes": found})  # fmt: skip

    def brief(call: dict[str, Any], occurrence: int) -> dict[str, Any]:
        return {"module": call.get("module", ""), "occurrence": occurrence, "index": call.get("index"),
                "path": call.get("path"), "sdpa_backend": call.get("sdpa_backend")}  # fmt: skip

    vanished = [brief(ca[k], k[1]) for k in sorted(ca.keys() - cb.keys(), key=lambda k: ca[k].get("index", 0))]
    appeared = [brief(cb[k], k[1]) for k in sorted(cb.keys() - ca.keys(), key=lambda k: cb[k].get("index", 0))]
    result: dict[str, Any] = {
        "schema": TRACEDIFF_SCHEMA,
        "a": {"torch_version": a.get("torch_version"), "calls": len(ca)},
        "b": {"torch_version": b.get("torch_version"), "calls": len(cb)},
        "rtol": rtol,
        "changed": changed,
        "appeared": appeared,
        "vanished": vanished,
    }
    result["summary"] = _summary(result)
    if not comparable:
        result["summary"] += (f"; fully-masked rows not compared: {a.get('schema')} and {b.get('schema')} count "
                              "them differently (since qkvtrace.trace/3 every (batch, head, query) row)")  # fmt: skip
    return result


def _calls(n: int) -> str:
    return f"{n} call{'' if n == 1 else 's'}"


def _summary(d: dict[str, Any]) -> str:
    a, b = d["a"], d["b"]
    head = f"torch {a['torch_version']} ({_calls(a['calls'])}) → {b['torch_version']} ({_calls(b['calls'])})"
    fields: dict[str, int] = defaultdict(int)
    for call in d["changed"]:
        for ch in call["changes"]:
            fields[ch["label"]] += 1
    parts = [f"{label} changed in {_calls(n)}" for label, n in sorted(fields.items())]
    if d["appeared"]:
        parts.append(f"{len(d['appeared'])} call(s) appeared")
    if d["vanished"]:
        parts.append(f"{len(d['vanished'])} call(s) vanished")
    return f"{head}: " + ("; ".join(parts) if parts else "no change in what ran")
