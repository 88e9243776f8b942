"""A call like its module's previous one: its record made from that record, with what only this call says.

Most calls of a loop are alike: the same module, shapes, dtypes, flags,
modes, path, backend, reasons and Q/K/V rows as the call before. Building
such a call's record field by field (the inputs' dictionary, PyTorch's
refusals looked up again, every slice record) is most of what a traced
small call costs. Here an observer states everything the record is built
from -- a *key* of plain values and the *refs* it holds (the projection and
its slice record, compared by identity) -- and when both are those of the
module's previous record in every trace that records the call, the new
record is that record's copy with this call's own facts written in: its
index, thread and rank, its output's NaN count and fully-masked rows, the
activation norms, the backward core. Anything else that differs (a new
shape, a mode switched, an optimizer step that moved a weight's version, a
flag, another reason) makes another key, so the record is built anew: a
record made here is equal to the one built in full, which the tests check
field by field.

Only plain traces take this way (``keep="all"``, no maps, no health): a
long run has its own steady state (:func:`qkvtrace.tracer.build.count_again`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from qkvtrace.base import compat
from qkvtrace.facts import routes
from qkvtrace.facts.slices import Projection
from qkvtrace.records import AttentionCall, QKVInfo, SliceInfo

if TYPE_CHECKING:
    from torch import nn

    from qkvtrace.tracer.build import Target

__all__ = ["Last", "clone", "detached", "own_lists", "plain", "previous", "repeat", "with_norms"]


def _cloner() -> Any:
    names = [f.name for f in dataclasses.fields(AttentionCall)]
    source = f"def clone(r):\n    return _Call({', '.join(f'r.{n}' for n in names)})\n"
    namespace: dict[str, Any] = {"_Call": AttentionCall}
    exec(source, namespace)  # a positional copy: ten times faster than dataclasses.replace
    return namespace["clone"]


#: ``clone(record)``: a shallow copy of an :class:`AttentionCall` (its dicts and lists shared, as
#: ``dataclasses.replace`` shares them)
clone = _cloner()


def detached(record: AttentionCall) -> AttentionCall:
    """A copy of ``record`` for :mod:`.slots` to keep beyond its trace, out of reach of a caller editing the record
    it was made from: its kernels, refusals and slice records are its own (``inputs`` is shared by every call
    with equal inputs, as :func:`~qkvtrace.tracer.build.shared_inputs` shares it; ``output`` and the maps are
    never read from a kept record)."""
    out = clone(record)
    own_lists(out, record)
    qkv = record.qkv
    q, k, v = (None if s is None else _slice_with(s, s.activation_norm) for s in (qkv.q, qkv.k, qkv.v))
    out.qkv = QKVInfo(qkv.layout, q, k, v, qkv.holder, qkv.reason)
    return out


def own_lists(record: AttentionCall, before: AttentionCall) -> None:
    """Give ``record`` (a :func:`clone` of ``before``) lists of its own for the kernels and PyTorch's refusals: a
    caller editing one record must not edit the next."""
    if before.aten_ops is not None:
        record.aten_ops = list(before.aten_ops)
    if before.sdpa_refusals is not None:
        record.sdpa_refusals = {b: list(w) for b, w in before.sdpa_refusals.items()}


def with_norms(before: QKVInfo, norms: tuple[Any, Any, Any]) -> QKVInfo:
    """``before`` (the previous record's slices, built from the same slice record) with this call's
    activation norms."""
    q, k, v = (_slice_with(s, n) for s, n in zip((before.q, before.k, before.v), norms, strict=True))
    return QKVInfo(before.layout, q, k, v, before.holder, before.reason)


def _slice_with(s: SliceInfo | None, norm: Any) -> SliceInfo:
    if s is None:
        return SliceInfo(None, None, None, None, activation_norm=norm)
    return SliceInfo(s.param, s.rows, s.shape, s.weight_norm, s.bias_param, s.bias_norm, norm, s.dim, s.evidence,
                     s.also)  # fmt: skip


@dataclasses.dataclass(slots=True)
class Last:
    """A module's previous record in one trace, with the key and refs it was built from."""

    key: Hashable
    refs: tuple[Any, ...]
    record: AttentionCall

    def matches(self, key: Hashable, refs: tuple[Any, ...]) -> bool:
        if self.key != key or len(refs) != len(self.refs):
            return False
        return all(a is b for a, b in zip(refs, self.refs, strict=True))


def plain(targets: list[Target]) -> bool:
    """Every trace recording the call keeps every record and computes no map (health needs a long run)."""
    for t, _, _ in targets:
        if t.monitor is not None or t.maps is not None:
            return False
    return True


def previous(
    targets: list[Target], owner: nn.Module, key: Hashable, refs: tuple[Any, ...]
) -> list[AttentionCall] | None:
    """Each trace's previous record of ``owner`` when every one was built from ``key`` and ``refs``, else
    ``None`` (then the caller builds the record in full)."""
    found = []
    for t, _, _ in targets:
        last = t.last_record(owner)
        if last is None or not last.matches(key, refs):
            return None
        found.append(last.record)
    return found


def repeat(
    found: list[AttentionCall],
    targets: list[Target],
    owner: nn.Module,
    projection: Projection | str,
    core: routes.Core | None,
    output: dict[str, Any],
    norms: tuple[Any, Any, Any] | None = None,
) -> None:
    """Record the call in every trace from the previous records :func:`previous` ``found``.

    ``output``: this call's NaN count and fully-masked rows; ``norms``: the norms of the Q, K and V it
    received, where its record holds them (``None``: the previous record's slices, which the refs showed
    unchanged, are shared).
    """
    thread = threading.current_thread().name
    rank, world = compat.distributed_rank()
    if core is None:
        core = routes.Core(None, "not recorded: the trace was opened with routes=False")
    for (t, name, index), before in zip(targets, found, strict=True):
        record = clone(before)
        record.index, record.module = index, name
        record.output = output
        if norms is not None:
            record.qkv = with_norms(before.qkv, norms)
        own_lists(record, before)
        record.thread, record.rank, record.world_size = thread, rank, world
        core.stamp(record)
        if core.deferred is not None:
            core.deferred.records.append(record)
        t.add_call(record, owner, projection, core)
