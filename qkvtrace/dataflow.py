"""Which weight rows became the Q, K and V of a call: read from the call's own autograd graph.

The Q, K and V a kernel received carry their history in ``grad_fn``: the
view, reshape, permute, split and select nodes between the projection's
matmul and the kernel, and the matmul itself, whose edges lead (through a
transpose or a dtype cast) to the weight's ``AccumulateGrad``. For each of
Q, K and V this module

1. walks that graph breadth-first to the nearest matmul that consumes the
   weight of a projection module (``nn.Linear``, or a ``Conv1D``-style module
   with an ``[in, out]`` weight) held by the attention module or its parents,
   never past another matmul (so never into an earlier layer);
2. asks autograd for the gradient of the part with respect to that matmul's
   output (``torch.autograd.grad`` with a ``GradientEdge`` as input, a
   pseudo-random probe from a private generator as ``grad_outputs``,
   ``retain_graph=True``): an output feature that never reaches the part has
   an exactly zero gradient column, one that does has a non-zero one. The
   non-zero columns are the part's rows, in whatever order and interleaving
   the model laid them out.

Nothing the user owns moves: the capture stops at the matmul's output, so no
parameter's ``AccumulateGrad`` runs, no ``.grad`` changes (a ``.grad`` the
model retains on Q, K or V is put back as it was), the graph keeps its
buffers, and the global RNG is not touched. Tensor hooks the model put on
the tensors between the projection and Q, K, V do see the probe. A call that builds no graph
(``torch.no_grad``, ``inference_mode``, frozen weights) has nothing to read:
the answer is then a reason, never a guess.
"""

from __future__ import annotations

import re
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qkvtrace import compat
from qkvtrace.slices import PARTS, PartSpec, Projection, ProjectionSpec, layout_of, rows_of

__all__ = ["EVIDENCE", "derive_projection", "derived_projection"]

EVIDENCE = "dataflow: autograd graph"

#: nodes allowed between a weight's ``AccumulateGrad`` and the matmul that consumes it
_WEIGHT_PATH = re.compile(r"^(T|Transpose|Permute|ToCopy|Alias)Backward\d*$")
#: a matmul that consumes no projection weight: the search does not walk past one, so it stays between
#: the kernel and the nearest projection and never reaches an earlier layer's weights
_MATMUL = re.compile(r"^(Mm|Addmm|Bmm|Baddbmm|Addbmm|Matmul|Linear|Convolution|Einsum)Backward\d*$")
_MAX_NODES = 512


@dataclass(frozen=True, slots=True)
class _Candidate:
    module: nn.Module
    #: dotted name of the module inside the outermost searched module
    name: str
    #: the weight dimension that indexes output features (0: ``[out, in]``, 1: ``[in, out]``)
    dim: int
    width: int


def _weight_dim(module: nn.Module) -> tuple[torch.Tensor, int] | None:
    """A projection module's weight (as its forward sees it) and its output dimension."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return weight, 0
    nf = getattr(module, "nf", None)
    if isinstance(nf, int) and weight.shape[1] == nf:  # Conv1D-style: [in, out]
        return weight, 1
    return None


def _candidates(holders: Sequence[nn.Module]) -> dict[int, tuple[torch.Tensor, _Candidate]]:
    """Projection weights among ``holders`` and their descendants, by the identity of the weight tensor."""
    found: dict[int, tuple[torch.Tensor, _Candidate]] = {}
    for name, module in holders[-1].named_modules():
        got = _weight_dim(module)
        if got is not None and id(got[0]) not in found:
            weight, dim = got
            found[id(weight)] = (weight, _Candidate(module, name, dim, int(weight.shape[dim])))
    return found


def _weight_of(node: Any, by_id: dict[int, tuple[torch.Tensor, _Candidate]],
               by_fn: dict[int, int]) -> int | None:  # fmt: skip
    """The id of the candidate weight ``node`` leads to (through transposes or casts), or ``None``."""
    for _ in range(4):
        if node is None:
            return None
        variable = getattr(node, "variable", None)
        if variable is not None:
            return id(variable) if id(variable) in by_id else None
        if id(node) in by_fn:  # a weight that is itself a view (FSDP's unsharded parameters)
            return by_fn[id(node)]
        if not _WEIGHT_PATH.match(node.name()) or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    return None


def _consumer(start: Any, by_id: dict[int, tuple[torch.Tensor, _Candidate]],
              by_fn: dict[int, int]) -> tuple[Any, int] | None:  # fmt: skip
    """The nearest node that consumes a candidate weight, and that weight's id."""
    seen = {id(start)}
    queue: deque[Any] = deque([start])
    kept = [start]  # ids are unique only while the nodes live
    while queue and len(seen) < _MAX_NODES:
        node = queue.popleft()
        children = [c for c, _ in node.next_functions if c is not None]
        for child in children:
            wid = _weight_of(child, by_id, by_fn)
            if wid is not None:
                return node, wid
        if _MATMUL.match(node.name()):
            continue
        for child in children:
            if id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
                kept.append(child)
    return None


def _probe(t: torch.Tensor) -> torch.Tensor:
    """Pseudo-random ``grad_outputs`` from a private generator: the global RNG state is not touched."""
    gen = torch.Generator(device=t.device)
    gen.manual_seed(20)
    return torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)


#: what was derived, per attention module, for every later call in this process: the holder (weakly) and
#: the slices (names and rows, no tensors), or the reason; a module's layout is its code's, read once
_DERIVED: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ProjectionSpec] | str] = (
    weakref.WeakKeyDictionary()
)


def derived_projection(module: nn.Module, qkv: Sequence[Any], holders: Sequence[nn.Module]) -> Projection | str:
    """:func:`derive_projection` once per module: from its first call that builds a graph.

    Until a call of ``module`` builds one (calls under ``torch.no_grad`` or
    ``inference_mode``), the answer is the reason the rows are not known.
    """
    known = _DERIVED.get(module)
    if isinstance(known, str):
        return known
    if known is not None:
        holder = known[0]()
        if holder is not None:
            return Projection(holder, known[1])
    found = derive_projection(qkv, holders)
    if isinstance(found, Projection):
        _DERIVED[module] = (weakref.ref(found.holder), found.spec)
    elif all(getattr(t, "grad_fn", None) is not None for t in qkv):
        _DERIVED[module] = found  # a graph was read and gave no answer: the next call's would not either
    return found


def derive_projection(qkv: Sequence[Any], holders: Sequence[nn.Module]) -> Projection | str:
    """The Q/K/V slices of a call whose kernel received ``qkv``, or why they cannot be derived.

    ``holders``: the calling module, then its parents, innermost first; the
    projection must be a weight of one of them or of their descendants.
    """
    tensors = [t for t in qkv if isinstance(t, torch.Tensor)]
    if len(tensors) != 3:
        return "the kernel did not receive three tensors"
    if any(t.is_nested for t in tensors):
        return "nested Q/K/V: their rows are not derived"
    if any(t.grad_fn is None for t in tensors):
        if torch.is_inference_mode_enabled():
            return "not derived: inference mode builds no autograd graph, and the rows are read from one"
        if not torch.is_grad_enabled():
            return "not derived: grad is disabled (torch.no_grad), so no autograd graph exists to read the rows from"
        i = next(i for i, t in enumerate(tensors) if t.grad_fn is None)
        if tensors[i].requires_grad:
            return f"not derived: {'QKV'[i]} is a leaf tensor: no projection made it"
        return f"not derived: {'QKV'[i]} has no autograd history (nothing it came from requires grad)"
    if not compat.has_gradient_edge():
        return "not derived: this PyTorch cannot take gradients at a graph edge (torch.autograd.graph.GradientEdge)"
    # the probes below run the graph from Q, K, V themselves: a .grad the model keeps on them (retain_grad)
    # would receive the probe, so it is put back as it was
    retained = [(t, t.grad) for t in tensors if t.retains_grad]
    try:
        return _derive(tensors, holders)
    finally:
        for t, grad in retained:
            t.grad = grad


def _derive(tensors: Sequence[torch.Tensor], holders: Sequence[nn.Module]) -> Projection | str:
    by_id = _candidates(holders)
    by_fn = {id(w.grad_fn): wid for wid, (w, _) in by_id.items() if w.grad_fn is not None}
    parts: dict[str, tuple[_Candidate, tuple[tuple[int, int], ...]]] = {}
    for part, t in zip(PARTS, tensors, strict=True):
        found = _consumer(t.grad_fn, by_id, by_fn)
        if found is None:
            return (f"not derived: no nn.Linear or Conv1D weight of this module or its parents is consumed on the "
                    f"way back from {part.upper()} (within {_MAX_NODES} autograd nodes)")  # fmt: skip
        node, wid = found
        cand = by_id[wid][1]
        edge = torch.autograd.graph.GradientEdge(node, 0)
        (grad,) = torch.autograd.grad([t], [edge], [_probe(t)], retain_graph=True, allow_unused=True)
        if grad is None or grad.dim() == 0 or grad.shape[-1] != cand.width:
            return (f"not derived: the matmul {node.name()} that consumes {cand.name}.weight does not give one "
                    f"column per output feature")  # fmt: skip
        reached = grad.detach().ne(0).reshape(-1, cand.width).any(0)
        rows = rows_of(reached)
        if not rows:
            return f"not derived: no output feature of {cand.name} reaches {part.upper()} with a non-zero gradient"
        parts[part] = (cand, rows)
    holder = _holder([c.module for c, _ in parts.values()], holders)
    names = {id(m): n for n, m in holder.named_modules()}
    specs = []
    for part in PARTS:
        cand, rows = parts[part]
        name = names[id(cand.module)]
        prefix = f"{name}." if name else ""
        bias = f"{prefix}bias" if isinstance(getattr(cand.module, "bias", None), torch.Tensor) else None
        # Linear and Conv1D add bias[r] to output feature r: the bias entries follow the weight's rows
        specs.append(PartSpec(f"{prefix}weight", rows, bias, rows if bias else (), cand.dim, EVIDENCE))
    return Projection(holder, ProjectionSpec(layout_of(specs), *specs))


def _holder(modules: Sequence[nn.Module], holders: Sequence[nn.Module]) -> nn.Module:
    """The innermost of ``holders`` that contains every module of ``modules``."""
    for h in holders:
        inside = {id(m) for m in h.modules()}
        if all(id(m) in inside for m in modules):
            return h
    return holders[-1]
