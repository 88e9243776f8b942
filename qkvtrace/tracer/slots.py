"""A module's steady calls: checked first, against one key of the call's own facts, and captured lean.

Most calls of a loop are their module's previous call again: the same
shapes, dtypes, strides, flags and modes, so the same backend, kernels,
reasons, Q/K/V rows and combination. The full observer finds all of that
out anew on every call, in many small Python steps (:mod:`.observers.sdpa`);
the record it builds is then equal to its module's previous one but for
this call's own numbers (:mod:`qkvtrace.tracer.again`).

A *slot* turns that around. Once a call's record could be copied (a plain
trace) or its call was only counted (a long run), the observer keeps, per
module and trace, the *key* of the facts that decide everything a record
says -- read from the call's arguments alone, before the call runs -- with
what those facts gave. The next call computes its key first (a tuple of
attribute reads, about a microsecond) and, when it equals the slot's and
what the slot relies on still holds, runs the call and captures only what is
its own:

* in a long run (``keep="changes"``): its NaN count, on the device, added to
  the module's count; nothing else (no record, no key of the combination);
* in a plain trace (``keep="all"``): its index, thread, NaN count, activation
  norms and what its backward core says, in a tuple; the record itself is built from the
  slot's record when the trace's records are read (:meth:`Trace.result`), at
  its end or in between.

What a slot relies on is checked on every call: the key (so a new shape,
stride, flag, mode or child module misses), that the slot's record is still
its module's previous record (another way of calling it in between
replaced it) and, for records, that the Q/K/V slice record is the one the
weights' versions give now (so an optimizer step or a swapped weight
misses). A miss takes the full observer, which fills the slot again.
A model's own SDPA call is checked and captured in :mod:`.hot`, whose
functions are all its steady way runs in besides its wrapper and the place
its numbers are kept.

A plain trace's slots of a model's own SDPA calls are *kept* when it closes
(:class:`Kept`, with the model's structure: :mod:`.structure`), their record
read into numbers and their projection's holder held weakly, so that one
trace per step starts where the previous one ended: a module's first call in
the next trace is taken by the kept slot when its key, the trace's options
and the slice record all still hold.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qkvtrace.base import lazy
from qkvtrace.facts import routes
from qkvtrace.facts.slices import Projection, ProjectionSpec, Stamp
from qkvtrace.records import AttentionCall
from qkvtrace.tracer import again, hot
from qkvtrace.tracer.build import shared_inputs

if TYPE_CHECKING:
    from torch import nn

    from qkvtrace.tracer.monitor import _Module, _Seen
    from qkvtrace.tracer.session import Trace

__all__ = ["Capture", "Kept", "Slot", "build", "keep", "keep_counting", "keep_recording", "revive"]


@dataclass(slots=True, eq=False)
class Slot:
    """What one module's steady calls share in one trace (found by the id of the module, which the trace holds
    alive), and the key of the facts that decided it."""

    #: the call's facts that decide its record: shapes, dtypes, strides, flags, modes (each observer's
    #: ``steady_key``: :func:`qkvtrace.tracer.hot.steady_key`, :func:`.observers.mha_facts.steady_key`)
    key: tuple[Any, ...]
    #: fully-masked query rows, decided by the key (shapes and ``is_causal``; no mask): shared by its calls
    rows: Any = 0
    # -- a long run's count
    entry: _Module | None = None
    combination: tuple[Any, ...] | None = None
    seen: _Seen | None = None
    backend: str | None = None
    # -- a plain trace's record
    last: again.Last | None = None
    projection: Projection | str | None = None
    #: the Q/K/V slice record the weights' versions gave (``None`` where no projection is known)
    base: Any = None
    #: what that record was found by, read when the slot was kept (:meth:`~qkvtrace.facts.slices.NormCache.stamp`):
    #: checked on every call in place of looking the record up again (``None``: looked up)
    stamp: Stamp | None = None
    #: the call signature routes are found by (:func:`qkvtrace.facts.routes.sdpa_core`)
    signature: Any = None
    #: what a ``MultiheadAttention`` call itself said (path, reasons, backend, evidence, kernels, what its kernel
    #: received): a call is the slot's only when it says the same
    facts: tuple[Any, ...] | None = None
    #: what the SDPA kernel of a ``MultiheadAttention`` fallback said, with the key of its arguments
    #: (:func:`qkvtrace.tracer.hot.steady_key`): a steady call's kernel with that key says it again
    #: (learnt from the first steady call whose kernel was found out in full)
    kernel: tuple[Any, ...] | None = None
    #: ``False`` once a steady call's backward core could not be left to its backward pass (:meth:`verdict`)
    follows: bool = True
    #: the call signature (:func:`qkvtrace.facts.dataflow.signature`) a call whose keys grew was last found to have the
    #: slot's Q/K/V rows by: a grown call with it has them too (the trace keeps its rows by it)
    layout: Any = None

    #: what a call with the key says of its backward core where the key decides it builds no graph (no grad,
    #: inference mode, nothing requiring grad): its first steady call's, said again (``None``: not known yet)
    quiet: routes.Verdict | None = None
    #: how the Q, K and V of a call with the key are reduced to their norms (:func:`~qkvtrace.facts.slices.norm_plan`)
    plans: tuple[Any, Any, Any] | None = None

    def holds(self, trace: Trace, name: str) -> bool:
        """What the slot relies on beyond the call's key still holds (:func:`qkvtrace.tracer.hot.holds`)."""
        return hot.holds(self, trace, name)

    def count(self, trace: Trace, nan_count: Any, rows: Any = None) -> None:
        """Count, in a long run, a call the slot knows: its NaN count added to its module's, nothing else
        (``rows``: its fully-masked rows where they are its own, not the slot's)."""
        trace.monitor.count_steady(self.entry, self.seen, self.backend, nan_count,  # type: ignore[union-attr, arg-type]
                                   self.rows if rows is None else rows)  # fmt: skip

    def verdict(self, trace: Trace, index: int, name: str, out: Any, inputs: tuple[Any, ...], *, heads: int | None,
                key: Any, fused: bool = False) -> routes.Verdict | None:  # fmt: skip
        """What a steady call's core says where it can be left to its backward pass
        (:func:`~qkvtrace.facts.routes.steady_verdict`, its hook watched by ``trace``), else ``None``: the caller
        finds the core. Asked until it cannot be so once -- a decomposed SDPA kernel's never can (its key decides
        it), nor a call with no graph -- then no more: the core found instead says the same, only later."""
        if not self.follows:
            return None
        said = routes.steady_verdict(out, inputs, heads=heads, key=key, watch=trace.watch_routes, index=index,
                                     module=name, fused=fused)  # fmt: skip
        self.follows = said is not None
        return said

    def record(self, trace: Trace, name: str, index: int, nan_count: Any, core: routes.Core | None,
               said: routes.Verdict | None = None) -> None:  # fmt: skip
        """Record, in a plain trace, a ``MultiheadAttention`` call the slot knows (:func:`qkvtrace.tracer.hot.capture`:
        the norms of its slot's record kept)."""
        hot.capture(self, trace, name, index, nan_count, None, core, said)


def keep_counting(trace: Trace, name: str, key: tuple[Any, ...], backend: str | None, rows: Any, *,
                  owner: nn.Module, facts: tuple[Any, ...] | None = None) -> None:  # fmt: skip
    """Keep the slot of a long run's module whose call was just counted as its previous one."""
    entry = trace.monitor.modules[name]  # type: ignore[union-attr]
    combination = entry.last
    if combination is not None:  # (always: the call was just counted as it)
        trace.slots[id(owner)] = Slot(key, rows, entry=entry, combination=combination,
                                      seen=entry.seen[combination], backend=backend, facts=facts)  # fmt: skip


def keep_recording(trace: Trace, name: str, key: tuple[Any, ...], projection: Projection | str,
                   refs: tuple[Any, ...], rows: Any, *, owner: nn.Module, signature: Any = None,
                   facts: tuple[Any, ...] | None = None) -> None:  # fmt: skip
    """Keep the slot of a plain trace's module whose record was just remembered as its previous one, built
    from ``refs`` (:func:`qkvtrace.tracer.again.previous`: the module, and its projection and slice record)."""
    last = trace.last_record(owner)
    if last is not None:
        # (``refs`` holds the slice record, made just now, exactly where ``projection`` is one: its stamp is read now)
        stamp = trace.norms.stamp(projection) if isinstance(projection, Projection) else None
        trace.slots[id(owner)] = Slot(key, rows, last=last, projection=projection,
                                      base=refs[2] if len(refs) == 3 else None, stamp=stamp, signature=signature,
                                      facts=facts)  # fmt: skip


@dataclass(slots=True, eq=False)
class Kept:
    """A plain trace's slot of a model's own SDPA call, kept at its close for the next trace of the model: its
    record read into numbers, its projection's holder held weakly, nothing that keeps a module or tensor alive."""

    #: the trace options the record depends on (a plain trace's: no long run, no maps; whether PyTorch's refusals
    #: are asked)
    options: tuple[Any, ...]
    key: tuple[Any, ...]
    rows: Any
    record: AttentionCall
    holder: weakref.ref[nn.Module] | None
    spec: ProjectionSpec | None
    #: the projection when it is a reason (no rows)
    reason: str | None
    base: Any
    signature: Any


def options(trace: Trace) -> tuple[Any, ...]:
    """What of a trace's options a kept record depends on: only a plain trace records from a record."""
    return (trace.monitor is None and trace.maps is None, trace.record_refusals)


def keep(trace: Trace) -> None:
    """Keep, at a plain trace's close (its records read into numbers), the slots of its models' own SDPA calls in
    ``trace.kept`` (the model's structure's)."""
    kept = trace.kept
    said = options(trace)
    for owner_id, slot in trace.slots.items():
        if slot.last is None or slot.facts is not None:  # a long run's count, or a MultiheadAttention's
            continue
        held = kept.get(owner_id)
        if held is not None and slot.last.record is held.record:
            continue  # revived from what an earlier trace kept, and held: that stays, equal (no caller has its record)
        record = again.detached(slot.last.record)  # the caller may edit the one it has
        projection = slot.projection
        if isinstance(projection, Projection):
            holder, spec, reason = weakref.ref(projection.holder), projection.spec, None
        else:
            holder, spec, reason = None, None, projection
        kept[owner_id] = Kept(said, slot.key, record.output["fully_masked_rows"], record, holder,
                              spec, reason, slot.base, slot.signature)  # fmt: skip


def revive(trace: Trace, owner: nn.Module, name: str, key: tuple[Any, ...]) -> Slot | None:
    """The slot an earlier trace of the model kept for ``owner`` (in ``trace.kept``), when its key, the trace's
    options and its slice record still hold; it becomes this trace's slot (and ``owner`` is seen, its projection
    watched), else ``None``. (The kept slots are the model's structure's: its modules, under the same names, are
    the ones they were.)"""
    found = trace.kept.get(id(owner))
    if found is None or found.key != key or found.options != options(trace):
        return None
    projection: Projection | str
    if found.holder is None:
        projection = found.reason  # type: ignore[assignment]
    else:
        holder = found.holder()
        if holder is None:
            return None
        projection = Projection(holder, found.spec)  # type: ignore[arg-type]
    slot = Slot(key, found.rows, last=again.Last(None, (), found.record), projection=projection, base=found.base,
                signature=found.signature)  # fmt: skip
    if not slot.holds(trace, name):
        return None
    trace.slots[id(owner)] = slot
    trace.adopt(owner, projection)
    return slot


#: one call captured in a plain trace: (its slot's record, index, thread, rank, world size, NaN count,
#: fully-masked rows, the Q, K and V activation norms or ``None``, what its backward core says, the shapes of
#: its Q, K and V where they are not the slot's record's or ``None``)
Capture = tuple[AttentionCall, int, str, Any, Any, Any, Any, "tuple[Any, Any, Any] | None", routes.Verdict,
                "tuple[Any, Any, Any] | None"]


def build(captured: list[Capture]) -> list[AttentionCall]:
    """The records of calls captured by their slots, each made from its slot's record with its own numbers,
    as :func:`qkvtrace.tracer.again.repeat` makes them, with those numbers read now (:func:`qkvtrace.base.lazy.read`:
    one read per accelerator for all of them) -- the slots' records must have been resolved first."""
    numbers = [[nan, rows, *(norms or ())] for _, _, _, _, _, nan, rows, norms, _, _ in captured]
    grown: dict[tuple[Any, ...], dict[str, Any]] = {}  # (the inputs of grown calls, one per template's and shapes)
    lazy.read([((values, i), v) for values in numbers for i, v in enumerate(values) if isinstance(v, torch.Tensor)])
    out = []
    for (template, index, thread, rank, world, _, _, norms, said, shapes), values in zip(captured, numbers,
                                                                                        strict=True):  # fmt: skip
        record = again.clone(template)
        record.index = index
        if shapes is not None:  # a call whose keys grew (or shrank): its own shapes, all else its slot's
            key = (id(template.inputs), *shapes)
            inputs = grown.get(key)
            if inputs is None:
                q, k, v = shapes
                inputs = grown[key] = shared_inputs({**template.inputs, "query_shape": list(q),
                                                     "key_shape": list(k), "value_shape": list(v)})  # fmt: skip
            record.inputs = inputs
        record.output = {"nan_count": values[0], "fully_masked_rows": values[1]}
        if norms is not None:  # a model's own SDPA call: the norms of the Q, K and V it received
            record.qkv = again.with_norms(template.qkv, (values[2], values[3], values[4]))
        again.own_lists(record, template)
        record.thread, record.rank, record.world_size = thread, rank, world
        said.stamp(record)
        out.append(record)
    return out

