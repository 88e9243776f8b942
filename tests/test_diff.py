"""`qkvtrace diff` / `compare` over the committed reports, checked against facts verified by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkvtrace.analyses.diff import diff_reports
from qkvtrace.analyses.reportio import load_report
from qkvtrace.render.diff_render import diff_dot
from qkvtrace.render.graph import ENGINE_ENV, how_to_get_an_engine, layout_engine, render_svg

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
OLD, MID, NEW = "torch-2.4.1+cu121", "torch-2.13.0+cpu", "torch-2.14.1+cu130"
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
ENGINE = layout_engine()


def qkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {v: load_report(REPORTS / v) for v in (OLD, MID, NEW)}


def texts(report: dict) -> dict[str, str]:
    return {s["name"]: s["text"] for s in report["sources"]}


def test_close_versions_give_a_nearly_empty_diff(reports: dict[str, dict]) -> None:
    """Witness: facts checked by hand in both PyTorch trees, written in the test."""
    d = diff_reports(reports[MID], reports[NEW])
    # verified by reading both texts: 2.14.1 only rewrote the GQA paragraph of SDPA's docstring
    assert d["sources"] == {"changed": ["torch.nn.functional.scaled_dot_product_attention"], "added": [], "removed": []}
    assert "cuDNN attention" in d["source_diffs"]["torch.nn.functional.scaled_dot_product_attention"]
    assert d["fast_path_conditions"] == {"added": [], "removed": [], "reworded": []}
    assert d["callgraph"] == {"edges_added": [], "edges_removed": []}
    assert d["probes"]["changed"] == []
    assert d["summary"] == "torch 2.13.0+cpu → 2.14.1+cu130: 1 function changed"


def test_distant_versions_find_every_real_change(reports: dict[str, dict]) -> None:
    """Witness: the committed reports' source texts compared here, and facts checked by hand in both trees."""
    a, b = reports[OLD], reports[MID]
    d = diff_reports(a, b)
    ta, tb = texts(a), texts(b)
    # every function whose text differs, and no other, is "changed" (line moves alone are not)
    assert set(d["sources"]["changed"]) == {n for n in ta.keys() & tb.keys() if ta[n] != tb[n]}
    assert d["sources"]["added"] == sorted(tb.keys() - ta.keys())
    # facts checked by hand in the two PyTorch trees:
    assert "torch.nn.functional._check_key_padding_mask" in d["sources"]["added"]  # new helper after 2.4
    added = {(c["function"].rsplit(".", 2)[-2], c["reason"]) for c in d["fast_path_conditions"]["added"]}
    assert ("TransformerEncoderLayer", "forward pre-/hooks are attached to the module") in added
    assert ("TransformerEncoder", "mask_check enabled with torch.compile or torch.export") in added
    rows = {ch["key"]: (ch["was"], ch["became"]) for ch in d["probes"]["changed"] if ch["kind"] == "fully_masked_rows"}
    was, became = rows["F.scaled_dot_product_attention (bool mask) / MATH"]
    assert (was["result"], became["result"]) == ("nan", "zero")
    assert (was["grad_finite"], became["grad_finite"]) == (False, True)
    assert "fully-masked rows: nan → zero for" in d["summary"]
    edge = {"caller": "torch.nn.functional.multi_head_attention_forward",
            "callee": "torch.nn.functional._check_key_padding_mask"}  # fmt: skip
    assert edge in d["callgraph"]["edges_added"]


def test_same_version_is_empty(reports: dict[str, dict]) -> None:
    """Witness: by construction, one report against itself."""
    d = diff_reports(reports[MID], reports[MID])
    assert d["summary"].endswith("no change in the attention path")
    assert not any(d["sources"].values()) and d["probes"]["changed"] == []


def test_committed_diffs_are_what_diff_prints(reports: dict[str, dict]) -> None:
    """Witness: a change detector for the committed diff files (the tool's output, once); independently, the
    functions a diff lists as added, removed and changed are recomputed here from the two committed reports'
    source texts, compared as plain strings."""
    for a, b in ((OLD, MID), (MID, NEW)):
        committed = json.loads((REPORTS / "diffs" / f"{a}..{b}.json").read_text())
        assert committed == json.loads(json.dumps(diff_reports(reports[a], reports[b])))
        before = {s["name"]: s["text"] for s in reports[a]["sources"]}
        after = {s["name"]: s["text"] for s in reports[b]["sources"]}
        assert sorted(committed["sources"]["added"]) == sorted(after.keys() - before.keys())
        assert sorted(committed["sources"]["removed"]) == sorted(before.keys() - after.keys())
        changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
        assert sorted(committed["sources"]["changed"]) == changed and changed, (a, b)
        assert (REPORTS / "diffs" / f"{a}..{b}.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.skipif(ENGINE is None, reason=f"cannot draw SVG: {how_to_get_an_engine()}")
def test_cli_diff_writes_all_formats(tmp_path: Path) -> None:
    """Witness: the files the test asked for, and the versions, schema name and markers the test expects."""
    proc = qkv("diff", str(REPORTS / OLD), str(REPORTS / MID / "report.json"), "--json", str(tmp_path / "d.json"),
               "--md", str(tmp_path / "d.md"), "--svg", str(tmp_path / "d.svg"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("torch 2.4.1+cu121 → 2.13.0+cpu:")
    assert json.loads((tmp_path / "d.json").read_text())["schema"] == "qkvtrace.diff/1"
    md = (tmp_path / "d.md").read_text()
    assert "```diff" in md and "![union call graph" in md and "(d.svg)" in md
    assert "<svg" in (tmp_path / "d.svg").read_text()


def test_cli_diff_without_a_layout_program_writes_the_rest(tmp_path: Path) -> None:
    """Witness: the missing layout program the test names, and the files it asked for."""
    env = {**ENV, ENGINE_ENV: str(tmp_path / "no-such-program")}
    proc = qkv("diff", str(REPORTS / OLD), str(REPORTS / MID), "--md", str(tmp_path / "d.md"),
               "--svg", str(tmp_path / "d.svg"), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "d.svg was not drawn" in proc.stdout and "no-such-program" in proc.stdout
    assert not (tmp_path / "d.svg").exists() and "![union call graph" not in (tmp_path / "d.md").read_text()


@pytest.mark.skipif(
    ENGINE is None or not os.path.basename(ENGINE).startswith("graphviz-pure"),
    reason=f"the committed pictures are drawn by graphviz-pure; this machine has {ENGINE or 'no layout program'}",
)
def test_committed_diff_pictures_are_what_graphviz_pure_draws(reports: dict[str, dict]) -> None:
    """Byte for byte on any machine (graphviz-pure carries its fonts); redraw them when graphviz-pure changes.

    Witness: a change detector for the committed pictures (graphviz-pure's drawing, once); what the pictures show
    is witnessed by test_committed_diffs_are_what_diff_prints."""
    for a, b in ((OLD, MID), (MID, NEW)):
        drawing = render_svg(diff_dot(reports[a], reports[b], diff_reports(reports[a], reports[b])))
        assert drawing.svg is not None, drawing.problem
        same = drawing.svg == (REPORTS / "diffs" / f"{a}..{b}.svg").read_text(encoding="utf-8")
        assert same, f"reports/diffs/{a}..{b}.svg is not what graphviz-pure draws now"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("not json", "is not valid JSON"),
        ('{"schema": "qkvtrace.trace/1"}', 'expected "qkvtrace.report/1", got "qkvtrace.trace/1"'),
        ('{"schema": "qkvtrace.report/9"}', "newer than this qkvtrace reads"),
    ],
)
def test_cli_diff_refuses_bad_reports(tmp_path: Path, content: str, needle: str) -> None:
    """Witness: the bad file the test wrote, and the message the test expects."""
    bad = tmp_path / "report.json"
    bad.write_text(content)
    proc = qkv("diff", str(bad), str(REPORTS / MID))
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    missing = qkv("diff", str(tmp_path / "nope"), str(REPORTS / MID))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_diff_needs_no_torch() -> None:
    """Witness: torch blocked in ``sys.modules`` by the test; the versions of the reports it names."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from qkvtrace.analyses.reportio import load_report\nfrom qkvtrace.analyses.diff import diff_reports\n"
        f"d = diff_reports(load_report({str(REPORTS / OLD)!r}), load_report({str(REPORTS / MID)!r}))\n"
        "print(d['summary'])\n"
        "from qkvtrace.cli.main import main\n"
        f"sys.exit(main(['diff', {str(REPORTS / MID)!r}, {str(REPORTS / NEW)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch 2.4.1+cu121 → 2.13.0+cpu")
    assert "torch 2.13.0+cpu → 2.14.1+cu130: 1 function changed" in proc.stdout  # the command, too


def test_collector_runs_without_rendering_libraries() -> None:
    """What `compare` ships to the other environment needs torch only.

    Witness: the rendering libraries blocked in ``sys.modules`` by the test; the schema name the test expects."""
    code = (
        "import sys\nfor name in ('rich', 'networkx', 'graphviz'): sys.modules[name] = None\n"
        "import runpy; runpy.run_module('qkvtrace.analyses.report', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["schema"] == "qkvtrace.report/1"


def test_compare_same_interpreter_twice(tmp_path: Path) -> None:
    """The second interpreter given by a path relative to the working directory, as people type it.

    Witness: by construction, the same interpreter twice (so no change), and the files the test asked for."""
    here = Path(sys.executable).parent
    proc = subprocess.run([sys.executable, "-m", "qkvtrace", "compare", "--python", sys.executable, "--python",
                           f"./{Path(sys.executable).name}", "--out", str(tmp_path), "--md", str(tmp_path / "d.md")],
                          capture_output=True, text=True, env=ENV, cwd=here, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no change in the attention path" in proc.stdout
    assert (tmp_path / "diffs").is_dir() and (tmp_path / "d.md").exists()


@pytest.mark.parametrize("kind", ["not-python", "no-torch", "missing"])
def test_compare_refuses_bad_interpreters(tmp_path: Path, kind: str) -> None:
    """Witness: the bad interpreter the test made (or torch hidden from it), and the message the test expects."""
    if kind == "not-python":
        exe = tmp_path / "fake"
        exe.write_text("#!/bin/sh\nexit 3\n")
        exe.chmod(0o755)
        needle = "does not run as a Python interpreter"
    elif kind == "no-torch":
        exe = Path(sys.executable)
        needle = "cannot import torch"
    else:
        exe = tmp_path / "nothing"
        needle = "is not an executable file"
    env = dict(ENV)
    if kind == "no-torch":  # this interpreter, but torch hidden from it
        blocker = tmp_path / "block"
        blocker.mkdir()
        (blocker / "torch.py").write_text("raise ImportError('torch hidden for this test')\n")
        env["PYTHONPATH"] = str(blocker)
    proc = qkv("compare", "--python", str(exe), "--python", sys.executable, "--out", str(tmp_path / "o"), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def _live(name: str) -> object | None:
    """The object a report's dotted name names in the installed PyTorch, or None where it has none."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


def test_this_pytorch_against_a_stored_older_version(tmp_path: Path) -> None:
    """Two real PyTorch versions: the committed report of the installed torch (written by it: `qkvtrace inspect`,
    which CI runs before the tests) against the committed report of torch 2.4.1, through the real CLI.

    Witness: the installed PyTorch itself -- ``inspect.getsource`` of each Python function both reports name,
    compared here with the text 2.4.1's report holds (changed exactly where they differ), the functions the
    installed torch has and 2.4.1's report lacks (added), and what SDPA returns here for a fully-masked row
    (its math kernel forced), against what 2.4.1's report says it returned there.
    """
    import inspect

    import torch
    import torch.nn.functional as F

    mine = REPORTS / f"torch-{torch.__version__}"
    if not (mine / "report.json").exists():
        pytest.skip(f"no committed report of torch {torch.__version__} (`qkvtrace inspect` writes it)")
    old, new = load_report(REPORTS / OLD), load_report(mine)
    live = {}
    for s in new["sources"]:
        obj = _live(s["name"])
        if s["kind"] == "python" and obj is not None:
            live[s["name"]] = inspect.getsource(inspect.unwrap(obj))  # type: ignore[arg-type]
    assert live and all(live[s["name"]] == s["text"] for s in new["sources"] if s["name"] in live)  # written here
    proc = qkv("diff", str(REPORTS / OLD), str(mine), "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 0, proc.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    assert (d["a"], d["b"]) == (old["environment"]["torch_version"], torch.__version__)
    was = texts(old)
    assert set(d["sources"]["changed"]) & live.keys() == {n for n, t in live.items() if n in was and was[n] != t}
    assert set(d["sources"]["added"]) & live.keys() == live.keys() - was.keys()
    q = torch.zeros(1, 1, 3, 8)
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False  # query 0 may attend to no key
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        row = F.scaled_dot_product_attention(q, q, q, attn_mask=attend)[0, 0, 0]
    here = "nan" if bool(row.isnan().all()) else "zero" if bool((row == 0).all()) else "other"
    key = "F.scaled_dot_product_attention (bool mask) / MATH"
    [there] = [r["result"] for r in old["probes"]["fully_masked_rows"]
               if f"{r['api']} / {r['backend']}" == key]  # fmt: skip
    said = [(c["was"] or {}).get("result") for c in d["probes"]["changed"]
            if c["kind"] == "fully_masked_rows" and c["key"] == key]  # fmt: skip
    became = [(c["became"] or {}).get("result") for c in d["probes"]["changed"]
              if c["kind"] == "fully_masked_rows" and c["key"] == key]  # fmt: skip
    assert (said, became) == (([there], [here]) if there != here else ([], []))
