"""The JSON Schemas in qkvtrace/schemas/: what qkvtrace writes passes them, damaged files are refused cleanly.

The fuzz test feeds damaged variants of a committed report to `qkvtrace diff`
(most through ``main()`` in this process, a few through a real subprocess)
and accepts only two outcomes: exit 0 with a diff, or exit 2 with one line on
stderr naming the file — never a traceback, never a half-written output.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import Draft202012Validator

from qkvtrace.base.errors import SchemaError
from qkvtrace.cli.main import main
from qkvtrace.records.validation import MAX_JSON_BYTES, check_document, load_json, load_trace, schema_file, schema_ids

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
GOOD = REPORTS / "torch-2.13.0+cpu" / "report.json"
# a committed report of another release than the one running (a history needs two)
OLD = REPORTS / ("torch-2.4.1+cu121" if not torch.__version__.startswith("2.4.") else "torch-2.13.0+cpu")
COMMITTED = sorted(REPORTS.glob("*/report.json")) + sorted((REPORTS / "diffs").glob("*.json"))
SCHEMAS = ROOT / "qkvtrace" / "schemas"
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- the schema files ------------------------------------------------------------


def _schema_files() -> dict[str, dict[str, Any]]:
    """Each file in qkvtrace/schemas/, read with json, by the id its ``schema`` property fixes."""
    schemas = (json.loads(p.read_text(encoding="utf-8")) for p in sorted(SCHEMAS.glob("*.json")))
    return {schema["properties"]["schema"]["const"]: schema for schema in schemas}


def _jsonschema_errors(data: Any, schema_id: str) -> list[str]:
    """What jsonschema itself says of ``data`` against the schema file of ``schema_id`` (no qkvtrace code)."""
    from referencing import Registry, Resource

    schemas = _schema_files()
    registry: Registry[Any] = Registry().with_resources(
        [(schema["$id"], Resource.from_contents(schema)) for schema in schemas.values()]
    )
    validator = Draft202012Validator(schemas[schema_id], registry=registry)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(data)]


def test_one_schema_file_per_id() -> None:
    """Witness: the files in qkvtrace/schemas/, read with json: the id each one's ``schema`` const fixes."""
    ids = schema_ids()
    assert {"qkvtrace.trace/3", "qkvtrace.report/1", "qkvtrace.diff/1"} <= set(ids)
    consts = {p.name: json.loads(p.read_text())["properties"]["schema"] for p in SCHEMAS.glob("*.json")}
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(schema_file(i) for i in ids)
    assert sorted(c["const"] for c in consts.values()) == sorted(ids)  # one file per id, and no file without one
    for schema_id in ids:
        schema = json.loads((SCHEMAS / schema_file(schema_id)).read_text())
        Draft202012Validator.check_schema(schema)  # each is itself a valid Draft 2020-12 schema
        assert consts[schema_file(schema_id)] == {"const": schema_id}


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(REPORTS)))
def test_committed_reports_and_diffs_validate(path: Path) -> None:
    """Witness: the folder each committed file sits in (diffs/ or torch-*/), and jsonschema with the schema file."""
    data = load_json(path)
    expected = "qkvtrace.diff/1" if path.parent.name == "diffs" else "qkvtrace.report/1"
    assert data["schema"] == expected
    assert _jsonschema_errors(json.loads(path.read_text(encoding="utf-8")), expected) == []


def test_every_file_the_tool_writes_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the schema id this test expects of each command, the ids the schema files fix, and jsonschema
    itself run on every file with its schema file."""
    written: dict[str, list[Path]] = {}

    def write(schema_id: str, name: str, *args: str | Path, code: int = 0) -> None:
        path = tmp_path / name
        got, _, err = run(capsys, *args, "--json", path) if name.endswith(".json") else run(capsys, *args)
        assert got == code, err
        written.setdefault(schema_id, []).append(path)

    write("qkvtrace.trace/3", "t-train.json", "trace", "demo:mha", "--train", "--backward")
    write("qkvtrace.trace/3", "t-encoder.json", "trace", "demo:encoder")
    write("qkvtrace.trace/3", "t-lm.json", "trace", "demo:tiny-lm", "--train", "--backward")
    write("qkvtrace.check/1", "c-ok.json", "check", "demo:tiny-lm", "--causal", "--mode", "inference")
    write("qkvtrace.check/1", "c-leak.json", "check", f"{ROOT / 'tests' / 'mistakes.py'}:build_reversed",
          "--causal", "--mode", "inference", code=1)  # fmt: skip
    write("qkvtrace.probes/1", "probes.json", "probe")
    write("qkvtrace.grads/2", "g.json", "grads", "demo:mha")
    write("qkvtrace.advise/1", "a.json", "advise", "demo:mha", "--repeats", "2")
    write("qkvtrace.ablate/1", "ablate.json", "ablate", "--seeds", "1", "--steps", "2")
    write("qkvtrace.walkthrough/1", "w.json", "walkthrough", "--epochs", "3")
    code, _, err = run(capsys, "inspect", "--out", tmp_path / "reports")
    assert code == 0, err
    (report,) = (tmp_path / "reports").glob("torch-*/report.json")
    written["qkvtrace.report/1"] = [report]
    write("qkvtrace.diff/1", "d.json", "diff", OLD, report.parent)
    write("qkvtrace.history/1", "h.json", "history", OLD, report.parent, "--no-chart")
    write("qkvtrace.tracediff/1", "td.json", "diff", tmp_path / "t-train.json", tmp_path / "t-lm.json", code=1)
    ranks = tmp_path / "ranks"  # one rank trained, the other did not: they disagree (exit 1)
    ranks.mkdir()
    (ranks / "trace.rank0.json").write_bytes((tmp_path / "t-train.json").read_bytes())
    (ranks / "trace.rank1.json").write_bytes((tmp_path / "t-encoder.json").read_bytes())
    write("qkvtrace.merge/1", "m.json", "merge", ranks, code=1)
    # a trace as /2 wrote it (same keys; fully_masked_rows counted otherwise, read as null with the reason)
    two = json.loads((tmp_path / "t-train.json").read_text())
    (tmp_path / "t-2.json").write_text(json.dumps({**two, "schema": "qkvtrace.trace/2"}))
    written["qkvtrace.trace/2"] = [tmp_path / "t-2.json"]
    assert load_trace(tmp_path / "t-2.json").calls[0].output["fully_masked_rows"] is None
    # a trace as the first format wrote it: one [start, stop) pair per slice (readers still read it)
    old = json.loads((tmp_path / "t-train.json").read_text())
    old["schema"] = "qkvtrace.trace/1"
    for call in old["calls"]:
        for part in "qkv":
            if call["qkv"][part] is not None and call["qkv"][part]["rows"] is not None:
                call["qkv"][part]["rows"] = call["qkv"][part]["rows"][0]
    (tmp_path / "t-1.json").write_text(json.dumps(old))
    written["qkvtrace.trace/1"] = [tmp_path / "t-1.json"]
    assert load_trace(tmp_path / "t-1.json").calls[0].qkv.q.rows == [[0, 64]]  # MultiheadAttention(64, 8)
    # a long run's stream: JSON Lines, one document a line (each kind of line, as its own file here)
    import torch
    from torch import nn

    import qkvtrace

    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    with qkvtrace.trace(mha, keep="changes", stream_to=tmp_path / "run.jsonl") as t:
        for step in range(2):
            mha.train(step == 0)
            with torch.set_grad_enabled(step == 0):
                mha(x, x, x, need_weights=False)
            t.step()
    for n, line in enumerate((tmp_path / "run.jsonl").read_text().splitlines()):
        (tmp_path / f"stream-{n}.json").write_text(line)
        written.setdefault("qkvtrace.stream/1", []).append(tmp_path / f"stream-{n}.json")
    kinds = [json.loads(p.read_text())["kind"] for p in written["qkvtrace.stream/1"]]
    (tmp_path / "run.rank0.jsonl").write_bytes((tmp_path / "run.jsonl").read_bytes())
    write("qkvtrace.streammerge/1", "sm.json", "merge", tmp_path / "run.rank0.jsonl")
    assert kinds[0] == "start" and kinds[-1] == "end" and {"first", "change", "step"} <= set(kinds)

    assert set(written) == set(_schema_files())  # every schema file has a writer here
    for schema_id, paths in written.items():
        for path in paths:
            assert _jsonschema_errors(json.loads(path.read_text(encoding="utf-8")), schema_id) == [], path
    files = [p for paths in written.values() for p in paths]
    code, out, err = run(capsys, "validate", *files)
    assert (code, err) == (0, ""), err
    for schema_id, paths in written.items():
        for path in paths:
            assert f"{path}: ok ({schema_id})" in out


def test_validate_refuses_with_one_line_per_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the report damaged here (callgraph null), the absent file and the folder, and the messages
    written here."""
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({**json.loads(GOOD.read_text()), "callgraph": None}))
    code, out, err = run(capsys, "validate", GOOD, bad, tmp_path / "absent.json", REPORTS / "diffs")
    assert code == 2
    assert out == f"{GOOD}: ok (qkvtrace.report/1)\n"
    assert err.splitlines() == [
        f"qkvtrace validate: error: {bad}: /callgraph: expected an object, got null",
        f"qkvtrace validate: error: {tmp_path / 'absent.json'}: does not exist",
        f"qkvtrace validate: error: {REPORTS / 'diffs'}: is a folder; give a JSON file",
    ]
    code, _, err = run(capsys, "validate", "--schema", "qkvtrace.diff/1", GOOD)
    assert code == 2
    assert err == f'qkvtrace validate: error: {GOOD}: /schema: expected "qkvtrace.diff/1", ' \
                  'got "qkvtrace.report/1"; is it the right file?\n'  # fmt: skip


# -- messages ----------------------------------------------------------------------


def _good() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOOD.read_text())
    return data


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: r["callgraph"]["edges"][3].update(caller=None),
         "/callgraph/edges/3/caller: expected a string, got null"),
        (lambda r: r.pop("callgraph"), "/callgraph: missing (a required key)"),
        (lambda r: r.update(sources=7), "/sources: expected an array, got an integer (7)"),
        (lambda r: r["environment"].update(cuda_available="no"),
         '/environment/cuda_available: expected true or false, got a string ("no")'),
        (lambda r: r["sources"][2].update(lineno=-1), "/sources/2/lineno: expected at least 0, got -1"),
        (lambda r: r["probes"]["fully_masked_rows"][1].update(result="maybe"),
         '/probes/fully_masked_rows/1/result: expected "nan", "zero", "other" or "error", got "maybe"'),
        (lambda r: r["sources"][0].update(sha256="x" * 100),
         '/sources/0/sha256: expected a string matching ^[0-9a-f]{64}$, got "' + "x" * 38 + '…'),
        (lambda r: r.update(schema="qkvtrace.report/2"),
         '/schema: "qkvtrace.report/2" is newer than this qkvtrace reads (qkvtrace.report/1); upgrade qkvtrace'),
    ],
)  # fmt: skip
def test_message_names_the_first_bad_place(damage: Callable[[dict[str, Any]], Any], message: str) -> None:
    """Witness: the committed report with one field damaged here, and the message written here."""
    report = _good()
    damage(report)
    with pytest.raises(SchemaError) as info:
        check_document(report, name="report.json", expected="qkvtrace.report/1")
    assert str(info.value) == f"report.json: {message}"


def test_shallowest_error_wins_then_document_order() -> None:
    """Witness: the places this test damages, named in the messages written here."""
    report = _good()
    report["callgraph"]["edges"][5]["callee"] = 1
    report["callgraph"]["edges"][3]["caller"] = None
    with pytest.raises(SchemaError, match=r"/callgraph/edges/3/caller:"):
        check_document(report, name="r", expected="qkvtrace.report/1")
    report["sources"] = None  # shallower than the edges
    with pytest.raises(SchemaError, match=r"r: /sources: expected an array, got null$"):
        check_document(report, name="r", expected="qkvtrace.report/1")


# -- traces ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.json"
    assert main(["trace", "demo:mha", "--train", "--backward", "--json", str(path)]) == 0
    return path


def test_load_trace_reads_what_trace_wrote(trace_file: Path) -> None:
    """Witness: the trace file read with json in the test."""
    loaded = load_trace(trace_file)
    data = json.loads(trace_file.read_text())
    assert loaded.calls and loaded.gradients
    assert [(c.index, c.module, c.path) for c in loaded.calls] == [
        (c["index"], c["module"], c["path"]) for c in data["calls"]
    ]
    assert [g.q.grad_norm for g in loaded.gradients] == [g["q"]["grad_norm"] for g in data["gradients"]]
    assert json.loads(json.dumps(loaded.to_dict())) == data  # nothing lost or changed on the way in


def test_trace_schema_allows_fields_added_later(trace_file: Path, tmp_path: Path) -> None:
    """Witness: the trace JSON extended here with fields a later version might add."""
    data = json.loads(trace_file.read_text())
    call = data["calls"][0]
    call.update(evidence="unavailable: another profiler was active", aten_ops=None, compiled=True, thread=None)
    call["qkv"]["q"]["some_future_norm"] = 1.0
    data["gradients"][0]["q"]["some_future_norm"] = 2.0
    data["unobserved"] = [{"module": "blocks.0.attn", "module_type": "MyAttention", "reason": "hand-written"}]
    data["warnings"] = ["another profiler was active"]
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(data))
    loaded = load_trace(path)
    assert loaded.calls[0].module == call["module"] and loaded.gradients[0].q.grad_norm == data["gradients"][0]["q"][
        "grad_norm"]  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: t["calls"][0].update(index="0"), '/calls/0/index: expected an integer, got a string ("0")'),
        (lambda t: t["calls"][0].update(evidence="guessed"),
         '/calls/0/evidence: expected a string matching ^(witnessed|cached|unavailable: .*)$, got "guessed"'),
        (lambda t: t["calls"][0].update(path="warp"), '/calls/0/path: expected "fast", "fallback", '
                                                      '"fused_encoder_layer", "sdpa", "flex", "hand_written" or '
                                                      '"unknown", got "warp"'),
        (lambda t: t["calls"][0]["qkv"].update(k=[]),
         "/calls/0/qkv/k: expected an object or null, got an array (0 items)"),
        (lambda t: t["gradients"][0].pop("backward_index"), "/gradients/0/backward_index: missing (a required key)"),
        (lambda t: t.update(unobserved=[{"module": "a", "module_type": "B"}]),
         "/unobserved/0/reason: missing (a required key)"),
        (lambda t: t.update(schema="qkvtrace.report/1"),
         '/schema: expected "qkvtrace.trace/1", "qkvtrace.trace/2" or "qkvtrace.trace/3", got "qkvtrace.report/1"; '
         'is it the right file?'),
    ],
)  # fmt: skip
def test_load_trace_refuses_damaged_traces(
    trace_file: Path, tmp_path: Path, damage: Callable[[dict[str, Any]], Any], message: str
) -> None:
    """Witness: the trace JSON with one field damaged here, and the message written here."""
    data = json.loads(trace_file.read_text())
    damage(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}: {message}"


# -- fuzz: damaged reports into `qkvtrace diff` ------------------------------------------


def _edit(change: Callable[[dict[str, Any]], Any]) -> Callable[[bytes], bytes]:
    def apply(raw: bytes) -> bytes:
        data = json.loads(raw)
        change(data)
        return json.dumps(data).encode()

    return apply


def _set(*path: str | int, value: Any) -> Callable[[bytes], bytes]:
    def change(data: Any) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return _edit(change)


def _drop(*path: str | int) -> Callable[[bytes], bytes]:
    def change(data: Any) -> None:
        for key in path[:-1]:
            data = data[key]
        del data[path[-1]]

    return _edit(change)


def _big_source(data: dict[str, Any]) -> None:
    data["sources"][0].update(text="x" * 2_000_000, sha256="0" * 64)


SECTIONS = ("environment", "sources", "fast_path_conditions", "callgraph", "probes")
WRONG = {"null": None, "int": 3, "string": "callgraph", "list": [], "object": {}}
IS_A = {"environment": "object", "sources": "list", "fast_path_conditions": "list", "callgraph": "object",
        "probes": "object"}  # fmt: skip

VARIANTS: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda raw: b"",
    "truncated-half": lambda raw: raw[: len(raw) // 2],
    "truncated-10-bytes": lambda raw: raw[:10],
    "truncated-last-byte": lambda raw: raw.rstrip()[:-1],
    "binary-png": lambda raw: b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4,
    "latin-1-bytes": lambda raw: raw.decode().replace("attention", "attention\xe9").encode("latin-1", "replace"),
    "utf-16": lambda raw: raw.decode().encode("utf-16"),
    "bom": lambda raw: b"\xef\xbb\xbf" + raw,
    "trailing-garbage": lambda raw: raw + b"}}",
    "top-null": lambda raw: b"null",
    "top-list": lambda raw: b"[1, 2, 3]",
    "top-number": lambda raw: b"42",
    "top-string": lambda raw: b'"qkvtrace.report/1"',
    "empty-object": lambda raw: b"{}",
    "deep-nesting": lambda raw: b"[" * 200_000 + b"]" * 200_000,
    "huge-integer": lambda raw: b'{"schema": "qkvtrace.report/1", "environment": ' + b"9" * 5000 + b"}",
    "schema-missing": _drop("schema"),
    "schema-diff": _set("schema", value="qkvtrace.diff/1"),
    "schema-newer": _set("schema", value="qkvtrace.report/2"),
    "schema-int": _set("schema", value=1),
    **{f"{s}-missing": _drop(s) for s in SECTIONS},
    # each section set to null, a number, a string and the container type it is not
    **{f"{s}-{w}": _set(s, value=v) for s in SECTIONS for w, v in WRONG.items() if not IS_A[s] == w},
    "sources-empty-list": _set("sources", value=[]),  # valid: every function "removed"
    "sources-of-ints": _set("sources", value=[1, 2]),
    "source-text-null": _set("sources", 0, "text", value=None),
    "source-sha-int": _set("sources", 0, "sha256", value=7),
    "source-name-missing": _drop("sources", 0, "name"),
    "torch-version-int": _set("environment", "torch_version", value=5),
    "torch-version-missing": _drop("environment", "torch_version"),
    "edges-object": _set("callgraph", "edges", value={}),
    "edge-caller-null": _set("callgraph", "edges", 3, "caller", value=None),
    "edge-kind-string": _set("callgraph", "edges", 0, "kind", value="static"),
    "node-name-list": _set("callgraph", "nodes", 0, "name", value=[]),
    "condition-string": _set("fast_path_conditions", 0, "conditions", 0, value="x"),
    "scenario-calls-null": _set("probes", "scenarios", 0, "calls", value=None),
    "scenario-error-int": _set("probes", "scenarios", 0, "error", value=1),
    "mask-semantics-object": _set("probes", "mask_semantics", value={}),
    "mask-api-list": _set("probes", "mask_semantics", 0, "api", value=["a"]),
    "fully-masked-result": _set("probes", "fully_masked_rows", 0, "result", value="maybe"),
    "agreement-diff-string": _set("probes", "agreement", "sdpa", 0, "max_abs_diff", value="big"),
    "agreement-nan": lambda raw: raw.replace(b'"max_abs_diff_to_by_hand": ', b'"max_abs_diff_to_by_hand": NaN, "x": '),
    "agreement-missing": _drop("probes", "agreement"),  # valid: agreement is optional
    "extra-keys": _set("future_section", value={"anything": [1, None]}),  # valid: new keys are allowed
    "2mb-string": _edit(_big_source),
}


#: The variants that are still valid reports: diffed, exit 0. Every other one is refused with exit 2.
ACCEPTED = {"sources-empty-list", "agreement-nan", "agreement-missing", "extra-keys", "2mb-string"}


def test_fuzz_has_enough_variants() -> None:
    """Witness: the VARIANTS and ACCEPTED tables written in this file."""
    assert len(VARIANTS) >= 40 and ACCEPTED < VARIANTS.keys()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fuzz_diff_refuses_or_diffs(variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: the damaged file built here from the committed report, and ACCEPTED written here."""
    bad = tmp_path / "report.json"
    bad.write_bytes(VARIANTS[variant](GOOD.read_bytes()))
    written = tmp_path / "d.json"
    for a, b in ((GOOD, bad), (bad, GOOD)):
        code, out, err = run(capsys, "diff", a, b, "--json", written, "--md", tmp_path / "d.md")
        assert "Traceback" not in out + err
        if variant in ACCEPTED:
            assert (code, err) == (0, "")
            load_json(written, "qkvtrace.diff/1")
            written.unlink()
        else:
            assert code == 2, err
            assert err.count("\n") == 1 and err.startswith(f"qkvtrace diff: error: {bad}: "), err
            assert not written.exists() and not (tmp_path / "d.md").exists()  # nothing half-written


def test_over_large_and_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Witness: a sparse file made here one byte over the limit, and a copy made unreadable here."""
    huge = tmp_path / "huge.json"
    with huge.open("wb") as fh:  # sparse: no disk space used
        fh.truncate(MAX_JSON_BYTES + 1)
    code, _, err = run(capsys, "diff", GOOD, huge)
    assert code == 2 and "is more than a qkvtrace JSON file can be" in err and err.count("\n") == 1
    if os.name == "posix" and os.geteuid() != 0:
        locked = tmp_path / "locked.json"
        locked.write_bytes(GOOD.read_bytes())
        locked.chmod(0)
        code, _, err = run(capsys, "diff", GOOD, locked)
        locked.chmod(stat.S_IRUSR | stat.S_IWUSR)
        assert code == 2 and "cannot be read" in err


THROUGH_SUBPROCESS = ["truncated-half", "binary-png", "callgraph-null", "schema-diff", "edge-caller-null"]


@pytest.mark.parametrize("variant", THROUGH_SUBPROCESS)
def test_fuzz_through_the_real_command(variant: str, tmp_path: Path) -> None:
    """Witness: the damaged file built here, named in the one line a real subprocess writes."""
    bad = tmp_path / "report.json"
    bad.write_bytes(VARIANTS[variant](GOOD.read_bytes()))
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "diff", str(GOOD), str(bad)], capture_output=True,
                          text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"qkvtrace diff: error: {bad}: ")
    assert proc.stdout == ""


def test_validate_through_the_real_command() -> None:
    """Witness: the committed reports and diffs listed here with glob."""
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "validate", *map(str, COMMITTED)], capture_output=True,
                          text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == len(COMMITTED)


def test_compare_refuses_a_damaged_collector_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`compare` reads JSON from another interpreter's collector: it is checked like a file.

    Witness: a fake interpreter written here whose collector prints a report with ``sources`` null."""
    damaged = tmp_path / "collected.json"
    damaged.write_text(json.dumps({**_good(), "sources": None}))
    fake = tmp_path / "python"
    script = [
        "#!/bin/sh",
        f'case "$*" in *qkvtrace.analyses.report*) cat "{damaged}"; exit 0;; esac',  # the collector's run
        f'exec "{sys.executable}" "$@"',  # everything else: the real interpreter
    ]
    fake.write_text("\n".join(script) + "\n")
    fake.chmod(0o755)
    code, _, err = run(capsys, "compare", "--python", fake, "--python", fake, "--out", tmp_path / "out")
    assert code == 2
    assert err == f"qkvtrace compare: error: the report collected under {fake}: /sources: expected an array, got null\n"
    assert not list((tmp_path / "out").glob("torch-*"))


def test_diff_reports_checks_reports_given_in_memory() -> None:
    """Witness: the committed report damaged here in memory, and the message written here."""
    from qkvtrace.analyses.diff import diff_reports

    broken = _good()
    broken["fast_path_conditions"][0]["conditions"] = None
    message = "report B: /fast_path_conditions/0/conditions: expected an array, got null"
    with pytest.raises(SchemaError, match=f"^{message}$"):
        diff_reports(_good(), broken)


def test_report_collector_imports_without_jsonschema() -> None:
    """The collector `compare` ships to other environments (torch only) must not need jsonschema.

    Witness: a fresh interpreter in which the test blocks importing jsonschema and referencing."""
    code = ("import sys\nfor name in ('jsonschema', 'referencing'): sys.modules[name] = None\n"
            "import qkvtrace.analyses.report")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
