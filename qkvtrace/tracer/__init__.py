"""The tracer: ``with qkvtrace.trace(model) as t: ...``.

How it observes without disturbing what runs (DESIGN.md, principle 1):

* No module hooks: PyTorch's encoder layer refuses its fused path when any
  forward (pre-)hook sits on it or a child.
* No ``TorchFunctionMode`` and no tensor subclass: both make
  ``MultiheadAttention`` refuse its fast path.
* No trace function: it would cost every Python call and hide events from
  the user's own debugger.
* Instead, thin wrappers replace a few PyTorch attributes while any trace is
  open (:mod:`.install`, one installation per process); each wrapper asks
  which open traces record the call (:mod:`.hot`, :mod:`.registry`) and
  hands it to the observer of its entry point (:mod:`.observers`); a call
  its module's slot knows (:mod:`.slots`) is taken in :mod:`.hot` alone. Records
  are built in one place (:mod:`.build`), gradients apart (:mod:`.gradients`),
  and the trace a user holds is :mod:`.session`.
"""

from qkvtrace.tracer.session import Trace, trace

__all__ = ["Trace", "trace"]
