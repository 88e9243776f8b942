"""Long runs: ``trace(model, keep="changes")`` reports when attention changed, in bounded memory.

Witnesses: the steps at which the test itself changes the mask and the mode
(by construction), the path PyTorch takes in each mode (the profiler of one
untraced call), ``tracemalloc`` for memory, a process killed by the test,
and TensorBoard's own reader for the event file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

import qkvtrace

E, H, B, L = 16, 4, 2, 6
CALLS_PER_STEP = 20


def _attention_ops(module: nn.Module, x: torch.Tensor, **kwargs: object) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(x, x, x, need_weights=False, **kwargs)
    return sorted({e.name for e in prof.events() if "attention" in e.name})


@pytest.mark.parametrize(
    "steps",
    [pytest.param(50, id="1000-calls"), pytest.param(1000, id="20000-calls", marks=pytest.mark.slow)],
)
def test_a_long_run_reports_exactly_the_steps_where_attention_changed(tmp_path: Path, steps: int) -> None:
    """A padding mask from 30 % of the run, eval + no_grad from 70 % (set by the test); 20 calls a step.

    The run keeps records of the first call and of those two changes only,
    in at most 2 MB (tracemalloc), and every call is counted.
    """
    STEPS, MASK_AT, EVAL_AT = steps, steps * 3 // 10, steps * 7 // 10
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[:, -2:] = True
    mha.eval()
    with torch.no_grad():
        eval_ops = _attention_ops(mha, x, key_padding_mask=pad)
    mha.train()
    train_ops = _attention_ops(mha, x, key_padding_mask=pad)
    assert "aten::_native_multi_head_attention" in eval_ops and "aten::_native_multi_head_attention" not in train_ops
    stream = tmp_path / "run.jsonl"
    with qkvtrace.trace(mha, keep="changes", stream_to=stream) as t:
        tracemalloc.start()
        try:
            for step in range(STEPS):
                mha.train(step < EVAL_AT)
                with torch.set_grad_enabled(step < EVAL_AT):
                    for _ in range(CALLS_PER_STEP):
                        mha(x, x, x, need_weights=False, key_padding_mask=pad if step >= MASK_AT else None)
                t.step()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert held <= 2 * 2**20, f"{held / 2**20:.2f} MB held after {STEPS * CALLS_PER_STEP} calls"
    assert [(e.kind, e.step, e.call) for e in t.changes] == [
        ("first", 0, 0),
        ("change", MASK_AT, MASK_AT * CALLS_PER_STEP),
        ("change", EVAL_AT, EVAL_AT * CALLS_PER_STEP),
    ]
    assert len(t.calls) == 3
    mask_change, eval_change = t.changes[1:]
    assert mask_change.was["key_padding_mask"] is None and mask_change.became["key_padding_mask"] is not None
    assert eval_change.became["path"] == "fast" and eval_change.became["training"] is False
    counts = {(c["combo"]["path"], c["calls"]) for c in t.summary()["modules"][""]["combinations"]}
    assert counts == {("fallback", MASK_AT * CALLS_PER_STEP), ("fallback", (EVAL_AT - MASK_AT) * CALLS_PER_STEP),
                      ("fast", (STEPS - EVAL_AT) * CALLS_PER_STEP)}  # fmt: skip
    lines = [json.loads(x) for x in stream.read_text().splitlines()]
    assert [ln["kind"] for ln in lines if ln["kind"] in ("start", "end")] == ["start", "end"]
    assert sum(ln["calls"] for ln in lines if ln["kind"] == "step") == STEPS * CALLS_PER_STEP


def test_a_killed_run_leaves_a_stream_summarize_reads(tmp_path: Path) -> None:
    """A process killed by SIGKILL at step 40 (the test's own script): its stream is read back with the change."""
    stream = tmp_path / "killed.jsonl"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, torch, qkvtrace
        from torch import nn
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 4, batch_first=True)
        x = torch.randn(2, 6, 16)
        with qkvtrace.trace(mha, keep="changes", stream_to={str(stream)!r}) as t:
            for step in range(100):
                mha.train(step < 25)
                with torch.set_grad_enabled(step < 25):
                    mha(x, x, x, need_weights=False)
                t.step()
                if step == 40:
                    os.kill(os.getpid(), signal.SIGKILL)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert run.returncode < 0  # killed, not ended
    out = subprocess.run([sys.executable, "-m", "qkvtrace", "summarize", str(stream)], capture_output=True, text=True,
                         env={"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "did not end" in out.stdout
    assert "1 change(s)" in out.stdout
    row = next(line for line in out.stdout.splitlines() if "path: fallback → fast" in line)
    assert row.split("│")[1].strip() == "25"


def test_summarize_refuses_what_is_not_a_stream(tmp_path: Path) -> None:
    """A file that is not a stream, and a missing one: exit 2 with one line naming it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "qkvtrace.trace/1"}\nnot json\n{}\n')
    for path in (bad, tmp_path / "missing.jsonl"):
        out = subprocess.run([sys.executable, "-m", "qkvtrace", "summarize", str(path)], capture_output=True, text=True)
        assert out.returncode == 2 and path.name in out.stderr and "Traceback" not in out.stderr


def test_tensorboard_gets_the_scalars(tmp_path: Path) -> None:
    """The event file, read back by TensorBoard's own reader: backend shares and changes per step.

    Witness: steps 0-4 train (MHA fallback with SDPA; 3 calls a step), 5-9
    eval + no_grad (fast path, no SDPA kernel), set by the test.
    """
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    writer = SummaryWriter(str(tmp_path / "tb"))
    with qkvtrace.trace(mha, keep="changes", tensorboard=writer) as t:
        for step in range(10):
            mha.train(step < 5)
            with torch.set_grad_enabled(step < 5):
                for _ in range(3):
                    mha(x, x, x, need_weights=False)
            t.step()
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    none_share = {e.step: e.value for e in events.Scalars("qkvtrace/backend_share/none")}
    changes = {e.step: e.value for e in events.Scalars("qkvtrace/changes")}
    assert none_share == {s: 1.0 for s in range(5, 10)}
    assert changes == {s: (1.0 if s == 5 else 0.0) for s in range(10)}


def test_keep_all_refuses_stream_options() -> None:
    """``stream_to`` without ``keep="changes"`` is a usage error (ValueError), and ``step()`` needs it too."""
    with pytest.raises(ValueError, match="keep='changes'"):
        qkvtrace.trace(nn.Linear(1, 1), stream_to="x.jsonl")
    with qkvtrace.trace(nn.Linear(1, 1)) as t, pytest.raises(RuntimeError, match="keep='changes'"):
        t.step()
