"""The recogniser of attention written by hand: a ``TorchFunctionMode`` that follows the dataflow of the torch
functions a watched module calls, from QKᵀ through the scores' scaling, masks and softmax to the probabilities'
product with V, and records that product as an attention call (:mod:`.handwritten` says which modules are watched,
and when the mode is on).

Per thread, :func:`state` holds what the mode has seen: each tensor's stage on the way (:class:`Node`, by identity,
held weakly), the activations scaled or folded into ``[B·H, T, d]`` before a product, and how many products of two
activations it has seen. The mode calls every function with the very arguments it was given and returns its result
untouched; it reads no values.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from qkvtrace.facts import lineage, patterns
from qkvtrace.tracer import folded, registry
from qkvtrace.tracer.observers.handwritten_record import record

__all__ = ["Recogniser", "State", "busy", "local", "state"]

_MATMUL = frozenset({"matmul", "bmm", "__matmul__"})
_SCALE = frozenset({"mul", "mul_", "__mul__", "__rmul__", "multiply", "div", "div_", "__truediv__", "true_divide",
                    "divide"})  # fmt: skip
_DIVIDES = frozenset({"div", "div_", "__truediv__", "true_divide", "divide"})
_ADD = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "subtract"})
_FILL = frozenset({"masked_fill", "masked_fill_"})
_CAST = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})
_SAME = frozenset({"view", "reshape", "contiguous", "clone", "view_as", "reshape_as", "flatten", "unflatten",
                   "squeeze", "unsqueeze", "detach", "tanh", "tanh_", "clamp", "clamp_", "nan_to_num"})  # fmt: skip
_SOFTMAX = frozenset({"softmax", "_softmax"})
_CAT = frozenset({"cat", "concat", "concatenate"})
_SLICE = frozenset({"__getitem__", "narrow", "split", "chunk", "tensor_split"})
_DROPOUT = frozenset({"dropout", "dropout_", "native_dropout"})


#: this thread's :class:`State` (made on its first watched call)
local = threading.local()


@dataclass(slots=True)
class Node:
    """What a tensor is on the way from QKᵀ to the attention's output."""

    ref: weakref.ref[torch.Tensor]
    stage: str  # "scores" or "probs"
    q: torch.Tensor
    #: K as the product received it (``kᵀ`` for ``q @ kᵀ``; ``transposed`` says so)
    k: torch.Tensor
    transposed: bool
    form: tuple[str, ...]
    #: scalar factors applied to the scores, in order (Python numbers or 0-dim tensors)
    steps: tuple[tuple[str, Any], ...] = ()
    terms: tuple[patterns.Term, ...] = ()
    probs: torch.Tensor | None = None
    dropout_p: float = 0.0
    softmax_dtype: str | None = None
    #: heads folded into dimension 0 of Q or K (``[B·H, T, d]``), as the module's own reshape made them
    heads: int | None = None
    #: scores assembled with ``torch.cat`` along the keys: how many pieces, and whether a piece had its own mask
    pieces: int = 0
    piece_masked: bool = False
    #: a slice of the probabilities along the keys (stage ``"piece"``) or its product with values (``"partial"``):
    #: how many key columns it covers, and the first values it met
    cols: int = 0
    value: torch.Tensor | None = None


@dataclass(eq=False)
class State:
    mode: Recogniser | None = None
    #: candidate modules open in this thread (innermost last), with :attr:`products` as each opened
    active: list[nn.Module] = field(default_factory=list)
    opened_at: list[int] = field(default_factory=list)
    #: entry users being checked in this thread, not watched (innermost last), each with whether its call has
    #: reached an entry point yet (:func:`entry_point_called`)
    users: list[list[Any]] = field(default_factory=list)
    #: projection holders open in this thread with the mode on for their rows (innermost last), each with how
    #: many new layouts had been read when it opened
    holders: list[list[Any]] = field(default_factory=list)
    #: products of two activations seen since the mode came on in this thread
    products: int = 0
    nodes: dict[int, Node] = field(default_factory=dict)
    #: activations scaled by a number before any product (Q or K scaled before QKᵀ), and through which steps
    scaled: dict[int, tuple[weakref.ref[torch.Tensor], tuple[tuple[str, Any], ...]]] = field(default_factory=dict)
    #: activations the module folded ``[B, H, T, d]`` into ``[B·H, T, d]``, with the heads folded
    folds: dict[int, tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=dict)

    def forget(self) -> None:
        """Drop the dataflow followed so far (the mode goes off, or following it failed)."""
        self.nodes.clear()
        self.scaled.clear()
        self.folds.clear()


#: every thread's :class:`State` (a module in the middle of a watched call, in any thread: :func:`busy`)
_states: weakref.WeakSet[State] = weakref.WeakSet()


def state() -> State:
    st = getattr(local, "state", None)
    if st is None:
        st = local.state = State()
        _states.add(st)
    return st


def busy() -> set[int]:
    """Ids of the modules whose watched call is under way now, in any thread (their leaving hook must run)."""
    found: set[int] = set()
    for st in list(_states):
        found.update(id(m) for m in list(st.active))
        found.update(id(u[0]) for u in list(st.users))
        found.update(id(h[0]) for h in list(st.holders))
    return found


# -- the mode ---------------------------------------------------------------------------------------


class Recogniser(TorchFunctionMode):
    """Follows the dataflow of hand-written attention, and writes every function into this thread's
    :class:`~qkvtrace.facts.lineage.Log` (from which a call that builds no graph gets its rows)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            log = lineage.current()
            if log is not None:
                lineage.see(log, func, args, kwargs, out)
            _see(getattr(func, "__name__", ""), args, kwargs, out)
        except Exception as exc:  # the model's call goes on whatever happens here
            state().forget()
            registry.report_failure("hand-written attention", exc)
        return out


def _node(nodes: dict[int, Node], t: Any) -> Node | None:
    if not isinstance(t, torch.Tensor):
        return None
    n = nodes.get(id(t))
    if n is None or n.ref() is not t:
        return None
    return n


def _activation(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.dim() >= 2 and t.is_floating_point()


def _keep(nodes: dict[int, Node], out: Any, node: Node, **changes: Any) -> None:
    if isinstance(out, torch.Tensor):
        nodes[id(out)] = dataclasses.replace(node, ref=weakref.ref(out), **changes)


#: what an activation scaled by a number goes through on its way to QKᵀ and still carries that factor: moves,
#: copies and casts (not tanh, clamp or nan_to_num, which keep the scores a score but not a factor)
_MOVES = (_SAME - {"tanh", "tanh_", "clamp", "clamp_", "nan_to_num"}) | _CAST | frozenset({
    "transpose", "permute", "split", "chunk", "unbind", "expand", "repeat", "repeat_interleave", "narrow", "select",
    "__getitem__"})  # fmt: skip


def _factors(st: State, t: Any) -> tuple[tuple[str, Any], ...]:
    """The numbers ``t`` was scaled by since it was an activation of its own (``()``: none seen)."""
    found = st.scaled.get(id(t))
    return found[1] if found is not None and found[0]() is t else ()


def _see(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    st = state()
    nodes = st.nodes
    if name in _MATMUL or name == "baddbmm" or name == "einsum":
        _product(nodes, name, args, kwargs, out)
        return
    if name in _CAT and nodes:
        _cat(nodes, args, kwargs, out)
        return
    first = args[0] if args else kwargs.get("input")
    if (name in _SCALE or name in _MOVES) and _node(nodes, first) is None and _activation(first):
        _scaled(st, name, first, args, kwargs, out)  # type: ignore[arg-type]  # an activation: a tensor
        _fold(st, name, first, out)  # type: ignore[arg-type]
    if not nodes:
        return
    if name == "where":
        _where(nodes, args, out)
        return
    node = _node(nodes, first)
    if node is None:
        if name in _ADD and len(args) > 1:  # mask + scores
            node = _node(nodes, args[1])
            if node is not None and node.stage == "scores" and isinstance(first, torch.Tensor):
                term = patterns.Term("add", first, tuple(node.ref().shape))  # type: ignore[union-attr]
                _keep(nodes, out, node, form=(*node.form, name), terms=(*node.terms, term))
        return
    form = (*node.form, name)
    if node.stage in ("piece", "partial"):
        _assembled(nodes, node, name, args, out, form)
        return
    if node.stage == "probs":
        if node.pieces and name in _SLICE:  # assembled scores: the probabilities of each piece of keys
            _slices(nodes, node, out, form)
        elif name in _DROPOUT:
            p = float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
            training = bool(kwargs.get("training", args[2] if len(args) > 2 else True))
            dropped = p if training else 0.0
            _keep(nodes, out[0] if isinstance(out, tuple) else out, node, form=form, dropout_p=dropped)
        elif name in _CAST or name in _SAME or name in _SCALE or name in _FILL:
            if isinstance(out, torch.Tensor) and out.shape[-1:] == node.ref().shape[-1:]:  # type: ignore[union-attr]
                _keep(nodes, out, node, form=form)
        return
    scores = node.ref()
    assert scores is not None
    other = args[1] if len(args) > 1 else kwargs.get("other")
    here = tuple(scores.shape)
    if name in _SOFTMAX:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if isinstance(dim, int) and isinstance(out, torch.Tensor) and dim % scores.dim() == scores.dim() - 1:
            _keep(nodes, out, node, form=form, stage="probs", probs=out, softmax_dtype=str(out.dtype))
        return
    scalar = isinstance(other, (int, float)) or (isinstance(other, torch.Tensor) and other.dim() == 0)
    if name in _SCALE and scalar:
        factor = ("div" if name in _DIVIDES else "mul", other)
        _keep(nodes, out, node, form=form, steps=(*node.steps, factor))
    elif name in _ADD and isinstance(other, torch.Tensor) and _node(nodes, other) is None:
        alpha = float(kwargs.get("alpha", 1.0))
        sign = -alpha if name.startswith("sub") or name == "__sub__" else alpha
        term = patterns.Term("add", other, here, sign=sign)
        _keep(nodes, out, node, form=form, terms=(*node.terms, term))
    elif name in _FILL and isinstance(args[1] if len(args) > 1 else kwargs.get("mask"), torch.Tensor):
        mask = args[1] if len(args) > 1 else kwargs["mask"]
        value = args[2] if len(args) > 2 else kwargs.get("value")
        term = patterns.Term("fill", mask, here, value=value)
        _keep(nodes, out, node, form=form, terms=(*node.terms, term))
    elif name in ("tanh", "tanh_"):
        _keep(nodes, out, node, form=form, steps=(*node.steps, ("tanh", None)))
    elif name in _CAST or name in _SAME:
        if isinstance(out, torch.Tensor) and out.numel() == scores.numel() and out.shape[-1:] == scores.shape[-1:]:
            _keep(nodes, out, node, form=form)


def _scaled(st: State, name: str, first: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any],
            out: Any) -> None:  # fmt: skip
    """Follow a number an activation is scaled by (``q * scale``, ``q_proj(x) / sqrt(d)``) through reshapes."""
    steps = _factors(st, first)
    if name in _SCALE:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if not (isinstance(other, (int, float)) or (isinstance(other, torch.Tensor) and other.dim() == 0)):
            return
        steps = (*steps, ("div" if name in _DIVIDES else "mul", other))
    elif not steps:
        return
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor):
            st.scaled[id(t)] = (weakref.ref(t), steps)


def _folded(st: State, t: Any) -> int | None:
    found = st.folds.get(id(t))
    return found[1] if found is not None and found[0]() is t else None


def _fold(st: State, name: str, first: torch.Tensor, out: Any) -> None:
    """Follow ``[B, H, T, d]`` folded into ``[B·H, T, d]`` by a reshape, then through moves and scalings."""
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        return
    heads = _folded(st, first)
    if heads is not None and out.shape[0] == first.shape[0]:
        st.folds[id(out)] = (weakref.ref(out), heads)
    elif heads is None and name in ("reshape", "view", "flatten"):
        heads = folded.split_heads(first.shape, out.shape)
        if heads is not None:
            st.folds[id(out)] = (weakref.ref(out), heads)


def _cat(nodes: dict[int, Node], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Scores assembled from pieces along the keys (local blocks beside global tokens): one node of scores."""
    parts = args[0] if args else kwargs.get("tensors")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(out, torch.Tensor) or not isinstance(parts, (list, tuple)) or not isinstance(dim, int):
        return
    if dim % out.dim() != out.dim() - 1:
        return
    found = [n for n in (_node(nodes, t) for t in parts) if n is not None]
    if not found or any(n.stage != "scores" for n in found):
        return
    first = found[0]
    if any(not patterns.same_steps(n.steps, first.steps) for n in found):
        return  # pieces scaled differently: no one scale for the assembled scores
    form = (*first.form, f"cat {len(parts)} pieces")
    _keep(nodes, out, first, form=form, terms=(), pieces=len(parts), piece_masked=any(n.terms for n in found))


def _slices(nodes: dict[int, Node], node: Node, out: Any, form: tuple[str, ...]) -> None:
    probs = node.ref()
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and probs is not None and t.shape[:-1] == probs.shape[:-1]:
            _keep(nodes, t, node, form=form, stage="piece", cols=int(t.shape[-1]))


def _assembled(nodes: dict[int, Node], node: Node, name: str, args: tuple[Any, ...], out: Any,
               form: tuple[str, ...]) -> None:  # fmt: skip
    """A piece of the probabilities reshaped, or the products of the pieces with their values summed up."""
    if name in _SAME or name in _CAST or name in _DROPOUT:
        result = out[0] if isinstance(out, tuple) else out
        if isinstance(result, torch.Tensor) and result.numel() == node.ref().numel():  # type: ignore[union-attr]
            _keep(nodes, result, node, form=form)
        return
    other = _node(nodes, args[1]) if len(args) > 1 else None
    if node.stage != "partial" or name not in _ADD or name.startswith("sub") or other is None:
        return
    if other.stage != "partial" or other.probs is not node.probs or not isinstance(out, torch.Tensor):
        return
    cols = node.cols + other.cols
    assert node.probs is not None
    if cols == node.probs.shape[-1]:  # every key column met its values: the attention's output
        assert node.value is not None
        _record(node, form, node.value, out)
    else:
        _keep(nodes, out, node, form=form, cols=cols)


def _where(nodes: dict[int, Node], args: tuple[Any, ...], out: Any) -> None:
    if len(args) != 3:
        return
    cond, x, y = args
    for keep, scores, value in ((True, x, y), (False, y, x)):
        node = _node(nodes, scores)
        if node is not None and node.stage == "scores" and isinstance(cond, torch.Tensor):
            term = patterns.Term("where", cond, tuple(scores.shape), value=value, keep=keep)
            _keep(nodes, out, node, form=(*node.form, "where"), terms=(*node.terms, term))
            return


def _product(nodes: dict[int, Node], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    if name == "einsum":
        operands = args[1:] if len(args) > 2 else (tuple(args[1]) if len(args) == 2 else ())
        if len(operands) != 2:
            return
        a, b, transposed = operands[0], operands[1], False
    elif name == "baddbmm":
        a, b = kwargs.get("batch1", args[1] if len(args) > 1 else None), kwargs.get("batch2",
                                                                                   args[2] if len(args) > 2 else None)
        transposed = True
    else:
        a, b = args[0] if args else kwargs.get("input"), args[1] if len(args) > 1 else kwargs.get("other")
        transposed = True
    if not (_activation(a) and _activation(b) and isinstance(out, torch.Tensor)):
        return
    st = state()
    st.products += 1
    probs = _node(nodes, a)
    if probs is not None and probs.stage == "probs":
        nodes.pop(id(a), None)
        _record(probs, (*probs.form, name), b, out)
        return
    if probs is not None and probs.stage == "piece":  # a piece of the probabilities times its values
        _keep(nodes, out, probs, form=(*probs.form, name), stage="partial",
              value=probs.value if probs.value is not None else b)
        return
    before: list[str] = []
    node = Node(weakref.ref(out), "scores", a, b, transposed, (name,), heads=_folded(st, a) or _folded(st, b))
    for part, operand in (("q", a), ("k", b)):  # a number Q or K was scaled by before the product scales QKᵀ too
        factors = _factors(st, operand)
        node.steps = (*node.steps, *factors)
        before += [f"{kind} {part}" for kind, _ in factors]
    node.form = (*before, *node.form)
    if name == "baddbmm":
        bias = args[0] if args else kwargs.get("input")
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if isinstance(bias, torch.Tensor) and beta != 0:
            node.terms = (patterns.Term("add", bias, tuple(out.shape), sign=float(beta)),)
        if alpha != 1:
            node.steps = (*node.steps, ("mul", alpha))
    nodes[id(out)] = node


def _record(node: Node, form: tuple[str, ...], v: torch.Tensor, out: torch.Tensor) -> None:
    record(node, form, v, out, node.heads or _folded(state(), v))
