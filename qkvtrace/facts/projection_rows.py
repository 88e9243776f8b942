"""What both ways of reading a call's rows share: the projections a call may read, and the slices they make.

A call's Q/K/V rows are read either from its autograd graph (:mod:`qkvtrace.facts.dataflow`, in training) or from the
torch functions it ran (:mod:`qkvtrace.facts.lineage`, when it built no graph). Either way the candidates are the
projection weights (``nn.Linear``, or a ``Conv1D``-style module with an ``[in, out]`` weight) of the calling module
and its parents, and what is found -- for each part, each weight that feeds it directly, its rows, and a projection
behind it -- becomes one :class:`~qkvtrace.facts.slices.Projection` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from qkvtrace.facts.slices import PARTS, PartSpec, Projection, ProjectionSpec, Rows, layout_of, ranges

__all__ = ["Candidate", "Found", "candidates", "merged", "projection_of", "weight_dim"]


@dataclass(frozen=True, slots=True)
class Candidate:
    module: nn.Module
    #: dotted name of the module inside the outermost searched module
    name: str
    #: the weight dimension that indexes output features (0: ``[out, in]``, 1: ``[in, out]``)
    dim: int
    width: int


#: per part: each weight feeding it directly (the one giving the most rows first), its rows, and a projection
#: whose output reaches that weight's matmul (``q_a_proj`` behind ``q_b_proj``), if any
Found = list[tuple[Candidate, Rows, nn.Module | None]]


def weight_dim(module: nn.Module) -> tuple[torch.Tensor, int] | None:
    """A projection module's weight (as its forward sees it) and its output dimension."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or isinstance(weight, (UninitializedParameter, UninitializedBuffer)):
        return None  # (a lazy module's weight before its first call has no shape)
    if weight.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return weight, 0
    nf = getattr(module, "nf", None)
    if isinstance(nf, int) and weight.shape[1] == nf:  # Conv1D-style: [in, out]
        return weight, 1
    return None


def candidates(holders: Sequence[nn.Module]) -> dict[int, tuple[torch.Tensor, Candidate]]:
    """Projection weights among ``holders`` and their descendants, by the identity of the weight tensor."""
    found: dict[int, tuple[torch.Tensor, Candidate]] = {}
    for name, module in holders[-1].named_modules():
        got = weight_dim(module)
        if got is not None and id(got[0]) not in found:
            weight, dim = got
            found[id(weight)] = (weight, Candidate(module, name, dim, int(weight.shape[dim])))
    return found


def merged(found: Found) -> Found:
    """``found`` with one entry per weight: a weight multiplied at several places on the way to one part (one
    projection applied to a module's own states and to the encoder's, joined into one K) gives its rows once,
    their union -- named twice, its norm would be counted twice."""
    by_module: dict[int, tuple[Candidate, set[int], nn.Module | None]] = {}
    for cand, rows, behind in found:
        entry = by_module.setdefault(id(cand.module), (cand, set(), behind))
        entry[1].update(i for lo, hi in rows for i in range(lo, hi))
    out: Found = [(cand, ranges(sorted(idx)), behind) for cand, idx, behind in by_module.values()]
    out.sort(key=lambda e: -sum(b - a for a, b in e[1]))  # the weight giving the most rows first
    return out


def projection_of(parts: dict[str, Found], holders: Sequence[nn.Module], evidence: str) -> Projection:
    """The slices of ``parts``, named inside the innermost of ``holders`` that holds every weight found."""
    holder = _holder([c.module for found in parts.values() for c, _, _ in found], holders)
    names = {id(m): n for n, m in holder.named_modules()}

    def spec(cand: Candidate, rows: Rows, behind: nn.Module | None, also: tuple[PartSpec, ...] = ()) -> PartSpec:
        name = names[id(cand.module)]
        prefix = f"{name}." if name else ""
        bias = f"{prefix}bias" if isinstance(getattr(cand.module, "bias", None), torch.Tensor) else None
        said = evidence
        if behind is not None:
            before = names.get(id(behind), type(behind).__name__)
            said += (f" (the nearest projection: {before} feeds {name or 'it'} and is named only for rows that reach "
                     f"this part without passing another projection)")  # fmt: skip
        # Linear and Conv1D add bias[r] to output feature r: the bias entries follow the weight's rows
        return PartSpec(f"{prefix}weight", rows, bias, rows if bias else (), cand.dim, said, also)

    specs = []
    for part in PARTS:
        (first, *more) = parts[part]
        specs.append(spec(*first, also=tuple(spec(*m) for m in more)))
    return Projection(holder, ProjectionSpec(layout_of(specs), *specs))


def _holder(modules: Sequence[nn.Module], holders: Sequence[nn.Module]) -> nn.Module:
    """The innermost of ``holders`` that contains every module of ``modules``."""
    for h in holders:
        inside = {id(m) for m in h.modules()}
        if all(id(m) in inside for m in modules):
            return h
    return holders[-1]
