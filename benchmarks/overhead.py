"""What does ``qkvtrace.trace`` cost, next to ``torch.profiler``?

Run ``python benchmarks/overhead.py`` (``--quick`` for a short run,
``--repeats N``, ``--threads N``).

Workloads
---------
W1  ``nn.TransformerEncoder`` of six ``TransformerEncoderLayer(d_model=256,
    nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)``, input
    ``(8, 128, 256)``: one training step (zero grads, forward, backward).
    Traced with the defaults: slice gradients, and the gradient routes into
    each call's Q, K, V (hooks on its backward kernel).
W1s The same step traced with ``routes=False`` (slice gradients only): the
    difference to W1 is what the routes cost.
W1h Ten of W1's steps as a long run (``keep="changes"``, ``t.step()`` after
    each) with ``health_every=10``: one step in ten measures each layer's
    max logit, entropies and slice norms (:mod:`qkvtrace.facts.health`).
W2  The same model (a copy with the same weights) in ``eval()`` under
    ``torch.inference_mode()``: one forward, on PyTorch's fused encoder path.
W3  1000 calls of ``nn.MultiheadAttention(64, 8)`` (default training mode,
    ``batch_first=False``) on a ``(2, 10, 64)`` input, read as ``(L, N, E)``.
W2m, W3m  W2 and W3 traced with ``attention_maps=True``: every call's
    ``[B, H, T, T]`` weights recomputed on the side (:mod:`qkvtrace.facts.maps`);
    the memory the maps hold per call is printed below the table.
W3c W3 traced as a long run (``keep="changes"``): counts per combination
    and the changes, not a record per call (:mod:`qkvtrace.tracer.monitor`).
W4  W1's training step on ``torch.compile(model)`` (inductor where a C++
    compiler is found, else aot_eager; compiled during the untimed identity
    check). The trace stands aside while compiled code runs, so it must add
    nothing: target 1.02.
W5  1000 direct ``F.scaled_dot_product_attention`` calls in training with
    ``dropout_p=0.1`` on ``(2, 4, 16, 32)`` tensors: PyTorch refuses its
    first-choice kernel, so every traced call carries PyTorch's reason
    (asked once per call signature on a stand-in, then looked up; the
    one-off asking is in the first unit of work, listed below the table).
W5n The same calls traced with ``refusals=False``. The calls are small
    (~0.2 ms), so a record per call is a large share of them; W5 and W5n
    have no target: the difference of their medians, printed below the
    table, is what PyTorch's reasons cost per call.
W6  A transformers GPT-2 (``n_embd=256``, 6 layers, 8 heads) with
    ``attn_implementation="eager"``, attention written by hand: one forward
    of ``(4, 128)`` token ids in ``eval()`` under ``torch.no_grad()``. Each
    attention is recognised and recorded (path ``hand_written``); target
    1.10. Skipped when transformers is not installed.

Method
------
* Everything runs in one process. Each repetition runs, per workload, the
  three arms back to back in a fixed order -- baseline, traced, profiler --
  so slow drifts of the machine (frequency, neighbours) hit all three alike.
  Each arm's time is divided by the baseline time *of the same repetition*;
  the table gives the minimum, median and maximum of these paired ratios.
* Verdict: ``met`` when every repetition is within the target, ``median
  only`` when the median is and some repetitions are not, ``NOT met`` when
  the median is above it; marked ``*`` (not established) when the spread of
  the ratios is wider than the margin the target allows (1.05 allows 0.05):
  such a run cannot tell a 1.00 from a 1.05.
* Baseline: the unit of work, nothing else.
* Traced: a fresh ``qkvtrace.trace(model)`` is entered, the unit of work runs
  once untimed inside it (the first traced call of each call signature runs
  under ``torch.autograd.profiler`` once per trace, to see which kernels ran),
  then the unit of work runs again, timed. Entering and leaving the trace are
  not timed either; both one-time costs are printed below the table.
* Profiler: ``torch.profiler.profile(activities=[ProfilerActivity.CPU])``
  around the unit of work, with its start, its stop and ``key_averages()``
  (the post-processing a user pays to read anything) all timed. The
  profiler's native start/stop log lines are sent to /dev/null, outside the
  timed region.
* Warm-up: before any measurement the identity check below runs every
  workload once plainly and twice traced (untimed), and the profiler is
  started, stopped and read once on a tiny op.
* ``gc.collect()`` runs before each timed region (untimed), so no arm pays
  for another arm's garbage.
* Identity: before timing, each workload runs untraced, then twice inside
  one trace (the first traced call is the profiled one, the second the
  steady state); outputs -- and for W1 every parameter gradient -- are
  compared with ``torch.equal``.
* Record memory: ``tracemalloc`` measures the Python memory still allocated,
  after ``gc.collect()``, by a trace that recorded 10,000 W3 calls (the
  growth from just before the trace was created). ``tracemalloc`` does not
  see tensor storage, so the records are also walked for any reachable
  ``torch.Tensor`` or ``nn.Module`` (there should be none).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import qkvtrace
from qkvtrace.facts.paths import quiet_native_stderr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_reads import added_host_reads

from qkvtrace.tracer import trace as qkv_trace

MEMORY_CALLS = 10_000
MEMORY_TARGET_MB = 20.0
DEFAULT_REPEATS = 9
QUICK_REPEATS = 3

Outputs = list[torch.Tensor]


# -- workloads -----------------------------------------------------------------


@dataclass
class Workload:
    """A unit of work and the module ``qkvtrace.trace`` is given for it."""

    key: str
    title: str
    model: nn.Module
    run: Callable[[], Outputs]
    #: the traced/baseline ratio it should stay within; ``None``: measured, not judged
    target: float | None
    gradients: bool = True
    #: record per-call gradient routes into Q, K, V (with ``gradients``)
    routes: bool = True
    #: compute each call's attention map on the side (``attention_maps=True``)
    maps: bool = False
    #: ``"all"`` records every call; ``"changes"`` is the long-run mode
    keep: str = "all"
    #: ask PyTorch why it refused the kernels it ranks above the one it chose
    refusals: bool = True
    #: measure attention health every N steps (``health_every``, long runs only)
    health_every: int | None = None
    #: the trace open on this workload now (a long run's unit of work marks its steps on it)
    current: qkvtrace.Trace | None = None
    #: for workloads of many small calls: the microseconds a call may add (traced minus untraced, per call)
    us_target: float | None = None


def make_encoder(seed: int) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=6)


def train_step_workload(model: nn.TransformerEncoder, x: torch.Tensor, routes: bool = True) -> Workload:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> Outputs:
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().mean().backward()
        return [out.detach(), *(p.grad for p in params if p.grad is not None)]

    if not routes:
        return Workload("W1s", "encoder train step, slices only", model, run, target=1.05, routes=False)
    return Workload("W1", "encoder train step, routes on", model, run, target=1.10)


def inference_workload(model: nn.TransformerEncoder, x: torch.Tensor) -> Workload:
    model.eval()

    def run() -> Outputs:
        with torch.inference_mode():
            return [model(x)]

    return Workload("W2", "encoder inference (fused)", model, run, target=1.05)


def small_mha_workload(calls: int = 1000) -> Workload:
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(64, 8)  # batch_first=False: (2, 10, 64) is (L, N, E)
    x = torch.randn(2, 10, 64)

    def run() -> Outputs:
        outs: Outputs = []
        for _ in range(calls):
            out, weights = mha(x, x, x)
            outs.append(out)
            outs.append(weights)
        return outs

    return Workload("W3", f"{calls} small MHA calls", mha, run, target=1.10, us_target=25.0)


class DropoutAttention(nn.Module):
    """Direct SDPA with dropout: on PyTorch's CPU and CUDA kernels this refuses the fused first choice."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


def refused_sdpa_workload(calls: int = 1000) -> Workload:
    torch.manual_seed(3)
    model = DropoutAttention().train()
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))

    def run() -> Outputs:
        torch.manual_seed(0)  # the same dropout masks in every arm, so the identity check can compare
        return [model(q, k, v) for _ in range(calls)]

    return Workload("W5", f"{calls} SDPA calls, dropout", model, run, target=None, gradients=False, us_target=25.0)


def compiled_train_workload(model: nn.TransformerEncoder, x: torch.Tensor) -> Workload:
    import shutil

    backend = "inductor" if any(shutil.which(c) for c in ("g++", "c++", "clang++")) else "aot_eager"
    compiled = torch.compile(model, backend=backend)
    w = train_step_workload(compiled, x)  # type: ignore[arg-type]
    return replace(w, key="W4", title=f"compiled train step ({backend})", target=1.02)


def gpt2_eager_workload() -> Workload | None:
    try:
        import transformers
    except ImportError:
        return None
    torch.manual_seed(4)
    config = transformers.GPT2Config(n_embd=256, n_layer=6, n_head=8, n_positions=256, vocab_size=1000,
                                     attn_implementation="eager")  # fmt: skip
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 1000, (4, 128))

    def run() -> Outputs:
        with torch.no_grad():
            return [model(input_ids=ids, use_cache=False).last_hidden_state]

    return Workload("W6", "GPT-2 eager forward (hand-written)", model, run, target=1.10, gradients=False)


def health_workload(model: nn.TransformerEncoder, x: torch.Tensor, steps: int = 10) -> Workload:
    """W1's training step ``steps`` times, a long run marking each step (``t.step()``), health every 10."""
    base = train_step_workload(model, x)
    w = replace(base, key="W1h", title=f"{steps} encoder train steps, health every 10", target=1.05,
                gradients=False, routes=False, keep="changes", health_every=10)  # fmt: skip

    def run() -> Outputs:
        outs: Outputs = []
        for _ in range(steps):
            outs += base.run()
            if w.current is not None:
                w.current.step()
        return outs

    w.run = run
    return w


def build_workloads() -> list[Workload]:
    train_model = make_encoder(seed=0)
    infer_model = copy.deepcopy(train_model)
    torch.manual_seed(1)
    x = torch.randn(8, 128, 256)
    return [
        train_step_workload(train_model, x),
        train_step_workload(train_model, x, routes=False),
        health_workload(train_model, x),
        inference_workload(infer_model, x),
        compiled_train_workload(copy.deepcopy(train_model), x),
        small_mha_workload(),
        replace(
            inference_workload(infer_model, x), key="W2m", title="encoder inference, maps on", target=1.5, maps=True
        ),
        replace(small_mha_workload(), key="W3m", title="1000 small MHA calls, maps on", target=1.5, maps=True,
                us_target=None),
        replace(small_mha_workload(), key="W3c", title="1000 small MHA calls, long run", target=1.3, keep="changes",
                us_target=10.0),
        refused_sdpa_workload(),
        replace(refused_sdpa_workload(), key="W5n", title="the same, refusals=False", refusals=False, us_target=None),
        *([w] if (w := gpt2_eager_workload()) is not None else []),
    ]


# -- the three arms ------------------------------------------------------------


def time_baseline(w: Workload) -> float:
    gc.collect()
    start = time.perf_counter()
    w.run()
    return time.perf_counter() - start


@dataclass
class TracedSample:
    seconds: float
    first_unit_s: float
    enter_exit_s: float
    calls_per_unit: int
    #: bytes of the attention maps the trace holds, per recorded call (``maps`` workloads)
    map_bytes_per_call: float = 0.0


@contextlib.contextmanager
def open_trace(w: Workload) -> Iterator[qkvtrace.Trace]:
    """A trace of ``w`` as the workload asks, open while the block runs (``w.current`` while it is)."""
    with qkv_trace(w.model, gradients=w.gradients, routes=w.routes, attention_maps=w.maps, keep=w.keep,
                   refusals=w.refusals, health_every=w.health_every) as t:  # fmt: skip
        w.current = t
        try:
            yield t
        finally:
            w.current = None


def calls_seen(t: qkvtrace.Trace) -> int:
    """Calls the trace saw: its records, or in a long run the calls its summary counts."""
    if t.monitor is not None:
        modules = t.summary()["modules"].values()
        return sum(combo["calls"] for m in modules for combo in m["combinations"])
    return len(t.calls)


def time_traced(w: Workload) -> TracedSample:
    gc.collect()
    t0 = time.perf_counter()
    with open_trace(w) as t:
        t1 = time.perf_counter()
        w.run()  # untimed: the first call of each signature is profiled here
        t2 = time.perf_counter()
        first_calls = calls_seen(t)
        gc.collect()
        t3 = time.perf_counter()
        w.run()
        t4 = time.perf_counter()
    t5 = time.perf_counter()
    return TracedSample(
        seconds=t4 - t3,
        first_unit_s=t2 - t1,
        enter_exit_s=(t1 - t0) + (t5 - t4),
        calls_per_unit=calls_seen(t) - first_calls,
        map_bytes_per_call=sum(c.attention_map.nbytes for c in t.calls if c.attention_map is not None)
        / max(calls_seen(t), 1),
    )


def time_profiler(w: Workload) -> float:
    with quiet_native_stderr():
        gc.collect()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            w.run()
        prof.key_averages()
        return time.perf_counter() - start


# -- measurement -----------------------------------------------------------------


@dataclass
class Samples:
    baseline: list[float] = field(default_factory=list)
    traced: list[TracedSample] = field(default_factory=list)
    profiler: list[float] = field(default_factory=list)

    def traced_ratios(self) -> list[float]:
        return [t.seconds / b for t, b in zip(self.traced, self.baseline, strict=True)]

    def profiler_ratios(self) -> list[float]:
        return [p / b for p, b in zip(self.profiler, self.baseline, strict=True)]

    def added_us_per_call(self) -> list[float]:
        """Per repetition: (traced - untraced) / calls, in microseconds (paired, like the ratios)."""
        return [(t.seconds - b) / max(t.calls_per_unit, 1) * 1e6 for t, b in zip(self.traced, self.baseline,
                                                                                    strict=True)]  # fmt: skip


def warm_up_profiler() -> None:
    """Start, stop and read the profiler once (its first start loads and sets up Kineto)."""
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).add(1)
    prof.key_averages()


def measure(workloads: Sequence[Workload], repeats: int) -> dict[str, Samples]:
    samples = {w.key: Samples() for w in workloads}
    for _ in range(repeats):
        for w in workloads:
            s = samples[w.key]
            s.baseline.append(time_baseline(w))
            s.traced.append(time_traced(w))
            s.profiler.append(time_profiler(w))
    return samples


# -- identity ------------------------------------------------------------------


@dataclass
class Identity:
    tensors: int
    first_traced_equal: bool
    steady_traced_equal: bool
    paths: dict[str, int]
    gradient_records: int


def all_equal(a: Outputs, b: Outputs) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def check_identity(w: Workload) -> Identity:
    plain = w.run()
    with open_trace(w) as t:
        first = w.run()
        steady = w.run()
    return Identity(
        tensors=len(plain),
        first_traced_equal=all_equal(plain, first),
        steady_traced_equal=all_equal(plain, steady),
        paths=t.result.summary()["paths"],
        gradient_records=len(t.gradients),
    )


# -- record memory -------------------------------------------------------------


@dataclass
class MemoryResult:
    calls_recorded: int
    bytes_held: int
    tensors_reachable: int
    modules_reachable: int


def reachable(root: object) -> Iterator[object]:
    """Every object reachable from ``root`` through ``gc.get_referents``."""
    seen = {id(root)}
    todo = [root]
    while todo:
        obj = todo.pop()
        yield obj
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, type):
                seen.add(id(ref))
                todo.append(ref)


def measure_record_memory(calls: int = MEMORY_CALLS) -> MemoryResult:
    w = small_mha_workload(calls=1)
    w.run()
    with qkv_trace(w.model):
        w.run()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = qkv_trace(w.model)
        with t:
            for _ in range(calls):
                w.run()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    objects = list(reachable(t.result))
    return MemoryResult(
        calls_recorded=len(t.calls),
        bytes_held=held,
        tensors_reachable=sum(isinstance(o, torch.Tensor) for o in objects),
        modules_reachable=sum(isinstance(o, nn.Module) for o in objects),
    )


# -- report --------------------------------------------------------------------


def print_environment(threads: int, repeats: int) -> None:
    print("qkvtrace overhead benchmark")
    print(f"  python   {platform.python_version()} ({platform.python_implementation()})")
    print(f"  torch    {torch.__version__}  threads={torch.get_num_threads()} (asked {threads})")
    print(f"  qkvtrace {qkvtrace.__version__}")
    print(f"  machine  {platform.platform()}, {os.cpu_count()} logical CPUs")
    print(f"  repeats  {repeats} (interleaved: baseline, traced, profiler per repetition)")
    print(f"  load     {load_average()} (1/5/15 min; other work on the machine skews the ratios)")
    print()


def load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "n/a"
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def print_identity(workloads: Sequence[Workload], results: dict[str, Identity]) -> None:
    print("Traced vs untraced outputs (torch.equal on every output tensor; W1 also every .grad):")
    for w in workloads:
        r = results[w.key]
        ok = r.first_traced_equal and r.steady_traced_equal
        verdict = "bit-identical" if ok else "DIFFERENT"
        paths = ", ".join(f"{k}={v}" for k, v in r.paths.items()) or "none"
        print(
            f"  {w.key} {w.title:<26} {verdict:<13} ({r.tensors} tensors; first traced run "
            f"{'equal' if r.first_traced_equal else 'differs'}, second "
            f"{'equal' if r.steady_traced_equal else 'differs'}); "
            f"recorded paths: {paths}; gradient records: {r.gradient_records}"
        )
    print()


def fmt_ratios(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"


@dataclass
class Verdict:
    """Whether a workload met its target, said with the spread of this run."""

    median_met: bool
    every_met: bool
    spread: float  # max - min of the paired ratios
    margin: float  # target - 1.0: the slowdown the target allows

    @property
    def word(self) -> str:
        if self.every_met:
            return "met"
        return "median only" if self.median_met else "NOT met"

    @property
    def resolved(self) -> bool:
        """Is this run's spread narrower than the margin it is judged against?"""
        return self.spread <= self.margin


def verdict(ratios: Sequence[float], target: float) -> Verdict:
    return Verdict(
        median_met=statistics.median(ratios) <= target,
        every_met=max(ratios) <= target,
        spread=max(ratios) - min(ratios),
        margin=target - 1.0,
    )


def print_table(workloads: Sequence[Workload], samples: dict[str, Samples]) -> None:
    header = (
        f"{'workload':<30} {'baseline ms':>11}  {'traced ratio min/med/max':>24}  "
        f"{'profiler ratio min/med/max':>26}  {'target':>7}  {'verdict':>11}"
    )
    print(header)
    print("-" * len(header))
    for w in workloads:
        s = samples[w.key]
        if w.target is None:
            target, word = "-", "measured"
        else:
            v = verdict(s.traced_ratios(), w.target)
            target, word = "<= " + format(w.target, ".2f"), v.word + ("" if v.resolved else "*")
        print(
            f"{w.key + ' ' + w.title:<30} {statistics.median(s.baseline) * 1e3:>11.1f}  "
            f"{fmt_ratios(s.traced_ratios()):>24}  {fmt_ratios(s.profiler_ratios()):>26}  "
            f"{target:>7}  {word:>11}"
        )
    print()
    print("Verdicts: 'met' = every repetition within the target; 'median only' = the median is, some")
    print("repetitions are not; 'NOT met' = the median is above it. * = not established: the spread")
    print("(max - min of the traced ratios) is wider than the margin the target allows.")
    for w in workloads:
        if w.target is None:
            continue
        ratios = samples[w.key].traced_ratios()
        v = verdict(ratios, w.target)
        median = statistics.median(ratios)
        if v.resolved:
            note = f"narrower than the {v.margin:.2f} margin the target allows"
        else:
            note = (
                f"WIDER than the {v.margin:.2f} margin the target allows: this run cannot tell "
                f"a ratio of 1.00 from {w.target:.2f}, so '{v.word}' is not established"
            )
        print(
            f"  {w.key}: median {median:.2f} {'<=' if v.median_met else '>'} {w.target:.2f}; "
            f"spread {v.spread:.2f} ({min(ratios):.2f}-{max(ratios):.2f}), {note}"
        )
    print()
    print("Not in the ratios above (medians over repetitions):")
    for w in workloads:
        s = samples[w.key]
        first = statistics.median(t.first_unit_s for t in s.traced) * 1e3
        enter_exit = statistics.median(t.enter_exit_s for t in s.traced) * 1e3
        calls = s.traced[0].calls_per_unit
        print(
            f"  {w.key}: first unit of work in a fresh trace {first:.1f} ms "
            f"(baseline {statistics.median(s.baseline) * 1e3:.1f} ms); "
            f"trace enter+exit {enter_exit:.2f} ms; {calls} calls recorded per unit of work"
        )
    print_refusal_cost(samples)
    for w in workloads:
        if w.maps:
            per_call = samples[w.key].traced[0].map_bytes_per_call
            print(f"  {w.key}: attention maps held by the trace, {per_call / 2**20:.3f} MB per call (CPU float32)")
    print("  Profiler arm includes profiler start, stop and prof.key_averages().")
    print()
    print_per_call(workloads, samples)


def print_per_call(workloads: Sequence[Workload], samples: dict[str, Samples]) -> None:
    """What a recorded call adds, in microseconds: (traced - untraced) / calls, per repetition."""
    print("Added per recorded call ((traced - untraced) / calls, paired per repetition; median, min-max):")
    for w in workloads:
        s = samples[w.key]
        if s.traced[0].calls_per_unit < 100:  # a few large calls: the ratio says it, a per-call figure does not
            continue
        added = s.added_us_per_call()
        goal = "" if w.us_target is None else (
            f"; goal <= {w.us_target:g} us: {'met' if statistics.median(added) <= w.us_target else 'NOT met'}")
        untraced = statistics.median(s.baseline) / s.traced[0].calls_per_unit * 1e6
        print(f"  {w.key + ' ' + w.title:<40} {statistics.median(added):7.1f} us ({min(added):.1f}-{max(added):.1f}) "
              f"on a {untraced:.1f} us call{goal}")  # fmt: skip
    print()


def print_refusal_cost(samples: dict[str, Samples]) -> None:
    """What asking PyTorch's reasons costs per call: W5 (refusals on) less W5n (off), same calls."""
    if "W5" not in samples or "W5n" not in samples:
        return
    on = statistics.median(t.seconds for t in samples["W5"].traced)
    off = statistics.median(t.seconds for t in samples["W5n"].traced)
    calls = samples["W5"].traced[0].calls_per_unit
    first_on = statistics.median(t.first_unit_s for t in samples["W5"].traced)
    first_off = statistics.median(t.first_unit_s for t in samples["W5n"].traced)
    print(
        f"  W5 - W5n: PyTorch's reasons cost {(on - off) / max(calls, 1) * 1e6:+.1f} us per call in the steady "
        f"state (medians {on * 1e3:.1f} ms vs {off * 1e3:.1f} ms for {calls} calls) and "
        f"{(first_on - first_off) * 1e3:+.1f} ms once per call signature (first unit of work)"
    )


def print_memory(m: MemoryResult) -> None:
    mb = m.bytes_held / 1e6
    verdict = "yes" if mb < MEMORY_TARGET_MB else "NO"
    print(f"Record memory, one trace of {MEMORY_CALLS:,} W3 calls ({m.calls_recorded:,} records):")
    print(
        f"  {mb:.2f} MB held (tracemalloc, after gc), {m.bytes_held / max(m.calls_recorded, 1):.0f} B "
        f"per call; target < {MEMORY_TARGET_MB:.0f} MB: {verdict}"
    )
    print(
        f"  reachable from the records: {m.tensors_reachable} tensors, {m.modules_reachable} modules (expected 0 and 0)"
    )


def print_host_reads(workloads: Sequence[Workload]) -> None:
    """Host reads (device syncs on an accelerator) per unit of work, untraced and traced."""
    print("\nHost reads per unit of work (aten::_local_scalar_dense/nonzero/equal/is_nonzero seen by torch.profiler,"
          " C++ callers included; target: +0)")
    print(f"  {'workload':<34} {'untraced':>9} {'traced':>7} {'added':>6}")
    for w in workloads:
        if w.maps:  # added_host_reads traces without maps; a map is copied to the CPU after each call
            print(f"  {w.key + ' ' + w.title:<34} not counted: each attention map is copied to the CPU after its "
                  "call (a device sync per call on an accelerator)")  # fmt: skip
            continue
        plain, traced = added_host_reads(w.model, w.run)
        print(f"  {w.key + ' ' + w.title:<34} {plain:>9} {traced:>7} {traced - plain:>+6}")


# -- entry point -----------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help=f"repetitions (default {DEFAULT_REPEATS})")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} repetitions unless --repeats is given")
    parser.add_argument("--only", default=None, metavar="W1,W3,...", help="run only these workloads (default: all)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print_environment(args.threads, args.repeats)
    workloads = build_workloads()
    if args.only:
        keys = {k.strip().lower() for k in args.only.split(",")}
        unknown = sorted(keys - {w.key.lower() for w in workloads})
        if unknown:
            print(f"unknown workloads {', '.join(unknown)}; known: {', '.join(w.key for w in workloads)}")
            return 2
        workloads = [w for w in workloads if w.key.lower() in keys]
    print(
        "Warm-up (untimed): the identity check runs each workload once plainly and twice traced, and\n"
        "the profiler is started, stopped and read once. In every traced repetition the first unit of\n"
        "work inside the fresh trace is untimed too: there qkvtrace runs the first call of each call\n"
        "signature under the autograd profiler (that cost is listed below the table).\n"
    )
    warm_up_profiler()
    identity = {w.key: check_identity(w) for w in workloads}
    print_identity(workloads, identity)
    samples = measure(workloads, args.repeats)
    print_table(workloads, samples)
    if any(w.key == "W3" for w in workloads):
        print_memory(measure_record_memory())
    print_host_reads(workloads)
    print(f"\nTotal wall time {time.perf_counter() - started:.0f} s; load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
