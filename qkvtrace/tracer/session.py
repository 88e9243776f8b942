"""``qkvtrace.trace(model)``: the trace a user opens, and what it keeps.

A trace owns what lives exactly as long as its ``with`` block: the names of
its model's modules, the projections it found, the records it made and its
gradient hooks. It does not own PyTorch's attributes: those belong to the
process-wide installation (:mod:`qkvtrace.tracer.install`), which the trace
acquires on entry and releases on exit. Everything a trace set up is undone
in ``__exit__`` through one ``ExitStack``, on every exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from qkvtrace.base import compat, lazy
from qkvtrace.facts import maps, masks, paths
from qkvtrace.facts.health import Health, HealthRecords
from qkvtrace.facts.routes import Core
from qkvtrace.facts.slices import NormCache, Projection
from qkvtrace.records import (
    AttentionCall,
    CompiledAttention,
    GradientRecord,
    MapTensors,
    RouteRecord,
    TraceResult,
    squared_shares,
)
from qkvtrace.tracer import again, compiled_before, registry, slots, structure
from qkvtrace.tracer import candidates as found_candidates
from qkvtrace.tracer import compiled as compiled_log
from qkvtrace.tracer.gradients import GradientRecorder
from qkvtrace.tracer.install import code_globals, installation
from qkvtrace.tracer.monitor import Event, Monitor
from qkvtrace.tracer.observers import handwritten
from qkvtrace.tracer.projections import Projections

__all__ = ["Trace", "trace"]

Threads = Literal["entering", "all"]

#: attributes through which a wrapper holds the user's model (``torch.compile``'s
#: ``_orig_mod``, FSDP's and activation checkpointing's wrapped modules); names skip them


class Trace:
    """Records every attention call of ``model`` while the ``with`` block runs.

    Use :func:`trace` to make one. After (or during) the block:

    * ``calls``: :class:`~qkvtrace.records.AttentionCall` records, in execution order;
    * ``gradients``: :class:`~qkvtrace.records.GradientRecord` per traced module
      and backward pass;
    * ``result.unobserved``: modules that look like attention but made no
      recorded call; ``result.warnings``: what the trace could not see;
    * ``to_dict()`` / ``save(path)``: the ``qkvtrace.trace/2`` JSON.

    While the block runs, measured numbers stay on the device; reading
    ``calls`` or ``gradients`` inside the block reads them back (on an
    accelerator that waits for the device). After the block nothing waits.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        gradients: bool | None = None,
        routes: bool | None = None,
        refusals: bool = True,
        threads: Threads = "entering",
        attention_maps: bool = False,
        max_map_tokens: int | None = None,
        max_map_mb: float | None = None,
        heads: int | Sequence[int] | None = None,
        batch_index: int | Sequence[int] | None = None,
        keep: str = "all",
        max_records: int = 1000,
        stream_to: str | Path | None = None,
        tensorboard: Any = None,
        health_every: int | None = None,
    ) -> None:
        if keep not in ("all", "changes"):
            raise ValueError(f"keep must be 'all' or 'changes', got {keep!r}")
        if keep == "all" and (stream_to is not None or tensorboard is not None):
            raise ValueError("stream_to and tensorboard report the changes of a long run: use keep='changes'")
        if keep == "all" and health_every:
            raise ValueError("health_every measures every N steps of a long run: use keep='changes' and t.step()")
        if not isinstance(model, nn.Module):
            raise TypeError(f"qkvtrace.trace() needs an nn.Module, got {type(model).__name__}")
        if threads not in ("entering", "all"):
            raise ValueError(f"threads must be 'entering' or 'all', got {threads!r}")
        self._model: nn.Module | None = model
        # a long run (keep="changes") records no gradients unless asked: they grow with every backward pass
        self.record_gradients = gradients if gradients is not None else keep == "all"
        self.record_routes = routes if routes is not None else keep == "all"
        self.record_refusals = refusals
        self.threads = threads
        #: what maps this trace computes and the memory they hold so far (``None``: no maps)
        self.maps: maps.MapBudget | None = None
        if attention_maps:
            self.maps = maps.MapBudget(maps.MapOptions.make(max_map_tokens, max_map_mb, heads, batch_index))
        #: the thread recorded (``threading.get_ident()``), ``None`` for every thread
        self.thread: int | None = None
        self.has_layers = False
        self.norms = NormCache()
        self._result = TraceResult(torch_version=str(torch.__version__))
        #: id of each module of the model -> (its name, the module): read by the registry on every call
        self.names: dict[int, tuple[str, nn.Module]] = {}
        #: the model's modules while the trace is open, with what their structure gives (:mod:`.structure`)
        self._walked: structure.Walked | None = None
        self._by_name: dict[str, nn.Module] = {}
        self._projections = Projections(self._parents)
        #: the next call's index (a counter's own ``__next__``: read on every call, a call into no function of qkvtrace)
        self.take_index: Callable[[], int] = itertools.count().__next__
        self._grads = GradientRecorder(self.name_of)
        self._exit: contextlib.ExitStack | None = None
        self._ended = False
        self._unresolved = False
        self._seen: set[int] = set()
        #: per module (by id, while the trace holds it): its previous record and what it was built from
        self._last: dict[int, again.Last] = {}
        #: per module (by id, while the trace holds it): what its steady calls share (:mod:`.slots`)
        self.slots: dict[int, slots.Slot] = {}
        #: calls captured by their slots, whose records are built when the records are read
        self._captured: list[slots.Capture] = []
        #: per module (by id): the slots an earlier plain trace of the model kept at its close (:class:`.slots.Kept`)
        self.kept: dict[int, slots.Kept] = {}
        #: records added since the records were last read, whose numbers are still to be read
        self._fresh: list[AttentionCall] = []
        #: code objects torch.compile had compiled frames of when the trace opened (their graphs are not in its log)
        self._compiled_before: frozenset[int] = frozenset()
        self._noted: set[str] = set()
        self._note_lock = threading.Lock()
        #: with ``keep="changes"``: the counts and events of a long run (:mod:`qkvtrace.tracer.monitor`)
        self.monitor: Monitor | None = None
        if keep == "changes":
            self.monitor = Monitor(max_records=max_records, stream_to=stream_to, tensorboard=tensorboard,
                                   torch_version=str(torch.__version__))  # fmt: skip
            if health_every:
                self.monitor.health = Health(health_every)

    # -- public face -------------------------------------------------------

    @property
    def result(self) -> TraceResult:
        self._resolve()
        return self._result

    @property
    def calls(self) -> list[AttentionCall]:
        return self.result.calls

    @property
    def gradients(self) -> list[GradientRecord]:
        return self.result.gradients

    @property
    def routes(self) -> list[RouteRecord]:
        return self.result.routes

    def to_dict(self) -> dict[str, Any]:
        return self.result.to_dict()

    def save(self, path: str | Path, *, maps: bool = False) -> Path:
        return self.result.save(path, maps=maps)

    def __enter__(self) -> Trace:
        if self._exit is not None:
            raise RuntimeError("this trace is already active; make a new qkvtrace.trace(model)")
        if self._ended or self._model is None:
            raise RuntimeError("this trace has ended; make a new qkvtrace.trace(model)")
        masks.sdpa_bool_true_means()  # measured once, before anything is wrapped
        model = self._model
        walked = self._walked = structure.walk(model)  # read again only where the model's structure changed
        for name, m in walked.named():
            if id(m) not in self.names:
                self.names[id(m)] = (name, m)
                self._by_name[name] = m
        # weight norms kept between traces of the model while its structure holds (read into numbers at each
        # close); each lookup checks the parameter's version and storage
        self.norms = walked.answer("norms", NormCache)
        self.kept = walked.answer("kept slots", dict)
        self.has_layers = walked.answer("layers", lambda: any(isinstance(m, nn.TransformerEncoderLayer)
                                                              for m in walked.modules))  # fmt: skip
        self.thread = threading.get_ident() if self.threads == "entering" else None
        _calibrate(walked.structure.devices)
        stack = contextlib.ExitStack()
        try:
            inst = installation()
            inst.acquire()
            stack.callback(inst.release)
            keys = inst.bind_names(model, walked.answer("globals", lambda: code_globals(walked.modules)))
            stack.callback(inst.unbind, keys)
            if walked.structure.compiled_in_place:
                inst.stand_aside_in(model)
            stack.callback(self._grads.close)
            self._grads.gather = self._fsdp1_gather() if self.record_gradients else None
            compiled = walked.inside_compiled()  # not observed: no hooks to cost a compiled step
            if self.record_gradients:  # MultiheadAttention modules are known up front; others when they call SDPA
                for _, m in self.names.values():
                    if isinstance(m, nn.MultiheadAttention) and id(m) not in compiled:
                        found = self.projection(m)
                        if isinstance(found, Projection):
                            self._grads.watch(m, found)
            registry.register(self)
            stack.callback(registry.unregister, self)
            stack.enter_context(compiled_log.listening())
            self._read_compiled_before()
            self._watch_hand_written(compiled, stack)
        except BaseException:
            stack.close()
            raise
        self._exit = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._exit = self._exit, None
        try:
            if stack is not None:
                stack.close()
            if self.monitor is not None:
                self.monitor.close()
        finally:
            if self.monitor is not None and self.monitor.health is not None:
                self.monitor.health.unhook()  # the gradient hooks go on every exit
            self._ended = True
            try:
                self._build_captured()
                self._find_unobserved()
                self._resolve()
                slots.keep(self)  # for the next trace of the model (:mod:`.slots`)
            finally:
                # keep only the records: no module, parameter or tensor outlives the block through the trace
                self.names.clear()
                self._by_name.clear()
                self._projections.clear()
                self._last.clear()
                self.slots.clear()
                self.kept = {}
                self.norms.settle()
                self.norms = NormCache()
                self._model = self._walked = None

    # -- used by the observers ---------------------------------------------

    def name_of(self, module: nn.Module) -> str | None:
        entry = self.names.get(id(module))
        return entry[0] if entry is not None and entry[1] is module else None

    def step(self, number: int | None = None) -> int:
        """Mark the end of a training step (``keep="changes"``): its events are written, the next step begins."""
        if self.monitor is None:
            raise RuntimeError("step() marks the steps of a long run: open the trace with keep='changes'")
        return self.monitor.step(number)

    @property
    def health(self) -> HealthRecords:
        """With ``health_every=N``: per measured step and module, the heads' max logit and entropies and the
        Q/K/V slice norms (:mod:`qkvtrace.facts.health`); a step's records appear when ``t.step()`` ends it."""
        found = self.monitor.health if self.monitor is not None else None
        return HealthRecords(found.records if found is not None else [])

    @property
    def health_alerts(self) -> list[dict[str, str]]:
        """With ``health_every=N``: per module whose max logit or entropy crossed its threshold so far, what crossed
        and at which step (``{"module": ..., "alert": ...}``, the alert ``qkvtrace summarize`` prints)."""
        return self.health.alerts

    def _repr_html_(self) -> str:
        """A notebook shows the trace: its records, and a long run's attention health as small curves."""
        page = self.result.html()
        health = self.health
        return page + health._repr_html_() if health else page

    def health_due(self, module: str) -> bool:
        """This step's health is measured and ``module``'s first call has not been yet."""
        return self.monitor is not None and self.monitor.health is not None and self.monitor.health.due(module)

    def attach_health(self, call: AttentionCall, projection: Projection | str, source: Any) -> None:
        """Measure ``call``'s health from ``source`` when it is its module's first call of a measured step."""
        if self.monitor is not None and self.monitor.health is not None and self.monitor.health.due(call.module):
            self.monitor.health.take(call, projection, source, self.monitor.step_number)

    @property
    def changes(self) -> list[Event]:
        """With ``keep="changes"``: the first call of each combination and every change, in order."""
        return list(self.monitor.events) if self.monitor is not None else []

    def summary(self) -> dict[str, Any]:
        """With ``keep="changes"``: per module each combination, its calls and first and last step."""
        if self.monitor is None:
            raise RuntimeError("summary() counts the calls of a long run: open the trace with keep='changes'")
        return self.monitor.summary()

    def note(self, warning: str) -> None:
        """Add ``warning`` to ``result.warnings`` once (an observer could not read a call)."""
        with self._note_lock:
            if warning not in self._noted:
                self._noted.add(warning)
                self._result.warnings.append(warning)

    def last_record(self, module: nn.Module) -> again.Last | None:
        """``module``'s previous record in this trace, when it was kept with what it was built from."""
        return self._last.get(id(module))

    def remember(self, module: nn.Module, last: again.Last) -> None:
        self._last[id(module)] = last

    def adopt(self, owner: nn.Module, projection: Projection | str) -> None:
        """``owner`` calls in this trace through a slot an earlier trace kept: seen, its Q/K/V weights watched."""
        self._seen.add(id(owner))
        if self.record_gradients and isinstance(projection, Projection):
            self._grads.watch(owner, projection)

    def own(self, undo: Callable[[], Any]) -> None:
        """Run ``undo`` when the trace closes (what an observer set up while the trace was open)."""
        if self._exit is not None:
            self._exit.callback(undo)
        else:
            undo()

    def projection(self, module: nn.Module, qkv: Sequence[Any] | None = None) -> Projection | str:
        """Where ``module``'s Q/K/V live for this call (:class:`~qkvtrace.tracer.projections.Projections`)."""
        return self._projections.get(module, qkv)

    def add_call(
        self, call: AttentionCall, owner: nn.Module, projection: Projection | str, core: Core | None = None
    ) -> None:
        self._seen.add(id(owner))
        if self.monitor is not None and not self.monitor.add(call):
            return  # counted; its record is not kept (neither a first nor a change)
        self._result.calls.append(call)
        self._fresh.append(call)
        self._unresolved = True
        if self.record_gradients and isinstance(projection, Projection):
            self._grads.watch(owner, projection)
        if self.record_routes and core is not None:
            self._grads.watch_routes(call.index, call.module, core)

    def watch_routes(self, index: int, module: str, core: Core) -> None:
        """Keep the gradients reaching call ``index``'s Q, K and V (its ``core``, found in the backward pass of a
        trace that records routes)."""
        self._grads.watch_routes(index, module, core)

    def capture(self, captured: slots.Capture, module: str, core: Core | None) -> None:
        """A call its slot captured (:mod:`.slots`): its record is built when the records are read."""
        self._captured.append(captured)
        self._unresolved = True
        if self.record_routes and core is not None:
            self._grads.watch_routes(captured[1], module, core)

    def add_compiled(self, record: CompiledAttention) -> None:
        """An attention operation of a graph ``torch.compile`` made while this trace was open."""
        with self._note_lock:
            record.index = len(self._result.compiled)
            self._result.compiled.append(record)

    def drop_compiled(self, record: CompiledAttention) -> None:
        """A graph compiled again (Dynamo restarted the frame): its earlier operations go."""
        with self._note_lock:
            self._result.compiled = [c for c in self._result.compiled if c is not record]
            for i, c in enumerate(self._result.compiled):
                c.index = i

    def attach_map(self, call: AttentionCall, source: Any) -> None:
        """Compute ``call``'s attention map from ``source`` (after the real call), or record why not."""
        budget = self.maps
        if budget is None:
            if call.attention_map_reason is not None or call.map_tensors is not None:  # copied from another trace's
                call.map_tensors = None
                call.attention_map_reason = call.attention_map_notes = None
                call.attention_map_heads = call.attention_map_batch = None
            return
        if source is None:
            why = "not computed: the call raised" if call.error else (
                f"not computed: maps are made for the fast, fallback, fused_encoder_layer and sdpa paths, not "
                f"{call.path!r}" + (" (its score_mod and block_mask are the user's functions)" if call.path == "flex"
                                    else ""))  # fmt: skip
            call.attention_map_reason = why
            return
        if isinstance(source, str):
            call.attention_map_reason = source
            return
        try:
            found = source.compute(budget, call.module)
        except Exception as exc:  # the user's run goes on whatever happens here
            call.attention_map_reason = f"not computed: {type(exc).__name__}: {exc}"
            return
        if found.weights is not None:
            call.map_tensors = MapTensors(found.weights, found.fully_masked)
        call.attention_map_heads, call.attention_map_batch = found.heads, found.batch
        call.attention_map_reason = found.reason
        call.attention_map_notes = found.notes or None
        if found.reason is not None and found.reason.startswith("not computed: ") and "max_map" in found.reason:
            self._result.warnings.append(f"attention map of {call.module or '(root)'} {found.reason}")

    # -- internals -----------------------------------------------------------

    def _watch_hand_written(self, compiled: set[int], stack: contextlib.ExitStack) -> None:
        """Hooks that watch the model's own attention-looking modules (none run compiled) for attention written
        by hand."""
        walked = self._walked
        assert walked is not None  # (asked while the trace opens)

        def positions() -> tuple[list[int], list[int]]:  # by position in the model's modules: they hold no module
            at = {id(m): i for i, m in enumerate(walked.modules)}
            found = found_candidates.hand_written_candidates(walked.named(), compiled, self._looks())
            holding = found_candidates.projection_holders(walked.named(), compiled, found)
            return [at[id(m)] for m in found], [at[id(m)] for m in holding]

        chosen, holding = walked.answer("hand_written", positions)
        candidates = [walked.modules[i] for i in chosen]
        self._compiled_before = compat.dynamo_compiled_code_ids()
        if (candidates or holding) and handwritten.watch_refused():
            if candidates:
                self.note(handwritten.NOT_WATCHED)
            return
        for m in candidates:
            stack.callback(handwritten.unwatch, handwritten.watch(m))
        for i in holding:  # (their first calls' functions are written down, for the rows of calls without a graph)
            stack.callback(handwritten.unwatch, handwritten.watch(walked.modules[i], holder=True))

    def _fsdp1_gather(self) -> Callable[[], Any] | None:
        """For a model wrapped in FSDP1 (``FullyShardedDataParallel``): whole parameters and ``.grad`` on
        every rank, through its own ``summon_full_params(root, with_grads=True)``."""
        walked = self._walked
        assert walked is not None  # (asked while the trace opens)

        def outermost() -> int | None:  # by position in the model's modules: the answers hold no module
            fsdp1 = compat.fsdp1_types()
            found = [(len(n), i) for i, (n, m) in enumerate(walked.named()) if fsdp1 and isinstance(m, fsdp1)]
            return min(found)[1] if found else None

        at = walked.answer("fsdp1 root", outermost)
        if at is None:
            return None
        root, cls = walked.modules[at], compat.fsdp1_types()[0]
        return lambda: cls.summon_full_params(root, with_grads=True)  # type: ignore[attr-defined]

    def _looks(self) -> Callable[[str, nn.Module], bool]:
        """Whether a module looks like attention, answered once per structure of the model."""
        walked = self._walked
        if walked is None:
            return found_candidates.looks_like_attention
        answers = dict(zip(map(id, walked.modules), walked.looks_like_attention(), strict=True))
        return lambda name, m: answers[id(m)] if id(m) in answers else found_candidates.looks_like_attention(name, m)

    def _parents(self, module: nn.Module) -> list[nn.Module]:
        name = self.name_of(module)
        parents: list[nn.Module] = []
        while name:
            name = name.rpartition(".")[0]
            parent = self._by_name.get(name)
            if parent is not None:
                parents.append(parent)
            if len(parents) == 2:
                break
        return parents

    def _resolve(self) -> None:
        grads, found = self._grads.records, self._grads.routes
        result = self._result
        if not self._unresolved and len(grads) == len(result.gradients) and len(found) == len(result.routes):
            return
        result.gradients, result.routes = list(grads), list(found)
        self._build_captured()
        fresh, self._fresh = self._fresh, []
        lazy.resolve([fresh, result.gradients, result.routes])  # only records not read before: a long trace
        for g in result.gradients:
            _shares([g.q, g.k, g.v], "pass_grad_norm", "pass_share")
        for r in result.routes:
            _shares([r.q, r.k, r.v], "norm", "share")
        result.calls.sort(key=lambda c: c.index)
        result.gradients.sort(key=lambda g: (g.backward_index, g.module))
        result.routes.sort(key=lambda r: (r.backward_index, r.call))
        self._unresolved = False

    def _build_captured(self) -> None:
        """The records of the calls their slots captured, built now that they are read, their numbers read
        with them (after the records they are copies of: nothing of theirs is walked again)."""
        if self._captured:
            fresh, self._fresh = self._fresh, []
            lazy.resolve([fresh])
            captured, self._captured = self._captured, []
            self._result.calls += slots.build(captured)

    def _find_unobserved(self) -> None:
        """Attention-looking modules with no recorded call, and the compiled/scripted regions."""
        walked = self._walked
        assert walked is not None  # (asked as the trace closes, before it lets the model go)
        seen = [self.names[i][0] for i in self._seen if i in self.names]
        found_candidates.note_unobserved(self._result, walked, seen, self.names.values(), self._compiled_before)

    def _read_compiled_before(self) -> None:
        """Records of the graphs torch.compile made for the model's modules before the trace opened."""
        if compat.dynamo_compiled_nothing():  # no code holds a cache entry
            return
        try:
            compiled_before.read(self, sorted(self.names.values(), key=lambda e: (e[0].count("."), e[0])))
        except Exception as e:  # Dynamo's cache in another shape: those modules stay listed unobserved
            self.note(f"graphs compiled before the trace could not be read ({type(e).__name__}: {e})")


def _shares(parts: list[Any], norm: str, share: str) -> None:
    """Set each part's share of the parts' squared norms (once every norm is a number)."""
    present = [p for p in parts if p is not None and isinstance(getattr(p, norm), float)]
    for p, value in zip(present, squared_shares([getattr(p, norm) for p in present]), strict=True):
        if getattr(p, share) is None:
            setattr(p, share, value)


def _calibrate(devices: Sequence[str]) -> None:
    """Learn which kernel each SDPA backend runs on the model's devices, before anything is wrapped."""
    evidence = paths.shared_evidence()
    for device in devices:
        evidence.calibrate_once(device)


def trace(
    model: nn.Module,
    *,
    gradients: bool | None = None,
    routes: bool | None = None,
    refusals: bool = True,
    threads: Threads = "entering",
    attention_maps: bool = False,
    max_map_tokens: int | None = None,
    max_map_mb: float | None = None,
    heads: int | Sequence[int] | None = None,
    batch_index: int | Sequence[int] | None = None,
    keep: str = "all",
    max_records: int = 1000,
    stream_to: str | Path | None = None,
    tensorboard: Any = None,
    health_every: int | None = None,
) -> Trace:
    """Trace every attention call ``model`` makes inside a ``with`` block.

    >>> with qkvtrace.trace(model) as t:        # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> t.calls[0].path, t.calls[0].why_not_fast_path   # doctest: +SKIP

    ``gradients``: record Q/K/V slice gradients after each backward pass.
    ``routes``: record per call its backward kernel (``backward_kernel``) and,
    after each backward pass, the gradients that reached its Q, K and V
    (``result.routes``), read by hooks on the call's backward core. Finding
    the core walks a few autograd nodes per call; ``routes=False`` saves that
    on many small calls.
    ``refusals``: record PyTorch's own words refusing each SDPA backend it
    ranks above the one it chose (asked once per call signature on a stand-in
    of the call; see :mod:`qkvtrace.facts.refusals`).
    ``threads``: ``"entering"`` (default) records calls of the thread that
    entered the block; ``"all"`` records the model's calls in every thread
    (servers, data loaders).
    ``attention_maps``: give each call an ``attention_map`` (CPU float32
    ``[B, H, T_query, T_key]``), recomputed on the side from the call's own
    inputs after it ran, without changing its path, kernel or outputs
    (:mod:`qkvtrace.facts.maps`). ``heads`` / ``batch_index``: only these heads and
    batch items (default: all of them, as ``--map-heads`` / ``--map-batch``
    of ``qkvtrace trace``). A map longer than ``max_map_tokens`` on a side (default
    1024), or that would bring the trace's maps over ``max_map_mb`` (default
    256), is refused before it is allocated; the call says why in
    ``attention_map_reason``. The maps live in the result and go with it.

    ``keep``: ``"all"`` (default) keeps a record of every call; ``"changes"``
    is for long runs: per module and combination (path, backend, reasons,
    dtype, masks, training) it counts calls with their first and last step,
    and keeps the record of the first call of each combination and of every
    change, at most ``max_records`` (:mod:`qkvtrace.tracer.monitor`). Mark steps with
    ``t.step()``; read ``t.changes`` and ``t.summary()``. ``stream_to``: write
    the events and per-step counts as JSON Lines while the run goes
    (``qkvtrace summarize FILE``); ``tensorboard``: a ``SummaryWriter`` that
    gets per-step scalars. With ``keep="changes"`` gradients and routes are
    off unless asked for (they grow with every backward pass).
    ``health_every``: every N-th step (step 0 first; ``None`` or 0: off),
    the first call of each attention module gives per head its largest
    pre-softmax logit and its mean and least attention entropy, and per
    module its Q/K/V slice weight and gradient norms: ``t.health``,
    ``health`` lines in the stream, TensorBoard scalars (:mod:`qkvtrace.facts.health`).

    Traces nest and overlap, in any order and any thread: each records the
    calls of its own model, with its own indices.
    """
    return Trace(model, gradients=gradients, routes=routes, refusals=refusals, threads=threads,
                 attention_maps=attention_maps, max_map_tokens=max_map_tokens, max_map_mb=max_map_mb,
                 heads=heads, batch_index=batch_index, keep=keep, max_records=max_records, stream_to=stream_to,
                 tensorboard=tensorboard, health_every=health_every)  # fmt: skip
