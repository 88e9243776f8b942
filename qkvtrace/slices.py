"""Q/K/V views of packed or separate projection weights and their gradients.

``nn.MultiheadAttention`` keeps Q, K and V in rows ``[0,E)``, ``[E,2E)`` and
``[2E,3E)`` of one ``in_proj_weight`` (layout ``packed``) unless ``kdim`` or
``vdim`` differ from ``embed_dim``, when it keeps ``q_proj_weight``,
``k_proj_weight`` and ``v_proj_weight`` (layout ``separate``). The bias stays
packed in ``in_proj_bias`` either way.

Modules that call SDPA themselves are searched for a packed projection -- a
``Linear(E, 3E)``, or a ``Conv1D``-style module whose weight is stored
transposed as ``[E, 3E]`` (GPT-2) -- or for ``q``/``k``/``v`` projections,
first among their own children, then among their parent's (an attention
module that hands the kernel call to a small child module).

Norms are computed on the device and returned as 0-dim tensors: nothing here
reads a value back to the host (DESIGN.md, principle 7); the tracer resolves
them when the block ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from qkvtrace import compat
from qkvtrace.records import QKVInfo, SliceGrad, SliceInfo

__all__ = [
    "NormCache",
    "PartSpec",
    "Projection",
    "ProjectionSpec",
    "find_projection",
    "grad_slices",
    "slice_norms_of",
]

PARTS = ("q", "k", "v")

Rows = tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class PartSpec:
    """Where one of Q, K, V lives inside a module."""

    param: str
    rows: Rows
    bias_param: str | None
    bias_rows: Rows
    #: the weight dimension ``rows`` index (1 for ``[in, out]`` Conv1D weights)
    dim: int = 0


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
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
    rows = [(0, e), (e, 2 * e), (2 * e, 3 * e)]
    if module.in_proj_weight is not None:
        parts = [PartSpec("in_proj_weight", r, bias, r if bias else None) for r in rows]
        layout = "packed"
    else:
        parts = [
            PartSpec(f"{p}_proj_weight", None, bias, r if bias else None) for p, r in zip(PARTS, rows, strict=True)
        ]
        layout = "separate"
    return ProjectionSpec(layout, *parts)


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


def _part(name: str, module: nn.Module, rows: Rows, dim: int) -> PartSpec:
    bias = f"{name}.bias" if getattr(module, "bias", None) is not None else None
    return PartSpec(f"{name}.weight", rows, bias, rows if bias else None, dim)


def _own_projection(module: nn.Module) -> ProjectionSpec | None:
    if isinstance(module, nn.MultiheadAttention):
        return _mha_spec(module)
    layouts = {n: (m, lay) for n, m in module.named_children() if (lay := _weight_layout(m)) is not None}
    for name, (child, (fan_in, fan_out, dim)) in layouts.items():
        if fan_out == 3 * fan_in:
            rows = [(0, fan_in), (fan_in, 2 * fan_in), (2 * fan_in, 3 * fan_in)]
            return ProjectionSpec("packed", *(_part(name, child, r, dim) for r in rows))
    found: dict[str, PartSpec] = {}
    for part, pattern in _SEPARATE_NAMES.items():
        for name, (child, (_, _, dim)) in layouts.items():
            if pattern.match(name):
                found[part] = _part(name, child, None, dim)
                break
    if len(found) == 3:
        return ProjectionSpec("separate", found["q"], found["k"], found["v"])
    return None


def find_projection(module: nn.Module, parents: Sequence[nn.Module] = ()) -> Projection | str:
    """The Q/K/V projection of an attention module, or why none was found.

    ``parents`` are the module's ancestors, innermost first; they are searched
    after the module itself.
    """
    for holder in (module, *parents):
        spec = _own_projection(holder)
        if spec is not None:
            return Projection(holder, spec)
    where = "its children" + (" or its parent's" if parents else "")
    return (
        f"no packed Linear(E, 3E) / Conv1D(E, 3E) or q/k/v-named projections among {where}; "
        "the Q/K/V slices are unknown"
    )


def param_of(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor ``module`` holds under the dotted ``name``.

    Usually an ``nn.Parameter``; inside a forward of FSDP (``use_orig_params``)
    a plain tensor view of its flat parameter, which ``get_parameter`` refuses.
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    value = getattr(owner, leaf, None)
    if not isinstance(value, torch.Tensor):
        raise AttributeError(f"{type(module).__name__} has no tensor {name!r}")
    return value


def _rows(t: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    return t if rows is None else t.narrow(dim, rows[0], rows[1] - rows[0])


def _norm(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim float tensor on ``t``'s device (no host read)."""
    return torch.linalg.vector_norm(t.detach().float())


_MAX_CACHED = 4096


class NormCache:
    """Norms of parameter slices, recomputed only when the parameter changed.

    A parameter's ``_version`` counter moves on every in-place update (an
    optimizer step), so equal versions mean equal values.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, Rows, int], torch.Tensor] = {}
        self._qkv: dict[tuple[int, tuple[tuple[int, int], ...]], QKVInfo] = {}
        self._params: dict[int, list[str]] = {}

    def norm(self, param: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
        key = (id(param), param._version, rows, dim)
        value = self._cache.get(key)
        if value is None:
            with torch.no_grad():
                value = _norm(_rows(param, rows, dim))
            self._cache[key] = value
        return value

    def qkv(self, projection: Projection | str) -> QKVInfo:
        """Q/K/V slice records; calls with unchanged parameters share one record."""
        if isinstance(projection, str):
            return QKVInfo(layout=None, q=None, k=None, v=None, reason=projection)
        module, spec = projection.holder, projection.spec
        names = self._params.get(id(module))
        if names is None:
            names = self._params[id(module)] = sorted(
                {n for _, ps in spec.parts() for n in (ps.param, ps.bias_param) if n is not None}
            )
        # looked up on every call: FSDP swaps the tensors behind these names between sharded and whole
        key = (id(module), tuple((id(p), p._version) for p in (param_of(module, n) for n in names)))
        cached = self._qkv.get(key)
        if cached is not None:
            return cached
        infos = {}
        for part, ps in spec.parts():
            weight = param_of(module, ps.param)
            w = _rows(weight, ps.rows, ps.dim)
            bias_norm = None
            if ps.bias_param is not None:
                bias_norm = self.norm(param_of(module, ps.bias_param), ps.bias_rows)
            infos[part] = SliceInfo(
                param=ps.param,
                rows=list(ps.rows) if ps.rows else None,
                shape=list(w.shape),
                weight_norm=self.norm(weight, ps.rows, ps.dim),  # type: ignore[arg-type]  # resolved later
                bias_param=ps.bias_param,
                bias_norm=bias_norm,  # type: ignore[arg-type]
                dim=ps.dim,
            )
        info = QKVInfo(spec.layout, infos["q"], infos["k"], infos["v"])
        if len(self._qkv) >= _MAX_CACHED:  # tensors swapped on every forward (FSDP) would grow it without end
            self._qkv.clear()
            self._cache.clear()
        self._qkv[key] = info
        return info


def grad_slices(
    projection: Projection,
    pass_norms: dict[tuple[str, Rows], torch.Tensor],
) -> dict[str, SliceGrad]:
    """Slice norms of the real ``.grad``, and of this pass's gradient (``pass_norms``), as 0-dim tensors."""
    module, spec = projection.holder, projection.spec

    def real(name: str | None, rows: Rows, dim: int = 0) -> torch.Tensor | None:
        if name is None:
            return None
        grad = param_of(module, name).grad
        return None if grad is None else _norm(_rows(compat.whole(grad), rows, dim))

    return {
        part: SliceGrad(
            grad_norm=real(ps.param, ps.rows, ps.dim),  # type: ignore[arg-type]  # resolved later
            bias_grad_norm=real(ps.bias_param, ps.bias_rows),  # type: ignore[arg-type]
            pass_grad_norm=pass_norms.get((ps.param, ps.rows)),  # type: ignore[arg-type]
            pass_bias_grad_norm=(pass_norms.get((ps.bias_param, ps.bias_rows)) if ps.bias_param else None),  # type: ignore[arg-type]
        )
        for part, ps in spec.parts()
    }


def slice_norms_of(grad: torch.Tensor, rows_list: list[tuple[Rows, int]]) -> list[torch.Tensor]:
    """Norms of several ``(rows, dim)`` ranges of one gradient tensor (0-dim tensors)."""
    return [_norm(_rows(grad, rows, dim)) for rows, dim in rows_list]
