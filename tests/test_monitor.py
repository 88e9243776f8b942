"""Long runs: ``trace(model, keep="changes")`` reports when attention changed, in bounded memory.

Witnesses: the steps at which the test itself changes the mask and the mode
(by construction), the path PyTorch takes in each mode (the profiler of one
untraced call), ``tracemalloc`` for memory, a process killed by the test,
and TensorBoard's own reader for the event file.
"""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import textwrap
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

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
        with qkvtrace.trace(mha, keep="changes", stream_to=folder / f"run.rank{rank}.jsonl") as t:
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


# -- the stream, the scalars and the summary, line by line -----------------------------------------


class _BareSDPA(nn.Module):
    """SDPA on the Q, K, V it is given: the output the test gets is the kernel's own."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _Scalars:
    """A writer with TensorBoard's ``add_scalar``/``flush`` that keeps what it was given, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, float, int]] = []
        self.flushes = 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.got.append((tag, float(value), step))

    def flush(self) -> None:
        self.flushes += 1


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_stream_scalars_and_summary_of_a_run_written_by_hand(tmp_path: Path) -> None:
    """Three steps set by the test: two MATH calls; then one FLASH call, one masked MATH call, one MATH call
    on a query holding a NaN; an empty step; then step 10 (numbered by the test) with one more MATH call.
    ``max_records=3`` keeps the first and two changes and drops the third.

    Witness: the backends forced by ``sdpa_kernel``, the mask built here (row 0 of ``[T, T]`` blocked, so
    ``B * H`` kernel rows), the NaNs counted here in the output PyTorch returned, and the steps, calls and
    changes of the construction. Catches wrong or missing step lines, backend counts and shares, change
    counts, event fields, records written before they are read back, unsorted keys, flushing, the record
    cap, step numbering, the NaN and fully-masked sums and the summary's combinations with their steps and
    calls."""
    b, h, t_len, d = 2, 3, 4, 8
    q = torch.randn(b, h, t_len, d)
    nan_q = q.clone()
    nan_q[0, 1, 2, 0] = float("nan")
    mask = torch.ones(t_len, t_len, dtype=torch.bool)
    mask[0] = False  # query row 0 sees no key
    model, scalars, stream = _BareSDPA(), _Scalars(), tmp_path / "run.jsonl"
    with qkvtrace.trace(model, keep="changes", stream_to=stream, tensorboard=scalars, max_records=3) as t:
        with sdpa_kernel(SDPBackend.MATH):
            model(q, q, q)
            model(q, q, q)
        assert t.step() == 1
        written = _lines(stream)  # flushed at the step: readable while the run goes on
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(q, q, q)
        with sdpa_kernel(SDPBackend.MATH):
            model(q, q, q, mask)
            nans = int(torch.isnan(model(nan_q, q, q)).sum())
        assert nans > 0
        assert t.step() == 2
        assert t.step(10) == 10  # step 2 had no call
        with sdpa_kernel(SDPBackend.MATH):
            model(q, q, q)
    assert [ln["kind"] for ln in written] == ["start", "first", "step"]
    lines = _lines(stream)
    assert all(ln["schema"] == "qkvtrace.stream/1" for ln in lines)
    assert all(list(ln) == sorted(ln) for ln in lines)  # keys in sorted order: lines that diff line by line
    assert lines[0] == {"schema": "qkvtrace.stream/1", "kind": "start", "torch_version": str(torch.__version__)}
    steps = [{k: ln[k] for k in ("step", "calls", "backends", "changes")} for ln in lines if ln["kind"] == "step"]
    assert steps == [
        {"step": 0, "calls": 2, "backends": {"MATH": 2}, "changes": 0},
        {"step": 1, "calls": 3, "backends": {"FLASH_ATTENTION": 1, "MATH": 2}, "changes": 3},
        {"step": 10, "calls": 1, "backends": {"MATH": 1}, "changes": 0},
    ]
    events = [ln for ln in lines if ln["kind"] in ("first", "change")]
    assert [(e["kind"], e["step"], e["module"], e["call"]) for e in events] == [
        ("first", 0, "", 0), ("change", 1, "", 2), ("change", 1, "", 3), ("change", 1, "", 4),
    ]  # fmt: skip
    assert [e["record"] is not None for e in events] == [True, True, True, False]  # max_records=3
    assert [e["record"]["index"] for e in events[:3]] == [0, 2, 3]  # type: ignore[index]
    assert events[2]["record"]["output"]["fully_masked_rows"] == b * h  # type: ignore[index]  # read back, a number
    first = events[0]["became"]
    assert events[0]["was"] is None
    assert first["sdpa_backend"] == "MATH" and first["dtype"] == str(torch.float32)
    assert first["attn_mask"] is None and first["training"] is True and first["error"] is False
    for before, after in itertools.pairwise(events):
        assert after["was"] == before["became"]  # each change starts from the combination before it
    changed = [{k for k in e["became"] if e["became"][k] != e["was"][k]} for e in events[1:]]
    assert changed == [{"sdpa_backend"}, {"sdpa_backend", "attn_mask"}, {"attn_mask"}]
    masked = events[2]["became"]["attn_mask"]  # the record's kind of mask, then the mask's dtype
    assert masked == f"{events[2]['record']['inputs']['attn_mask']['kind']} {torch.bool}"  # type: ignore[index]
    assert [(e.kind, e.step, e.call) for e in t.changes] == [("first", 0, 0), ("change", 1, 2), ("change", 1, 3)]
    assert [c.index for c in t.calls] == [0, 2, 3]
    summary = t.summary()
    assert lines[-1] == {"schema": "qkvtrace.stream/1", "kind": "end", "summary": json.loads(json.dumps(summary))}
    assert summary["steps"] == 10 and summary["dropped_records"] == 1
    # one meaning of "changes": every change of the run, the dropped one too (the steps' counts add up to it)
    assert summary["changes"] == sum(st["changes"] for st in steps) == 3
    module = summary["modules"][""]
    assert (module["nan_count"], module["fully_masked_rows"]) == (nans, b * h)
    seen = [(c["combo"]["sdpa_backend"], c["combo"]["attn_mask"] is None, c["calls"], c["first_step"],
             c["last_step"]) for c in module["combinations"]]  # fmt: skip
    assert seen == [("MATH", True, 4, 0, 10), ("FLASH_ATTENTION", True, 1, 1, 1), ("MATH", False, 1, 1, 1)]
    assert scalars.got == [
        ("qkvtrace/backend_share/MATH", 1.0, 0), ("qkvtrace/changes", 0.0, 0), ("qkvtrace/nan_outputs", 0.0, 0),
        ("qkvtrace/backend_share/FLASH_ATTENTION", 1 / 3, 1), ("qkvtrace/backend_share/MATH", 2 / 3, 1),
        ("qkvtrace/changes", 3.0, 1), ("qkvtrace/nan_outputs", float(nans), 1),
        ("qkvtrace/backend_share/MATH", 1.0, 10), ("qkvtrace/changes", 0.0, 10),
        ("qkvtrace/nan_outputs", float(nans), 10),
    ]  # fmt: skip
    assert scalars.flushes == 1


def test_a_long_step_sums_its_counts_and_an_error_is_a_combination() -> None:
    """300 calls in one step (more than are kept on the device before they are summed), each on a query with
    one NaN row, then a call PyTorch refuses (head sizes that differ). ``max_records`` below 0 is refused.

    Witness: the NaNs counted here in each output PyTorch returned, the ``RuntimeError`` PyTorch raised, and
    the construction's counts. Catches counts lost when a step's device-side counts are folded early, a
    refused call not told apart from a good one, and a wrong count of changes in the summary."""
    with pytest.raises(ValueError, match="max_records"):
        qkvtrace.trace(_BareSDPA(), keep="changes", max_records=-1)
    q = torch.randn(1, 2, 4, 8)
    q[0, 0, 1] = float("nan")
    model = _BareSDPA()
    with sdpa_kernel(SDPBackend.MATH), qkvtrace.trace(model, keep="changes") as t:
        nans = sum(int(torch.isnan(model(q, q, q)).sum()) for _ in range(300))
        t.step()
        nans += sum(int(torch.isnan(model(q, q, q)).sum()) for _ in range(2))  # two counts to fold at the step
        t.step()
        with pytest.raises(RuntimeError):
            model(q, q, torch.randn(1, 2, 4, 8)[..., :5].contiguous().transpose(-1, -2))
        nans += int(torch.isnan(model(q, q, q)).sum())  # back to the first combination: a second change
    assert nans > 0
    assert t.monitor is not None and t.monitor.stream_path is None  # nothing streamed
    summary = t.summary()
    module = summary["modules"][""]
    assert module["nan_count"] == nans
    assert [(c["combo"]["error"], c["calls"]) for c in module["combinations"]] == [(False, 303), (True, 1)]
    assert summary["changes"] == 2 and summary["dropped_records"] == 0  # two changes, one first
    assert [(e.kind, e.call, e.became["error"]) for e in t.changes] == [
        ("first", 0, False), ("change", 302, True), ("change", 303, False),
    ]  # fmt: skip
    with qkvtrace.trace(model, keep="changes", max_records=0) as t:  # 0: count only, keep no record
        model(q, q, q)
        model(q, q, q, torch.ones(4, 4, dtype=torch.bool))  # a change: a second record not kept
    assert (t.calls, t.changes, t.summary()["dropped_records"]) == ([], [], 2)


def test_a_rank_streams_to_its_own_file_and_says_so(tmp_path: Path) -> None:
    """Rank 1 of a job of 2 (PyTorch's own fake process group, this process being rank 1): ``run.jsonl`` becomes
    ``run.rank1.jsonl`` and the start line names the rank and the world size.

    Witness: the rank and world size given to ``torch.distributed.init_process_group`` here, and the file
    name rule of docs/long-runs.md (``.rankN`` before the suffix). Catches the rank or world size not handed
    on, or missing from the start line."""
    dist = pytest.importorskip("torch.distributed")
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group(backend="fake", rank=1, world_size=2, store=fake.FakeStore())
    try:
        mha = nn.MultiheadAttention(E, H, batch_first=True)
        x = torch.randn(B, L, E)
        with qkvtrace.trace(mha, keep="changes", stream_to=tmp_path / "run.jsonl") as t:
            mha(x, x, x)
    finally:
        dist.destroy_process_group()
    assert t.monitor is not None and t.monitor.stream_path == tmp_path / "run.rank1.jsonl"
    assert not (tmp_path / "run.jsonl").exists()
    start = _lines(tmp_path / "run.rank1.jsonl")[0]
    assert (start["kind"], start["rank"], start["world_size"]) == ("start", 1, 2)


def test_a_long_run_with_attention_maps_streams_its_records(tmp_path: Path) -> None:
    """``keep="changes"`` with ``attention_maps=True``: the record of the first call, which holds the map's
    tensors, still goes to the stream.

    Witness: the one call the test makes (index 0, the first of its combination). Catches a stream line that
    cannot be written when a record holds a value JSON has no type for."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    stream = tmp_path / "run.jsonl"
    with qkvtrace.trace(mha, keep="changes", stream_to=stream, attention_maps=True):
        mha(x, x, x)
    [first] = [ln for ln in _lines(stream) if ln["kind"] == "first"]
    assert first["record"]["index"] == 0  # type: ignore[index]
    # the record as a trace file has it: no map tensors written as their Python repr
    assert "map_tensors" not in first["record"], first["record"].get("map_tensors")  # type: ignore[union-attr]


def test_a_mask_object_is_named_by_its_type() -> None:
    """A mask that is an object of its own (PyTorch's ``CausalBias``, which has no dtype of a tensor mask): its
    combination names its type and nothing after it.

    Witness: the type of the bias PyTorch's ``causal_lower_right`` returns. Catches a made-up dtype put
    after the kind."""
    bias_module = pytest.importorskip("torch.nn.attention.bias")
    q = torch.randn(1, 2, 4, 8)
    bias = bias_module.causal_lower_right(4, 4)
    model = _BareSDPA()
    with qkvtrace.trace(model, keep="changes") as t:
        model(q, q, q, bias)
    [first] = t.changes
    assert first.became["attn_mask"] == type(bias).__name__


def test_a_long_run_with_maps_keeps_the_records_of_firsts_and_changes_only() -> None:
    """``keep="changes"`` with ``attention_maps=True`` (every call then builds its record and its map): seven
    calls, the last three with a padding mask. Only the first call and the change keep their records, each
    with its map; the five others are counted.

    Witness: the calls the test makes and the one change it makes (the mask given from the fifth call on),
    tallied here. Catches a call that changes nothing kept anyway, and with it a map per call."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[:, -1] = True
    made: Counter[bool] = Counter()
    with qkvtrace.trace(mha, keep="changes", attention_maps=True) as t:
        for i in range(7):
            masked = i >= 4
            mha(x, x, x, key_padding_mask=pad if masked else None)
            made[masked] += 1
    assert [c.index for c in t.calls] == [0, 4]
    assert all(c.attention_map is not None for c in t.calls)
    calls = [c["calls"] for c in t.summary()["modules"][""]["combinations"]]
    assert calls == [made[False], made[True]] == [4, 3]
