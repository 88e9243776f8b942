"""``qkvtrace merge``: per-rank traces combined, ranks that disagree flagged (exit 1), bad input refused (exit 2).

The per-rank files here are real traces of real models made in this
process, saved under per-rank names; the traces a real two-process job
writes are merged in tests/test_distributed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qkvtrace
from qkvtrace.cli.main import main
from qkvtrace.records.distributed import load_rank_traces, merge_traces, save_per_rank
from qkvtrace.records.validation import load_json

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def _mha() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 2, batch_first=True)


def _trace(train: bool, calls: int = 1) -> qkvtrace.Trace:
    """One rank's step: the same MHA, in inference (fast path) or in training (PyTorch refuses it)."""
    m = _mha().train(train)
    x = torch.randn(2, 5, 16)
    with torch.set_grad_enabled(train), qkvtrace.trace(m) as t:
        for _ in range(calls):
            m(x, x, x, need_weights=False)
    return t


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # table rows on one line each


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["merge", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> list[list[str]]:
    """The cells of each row of the table `qkvtrace merge` prints."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines() if line.startswith("│")
    ]


def why(call: qkvtrace.AttentionCall) -> str:
    return call.why_not_fast_path or "(fast path taken)"


@pytest.fixture
def agreeing(tmp_path: Path) -> Path:
    folder = tmp_path / "agree"
    folder.mkdir()
    t = _trace(train=False)
    for rank in (0, 1):
        t.save(folder / f"trace.rank{rank}.json")
    return folder


@pytest.fixture
def disagreeing(tmp_path: Path) -> tuple[Path, qkvtrace.Trace, qkvtrace.Trace]:
    """Rank 1 trains while rank 0 runs inference: rank 1 falls off the fast path."""
    folder = tmp_path / "disagree"
    folder.mkdir()
    t0, t1 = _trace(train=False), _trace(train=True)
    t0.save(folder / "trace.rank0.json")
    t1.save(folder / "trace.rank1.json")
    return folder, t0, t1


def test_agreeing_ranks_exit_0(agreeing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the two identical rank files the test wrote, read back with ``json``."""
    out_file = tmp_path / "merged.json"
    code, out, err = run(capsys, agreeing, "--json", out_file)
    assert (code, err) == (0, "")
    assert "2 ranks (0-1) of world size" not in out  # traced outside torch.distributed: no world size
    assert "2 ranks (0-1) (no world size: traced outside torch.distributed) · 1 call each · 1 lined up" in out
    assert "every rank made the same calls the same way" in out
    merged = load_json(out_file, "qkvtrace.merge/1")
    assert merged["agree"] is True and merged["disagreements"] == []
    assert [r["file"] for r in merged["ranks"]] == ["trace.rank0.json", "trace.rank1.json"]
    assert merged["ranks"][0]["trace"] == json.loads((agreeing / "trace.rank0.json").read_text())


def test_a_rank_off_the_fast_path_is_flagged(
    disagreeing: tuple[Path, qkvtrace.Trace, qkvtrace.Trace], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Witness: the rank files the test wrote (merge's input), one rank in eval and one in training; that their
    paths really differ is witnessed by torch.profiler on an untraced run of each rank's step (the fused kernel
    ``aten::_native_multi_head_attention`` runs in inference only)."""
    folder, t0, t1 = disagreeing
    c0, c1 = t0.calls[0], t1.calls[0]
    for train, call in ((False, c0), (True, c1)):
        m, x = _mha().train(train), torch.randn(2, 5, 16)
        with torch.set_grad_enabled(train), torch.profiler.profile() as prof:
            m(x, x, x, need_weights=False)
        fused = "aten::_native_multi_head_attention" in {e.name for e in prof.events()}
        assert fused == (not train) and (call.path == "fast") == fused, (train, call.path)
    out_file = tmp_path / "merged.json"
    code, out, err = run(capsys, folder / "trace.rank0.json", folder / "trace.rank1.json", "--json", out_file)
    assert (code, err) == (1, "")
    # the ranks grouped by what they saw, with PyTorch's reason as each rank recorded it
    assert rows(out) == [
        ["(root)", "0", "0", c0.path, c0.sdpa_backend or "none", why(c0)],
        ["", "", "1", c1.path, c1.sdpa_backend or "none", why(c1)],
    ]
    assert "1 call where ranks disagree" in out
    merged = load_json(out_file, "qkvtrace.merge/1")  # written even when the ranks disagree
    assert merged["agree"] is False
    fields = {d["field"]: d for d in merged["disagreements"]}
    assert fields["path"]["values"] == [{"value": c0.path, "ranks": [0]}, {"value": c1.path, "ranks": [1]}]
    assert fields["why_not_fast_path"]["module"] == "" and fields["why_not_fast_path"]["occurrence"] == 0
    expected = {"path"} | {f for f in ("sdpa_backend", "why_not_fast_path") if getattr(c0, f) != getattr(c1, f)}
    assert set(fields) == expected
    assert merged["calls"][0]["differs"] == [f for f in ("path", "sdpa_backend", "why_not_fast_path") if f in expected]


def test_a_call_only_some_ranks_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: rank 0 made one call and rank 1 two, by construction; rank 1's second call from its file."""
    _trace(train=False, calls=1).save(tmp_path / "t.rank0.json")
    t1 = _trace(train=False, calls=2)
    t1.save(tmp_path / "t.rank1.json")
    code, out, _ = run(capsys, tmp_path)
    assert code == 1
    second = t1.calls[1]
    assert rows(out) == [["(root)", "1", "0", "did not make this call", "", ""],
                         ["", "", "1", second.path, second.sdpa_backend or "none", why(second)]]  # fmt: skip
    merged = merge_traces(load_rank_traces([tmp_path]))
    assert [c["differs"] for c in merged["calls"]] == [[], ["present"]]
    assert merged["calls"][1]["ranks"][0] == {"rank": 0, "index": None}


def _with_ranks(t: qkvtrace.Trace, rank: int, world: int) -> dict[str, object]:
    """A trace's JSON with the rank fields the tracer writes under torch.distributed."""
    data = t.to_dict()
    for record in [*data["calls"], *data["gradients"]]:
        record.update(rank=rank, world_size=world)
    return data


def test_rank_comes_from_the_records_before_the_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the rank and world size the test wrote into each file's records."""
    t = _trace(train=True)
    (tmp_path / "a.rank7.json").write_text(json.dumps(_with_ranks(t, 1, 4)))
    (tmp_path / "b.json").write_text(json.dumps(_with_ranks(t, 0, 4)))
    traces = load_rank_traces([tmp_path / "a.rank7.json", tmp_path / "b.json"])
    assert [(r.rank, r.world_size, r.name) for r in traces] == [(0, 4, "b.json"), (1, 4, "a.rank7.json")]
    code, out, _ = run(capsys, tmp_path / "a.rank7.json", tmp_path / "b.json")
    assert code == 0
    assert "2 ranks (0-1) of world size 4" in out
    assert "no file for rank(s) 2-3" in out
    assert merge_traces(traces)["missing_ranks"] == [2, 3]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["x.rank0.json", "y.rank0.json"], "x.rank0.json and y.rank0.json are both rank 0; give one file per rank"),
        (["plain.json"], "its records carry no rank and its name has none (NAME.rankN.json)"),
        (["report"], '/schema: expected "qkvtrace.trace/1", "qkvtrace.trace/2" or "qkvtrace.trace/3", '
                     'got "qkvtrace.report/1"'),
        (["empty"], "no per-rank trace files (NAME.rankN.json) in this folder"),
        (["w2.rank0.json", "w4.rank1.json"], "the files come from jobs of different world sizes"),
        (["mixed.rank0.json"], "holds records of ranks [0, 1]; give one file per rank"),
    ],
)
def test_bad_input_exit_2_one_line(tmp_path: Path, files: list[str], message: str) -> None:
    """Witness: the bad inputs built here (duplicate rank, no rank, a report, empty folder, mixed worlds and ranks)."""
    t = _trace(train=False, calls=2)
    t.save(tmp_path / "x.rank0.json")
    t.save(tmp_path / "y.rank0.json")
    t.save(tmp_path / "plain.json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "w2.rank0.json").write_text(json.dumps(_with_ranks(t, 0, 2)))
    (tmp_path / "w4.rank1.json").write_text(json.dumps(_with_ranks(t, 1, 4)))
    mixed = _with_ranks(t, 0, 2)
    mixed["calls"][1]["rank"] = 1  # type: ignore[index]
    (tmp_path / "mixed.rank0.json").write_text(json.dumps(mixed))
    paths = [str(ROOT / "reports" / "torch-2.13.0+cpu" / "report.json") if f == "report" else str(tmp_path / f)
             for f in files]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "merge", *paths], capture_output=True, text=True,
                          env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkvtrace merge: error: ") and message in lines[0], proc.stderr


def test_json_output_checked_before_work(agreeing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the ``--json`` folder given here does not exist."""
    code, out, err = run(capsys, agreeing, "--json", tmp_path / "no" / "such" / "m.json")
    assert code == 2 and out == ""
    assert "folder" in err and "does not exist" in err


def test_merge_needs_no_torch(agreeing: Path) -> None:
    """Files copied off the job's machines merge where PyTorch is not installed.

    Witness: ``sys.modules['torch'] = None`` makes every ``import torch`` in that process fail.
    """
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from qkvtrace.cli.main import main\n"
        f"sys.exit(main(['merge', {str(agreeing)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "every rank made the same calls the same way" in proc.stdout


def test_save_per_rank_outside_torch_distributed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: the ``RANK`` set here, and the saved file read back with ``json`` against the trace it was given."""
    t = _trace(train=False)
    monkeypatch.delenv("RANK", raising=False)
    assert save_per_rank(t, tmp_path / "traces") == tmp_path / "traces" / "trace.rank0.json"
    monkeypatch.setenv("RANK", "3")  # torchrun sets it before the process group exists
    path = save_per_rank(t.result, tmp_path / "traces", stem="step1")
    assert path == tmp_path / "traces" / "step1.rank3.json"
    assert load_json(path, "qkvtrace.trace/3") == t.to_dict()
    assert json.loads(path.read_text()) == t.to_dict()
    with pytest.raises(TypeError, match="needs a qkvtrace trace or TraceResult"):
        save_per_rank({"calls": []}, tmp_path)


def test_ranks_on_different_pytorch_versions(agreeing: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the ``torch_version`` the test wrote into rank 1's file, and ``torch.__version__``."""
    data = json.loads((agreeing / "trace.rank1.json").read_text())
    mine = data["torch_version"]
    assert mine == torch.__version__
    data["torch_version"] = "0.0.0+other"
    (agreeing / "trace.rank1.json").write_text(json.dumps(data))
    code, out, _ = run(capsys, agreeing)
    assert code == 1
    assert f"torch_version differs: rank 0: {mine} · rank 1: 0.0.0+other" in out
    assert rows(out) == []  # the calls themselves agree


def test_merged_file_is_checked_against_its_schema(agreeing: Path, tmp_path: Path) -> None:
    """qkvtrace.merge/1 is a registered format: `validate` knows it, and each rank's embedded trace is checked too.

    Witness: the schema files, and the bad ``path`` value the test wrote into rank 1's trace.
    """
    merged = merge_traces(load_rank_traces([agreeing]))
    good = tmp_path / "merged.json"
    good.write_text(json.dumps(merged))
    bad = tmp_path / "bad.json"
    merged["ranks"][1]["trace"]["calls"][0]["path"] = "warp"
    bad.write_text(json.dumps(merged))
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "validate", str(good), str(bad)], capture_output=True,
                          text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == f"{good}: ok (qkvtrace.merge/1)\n"
    assert proc.stderr.startswith(f"qkvtrace validate: error: {bad}: /ranks/1/trace/calls/0/path: expected ")
