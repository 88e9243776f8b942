"""Plain records of what a trace observed, and their JSON form.

Collectors build these; renderers read them. No record holds a live module,
and only the optional attention maps are tensors (CPU copies, written to the
JSON only when asked for): everything else is strings, numbers, shapes and
lists of them, so a record outlives the model and serialises to the
``qkvtrace.trace/3`` JSON of DESIGN.md without PyTorch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qkvtrace.base.errors import SchemaError
from qkvtrace.base.files import atomic_write_text
from qkvtrace.base.traceversions import TRACE_SCHEMA, TRACE_SCHEMAS, read_older_call

#: how records are shown -- HTML fragments and pages, a terminal line -- by name: made by the views, a floor above
#: the records (:mod:`qkvtrace.render.views` hands them in here when it is imported, and the package's
#: ``__init__`` imports it first, so a record always finds them)
VIEWS: dict[str, Callable[..., Any]] = {}

__all__ = [
    "TRACE_SCHEMA",
    "TRACE_SCHEMAS",
    "AttentionCall",
    "CompiledAttention",
    "GradientRecord",
    "MapTensors",
    "MaskInfo",
    "QKVInfo",
    "RouteGrad",
    "RouteRecord",
    "SliceGrad",
    "SliceInfo",
    "TraceResult",
    "Unobserved",
    "atomic_write_text",
    "call_dict",
    "kernel_refusal",
    "rows_label",
    "squared_shares",
]

#: The paths an attention call can take (DESIGN.md, "Vocabulary"). A call
#: whose wrapper evidence is missing (a future PyTorch routing elsewhere) says "unknown".
PATHS = ("fast", "fallback", "fused_encoder_layer", "sdpa", "flex", "hand_written")

#: ``evidence`` of a call's ``aten_ops``: seen by qkvtrace's own profiler run of
#: this call, or of an identical call signature earlier in this process; else
#: ``"unavailable: <why>"`` with ``aten_ops`` null.
EVIDENCE_WITNESSED = "witnessed"
EVIDENCE_CACHED = "cached"


@dataclass(slots=True)
class MaskInfo:
    """One mask argument as the call received it."""

    #: ``"bool"`` or ``"float"`` (any floating dtype).
    kind: str
    #: ``str(tensor.dtype)``, e.g. ``"torch.bool"``.
    dtype: str
    shape: list[int]
    #: What ``True`` means for this argument of this API, as measured on the
    #: running PyTorch (``"attend"`` or ``"ignore"``); ``None`` for float masks.
    true_means: str | None
    #: How many entries block attention (``-inf`` for float masks).
    blocked: int
    total: int
    #: Index tuples of the blocked entries, only for masks of at most 64 entries.
    blocked_positions: list[list[int]] | None = None


@dataclass(slots=True)
class SliceInfo:
    """The Q, K or V part of a projection at the time of the call."""

    #: Parameter name relative to the module holding the projection, e.g. ``"in_proj_weight"``.
    param: str | None
    #: The rows of ``param`` this part is made of, as ``[start, stop)`` ranges
    #: (one per head where heads are interleaved); ``None`` when unknown.
    rows: list[list[int]] | None
    shape: list[int] | None
    weight_norm: float | None
    #: Parameter holding this slice's bias (``None`` when there is none).
    bias_param: str | None = None
    bias_norm: float | None = None
    #: Norm of the projected tensor handed to the kernel (only where the
    #: tracer sees it: direct SDPA calls); ``None`` elsewhere.
    activation_norm: float | None = None
    #: The weight dimension ``rows`` index: 0 for ``nn.Linear``-style ``[out, in]``
    #: weights, 1 for ``Conv1D``-style ``[in, out]`` weights (then ``rows`` are columns).
    dim: int = 0
    #: How ``rows`` are known: ``"dataflow: autograd graph"`` (derived from what
    #: the call did), ``"by definition: ..."`` (``nn.MultiheadAttention``), or
    #: ``"by shape"`` / ``"by name"`` (a hypothesis, for modules with no call).
    evidence: str | None = None
    #: Other weights this part is also made from, each a slice of its own (latent attention's K takes a
    #: rotary part from a second projection); the norms above are then those of all the rows together.
    also: list[SliceInfo] | None = None


@dataclass(slots=True)
class QKVInfo:
    """How the Q/K/V projection of a call is stored."""

    #: ``"packed"`` (one weight, each part one range of rows), ``"interleaved"``
    #: (one weight, a part in several ranges: per-head layouts), ``"separate"``
    #: (a weight per part), ``"mixed"``, or ``None`` when the slices are not known.
    layout: str | None
    q: SliceInfo | None
    k: SliceInfo | None
    v: SliceInfo | None
    #: Dotted name (in the trace) of the module holding the projection, when it
    #: is not the call's own module (e.g. the parent of a small "attend" module).
    holder: str | None = None
    #: Why the slices are not known (``layout`` is ``None``), in words.
    reason: str | None = None


#: The faster SDPA backends in the order qkvtrace asks PyTorch about them (flash first).
_REFUSAL_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def kernel_refusal(refusals: Mapping[str, Sequence[str]] | None) -> tuple[str, str] | None:
    """``(backend, reason)``: the best-ranked backend PyTorch refused with a reason of its own, or ``None``.

    ``refusals`` is a call's ``sdpa_refusals``; backends are ranked in the
    order ``_REFUSAL_ORDER`` gives, never in the mapping's own order (a
    report read back from JSON has its keys sorted). PyTorch's lines that only introduce the reasons ("... not
    used because:") or abort ("RuntimeError: No available kernel ...") are
    left out; a backend whose only words are such an error (one this device
    does not have) is skipped.
    """
    ranked = sorted((refusals or {}).items(), key=lambda kv: (*_REFUSAL_ORDER, kv[0]).index(kv[0]))
    for backend, words in ranked:
        reasons = [w for w in words if not w.rstrip().endswith(":") and not w.startswith("RuntimeError: No ")]
        if reasons:
            return backend, " ".join(" ".join(w.split()) for w in reasons)
    return None


@dataclass(slots=True)
class AttentionCall:
    """One execution of an attention operation observed during a trace."""

    index: int
    #: Dotted module name inside the traced model, ``""`` for the root.
    module: str
    module_type: str
    #: ``fast``, ``fallback``, ``fused_encoder_layer``, ``sdpa``, ``flex`` or ``hand_written``
    #: (matmul, softmax, matmul in the model's own code).
    path: str
    #: PyTorch's own reason, verbatim; ``None`` when the fast path ran or the
    #: call never went through ``MultiheadAttention.forward``.
    why_not_fast_path: str | None
    #: The reason of the enclosing ``TransformerEncoderLayer`` for not taking
    #: its fused path, verbatim; ``None`` when no encoder layer made the call.
    why_not_fused_layer: str | None
    #: ``SDPBackend`` member name of the kernel that ran, ``None`` if no SDPA ran.
    sdpa_backend: str | None
    #: ``aten::...`` names of the attention kernels that ran for the call;
    #: ``None`` when there is no evidence (see ``evidence``).
    aten_ops: list[str] | None
    #: Shapes, dtypes, masks and modes of the call.
    inputs: dict[str, Any]
    qkv: QKVInfo
    #: ``nan_count`` and ``fully_masked_rows`` of the result.
    output: dict[str, Any]
    #: For each SDPA backend PyTorch ranks above the one it chose, its own words refusing
    #: this call, verbatim (``[]``: it would have run it); ``{}`` when none ranks higher;
    #: ``None`` when not asked (``sdpa_refusals_source`` says why).
    sdpa_refusals: dict[str, list[str]] | None = None
    #: Where ``sdpa_refusals`` come from (the backend forced on a stand-in of the call,
    #: and on CUDA also ``can_use_*(debug=True)``), or why they were not asked.
    sdpa_refusals_source: str | None = None
    #: The exception the call raised (the trace records it; it still propagates).
    error: str | None = None
    #: Where ``aten_ops`` come from: ``"witnessed"`` (qkvtrace's profiler saw this
    #: call), ``"cached"`` (it saw an identical call signature earlier in this
    #: process) or ``"unavailable: <why>"`` (then ``aten_ops`` is ``None``).
    evidence: str = EVIDENCE_WITNESSED
    #: Name of the thread that made the call (``threading.current_thread().name``).
    thread: str | None = None
    #: This process's rank and the world size under ``torch.distributed``; ``None`` outside it.
    rank: int | None = None
    world_size: int | None = None
    #: The autograd node that runs the attention core of this call in the backward
    #: pass, read from the output's ``grad_fn`` graph when the call ran: a fused node
    #: (``ScaledDotProductFlashAttentionForCpuBackward0``) or an explicit-softmax
    #: chain (``"SoftmaxBackward0 + BmmBackward0"``); ``None`` with ``backward_reason``.
    backward_kernel: str | None = None
    backward_reason: str | None = None
    #: Why no gradient route of this call is recorded although it has a backward
    #: graph; ``None`` when routes are recorded (see ``TraceResult.routes``).
    route_reason: str | None = None
    #: With ``trace(model, attention_maps=True)``: the tensors of the call's map
    #: (read them as ``attention_map`` and ``attention_map_fully_masked``).
    map_tensors: MapTensors | None = None
    #: Which heads and batch items ``attention_map`` holds (indices in the call).
    attention_map_heads: list[int] | None = None
    attention_map_batch: list[int] | None = None
    #: Why the call has no map although maps were asked for.
    attention_map_reason: str | None = None
    #: Where the map is not exactly what the kernel used (dropout, precision, padding).
    attention_map_notes: list[str] | None = None

    @property
    def attention_map(self) -> Any:
        """The call's attention weights: a CPU float32 tensor ``[B, H, T_query, T_key]``.

        Only with ``trace(model, attention_maps=True)``, for the asked batch
        items (``attention_map_batch``) and heads (``attention_map_heads``),
        recomputed on the side from the call's own inputs (:mod:`qkvtrace.facts.maps`);
        ``None`` with ``attention_map_reason`` otherwise. Kept in the result
        only; in the JSON only when ``save(..., maps=True)`` asks.
        """
        return None if self.map_tensors is None else self.map_tensors.weights

    @property
    def attention_map_fully_masked(self) -> Any:
        """CPU bool ``[B, H, T_query]``: query rows whose keys were all masked (their weights are 0, not NaN)."""
        return None if self.map_tensors is None else self.map_tensors.fully_masked

    def _repr_html_(self) -> str:
        """The call's details in a notebook: reason, kernel and evidence, inputs, Q/K/V slices, its map."""
        return VIEWS["call"](self)


class MapTensors:
    """The tensors of one call's attention map (a plain holder: records resolve numbers, not these)."""

    __slots__ = ("fully_masked", "weights")

    def __init__(self, weights: Any, fully_masked: Any) -> None:
        self.weights = weights
        self.fully_masked = fully_masked

    def __repr__(self) -> str:
        return f"MapTensors(shape={list(self.weights.shape)})"

    def _repr_html_(self) -> str:
        return VIEWS["map_tensors"](self.weights, self.fully_masked)


#: the ``AttentionCall`` fields of attention maps (left out of the JSON while ``None``)
MAP_FIELDS = (
    "map_tensors",
    "attention_map_heads",
    "attention_map_batch",
    "attention_map_reason",
    "attention_map_notes",
)


def call_dict(call: AttentionCall, maps: bool = False) -> dict[str, Any]:
    """One call as JSON; its map tensor as nested lists only when ``maps``."""
    weights, full = call.attention_map, call.attention_map_fully_masked
    out = asdict(call if call.map_tensors is None else replace(call, map_tensors=None))
    for name in MAP_FIELDS:
        if out.get(name) is None:
            out.pop(name, None)
    if maps and weights is not None:
        out["attention_map"] = {
            "shape": list(weights.shape),
            "values": weights.tolist(),
            "fully_masked": [list(map(int, i)) for i in full.nonzero().tolist()] if full is not None else [],
        }
    return out


def _map_from_dict(data: Any) -> MapTensors | None:
    """The tensors of a JSON ``attention_map`` (``values`` and ``fully_masked`` positions)."""
    if not isinstance(data, dict):
        return None
    import torch  # only a file with maps needs it

    weights = torch.tensor(data["values"], dtype=torch.float32).reshape(data["shape"])
    full = torch.zeros(weights.shape[:-1], dtype=torch.bool)
    for b, h, q in data.get("fully_masked", []):
        full[b, h, q] = True
    return MapTensors(weights, full)


@dataclass(slots=True)
class RouteGrad:
    """The gradient that reached one of a call's Q, K, V in one backward pass."""

    #: Norm of the gradient with respect to the tensor the attention core received.
    norm: float | None
    #: The same, per head (``None`` when the heads cannot be read from its layout).
    per_head: list[float] | None = None
    #: This route's share of the call's squared Q/K/V gradient norm (they sum to 1).
    share: float | None = None


@dataclass(slots=True)
class RouteRecord:
    """How the loss reached one call's Q, K and V in one backward pass.

    One record per forward call and backward pass: a module that runs twice
    before one backward (shared weights, accumulation) has two records.
    """

    #: ``index`` of the call in the trace.
    call: int
    module: str
    backward_index: int
    q: RouteGrad | None
    k: RouteGrad | None
    v: RouteGrad | None

    def _repr_html_(self) -> str:
        return VIEWS["routes"]([self])


@dataclass(slots=True)
class SliceGrad:
    """Gradient of one Q/K/V slice after one backward pass."""

    #: Norm of the slice of the parameter's real ``.grad`` after this backward
    #: (what an optimizer step would use; includes earlier, un-zeroed passes).
    grad_norm: float | None
    bias_grad_norm: float | None
    #: Norm of the gradient this backward pass alone contributed.
    pass_grad_norm: float | None = None
    pass_bias_grad_norm: float | None = None
    #: This slice's share of the squared norm of the pass's Q/K/V weight gradient.
    pass_share: float | None = None
    #: The weight these rows are of, named as the call's slices name it (relative to the record's ``holder``),
    #: and its rows, as ``[start, stop)`` ranges: the same as the call's ``qkv`` part.
    param: str | None = None
    rows: list[list[int]] | None = None


@dataclass(slots=True)
class GradientRecord:
    """Q/K/V slice gradients of one attention module after one backward pass."""

    module: str
    #: 0 for the first backward pass inside the trace, 1 for the next, ...
    backward_index: int
    q: SliceGrad
    k: SliceGrad
    v: SliceGrad
    #: This process's rank and the world size under ``torch.distributed`` (then
    #: ``grad_norm`` is read after the gradients were reduced); ``None`` outside it.
    rank: int | None = None
    world_size: int | None = None
    #: Dotted name (in the trace) of the module holding the projection, when it is not ``module`` itself (as
    #: the calls' ``qkv.holder``): the parts' ``param`` names are relative to it.
    holder: str | None = None


@dataclass(slots=True)
class Unobserved:
    """A module that looks like attention but made no call the trace recorded."""

    module: str
    module_type: str
    #: Why the tracer did not see it (hand-written attention, a compiled or
    #: scripted region, an entry point it does not wrap).
    reason: str


@dataclass(slots=True)
class CompiledAttention:
    """One attention operation in a graph ``torch.compile`` made, while the trace was open or before it.

    Read from PyTorch's own compile log (or, for a graph compiled before the trace opened, from Dynamo's cache
    entry, which holds the same graph and code): the FX graph Dynamo captured (module,
    the function as written, shapes), the ATen graph AOTAutograd made of it and
    the code inductor generated (what actually runs). Made once per graph, at
    compile time: compiled code runs with no Python between its kernels, so how
    often it ran is not observed (``runtime``).
    """

    index: int
    module: str
    module_type: str
    #: the attention as the model wrote it: ``sdpa``, ``MultiheadAttention``, ``fused_encoder_layer``, ``flex``
    #: or ``hand_written``
    entry: str
    #: the function(s) in Dynamo's graph, as called
    written: str
    #: Dynamo's compile id of the graph (``frame/compile``)
    graph: str
    #: what compiled the graph, as its log shows: ``inductor``, ``aot`` (AOTAutograd, e.g. ``aot_eager``) or
    #: ``dynamo`` (the graph runs as captured: ``eager`` or a custom backend)
    compiler: str
    shapes: list[list[int]]
    dtypes: list[str]
    #: the mask as the graph passes it: ``none``, ``is_causal``, ``bool tensor``, ``float tensor``, or for
    #: attention written by hand the operations between the scores and the softmax that mask or bias them
    mask: str
    #: what the compiled forward calls for this attention, in order (ATen ops, extern kernels, generated kernels)
    runs: list[str] = field(default_factory=list)
    #: the same for its backward, where a backward graph was compiled
    backward: list[str] = field(default_factory=list)
    #: the SDPA backend whose kernel the compiled code calls (``None``: no SDPA kernel, or not known)
    sdpa_backend: str | None = None
    #: what the compiler changed, in words (``None``: the attention runs as written)
    rewritten: str | None = None
    #: the log events each fact rests on
    evidence: list[str] = field(default_factory=list)
    runtime: str = "not observed"
    compiled: bool = True


@dataclass
class TraceResult:
    """Everything one trace observed."""

    calls: list[AttentionCall] = field(default_factory=list)
    gradients: list[GradientRecord] = field(default_factory=list)
    torch_version: str = ""
    #: Attention-looking modules with no recorded call: silence is not absence.
    unobserved: list[Unobserved] = field(default_factory=list)
    #: What the trace could not see or do, in sentences (compiled regions...).
    warnings: list[str] = field(default_factory=list)
    #: Gradient routes into each call's Q, K, V, per call and backward pass.
    routes: list[RouteRecord] = field(default_factory=list)
    #: Attention operations in graphs ``torch.compile`` made while the trace was open or before it.
    compiled: list[CompiledAttention] = field(default_factory=list)

    def to_dict(self, *, maps: bool = False) -> dict[str, Any]:
        """The ``qkvtrace.trace/3`` JSON object (``maps``: with the attention maps' values)."""
        return {
            "schema": TRACE_SCHEMA,
            "torch_version": self.torch_version,
            "calls": [call_dict(c, maps) for c in self.calls],
            "gradients": [asdict(g) for g in self.gradients],
            "unobserved": [asdict(u) for u in self.unobserved],
            "warnings": list(self.warnings),
            "routes": [asdict(r) for r in self.routes],
            "compiled": [asdict(c) for c in self.compiled],
        }

    def to_json(self, *, maps: bool = False) -> str:
        return json.dumps(self.to_dict(maps=maps), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | os.PathLike[str], *, maps: bool = False) -> Path:
        """Write the JSON atomically: the file is either complete or absent.

        ``maps``: also write each call's ``attention_map`` values (B·H·T_q·T_k numbers per call).
        """
        return atomic_write_text(Path(path), self.to_json(maps=maps))

    def __repr__(self) -> str:
        """One line a terminal can read (a trace of thousands of calls stays one line): what the trace holds."""
        summary_line = VIEWS["summary_line"]
        extra = [f"{len(self.routes)} routes"] if self.routes else []
        extra += [f"{len(self.unobserved)} unobserved", f"{len(self.warnings)} warnings"] if self.unobserved or \
            self.warnings else []  # fmt: skip
        return f"<TraceResult torch {self.torch_version}: {' · '.join([summary_line(self), *extra])}>"

    def html(self, *, tokens: Sequence[Sequence[str]] | None = None) -> str:
        """The trace as an HTML fragment (what a notebook shows): the gradient routes picture when a backward
        pass was traced, the summary, the calls table and each call's details.

        ``tokens``: labels of the attention maps' axes, per batch item. In
        Jupyter, ``IPython.display.HTML(result.html(tokens=...))``; the result
        alone displays itself with positions as labels.
        """
        return VIEWS["trace_html"](self, tokens=_token_rows(tokens))

    def _repr_html_(self) -> str:
        return self.html()

    def save_html(self, path: str | os.PathLike[str], *, title: str = "qkvtrace trace",
                  tokens: Sequence[Sequence[str]] | None = None) -> Path:  # fmt: skip
        """Write one self-contained HTML page of the trace (no network needed to open it); atomically."""
        return VIEWS["save_trace_page"](self, path, title=title, tokens=_token_rows(tokens))

    def summary(self) -> dict[str, dict[str, int]]:
        """Counts of calls per path and per SDPA backend."""
        paths: dict[str, int] = {}
        backends: dict[str, int] = {}
        for call in self.calls:
            paths[call.path] = paths.get(call.path, 0) + 1
            key = call.sdpa_backend or "none"
            backends[key] = backends.get(key, 0) + 1
        return {"paths": dict(sorted(paths.items())), "backends": dict(sorted(backends.items()))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceResult:
        """Read a ``qkvtrace.trace/3`` (or ``/2``, ``/1``) object; refuse any other schema."""
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema not in TRACE_SCHEMAS:
            raise SchemaError(
                f"expected schema {TRACE_SCHEMA!r} (or {' or '.join(map(repr, TRACE_SCHEMAS[:-1]))}) but found "
                f"{schema!r}; this file was not written by `qkvtrace trace` of this version"
            )
        old = schema == TRACE_SCHEMAS[0]  # /1: a slice's rows as one pair
        calls = []
        for c in data["calls"]:
            c = read_older_call(c, schema)
            qkv, written_map = c["qkv"], c.get("attention_map")
            c = _ours(AttentionCall, c)
            c["map_tensors"] = _map_from_dict(written_map)
            c["qkv"] = QKVInfo(
                layout=qkv["layout"],
                holder=qkv.get("holder"),
                reason=qkv.get("reason"),
                **{part: (_slice(qkv[part], old) if qkv[part] is not None else None) for part in ("q", "k", "v")},
            )
            calls.append(AttentionCall(**c))
        grads = [
            GradientRecord(
                module=g["module"],
                backward_index=g["backward_index"],
                rank=g.get("rank"),
                world_size=g.get("world_size"),
                holder=g.get("holder"),
                **{part: SliceGrad(**g[part]) for part in ("q", "k", "v")},
            )
            for g in data["gradients"]
        ]
        unobserved = [Unobserved(**u) for u in data.get("unobserved", [])]
        routes = [
            RouteRecord(
                call=r["call"],
                module=r["module"],
                backward_index=r["backward_index"],
                **{part: (RouteGrad(**r[part]) if r.get(part) is not None else None) for part in ("q", "k", "v")},
            )
            for r in data.get("routes", [])
        ]
        return cls(
            calls=calls,
            gradients=grads,
            torch_version=data.get("torch_version", ""),
            unobserved=unobserved,
            warnings=list(data.get("warnings", [])),
            routes=routes,
            compiled=[CompiledAttention(**_ours(CompiledAttention, c)) for c in data.get("compiled", [])],
        )


def _token_rows(tokens: Sequence[Sequence[str]] | None) -> list[list[str]] | None:
    """Token labels per batch item; one flat row of strings is read as the labels of batch item 0."""
    if tokens is None:
        return None
    rows = list(tokens)
    if rows and all(isinstance(t, str) for t in rows):
        return [[str(t) for t in rows]]
    return [[str(t) for t in row] for row in rows]


def _ours(record: type, data: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``data`` that are fields of ``record``: fields a newer writer added are not ours to read."""
    known = {f.name for f in fields(record)}
    return {k: v for k, v in data.items() if k in known}


def _slice(data: dict[str, Any], version_1: bool = False) -> SliceInfo:
    info = SliceInfo(**_ours(SliceInfo, data))
    if info.also:
        info.also = [_slice(a) for a in info.also]  # type: ignore[arg-type]  # dicts in a file
    if version_1 and info.rows is not None:  # /1 wrote one [start, stop) pair
        info.rows = [list(info.rows)]  # type: ignore[arg-type]  # a flat pair in /1
    return info


def rows_label(rows: Sequence[Sequence[int]] | None, most: int = 4) -> str:
    """``0:64`` for one range, ``0:4,12:16,...`` for several (``… (+n)`` past ``most``), ``:`` for unknown."""
    if not rows:
        return ":"
    shown = ",".join(f"{a}:{b}" for a, b in rows[:most])
    return shown if len(rows) <= most else f"{shown},…(+{len(rows) - most})"


def squared_shares(norms: Sequence[float | None]) -> list[float | None]:
    """Each norm's share of the sum of the squared norms (``None`` for a missing norm or a zero sum)."""
    total = sum(n * n for n in norms if n is not None)
    return [n * n / total if n is not None and total > 0 else None for n in norms]
