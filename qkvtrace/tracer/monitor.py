"""Long runs: what attention did over a whole training job, in bounded memory.

``qkvtrace.trace(model, keep="changes")`` keeps no record per call. Per module
and *combination* -- path, SDPA backend, PyTorch's reasons, dtype, the kind
and dtype of each mask, training or not -- it counts calls and remembers the
first and last step it was seen; it keeps the full record of the first call
of each combination and of every *change* (a call whose combination differs
from the module's previous call), up to ``max_records``. Memory grows with
the number of distinct combinations, not with the number of calls. NaN
outputs and fully-masked rows are summed per module on the device (no host
read per call).

Steps are marked by the user (``t.step()``). At each step the events of the
step are resolved (the only host reads) and, with ``stream_to=FILE``, written
as JSON Lines (``qkvtrace.stream/1``) and flushed, so a process that dies
leaves a readable file; ``qkvtrace summarize FILE`` reads it back. With
``tensorboard=SummaryWriter(...)`` the step's share of calls per backend,
its changes and its NaN rows become scalars.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvtrace.base import lazy
from qkvtrace.facts.health import Health, HealthRecord
from qkvtrace.records import AttentionCall, call_dict

__all__ = ["STREAM_SCHEMA", "Event", "Monitor", "combination", "combination_key", "mask_kind"]

STREAM_SCHEMA = "qkvtrace.stream/1"

#: device-side counts kept per module before they are summed (bounds memory when steps are long or unmarked)
_PENDING = 256

#: the facts whose change is an event
_FIELDS = ("path", "sdpa_backend", "why_not_fast_path", "why_not_fused_layer")
_INPUTS = ("dtype", "training")
_MASKS = ("attn_mask", "key_padding_mask", "merged_mask")
#: the order of a combination's facts, in its dict and in its key
_ORDER = (*_FIELDS, *_INPUTS, *_MASKS, "error")


def combination(call: AttentionCall) -> dict[str, Any]:
    """What a module's calls are compared on: path, backend, reasons, dtype, masks, training."""
    combo: dict[str, Any] = {k: getattr(call, k) for k in _FIELDS}
    inputs = call.inputs
    for key in _INPUTS:
        combo[key] = inputs.get(key)
    for key in _MASKS:
        mask = inputs.get(key)
        combo[key] = None if not isinstance(mask, dict) else f"{mask.get('kind')} {mask.get('dtype') or ''}".strip()
    combo["error"] = call.error is not None  # built in _ORDER's order
    return combo


def _key(combo: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(combo.values())


def mask_kind(mask: Any) -> str | None:
    """A mask as :func:`combination` names it, from the tensor itself (a record says ``kind`` and ``dtype``)."""
    if not isinstance(mask, torch.Tensor):
        return None
    return f"{'bool' if mask.dtype == torch.bool else 'float'} {mask.dtype}"


def combination_key(*, path: str, sdpa_backend: str | None, dtype: str | None, training: bool | None,
                    why_not_fast_path: str | None = None, why_not_fused_layer: str | None = None,
                    attn_mask: str | None = None, key_padding_mask: str | None = None,
                    merged_mask: str | None = None) -> tuple[Any, ...]:  # fmt: skip
    """The key :func:`combination` gives the record of a call that did not raise, from its facts alone (each
    named as in the combination, the masks as :func:`mask_kind` names them): the steady state asks it before any
    record is built."""
    facts = {"path": path, "sdpa_backend": sdpa_backend, "why_not_fast_path": why_not_fast_path,
             "why_not_fused_layer": why_not_fused_layer, "dtype": dtype, "training": training,
             "attn_mask": attn_mask, "key_padding_mask": key_padding_mask, "merged_mask": merged_mask,
             "error": False}  # fmt: skip
    return tuple(facts[name] for name in _ORDER)


@dataclass
class Event:
    """The first call of a combination, or a change: the step, the call, what it was and became."""

    kind: str
    step: int
    module: str
    call: int
    was: dict[str, Any] | None
    became: dict[str, Any]
    record: AttentionCall | None


@dataclass
class _Seen:
    combo: dict[str, Any]
    calls: int = 0
    first_step: int = 0
    last_step: int = 0


@dataclass
class _Module:
    last: tuple[Any, ...] | None = None
    seen: dict[tuple[Any, ...], _Seen] = field(default_factory=dict)
    nan_count: Any = 0
    fully_masked_rows: Any = 0
    #: device-side counts of this step's calls, summed once at the step's end (one op, not one per call)
    pending: dict[str, list[Any]] = field(default_factory=dict)

    def collapse(self) -> None:
        for name, values in self.pending.items():
            if values:
                total = torch.stack(values).sum() if len(values) > 1 else values[0]
                setattr(self, name, getattr(self, name) + total)
                values.clear()


def _count(entry: _Module, name: str, value: Any) -> None:
    """Add one call's ``name`` (a NaN count or fully-masked rows) to ``entry``'s: a tensor is summed on the device at
    the step's end, or every ``_PENDING`` calls; a number at once."""
    if isinstance(value, torch.Tensor):
        waiting = entry.pending.get(name)
        if waiting is None:
            waiting = entry.pending[name] = []
        waiting.append(value)
        if len(waiting) >= _PENDING:
            entry.collapse()
    elif value is not None:
        setattr(entry, name, getattr(entry, name) + value)


class Monitor:
    """Counts and events of a long run; bounded by combinations and ``max_records``."""

    def __init__(self, *, max_records: int = 1000, stream_to: str | os.PathLike[str] | None = None,
                 tensorboard: Any = None, torch_version: str = "") -> None:  # fmt: skip
        if max_records < 0:
            raise ValueError(f"max_records must be 0 or more, got {max_records}")
        self.max_records = max_records
        self.step_number = 0
        self.modules: dict[str, _Module] = {}
        self.events: list[Event] = []
        self.dropped_records = 0
        self._pending: list[Event] = []
        self._step_backends: Counter[str] = Counter()
        self._step_changes = 0
        #: every change of the run, kept as an event or not (past ``max_records``)
        self.changes = 0
        self._writer = tensorboard
        #: with ``health_every``: the attention health measured every N steps (:mod:`qkvtrace.facts.health`)
        self.health: Health | None = None
        self._stream = None
        #: the file streamed to (under torch.distributed, this rank's: see
        #: :func:`qkvtrace.records.streams.rank_stream_path`)
        self.stream_path: Path | None = None
        if stream_to is not None:
            from qkvtrace.base.compat import distributed_rank
            from qkvtrace.records.streams import rank_stream_path

            rank, world = distributed_rank()
            self.stream_path = rank_stream_path(stream_to, rank, world)
            self._stream = self.stream_path.open("w", encoding="utf-8")
            start: dict[str, Any] = {"kind": "start", "torch_version": torch_version}
            if rank is not None:
                start.update(rank=rank, world_size=world)
            self._write(start)

    # -- per call (no host reads) ---------------------------------------------------

    def add(self, call: AttentionCall) -> bool:
        """Count ``call``; ``True`` when its full record is to be kept (a first or a change)."""
        combo = combination(call)
        key = _key(combo)
        entry = self.modules.get(call.module)
        if entry is None:
            entry = self.modules[call.module] = _Module()
        seen = entry.seen.get(key)
        first = seen is None
        if seen is None:
            seen = entry.seen[key] = _Seen(combo, first_step=self.step_number)
        seen.calls += 1
        seen.last_step = self.step_number
        self._step_backends[call.sdpa_backend or "none"] += 1
        self._count_output(entry, call.output)
        changed = entry.last is not None and entry.last != key
        was = None if entry.last is None else self._combo_of(entry, entry.last)
        entry.last = key
        if not (first or changed):
            return False
        self._step_changes += int(changed)
        self.changes += int(changed)
        keep = len(self.events) < self.max_records
        if not keep:
            self.dropped_records += 1
        event = Event("change" if changed else "first", self.step_number, call.module, call.index, was, combo,
                      call if keep else None)  # fmt: skip
        if keep:
            self.events.append(event)
        self._pending.append(event)
        return keep

    def is_last(self, module: str, key: tuple[Any, ...]) -> bool:
        """``key`` is the combination of ``module``'s previous call (a call with it would change nothing)."""
        entry = self.modules.get(module)
        return entry is not None and entry.last == key

    def again(self, module: str, key: tuple[Any, ...], backend: str | None, output: dict[str, Any]) -> None:
        """Count a call of ``module`` whose combination ``key`` is that of its previous call (:meth:`is_last`),
        without a record: the steady state of a long run. ``output``: its NaN count and fully-masked rows."""
        entry = self.modules[module]
        self.count_steady(entry, entry.seen[key], backend, output.get("nan_count"), output.get("fully_masked_rows"))

    def count_steady(self, entry: _Module, seen: _Seen, backend: str | None, nan_count: Any, rows: Any) -> None:
        """:meth:`again` for a call its module's slot recognised (:mod:`qkvtrace.tracer.slots`): ``entry`` and
        ``seen`` are the module's and its combination's counts, ``nan_count`` and ``rows`` the call's."""
        seen.calls += 1
        seen.last_step = self.step_number
        self._step_backends[backend or "none"] += 1
        waiting = entry.pending.get("nan_count")
        if waiting is not None and len(waiting) < _PENDING - 1 and isinstance(nan_count, torch.Tensor):
            waiting.append(nan_count)  # (what :func:`_count` does with it, on every steady call)
        else:
            _count(entry, "nan_count", nan_count)
        if isinstance(rows, torch.Tensor) or rows:  # (an unmasked, non-causal call has none to add)
            _count(entry, "fully_masked_rows", rows)

    @staticmethod
    def _count_output(entry: _Module, output: dict[str, Any]) -> None:
        for name in ("nan_count", "fully_masked_rows"):
            _count(entry, name, output.get(name))

    @staticmethod
    def _combo_of(entry: _Module, key: tuple[Any, ...]) -> dict[str, Any]:
        return entry.seen[key].combo

    # -- per step (host reads allowed) ------------------------------------------------

    def step(self, number: int | None = None) -> int:
        """End the current step (writing its events) and start the next one (``number``, or the next)."""
        self._flush_step()
        self.step_number = self.step_number + 1 if number is None else int(number)
        if self.health is not None:
            self.health.arm(self.step_number)
        return self.step_number

    def _flush_step(self) -> None:
        for entry in self.modules.values():
            entry.collapse()
        pending, self._pending = self._pending, []
        records = [e.record for e in pending if e.record is not None]
        lazy.resolve([records])
        for event in pending:
            self._write({"kind": event.kind, "step": event.step, "module": event.module, "call": event.call,
                         "was": event.was, "became": event.became,
                         "record": call_dict(event.record) if event.record is not None else None})  # fmt: skip
        if self.health is not None:
            self._write_health(self.health.end_step())
        total = sum(self._step_backends.values())
        if self._writer is not None and total:
            for backend, n in sorted(self._step_backends.items()):
                self._writer.add_scalar(f"qkvtrace/backend_share/{backend}", n / total, self.step_number)
            self._writer.add_scalar("qkvtrace/changes", self._step_changes, self.step_number)
            self._writer.add_scalar("qkvtrace/nan_outputs", self._nan_total(), self.step_number)
        if total or pending:
            backends = dict(sorted(self._step_backends.items()))
            self._write({"kind": "step", "step": self.step_number, "calls": total, "backends": backends,
                         "changes": self._step_changes})  # fmt: skip
        self._step_backends.clear()
        self._step_changes = 0

    def _write_health(self, records: list[HealthRecord]) -> None:
        """A ``health`` line per module measured in the step, and its TensorBoard scalars."""
        for r in records:
            self._write({"kind": "health", **r.to_dict()})
            if self._writer is None:
                continue
            tag = f"qkvtrace/health/{r.module or '(root)'}"
            for h in r.heads:
                for name in ("max_logit", "entropy_mean", "entropy_min"):
                    value = getattr(h, name)
                    if value is not None:
                        self._writer.add_scalar(f"{tag}/{name}/head{h.head}", value, r.step)
            for kind, norms in (("weight_norm", r.weight_norms), ("grad_norm", r.grad_norms)):
                for part, value in norms.items():
                    if value is not None:
                        self._writer.add_scalar(f"{tag}/{kind}/{part}", value, r.step)

    def _nan_total(self) -> float:
        resolved = self._resolved_counts()
        return float(sum(v["nan_count"] or 0 for v in resolved.values()))

    def _resolved_counts(self) -> dict[str, dict[str, Any]]:
        for entry in self.modules.values():
            entry.collapse()
        counts = {m: {"nan_count": e.nan_count, "fully_masked_rows": e.fully_masked_rows}
                  for m, e in self.modules.items()}  # fmt: skip
        lazy.resolve([counts])
        return counts

    def summary(self) -> dict[str, Any]:
        """Per module: each combination with its calls and first and last step; NaN and fully-masked totals."""
        counts = self._resolved_counts()
        return {
            "steps": self.step_number,
            "modules": {
                name: {
                    "combinations": [{**asdict(s)} for s in entry.seen.values()],
                    "nan_count": counts[name]["nan_count"],
                    "fully_masked_rows": counts[name]["fully_masked_rows"],
                }
                for name, entry in sorted(self.modules.items())
            },
            "changes": self.changes,
            "dropped_records": self.dropped_records,
        }

    def close(self) -> None:
        """Write the last step's events and the summary; close the stream."""
        self._flush_step()
        if self._stream is not None:
            self._write({"kind": "end", "summary": self.summary()})
            self._stream.close()
            self._stream = None
        if self._writer is not None and hasattr(self._writer, "flush"):
            self._writer.flush()

    def _write(self, line: dict[str, Any]) -> None:
        if self._stream is None:
            return
        line = {"schema": STREAM_SCHEMA, **line}
        self._stream.write(json.dumps(line, sort_keys=True, default=str) + "\n")
        self._stream.flush()
