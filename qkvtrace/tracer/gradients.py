"""Q/K/V slice gradients per module, and gradient routes per call, for each backward pass.

Routes: hooks on the backward core of each call (:mod:`qkvtrace.facts.routes`)
keep the norms of the gradients that reached its Q, K and V.

Slices: a hook on each Q/K/V parameter keeps the norm of this pass's gradient for
each slice; a callback queued on the autograd engine runs once the backward
pass is over and takes the norms of the slices of the real ``.grad`` -- what
an optimizer step would use. Every norm stays a 0-dim tensor on the device
until the trace resolves its records (no host read during backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts import routes
from qkvtrace.facts.slices import Projection, Rows, grad_slices, param_of, slice_norms_of
from qkvtrace.records import GradientRecord, RouteGrad, RouteRecord

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientRecorder"]


class GradientRecorder:
    """The gradient side of one trace: hooks in, records out, hooks removed by :meth:`close`."""

    def __init__(self, name_of: Callable[[nn.Module], str | None]) -> None:
        self._name_of = name_of
        #: by module and projection: a module whose calls use other rows (re-wired, or two kernel calls) has each
        self._watched: dict[tuple[int, int], tuple[nn.Module, Projection]] = {}
        self._handles: list[RemovableHandle] = []
        self._pending: dict[tuple[int, int], dict[tuple[str, Rows], torch.Tensor]] = {}
        #: this pass's route gradients: call index -> (module name, part -> (norm, per-head norms))
        self._pending_routes: dict[int, tuple[str, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]] = {}
        self.routes: list[RouteRecord] = []
        #: modules whose parameters are sharded (FSDP): their slices are read at the end of every pass
        self._sharded: set[tuple[int, int]] = set()
        #: FSDP1: a context in which every rank holds whole parameters and whole ``.grad``
        #: (``summon_full_params(root, with_grads=True)``, a collective: entered by every rank, every pass)
        self.gather: Callable[[], contextlib.AbstractContextManager[object]] | None = None
        self._queued = False
        self._backward_index = 0
        self._open = True
        self.records: list[GradientRecord] = []

    def watch(self, owner: nn.Module, projection: Projection) -> None:
        """Hook the Q/K/V parameters of ``owner``'s projection (once per module and projection)."""
        key = (id(owner), id(projection.spec))  # the spec is held in _watched: its id stays its own
        if not self._open or key in self._watched:
            return
        self._watched[key] = (owner, projection)
        by_param: dict[str, list[tuple[Rows, int]]] = {}
        for _, part in projection.spec.parts():
            for ps in part.pieces():
                by_param.setdefault(ps.param, []).append((ps.rows, ps.dim))
                if ps.bias_param is not None:
                    by_param.setdefault(ps.bias_param, []).append((ps.bias_rows, 0))
        if self.gather is not None:  # FSDP1: each rank's .grad is a shard until gathered at the end of the pass
            self._sharded.add(key)
        for pname, rows_list in by_param.items():
            param = param_of(projection.holder, pname)
            if compat.is_dtensor(param):
                # FSDP's sharded parameter: its .grad is set by FSDP after the reduction, no hook runs for it
                self._sharded.add(key)
            elif param.requires_grad:
                self._handles.append(param.register_hook(self._hook(key, pname, rows_list)))

    def watch_routes(self, index: int, module: str, core: routes.Core) -> None:
        """Keep, for each backward pass, the gradients reaching call ``index``'s Q, K and V."""
        if not self._open or not core.has_routes:
            return

        def on_grad(part: str, layout: routes.Layout, grad: torch.Tensor) -> None:
            if not self._open:
                return
            self._pending_routes.setdefault(index, (module, {}))[1][part] = routes.grad_norms(grad, layout)
            self._queue()

        routes.register(core, on_grad)

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _hook(self, mid: tuple[int, int], pname: str,
              rows_list: list[tuple[Rows, int]]) -> Callable[[torch.Tensor], None]:  # fmt: skip
        def hook(grad: torch.Tensor) -> None:
            if not self._open:
                return
            with torch.no_grad():
                norms = slice_norms_of(grad, rows_list)
            pending = self._pending.setdefault(mid, {})
            for (rows, _), norm in zip(rows_list, norms, strict=True):
                pending[(pname, rows)] = norm
            self._queue()

        return hook

    def _end_of_backward(self) -> None:
        # Callbacks run in the order they were queued, and this one was queued by the first
        # gradient of the pass; ``DistributedDataParallel`` queues its reduction when the last
        # bucket is ready. Queued again from here, it runs after that: ``.grad`` is then what
        # every rank's optimizer will use.
        torch.autograd.Variable._execution_engine.queue_callback(self._read_grads)

    def _read_grads(self) -> None:
        self._queued = False
        if not self._open or not (self._pending or self._pending_routes):
            self._pending, self._pending_routes = {}, {}
            return
        for index, (module, found) in self._pending_routes.items():
            got = {p: RouteGrad(norm=n, per_head=h) for p, (n, h) in found.items()}  # type: ignore[arg-type]  # resolved later
            record = RouteRecord(call=index, module=module, backward_index=self._backward_index,
                                 q=got.get("q"), k=got.get("k"), v=got.get("v"))  # fmt: skip
            self.routes.append(record)
        self._pending_routes = {}
        for mid in self._sharded:
            self._pending.setdefault(mid, {})
        rank, world = compat.distributed_rank()
        gather = self.gather() if self.gather is not None else contextlib.nullcontext()
        with torch.no_grad(), gather:
            for mid, pass_norms in self._pending.items():
                owner, projection = self._watched[mid]
                name = self._name_of(owner) or ""
                parts = grad_slices(projection, pass_norms)
                holder = None if projection.holder is owner else self._name_of(projection.holder)
                self.records.append(
                    GradientRecord(module=name, backward_index=self._backward_index, rank=rank, world_size=world,
                                   holder=holder, **parts)
                )
        self._pending = {}
        self._backward_index += 1

    def close(self) -> None:
        """Remove every hook; keep the records."""
        self._open = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()
        self._pending.clear()
        self._pending_routes.clear()
