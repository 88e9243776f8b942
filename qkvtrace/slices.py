"""Q/K/V views of packed or separate projection weights and their gradients.

``nn.MultiheadAttention`` keeps Q, K and V in rows ``[0,E)``, ``[E,2E)`` and
``[2E,3E)`` of one ``in_proj_weight`` (layout ``packed``) unless ``kdim`` or
``vdim`` differ from ``embed_dim``, when it keeps ``q_proj_weight``,
``k_proj_weight`` and ``v_proj_weight`` (layout ``separate``). The bias stays
packed in ``in_proj_bias`` either way. Custom modules that call SDPA
themselves are searched for a packed ``Linear(E, 3E)`` child or for
``q``/``k``/``v`` ``Linear`` children.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from qkvtrace.records import QKVInfo, SliceGrad, SliceInfo

__all__ = ["NormCache", "PartSpec", "ProjectionSpec", "find_projection", "grad_slices", "slice_norms_of"]

PARTS = ("q", "k", "v")


@dataclass(frozen=True, slots=True)
class PartSpec:
    """Where one of Q, K, V lives inside a module."""

    param: str
    rows: tuple[int, int] | None
    bias_param: str | None
    bias_rows: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    layout: str
    q: PartSpec
    k: PartSpec
    v: PartSpec

    def parts(self) -> tuple[tuple[str, PartSpec], ...]:
        return (("q", self.q), ("k", self.k), ("v", self.v))


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
    "q": re.compile(r"^(q|query|q_proj|to_q|wq|q_lin|query_proj)$"),
    "k": re.compile(r"^(k|key|k_proj|to_k|wk|k_lin|key_proj)$"),
    "v": re.compile(r"^(v|value|v_proj|to_v|wv|v_lin|value_proj)$"),
}


def _linear_part(name: str, lin: nn.Linear, rows: tuple[int, int] | None) -> PartSpec:
    bias = f"{name}.bias" if lin.bias is not None else None
    return PartSpec(f"{name}.weight", rows, bias, rows if bias else None)


def find_projection(module: nn.Module) -> ProjectionSpec | None:
    """The Q/K/V projection of an attention module, or ``None`` if not found."""
    if isinstance(module, nn.MultiheadAttention):
        return _mha_spec(module)
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    for name, lin in linears.items():
        if lin.out_features == 3 * lin.in_features:
            e = lin.in_features
            rows = [(0, e), (e, 2 * e), (2 * e, 3 * e)]
            return ProjectionSpec("packed", *(_linear_part(name, lin, r) for r in rows))
    found: dict[str, PartSpec] = {}
    for part, pattern in _SEPARATE_NAMES.items():
        for name, lin in linears.items():
            if pattern.match(name):
                found[part] = _linear_part(name, lin, None)
                break
    if len(found) == 3:
        return ProjectionSpec("separate", found["q"], found["k"], found["v"])
    return None


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().float()))


class NormCache:
    """Norms of parameter slices, recomputed only when the parameter changed.

    A parameter's ``_version`` counter moves on every in-place update (an
    optimizer step), so equal versions mean equal values.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, tuple[int, int] | None], float] = {}
        self._qkv: dict[tuple[int, tuple[int, ...]], QKVInfo] = {}
        self._params: dict[int, list[torch.Tensor]] = {}

    def norm(self, param: torch.Tensor, rows: tuple[int, int] | None) -> float:
        key = (id(param), param._version, rows)
        value = self._cache.get(key)
        if value is None:
            with torch.no_grad():
                value = _norm(_rows(param, rows))
            self._cache[key] = value
        return value

    def qkv(self, module: nn.Module, spec: ProjectionSpec | None) -> QKVInfo:
        """Q/K/V slice records; calls with unchanged parameters share one record."""
        if spec is None:
            return QKVInfo(layout=None, q=None, k=None, v=None)
        params = self._params.get(id(module))
        if params is None:
            names = {n for _, ps in spec.parts() for n in (ps.param, ps.bias_param) if n is not None}
            params = self._params[id(module)] = [module.get_parameter(n) for n in sorted(names)]
        key = (id(module), tuple(p._version for p in params))
        cached = self._qkv.get(key)
        if cached is not None:
            return cached
        infos = {}
        for part, ps in spec.parts():
            weight = module.get_parameter(ps.param)
            w = _rows(weight, ps.rows)
            bias_norm = None
            if ps.bias_param is not None:
                bias_norm = self.norm(module.get_parameter(ps.bias_param), ps.bias_rows)
            infos[part] = SliceInfo(
                param=ps.param,
                rows=list(ps.rows) if ps.rows else None,
                shape=list(w.shape),
                weight_norm=self.norm(weight, ps.rows),
                bias_param=ps.bias_param,
                bias_norm=bias_norm,
            )
        info = QKVInfo(layout=spec.layout, **infos)
        self._qkv[key] = info
        return info


def grad_slices(
    module: nn.Module,
    spec: ProjectionSpec,
    pass_norms: dict[tuple[str, tuple[int, int] | None], float],
) -> dict[str, SliceGrad]:
    """Slice norms of the real ``.grad``, and of this pass's gradient (``pass_norms``)."""

    def real(name: str | None, rows: tuple[int, int] | None) -> float | None:
        if name is None:
            return None
        grad = module.get_parameter(name).grad
        return None if grad is None else _norm(_rows(grad, rows))

    return {
        part: SliceGrad(
            grad_norm=real(ps.param, ps.rows),
            bias_grad_norm=real(ps.bias_param, ps.bias_rows),
            pass_grad_norm=pass_norms.get((ps.param, ps.rows)),
            pass_bias_grad_norm=(pass_norms.get((ps.bias_param, ps.bias_rows)) if ps.bias_param else None),
        )
        for part, ps in spec.parts()
    }


def slice_norms_of(grad: torch.Tensor, rows_list: list[tuple[int, int] | None]) -> list[float]:
    """Norms of several row ranges of one gradient tensor."""
    return [_norm(_rows(grad, rows)) for rows in rows_list]
