"""What recording one small attention call costs, taken apart: records with routes, without, without gradients.

Run ``python benchmarks/small_calls.py`` (from any folder; to compare with another
checkout of qkvtrace, run it there with that checkout first on ``PYTHONPATH``).
``--parts``: also the default trace with one part of the record switched off at a
time (by replacing that part's function for the run), so each part's share is the
difference -- a breakdown, not a supported way to run qkvtrace.
``--floor``: also the least any observer that reports what a record reports must
do, without qkvtrace: plain wrappers around ``MultiheadAttention.forward`` and
``F.multi_head_attention_forward`` that only read PyTorch's reason from its frame
and count the output's NaNs -- the cost below which no record can go -- and the
same with every head's attention weights computed beside the call (the least a
map costs), next to the records with ``attention_maps=True``; for the model's own SDPA
call, a guarded wrapper around ``F.scaled_dot_product_attention`` that keeps the call's
numbers (the norms of Q, K and V, the output's NaN count), a record and a hook; for
GPT-2, those numbers alone in a bare wrapper (``peers.py``'s floor).

One ``nn.MultiheadAttention(64, 8)`` in training mode on a ``(2, 10, 64)`` input,
``need_weights`` left at its default, then with ``need_weights=False`` (the call an
encoder layer makes: the fallback's kernel is an SDPA call), then a model's own SDPA call with dropout on
``(2, 4, 16, 32)`` (``overhead.py``'s W5), then a transformers GPT-2 of one layer (if installed: a
library's attention, its module found on the stack): 200 calls per sample, 25 samples per arm,
interleaved untraced / traced; the CPU time of the fastest sample of each arm (the
one least disturbed by the machine) gives the cost per call in microseconds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import qkvtrace

CALLS, SAMPLES = 200, 25


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 8)
    x = torch.randn(2, 10, 64)

    def work() -> None:
        for _ in range(CALLS):
            mha(x, x, x)

    def cpu(fn: Callable[[], None]) -> float:
        gc.collect()
        start = time.process_time()
        fn()
        return time.process_time() - start

    work()
    print(f"qkvtrace from {qkvtrace.__file__}, torch {torch.__version__}")
    arms: list[tuple[str, dict[str, Any], Callable[[], Any]]] = [
        ("records, routes on", {}, contextlib.nullcontext),
        ("routes=False", {"routes": False}, contextlib.nullcontext),
        ("gradients=False, routes=False", {"gradients": False, "routes": False}, contextlib.nullcontext),
        ('long run (keep="changes"), steady state', {"keep": "changes"}, contextlib.nullcontext),
    ]
    if "--parts" in sys.argv:
        arms += [(f"routes on, without {part}", {}, off) for part, off in _parts().items()]
    if "--floor" in sys.argv:
        arms.append(("floor: reason and NaN count only, no qkvtrace", {"floor": True}, _floor))
        arms.append(("exact floor: + facts compared with the last call's", {"floor": True}, lambda: _floor(exact=True)))
        arms.append(("exact floor with records: + a record and a hook", {"floor": True},
                     lambda: _floor(exact=True, records=True)))  # fmt: skip
        arms.append(("exact floor, guarded: + threads, nesting, errors, compile", {"floor": True},
                     lambda: _floor(exact=True, guarded=True, modules=(mha,))))  # fmt: skip
        arms.append(("the same with records: + a record and a hook", {"floor": True},
                     lambda: _floor(exact=True, records=True, guarded=True, modules=(mha,))))  # fmt: skip
        arms.append(("floor with a map: + softmax(QKᵀ) on the side", {"floor": True}, lambda: _floor(maps=True)))
        arms.append(("records with maps (attention_maps=True)", {"attention_maps": True}, contextlib.nullcontext))
    _measure(arms, mha, work, cpu, lambda: mha(x, x, x))

    def kernel_work() -> None:
        for _ in range(CALLS):
            mha(x, x, x, need_weights=False)

    print("  the same MultiheadAttention with need_weights=False (an encoder layer's call: its kernel an SDPA call):")
    kernel_arms: list[tuple[str, dict[str, Any], Callable[[], Any]]] = [
        ("records (need_weights=False)", {}, contextlib.nullcontext),
        ('long run (keep="changes") (need_weights=False)', {"keep": "changes"}, contextlib.nullcontext),
    ]
    kernel_work()
    _measure(kernel_arms, mha, kernel_work, cpu, lambda: mha(x, x, x, need_weights=False))
    # a model's own SDPA call (benchmarks/overhead.py's W5): dropout, so PyTorch refuses its first choice
    sdpa = _DropoutAttention().train()
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))

    def sdpa_work() -> None:
        for _ in range(CALLS):
            sdpa(q, k, v)

    print("  a model's own F.scaled_dot_product_attention call (W5's: (2, 4, 16, 32), dropout 0.1):")
    sdpa_arms: list[tuple[str, dict[str, Any], Callable[[], Any]]] = [
        ("records (SDPA)", {}, contextlib.nullcontext),
        ('long run (keep="changes"), steady state (SDPA)', {"keep": "changes"}, contextlib.nullcontext),
    ]
    if "--floor" in sys.argv:
        sdpa_arms.append(("no qkvtrace: the SDPA floor with records", {"floor": True}, lambda: _sdpa_floor((sdpa,))))
    _measure(sdpa_arms, sdpa, sdpa_work, cpu, lambda: sdpa(q, k, v))
    _gpt2(cpu)


def _gpt2(cpu: Callable[[Callable[[], None]], float]) -> None:
    """A transformers GPT-2 of one layer (random weights, SDPA attention), a forward in inference: one attention
    call of a library's model, its module found on the Python stack, its projection named ``c_attn``."""
    try:
        import transformers
    except ImportError:
        print("  a transformers GPT-2 forward: skipped (pip install transformers)")
        return
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100, n_positions=64,
                                     attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))

    def work() -> None:
        with torch.no_grad():
            for _ in range(CALLS):
                model(ids)

    def first() -> None:
        with torch.no_grad():
            model(ids)

    print("  a transformers GPT-2 forward (1 layer, SDPA attention, inference; ids (1, 8)): one attention call")
    work()
    arms: list[tuple[str, dict[str, Any], Callable[[], Any]]] = [
        ("records (GPT-2)", {}, contextlib.nullcontext),
        ('long run (keep="changes") (GPT-2)', {"keep": "changes"}, contextlib.nullcontext),
    ]
    if "--floor" in sys.argv:  # the call's own numbers in a bare wrapper, as the peer benchmark's floor
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from peers import numbers_alone

        arms.append(("no qkvtrace: the numbers alone (GPT-2)", {"floor": True}, lambda: numbers_alone([])))
    _measure(arms, model, work, cpu, first)


class _DropoutAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


def _measure(arms: list[tuple[str, dict[str, Any], Callable[[], Any]]], model: torch.nn.Module,
             work: Callable[[], None], cpu: Callable[[Callable[[], None]], float],
             first: Callable[[], Any]) -> None:  # fmt: skip
    """Each arm against the untraced calls, interleaved: the fastest sample of each, per call."""
    for label, options, context in arms:
        plain, traced = [], []
        for _ in range(SAMPLES):
            plain.append(cpu(work))
            observer = contextlib.nullcontext() if "floor" in options else qkvtrace.trace(model, **options)
            with context(), observer:
                first()  # the first call of a signature: its kernels profiled once, not timed
                traced.append(cpu(work))
        base, with_trace = min(plain), min(traced)
        print(f"  {label:48s} +{(with_trace - base) / CALLS * 1e6:4.0f} us a call "
              f"({with_trace / base:.2f}x of a {base / CALLS * 1e6:.0f} us call)")  # fmt: skip


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _parts() -> dict[str, Callable[[], Any]]:
    from qkvtrace.facts.slices import NormCache
    from qkvtrace.tracer.observers import mha

    lookup = NormCache.qkv
    return {
        "the NaN count": lambda: _replaced(mha, "nan_count", lambda _t: None),
        "PyTorch's reason (frame read)": lambda: _replaced(mha, "_read_frame", lambda _ctx, _caller: None),
        "the Q/K/V slice lookup": lambda: _replaced(NormCache, "qkv", lambda self, _p: lookup(self, "skipped")),
        "the record's delivery": lambda: _replaced(mha, "deliver", lambda *a, **k: None),
        "the record (wrappers only)": lambda: _replaced(mha, "_finish", lambda ctx, out: None),
    }


def _no_hook(grad_outputs: Any) -> None:
    """The hook a floor puts on a call's output node: one, as a record's routes need, doing nothing."""
    return None


@contextlib.contextmanager
def _floor(maps: bool = False, exact: bool = False, records: bool = False, guarded: bool = False,
           modules: tuple[torch.nn.Module, ...] = ()) -> Iterator[None]:  # fmt: skip
    """Wrappers that read PyTorch's reason from its frame and count the output's NaNs, and nothing else.

    ``maps``: also the attention weights of every head, computed on the side from the call's own query and
    key (the two projections, Q·Kᵀ scaled, softmax) -- the arithmetic any map made beside the kernel needs.
    ``exact``: also what a long run must do to stay exact: the facts a record is made of (shapes, dtype,
    device, flags, modes; the masks left out: these calls pass none) and PyTorch's reason compared with the
    module's previous call's, and the call counted. ``records``: also a record of each call (a tuple) and a
    hook on its output's backward node (where a gradient's routes are read from). ``guarded``: also what every
    observer of a user's model must keep, as qkvtrace's wrappers keep it: both wrappers step aside while
    ``torch.compile`` or the JIT traces them; the module is looked up among the traced ``modules``; the reason goes
    to this thread's innermost open call (a stack per thread: threads and nested calls keep theirs); the
    call is counted even when it raises, and its exception goes on unchanged.
    """
    forward, function = torch.nn.MultiheadAttention.forward, torch.nn.functional.multi_head_attention_forward
    seen: list[Any] = []
    state: dict[str, Any] = {"reason": None, "last": None, "calls": 0, "changes": 0}
    local = threading.local()
    traced = {id(m) for m in modules}
    compiling, tracing = torch.compiler.is_compiling, torch._C._is_tracing

    def wrapped_forward(self: torch.nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
        if guarded:
            if compiling() or tracing() or id(self) not in traced:
                return forward(self, *args, **kwargs)
            stack = local.__dict__.get("stack")
            if stack is None:
                stack = local.stack = []
            call = [None]
            stack.append(call)
            try:
                out = forward(self, *args, **kwargs)
            except BaseException:
                state["calls"] += 1
                raise
            finally:
                stack.pop()
            state["reason"] = call[0]
            return _after(self, args, kwargs, out)
        return _after(self, args, kwargs, forward(self, *args, **kwargs))

    def _after(self: torch.nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if exact:
            q, k, v = args[:3]
            key = (q.shape, k.shape, v.shape, q.dtype, q.device, q is k, k is v, kwargs.get("need_weights", True),
                   kwargs.get("average_attn_weights", True), kwargs.get("is_causal", False), self.training,
                   self.batch_first, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                   torch.is_autocast_enabled())  # fmt: skip
        nans = torch.isnan(out[0]).sum()  # kept on its device, as a record keeps it
        seen.append(nans)
        if exact:
            said = (key, state["reason"])
            if said != state["last"]:
                state["last"] = said
                state["changes"] += 1
            state["calls"] += 1
        if records:
            seen.append((state["calls"], nans, said))
            node = out[0].grad_fn
            if node is not None:
                node.register_prehook(_no_hook)
        if maps:
            seen.append(_weights(self, args[0], args[1]))
        return out

    def wrapped_function(*args: Any, **kwargs: Any) -> Any:
        if not guarded:
            state["reason"] = sys._getframe(1).f_locals.get("why_not_fast_path")
        elif not (compiling() or tracing()):
            stack = local.__dict__.get("stack")
            if stack:
                stack[-1][0] = sys._getframe(1).f_locals.get("why_not_fast_path")
        return function(*args, **kwargs)

    with (_replaced(torch.nn.MultiheadAttention, "forward", wrapped_forward),
          _replaced(torch.nn.functional, "multi_head_attention_forward", wrapped_function)):  # fmt: skip
        yield


@contextlib.contextmanager
def _sdpa_floor(modules: tuple[torch.nn.Module, ...]) -> Iterator[dict[str, Any]]:
    """A wrapper around ``F.scaled_dot_product_attention`` that does the least a record of the call holds, as
    guarded as the one around ``MultiheadAttention`` (:func:`_floor`): the calling module looked up among the
    traced ``modules``, the call's facts (shapes, strides, dtype, device, flags, modes) compared with the last
    call's and the call counted, even when it raises; the numbers measured on each call's data -- the norms of
    Q, K and V and the output's NaN count, each kept on its device, by qkvtrace's measuring functions (as
    ``peers.py``'s numbers alone) -- a record (a tuple) and a hook on the output's backward node. No reason is
    read: an SDPA call's backend and reasons follow from its facts. Yields its counts and its records
    (``calls``, ``changes``, ``records``).
    """
    from qkvtrace.facts.slices import norm_of
    from qkvtrace.tracer.build import nan_count

    function = torch.nn.functional.scaled_dot_product_attention
    seen: list[Any] = []
    state: dict[str, Any] = {"last": None, "calls": 0, "changes": 0, "records": seen}
    traced = {id(m) for m in modules}
    compiling, tracing = torch.compiler.is_compiling, torch._C._is_tracing

    def wrapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_locals.get("self")
        if compiling() or tracing() or id(caller) not in traced:
            return function(q, k, v, *args, **kwargs)
        try:
            out = function(q, k, v, *args, **kwargs)
        except BaseException:
            state["calls"] += 1
            raise
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, args,
               tuple(kwargs.items()), caller.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               torch.is_autocast_enabled())  # fmt: skip
        with torch.no_grad():
            numbers = (nan_count(out), norm_of(q), norm_of(k), norm_of(v))
        if key != state["last"]:
            state["last"] = key
            state["changes"] += 1
        state["calls"] += 1
        seen.append((state["calls"], key, numbers))
        node = out.grad_fn
        if node is not None:
            node.register_prehook(_no_hook)
        return out

    with _replaced(torch.nn.functional, "scaled_dot_product_attention", wrapped):
        yield state


def _weights(mha: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """softmax(Q·Kᵀ/√d) per head for an ``(L, N, E)`` call, from the module's packed projection."""
    e, h = mha.embed_dim, mha.num_heads
    with torch.no_grad():
        w, b = mha.in_proj_weight, mha.in_proj_bias
        q = torch.nn.functional.linear(query, w[:e], None if b is None else b[:e])
        k = torch.nn.functional.linear(key, w[e : 2 * e], None if b is None else b[e : 2 * e])
        length, n = q.shape[0], q.shape[1]
        q = q.reshape(length, n * h, e // h).transpose(0, 1)
        k = k.reshape(k.shape[0], n * h, e // h).transpose(0, 1)
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * (e // h) ** -0.5, dim=-1)


if __name__ == "__main__":
    main()
