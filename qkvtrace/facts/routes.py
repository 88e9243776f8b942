"""The backward side of one attention call: its backward kernel and the gradient routes into Q, K and V.

At the time of the call, the output's ``grad_fn`` graph already says which
autograd node will run the attention core in the backward pass: a fused
node (``ScaledDotProductFlashAttentionForCpuBackward0``, ...) or an
explicit-softmax chain (a softmax node and the matmul that applies its
weights to V). That node is PyTorch's own record of the backward kernel, so
the tracer reads it rather than inferring it from the forward backend.

The same nodes give the gradient routes. A hook on a node receives the
gradients PyTorch computes for its inputs; for the core they are the
gradients with respect to the Q, K and V the core received -- the V route
(straight from ``attention @ V``) and the Q/K routes (through softmax and
the scores). Hooks only read: they return nothing, so the gradients, the
kernels and the outputs are PyTorch's own, and they hold no tensor, so no
activation outlives its pass.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from qkvtrace.facts.slices import norm_of

__all__ = [
    "Core", "Source", "Verdict", "find_core", "grad_norms", "head_norms", "no_graph_reason", "register", "sdpa_core",
    "steady_verdict", "tensor_sources",
]  # fmt: skip

#: a fused attention backward node (SDPA's flash / efficient / cuDNN / math-for-MPS kernels, FlexAttention)
_FUSED = re.compile(r"ScaledDotProduct|Attention")
#: nodes that only move, copy, scale or drop values: between the softmax and the matmul that uses it
_PASS_THROUGH = re.compile(
    r"^(View|UnsafeView|Reshape|Expand|Transpose|T|Permute|Clone|Squeeze|Unsqueeze|NativeDropout|Dropout|"
    r"FusedDropout|Mul|Div|ToCopy)Backward\d*$"
)
_MAX_NODES = 256

#: how a route's gradient is laid out: heads at dimension -3 (``[B, H, L, D]``),
#: or heads folded into dimension 0 (``[B*H, L, D]``) with the number of heads
Layout = str | int


@dataclass(frozen=True, slots=True)
class Source:
    """Where one route's gradient is read: input ``index`` of ``node``, or the gradient of ``tensor``."""

    part: str
    layout: Layout
    node: Any = None
    index: int = 0
    tensor: torch.Tensor | None = None


@dataclass(slots=True)
class Core:
    """The attention core's backward node(s) of one call, and where its routes can be read."""

    #: the node name (fused) or ``"<softmax node> + <matmul node>"``; ``None`` with ``reason``
    kernel: str | None
    reason: str | None = None
    sources: list[Source] = field(default_factory=list)
    #: why no route gradient can be read although the call has a backward graph
    route_reason: str | None = None
    #: nodes that name the kernel without being sources (the softmax of a chain)
    checks: list[Any] = field(default_factory=list)
    #: the way found on an earlier call of the same signature, to be followed (and checked) on this
    #: call's graph only when the backward pass reaches it; ``None`` once followed
    deferred: Deferred | None = None
    #: the call's output node, where a deferred core is followed from (held only while the call is delivered)
    start: Any = None
    #: what a shared core of calls with no graph says (:data:`_NO_GRAPH`), made once
    said: Verdict | None = field(default=None, repr=False, compare=False)

    def stamp(self, record: Any) -> None:
        """Say this core on a call's record: its backward kernel, or why none, and why no routes if so."""
        record.backward_kernel, record.backward_reason = self.kernel, self.reason
        record.route_reason = self.route_reason if self.kernel is not None and not self.has_routes else None

    def verdict(self) -> Verdict:
        """What :meth:`stamp` says, kept without the nodes, for a record built later (:mod:`.slots`); a
        deferred core corrects it, and the records built from it by then, if the call's graph differs."""
        if self.said is not None:
            return self.said
        said = Verdict(None, None, None)
        self.stamp(said)
        if self.deferred is not None:
            said.waiting = self.deferred.records
            self.deferred.verdicts.append(said)
        return said

    @property
    def has_routes(self) -> bool:
        """Whether routes can be read (from sources found now, or from the way found earlier)."""
        return bool(self.sources) or (self.deferred is not None and bool(self.deferred.recipe.sources))


@dataclass(slots=True)
class Verdict:
    """What a core says on a record (:meth:`Core.stamp`), held without its nodes until the record is built."""

    backward_kernel: str | None
    backward_reason: str | None
    route_reason: str | None
    #: while its core is not followed: where the records built from it go, to be corrected with it
    waiting: list[Any] | None = None

    def stamp(self, record: Any) -> None:
        record.backward_kernel, record.backward_reason = self.backward_kernel, self.backward_reason
        record.route_reason = self.route_reason
        if self.waiting is not None:
            self.waiting.append(record)


@dataclass(slots=True)
class Deferred:
    """What following a recipe needs when the backward pass reaches the call's output node."""

    recipe: Recipe
    inputs: tuple[Any, ...]
    heads: int | None
    #: the records of the call, corrected if this call's graph turns out not to follow the recipe
    records: list[Any] = field(default_factory=list)
    #: what was said of the call for records not built yet (:meth:`Core.verdict`), corrected with them
    verdicts: list[Verdict] = field(default_factory=list)


def _tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    return [t for t in values if isinstance(t, torch.Tensor)]


def no_graph_reason(out: Any) -> str | None:
    """Why the call builds no autograd graph, or ``None`` when it does."""
    if torch.is_inference_mode_enabled():
        return _INFERENCE
    if not torch.is_grad_enabled():
        return _NO_GRAD
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return _NO_GRAD_FN
    return None


_INFERENCE = "inference mode: no autograd graph is built"
_NO_GRAD = "grad is disabled (torch.no_grad): no autograd graph is built"
_NO_GRAD_FN = "the output has no grad_fn: nothing the call used requires grad"
#: the core of a call with no graph, one per reason, shared by all such calls: it holds no node, and neither it
#: nor what it says is ever changed (only a core with a kernel is given sources or followed)
_NO_GRAPH = {reason: Core(None, reason, said=Verdict(None, reason, None))
             for reason in (_INFERENCE, _NO_GRAD, _NO_GRAD_FN)}  # fmt: skip


#: a way through a graph: (edge index, name of the node it leads to) per step
Steps = tuple[tuple[int, str], ...]
#: a node of a recipe: reached from an earlier node of the recipe (-1: the output node) by some steps
Hop = tuple[int, Steps]


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a search found, as ways from the output node, to be followed (and checked) on later calls."""

    kernel: str
    route_reason: str | None
    #: the nodes to reach, in order, each from an earlier one (shared prefixes are walked once)
    hops: tuple[Hop, ...]
    #: per source: (part, layout, position of its node in ``hops``, input index)
    sources: tuple[tuple[str, Layout, int, int], ...]


_RECIPES: dict[Any, Recipe] = {}
_MAX_RECIPES = 256
#: the autograd node whose backward is running on this thread (inside a hook), where PyTorch names it
_CURRENT_NODE: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)


def find_core(out: Any, inputs: Sequence[Any], *, heads: int | None = None, key: Any = None) -> Core:
    """The backward core of a call whose output is ``out`` and whose attention inputs are ``inputs``.

    The search walks the output's graph breadth-first and stops at the
    inputs' own nodes, so it stays inside this call. ``heads``: the number
    of heads folded into dimension 0 of an explicit-softmax chain (MHA's
    ``need_weights=True`` path); ``None`` when unknown (then no per-head norms).

    ``key``: the call's signature. Calls of one signature build graphs of one
    shape, so the way to the core found for the first is tried first on the
    next; every node on it is checked by name on this call's own graph, and
    any difference falls back to the search. Where PyTorch names the node
    its backward is running, that check waits until the backward pass
    reaches the output's node: a forward-only run walks nothing after the
    first call of a signature.
    """
    reason = no_graph_reason(out)
    if reason is not None:
        return _NO_GRAPH[reason]
    start = out.grad_fn
    cache_key = None if key is None else (key, start.name(), heads)
    if cache_key is not None:
        recipe = _RECIPES.get(cache_key)
        if recipe is not None and _CURRENT_NODE is not None:
            return Core(recipe.kernel, route_reason=recipe.route_reason,
                        deferred=Deferred(recipe, tuple(_tensors(inputs)), heads), start=start)  # fmt: skip
        if recipe is not None:
            core = _replay(start, recipe)
            if core is not None:
                return core
    core = _search(start, inputs, heads)
    if cache_key is not None and core.kernel is not None and len(_RECIPES) < _MAX_RECIPES:
        recipe = _recipe(start, core)
        if recipe is not None:
            _RECIPES[cache_key] = recipe
    return core


def steady_verdict(out: Any, inputs: tuple[Any, ...], *, heads: int | None, key: Any,
                   watch: Callable[[int, str, Core], None], index: int, module: str,
                   fused: bool = False) -> Verdict | None:  # fmt: skip
    """What a steady call's core says, for a call whose way to its core its signature's first call found and
    whose core is followed only when the backward pass reaches the call's output node (as :func:`find_core`
    defers it): one hook on that node, which follows the way then (and searches this call's graph if it
    differs, correcting what was said) and hands the core found to ``watch`` (with the call's ``index`` and
    ``module``, as :meth:`~qkvtrace.tracer.gradients.GradientRecorder.watch_routes` takes them). ``None`` where
    that does not apply (no graph, no way known, no routes, no node named in a hook; with ``fused``, a core
    that is not a fused node: :func:`sdpa_core` reads those routes at the tensors): :func:`find_core` then.

    A call's core costs, this way, the verdict and one hook; the core itself is made only in the backward pass.
    """
    start = getattr(out, "grad_fn", None)  # (``None`` under no_grad and in inference mode)
    if start is None or _CURRENT_NODE is None:
        return None
    recipe = _RECIPES.get((key, start.name(), heads))
    if recipe is None or not recipe.sources or (fused and not _FUSED.search(recipe.kernel)):
        return None  # (a core with no routes to follow: :func:`find_core` says why)
    records: list[Any] = []  # (the records built from what is said, corrected with it)
    said = Verdict(recipe.kernel, None, None, records)
    start.register_prehook(_Follow(recipe, inputs, heads, (said,), records, partial(watch, index, module)))
    return said


class _Follow:
    """The hook on a call's output node that follows the way its signature's first call found once the backward
    pass reaches that node: where this call's graph differs, the graph is searched and what was said of the call
    (``verdicts``, and ``records`` built from it so far) corrected; then ``then(core)``. It holds no node (a
    node holding a hook that holds it would never be freed: the node is asked for), and lets go of the call's
    inputs once followed. (A deferred core's, :func:`register`; a steady call's, :func:`steady_verdict`.)"""

    __slots__ = ("followed", "heads", "inputs", "recipe", "records", "then", "verdicts")

    def __init__(self, recipe: Recipe, inputs: tuple[Any, ...], heads: int | None, verdicts: Sequence[Verdict],
                 records: list[Any], then: Callable[[Core], None]) -> None:  # fmt: skip
        self.recipe, self.inputs, self.heads, self.then = recipe, inputs, heads, then
        self.verdicts, self.records = verdicts, records
        self.followed = False

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        if self.followed:  # (a graph kept for another backward pass: its routes' hooks stay)
            return
        self.followed = True
        start = _CURRENT_NODE()  # type: ignore[misc]  # (registered only where PyTorch names the node in a hook)
        if start is None:
            return
        core = _replay(start, self.recipe)
        if core is None:  # this call's graph differs from its signature's first: search it
            core = _search(start, self.inputs, self.heads)
            for record in (*self.verdicts, *self.records):
                core.stamp(record)
        for said in self.verdicts:
            said.waiting = None  # records built from it from now on say what it says
        self.inputs = ()
        self.then(core)


def _follow(node: Any, steps: Steps) -> Any:
    for index, name in steps:
        edges = node.next_functions
        if index >= len(edges):
            return None
        node = edges[index][0]
        if node is None or node.name() != name:
            return None
    return node


def _replay(start: Any, recipe: Recipe) -> Core | None:
    reached: list[Any] = []
    for base, steps in recipe.hops:
        node = _follow(start if base < 0 else reached[base], steps)
        if node is None:
            return None
        reached.append(node)
    found = [Source(part, layout, node=reached[at], index=index) for part, layout, at, index in recipe.sources]
    return Core(recipe.kernel, sources=found, route_reason=recipe.route_reason)


def _ways(start: Any, targets: list[Any]) -> dict[int, Steps] | None:
    """The breadth-first way from ``start`` to each of ``targets``."""
    wanted = {id(t) for t in targets}
    way: dict[int, Steps] = {id(start): ()}
    queue: deque[Any] = deque([start])
    kept = [start]  # ids are unique only while the nodes live (see _search)
    while queue and len(way) < 4 * _MAX_NODES and not wanted <= way.keys():
        node = queue.popleft()
        for i, (child, _) in enumerate(node.next_functions):
            if child is not None and id(child) not in way:
                way[id(child)] = (*way[id(node)], (i, child.name()))
                queue.append(child)
                kept.append(child)
    return way if wanted <= way.keys() else None


def _recipe(start: Any, core: Core) -> Recipe | None:
    nodes = [s.node for s in core.sources if s.node is not None]
    if len(nodes) != len(core.sources) or core.kernel is None:
        return None
    targets = list({id(n): n for n in [*core.checks, *nodes]}.values())
    way = _ways(start, targets)
    if way is None:
        return None
    targets.sort(key=lambda n: len(way[id(n)]))
    hops: list[Hop] = []
    for i, node in enumerate(targets):
        steps = way[id(node)]
        # start from the earlier target whose way is the longest prefix of this one
        base = max((j for j in range(i) if steps[: len(way[id(targets[j])])] == way[id(targets[j])]),
                   key=lambda j: len(way[id(targets[j])]), default=-1)  # fmt: skip
        hops.append((base, steps[len(way[id(targets[base])]) :] if base >= 0 else steps))
    at = {id(n): i for i, n in enumerate(targets)}
    sources = tuple((s.part, s.layout, at[id(s.node)], s.index) for s in core.sources)
    return Recipe(core.kernel, core.route_reason, tuple(hops), sources)


def _search(start: Any, inputs: Sequence[Any], heads: int | None) -> Core:
    # A node's Python object may live only while something holds it (seen on torch 2.4), and a
    # freed one's id() can be reused by the next: every node the search looks at is kept until it ends.
    kept = [t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None]
    stops = {id(n) for n in kept}
    parent: dict[int, Any] = {id(start): None}
    queue: deque[Any] = deque([start])
    kept.append(start)
    seen = 0
    while queue and seen < _MAX_NODES:
        node = queue.popleft()
        seen += 1
        name = node.name()
        if _FUSED.search(name):
            return _fused(node, name)
        if "Softmax" in name:
            consumer = parent[id(node)]
            while consumer is not None and _PASS_THROUGH.match(consumer.name()):
                consumer = parent[id(consumer)]
            if consumer is None:
                return Core(f"{name}", route_reason="the softmax weights are not multiplied with V in this call")
            return _chain(node, consumer, heads)
        if id(node) in stops:
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in parent and not _is_leaf(child):
                parent[id(child)] = node
                queue.append(child)
                kept.append(child)
    return Core(None, "no attention node (fused attention or softmax) in the output's autograd graph")


def _is_leaf(node: Any) -> bool:
    return node.name().endswith("AccumulateGrad")


def _fused(node: Any, name: str) -> Core:
    # A fused node's first three inputs are query, key and value, in that order.
    edges = node.next_functions
    sources = [Source(part, "bhld", node=node, index=i) for i, part in enumerate("qkv") if i < len(edges)]
    return Core(name, sources=sources)


def _reaches(node: Any, target: Any, depth: int = 6) -> bool:
    frontier = [node]
    for _ in range(depth):
        nxt: list[Any] = []
        for n in frontier:
            if n is target:
                return True
            nxt.extend(c for c, _ in n.next_functions if c is not None)
        frontier = nxt
    return any(n is target for n in frontier)


def _chain(softmax: Any, consumer: Any, heads: int | None) -> Core:
    """``softmax(scores) @ V``: V's gradient from the matmul, Q's and K's from the scores' node."""
    kernel = f"{softmax.name()} + {consumer.name()}"
    layout: Layout = heads if heads is not None else 0  # 0: heads unknown, totals only
    c_edges = consumer.next_functions
    weights_side = [i for i, (child, _) in enumerate(c_edges) if child is not None and _reaches(child, softmax)]
    if len(c_edges) != 2 or len(weights_side) != 1:
        return Core(kernel, route_reason=f"{consumer.name()} is not the (weights, V) product PyTorch used to build")
    sources = [Source("v", layout, node=consumer, index=1 - weights_side[0])]
    scores = _scores_product(softmax.next_functions[0][0])
    if scores is not None:
        n = len(scores.next_functions)
        q_node = scores.next_functions[n - 2][0]
        if q_node is not None and re.match(r"^(Mul|Div)Backward\d*$", q_node.name()):
            sources.append(Source("q", layout, node=q_node, index=0))  # the gradient of Q before its scaling
        else:
            sources.append(Source("q", layout, node=scores, index=n - 2))
        sources.append(Source("k", layout, node=scores, index=n - 1))  # of K transposed: the same numbers
    return Core(kernel, sources=sorted(sources, key=lambda s: "qkv".index(s.part)), checks=[softmax])


def sdpa_core(out: Any, q: Any, k: Any, v: Any, key: Any = None, heads: int | None = None) -> Core:
    """The backward core of an SDPA call; routes from the fused node, else from the q/k/v tensors.

    ``heads``: for ``[B*H, T, d]`` tensors (heads folded into dimension 0,
    as attention written by hand often keeps them), the number of heads the
    module says it has; ``None``: unknown (then the routes have totals only).
    """
    core = find_core(out, (q, k, v), key=key)
    if core.kernel is not None and not _FUSED.search(core.kernel):
        core.deferred = core.start = None
        # a decomposed SDPA scales q and k inside the chain: read the routes at the tensors it received
        folded = isinstance(q, torch.Tensor) and q.dim() == 3
        layout: Layout = (heads or 0) if folded else "bhld"
        core.sources, core.route_reason = tensor_sources(q, k, v, layout)
    return core


def _scores_product(node: Any) -> Any:
    """The matmul that made the scores, below any reshaping or scaling of them."""
    for _ in range(8):
        if node is None:
            return None
        edges = [c for c, _ in node.next_functions if c is not None]
        if len(node.next_functions) >= 2 and not _PASS_THROUGH.match(node.name()):
            return node
        if len(edges) != 1:
            return None
        node = edges[0]
    return None


def tensor_sources(q: Any, k: Any, v: Any, layout: Layout = "bhld") -> tuple[list[Source], str | None]:
    """Routes read from the gradients of the very ``q``, ``k``, ``v`` tensors a call received."""
    tensors = {"q": q, "k": k, "v": v}
    if q is k or k is v or q is v:
        return [], "q, k and v are one tensor and the backward is not fused: their routes cannot be told apart"
    sources = [
        Source(part, layout, tensor=t)
        for part, t in tensors.items()
        if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_nested
    ]
    return sources, None if sources else "none of q, k, v requires grad"


def head_norms(grad: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """Gradient norm per head (a 1-D tensor on the gradient's device), ``None`` when heads cannot be read."""
    g = grad.detach()
    if g.is_nested:
        return None
    if isinstance(layout, int):
        if g.dim() < 1 or layout <= 0 or g.shape[0] % layout:
            return None
        return g.float().reshape(g.shape[0] // layout, layout, -1).square().sum(dim=(0, 2)).sqrt()
    if g.dim() < 3:
        return None
    dims = [d for d in range(g.dim()) if d != g.dim() - 3]
    return g.float().square().sum(dim=dims).sqrt()


def grad_norms(grad: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm of a route's gradient and its norms per head (``None`` when heads cannot be read), on its device."""
    with torch.no_grad():
        heads = head_norms(grad, layout)
        norm = heads.square().sum().sqrt() if heads is not None else norm_of(grad)
    return norm, heads


def register(core: Core, on_grad: Callable[[str, Layout, torch.Tensor], None]) -> None:
    """Call ``on_grad(part, layout, grad)`` for each route of ``core`` when its gradient is computed.

    A deferred core is followed when the backward pass reaches the call's
    output node: the nodes below it have not run yet, so the hooks put on
    them then still see their gradients.
    """
    deferred = core.deferred
    if deferred is not None and core.start is not None:
        core.start.register_prehook(_Follow(deferred.recipe, deferred.inputs, deferred.heads, deferred.verdicts,
                                            deferred.records, partial(register, on_grad=on_grad)))  # fmt: skip
        return
    by_node: dict[int, tuple[Any, list[Source]]] = {}
    for s in core.sources:
        if s.tensor is not None:
            s.tensor.register_hook(_tensor_hook(s.part, s.layout, on_grad))
        elif s.node is not None:
            by_node.setdefault(id(s.node), (s.node, []))[1].append(s)
    for node, sources in by_node.values():
        picks = [(s.part, s.layout, s.index) for s in sources]
        node.register_hook(_node_hook(picks, on_grad))


def _tensor_hook(part: str, layout: Layout, on_grad: Callable[[str, Layout, torch.Tensor], None]) -> Any:
    def hook(grad: torch.Tensor) -> None:
        on_grad(part, layout, grad)

    return hook


def _node_hook(picks: list[tuple[str, Layout, int]], on_grad: Callable[[str, Layout, torch.Tensor], None]) -> Any:
    def hook(grad_inputs: Sequence[torch.Tensor | None], grad_outputs: Sequence[torch.Tensor | None]) -> None:
        for part, layout, index in picks:
            grad = grad_inputs[index] if index < len(grad_inputs) else None
            if grad is not None:
                on_grad(part, layout, grad)

    return hook
