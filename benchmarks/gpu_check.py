"""Which attention kernels does ``qkvtrace.trace`` see on a CUDA machine?

Run ``python benchmarks/gpu_check.py [--json gpu_check.json]``.

Each scenario is a small ``nn.Module`` whose attention call runs either with
PyTorch's default backend choice or with one SDPA backend forced through
``torch.nn.attention.sdpa_kernel``:

* direct ``F.scaled_dot_product_attention`` calls forcing FLASH_ATTENTION,
  EFFICIENT_ATTENTION, CUDNN_ATTENTION and MATH, and with the default choice,
  in float16/bfloat16 (float32 where a scenario is about dtype), with shapes,
  masks and head dimensions that suit each backend; one also runs backward;
* a forced backend on inputs it cannot take (FLASH_ATTENTION with float32),
  which PyTorch refuses: the scenario records the error, never crashes;
* ``nn.MultiheadAttention`` on its fast path (eval, ``no_grad``,
  ``need_weights=False``);
* ``nn.TransformerEncoder`` on the fused layer path (eval,
  ``inference_mode``), without and with a padding mask (nested tensors).

For every scenario the work runs twice untraced (the second run tells a
non-deterministic kernel apart from a tracer that changed something) and
twice inside one ``qkvtrace.trace`` (the first traced call of a signature
runs under the autograd profiler, the second reuses what it saw). Outputs,
and gradients where a scenario runs backward, are compared with
``torch.equal``; errors must be the same error traced and untraced.

Printed: a table with the recorded path, ``sdpa_backend`` and ``aten_ops``
of each scenario and one identity line per scenario, then PyTorch's reasons
for refusing each faster SDPA backend (``sdpa_refusals``) and any warnings.
``--json`` gets everything, the full call records included.

Two more checks per scenario, each against a witness the tracer does not
use:

* **Syncs.** The steady-state run (untraced, then traced) runs under
  ``torch.cuda.set_sync_debug_mode("warn")``; every synchronising CUDA call
  warns, and the warnings are counted. The tracer must add none (a model
  that synchronises by itself -- nested tensors from a padding mask -- does
  so in both runs; only the difference counts).
* **Backend.** An untraced run under ``torch.profiler`` gives the SDPA
  kernels that really ran; each is mapped to its ``SDPBackend`` by forcing
  every backend on a small input under the profiler (calibration done by
  this script). The backends the trace recorded must be the same, in order.

Without CUDA the script says so and exits 0; it exits 1 when tracing
changed a result or an error (``DIFFERENT`` above), added a sync, or
recorded a backend other than the one the profiler saw. ``--device cpu`` runs the same scenarios on the
CPU, to try the script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from qkvtrace.tracer import trace as qkv_trace

Outputs = list[torch.Tensor]


# -- modules -------------------------------------------------------------------


class SDPAAttention(nn.Module):
    """Self-attention that calls ``F.scaled_dot_product_attention`` itself.

    Separate ``q_proj``/``k_proj``/``v_proj`` projections, so grouped-query
    attention (fewer K/V heads) fits the same module.
    """

    def __init__(self, embed_dim: int, heads: int, kv_heads: int, causal: bool) -> None:
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = embed_dim // heads
        self.causal = causal
        self.q_proj = nn.Linear(embed_dim, heads * self.head_dim)
        self.k_proj = nn.Linear(embed_dim, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(embed_dim, kv_heads * self.head_dim)

    def _split(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        b, length, _ = t.shape
        return t.view(b, length, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, length, _ = x.shape
        q = self._split(self.q_proj(x), self.heads)
        k = self._split(self.k_proj(x), self.kv_heads)
        v = self._split(self.v_proj(x), self.kv_heads)
        extra = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal, **extra)
        return out.transpose(1, 2).reshape(b, length, self.heads * self.head_dim)


class MHABlock(nn.Module):
    """``nn.MultiheadAttention`` self-attention, called the way its fast path wants."""

    def __init__(self, embed_dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return out


class EncoderBlock(nn.Module):
    """A two-layer ``nn.TransformerEncoder``."""

    def __init__(self, embed_dim: int, heads: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            embed_dim, heads, dim_feedforward=4 * embed_dim, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=padding)


# -- scenarios -----------------------------------------------------------------


@dataclass
class Case:
    """A built scenario: the module to trace and one unit of work."""

    model: nn.Module
    run: Callable[[], Outputs]
    gradients: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    forced: str | None  # SDPBackend member name, None for PyTorch's default choice
    dtype: torch.dtype
    note: str
    make: Callable[[torch.device, torch.dtype], Case]


def _sdpa_case(
    batch: int = 2,
    length: int = 256,
    embed_dim: int = 512,
    heads: int = 8,
    kv_heads: int | None = None,
    causal: bool = False,
    mask: str | None = None,
    backward: bool = False,
) -> Callable[[torch.device, torch.dtype], Case]:
    """A maker for an :class:`SDPAAttention` scenario (``mask``: None, "bool" or "float")."""

    def make(device: torch.device, dtype: torch.dtype) -> Case:
        torch.manual_seed(0)
        model = SDPAAttention(embed_dim, heads, kv_heads or heads, causal).to(device, dtype)
        x = torch.randn(batch, length, embed_dim, device=device, dtype=dtype)
        attn_mask = _make_mask(mask, batch, length, device, dtype)
        params = list(model.parameters())

        def run() -> Outputs:
            if not backward:
                with torch.no_grad():
                    return [model(x, attn_mask)]
            model.zero_grad(set_to_none=True)
            out = model(x, attn_mask)
            out.float().square().mean().backward()
            return [out.detach(), *(p.grad for p in params if p.grad is not None)]

        model.train(backward)
        return Case(model, run, gradients=backward)

    return make


def _make_mask(
    kind: str | None, batch: int, length: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """A mask hiding the last quarter of the keys of the second batch item."""
    if kind is None:
        return None
    keep = torch.ones(batch, 1, length, length, dtype=torch.bool, device=device)
    keep[1, :, :, length - length // 4 :] = False
    if kind == "bool":
        return keep  # SDPA: True = attend
    additive = torch.zeros(keep.shape, device=device, dtype=dtype)
    return additive.masked_fill(~keep, float("-inf"))


def _mha_case(device: torch.device, dtype: torch.dtype) -> Case:
    torch.manual_seed(0)
    model = MHABlock(512, 8).to(device, dtype).eval()
    x = torch.randn(4, 128, 512, device=device, dtype=dtype)

    def run() -> Outputs:
        with torch.no_grad():
            return [model(x)]

    return Case(model, run)


def _encoder_case(padded: bool) -> Callable[[torch.device, torch.dtype], Case]:
    def make(device: torch.device, dtype: torch.dtype) -> Case:
        torch.manual_seed(0)
        model = EncoderBlock(512, 8).to(device, dtype).eval()
        x = torch.randn(4, 128, 512, device=device, dtype=dtype)
        padding = None
        if padded:
            lengths = torch.tensor([128, 96, 64, 17], device=device)
            padding = torch.arange(128, device=device)[None, :] >= lengths[:, None]  # True = pad

        def run() -> Outputs:
            with torch.inference_mode():
                return [model(x, padding)]

        return Case(model, run)

    return make


def scenarios() -> list[Scenario]:
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    return [
        Scenario("sdpa_default_f16", None, f16, "default choice, no mask", _sdpa_case()),
        Scenario("sdpa_default_bf16_causal", None, bf16, "default choice, is_causal", _sdpa_case(causal=True)),
        Scenario("sdpa_default_f16_boolmask", None, f16, "default choice, bool mask", _sdpa_case(mask="bool")),
        Scenario("sdpa_default_f32", None, f32, "default choice, float32", _sdpa_case()),
        Scenario("sdpa_default_bf16_gqa", None, bf16, "default choice, 8 Q / 2 KV heads", _sdpa_case(kv_heads=2)),
        Scenario("sdpa_flash_f16_causal", "FLASH_ATTENTION", f16, "head_dim 64, causal", _sdpa_case(causal=True)),
        Scenario("sdpa_flash_bf16", "FLASH_ATTENTION", bf16, "head_dim 128", _sdpa_case(embed_dim=1024)),
        Scenario(
            "sdpa_flash_bf16_backward",
            "FLASH_ATTENTION",
            bf16,
            "forward + backward, causal",
            _sdpa_case(causal=True, backward=True),
        ),
        Scenario(
            "sdpa_efficient_f16_floatmask",
            "EFFICIENT_ATTENTION",
            f16,
            "additive float mask",
            _sdpa_case(mask="float"),
        ),
        Scenario("sdpa_efficient_f32", "EFFICIENT_ATTENTION", f32, "float32", _sdpa_case()),
        Scenario(
            "sdpa_cudnn_bf16", "CUDNN_ATTENTION", bf16, "head_dim 128, L 512", _sdpa_case(length=512, embed_dim=1024)
        ),
        Scenario("sdpa_cudnn_f16_causal", "CUDNN_ATTENTION", f16, "head_dim 64, causal", _sdpa_case(causal=True)),
        Scenario("sdpa_math_f16", "MATH", f16, "no mask", _sdpa_case()),
        Scenario("sdpa_math_bf16_boolmask", "MATH", bf16, "bool mask", _sdpa_case(mask="bool")),
        Scenario(
            "sdpa_flash_f32_refused",
            "FLASH_ATTENTION",
            f32,
            "float32, which flash refuses on CUDA: expect an error there",
            _sdpa_case(),
        ),
        Scenario("mha_fast_path_f16", None, f16, "eval, no_grad, need_weights=False", _mha_case),
        Scenario("encoder_fused_f16", None, f16, "eval, inference_mode", _encoder_case(padded=False)),
        Scenario(
            "encoder_fused_bf16_padded",
            None,
            bf16,
            "padding mask: nested tensors",
            _encoder_case(padded=True),
        ),
    ]


# -- running one scenario ------------------------------------------------------


@dataclass
class Attempt:
    """One unit of work: its outputs or its error, and the warnings it raised."""

    outputs: Outputs | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)


def attempt(run: Callable[[], Outputs]) -> Attempt:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = Attempt(outputs=run())
        except Exception as exc:  # a refused backend is a result here, not a crash
            result = Attempt(error=f"{type(exc).__name__}: {_first_line(str(exc))}")
    result.warnings = list(dict.fromkeys(str(w.message).strip() for w in caught))
    return result


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


@contextlib.contextmanager
def forced_backend(name: str | None) -> Iterator[None]:
    """``sdpa_kernel(<name>)`` for the block, or nothing for the default choice."""
    if name is None:
        yield
        return
    member = SDPBackend.__members__.get(name)
    if member is None:
        raise RuntimeError(f"SDPBackend.{name} does not exist in torch {torch.__version__}")
    with sdpa_kernel(member):
        yield


def outputs_equal(a: Outputs, b: Outputs) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def identity(reference: Attempt, repeat: Attempt, traced: Attempt) -> str:
    """How a traced run compares with the untraced reference run."""
    if reference.error is not None or traced.error is not None:
        if reference.error == traced.error:
            return "same error"
        return "DIFFERENT: untraced {!r}, traced {!r}".format(reference.error or "ok", traced.error or "ok")
    assert reference.outputs is not None and traced.outputs is not None
    if outputs_equal(reference.outputs, traced.outputs):
        return "bit-identical"
    if repeat.outputs is None or not outputs_equal(reference.outputs, repeat.outputs):
        return "differs, but so do two untraced runs (non-deterministic kernel)"
    return "DIFFERENT"


@dataclass
class ScenarioResult:
    name: str
    forced: str | None
    dtype: str
    note: str
    status: str  # "ok" or "error"
    error: str | None
    identity_first: str
    identity_second: str
    #: Call records of the first traced run (profiled) and of the second.
    calls: list[dict[str, Any]]
    calls_second: list[dict[str, Any]]
    gradient_records: int
    warnings: list[str]
    seconds: float
    #: synchronising CUDA calls in the steady-state run: (untraced, traced); None when not counted
    syncs: tuple[int, int] | None = None
    #: SDPA backends of the kernels the profiler saw in an untraced run, in order
    witness_backends: list[str] | None = None


def run_scenario(s: Scenario, device: torch.device) -> ScenarioResult:
    started = time.perf_counter()
    calls: list[dict[str, Any]] = []
    calls_second: list[dict[str, Any]] = []
    gradient_records = 0
    stage = "building the scenario"
    try:
        case = s.make(device, s.dtype)
        with forced_backend(s.forced):
            reference = attempt(case.run)
            witness = witness_backends(case.run, device)
            with count_syncs(device) as plain_syncs:
                repeat = attempt(case.run)
            stage = "tracing"
            with qkv_trace(case.model, gradients=case.gradients) as t:
                first = attempt(case.run)
                n_first = len(t.calls)
                with count_syncs(device) as traced_syncs:
                    second = attempt(case.run)
        records = [dataclasses.asdict(c) for c in t.calls]
        calls, calls_second = records[:n_first], records[n_first:]
        gradient_records = len(t.gradients)
        first_identity = identity(reference, repeat, first)
        second_identity = identity(reference, repeat, second)
        error = reference.error or first.error
        seen = [*reference.warnings, *first.warnings, *second.warnings]
        seen = [w for w in seen if not _is_sync_warning(w)]
        syncs = (plain_syncs.count, traced_syncs.count) if plain_syncs.counting else None
    except Exception as exc:  # building the case failed, or the tracer itself (entering or leaving)
        error = f"{type(exc).__name__} while {stage}: {_first_line(str(exc))}"
        first_identity = second_identity = "DIFFERENT: the tracer raised" if stage == "tracing" else "not run"
        seen = []
        syncs = None
        witness = None
    if device.type == "cuda":
        torch.cuda.synchronize()
    return ScenarioResult(
        name=s.name,
        forced=s.forced,
        dtype=str(s.dtype).removeprefix("torch."),
        note=s.note,
        status="error" if error else "ok",
        error=error,
        identity_first=first_identity,
        identity_second=second_identity,
        calls=calls,
        calls_second=calls_second,
        gradient_records=gradient_records,
        warnings=list(dict.fromkeys(seen)),
        seconds=time.perf_counter() - started,
        syncs=syncs,
        witness_backends=witness,
    )


# -- independent witnesses -------------------------------------------------------

_KERNEL_BACKEND: dict[tuple[str, str], str] = {}


def _sdpa_kernels(run: Callable[[], Any]) -> list[str]:
    """The SDPA kernel ops (not the dispatcher entry) a run executes, in order, seen by torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return [
        e.name for e in events
        if "scaled_dot_product" in e.name and e.name != "aten::scaled_dot_product_attention"
        and not e.name.endswith("_backward")
    ]  # fmt: skip


def _calibrate(device: torch.device) -> None:
    if any(dev == device.type for dev, _ in _KERNEL_BACKEND):
        return
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 64, 64, device=device, dtype=dtype)
    for name, member in SDPBackend.__members__.items():
        if name == "ERROR":
            continue
        try:
            with sdpa_kernel(member):
                kernels = _sdpa_kernels(lambda: torch._C._nn.scaled_dot_product_attention(q, q, q))
        except RuntimeError:  # not available here
            continue
        for k in kernels[:1]:
            _KERNEL_BACKEND[(device.type, k)] = name


def witness_backends(run: Callable[[], Outputs], device: torch.device) -> list[str] | None:
    """Backends of the SDPA kernels an untraced run executes, mapped through the calibration."""
    _calibrate(device)
    try:
        kernels = _sdpa_kernels(run)
    except Exception:  # the scenario's error is reported by its own attempt
        return None
    return [_KERNEL_BACKEND.get((device.type, k), f"unknown kernel {k}") for k in kernels]


def _is_sync_warning(text: str) -> bool:
    return "synchroniz" in text.lower()


class count_syncs:
    """Counts synchronising CUDA calls in the block (``torch.cuda.set_sync_debug_mode("warn")``)."""

    def __init__(self, device: torch.device) -> None:
        self.counting = device.type == "cuda" and hasattr(torch.cuda, "set_sync_debug_mode")
        self.count = 0
        self._caught: Any = None

    def __enter__(self) -> count_syncs:
        if self.counting:
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.counting:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self.count = sum(1 for w in self._caught if _is_sync_warning(str(w.message)))


def recorded_backends(r: ScenarioResult) -> list[str]:
    return [c["sdpa_backend"] for c in r.calls if c.get("sdpa_backend")]


def backend_verdict(r: ScenarioResult) -> str:
    if r.witness_backends is None:
        return "not checked"
    recorded = recorded_backends(r)
    if recorded == r.witness_backends:
        return f"same as the profiler ({', '.join(recorded) or 'no SDPA kernel'})"
    return f"DIFFERENT: recorded {recorded}, profiler saw {r.witness_backends}"


def sync_verdict(r: ScenarioResult) -> str:
    if r.syncs is None:
        return "not counted (CPU)"
    plain, traced = r.syncs
    added = traced - plain
    return f"{plain} untraced, {traced} traced" + (f": ADDED {added}" if added else ": none added")


# -- report --------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["cudnn"] = torch.backends.cudnn.version()
        env["sdp_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
            "cudnn": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
        }
    return env


def _distinct(calls: Sequence[dict[str, Any]], key: str) -> str:
    values = [str(c.get(key)) if not isinstance(c.get(key), list) else ",".join(c[key]) for c in calls]
    return " | ".join(dict.fromkeys(values)) or "-"


_SUMMARY_KEYS = ("path", "sdpa_backend", "aten_ops", "why_not_fast_path", "sdpa_refusals")


def records_agree(r: ScenarioResult) -> bool:
    """Whether the second traced run was recorded like the first (cached kernel evidence)."""

    def summary(calls: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
        return [tuple(json.dumps(c.get(k), sort_keys=True) for k in _SUMMARY_KEYS) for c in calls]

    return summary(r.calls) == summary(r.calls_second)


def print_table(results: Sequence[ScenarioResult]) -> None:
    rows = [("scenario", "forced", "dtype", "status", "path", "sdpa_backend", "aten_ops")]
    for r in results:
        calls = r.calls
        rows.append(
            (
                r.name,
                r.forced or "default",
                r.dtype,
                r.status,
                _distinct(calls, "path"),
                _distinct(calls, "sdpa_backend"),
                _distinct(calls, "aten_ops"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()


def print_identity(results: Sequence[ScenarioResult]) -> None:
    print("Traced vs untraced (torch.equal; first traced run is the profiled one):")
    for r in results:
        agree = "same" if records_agree(r) else "DIFFERENT"
        print(
            f"  {r.name}: first traced run {r.identity_first}; second {r.identity_second}; "
            f"records {len(r.calls)} + {len(r.calls_second)} calls, second run's path/backend/ops {agree}; "
            f"backend {backend_verdict(r)}; syncs {sync_verdict(r)}"
        )
    print()


def print_details(results: Sequence[ScenarioResult]) -> None:
    print("SDPA refusals (for each backend PyTorch ranks above the chosen one, its own words; [] = usable),"
          " errors and warnings:")
    for r in results:
        lines: list[str] = []
        if r.error:
            lines.append(f"error: {r.error}")
        for call in r.calls:
            if call.get("why_not_fast_path"):
                lines.append(f"call {call['index']}: why_not_fast_path: {call['why_not_fast_path']}")
            if call.get("sdpa_backend"):
                lines.append(f"call {call['index']}: chose {call['sdpa_backend']}; refusals "
                             f"{call.get('sdpa_refusals_source') or 'not recorded'}")  # fmt: skip
            for backend, reasons in (call.get("sdpa_refusals") or {}).items():
                text = "[] (it would run)" if not reasons else " / ".join(reasons)
                lines.append(f"call {call['index']}: why not {backend}: {text}")
        lines.extend(f"warning: {w}" for w in r.warnings)
        if r.gradient_records:
            lines.append(f"gradient records: {r.gradient_records}")
        print(f"  {r.name} ({r.note}; {r.seconds:.1f} s)")
        for line in lines or ["(nothing)"]:
            print(f"      {line}")
    print()


def write_json(path: Path, env: dict[str, Any], results: Sequence[ScenarioResult]) -> None:
    payload = {
        "environment": env,
        "scenarios": [dataclasses.asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")


# -- entry point -----------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where to write the JSON")
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the scenarios on the CPU"
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only the scenarios with these names")
    return parser.parse_args(argv)


def choose(all_scenarios: Sequence[Scenario], names: Sequence[str] | None) -> list[Scenario]:
    if names is None:
        return list(all_scenarios)
    unknown = sorted(set(names) - {s.name for s in all_scenarios})
    if unknown:
        known = ", ".join(s.name for s in all_scenarios)
        raise SystemExit(f"unknown scenario(s): {', '.join(unknown)}; known: {known}")
    return [s for s in all_scenarios if s.name in names]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        reason = f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        print(f"{reason}; nothing to check. Use --device cpu to try the scenarios on the CPU.")
        write_json(args.json, {**environment(torch.device("cpu")), "skipped": reason}, [])
        return 0
    env = environment(device)
    print("qkvtrace GPU check: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print()
    chosen = choose(scenarios(), args.only)
    results = [run_scenario(s, device) for s in chosen]
    print_table(results)
    print_identity(results)
    print_details(results)
    write_json(args.json, env, results)
    print(f"JSON written to {args.json}")
    failed = [r.name for r in results if "DIFFERENT" in (r.identity_first + r.identity_second)]
    if failed:
        print(f"Tracing changed the results of: {', '.join(failed)}")
    synced = [r.name for r in results if r.syncs is not None and r.syncs[1] > r.syncs[0]]
    if synced:
        print(f"Tracing added device syncs in: {', '.join(synced)}")
    wrong = [r.name for r in results if backend_verdict(r).startswith("DIFFERENT")]
    if wrong:
        print(f"Recorded backend differs from the profiler's kernel in: {', '.join(wrong)}")
    if failed or synced or wrong:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
