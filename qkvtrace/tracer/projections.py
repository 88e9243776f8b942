"""Which weight rows are each call's Q, K and V, kept for one trace while they hold.

``nn.MultiheadAttention`` keeps them where its definition says. Any other
module's are derived from what its call did (:mod:`qkvtrace.facts.dataflow`) and
kept per call layout: every call is checked against the layouts this trace
has seen -- how the kernel's Q, K and V view their storage (strides and
offsets) and the module's children, a few attribute reads -- and a call
whose layout is new is looked up by its full signature, which is blind to
the sequence length and reads the graph nodes nearest the kernel; a
signature never seen is derived anew. So a module fused after its first
call, one whose split order comes from an argument, or one that calls its
kernel twice with other rows gets each call's own rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from qkvtrace.facts import lineage
from qkvtrace.facts.dataflow import derived_projection, signature
from qkvtrace.facts.slices import Projection, mha_projection
from qkvtrace.tracer import registry
from qkvtrace.tracer.observers import handwritten

__all__ = ["Projections"]

#: call layouts a trace remembers before it forgets them all (each step of a decoding loop is one)
_MAX_LAYOUTS = 4096


class Projections:
    """One trace's answers: by module for ``nn.MultiheadAttention``, by call layout for any other."""

    def __init__(self, parents: Callable[[nn.Module], list[nn.Module]]) -> None:
        self._parents = parents
        self._known: dict[Any, Projection | str] = {}

    def clear(self) -> None:
        self._known.clear()

    def get(self, module: nn.Module, qkv: Sequence[Any] | None = None) -> Projection | str:
        """``module``'s Q/K/V for a call whose kernel received ``qkv``, or why they are not known."""
        known = self._known
        if isinstance(module, nn.MultiheadAttention):
            found = known.get(id(module))
            if found is None:
                found = known[id(module)] = mha_projection(module)
            return found
        if qkv is None:
            return "not derived: the call handed no Q, K, V tensors to a kernel the tracer sees"
        try:  # the check made on every call: how the kernel's Q, K, V view their storage, the children, a graph
            q, k, v = qkv
            fast = (id(module), q.requires_grad, q.stride(), k.stride(), v.stride(), q.storage_offset(),
                    k.storage_offset(), v.storage_offset(), tuple(map(id, module._modules.values())),
                    registry.call_site())  # fmt: skip
        except (TypeError, ValueError, RuntimeError, AttributeError):  # not three strided tensors
            fast = None
        found = known.get(fast) if fast is not None else None
        if found is not None:
            return found
        sig = (signature(module, qkv), registry.call_site())
        key = (id(module), sig)
        found = known.get(key)
        if found is None:
            found = derived_projection(module, qkv, [module, *self._parents(module)], sig, lineage.current())
            # no graph: the next call's functions are written down too, in case its layout is new again (a
            # decoding loop's first step); a module no hook can watch says so for good
            if fast is not None and not q.requires_grad and not handwritten.layouts_new(module):
                found = lineage.never_recorded(found)
            if not lineage.lasting(found):
                return found
            known[key] = found
        if fast is not None:
            if len(known) > _MAX_LAYOUTS:  # a decoding loop: a new length each step
                known.clear()
            known[fast] = found
        return found
