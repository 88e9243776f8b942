"""Which weight rows became the Q, K and V of a call that built no autograd graph: read from the torch functions
the call itself ran.

Under ``torch.no_grad()``, ``inference_mode()`` or with frozen weights a call leaves no autograd graph to read
its rows from (:mod:`qkvtrace.facts.dataflow` reads them from one in training). While a watched module runs (its first
calls in a trace, and its calls while their layouts are new), the tracer's mode writes every torch function the
module calls into a :class:`Log` (:func:`see`): the function, its arguments -- each tensor as the entry that made
it, or, for a tensor made elsewhere, a weak reference -- and the shapes it returned. Nothing is copied, computed or
read back.

At the kernel call, :func:`derive`

1. walks the log back from the kernel's Q, K and V to the nearest function on each branch that multiplies by the
   weight of a projection of the module or its parents (``nn.Linear``, a ``Conv1D``), never past another matmul
   (so never into an earlier layer);
2. runs **the logged torch functions between them, and only those**, on probes: each projection's output becomes
   a leaf of its shape with gradients on, filled from a private generator; every other tensor they read is the one
   the call read (copied where it is an inference tensor, or where the functions write in place, so nothing of the
   call's changes);
3. asks autograd for the gradient of each part with respect to each leaf: an output feature that never reaches
   the part has an exactly zero gradient column, one that does has a non-zero one -- as in training.

Nothing of the model runs a second time: no ``forward``, no hook, no function of the model's own (a branch
through one gives no rows and says so), no collective, no lock, no random draw (dropout is passed through: it
keeps every feature's way). The functions run with every torch function and dispatch mode set aside and never
while a profiler records (the call's rows then wait for a later call). What is read holds for this call only:
its rows are those this call used, or ``None`` with the reason.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._python_dispatch
from torch import nn

from qkvtrace.facts.projection_rows import Candidate, Found, candidates, merged, projection_of
from qkvtrace.facts.slices import PARTS, Projection, rows_of

__all__ = ["EVIDENCE", "NOT_RECORDED", "PROFILING", "UNWATCHED", "Log", "current", "derive", "lasting",
           "never_recorded", "see", "start", "stop"]

EVIDENCE = "dataflow: the call's own torch functions from its projections to the kernel, run on probes"

#: why a call's rows wait for a later call: a profiler records (the probes' functions would show in its profile)
PROFILING = "a profiler is recording, and running the call's functions on probes would show in its profile"

#: why a call's rows wait for a later call: its functions were not written down
NOT_RECORDED = (
    "its torch functions were not recorded (they are while a module's calls in a trace are new, and this layout "
    "came after): a later call of this layout gives its rows"
)

#: entries one log holds at most (a watched module's whole forward); past it, nothing more is written
MAX_OPS = 20_000
#: entries one walk back from Q, K or V visits at most
_MAX_WALK = 512
#: bytes of the call's tensors copied for one derivation at most (inference tensors, tensors written in place)
MAX_COPY_BYTES = 256 * 2**20

#: functions that multiply two operands: the one that reads a projection's weight is where a walk stops; any
#: other is never walked past
_MATMUL = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addmm_", "baddbmm",
                     "addbmm", "einsum", "conv1d", "bilinear", "tensordot", "outer", "mv", "inner", "dot"})  # fmt: skip
#: functions a weight may pass through on its way into its matmul (``x @ W.T``, a cast)
_WEIGHT_WAY = frozenset({"t", "T", "mT", "H", "mH", "transpose", "permute", "to", "float", "half", "bfloat16",
                         "type", "type_as", "contiguous", "detach"})  # fmt: skip
#: dropout keeps every feature's way to Q, K and V: the probes pass through it unchanged (no random draw)
_DROPOUT = frozenset({"dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
                      "dropout3d", "native_dropout"})  # fmt: skip
#: functions that draw random numbers: never run again
_RANDOM = frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
                     "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "random_",
                     "cauchy_", "log_normal_", "geometric_", "poisson", "rrelu", "rrelu_"})  # fmt: skip
#: functions whose output may view their first argument's memory (checked when it is written down)
_VIEWS = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "T", "mT", "narrow",
                    "select", "__getitem__", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "expand",
                    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "diagonal", "as_strided",
                    "view_as_real", "view_as_complex", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold",
                    "detach", "alias", "contiguous", "real", "imag"})  # fmt: skip
#: functions, and the positions of their arguments, whose value cannot decide whether a feature of another
#: argument reaches the output (a tensor joined beside it, added to it, or written into): such an argument freed
#: since the call read it (the old KV cache a decoding step joined its new keys to) is stood in for by zeros
_JOINS, _SUMS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack"}), frozenset({
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__", "__isub__"})
_BESIDE = {**dict.fromkeys(_JOINS, (0,)), **dict.fromkeys(_SUMS, (0, 1)), **dict.fromkeys(
    ("copy_", "index_copy", "index_copy_", "__setitem__", "index_put", "index_put_", "slice_scatter",
     "select_scatter"), (0,))}  # fmt: skip
#: in-place functions whose names do not end in ``_``
_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


class _Made:
    """An argument made by the log's entry ``index`` (its output ``position``; ``-1``: the tensor it wrote to)."""

    __slots__ = ("index", "position")

    def __init__(self, index: int, position: int) -> None:
        self.index = index
        self.position = position


class _Outside:
    """An argument made outside the log: held weakly, with its version counter when it has one."""

    __slots__ = ("meta", "ref", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.version = _version(t)
        self.meta = (t.shape, t.dtype, t.device)


class _Entry:
    """One torch function the module called: its arguments as :class:`_Made`/:class:`_Outside`, what it made."""

    __slots__ = ("args", "func", "in_place", "inputs", "kwargs", "metas", "name", "outs", "root")

    def __init__(self, func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 inputs: list[_Made | _Outside], in_place: bool, outs: list[tuple[int, torch.Tensor]],
                 root: int | None) -> None:  # fmt: skip
        #: the entry whose memory this one's output views (``None``: its own, or memory made outside the log)
        self.root = root
        self.func = func
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs
        self.in_place = in_place
        #: per output: its position, shape, dtype and device
        self.metas = [(position, t.shape, t.dtype, t.device) for position, t in outs]
        #: per output position: the tensor made, weakly, and its version then (read where it is still unchanged)
        self.outs = {position: _Outside(t) for position, t in outs}


class Log:
    """The torch functions one thread's watched modules called, in order, while the tracer's mode was on."""

    __slots__ = ("__weakref__", "entries", "made", "writes")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        #: id of each tensor an entry made -> (the tensor, weakly; the entry; its output position)
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        #: entry whose memory was written in place (itself, or through a view of it) -> the entries that wrote
        self.writes: dict[int, list[int]] = {}

    def clear(self) -> None:
        self.entries.clear()
        self.made.clear()
        self.writes.clear()

    def source(self, t: torch.Tensor) -> _Made | None:
        found = self.made.get(id(t))
        if found is None or found[0]() is not t:
            return None
        return _Made(found[1], found[2])


_local = threading.local()


def current() -> Log | None:
    """The log this thread's watched modules write to now (``None``: no module is watched here)."""
    return getattr(_local, "log", None)


def start() -> Log:
    """A new, empty log for this thread (the tracer's mode comes on)."""
    log = _local.log = Log()
    return log


def stop() -> None:
    """This thread's log is dropped (the mode goes off): nothing it referred to is kept."""
    log = getattr(_local, "log", None)
    if log is not None:
        log.clear()
    _local.log = None


def _version(t: torch.Tensor) -> int | None:
    if t.is_inference():
        return None  # (inference tensors keep no version counter)
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of a tensor (``W.T``): the property's own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def see(log: Log, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Write the call ``func(*args, **kwargs) -> out`` into ``log`` (after it ran; nothing is read or copied)."""
    entries = log.entries
    if len(entries) >= MAX_OPS:
        return
    inputs: list[_Made | _Outside] = []
    made = log.made

    def ref(t: torch.Tensor) -> _Made | _Outside:
        found = made.get(id(t))
        got: _Made | _Outside = _Made(found[1], found[2]) if found is not None and found[0]() is t else _Outside(t)
        inputs.append(got)
        return got

    def arg(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ref(x)
        if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
            return [arg(y) for y in x] if isinstance(x, list) else tuple(arg(y) for y in x)
        return x

    logged_args = tuple(arg(a) for a in args)
    logged_kwargs = {k: arg(v) for k, v in kwargs.items()} if kwargs else {}
    if not inputs:
        return  # a tensor made from no tensor (``arange``): read as made outside the log
    name = _name(func)
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE or "out" in kwargs
    made_now: list[tuple[int, torch.Tensor]]  # (output position, the tensor); -1: the tensor written in place
    if in_place:
        target = kwargs["out"] if "out" in kwargs else args[0]
        made_now = [(-1, target)] if isinstance(target, torch.Tensor) else []
    elif isinstance(out, torch.Tensor):
        made_now = [(0, out)]
    elif isinstance(out, (tuple, list)):
        made_now = [(i, t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    else:
        return  # no tensor made (``dim()``, ``size()``): nothing to follow
    if not made_now:
        return
    index = len(entries)
    written = (logged_kwargs.get("out") if "out" in kwargs else logged_args[0] if logged_args else None) if in_place \
        else inputs[0]  # (the tensor an in-place function writes; a view's, the tensor it views)
    first = written if isinstance(written, _Made) else None
    root = None
    if first is not None and (in_place or (name in _VIEWS and _shares(args, kwargs, made_now[0][1]))):
        root = entries[first.index].root
        root = first.index if root is None else root
        if in_place:
            log.writes.setdefault(root, []).append(index)
            root = None  # (what an in-place function returns is its target: found through the target's entry)
    entries.append(_Entry(func, name, logged_args, logged_kwargs, inputs, in_place, made_now, root))
    for position, t in made_now:
        made[id(t)] = (weakref.ref(t), index, position)


#: why a call's rows are not read: no module is watched around it (said instead of :data:`NOT_RECORDED`)
UNWATCHED = (
    "its torch functions are not recorded: neither it nor a module of the model around it that holds a projection "
    "(an nn.Linear, a Conv1D) is watched"
)


def never_recorded(found: Projection | str) -> Projection | str:
    """``found``, saying :data:`UNWATCHED` where it said :data:`NOT_RECORDED` (no later call will be recorded)."""
    if isinstance(found, str) and found.endswith(NOT_RECORDED):
        return found[: -len(NOT_RECORDED)] + UNWATCHED
    return found


def lasting(found: Projection | str) -> bool:
    """Whether an answer holds for later calls of the same layout (rows, or a reason a later call would give too)."""
    return not (isinstance(found, str) and found.endswith((PROFILING, NOT_RECORDED)))


def _shares(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> bool:
    """Whether ``out`` views the memory of the function's first tensor argument."""
    first = args[0] if args else kwargs.get("input")
    try:
        if not isinstance(first, torch.Tensor):
            return False
        return bool(out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor with no storage (a subclass, a nested tensor)
        return False


# -- deriving ---------------------------------------------------------------------------------------------


def _is_torch(func: Any) -> bool:
    """Whether ``func`` is PyTorch's own (a method of its tensors, one of its functions), not the model's."""
    # (a tensor's property, ``t.mT``, is its descriptor's ``__get__``: the descriptor's class is the owner)
    owner = getattr(getattr(func, "__self__", None), "__objclass__", None) or getattr(func, "__objclass__", None)
    module = getattr(owner, "__module__", None) if owner is not None else getattr(func, "__module__", None)
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


class _Unknown(Exception):
    """Why a call's rows cannot be read from its log (said in the call's reason)."""


def _weight(log: Log, x: _Made | _Outside, by_id: dict[int, tuple[torch.Tensor, Candidate]]) -> int | None:
    """The id of the candidate weight ``x`` is (through transposes or casts), or ``None``."""
    for _ in range(4):
        if isinstance(x, _Outside):
            t = x.ref()
            return id(t) if t is not None and id(t) in by_id else None
        entry = log.entries[x.index]
        if entry.name not in _WEIGHT_WAY or len(entry.inputs) != 1:
            return None
        x = entry.inputs[0]
    return None


def _walk(log: Log, start: _Made, by_id: dict[int, tuple[torch.Tensor, Candidate]],
          needed: set[int], cuts: set[int]) -> dict[int, int]:  # fmt: skip
    """The entries between ``start`` and the nearest matmul reading a projection's weight on each branch back
    (into ``needed``), the other matmuls met (``cuts``), and those matmuls: entry -> id of the weight.

    An entry's memory written in place after it was made and before it was read (``k = empty(...);
    k[..., :n] = k_nope``, then the kernel reads ``k``) brings in the writes; a write after the last read of
    it on the way does not (what it changed was not read).
    """
    consumers: dict[int, int] = {}
    queue = [(start.index, len(log.entries))]  # (an entry, the latest entry on the way that reads it)
    read_by: dict[int, int] = {}
    while queue:
        i, reader = queue.pop()
        if read_by.get(i, -1) >= reader:
            continue
        first = i not in read_by
        read_by[i] = reader
        if len(read_by) > _MAX_WALK:
            raise _Unknown(f"more than {_MAX_WALK} torch functions lie between the kernel and its projections")
        entry = log.entries[i]
        if entry.name in _MATMUL:
            wid = next((w for w in (_weight(log, x, by_id) for x in entry.inputs) if w is not None), None)
            if wid is not None:
                consumers[i] = wid
            else:
                cuts.add(i)
            continue
        if first:
            needed.add(i)
            queue.extend((x.index, i) for x in entry.inputs if isinstance(x, _Made))
        root = i if entry.root is None else entry.root
        queue.extend((w, reader) for w in log.writes.get(root, ()) if i < w < reader)
    return consumers


#: the step of the values a probe holds (the golden ratio's fraction: no two entries alike, none zero)
_STEP = 0.6180339887498949


def _probe(shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Values in ``[0.5, 1.5)`` that differ from entry to entry, made without a random generator (none is
    touched, and a large probe costs a few passes over memory): ``frac((i + seed) · φ) + 0.5``."""
    real = dtype if dtype.is_floating_point or dtype.is_complex else torch.float32
    n = math.prod(shape)
    values = torch.arange(seed, seed + n, device=device, dtype=torch.float64 if n > 2**24 else torch.float32)
    return values.mul_(_STEP).frac_().add_(0.5).to(real).view(tuple(shape))


class _Missing:
    """A value that could not be had (said only if something needs it)."""

    __slots__ = ("meta", "why")

    def __init__(self, why: str, meta: tuple[torch.Size, torch.dtype, torch.device]) -> None:
        self.why = why
        self.meta = meta


class _Run:
    """The logged functions between the projections and Q, K, V, run on probes, in the order the call ran them.

    A function no probe reaches (the rotary angles from the positions, a mask) is not run where what it made is
    still alive and unchanged: that tensor is read instead (a temporary it read may be gone).
    """

    def __init__(self, log: Log, needed: set[int], consumers: dict[int, int], cuts: set[int]) -> None:
        self.log = log
        self.values: dict[tuple[int, int], Any] = {}
        self.leaves: dict[int, torch.Tensor] = {}
        self.copy_all = any(log.entries[i].in_place for i in needed)
        self.copied = 0
        # what is written in place later: its earlier value is not the one alive now
        self.written = set(log.writes)  # (entries whose memory is written in place later: not read as they are now)
        self.reached = set(consumers)
        for i in sorted(needed):
            if any(isinstance(x, _Made) and x.index in self.reached for x in log.entries[i].inputs):
                self.reached.add(i)
        for i in consumers:
            _, shape, dtype, device = log.entries[i].metas[0]
            if not dtype.is_floating_point:
                raise _Unknown(f"the projection {log.entries[i].name} made a {dtype} tensor")
            leaf = _probe(shape, dtype, device, 20 + i).requires_grad_()
            self.leaves[i] = leaf
            # (written in place on the way, the leaf itself could not be: a copy of it is)
            self.values[(i, 0)] = leaf.clone() if self.copy_all else leaf
        for i in cuts:
            if not self._alive(i):
                _, shape, dtype, device = log.entries[i].metas[0]
                self.values[(i, 0)] = _probe(shape, dtype, device, 20 + i)
        for i in sorted(needed):
            if i in self.reached or not self._alive(i):
                try:
                    self._run(i)
                except _Unknown as exc:
                    for position, *meta in log.entries[i].metas:
                        self.values[(i, position)] = _Missing(str(exc), tuple(meta))  # type: ignore[arg-type]

    def _alive(self, i: int) -> bool:
        """Entry ``i``'s outputs taken as they are now, if each is alive and unchanged since it was made."""
        entry = self.log.entries[i]
        got = {}
        for position, out in entry.outs.items():
            t = out.ref()
            if t is None or (i if entry.root is None else entry.root) in self.written or out.version != _version(t):
                return False  # (an inference tensor keeps no version: only a write the log saw is known)
            got[(i, position)] = t.detach().clone() if t.is_inference() else t.detach()
        self.values.update(got)
        return True

    def value(self, x: Any, beside: bool = False) -> Any:
        """``x``'s value for a function; ``beside``: an argument whose value decides no feature's way
        (:data:`_BESIDE`)."""
        if isinstance(x, _Made):
            found = self.values.get((x.index, x.position))
            if found is None:
                raise _Unknown(f"{self.log.entries[x.index].name} was not run before its result was read")
            if isinstance(found, _Missing):
                if beside:
                    return torch.zeros(found.meta[0], dtype=found.meta[1], device=found.meta[2])
                raise _Unknown(found.why)
            return found
        if isinstance(x, _Outside):
            t = x.ref()
            if t is None and beside:
                shape, dtype, device = x.meta
                return torch.zeros(shape, dtype=dtype, device=device)
            if t is None:
                raise _Unknown("a tensor the way from a projection to the kernel read was freed before the kernel call")
            if x.version is not None and _version(t) != x.version:
                raise _Unknown("a tensor the way from a projection to the kernel read was changed in place since")
            if self.copy_all or t.is_inference():
                self.copied += t.numel() * t.element_size()
                if self.copied > MAX_COPY_BYTES:
                    raise _Unknown(f"the tensors it reads exceed {MAX_COPY_BYTES // 2**20} MiB")
                return t.detach().clone()
            return t.detach()
        if isinstance(x, list):
            return [self.value(y, beside) for y in x]
        if isinstance(x, tuple):
            return tuple(self.value(y, beside) for y in x)
        return x

    def _run(self, i: int) -> None:
        entry = self.log.entries[i]
        if entry.name in _RANDOM:
            raise _Unknown(f"{entry.name} on the way from a projection to the kernel draws random numbers")
        if not _is_torch(entry.func):
            raise _Unknown(f"the way from a projection to the kernel goes through {entry.name!r}, a function of the "
                           f"model's own (not PyTorch's), which is not run again")  # fmt: skip
        beside = _BESIDE.get(entry.name, ()) if i in self.reached else ()  # (a stand-in only beside a probe's way)
        args = [self.value(a, n in beside) for n, a in enumerate(entry.args)]
        kwargs = {k: self.value(v) for k, v in entry.kwargs.items()}
        if entry.name in _DROPOUT:
            first: Any = args[0] if args else kwargs.get("input")
            out: Any = (first, torch.ones_like(first, dtype=torch.bool)) if entry.name == "native_dropout" else first
        elif "out" in kwargs:  # (autograd takes no out=: the result is computed, then copied into its buffer)
            target = kwargs.pop("out")
            result = entry.func(*args, **kwargs)
            if isinstance(target, torch.Tensor) and target.shape == result.shape:
                result = target.copy_(result)
            self.values[(i, -1)] = result
            return
        elif entry.in_place:
            entry.func(*args, **kwargs)
            self.values[(i, -1)] = args[0]
            return
        else:
            out = entry.func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.values[(i, 0)] = out
        elif isinstance(out, (tuple, list)):
            for position, t in enumerate(out):
                self.values[(i, position)] = t


def derive(log: Log | None, qkv: Sequence[Any], holders: Sequence[nn.Module], why: str) -> Projection | str:
    """The rows of a call whose kernel received ``qkv``, read from ``log``; else ``why`` with what stood in the way.

    ``holders``: the calling module, then its parents, innermost first; the projection must be a weight of one of
    them or of their descendants. ``why``: why the call itself gave no graph to read.
    """
    if log is None:
        return f"{why}; {NOT_RECORDED}"
    if torch.autograd._profiler_enabled():
        return f"{why}; {PROFILING}"
    try:
        return _derive(log, qkv, holders)
    except _Unknown as exc:
        return f"{why}, and its torch functions give none: {exc}"
    except RuntimeError as exc:  # a function refused the probes: the call is still recorded, with why
        return f"{why}, and its torch functions give none: running them on probes raised {type(exc).__name__}: {exc}"


def _derive(log: Log, qkv: Sequence[Any], holders: Sequence[nn.Module]) -> Projection | str:
    by_id = candidates(holders)
    starts: dict[str, _Made] = {}
    for part, t in zip(PARTS, qkv, strict=True):
        start = log.source(t) if isinstance(t, torch.Tensor) else None
        if start is None:
            raise _Unknown(f"{part.upper()} was not made by a torch function of a watched module's call")
        starts[part] = start
    needed: set[int] = set()
    cuts: set[int] = set()
    consumers: dict[int, int] = {}
    for part, start in starts.items():
        found = _walk(log, start, by_id, needed, cuts)
        if not found:
            return (f"not derived: no nn.Linear or Conv1D weight of this module or its parents is multiplied on the "
                    f"way back from {part.upper()} through the call's torch functions")  # fmt: skip
        consumers.update(found)
    for i in consumers:
        width = by_id[consumers[i]][1].width
        shape = log.entries[i].metas[0][1]
        if not shape or shape[-1] != width:
            raise _Unknown(f"the matmul {log.entries[i].name} that reads {by_id[consumers[i]][1].name}.weight does "
                           f"not give one column per output feature")  # fmt: skip
    with torch._C.DisableTorchFunction(), torch.utils._python_dispatch._disable_current_modes(), \
            torch.inference_mode(False), torch.enable_grad():  # fmt: skip
        run = _Run(log, needed, consumers, cuts)
        parts: dict[str, Found] = {}
        for part, start in starts.items():
            t = run.value(start) if start.index not in consumers else run.leaves[start.index]
            parts[part] = _part_rows(part, t, run, consumers, by_id)
    behind = _behind(log, consumers, by_id)
    for entries in parts.values():
        entries[:] = [(cand, rows, behind.get(id(cand.module))) for cand, rows, _ in entries]
    return projection_of(parts, holders, EVIDENCE)


def _part_rows(part: str, t: Any, run: _Run, consumers: dict[int, int],
               by_id: dict[int, tuple[torch.Tensor, Candidate]]) -> Found:  # fmt: skip
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        raise _Unknown(f"no projection's output reaches {part.upper()} through the call's torch functions")
    leaves = list(run.leaves.items())
    probe = _probe(t.shape, t.dtype, t.device, 20)
    grads = torch.autograd.grad([t], [leaf for _, leaf in leaves], [probe], retain_graph=True, allow_unused=True)
    out: Found = []
    for (i, _), grad in zip(leaves, grads, strict=True):
        if grad is None:
            continue
        cand = by_id[consumers[i]][1]
        rows = rows_of(grad.detach().ne(0).reshape(-1, cand.width).any(0))
        if rows:
            out.append((cand, rows, None))
    if not out:
        raise _Unknown(f"no output feature of a projection reaches {part.upper()} with a non-zero gradient")
    return merged(out)


def _behind(log: Log, consumers: dict[int, int],
            by_id: dict[int, tuple[torch.Tensor, Candidate]]) -> dict[int, nn.Module]:  # fmt: skip
    """Per projection module: another projection whose output its matmul reads (``q_a_proj`` behind
    ``q_b_proj``), found by walking the log back from the matmul's activation."""
    out: dict[int, nn.Module] = {}
    for i, wid in consumers.items():
        entry = log.entries[i]
        for x in entry.inputs:
            if not isinstance(x, _Made) or _weight(log, x, by_id) is not None:
                continue
            needed: set[int] = set()
            try:
                earlier = _walk(log, x, by_id, needed, set())
            except _Unknown:
                continue
            other = next((w for w in earlier.values() if w != wid), None)
            if other is not None:
                out[id(by_id[wid][1].module)] = by_id[other][1].module
                break
    return out
