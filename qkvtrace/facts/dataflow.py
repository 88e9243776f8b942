"""Which weight rows became the Q, K and V of a call: read from the call's own autograd graph.

The Q, K and V a kernel received carry their history in ``grad_fn``: the
view, reshape, permute, split and select nodes between the projection's
matmul and the kernel, and the matmul itself, whose edges lead (through a
transpose or a dtype cast) to the weight's ``AccumulateGrad``. For each of
Q, K and V this module

1. walks that graph breadth-first to the nearest matmul on each branch that
   consumes the weight of a projection module (``nn.Linear``, or a
   ``Conv1D``-style module with an ``[in, out]`` weight) held by the
   attention module or its parents, never past another matmul (so never into
   an earlier layer, and never from ``q_b_proj`` on to the ``q_a_proj``
   before it: the rows named are those of the nearer weight);
2. asks autograd for the gradient of the part with respect to that matmul's
   output (``torch.autograd.grad`` with a ``GradientEdge`` as input, a
   pseudo-random probe from a private generator as ``grad_outputs``,
   ``retain_graph=True``): an output feature that never reaches the part has
   an exactly zero gradient column, one that does has a non-zero one. The
   non-zero columns are the part's rows, in whatever order and interleaving
   the model laid them out. A part made from several weights (latent
   attention's K: a per-head part from ``kv_b_proj``, a shared rotary part
   from ``kv_a_proj_with_mqa``) names each; while one weight's rows are
   probed, the gradient is stopped at the other weights' matmuls, so a
   weight behind another is credited only with what reaches the part
   directly.

Nothing the user owns moves: the capture stops at the matmul's output, so no
parameter's ``AccumulateGrad`` runs, no ``.grad`` changes (a ``.grad`` the
model retains on Q, K or V is put back as it was), the graph keeps its
buffers, and the global RNG is not touched. Tensor hooks the model put on
the tensors between the projection and Q, K, V do see the probe.

A call that builds no graph (``torch.no_grad``, ``inference_mode``, frozen
weights) is read from the torch functions it ran (:mod:`qkvtrace.facts.lineage`):
nothing of the model runs a second time.

A derived answer holds for the call it was read from. It is reused for a
later call of the module only when that call's :func:`signature` -- the
module's children, and for each of Q, K and V its shape, strides, offset,
the tensor it is a view of and (with a graph) the nodes that made it -- is
the same; a module re-wired after its first call (projections fused for
inference, a split order taken from an argument, a second kernel call with
other rows) gets new rows, not the old ones.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts import lineage
from qkvtrace.facts.projection_rows import Candidate, Found, candidates, merged, projection_of
from qkvtrace.facts.slices import PARTS, Projection, ProjectionSpec, rows_of

__all__ = ["EVIDENCE", "derive_projection", "derived_projection", "no_graph", "signature"]

EVIDENCE = "dataflow: autograd graph"

#: nodes allowed between a weight's ``AccumulateGrad`` and the matmul that consumes it
_WEIGHT_PATH = re.compile(r"^(T|Transpose|Permute|ToCopy|Alias)Backward\d*$")
#: a matmul that consumes no projection weight: the search does not walk past one, so it stays between
#: the kernel and the nearest projection and never reaches an earlier layer's weights
_MATMUL = re.compile(r"^(Mm|Addmm|Bmm|Baddbmm|Addbmm|Matmul|Linear|Convolution|Einsum)Backward\d*$")
_MAX_NODES = 512
#: graph nodes per part that :func:`signature` reads (the views and the matmul nearest the kernel)
_CHAIN = 4
#: derived answers kept per module (one per layout its calls showed)
_PER_MODULE = 8


def _weight_of(node: Any, by_id: dict[int, tuple[torch.Tensor, Candidate]],
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


def _consumers(start: Any, by_id: dict[int, tuple[torch.Tensor, Candidate]],
               by_fn: dict[int, int]) -> list[tuple[Any, int]]:  # fmt: skip
    """The nearest node consuming a candidate weight on each branch back from ``start``, with that weight's id.

    The search goes past neither a consumer nor any other matmul.
    """
    seen = {id(start)}
    queue: deque[Any] = deque([start])
    kept = [start]  # ids are unique only while the nodes live
    found: list[tuple[Any, int]] = []
    while queue and len(seen) < _MAX_NODES:
        node = queue.popleft()
        children = [c for c, _ in node.next_functions if c is not None]
        wid = next((w for w in (_weight_of(c, by_id, by_fn) for c in children) if w is not None), None)
        if wid is not None:
            found.append((node, wid))
            continue
        if _MATMUL.match(node.name()):
            continue
        for child in children:
            if id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
                kept.append(child)
    return found


def _behind(node: Any, wid: int, by_id: dict[int, tuple[torch.Tensor, Candidate]],
            by_fn: dict[int, int]) -> nn.Module | None:  # fmt: skip
    """A projection whose output reaches ``node``'s input (``q_a_proj`` of a low-rank ``q_a_proj → q_b_proj``)."""
    for child, _ in node.next_functions:
        if child is None or _weight_of(child, by_id, by_fn) is not None:
            continue
        for _, other in _consumers(child, by_id, by_fn):
            if other != wid:
                return by_id[other][1].module
    return None


def _probe(t: torch.Tensor) -> torch.Tensor:
    """Pseudo-random ``grad_outputs`` from a private generator: the global RNG state is not touched."""
    gen = torch.Generator(device=t.device)
    gen.manual_seed(20)
    return torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)


def _stop(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """A node pre-hook: nothing flows through this node (another weight's matmul, while one is probed)."""
    return tuple(None if g is None else torch.zeros_like(g) for g in grads)


def _reached(t: torch.Tensor, node: Any, width: int, others: Sequence[Any]) -> torch.Tensor | str:
    """Which output features of ``node``'s matmul reach ``t`` (a bool vector), the gradient stopped at ``others``."""
    handles = [o.register_prehook(_stop) for o in others]
    try:
        edge = torch.autograd.graph.GradientEdge(node, 0)
        (grad,) = torch.autograd.grad([t], [edge], [_probe(t)], retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if grad is None or grad.dim() == 0 or grad.shape[-1] != width:
        return "does not give one column per output feature"
    return grad.detach().ne(0).reshape(-1, width).any(0)


# -- reuse, while it holds ------------------------------------------------------------------------------


def signature(module: nn.Module, qkv: Sequence[Any]) -> Hashable:
    """What must be the same for a derived answer to hold for another call of ``module``.

    Cheap (no host read, a few attribute reads a tensor) and blind to the
    sequence length, so a decoding loop keeps one answer: the module's
    children; for each of Q, K and V its rank, dtype, last dimension, the
    strides and offset that pick features out of the tensor it is a view of,
    whether the three are views of one tensor, and with a graph which output
    of each of the nodes nearest the kernel was taken (a split's ``k, v, q``
    order is seen there; the nodes' kinds are not: a mode of the user's can
    record a reshape as a view).
    """
    out: list[Any] = [tuple(map(id, module._modules.values()))]
    bases: list[int | None] = []
    for t in qkv:
        if not isinstance(t, torch.Tensor) or t.is_nested:
            out.append(None)
            bases.append(None)
            continue
        base = t._base
        width = int(t.shape[-1]) if base is None or base.dim() == 0 else int(base.shape[-1])
        chain: list[Any] = []
        node = t.grad_fn
        for _ in range(_CHAIN):
            if node is None:
                break
            nexts = node.next_functions
            if not nexts:
                break
            node, nr = nexts[0]
            chain.append(nr)
        # without the tensor it views (inference mode keeps none) the offset itself says which features it took
        offset = t.storage_offset() if base is None else t.storage_offset() % max(width, 1)
        out.append((t.dim(), t.dtype, t.shape[-1] if t.dim() else None, base is None, width,
                    tuple(st for st in t.stride() if st < width), offset, tuple(chain)))  # fmt: skip
        try:
            bases.append(int(t.data_ptr() - t.storage_offset() * t.element_size()))  # where its storage starts
        except RuntimeError:  # a fake tensor (a compiler or export tracing): no storage to compare
            bases.append(None)
    q, k, v = bases
    out.append((q == k, k == v, q == v))
    return tuple(out)


#: what was derived, per attention module and call signature: the holder (weakly) and the slices (names and
#: rows, no tensors), or the reason; a few signatures per module, the oldest forgotten first
_Known = tuple[weakref.ref[nn.Module], ProjectionSpec] | str
_DERIVED: weakref.WeakKeyDictionary[nn.Module, OrderedDict[Hashable, _Known]] = weakref.WeakKeyDictionary()


def no_graph(reason: str) -> bool:
    """Whether ``reason`` says only that the call built no graph to read (its torch functions may give the rows)."""
    return reason.startswith(_NO_GRAPH)


_NO_GRAPH = "not derived: no graph:"


def derived_projection(module: nn.Module, qkv: Sequence[Any], holders: Sequence[nn.Module],
                       sig: Hashable | None = None, log: lineage.Log | None = None) -> Projection | str:  # fmt: skip
    """:func:`derive_projection` once per module and call signature; a call that built no graph is read from
    ``log``, the torch functions its watched module ran (:mod:`qkvtrace.facts.lineage`).

    ``sig``: the call's :func:`signature` when the caller has it already.
    """
    if sig is None:
        sig = signature(module, qkv)
    known = _DERIVED.get(module)
    if known is not None and sig in known:
        entry = known[sig]
        if isinstance(entry, str):
            return entry
        holder = entry[0]()
        if holder is not None:
            return Projection(holder, entry[1])
    try:
        found = derive_projection(qkv, holders)
    except RuntimeError as exc:  # autograd refused a probe: the call is still recorded, with why
        found = f"not derived: autograd could not read the rows ({type(exc).__name__}: {exc})"
    if isinstance(found, str) and no_graph(found):
        found = lineage.derive(log, qkv, holders, found)
        if not lineage.lasting(found):
            return found
    if known is None:
        known = _DERIVED[module] = OrderedDict()
    known[sig] = (weakref.ref(found.holder), found.spec) if isinstance(found, Projection) else found
    while len(known) > _PER_MODULE:
        known.popitem(last=False)
    return found


def derive_projection(qkv: Sequence[Any], holders: Sequence[nn.Module], evidence: str = EVIDENCE) -> Projection | str:
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
            return f"{_NO_GRAPH} inference mode builds no autograd graph"
        if not torch.is_grad_enabled():
            return f"{_NO_GRAPH} grad is disabled (torch.no_grad)"
        i = next(i for i, t in enumerate(tensors) if t.grad_fn is None)
        if tensors[i].requires_grad:
            return f"not derived: {'QKV'[i]} is a leaf tensor: no projection made it"
        return f"{_NO_GRAPH} {'QKV'[i]} has no autograd history (nothing it came from requires grad)"
    if not compat.has_gradient_edge():
        return "not derived: this PyTorch cannot take gradients at a graph edge (torch.autograd.graph.GradientEdge)"
    # the probes below run the graph from Q, K, V themselves: a .grad the model keeps on them (retain_grad)
    # would receive the probe, so it is put back as it was
    retained = [(t, t.grad) for t in tensors if t.retains_grad]
    try:
        return _derive(tensors, holders, evidence)
    finally:
        for t, grad in retained:
            t.grad = grad


def _part_rows(part: str, t: torch.Tensor, by_id: dict[int, tuple[torch.Tensor, Candidate]],
               by_fn: dict[int, int]) -> Found | str:  # fmt: skip
    """Each weight that feeds ``part`` directly: its candidate, its rows, and a projection behind it."""
    found = _consumers(t.grad_fn, by_id, by_fn)
    if not found:
        return (f"not derived: no nn.Linear or Conv1D weight of this module or its parents is consumed on the "
                f"way back from {part.upper()} (within {_MAX_NODES} autograd nodes)")  # fmt: skip
    out = []
    for node, wid in found:
        cand = by_id[wid][1]
        others = [n for n, _ in found if n is not node]
        reached = _reached(t, node, cand.width, others)
        if isinstance(reached, str):
            return f"not derived: the matmul {node.name()} that consumes {cand.name}.weight {reached}"
        rows = rows_of(reached)
        if rows:
            out.append((cand, rows, _behind(node, wid, by_id, by_fn)))
    if not out:
        return f"not derived: no output feature of a projection reaches {part.upper()} with a non-zero gradient"
    # the weight giving the most rows first: the part's own projection; the others are named beside it
    return merged(out)


def _derive(tensors: Sequence[torch.Tensor], holders: Sequence[nn.Module], evidence: str) -> Projection | str:
    by_id = candidates(holders)
    by_fn = {id(w.grad_fn): wid for wid, (w, _) in by_id.items() if w.grad_fn is not None}
    parts = {}
    for part, t in zip(PARTS, tensors, strict=True):
        found = _part_rows(part, t, by_id, by_fn)
        if isinstance(found, str):
            return found
        parts[part] = found
    return projection_of(parts, holders, evidence)
