"""For every attention call off its fastest path: the change that would move it, measured on a copy.

:func:`advise` traces a deep copy of the model as given, reads each call's
facts -- PyTorch's own reason, the path, the SDPA backend, the masks,
``need_weights``, the modes -- and turns them into candidate changes
(:mod:`qkvtrace.analyses.advice_rules`). Each candidate is then applied to another
deep copy and measured against an unchanged copy: the path and backend the
call takes now (by tracing the changed copy), the time of the whole forward
(and backward with ``train``) in interleaved repetitions, and the largest
difference of the outputs (and gradients). A candidate is recommended only
when the call moved to another path or kernel *and* the changed copy was
faster in every repetition; the rest are reported with what they did.

The user's model is never run: its parameters, buffers, hooks, training
flag and the process's random number generators are as they were.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkvtrace.analyses.advice_rules import Candidate, candidates_for, combined
from qkvtrace.analyses.grads import probe_like
from qkvtrace.records import kernel_refusal

__all__ = ["ADVISE_SCHEMA", "Advice", "Measured", "advise"]

ADVISE_SCHEMA = "qkvtrace.advise/1"

RECOMMENDED = "recommended"
#: the SDPA backend a record names for PyTorch's plain composite kernel
_MATH = "MATH"


@dataclass
class Measured:
    """One candidate change for one call (or for every call it reaches), and what it did."""

    call: int
    module: str
    path: str
    backend: str | None
    reason: str | None
    change: str
    #: what the change is made to: a module's name (``""``: the root), ``None`` for the whole model (or its call)
    scope: str | None
    #: what the change costs the caller: weights it no longer gets, autograd, a hook that no longer runs
    gives_up: str
    #: ``file:line`` of the code that calls the module, read from the frame when the copy ran
    where: str | None = None
    path_after: str | None = None
    backend_after: str | None = None
    reason_after: str | None = None
    #: changed / unchanged time of one unit of work, per interleaved repetition
    ratios: list[float] = field(default_factory=list)
    #: repetitions discarded as broken samples (a ratio outside :data:`SANE_BAND`) and taken again
    discarded: int = 0
    #: what ``ratios`` time: ``"model"`` (a unit of the whole model), or ``"core"`` (a change to the model's own
    #: code: the attention core alone, as written and with the change, on tensors of the call's shapes)
    measured_on: str = "model"
    #: with ``measured_on == "core"``: the whole model's time with the change over without, per repetition,
    #: estimated as (model − n·core as written + n·core changed) / model, each timed in that repetition, where n is
    #: the number of calls the same code made in one unit
    model_ratios: list[float] = field(default_factory=list)
    #: with ``measured_on == "core"``: n·(core as written) / model, the share of a unit the changed code takes
    core_share: float | None = None
    #: the largest |changed - unchanged| over every output element (and every gradient with ``train``)
    max_abs_diff: float | None = None
    max_abs_grad_diff: float | None = None
    #: the parameter whose gradient differs the most (``train``; ``None`` where the gradients are not named)
    max_abs_grad_param: str | None = None
    #: peak device memory changed / unchanged (CUDA only; ``None`` where it cannot be measured)
    memory_ratio: float | None = None
    #: ``recommended``, or why not (not faster, no other path, changes results, raised, not measured)
    verdict: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def model_median(self) -> float | None:
        """The whole model's median time ratio: measured, or estimated from the core (``model_ratios``)."""
        if self.measured_on == "core":
            return statistics.median(self.model_ratios) if self.model_ratios else None
        return self.median


@dataclass
class Advice:
    """What :func:`advise` found: every candidate measured (recommended first), and the calls with none."""

    target: str
    torch_version: str
    device: str
    train: bool
    repeats: int
    measured: list[Measured] = field(default_factory=list)
    #: calls already on their fastest path, or off it with no known change: (call, module, path, why)
    settled: list[dict[str, Any]] = field(default_factory=list)
    #: candidates the time budget left unmeasured
    unmeasured: list[str] = field(default_factory=list)
    #: what the advisor itself took, in seconds
    seconds: float = 0.0

    @property
    def recommended(self) -> list[Measured]:
        return [m for m in self.measured if m.verdict == RECOMMENDED]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = ADVISE_SCHEMA
        for m, row in zip(self.measured, out["measured"], strict=True):
            row["median"] = m.median
            row["min"] = min(m.ratios) if m.ratios else None
            row["max"] = max(m.ratios) if m.ratios else None
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


# -- running a copy -------------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every floating tensor in a model's output (tensors, tuples, lists, dicts, ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and not value.is_nested else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@dataclass
class _Run:
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    train: bool
    #: the context the unit runs in (the caller's own modes unless a change says otherwise)
    context: Callable[[], Any] = contextlib.nullcontext
    #: the loss's fixed weighting of each output, made once (not in every timed unit)
    probes: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    #: the names of the parameters whose gradients the last unit returned, in their order
    grad_names: list[str] = field(default_factory=list)

    def probe(self, out: torch.Tensor) -> torch.Tensor:
        key = (tuple(out.shape), out.device)
        if key not in self.probes:
            self.probes[key] = probe_like(out)
        return self.probes[key]

    def __call__(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One unit of work: forward (and backward with ``train``); the outputs and the parameters' gradients."""
        model = self.model
        if self.train:
            model.zero_grad(set_to_none=True)
        with self.context():
            outs = _tensors(model(*self.args, **self.kwargs))
            if self.train:
                loss = sum((o.float() * self.probe(o)).sum() for o in outs if o.requires_grad)
                if isinstance(loss, torch.Tensor):
                    loss.backward()
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None] if self.train else []
        self.grad_names = [n for n, _ in named]
        return [o.detach() for o in outs], [g for _, g in named]


def _diffs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[float] | None:
    """The largest |a - b| of each pair of tensors (0 for an empty pair), ``None`` when they differ in number or
    shape."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return None
    return [float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
    diffs = _diffs(a, b)
    return None if diffs is None else max(diffs, default=0.0)


#: seconds one timed sample should last at least (small models run several units per sample)
_MIN_SAMPLE = 0.05


#: a repetition whose changed / unchanged time is outside this band around the median of the repetitions is a
#: broken sample (the machine paused one side, a timer jumped), not a measurement: it is discarded and taken again
#: (a change that is really 20 times faster is so in every repetition)
SANE_BAND = (0.1, 10.0)
#: the good repetitions a verdict needs at least
MIN_GOOD = 2

Clock = Callable[[], float]


def _timed(run: Callable[[], Any], loops: int = 1, clock: Clock = time.perf_counter) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = clock()
    for _ in range(loops):
        run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - start


def _peak(run: _Run) -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.reset_peak_memory_stats()
    run()
    return float(torch.cuda.max_memory_allocated())


# -- the advisor -------------------------------------------------------------------------------------


def _traced(run: _Run, trace_model: nn.Module) -> Any:
    from qkvtrace.tracer import trace

    with trace(trace_model, gradients=False, routes=False) as t:
        run()
    return t.result


def _same_call(calls: Sequence[Any], module: str, index: int) -> Any:
    """The changed copy's call of ``module`` (the same occurrence when a module is called several times)."""
    mine = [c for c in calls if c.module == module]
    return mine[index] if index < len(mine) else (mine[0] if mine else None)


def advise(
    model: nn.Module,
    *args: Any,
    train: bool = False,
    repeats: int = 7,
    budget: float | None = None,
    target: str = "",
    progress: Callable[[str], None] | None = None,
    clock: Clock = time.perf_counter,
    **kwargs: Any,
) -> Advice:
    """Measure, on copies of ``model`` called with ``args``/``kwargs``, the changes that move attention to a faster
    path. ``train``: a training step (forward and backward) instead of an inference forward in ``eval()``.
    ``budget``: seconds after which no further candidate is measured (those left are listed).
    ``clock``: what times the repetitions and the budget (``time.perf_counter``; a test hands its own).
    """
    if repeats < 2:
        raise ValueError(f"repeats={repeats}: at least 2 interleaved repetitions are needed for a spread")
    say = progress or (lambda _text: None)
    started = clock()
    device = next((p.device.type for p in model.parameters()), "cpu")
    advice = Advice(target=target, torch_version=torch.__version__, device=device, train=train, repeats=repeats)
    with torch.random.fork_rng(devices=_cuda_devices()):
        base_model = copy.deepcopy(model).train(train)
        base = _Run(base_model, args, kwargs, train)
        say("tracing a copy as given")
        torch.manual_seed(0)
        before = _traced(base, base_model)
        occurrence: dict[str, int] = {}
        work: list[tuple[Any, int, Candidate]] = []
        for call in before.calls:
            n = occurrence.get(call.module, 0)
            occurrence[call.module] = n + 1
            found, settled = candidates_for(call, base_model, train)
            if not found:
                advice.settled.append({"call": call.index, "module": call.module, "path": call.path,
                                       "backend": call.sdpa_backend, "why": settled})  # fmt: skip
            work.extend((call, n, c) for c in found)
        seen: dict[tuple[str | None, frozenset[str]], Measured] = {}
        #: every single change offered so far, by name: what a joined change that moved the call is made of
        singles = {c.change: c for _, _, c in work}

        i = 0
        while i < len(work):
            call, n, cand = work[i]
            i += 1
            key = (cand.scope, frozenset(cand.names))
            if key in seen:  # one change of a module (or of the whole model) reaches all its calls, and changes
                continue  # joined in another order are the same changes: measured once
            m = Measured(call=call.index, module=call.module, path=call.path, backend=call.sdpa_backend,
                         reason=call.why_not_fast_path or call.why_not_fused_layer, change=cand.change,
                         scope=cand.scope, gives_up=cand.gives_up)  # fmt: skip
            seen[key] = m
            advice.measured.append(m)
            if budget is not None and clock() - started > budget:
                m.verdict = f"not measured: --budget {budget:g} s spent"
                advice.unmeasured.append(f"{call.module or '(root)'}: {cand.change}")
                continue
            say(f"measuring {i}/{len(work)}: {cand.change} on {call.module or '(root)'}")
            same_code = sum(1 for c in before.calls if (c.path, c.module_type) == (call.path, call.module_type))
            _measure(m, cand, base, model, args, kwargs, train, repeats, n, same_code, clock)
            work[i:i] = [(call, n, c) for c in _next_changes(m, cand, call, base_model, train, singles)
                         + _left_out(m, cand, singles)]  # fmt: skip
    order = {RECOMMENDED: 0}
    advice.measured.sort(key=lambda m: (order.get(m.verdict, 1), m.model_median if m.model_median is not None else 9e9))
    advice.seconds = clock() - started
    return advice


#: the most changes joined in one candidate (every rule for one ``MultiheadAttention`` call at once)
MAX_JOINED = 5


def _next_changes(m: Measured, cand: Candidate, call: Any, model: nn.Module, train: bool,
                  singles: dict[str, Candidate] | None = None) -> list[Candidate]:  # fmt: skip
    """When a change left the call on its path with another of PyTorch's reasons, that reason's changes with it
    (the fast path's conditions are a list, and PyTorch names the first one not met: each change may show the next)."""
    if m.path_after != m.path or not m.reason_after or m.reason_after == m.reason or len(cand.names) >= MAX_JOINED:
        return []
    after = copy.copy(call)
    after.why_not_fast_path = m.reason_after if call.why_not_fast_path else None
    after.why_not_fused_layer = m.reason_after if not call.why_not_fast_path else call.why_not_fused_layer
    found, _ = candidates_for(after, model, train)
    if singles is not None:  # (kept by name, for :func:`_left_out`)
        singles.update((c.change, c) for c in found)
    return [combined(cand, c) for c in found if c.change not in cand.names]


def _left_out(m: Measured, cand: Candidate, singles: dict[str, Candidate]) -> list[Candidate]:
    """When three or more changes joined moved the call to another path, the same changes with one left out at a
    time: which of them the path needs (two joined: each alone was measured first)."""
    if m.path_after == m.path or m.path_after is None or len(cand.names) < 3:
        return []
    out = []
    for left in cand.names:
        rest = [singles[name] for name in cand.names if name != left and name in singles]
        if len(rest) == len(cand.names) - 1:
            out.append(functools.reduce(combined, rest))
    return out


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _measure(m: Measured, cand: Candidate, base: _Run, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             train: bool, repeats: int, occurrence: int, same_code: int = 1,
             clock: Clock = time.perf_counter) -> None:  # fmt: skip
    if cand.pair is not None:
        _measure_pair(m, cand, repeats, train, base, same_code, clock)
        return
    changed_model = copy.deepcopy(model).train(train)
    try:
        context, where = cand.apply(changed_model)
        changed = _Run(changed_model, args, kwargs, train, context or contextlib.nullcontext)
        torch.manual_seed(0)
        after = _traced(changed, changed_model)
    except Exception as exc:  # the change itself broke the call: that is the finding
        m.verdict = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        return
    m.where = where[0] if where else None
    call = _same_call(after.calls, m.module, occurrence)
    refused = None
    dropout = 0.0
    if call is not None:
        m.path_after, m.backend_after = call.path, call.sdpa_backend
        m.reason_after = call.why_not_fast_path or call.why_not_fused_layer
        refused = kernel_refusal(call.sdpa_refusals)
        dropout = float(call.inputs.get("dropout_p") or 0.0) if train else 0.0
    m.discarded = _judge(m, cand, base, changed, repeats, train, clock=clock)
    peak_a, peak_b = _peak(base), _peak(changed)
    if peak_a and peak_b:
        m.memory_ratio = peak_b / peak_a
    m.verdict = _verdict(m, cand)
    on_math = dropout and m.backend_after == _MATH  # (what keeps the changed call on MATH, said on every verdict)
    if m.verdict.startswith("no other path") and refused is not None:  # PyTorch's words for the kernel it did not pick
        m.verdict += f"; PyTorch refused {refused[0]}: {refused[1]}"
    elif on_math:
        m.verdict += f"; it ran {_MATH}" + (f": PyTorch refused {refused[0]}: {refused[1]}" if refused else "")
    if on_math:
        m.verdict += f" (the call's dropout={dropout:g}, which applies in training only)"


def _measure_pair(m: Measured, cand: Candidate, repeats: int, train: bool, base: _Run, calls: int,
                  clock: Clock = time.perf_counter) -> None:  # fmt: skip
    """A change to the model's own code: the computation as written and as changed, on tensors of its shapes; the
    whole model is timed beside them, so the change's share of a unit can be estimated (``model_ratios``)."""
    assert cand.pair is not None
    written, changed, kernel = cand.pair()
    m.where = cand.site
    m.measured_on = "core"
    m.path_after, m.backend_after = kernel()
    m.discarded = _judge(m, cand, written, changed, repeats, train, model=base, calls=calls, clock=clock)
    m.verdict = _verdict(m, cand)


def _judge(m: Measured, cand: Candidate, today: Callable[[], Any], changed: Callable[[], Any], repeats: int,
           train: bool, model: _Run | None = None, calls: int = 1,
           clock: Clock = time.perf_counter) -> int:  # fmt: skip
    """The largest output (and, with ``train``, gradient) difference of one run each, then their time ratio over
    ``repeats`` good repetitions: one whose ratio is outside :data:`SANE_BAND` around the median of those taken is
    discarded and taken again (as many more tries as ``repeats``). Returns how many were discarded."""
    torch.manual_seed(0)
    out_a, grad_a = today()
    torch.manual_seed(0)
    out_b, grad_b = changed()
    if cand.drops_outputs and len(out_b) < len(out_a):  # what the change gives up is not a difference of results
        out_a = out_a[: len(out_b)]
    m.max_abs_diff = _max_diff(out_a, out_b)
    if train:
        diffs = _diffs(grad_a, grad_b)
        m.max_abs_grad_diff = None if diffs is None else max(diffs, default=0.0)
        names = getattr(today, "grad_names", None)
        if diffs and m.max_abs_grad_diff and names and len(names) == len(diffs):
            m.max_abs_grad_param = names[diffs.index(m.max_abs_grad_diff)]
    # a sample long enough to rise above the timer's noise
    loops = max(1, int(_MIN_SAMPLE / max(_timed(today, 1, clock), 1e-6)))
    model_loops = max(1, int(_MIN_SAMPLE / max(_timed(model, 1, clock), 1e-6))) if model is not None else 0
    taken: list[tuple[float, float | None, float | None]] = []  # each repetition's ratio, model ratio and share
    good: list[tuple[float, float | None, float | None]] = []
    while len(good) < repeats and len(taken) < 2 * repeats:  # interleaved: the same drifts of the machine hit both
        a = _timed(today, loops, clock)
        b = _timed(changed, loops, clock)
        model_ratio = share = None
        if model is not None:
            whole = _timed(model, model_loops, clock) / model_loops
            model_ratio = max(whole - calls * (a - b) / loops, 1e-9) / whole if whole > 0 else None
            share = calls * a / loops / whole if whole > 0 else None
        taken.append((b / a if a > 0 else math.inf, model_ratio, share))
        good = _good(taken)
    good = good[:repeats]
    m.ratios = [r for r, _, _ in good]
    if model is not None:
        m.model_ratios = [r for _, r, _ in good if r is not None]
        shares = [s for _, _, s in good if s is not None]
        if shares:
            m.core_share = statistics.median(shares)
    return len(taken) - len(good)


def _good(taken: list[tuple[float, float | None, float | None]]) -> list[tuple[float, float | None, float | None]]:
    """The repetitions whose ratio is within :data:`SANE_BAND` of the median of the finite, positive ones."""
    finite = [r for r, _, _ in taken if 0 < r < math.inf]
    if not finite:
        return []
    middle = statistics.median(finite)
    low, high = SANE_BAND
    return [t for t in taken if 0 < t[0] < math.inf and low <= t[0] / middle <= high]


def _verdict(m: Measured, cand: Candidate) -> str:
    moved = (m.path_after, m.backend_after) != (m.path, m.backend)
    tolerance = cand.tolerance
    if m.max_abs_diff is None:
        return "changes results: the outputs differ in number or shape"
    if m.max_abs_diff > tolerance:
        return f"changes results: outputs differ by up to {m.max_abs_diff:.3g} (more than {tolerance:g})"
    if (m.max_abs_grad_diff or 0.0) > tolerance:
        which = f"the gradient of {m.max_abs_grad_param} differs" if m.max_abs_grad_param else "the gradients differ"
        return (f"changes results: {which} by up to {m.max_abs_grad_diff:.3g} (more than {tolerance:g}); "
                f"outputs agree within {m.max_abs_diff:.3g}")  # fmt: skip
    if not moved:
        return f"no other path: the call still runs {m.path_after or 'nothing seen'}" + (
            f" ({m.backend_after})" if m.backend_after else "")
    if len(m.ratios) < MIN_GOOD:
        high = SANE_BAND[1]
        return (f"not measured: {m.discarded} of {m.discarded + len(m.ratios)} repetitions were broken samples "
                f"(more than {high:g}x away from their median); {MIN_GOOD} good ones are needed")  # fmt: skip
    if max(m.ratios) < 1.0 and (not m.model_ratios or max(m.model_ratios) < 1.0):
        return RECOMMENDED
    return (f"not faster beyond the spread: {min(m.ratios):.2f}-{max(m.ratios):.2f} of today's time "
            f"over {len(m.ratios)} repetitions")  # fmt: skip
