"""``qkvtrace history``: the timeline across releases, and the committed one.

* three small synthetic reports whose history is known by construction;
* the committed reports/history.json is what the tool builds from the
  committed reports now, and agrees with the pairwise ``diff`` of every
  consecutive pair; HISTORY.md is what the renderer writes from it;
* a report that fails validation is refused with exit 2, naming its file;
* the old-release reports say what their PyTorch lacks instead of failing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qkvtrace.analyses.diff import diff_reports
from qkvtrace.analyses.history import build_history, find_reports, source_change, version_key
from qkvtrace.analyses.reportio import load_report
from qkvtrace.records.validation import check_document

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
#: The id the history schema file fixes for ``schema`` (read here, not taken from qkvtrace).
_HISTORY_SCHEMA_FILE = ROOT / "qkvtrace" / "schemas" / "history-1.json"
HISTORY_ID = json.loads(_HISTORY_SCHEMA_FILE.read_text(encoding="utf-8"))["properties"]["schema"]["const"]


def _numbers(version: str) -> tuple[int, ...]:
    """``"2.10.0+cu128"`` -> ``(2, 10, 0)``: the release's leading numbers, read here."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    assert match, version
    return tuple(int(x) for x in match.group().split("."))


# -- three synthetic releases ----------------------------------------------------

_FWD = '''def forward(self, x):
    """Run the layer."""
    if self.training:
        why_not_fast_path = "training is enabled"
    return self.attn(x)
'''
_HELPER = '''def helper(x):
    """Old words."""
    return x + 1
'''
_GONE = """def gone(x):
    return x
"""


def _source(name: str, text: str) -> dict[str, Any]:
    return {"name": name, "kind": "python", "file": "nn/x.py", "lineno": 1,
            "sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text}  # fmt: skip


def _report(version: str, sources: dict[str, str], conditions: list[tuple[str, str]],
            edges: list[tuple[str, str]], fully_masked: str) -> dict[str, Any]:  # fmt: skip
    return {
        "schema": "qkvtrace.report/1",
        "environment": {
            "torch_version": version,
            "torch_git_version": "abc",
            "python_version": "3.11.0",
            "platform": "Linux-x86_64",
            "cuda_available": False,
            "sdp_enabled": {},
            "mha_fastpath_enabled": None,
        },
        "sources": [_source(n, t) for n, t in sorted(sources.items())],
        "missing": [],
        "fast_path_conditions": [
            {
                "function": "Layer.forward",
                "missing": False,
                "conditions": [{"reason": r, "condition": c} for r, c in conditions],
            }
        ],
        "callgraph": {
            "nodes": [{"name": n, "kind": "python", "file": None} for n in sorted({x for e in edges for x in e})],
            "edges": [{"caller": a, "callee": b, "kind": ["static"], "paths": [], "scenarios": []} for a, b in edges],
        },
        "probes": {
            "scenarios": [],
            "mask_semantics": [{"api": "sdpa", "true_means": "attend"}],
            "fully_masked_rows": [{"api": "sdpa (bool mask)", "backend": "MATH", "result": fully_masked}],
        },
    }


def _three() -> list[dict[str, Any]]:
    """9.2.0 -> 9.10.0 -> 9.11.0, with these changes (and so this answer):

    9.10.0: forward's code changes; helper's docstring only; a condition added;
            an edge added; fully-masked rows nan -> zero.
    9.11.0: forward gains a comment (layout); gone() removed; the condition
            reworded (same test, new words); an edge removed.
    """
    base = {"Layer.forward": _FWD, "helper": _HELPER, "gone": _GONE}
    r1 = _report("9.2.0", base, [("training is enabled", "self.training")],
                 [("Layer.forward", "helper")], "nan")  # fmt: skip
    code = _FWD.replace("return self.attn(x)", "return self.attn(x) * 1")
    r2 = _report("9.10.0", {**base, "Layer.forward": code, "helper": _HELPER.replace("Old", "New")},
                 [("training is enabled", "self.training"), ("hooks are attached", "self._forward_hooks")],
                 [("Layer.forward", "helper"), ("Layer.forward", "gone")], "zero")  # fmt: skip
    layout = code.replace("    return", "    # a comment\n    return")
    r3 = _report("9.11.0", {"Layer.forward": layout, "helper": _HELPER.replace("Old", "New")},
                 [("training is enabled", "self.training"), ("forward hooks are attached", "self._forward_hooks")],
                 [("Layer.forward", "helper")], "zero")  # fmt: skip
    return [r1, r2, r3]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m qkvtrace ARGS`` (or ``python -c CODE ARGS``), wide enough that lines do not wrap."""
    head = ["-c", code] if code else ["-m", "qkvtrace"]
    env = {**os.environ, "COLUMNS": "250"}
    return subprocess.run([sys.executable, *head, *args], capture_output=True, text=True, timeout=120, env=env)


def _write(reports: list[dict[str, Any]], root: Path) -> Path:
    for r in reports:
        folder = root / f"torch-{r['environment']['torch_version']}"
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(json.dumps(r), encoding="utf-8")
    return root


def test_three_synthetic_reports_give_the_known_history() -> None:
    """Witness: the three reports built here, whose changes are known by construction (``_three``)."""
    r1, r2, r3 = _three()
    h = build_history([r3, r1, r2])  # any order: releases sort by version number
    check_document(h, name="history", expected=HISTORY_ID)
    assert h["releases"] == ["9.2.0", "9.10.0", "9.11.0"]
    changes = {s["name"]: [(c["release"], c["change"]) for c in s["changes"]] for s in h["sources"]}
    assert changes == {
        "Layer.forward": [("9.10.0", "code"), ("9.11.0", "layout")],
        "helper": [("9.10.0", "docstring")],
        "gone": [("9.11.0", "removed")],
    }
    assert [(c["release"], c["change"], c["reason"], c.get("was")) for c in h["fast_path_conditions"]] == [
        ("9.10.0", "added", "hooks are attached", None),
        ("9.11.0", "reworded", "forward hooks are attached", "hooks are attached"),
    ]
    assert [(p["kind"], p["key"], [(c["release"], c["was"], c["became"]) for c in p["changes"]])
            for p in h["probes"]] == [
        ("fully_masked_rows", "sdpa (bool mask) / MATH",
         [("9.10.0", {"result": "nan", "grad_finite": None}, {"result": "zero", "grad_finite": None})]),
    ]  # fmt: skip
    assert [(g["release"], g["edges_added"], g["edges_removed"]) for g in h["callgraph"]] == [
        ("9.10.0", [{"caller": "Layer.forward", "callee": "gone"}], []),
        ("9.11.0", [], [{"caller": "Layer.forward", "callee": "gone"}]),
    ]


def test_history_command_writes_markdown_json_and_names_releases(tmp_path: Path) -> None:
    """Witness: the three reports built and written here, and the id fixed by the history schema file."""
    folder = _write(_three(), tmp_path / "reports")
    proc = _run("history", str(folder), "--no-chart")
    assert proc.returncode == 0, proc.stderr
    h = json.loads((folder / "history.json").read_text())
    assert h["schema"] == HISTORY_ID and h["releases"] == ["9.2.0", "9.10.0", "9.11.0"]
    md = (folder / "HISTORY.md").read_text()
    assert "| 9.11.0 | `Layer.forward` | reworded | “forward hooks are attached” (was “hooks are attached”) |" in md
    assert "| `helper` | python | 9.2.0 | 9.10.0 (docstring) |" in md
    assert "9.10.0" in proc.stdout and "fully masked rows nan → zero: MATH" in proc.stdout


def test_a_report_failing_validation_is_refused_naming_it(tmp_path: Path) -> None:
    """Witness: the report damaged and written here (an edge without its caller)."""
    r1, r2, r3 = _three()
    del r2["callgraph"]["edges"][0]["caller"]
    folder = _write([r1, r2, r3], tmp_path / "reports")
    proc = _run("history", str(folder), "--no-chart")
    assert proc.returncode == 2
    bad = folder / "torch-9.10.0" / "report.json"
    assert str(bad) in proc.stderr and "/callgraph/edges/0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (folder / "history.json").exists()


def test_one_release_or_a_duplicate_is_refused(tmp_path: Path) -> None:
    """Witness: one report written here, and the same report given twice."""
    r1, _, _ = _three()
    folder = _write([r1], tmp_path / "one")
    proc = _run("history", str(folder))
    assert proc.returncode == 2 and "at least two releases" in proc.stderr
    with pytest.raises(Exception, match=r"two reports of torch 9\.2\.0"):
        build_history([("a", r1), ("b", r1)])


def test_source_change_kinds() -> None:
    """Witness: the edits made here to a source text (code, docstring, comment), and the version order written
    here."""

    def src(text: str, kind: str = "python") -> dict[str, Any]:
        return {"kind": kind, "text": text}

    assert source_change(src(_HELPER), src(_HELPER.replace("x + 1", "x + 2"))) == "code"
    assert source_change(src(_HELPER), src(_HELPER.replace("Old", "New"))) == "docstring"
    assert source_change(src(_HELPER), src(_HELPER.replace("    return", "    # why\n    return"))) == "layout"
    assert source_change(src("f(a)", "builtin"), src("f(a, b)", "builtin")) == "docstring"
    assert version_key("2.10.0+cu128") > version_key("2.9.1+cu128") > version_key("2.9.0")


def test_chart_draws_a_png(tmp_path: Path) -> None:
    """Witness: the rows that change in the reports built here, and the PNG signature bytes."""
    pytest.importorskip("matplotlib")
    from qkvtrace.render.history_render import chart_rows, draw_history_chart

    h = build_history(_three())
    assert [label for label, _, _ in chart_rows(h)] == [
        "source: Layer.forward", "source: gone", "source: helper",
        "fast-path conditions: Layer.forward", "fully-masked rows: sdpa (bool mask) / MATH", "call graph edges",
    ]  # fmt: skip
    draw_history_chart(h, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_the_timeline_is_written_and_the_chart_names_the_extra(tmp_path: Path) -> None:
    """Witness: an interpreter in which the test blocks importing matplotlib."""
    folder = _write(_three(), tmp_path / "reports")
    block = "import sys; sys.modules['matplotlib'] = None; from qkvtrace.cli.main import main; sys.exit(main())"
    proc = _run("history", str(folder), code=block)
    assert proc.returncode == 0, proc.stderr
    assert 'pip install "qkvtrace[plot]"' in proc.stdout and (folder / "HISTORY.md").exists()
    proc = _run("history", str(folder), "--chart", str(tmp_path / "c.png"), code=block)
    assert proc.returncode == 2 and 'pip install "qkvtrace[plot]"' in proc.stderr


# -- the committed history ---------------------------------------------------------


def _committed_report_folders(root: Path = ROOT) -> list[Path]:
    """The report folders under ``root/reports`` that git tracks (all of them outside a git checkout).

    ``qkvtrace inspect``, the README's main command, writes ``reports/torch-<installed version>/``: on a
    machine whose PyTorch build has no committed report (``2.13.0`` from PyPI beside the committed
    ``2.13.0+cpu``) that is a new, untracked folder, which the committed history cannot know.
    """
    reports = root / "reports"
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "reports"], cwd=root, capture_output=True,
                                check=True, timeout=60).stdout.decode()  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an unpacked source archive)
        listed = ""
    tracked = sorted({root / Path(n).parent for n in listed.split("\0") if n.endswith("/report.json")})
    return tracked or sorted(p.parent for p in reports.glob("*/report.json"))


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    path = REPORTS / "history.json"
    if not path.exists():
        pytest.fail("reports/history.json is not committed; run `qkvtrace history reports/`")
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def test_committed_history_is_what_the_tool_builds_from_the_committed_reports(committed: dict[str, Any]) -> None:
    """Witness: the committed reports/history.json and reports/HISTORY.md."""
    from qkvtrace.render.history_render import history_markdown

    rebuilt = build_history(find_reports(_committed_report_folders()))
    assert rebuilt == committed, "reports/history.json is stale; run `qkvtrace history reports/`"
    md = (REPORTS / "HISTORY.md").read_text(encoding="utf-8")
    assert md == history_markdown(committed, chart_name="history.png")


def test_committed_history_covers_every_minor_release_from_2_0(committed: dict[str, Any]) -> None:
    """Witness: the minor releases 2.0-2.14 listed here, and the committed releases' numbers read here."""
    minors = {_numbers(v)[:2] for v in committed["releases"]}
    missing = [f"2.{m}" for m in range(15) if (2, m) not in minors]
    assert not missing, f"no committed report for torch {', '.join(missing)}"


def _condition_triples(report: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(blk["function"], c["reason"], c["condition"]) for blk in report["fast_path_conditions"]
            for c in blk["conditions"]}  # fmt: skip


def test_committed_history_agrees_with_pairwise_diff(committed: dict[str, Any]) -> None:
    """Witness: the committed report files read with json; for each consecutive pair the test compares sources
    (by sha256), fast-path conditions (function, reason, condition) and call edges itself. Which of several
    candidates a reworded condition pairs with, and the probe changes, follow ``diff``'s rules: there the
    pairwise ``diff_reports`` is the cross-check."""
    reports: dict[str, dict[str, Any]] = {}
    for folder in _committed_report_folders():
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
        reports[report["environment"]["torch_version"]] = report
    releases = committed["releases"]
    assert releases == sorted(reports, key=lambda v: (_numbers(v), v))
    for a, b in itertools.pairwise(releases):
        d = diff_reports(reports[a], reports[b])
        sha_a = {s["name"]: s["sha256"] for s in reports[a]["sources"]}
        sha_b = {s["name"]: s["sha256"] for s in reports[b]["sources"]}
        at_b = {s["name"]: [c["change"] for c in s["changes"] if c["release"] == b] for s in committed["sources"]}
        assert sorted(n for n, c in at_b.items() if c and c[0] not in ("added", "removed")) == sorted(
            n for n in sha_a.keys() & sha_b.keys() if sha_a[n] != sha_b[n]
        )
        assert sorted(n for n, c in at_b.items() if c == ["added"]) == sorted(sha_b.keys() - sha_a.keys())
        assert sorted(n for n, c in at_b.items() if c == ["removed"]) == sorted(sha_a.keys() - sha_b.keys())
        conds = [c for c in committed["fast_path_conditions"] if c["release"] == b]
        # by hand: every (function, reason, condition) that left is removed or reworded away, every one that came
        # is added or reworded to; a rewording keeps its condition or its words, and no removed one could have
        # paired with an added one
        gone = _condition_triples(reports[a]) - _condition_triples(reports[b])
        came = _condition_triples(reports[b]) - _condition_triples(reports[a])
        new = sorted((c["function"], c["reason"], c["condition"]) for c in conds if c["change"] != "removed")
        old = sorted((c["function"], c["reason"], c["condition"]) for c in conds if c["change"] == "removed") + [
            (c["function"], c["was"], c["condition_was"]) for c in conds if c["change"] == "reworded"
        ]
        assert new == sorted(came) and sorted(old) == sorted(gone)
        for c in conds:
            if c["change"] == "reworded":
                assert c["condition"] == c["condition_was"] or c["reason"] == c["was"], c
        for x, y in itertools.product([c for c in conds if c["change"] == "removed"],
                                      [c for c in conds if c["change"] == "added"]):  # fmt: skip
            assert x["function"] != y["function"] or (x["reason"] != y["reason"] and x["condition"] != y["condition"])
        fp = d["fast_path_conditions"]
        assert sorted(c["reason"] for c in conds if c["change"] == "added") == sorted(c["reason"] for c in fp["added"])
        assert sorted(c["reason"] for c in conds if c["change"] == "removed") == sorted(
            c["reason"] for c in fp["removed"]
        )
        assert sorted(c["was"] for c in conds if c["change"] == "reworded") == sorted(c["was"] for c in fp["reworded"])
        probes = sorted((p["kind"], p["key"], c["was"], c["became"]) for p in committed["probes"]
                        for c in p["changes"] if c["release"] == b)  # fmt: skip
        assert probes == sorted((c["kind"], c["key"], c["was"], c["became"]) for c in d["probes"]["changed"])
        edges = [g for g in committed["callgraph"] if g["release"] == b]
        ea = {(e["caller"], e["callee"]) for e in reports[a]["callgraph"]["edges"]}
        eb = {(e["caller"], e["callee"]) for e in reports[b]["callgraph"]["edges"]}
        g = {"edges_added": [{"caller": x, "callee": y} for x, y in sorted(eb - ea)],
             "edges_removed": [{"caller": x, "callee": y} for x, y in sorted(ea - eb)]}  # fmt: skip
        if g["edges_added"] or g["edges_removed"]:
            assert edges == [{"release": b, "from": a, **g}]
        else:
            assert edges == []


def test_old_releases_say_what_they_lack_instead_of_failing(committed: dict[str, Any]) -> None:
    """Before torch.nn.attention (2.3) the report names it missing, and still measures behaviour.

    Witness: the committed history.json and the old releases' committed report files, read with json."""
    lacking = {m["name"]: m["releases"] for m in committed["missing"]}
    olds = [v for v in committed["releases"] if _numbers(v)[:2] < (2, 3)]
    assert olds and set(olds) <= set(lacking.get("torch.nn.attention.sdpa_kernel", []))
    for version in olds:
        report = json.loads((REPORTS / f"torch-{version}" / "report.json").read_text())
        rows = report["probes"]["fully_masked_rows"]
        assert any(r["backend"] == "default" and r["result"] in ("nan", "zero", "other") for r in rows)
        # a forced backend that this release did not select is recorded as such, not under a false label
        for r in rows:
            if r["result"] == "error" and "selected" in r.get("error", ""):
                assert r["backend"] not in r["error"].split("selected", 1)[1]


def test_compat_forces_backends_by_capability() -> None:
    """The API used to force a backend is the one this PyTorch has; a name it cannot force is refused.

    Witness: whether this torch has ``torch.nn.attention.sdpa_kernel``, and ``flash_sdp_enabled`` read from torch."""
    import torch

    from qkvtrace.base import compat

    has_new = callable(getattr(getattr(torch.nn, "attention", None), "sdpa_kernel", None))
    assert compat.backend_forcing_api() == (
        "torch.nn.attention.sdpa_kernel" if has_new else "torch.backends.cuda.sdp_kernel"
    )
    with pytest.raises(compat.MissingCapability, match="NOT_A_BACKEND"), compat.forced_backend("NOT_A_BACKEND"):
        pass
    with compat.forced_backend("MATH"):
        assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_readme_headline_rows_are_what_the_committed_history_measured(committed: dict[str, Any]) -> None:
    """Witness: the headline rows written here, found in the committed history.json and in docs/compare.md."""
    readme = " ".join((ROOT / "docs" / "compare.md").read_text(encoding="utf-8").split())
    added = {
        (c["release"].split("+")[0], c["reason"]) for c in committed["fast_path_conditions"] if c["change"] == "added"
    }
    for release, reason in [("2.5.1", "forward pre-/hooks are attached to the module"),
                            ("2.3.1", "self_attn was passed bias=False"),
                            ("2.10.0", "mask_check enabled with torch.compile or torch.export")]:  # fmt: skip
        assert (release, reason) in added
        assert f"| {release} |" in readme and f"“{reason}”" in readme
    rows = {p["key"]: p["changes"] for p in committed["probes"] if p["kind"] == "fully_masked_rows"}
    (change,) = rows["F.scaled_dot_product_attention (bool mask) / default"]
    assert change["release"].startswith("2.5.1")
    assert (change["was"]["result"], change["was"]["grad_finite"], change["became"]["result"]) == ("nan", False, "zero")
    assert "SDPA's fully-masked rows stop returning NaN" in readme
    first = {s["name"]: s["first_seen"] for s in committed["sources"]}
    assert first["torch.nn.attention.sdpa_kernel"].startswith("2.3.1")


def test_collect_refuses_a_path_that_is_not_a_python(tmp_path: Path) -> None:
    """Witness: a path named here where no file exists."""
    proc = _run("history", "--python", str(tmp_path / "no-python"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not an executable file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_collect_under_an_interpreter_writes_a_report_folder(tmp_path: Path) -> None:
    """The collector shipped to another interpreter (here this one) writes what `inspect` writes.

    Witness: the files listed in the written folder, and this interpreter's ``torch.__version__``."""
    import torch

    proc = _run("history", "--python", sys.executable, "--out", str(tmp_path), "--no-timeline")
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / f"torch-{torch.__version__}"
    assert {p.name for p in folder.iterdir()} >= {"report.json", "report.md", "callgraph.dot"}
    ((_, report),) = find_reports([folder])
    assert report["environment"]["torch_version"] == torch.__version__


@pytest.mark.slow
def test_the_main_command_run_elsewhere_leaves_the_committed_checks_passing(tmp_path: Path) -> None:
    """The README's main command, ``qkvtrace inspect``, run on another machine (here: this one, with
    Python reporting another version and another platform) into a copy of reports/, must not make
    the committed history stale nor change what any committed diff says.

    Witness: the committed reports/history.json and reports/diffs/*.json, compared with what the tool
    builds from the copy holding the freshly written report.
    """
    import shutil

    import torch

    copy = tmp_path / "reports"
    shutil.copytree(REPORTS, copy)
    code = (
        "import platform, sys, torch\n"
        "platform.python_version = lambda: '3.99.1'\n"  # another Python, another machine
        "platform.machine = lambda: 'elsewhere64'\n"
        "from qkvtrace.cli.main import main\n"
        f"sys.exit(main(['inspect', '--out', {str(copy)!r}]))"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((copy / f"torch-{torch.__version__}" / "report.json").read_text(encoding="utf-8"))
    assert written["environment"]["python_version"] == "3.99.1"  # the environment is recorded as it was
    assert written["environment"]["platform"].endswith("-elsewhere64")

    committed = json.loads((REPORTS / "history.json").read_text(encoding="utf-8"))
    folders = [copy / p.name for p in _committed_report_folders()]
    if (REPORTS / f"torch-{torch.__version__}").exists():  # this build has a committed report: now rewritten
        assert build_history(find_reports(folders)) == committed
    for path in sorted((REPORTS / "diffs").glob("*.json")):
        old = json.loads(path.read_text(encoding="utf-8"))
        a, b = (load_report(copy / f"torch-{v}") for v in (old["a"], old["b"]))
        assert json.loads(json.dumps(diff_reports(a, b))) == old, path.name
