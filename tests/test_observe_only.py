"""Observe only: a traced call that builds no graph gets its Q/K/V rows without any of the model's code running
a second time.

Each test runs the same steps untraced and traced and compares what a second run of the model's code would
change: side effects outside the module (a counter, a print, a log line, a file), state kept outside it (a KV
cache in a module-level dict), a lock held around the kernel, the global random state, hooks, a collective with
one rank traced, the memory a copy of the arguments would take. Rows are checked against the construction of
each module; where the rows cannot be had, the test asks for ``None`` with a reason, never other rows.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

E, H, D, B, T = 16, 2, 8, 2, 5
MODES: dict[str, Callable[[], Any]] = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _interleaved(x: torch.Tensor, proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head interleaved Q, K, V (``[heads, 3, head_dim]`` rows): Q of head h is rows ``h·3D + [0, D)``."""
    b, t, _ = x.shape
    q, k, v = proj(x).view(b, t, H, 3, D).permute(3, 0, 2, 1, 4)
    return q, k, v


def _interleaved_rows(part: int) -> list[int]:
    return [h * 3 * D + part * D + i for h in range(H) for i in range(D)]


def _expand(rows: list[list[int]] | None) -> list[int]:
    return [i for lo, hi in rows or [] for i in range(lo, hi)]


def _merge(out: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = out.shape
    return out.transpose(1, 2).reshape(b, t, E)


def _assert_interleaved(call: Any, param: str = "qkv.weight") -> None:
    for i, part in enumerate("qkv"):
        s = getattr(call.qkv, part)
        assert s.param == param, call.qkv.reason
        assert _expand(s.rows) == _interleaved_rows(i), (part, s.rows)


# -- side effects outside the module ----------------------------------------------------------------


class Effects(nn.Module):
    """Attention whose forward touches the world: a global counter, a print, a log line, a line in a file."""

    calls = 0

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        print("forward ran")
        logging.getLogger("qkvtrace.tests.effects").warning("forward ran")
        with self.path.open("a") as f:
            f.write("forward ran\n")
        return _merge(F.scaled_dot_product_attention(*_interleaved(x, self.qkv)))


@pytest.mark.parametrize("mode", list(MODES))
def test_side_effects_happen_once_per_call(mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Witness: the untraced run's counts of each side effect, and the rows by construction (per-head
    interleaved). A fresh module's first call under ``no_grad``/``inference_mode`` builds no graph; a tracer that
    ran its forward again to read the rows would count, print, log and write twice."""
    torch.manual_seed(0)
    x = torch.randn(B, T, E)

    def run(traced: bool) -> tuple[torch.Tensor, tuple[int, int, int, int], Any]:
        path = tmp_path / f"log-{traced}.txt"
        torch.manual_seed(1)
        model = Effects(path).eval()
        Effects.calls = 0
        capsys.readouterr()
        caplog.clear()
        with MODES[mode]():
            if traced:
                with qkvtrace.trace(model) as t:
                    out = model(x)
            else:
                out, t = model(x), None
        printed = capsys.readouterr().out.count("forward ran")
        logged = sum(1 for r in caplog.records if r.getMessage() == "forward ran")
        return out, (Effects.calls, printed, logged, path.read_text().count("forward ran")), t

    plain, plain_counts, _ = run(False)
    out, counts, t = run(True)
    assert plain_counts == (1, 1, 1, 1)
    assert counts == plain_counts
    assert torch.equal(out, plain)
    [call] = t.calls
    _assert_interleaved(call)


# -- state kept outside the module: a KV cache in a module-level dict ------------------------------------


_CACHES: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}


class GlobalCache(nn.Module):
    """Decoding with a KV cache kept in a module-level dict: each call appends its K and V, then attends over
    everything appended so far. A second run of the forward would append the step twice."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _interleaved(x, self.qkv)
        past = _CACHES.setdefault(self.key, [])
        past.append((k, v))
        keys = torch.cat([a for a, _ in past], dim=2)
        values = torch.cat([b for _, b in past], dim=2)
        return _merge(F.scaled_dot_product_attention(q, keys, values))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cache_kept_outside_the_module_gets_each_step_once(mode: str) -> None:
    """Witness: the untraced loop's outputs and cache (its length and contents after every step), and the rows
    by construction. Every step's call has its rows, read from its own functions (the first step's K and V are
    made from one step's keys, the later ones joined to the cache)."""
    torch.manual_seed(0)
    _CACHES.clear()
    model = GlobalCache("plain").eval()
    steps = [torch.randn(B, 1, E) for _ in range(5)]
    with MODES[mode]():
        plain = [model(s) for s in steps]
        model.key = "traced"
        with qkvtrace.trace(model) as t:
            traced = [model(s) for s in steps]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert len(_CACHES["traced"]) == len(_CACHES["plain"]) == len(steps)
    for (k1, v1), (k2, v2) in zip(_CACHES["plain"], _CACHES["traced"], strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert len(t.calls) == len(steps)
    for call in t.calls:
        _assert_interleaved(call)


# -- a lock held around the projections and the kernel --------------------------------------------------


class Locked(nn.Module):
    """Projections and kernel under a lock that is not re-entrant (a server's per-model lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            return _merge(F.scaled_dot_product_attention(*_interleaved(x, self.qkv)))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_lock_held_around_the_kernel_does_not_deadlock(mode: str) -> None:
    """Witness: the untraced output, and a thread that must end within 30 s (a forward run again inside the
    real kernel call would wait for the lock its own first run holds)."""
    torch.manual_seed(0)
    model, x = Locked().eval(), torch.randn(B, T, E)
    found: dict[str, Any] = {}

    def run(traced: bool) -> None:  # (in a thread of its own each, so both run with the same CPU threads)
        with MODES[mode]():
            if not traced:
                found["plain"] = model(x)
                return
            with qkvtrace.trace(model, threads="all") as t:
                found["out"] = model(x)
            found["trace"] = t

    for traced in (False, True):
        worker = threading.Thread(target=run, args=(traced,), daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the traced call is still waiting for the lock"
    assert torch.equal(found["out"], found["plain"])
    _assert_interleaved(found["trace"].calls[0])


# -- the path depends on the grad mode ---------------------------------------------------------------------


class GradDependent(nn.Module):
    """Separate projections when gradients are on; an inference-only fused projection (other weights) when off."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, H, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        else:
            q, k, v = _interleaved(x, self.qkv)
        return _merge(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_are_those_of_the_path_this_call_took(mode: str) -> None:
    """Witness: the construction. With gradients off the call reads the fused ``qkv`` (per-head interleaved);
    a forward run again with gradients on would take the other branch and name ``q``, ``k``, ``v``."""
    torch.manual_seed(0)
    model, x = GradDependent().eval(), torch.randn(B, T, E)
    with MODES[mode](), qkvtrace.trace(model) as t:
        model(x)
    _assert_interleaved(t.calls[0])


# -- the random state and hooks ------------------------------------------------------------------------


class Noisy(nn.Module):
    """Draws from the global generator in its forward (dropout in training, and noise of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _interleaved(F.dropout(x, 0.1, self.training) + 0.01 * torch.randn_like(x), self.qkv)
        return _merge(F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0))


@pytest.mark.parametrize("mode", list(MODES))
def test_the_random_state_and_hooks_see_one_run(mode: str) -> None:
    """Witness: the untraced run from the same seed: its output, the generator state after it, and its count of
    forward-hook calls on the projection (a hook of the user's)."""
    seen: list[int] = []
    results = []
    for traced in (False, True):
        torch.manual_seed(0)
        model = Noisy().train()
        handle = model.qkv.register_forward_hook(lambda *_, traced=traced: seen.append(traced))
        x = torch.randn(B, T, E)
        with MODES[mode]():
            if traced:
                with qkvtrace.trace(model) as t:
                    out = model(x)
            else:
                out = model(x)
        handle.remove()
        results.append((out, torch.get_rng_state()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert seen == [False, True]
    _assert_interleaved(t.calls[0])


# -- never raises into the user ------------------------------------------------------------------------------


class LazyAttention(nn.Module):
    """A projection whose weight is made on its first call (``nn.LazyLinear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.LazyLinear(3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _merge(F.scaled_dot_product_attention(*_interleaved(x, self.qkv)))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_lazy_projection_opens_and_gets_its_rows_once_it_exists(mode: str) -> None:
    """Witness: the untraced output of a copy built from the same seed, and the construction: the trace opens
    on the uninitialised module, and the first call -- which makes the weight before its projection runs --
    has the rows."""
    torch.manual_seed(0)
    x = torch.randn(B, T, E)
    torch.manual_seed(1)
    plain_model = LazyAttention().eval()
    with MODES[mode]():
        plain = plain_model(x)
    torch.manual_seed(1)
    model = LazyAttention().eval()
    with MODES[mode](), qkvtrace.trace(model) as t:
        out = model(x)
    assert torch.equal(out, plain)
    _assert_interleaved(t.calls[0])


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _merge(F.scaled_dot_product_attention(*_interleaved(x, self.qkv)))


def test_a_quantized_projection_says_why_it_has_no_rows() -> None:
    """Witness: PyTorch's own dynamic quantization (the projection becomes a module whose ``weight`` is a
    method, computed by ``quantized::linear_dynamic``): the untraced output, and a reason instead of rows."""
    quantization = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    try:
        model = quantization.quantize_dynamic(Quantized().eval(), {nn.Linear}, dtype=torch.qint8)
        x = torch.randn(B, T, E)
        with torch.no_grad():
            plain = model(x)
    except (RuntimeError, NotImplementedError) as exc:  # a build without a quantized engine
        pytest.skip(f"dynamic quantization does not run here: {exc}")
    with torch.no_grad(), qkvtrace.trace(model) as t:
        out = model(x)
    assert torch.equal(out, plain)
    [call] = t.calls
    assert call.qkv.layout is None and call.qkv.reason


def test_a_model_on_the_meta_device_traces_without_raising() -> None:
    """Witness: PyTorch's own meta tensors (shapes, no data): the call runs and is recorded as untraced it runs;
    rows are read or said unknown, never raised."""
    with torch.device("meta"):
        model = Quantized().eval()
        x = torch.empty(B, T, E)
    with torch.no_grad():
        plain = model(x)
        with qkvtrace.trace(model) as t:
            out = model(x)
    assert out.shape == plain.shape and out.device.type == "meta"
    [call] = t.calls
    assert call.qkv.layout is not None or call.qkv.reason


# -- memory: an input that views a large buffer ----------------------------------------------------------

_BIG = """
import resource, torch, torch.nn.functional as F, qkvtrace
from torch import nn
E, H, D = 16, 2, 8
class A(nn.Module):
    def __init__(self):
        super().__init__(); self.qkv = nn.Linear(E, 3 * E)
    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, H, 3, D).permute(3, 0, 2, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, E)
buffer = torch.ones(2**28)  # 1 GiB, every page touched
x = buffer[: 2 * 5 * E].view(2, 5, E)
model = A().eval()
with torch.no_grad():
    model(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad(), qkvtrace.trace(A().eval()) as t:
    t._model(x)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024, t.calls[0].qkv.q.param)
"""


def test_an_input_viewing_a_large_buffer_copies_nothing_of_it() -> None:
    """Witness: the kernel's accounting of the process's peak resident memory (``ru_maxrss``) around a traced
    first call under ``no_grad`` whose input is a small view of a 1 GiB buffer: it grows by far less than the
    buffer (copies of the arguments would copy the buffer whole), and the call has its rows."""
    done = subprocess.run([sys.executable, "-c", _BIG], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grown_mib, param = done.stdout.split()
    assert int(grown_mib) < 64, f"peak memory grew by {grown_mib} MiB"
    assert param == "qkv.weight"


# -- a collective in the forward, one rank traced ------------------------------------------------------------

_RANK = """
import json, sys, torch, torch.distributed as dist, torch.nn.functional as F, qkvtrace
from datetime import timedelta
from torch import nn
rank, traced, out = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
E, H, D = 16, 2, 8
class TensorParallel(nn.Module):
    # each rank holds half of the projection's input features; the partial products are summed across ranks
    def __init__(self):
        super().__init__(); self.qkv = nn.Linear(E // 2, 3 * E, bias=False)
    def forward(self, x):
        b, t, _ = x.shape
        part = self.qkv(x[..., rank * (E // 2):(rank + 1) * (E // 2)])
        dist.all_reduce(part)
        q, k, v = part.view(b, t, H, 3, D).permute(3, 0, 2, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)
torch.manual_seed(rank)
model = TensorParallel().eval()
torch.manual_seed(10)
x = torch.randn(2, 5, E)
with torch.no_grad():
    if traced and rank == 0:
        with qkvtrace.trace(model) as t:
            y = model(x)
        rows = t.calls[0].qkv.q.rows
    else:
        y, rows = model(x), None
json.dump({"out": y.flatten().tolist(), "rows": rows}, open(out, "w"))
dist.destroy_process_group()
"""


def _launch(tmp_path: Path, traced: bool) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    outs = [tmp_path / f"rank{r}-{traced}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), "1" if traced else "0", str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]  # fmt: skip
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("the two-rank job hung (a collective run again on one rank only waits for its pair)")
        assert p.returncode == 0, err[-3000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="this PyTorch has no torch.distributed with the gloo backend")  # fmt: skip
def test_a_collective_in_the_forward_with_one_rank_traced(tmp_path: Path) -> None:
    """Witness: the same two-rank job untraced: each rank's output. Rank 0 traces its first call under
    ``no_grad``; the forward's ``all_reduce`` must pair with rank 1's once, and the rows are by construction
    (per-head interleaved rows of rank 0's ``qkv``). A forward run again on one rank would hang until the
    collective's timeout or pair its second ``all_reduce`` with the other rank's next one."""
    plain = _launch(tmp_path, traced=False)
    traced = _launch(tmp_path, traced=True)
    assert [r["out"] for r in traced] == [r["out"] for r in plain]
    assert _expand(traced[0]["rows"]) == _interleaved_rows(0)


# -- a module that keeps state in its buffers ---------------------------------------------------------------------


class Counting(nn.Module):
    """Counts its calls in a buffer, in place, and picks its split order from the count (odd calls: K, Q, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        q, k, v = _interleaved(x, self.qkv)
        if int(self.seen) % 2:
            q, k = k, q
        return _merge(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("mode", list(MODES))
def test_state_the_forward_changes_in_place_changes_once(mode: str) -> None:
    """Witness: the untraced module's buffer after the same calls, its outputs, and the construction: odd calls
    hand K's rows over as Q. A forward run again would count twice, and read its order from the wrong count."""
    torch.manual_seed(0)
    x = torch.randn(B, T, E)
    plain_model = Counting().eval()
    model = Counting().eval()
    model.load_state_dict(plain_model.state_dict())
    with MODES[mode]():
        plain = [plain_model(x) for _ in range(3)]
        with qkvtrace.trace(model) as t:
            traced = [model(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert int(model.seen) == int(plain_model.seen) == 3
    for n, call in enumerate(t.calls, start=1):
        swapped = n % 2 == 1
        assert _expand(call.qkv.q.rows) == _interleaved_rows(1 if swapped else 0), (n, call.qkv.reason)
        assert _expand(call.qkv.k.rows) == _interleaved_rows(0 if swapped else 1), n


class OwnFunction(nn.Module):
    """Q goes through a function of the model's own on its way to the kernel (a custom autograd Function)."""

    class Scale(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            OwnFunction.Scale.calls += 1
            return t * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _interleaved(x, self.qkv)
        return _merge(F.scaled_dot_product_attention(self.Scale.apply(q), k, v))


def test_a_function_of_the_models_own_on_the_way_is_not_run_again() -> None:
    """Witness: the function's own count of its runs (one per call, as untraced), and the untraced output. Q
    came out of the model's own function: its rows are what the call's functions give, or ``None`` with a
    reason -- never a run of that function."""
    torch.manual_seed(0)
    model, x = OwnFunction().eval(), torch.randn(B, T, E)
    with torch.no_grad():
        plain = model(x)
        OwnFunction.Scale.calls = 0
        with qkvtrace.trace(model) as t:
            out = model(x)
    assert OwnFunction.Scale.calls == 1
    assert torch.equal(out, plain)
    q = t.calls[0].qkv.q
    assert q.rows is None or _expand(q.rows) == _interleaved_rows(0)
    if q.rows is None:
        assert t.calls[0].qkv.reason


def test_no_module_of_the_model_runs_again_while_its_rows_are_read() -> None:
    """Witness: a counter in every module's forward pre-hook, registered by the test (one pre-hook call per
    module call untraced): the traced first call under ``inference_mode`` of a two-layer model makes exactly as
    many module calls, and each layer's rows are by construction."""
    torch.manual_seed(0)
    model = nn.Sequential(Quantized(), Quantized()).eval()
    x = torch.randn(B, T, E)
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        m.register_forward_pre_hook(lambda *_, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
    with torch.inference_mode():
        model(x)
        plain = dict(counts)
        counts.clear()
        with qkvtrace.trace(model) as t:
            model(x)
    assert counts == plain
    for call in t.calls:
        _assert_interleaved(call)



# -- two kernel calls in one forward; one projection used twice for one part ------------------------------------


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_differential_attention_gives_each_call_its_own_half_of_v(mode: str) -> None:
    """Witness: transformers' DiffLlama, read from its config: each layer calls its kernel twice in one forward,
    with V of the first half of ``v_proj``'s heads, then of the second (``torch.chunk`` over KV heads, each half
    repeated), the two V of the very same shape and strides. Rows by construction: half ``i`` is rows
    ``[i·R, (i+1)·R)``, ``R = kv_heads/2 · head_dim``; outputs equal an untraced run's."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DiffLlamaConfig"):
        pytest.skip("this transformers has no DiffLlama")
    config = transformers.DiffLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(config).train(mode == "train")
    ids = torch.randint(0, 64, (1, 6))
    ctx = {"train": torch.enable_grad, **MODES}[mode]
    with ctx():
        torch.manual_seed(1)
        plain = model(ids).logits
        torch.manual_seed(1)
        with qkvtrace.trace(model) as t:
            out = model(ids).logits
    assert torch.equal(out, plain)
    half = config.num_key_value_heads // 2 * (config.hidden_size // config.num_attention_heads)
    assert len(t.calls) == 2
    for i, call in enumerate(t.calls):
        assert call.qkv.v.param == "v_proj.weight", call.qkv.reason
        assert _expand(call.qkv.v.rows) == list(range(i * half, (i + 1) * half)), (i, call.qkv.v.rows)


class SelfAndEncoder(nn.Module):
    """A decoder's attention over its own states and the encoder's in one call: K and V are one projection
    applied to both, joined along the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, -1, H, D).transpose(1, 2)

        k = torch.cat([heads(self.k(x)), heads(self.k(memory))], dim=2)
        v = torch.cat([heads(self.v(x)), heads(self.v(memory))], dim=2)
        return _merge(F.scaled_dot_product_attention(heads(self.q(x)), k, v))


def test_a_projection_used_twice_for_one_part_is_named_once() -> None:
    """Witness: the real ``.grad`` of ``k.weight`` and ``v.weight`` after the backward pass, read in the test: the
    gradient record's K and V norms are theirs (a weight named once per use would count its gradient twice:
    about 1.4 times the norm), and K is every row of ``k.weight``, once."""
    torch.manual_seed(0)
    model = SelfAndEncoder()
    x, memory = torch.randn(B, T, E), torch.randn(B, 7, E)
    with qkvtrace.trace(model) as t:
        model(x, memory).square().sum().backward()
    [call] = t.calls
    assert (call.qkv.k.param, call.qkv.k.rows, call.qkv.k.also) == ("k.weight", [[0, E]], None)
    [grad] = t.gradients
    for part in "kv":
        weight = getattr(model, part).weight
        assert getattr(grad, part).grad_norm == pytest.approx(float(torch.linalg.vector_norm(weight.grad)), rel=1e-6)


class CompilesInside(nn.Module):
    """A watched module whose forward uses ``torch.compile`` on a function of its own after its projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _interleaved(x, self.qkv)
        q = torch.compile(lambda t: t * 1.0, backend="eager")(q)
        return _merge(F.scaled_dot_product_attention(q, k, v))


def test_torch_compile_during_a_watched_call_leaves_no_mode_behind() -> None:
    """Witness: PyTorch's own record of the active function mode (``torch.overrides``) and its own lists of the
    module's hooks, after the trace: Dynamo starting during a watched call stops the watching, and the call's
    leaving hook still turns the mode off and takes the hooks away (left on, the mode would refuse every later
    MultiheadAttention fast path in the process)."""
    torch.manual_seed(0)
    model = CompilesInside().eval()
    x = torch.randn(B, T, E)
    with torch.no_grad():
        plain = model(x)
        torch._dynamo.reset()
        with qkvtrace.trace(model):
            out = model(x)
    assert torch.equal(out, plain)
    assert torch.overrides._get_current_function_mode() is None  # type: ignore[attr-defined]
    assert len(model._forward_pre_hooks) + len(model._forward_hooks) == 0
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.inference_mode(), qkvtrace.trace(mha) as t:
        mha(x, x, x, need_weights=False)
    assert t.calls[0].path == "fast"
    torch._dynamo.reset()
