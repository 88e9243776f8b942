"""Long runs: ``trace(model, keep="changes")`` reports when attention changed, in bounded memory.

Witnesses: the steps at which the test itself changes the mask and the mode
(by construction), the path PyTorch takes in each mode (the profiler of one
untraced call), ``tracemalloc`` for memory, a process killed by the test,
and TensorBoard's own reader for the event file.
"""

from __future__ import annotations

import gc
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


def _live_storages() -> int:
    """How many distinct tensor storages the Python objects alive now hold (tracemalloc does not see them)."""
    gc.collect()
    found = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                found.add(o.untyped_storage().data_ptr())
            except RuntimeError:  # a fake tensor an earlier compiled test left alive holds no storage
                continue
    return len(found)


def test_a_long_run_reports_exactly_the_steps_where_attention_changed(tmp_path: Path) -> None:
    """20,000 calls (1,000 steps of 20): a padding mask from 30 % of the run, eval + no_grad from 70 % (set by
    the test); every training step runs backward and an SGD step with momentum, so the weights move 700 times.

    The run keeps records of the first call and of those two changes only, in at most 2 MB (tracemalloc), with
    as many live tensor storages at the end of each combination's steps as at their start, and every call is
    counted.

    Witness: the steps and call counts set by the test, the path of each mode from torch.profiler on one
    untraced call, tracemalloc for the Python memory held, and the storages of the tensor objects that
    ``gc`` finds alive, counted here (a norm cache that grew with each optimizer step held 6 more a step).
    """
    STEPS, MASK_AT, EVAL_AT = 1000, 300, 700
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    optimizer = torch.optim.SGD(mha.parameters(), lr=1e-3, momentum=0.9)
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
    storages: list[int] = []
    versions = mha.in_proj_weight._version
    with qkvtrace.trace(mha, keep="changes", stream_to=stream) as t:
        tracemalloc.start()
        try:
            for step in range(STEPS):
                mha.train(step < EVAL_AT)
                with torch.set_grad_enabled(step < EVAL_AT):
                    mask = pad if step >= MASK_AT else None
                    outs = [mha(x, x, x, need_weights=False, key_padding_mask=mask)[0] for _ in range(CALLS_PER_STEP)]
                if step < EVAL_AT:
                    torch.stack(outs).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                del outs
                t.step()
                if step in (0, MASK_AT - 1, MASK_AT, STEPS - 1):  # the mask's combination adds its counters
                    storages.append(_live_storages())
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert mha.in_proj_weight._version - versions >= EVAL_AT  # the optimizer did move the weights every step
    grown = storages[1] - storages[0], storages[3] - storages[2]  # 299 and 399 optimizer steps apart
    assert grown == (0, 0), f"{grown} more tensor storages alive at the end of each combination's steps"
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
    """A process killed by SIGKILL at step 40 (the test's own script): its stream is read back with the change.

    Witness: the script written here, which switches to eval at step 25 and kills itself at step 40.
    """
    stream = tmp_path / "killed.jsonl"
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
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
    """)
    )
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
    """A file that is not a stream, and a missing one: exit 2 with one line naming it.

    Witness: the file the test wrote (not a stream) and a path it never created.
    """
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
    """``stream_to`` without ``keep="changes"`` is a usage error (ValueError), and ``step()`` needs it too.

    Witness: the calls the test makes, built without ``keep="changes"``.
    """
    with pytest.raises(ValueError, match="keep='changes'"):
        qkvtrace.trace(nn.Linear(1, 1), stream_to="x.jsonl")
    with qkvtrace.trace(nn.Linear(1, 1)) as t, pytest.raises(RuntimeError, match="keep='changes'"):
        t.step()


# -- the ranks of a job: per-rank streams merged ---------------------------------------------------


def _rank_streams(folder: Path, eval_from: dict[int, int], steps: int = 4) -> None:
    """Two ranks' long runs, streamed to ``run.rank{R}.jsonl``; rank R switches to eval + no_grad at its step."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    for rank, switch in eval_from.items():
        with qkvtrace.trace(
            mha, keep="changes", stream_to=folder / f"run.rank{rank}.jsonl"
        ) as t:
            for step in range(steps):
                mha.train(step < switch)
                with torch.set_grad_enabled(mha.training):
                    mha(x, x, x, need_weights=False)
                t.step()


def _merge(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", "merge", *map(str, args)], capture_output=True,
                          text=True, env={"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip


def test_merge_flags_the_rank_that_changed_alone(tmp_path: Path) -> None:
    """Rank 1 switches to eval at step 2, rank 0 never (set by the test): exactly that change, on rank 1 only.

    Witness: the steps chosen here, and the path PyTorch takes in eval (its
    profiler on one untraced call: the fused fast-path kernel, no SDPA).
    """
    _rank_streams(tmp_path, {0: 99, 1: 2})
    out = _merge(tmp_path, "--json", tmp_path / "merged.json")
    assert out.returncode == 1, out.stdout + out.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["schema"] == "qkvtrace.streammerge/1" and merged["agree"] is False
    [change] = merged["changes"]
    assert (change["step"], change["ranks"], change["differs"]) == (2, [1], True)
    assert (change["was"]["training"], change["became"]["training"]) == (True, False)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in _attention_ops(mha, torch.randn(B, L, E))
    assert change["became"]["path"] == "fast"
    [odd] = [c for c in merged["combinations"] if c["differs"]]  # eval ran on rank 1 only, at steps 2 and 3
    assert [(r["rank"], r["calls"], r["first_step"], r["last_step"]) for r in odd["ranks"]] == [(1, 2, 2, 3)]
    row = next(line for line in out.stdout.splitlines() if "path: fallback → fast" in line)
    assert [c.strip() for c in row.split("│")[1:5:3]] == ["2", "1 (not 0)"]
    assert "ranks disagree on 1 change and 1 combination" in out.stdout


def test_merge_of_ranks_that_changed_together_agrees(tmp_path: Path) -> None:
    """Both ranks switch to eval at step 1 (set by the test): one change, made by both; exit 0.

    Witness: the two rank streams written here, each switched to eval at step 1 by the test.
    """
    _rank_streams(tmp_path, {0: 1, 1: 1})
    out = _merge(tmp_path / "run.rank0.jsonl", tmp_path / "run.rank1.jsonl", "--json", tmp_path / "m.json")
    assert out.returncode == 0, out.stdout + out.stderr
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [(c["step"], c["ranks"], c["differs"]) for c in merged["changes"]] == [(1, [0, 1], False)]
    assert "every rank ran the same kernels and changed at the same steps" in out.stdout


def test_merge_refuses_traces_and_streams_together(tmp_path: Path) -> None:
    """A trace file beside a stream, and two streams of one rank: exit 2, one line, no traceback.

    Witness: the files the test wrote (a trace file, and a copy of rank 0's stream under a second name).
    """
    _rank_streams(tmp_path, {0: 1})
    (tmp_path / "trace.rank1.json").write_text("{}")
    out = _merge(tmp_path / "run.rank0.jsonl", tmp_path / "trace.rank1.json")
    assert out.returncode == 2 and "not both" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "again.rank0.jsonl").write_bytes((tmp_path / "run.rank0.jsonl").read_bytes())
    out = _merge(tmp_path / "run.rank0.jsonl", tmp_path / "again.rank0.jsonl")
    assert out.returncode == 2 and "both rank 0" in out.stderr


def test_rank_placeholder_names_the_stream(tmp_path: Path) -> None:
    """``stream_to`` holding ``{rank}`` is filled in (rank 0 outside torch.distributed); the file is where it says.

    Witness: the path the test chose, with rank 0 put in by the test, and the file read back from there.
    """
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha, keep="changes", stream_to=tmp_path / "r{rank}.jsonl") as t:
        mha(x, x, x)
    assert t.monitor is not None and t.monitor.stream_path == tmp_path / "r0.jsonl"
    assert json.loads((tmp_path / "r0.jsonl").read_text().splitlines()[0])["kind"] == "start"
