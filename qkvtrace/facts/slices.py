"""Q/K/V views of projection weights and their gradients.

A slice is a set of weight rows, written as ``[start, stop)`` ranges: one
range for a contiguous part, one per head where heads are interleaved.

``nn.MultiheadAttention`` keeps Q, K and V in rows ``[0,E)``, ``[E,2E)`` and
``[2E,3E)`` of one ``in_proj_weight`` (layout ``packed``) unless ``kdim`` or
``vdim`` differ from ``embed_dim``, when it keeps ``q_proj_weight``,
``k_proj_weight`` and ``v_proj_weight`` (layout ``separate``). The bias stays
packed in ``in_proj_bias`` either way. That is the module's own definition
(``F.multi_head_attention_forward`` chunks the weight in that order), and its
slices say so in their ``evidence``.

Modules that call SDPA themselves lay their projections out as they like;
their slices are derived from the autograd graph of the call
(:mod:`qkvtrace.facts.dataflow`). :func:`guess_projection` only proposes one by
shape and name (a ``Linear(E, 3E)`` read as contiguous thirds, or
``q``/``k``/``v``-named children), for the places where no call exists to
derive it from (listing modules that look like attention); its slices carry
``evidence`` ``"by shape"`` or ``"by name"``.

Norms are computed on the device and returned as 0-dim tensors: nothing here
reads a value back to the host (DESIGN.md, principle 7); the tracer resolves
them when the block ends.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qkvtrace.base import compat, lazy
from qkvtrace.records import QKVInfo, SliceGrad, SliceInfo

__all__ = [
    "NormCache",
    "PartSpec",
    "Projection",
    "ProjectionSpec",
    "grad_slices",
    "guess_projection",
    "layout_of",
    "mha_projection",
    "norm_of",
    "norm_plan",
    "ranges",
    "rows_of",
    "slice_norms_of",
    "whole",
]

PARTS = ("q", "k", "v")

#: ``[start, stop)`` ranges of rows (columns of a ``Conv1D`` weight), in order
Rows = tuple[tuple[int, int], ...]

#: the evidence of :class:`nn.MultiheadAttention`'s slices
BY_DEFINITION = "by definition: nn.MultiheadAttention (F.multi_head_attention_forward chunks it in q, k, v order)"


@dataclass(frozen=True, slots=True)
class PartSpec:
    """Where one of Q, K, V lives inside a module."""

    param: str
    rows: Rows
    bias_param: str | None
    bias_rows: Rows
    #: the weight dimension ``rows`` index (1 for ``[in, out]`` Conv1D weights)
    dim: int = 0
    #: how ``rows`` are known (``"dataflow: autograd graph"``, ``"by definition: ..."``, ``"by name"``)
    evidence: str = ""
    #: other weights whose rows feed the same part (latent attention's K: a rotary part from another projection)
    also: tuple[PartSpec, ...] = ()

    def pieces(self) -> tuple[PartSpec, ...]:
        """This part's own weight, then every other weight it is made from."""
        return (self, *self.also)


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    #: ``packed``, ``interleaved``, ``separate`` or ``mixed`` (see :func:`layout_of`)
    layout: str
    q: PartSpec
    k: PartSpec
    v: PartSpec

    def parts(self) -> tuple[tuple[str, PartSpec], ...]:
        return (("q", self.q), ("k", self.k), ("v", self.v))


@dataclass(frozen=True, slots=True)
class Projection:
    """A found projection: ``spec``'s parameter names are relative to ``holder``."""

    holder: nn.Module
    spec: ProjectionSpec


def _mha_spec(module: nn.MultiheadAttention) -> ProjectionSpec:
    e = module.embed_dim
    bias = "in_proj_bias" if module.in_proj_bias is not None else None
    rows: list[Rows] = [((0, e),), ((e, 2 * e),), ((2 * e, 3 * e),)]
    if module.in_proj_weight is not None:
        parts = [PartSpec("in_proj_weight", r, bias, r if bias else (), 0, BY_DEFINITION) for r in rows]
        layout = "packed"
    else:
        parts = [
            PartSpec(f"{p}_proj_weight", whole(getattr(module, f"{p}_proj_weight")), bias, r if bias else (), 0,
                     BY_DEFINITION)
            for p, r in zip(PARTS, rows, strict=True)
        ]  # fmt: skip
        layout = "separate"
    spec = ProjectionSpec(layout, *parts)
    # one object per distinct spec: what is kept by spec (weight norms between traces) finds it again
    if len(_MHA_SPECS) >= _MAX_CACHED:
        _MHA_SPECS.clear()
    return _MHA_SPECS.setdefault(spec, spec)


#: the specs :func:`_mha_spec` made, by value
_MHA_SPECS: dict[ProjectionSpec, ProjectionSpec] = {}


def whole(weight: torch.Tensor, dim: int = 0) -> Rows:
    """Every row of ``weight`` (along ``dim``) as one range."""
    return ((0, int(weight.shape[dim])),)


def rows_of(mask: torch.Tensor) -> Rows:
    """The ``[start, stop)`` ranges of the ``True`` entries of a 1-D bool tensor (one host read)."""
    return ranges(mask.nonzero().flatten().tolist())


def ranges(idx: Iterable[int]) -> Rows:
    """The ``[start, stop)`` ranges of increasing row indices."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def layout_of(parts: Sequence[PartSpec]) -> str:
    """``packed``: one weight, one range per part; ``interleaved``: one weight, a part in several ranges
    (per head); ``separate``: a weight per part; ``mixed``: anything else (Q alone, K and V packed...)."""
    params = {p.param for p in parts}
    if len(params) == 1:
        return "packed" if all(len(p.rows) == 1 for p in parts) else "interleaved"
    return "separate" if len(params) == len(parts) else "mixed"


_SEPARATE_NAMES = {
    "q": re.compile(r"^(q|query|q_proj|to_q|wq|w_q|q_lin|query_proj)$", re.IGNORECASE),
    "k": re.compile(r"^(k|key|k_proj|to_k|wk|w_k|k_lin|key_proj)$", re.IGNORECASE),
    "v": re.compile(r"^(v|value|v_proj|to_v|wv|w_v|v_lin|value_proj)$", re.IGNORECASE),
}


def _weight_layout(module: nn.Module) -> tuple[int, int, int] | None:
    """``(in_features, out_features, out_dim)`` of a projection module, or ``None``.

    ``nn.Linear`` keeps ``[out, in]``; a ``Conv1D``-style module (a leaf with
    a 2-D ``weight`` and an ``nf`` attribute equal to its second dimension)
    keeps ``[in, out]``.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, 0
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    if isinstance(weight, nn.Parameter) and weight.dim() == 2 and isinstance(nf, int) and weight.shape[1] == nf:
        return int(weight.shape[0]), nf, 1
    return None


def _part(name: str, module: nn.Module, rows: Rows, dim: int, evidence: str) -> PartSpec:
    bias = f"{name}.bias" if getattr(module, "bias", None) is not None else None
    return PartSpec(f"{name}.weight", rows, bias, rows if bias else (), dim, evidence)


def _own_guess(module: nn.Module) -> ProjectionSpec | None:
    layouts = {n: (m, lay) for n, m in module.named_children() if (lay := _weight_layout(m)) is not None}
    found: dict[str, PartSpec] = {}
    for part, pattern in _SEPARATE_NAMES.items():
        for name, (child, (_, fan_out, dim)) in layouts.items():
            if pattern.match(name):
                found[part] = _part(name, child, ((0, fan_out),), dim, "by name")
                break
    if len(found) == 3:
        return ProjectionSpec("separate", found["q"], found["k"], found["v"])
    for name, (child, (fan_in, fan_out, dim)) in layouts.items():
        if fan_out == 3 * fan_in:
            rows = [((0, fan_in),), ((fan_in, 2 * fan_in),), ((2 * fan_in, 3 * fan_in),)]
            return ProjectionSpec("packed", *(_part(name, child, r, dim, "by shape") for r in rows))
    return None


def mha_projection(module: nn.MultiheadAttention) -> Projection:
    """``nn.MultiheadAttention``'s slices, as the module defines them."""
    return Projection(module, _mha_spec(module))


def guess_projection(module: nn.Module) -> Projection | str:
    """A *hypothesis* for a module's Q/K/V projection, by name and shape (``evidence`` says which).

    Only for modules with no observed call to derive the slices from: q/k/v-named
    children first, then a child ``Linear(E, 3E)`` read as contiguous thirds.
    """
    if isinstance(module, nn.MultiheadAttention):
        return mha_projection(module)
    spec = _own_guess(module)
    if spec is not None:
        return Projection(module, spec)
    return "no q/k/v-named projections or Linear(E, 3E) / Conv1D(E, 3E) among its children"


def param_of(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor ``module`` holds under the dotted ``name``.

    Usually an ``nn.Parameter``; inside a forward of FSDP (``use_orig_params``)
    a plain tensor view of its flat parameter, which ``get_parameter`` refuses.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = module
    if owner_name:
        for part in owner_name.split("."):  # each child where PyTorch registers it, without Module.__getattr__
            children = owner._modules
            child = children.get(part) if type(children) is dict else None
            if child is None:  # not a plain registered child (a ScriptModule's, a container's own): PyTorch's lookup
                owner = module.get_submodule(owner_name)
                break
            owner = child
    params = owner._parameters  # what getattr finds first for a registered parameter, without __getattr__
    value = params.get(leaf) if type(params) is dict else None
    if value is None:
        value = getattr(owner, leaf, None)
    if not isinstance(value, torch.Tensor):
        raise AttributeError(f"{type(module).__name__} has no tensor {name!r}")
    return value


def _rows(t: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    if len(rows) == 1:
        return t.narrow(dim, rows[0][0], rows[0][1] - rows[0][0])
    return torch.cat([t.narrow(dim, a, b - a) for a, b in rows], dim)


def norm_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s 2-norm as a 0-dim float32 tensor on its device (no host read), computed in float32.

    A large view whose elements are not one dense block (the Q, K and V an
    attention call receives, cut from one packed projection; a column slice
    of a weight) is reduced over its dense runs first, then over their norms:
    one reduction over such a view walks it element by element, several
    times slower (the same number, summed in another order). A dense view in
    any order of its dimensions, and a small one, is reduced at once.
    """
    if t.requires_grad:  # detached: no autograd record (a tensor that needs no gradient gets none anyway)
        t = t.detach()
    cast, runs = norm_plan(t)
    if cast:
        t = t.float()
    if runs is not None:
        return torch.linalg.vector_norm(torch.linalg.vector_norm(t, dim=runs))
    return torch.linalg.vector_norm(t)


def norm_plan(t: torch.Tensor) -> tuple[bool, tuple[int, ...] | None]:
    """How :func:`norm_of` reduces ``t``: whether it is cast to float32 first, and the dimensions of its dense
    runs it reduces first (``None``: all at once). Decided by ``t``'s dtype, shape and strides alone: a caller
    that knows those are the same reads it once (:mod:`qkvtrace.tracer.hot`)."""
    cast = t.dtype != torch.float32
    if t.dim() > 1 and t.numel() >= _RUNS_FROM and not t.is_contiguous():
        layout = (t.shape, t.stride())
        runs = _RUNS.get(layout, _UNKNOWN)
        if runs is _UNKNOWN:
            if len(_RUNS) >= _MAX_LAYOUTS:
                _RUNS.clear()
            runs = _RUNS[layout] = dense_run(*layout)
        return cast, runs  # type: ignore[return-value]
    return cast, None


def dense_run(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The dimensions of the innermost dense run of a view's elements (those whose strides, in decreasing
    order, each step over exactly the run inside them, down to stride 1), or ``None`` where reducing them
    first gains nothing: the view is dense in some order (PyTorch reorders such a reduction itself), or no
    dimension has stride 1. A dimension of size 1, or of stride 0 (``expand``), neither joins a run nor
    breaks one."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1 and stride[d]), key=lambda d: stride[d], reverse=True)
    run: list[int] = []
    span = 1
    for d in reversed(dims):
        if stride[d] != span:
            break
        run.append(d)
        span *= shape[d]
    if not run or len(run) == len(dims):
        return None
    return tuple(sorted(run))


#: from how many elements :func:`norm_of` reduces a view's dense runs first (measured on one CPU thread, a
#: ``[B, H, T, D]`` view of a packed projection: 4,096 elements 3.1 against 3.4 µs at once; 131,072: 11 against 68)
_RUNS_FROM = 4096
#: (shape, strides) -> :func:`dense_run`'s answer, for the layouts seen lately
_RUNS: dict[tuple[Any, ...], tuple[int, ...] | None] = {}
_MAX_LAYOUTS = 256
_UNKNOWN = object()


_MAX_CACHED = 4096
#: :meth:`NormCache.stamp`: the registrations walked to the parameters, and each parameter's state
Stamp = tuple[tuple[tuple[nn.Module, str, Any, str, Any], ...], tuple[tuple[Any, int, int], ...]]
_NONE: dict[str, Any] = {}
#: versions for tensors that keep none (made under ``inference_mode``): a new one each time, never a stale hit
_UNTRACKED = itertools.count(-1, -1)


def _state(t: torch.Tensor) -> tuple[int, int | None]:
    """What says a parameter's values are the ones a norm was computed from: its version (an in-place change,
    an optimizer step) and its storage (``param.data = ...``, a conversion such as ``model.half()``)."""
    try:
        where: int | None = t.data_ptr()
    except RuntimeError:  # a tensor subclass with no storage of its own (a DTensor): its version says it
        where = None
    return version_of(t), where


def version_of(t: torch.Tensor) -> int:
    """``t._version``, which moves on every in-place change; a new number each call for an inference tensor."""
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return next(_UNTRACKED)


class NormCache:
    """Norms of parameter slices, recomputed only when the parameter changed.

    A parameter's ``_version`` counter moves on every in-place update (an
    optimizer step), so equal versions mean equal values. One entry per
    (parameter, rows, dim) holds the version it was computed at and is
    replaced when the version moves, so a training loop that steps an
    optimizer thousands of times holds as many entries as after its first
    step (tests/test_monitor.py counts the tensors left alive).
    """

    def __init__(self) -> None:
        #: (id of the parameter, rows, dim) -> (the parameter's state the norm was computed at, the norm)
        self._cache: dict[tuple[int, Rows, int], tuple[Any, torch.Tensor | float]] = {}
        #: (id of the holder, id of the spec, ids of its parameters) -> (their states then, the record)
        self._qkv: dict[tuple[int, int, tuple[int, ...]], tuple[tuple[Any, ...], QKVInfo]] = {}
        #: by module and spec: a module whose calls use other projections (re-wired, two calls) has each
        self._params: dict[tuple[int, int], list[str]] = {}
        #: what was computed since the last :meth:`settle`: the keys of norms held as tensors, and the records
        self._unsettled: list[tuple[int, Rows, int]] = []
        self._unsettled_qkv: list[QKVInfo] = []

    def norm(self, param: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor | float:
        """The norm of ``rows`` of ``param`` (a 0-dim tensor; a number once :meth:`settle` read it)."""
        key, version = (id(param), rows, dim), _state(param)
        held = self._cache.get(key)
        if held is not None and held[0] == version:
            return held[1]
        with torch.no_grad():
            value = norm_of(_rows(param, rows, dim))
        self._cache[key] = (version, value)
        self._unsettled.append(key)
        return value

    def qkv(self, projection: Projection | str) -> QKVInfo:
        """Q/K/V slice records; calls with unchanged parameters share one record."""
        if isinstance(projection, str):
            return QKVInfo(layout=None, q=None, k=None, v=None, reason=projection)
        module, spec = projection.holder, projection.spec
        names = self._names(module, spec)
        # looked up on every call: FSDP swaps the tensors behind these names between sharded and whole
        registered = module._parameters
        if type(registered) is not dict:
            registered = _NONE
        params = []
        for n in names:  # a name of the module's own parameter first, as :func:`param_of` finds it; else that
            found = registered.get(n)
            params.append(found if found is not None else param_of(module, n))
        key = (id(module), id(spec), tuple(map(id, params)))
        versions: tuple[tuple[int, int | None], ...]
        try:  # (each one's :func:`_state`, on every call)
            versions = tuple([(p._version, p.data_ptr()) for p in params])
        except RuntimeError:  # an inference tensor, or a tensor subclass with no storage of its own
            versions = tuple(map(_state, params))
        held = self._qkv.get(key)
        if held is not None and held[0] == versions:
            return held[1]
        infos = {part: self._slice(module, ps) for part, ps in spec.parts()}
        info = QKVInfo(spec.layout, infos["q"], infos["k"], infos["v"])
        if len(self._qkv) >= _MAX_CACHED:  # tensors swapped on every forward (FSDP) would grow it without end
            self._qkv.clear()
            self._cache.clear()
        self._qkv[key] = (versions, info)
        self._unsettled_qkv.append(info)
        return info

    def stamp(self, projection: Projection) -> Stamp | None:
        """What :meth:`qkv` finds ``projection``'s record by, read now, for a caller that asks on every call whether
        the record it has is still the one :meth:`qkv` gives (:meth:`qkvtrace.tracer.slots.Slot.holds`): each dict
        PyTorch registers the parameters in, from the holder down (children, then parameters, by name: each
        ``(module, its attribute, the dict, the name, what it held)``), and each parameter's version and storage.
        ``None`` where a quicker check than :meth:`qkv` itself could miss a change: a container that is not a plain
        dict (PyTorch's own lookup decides there), a tensor held elsewhere, or one that keeps no version or storage
        of its own."""
        module = projection.holder
        steps: dict[tuple[int, str, str], tuple[nn.Module, str, Any, str, Any]] = {}
        pieces = []
        for name in self._names(module, projection.spec):
            *path, leaf = name.split(".")
            owner = module
            for part in path:  # as :func:`param_of` walks them
                children = owner.__dict__.get("_modules")
                child = children.get(part) if type(children) is dict else None
                if child is None:
                    return None
                steps[(id(owner), "_modules", part)] = (owner, "_modules", children, part, child)
                owner = child
            params = owner.__dict__.get("_parameters")
            p = params.get(leaf) if type(params) is dict else None
            if p is None:
                return None
            steps[(id(owner), "_parameters", leaf)] = (owner, "_parameters", params, leaf, p)
            try:
                pieces.append((p, p._version, p.data_ptr()))
            except RuntimeError:  # an inference tensor, or a tensor subclass with no storage of its own
                return None
        return tuple(steps.values()), tuple(pieces)

    def _names(self, module: nn.Module, spec: ProjectionSpec) -> list[str]:
        """The names of the parameters ``spec`` reads from ``module`` (sorted; found once per module and spec)."""
        names = self._params.get((id(module), id(spec)))
        if names is None:
            names = self._params[(id(module), id(spec))] = sorted(
                {n for _, ps in spec.parts() for p in ps.pieces() for n in (p.param, p.bias_param) if n is not None}
            )
        return names

    def settle(self) -> None:
        """Read the norms held as tensors into numbers (one read per accelerator), so that a cache kept between
        traces of a model keeps no tensor alive; later lookups of unchanged parameters give the numbers. Only
        what was computed since the last settle is read: the rest holds numbers already."""
        keys, self._unsettled = self._unsettled, []
        infos, self._unsettled_qkv = self._unsettled_qkv, []
        held: list[tuple[Any, list[Any]]] = []
        for k in keys:
            entry = self._cache.get(k)
            if entry is not None and isinstance(entry[1], torch.Tensor):
                held.append((k, [entry[1]]))
        lazy.read([((box, 0), box[0]) for _, box in held])
        for k, box in held:
            self._cache[k] = (self._cache[k][0], box[0])
        lazy.resolve(infos)

    def _slice(self, module: nn.Module, ps: PartSpec) -> SliceInfo:
        """One part's record; a part made from several weights names the others in ``also``, and its norms
        are those of all the rows it names together."""
        weight = param_of(module, ps.param)
        own = self.norm(weight, ps.rows, ps.dim)
        bias = None if ps.bias_param is None else self.norm(param_of(module, ps.bias_param), ps.bias_rows)
        also = None
        weight_norm, bias_norm = own, bias
        if ps.also:
            also = [self._slice(module, p) for p in ps.also]
            weight_norm = _joint([own, *(a.weight_norm for a in also)])  # type: ignore[assignment, list-item]  # tensors until resolved
            bias_norm = _joint([b for b in (bias, *(a.bias_norm for a in also)) if b is not None])  # type: ignore[misc]
        return SliceInfo(
            param=ps.param,
            rows=[list(r) for r in ps.rows],
            shape=list(_rows(weight, ps.rows, ps.dim).shape),
            weight_norm=weight_norm,  # type: ignore[arg-type]  # resolved later
            bias_param=ps.bias_param,
            bias_norm=bias_norm,  # type: ignore[arg-type]
            dim=ps.dim,
            evidence=ps.evidence,
            also=also,
        )


def _joint(norms: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The norm of several pieces together (0-dim), from the norm of each; ``None`` when one is missing."""
    if not norms or any(n is None for n in norms):
        return None
    if len(norms) == 1:
        return norms[0]
    tensors = [n for n in norms if isinstance(n, torch.Tensor)]
    if not tensors:  # numbers read earlier (:meth:`NormCache.settle`)
        return math.sqrt(sum(float(n) ** 2 for n in norms if n is not None))  # type: ignore[return-value]
    like = tensors[0]
    return torch.stack([n if isinstance(n, torch.Tensor) else like.new_tensor(n) for n in norms]).square().sum().sqrt()


def grad_slices(
    projection: Projection,
    pass_norms: dict[tuple[str, Rows], torch.Tensor],
) -> dict[str, SliceGrad]:
    """Slice norms of the real ``.grad``, and of this pass's gradient (``pass_norms``), as 0-dim tensors."""
    module, spec = projection.holder, projection.spec

    def real(name: str | None, rows: Rows, dim: int = 0) -> torch.Tensor | None:
        if name is None or not rows:
            return None
        grad = param_of(module, name).grad
        return None if grad is None else norm_of(_rows(compat.whole(grad), rows, dim))

    # a part made from several weights (PartSpec.also): the norm over all the rows it names
    return {
        part: SliceGrad(
            grad_norm=_joint([real(p.param, p.rows, p.dim) for p in ps.pieces()]),  # type: ignore[arg-type]  # resolved later
            bias_grad_norm=_joint([real(p.bias_param, p.bias_rows) for p in ps.pieces() if p.bias_param]),  # type: ignore[arg-type]
            pass_grad_norm=_joint([pass_norms.get((p.param, p.rows)) for p in ps.pieces()]),  # type: ignore[arg-type]
            pass_bias_grad_norm=_joint([pass_norms.get((p.bias_param, p.bias_rows))  # type: ignore[arg-type]
                                        for p in ps.pieces() if p.bias_param]),
            param=ps.param,
            rows=[list(r) for r in ps.rows],
        )
        for part, ps in spec.parts()
    }


def slice_norms_of(grad: torch.Tensor, rows_list: list[tuple[Rows, int]]) -> list[torch.Tensor]:
    """Norms of several ``(rows, dim)`` ranges of one gradient tensor (0-dim tensors)."""
    return [norm_of(_rows(grad, rows, dim)) for rows, dim in rows_list]
