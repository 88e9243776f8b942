"""`qkvtrace inspect`: the per-version report."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.analyses.report import collect_report, dumps_report, load_report
from qkvtrace.facts import introspect
from qkvtrace.render.graph import ENGINE_ENV, how_to_get_an_engine, layout_engine, render_svg, report_graph, to_dot

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
ENGINE = layout_engine()
needs_layout_engine = pytest.mark.skipif(ENGINE is None, reason=f"cannot draw SVG: {how_to_get_an_engine()}")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return collect_report()


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in report["sources"]}


def qkv(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, env=env or ENV, cwd=cwd, timeout=300
    )


def test_collection_is_deterministic(report: dict[str, Any]) -> None:
    """Witness: a second collection made here, and torch's install folder read from ``torch.__file__``."""
    assert dumps_report(collect_report()) == dumps_report(report)
    text = dumps_report(report)
    assert str(Path(torch.__file__).parent) not in text  # no absolute paths
    assert report["schema"] == "qkvtrace.report/1"


def test_sources_are_the_installed_text(report: dict[str, Any]) -> None:
    """Witness: ``inspect.getsource`` of the installed PyTorch, hashed here with ``hashlib``."""
    sources = by_name(report)
    entry = sources["torch.nn.modules.activation.MultiheadAttention.forward"]
    expected = inspect.getsource(nn.MultiheadAttention.forward)
    assert entry["text"] == expected
    assert entry["sha256"] == hashlib.sha256(expected.encode()).hexdigest()
    assert entry["file"] == "nn/modules/activation.py"
    assert entry["lineno"] == inspect.getsourcelines(nn.MultiheadAttention.forward)[1]
    for s in report["sources"]:
        assert s["sha256"] == hashlib.sha256(s["text"].encode()).hexdigest()
        assert s["kind"] in ("python", "builtin")


def test_discovery_follows_calls(report: dict[str, Any]) -> None:
    """Every torch.nn.functional helper that multi_head_attention_forward's source calls is read.

    Witness: the helpers' names found here with a regex in ``inspect.getsource`` of the installed function."""
    sources = by_name(report)
    text = inspect.getsource(F.multi_head_attention_forward)
    called = set(re.findall(r"\b(_[a-z_]+)\(", text))
    helpers = {n for n in called if inspect.isfunction(getattr(F, n, None))}
    assert helpers, "expected private helpers in the fallback's source"
    for helper in helpers:
        assert f"torch.nn.functional.{helper}" in sources, helper
    # not a fixed list: each entry point's discovered callees are in the call graph
    edges = {(e["caller"], e["callee"]) for e in report["callgraph"]["edges"]}
    for helper in helpers:
        assert ("torch.nn.functional.multi_head_attention_forward", f"torch.nn.functional.{helper}") in edges


def test_builtins_record_signature_and_aten_ops(report: dict[str, Any]) -> None:
    """Witness: ``inspect.getdoc`` of the installed SDPA, and the aten op names written here."""
    sources = by_name(report)
    native = sources["torch._native_multi_head_attention"]
    assert native["kind"] == "builtin" and native["file"] is None
    assert "aten::_native_multi_head_attention" in native["aten_ops"]
    sdpa = sources["torch.nn.functional.scaled_dot_product_attention"]
    assert sdpa["kind"] == "builtin"
    assert sdpa["text"] == inspect.getdoc(F.scaled_dot_product_attention)
    assert "aten::scaled_dot_product_attention" in sdpa["aten_ops"]


def _reason_matches(why: str, reason: str) -> bool:
    """Is ``why`` (a string PyTorch computed) the reason ``reason`` (its source form)?

    Plain strings must be equal; an f-string's literal parts must match and each
    ``{...}`` field stands for some non-empty text.
    """
    if not reason.startswith(("f'", 'f"')):
        return why == reason
    parts = re.split(r"(\{[^{}]*\})", reason[2:-1])
    pattern = "".join(".+" if p.startswith("{") else re.escape(p) for p in parts)
    return re.fullmatch(pattern, why, flags=re.DOTALL) is not None


def test_reason_matcher_needs_the_whole_reason() -> None:
    """Witness: the reason strings and the f-string template written here."""
    template = 'f"dtypes of query ({query.dtype}) and self.in_proj_weight ({self.in_proj_weight.dtype}) don\'t match"'
    assert _reason_matches(
        "dtypes of query (torch.float16) and self.in_proj_weight (torch.float32) don't match", template
    )
    assert not _reason_matches("training is enabled", template)
    assert not _reason_matches("dtypes of query (torch.float16)", template)
    assert _reason_matches("training is enabled", "training is enabled")
    assert not _reason_matches("training is", "training is enabled")


def _source_reasons(fn: Any) -> list[str]:
    """Every non-empty value ``fn``'s source assigns to ``why_not_fast_path``, in the form ``_reason_matches`` reads:
    a plain string as its value, an f-string as its source text."""
    src = textwrap.dedent(inspect.getsource(fn))
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "why_not_fast_path" for t in node.targets):
            if isinstance(node.value, ast.Constant) and node.value.value:
                found.append(node.value.value)
            elif isinstance(node.value, ast.JoinedStr):
                found.append(ast.get_source_segment(src, node.value) or "")
    return found


def test_fast_path_conditions_match_source_and_observation(report: dict[str, Any]) -> None:
    """Witness: the installed ``MultiheadAttention.forward`` source (its assignments, read here with a regex
    and with ``ast``), and the reason and condition written here for the encoder layer."""
    blocks = {b["function"]: b["conditions"] for b in report["fast_path_conditions"]}
    mha_src = inspect.getsource(nn.MultiheadAttention.forward)
    reasons = [c["reason"] for c in blocks["torch.nn.modules.activation.MultiheadAttention.forward"]]
    # as many as there are non-empty assignments in the source, in source order
    assigned = re.findall(r"why_not_fast_path = (?!\"\"|'')", mha_src)
    assert len(reasons) == len(assigned)
    # each found after the previous one (long reasons span lines: locate them by their start)
    position = 0
    for r in reasons:
        position = mha_src.find(r[2:14] if r.startswith(("f'", 'f"')) else r[:20], position + 1)
        assert position > 0, r
    # every reason the tracer observed in the scenarios is one the source assigns (read here with ast)
    in_source = _source_reasons(nn.MultiheadAttention.forward)
    assert len(in_source) == len(assigned)
    observed = {
        c["why_not_fast_path"] for s in report["probes"]["scenarios"] for c in s["calls"] if c["why_not_fast_path"]
    }
    assert observed
    for why in observed:
        assert any(_reason_matches(why, r) for r in in_source), why
    layer = blocks["torch.nn.modules.transformer.TransformerEncoderLayer.forward"]
    assert any(c["reason"] == "training is enabled" and c["condition"] == "self.training" for c in layer)


def test_call_graph_marks_paths(report: dict[str, Any]) -> None:
    """Witness: PyTorch's call structure as written here (which path reaches which function or aten op)."""
    edges = {(e["caller"], e["callee"]): e for e in report["callgraph"]["edges"]}
    mha = "torch.nn.modules.activation.MultiheadAttention.forward"
    fast = edges[(mha, "torch._native_multi_head_attention")]
    assert "dynamic" in fast["kind"] and fast["paths"] == ["fast"]
    fallback = edges[(mha, "torch.nn.functional.multi_head_attention_forward")]
    assert "fallback" in fallback["paths"] and {"static", "dynamic"} <= set(fallback["kind"])
    layer = "torch.nn.modules.transformer.TransformerEncoderLayer.forward"
    assert "fused_encoder_layer" in edges[(layer, "torch._transformer_encoder_layer_fwd")]["paths"]
    assert any(e["callee"].startswith("aten::_scaled_dot_product") for e in report["callgraph"]["edges"])
    dot = to_dot(report_graph(report), "t")
    assert "rankdir=LR" in dot and "cluster_" in dot and "nn/functional.py" in dot
    assert "style=dashed" in dot and "aten::scaled_dot_product_attention" in dot


def test_scenarios_reuse_the_tracer(report: dict[str, Any]) -> None:
    """Witness: the path, reason and SDPA backend each scenario forces, written here."""
    scenarios = {s["name"]: s for s in report["probes"]["scenarios"]}
    assert len(scenarios) >= 12
    assert [c["path"] for c in scenarios["encoder_inference"]["calls"]] == ["fused_encoder_layer"] * 2
    assert scenarios["mha_train"]["calls"][0]["why_not_fast_path"] == "training is enabled"
    assert scenarios["sdpa_forced_math"]["calls"][0]["sdpa_backend"] == "MATH"


def test_missing_functions_are_recorded_not_fatal() -> None:
    """Witness: a name written here that torch.nn.functional does not have, beside one it has."""
    found = introspect.discover(
        ("torch.nn.functional.no_such_attention", "torch.nn.functional.multi_head_attention_forward")
    )
    assert "torch.nn.functional.no_such_attention" in found.missing
    assert "torch.nn.functional.multi_head_attention_forward" in found.entries


@needs_layout_engine
def test_cli_writes_report_and_a_second_run_keeps_it(tmp_path: Path) -> None:
    """Witness: the files listed in the output folder, the first run's report.json bytes, and ``torch.__version__``."""
    proc = qkv("inspect", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / f"torch-{torch.__version__}"
    assert sorted(p.name for p in folder.iterdir()) == ["callgraph.dot", "callgraph.svg", "report.json", "report.md"]
    first = (folder / "report.json").read_bytes()
    assert "<svg" in (folder / "callgraph.svg").read_text()
    md = (folder / "report.md").read_text()
    assert "![call graph](callgraph.svg)" in md and "<details>" in md and "What runs when" in md
    proc = qkv("inspect", "--out", str(tmp_path))
    assert proc.returncode == 0 and "kept the report there: it says the same" in proc.stdout
    assert (folder / "report.json").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no temp folders left
    assert load_report(folder)["environment"]["torch_version"] == torch.__version__


def _without_graphviz_on_path(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if k != ENGINE_ENV}
    return {**env, "PATH": str(tmp_path / "empty-bin")}  # no `dot`, no `graphviz-pure` on PATH


def test_cli_draws_the_picture_with_no_graphviz_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: an empty PATH built here, and the nodes and edges of the written report.json read with json."""
    env = _without_graphviz_on_path(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    if layout_engine() is None:
        pytest.skip(f"nothing installed with this Python draws SVG: {how_to_get_an_engine()}")
    proc = qkv("inspect", "--out", str(tmp_path / "r"), env=env)
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "r" / f"torch-{torch.__version__}"
    svg = (folder / "callgraph.svg").read_text()
    assert "drawn by graphviz-pure" in proc.stdout and "(graphviz-pure)" in svg  # the engine names itself
    callgraph = json.loads((folder / "report.json").read_text(encoding="utf-8"))["callgraph"]
    edges = {(e["caller"], e["callee"]) for e in callgraph["edges"]}
    nodes = {n["name"] for n in callgraph["nodes"]} | {name for edge in edges for name in edge}
    assert svg.count('class="node"') == len(nodes) + 1  # + the legend
    assert svg.count('class="edge"') == len(edges)


def test_without_a_layout_program_the_old_picture_is_kept(
    tmp_path: Path, report: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Witness: the missing program named here, the SVG text written here, and the line appended to the .dot."""
    from qkvtrace.cli.inspect_cmd import picture_note, write_report_dir

    monkeypatch.setenv(ENGINE_ENV, str(tmp_path / "no-such-program"))
    first = write_report_dir(report, tmp_path)
    assert first.picture == "none" and not (first.folder / "callgraph.svg").exists()
    assert (first.folder / "callgraph.dot").exists() and "no-such-program" in (picture_note(first) or "")
    # a picture from an earlier run (or a commit) survives a run that cannot draw
    committed = '<svg xmlns="http://www.w3.org/2000/svg"><text>drawn earlier</text></svg>\n'
    (first.folder / "callgraph.svg").write_text(committed)
    again = write_report_dir(report, tmp_path)
    assert again.replaced and again.picture == "kept"
    assert (again.folder / "callgraph.svg").read_text() == committed
    assert "![call graph](callgraph.svg)" in (again.folder / "report.md").read_text()
    assert "the call graph is unchanged" in (picture_note(again) or "")
    # ... and is kept, but called out of date, when the graph it was drawn from changed
    with (again.folder / "callgraph.dot").open("a") as f:
        f.write("// an older call graph\n")
    stale = write_report_dir(report, tmp_path)
    assert stale.picture == "kept-stale" and (stale.folder / "callgraph.svg").read_text() == committed
    assert "![call graph]" not in (stale.folder / "report.md").read_text()
    assert "OUT OF DATE" in (picture_note(stale) or "")
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.folder.name]


def test_cli_without_a_layout_program_says_how_to_get_one(tmp_path: Path) -> None:
    """Witness: the missing program named here, and the files listed in the output folder."""
    proc = qkv("inspect", "--out", str(tmp_path), env={**ENV, ENGINE_ENV: str(tmp_path / "no-such-program")})
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / f"torch-{torch.__version__}"
    assert (folder / "callgraph.dot").exists() and not (folder / "callgraph.svg").exists()
    assert "callgraph.svg was not drawn" in proc.stdout and "no-such-program" in proc.stdout


def test_how_to_get_a_layout_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: the install commands and the missing program path written here."""
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    assert "pip install graphviz-pure" in how_to_get_an_engine()
    assert "apt-get install graphviz" in how_to_get_an_engine()
    monkeypatch.setenv(ENGINE_ENV, "/nowhere/dot")
    assert layout_engine() is None and "'/nowhere/dot'" in how_to_get_an_engine()


@pytest.mark.parametrize("kind", ["file", "under-file"])
def test_cli_bad_out(tmp_path: Path, kind: str) -> None:
    """Witness: the file written here that blocks the output folder, and its path."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = blocker if kind == "file" else blocker / "sub"
    proc = qkv("inspect", "--out", str(out))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert str(out) in proc.stderr


def test_interrupted_write_keeps_old_report(tmp_path: Path, report: dict[str, Any]) -> None:
    """Witness: report.json's bytes read before the broken write, and the folder listing after it."""
    from qkvtrace.cli.inspect_cmd import write_report_dir

    folder = write_report_dir(report, tmp_path).folder
    before = (folder / "report.json").read_bytes()
    broken = {**report, "probes": {}}  # rendering report.md fails half-way
    with pytest.raises(KeyError):
        write_report_dir(broken, tmp_path)
    assert (folder / "report.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_a_run_that_finds_the_same_keeps_the_report_there(tmp_path: Path, report: dict[str, Any]) -> None:
    """Witness: the edits made here to the written report.json (another machine's Python and platform,
    an error 1.5x and then 10x this run's, a path PyTorch did not take) and that file's bytes."""
    from qkvtrace.cli.inspect_cmd import write_report_dir

    folder = write_report_dir(report, tmp_path).folder
    there = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    there["environment"].update(python_version="3.0.0", platform="Other-machine")
    row = next(r for r in there["probes"]["reference"] if (r["grad_max_abs_err"] or 0) > 1e-4)
    measured = row["grad_max_abs_err"]
    row["grad_max_abs_err"] = measured * 1.5  # rounding noise: another run, thread count or CPU
    (folder / "report.json").write_text(dumps_report(there), encoding="utf-8")
    noisy = (folder / "report.json").read_bytes()

    written = write_report_dir(report, tmp_path)
    assert written.kept and (folder / "report.json").read_bytes() == noisy

    for change in ("error 10x", "another path"):
        there = json.loads(noisy)
        if change == "error 10x":
            next(r for r in there["probes"]["reference"] if r["key"] == row["key"] and r["dtype"] == row["dtype"])[
                "grad_max_abs_err"
            ] = measured * 10
        else:
            there["probes"]["scenarios"][0]["calls"][0]["path"] = "no such path"
        (folder / "report.json").write_text(dumps_report(there), encoding="utf-8")
        written = write_report_dir(report, tmp_path)
        assert not written.kept and written.replaced, change
        assert (folder / "report.json").read_text(encoding="utf-8") == dumps_report(report), change


COMMITTED = ROOT / "reports" / f"torch-{torch.__version__}" / "report.json"


@pytest.mark.skipif(not COMMITTED.exists(), reason=f"no committed report for torch {torch.__version__}")
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_main_command_leaves_a_fresh_clone_clean(tmp_path: Path) -> None:
    """Witness: ``git status`` of a fresh clone of this checkout's commit after the README's main command ran in it."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    # the installed command, as the README runs it (``python -m`` would import the clone's own package)
    command = Path(sys.executable).with_name("qkvtrace")
    proc = subprocess.run([str(command), "inspect"], capture_output=True, text=True, env=ENV, cwd=clone, timeout=300)
    assert proc.returncode == 0, proc.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == "", status.stdout


@pytest.mark.skipif(not COMMITTED.exists(), reason=f"no committed report for torch {torch.__version__}")
def test_committed_report_matches_regeneration(report: dict[str, Any]) -> None:
    """Witness: the committed report.json for this torch, read with json."""
    committed = json.loads(COMMITTED.read_text())
    assert {(s["name"], s["sha256"]) for s in committed["sources"]} == {
        (s["name"], s["sha256"]) for s in report["sources"]
    }
    assert committed["fast_path_conditions"] == report["fast_path_conditions"]
    assert committed["callgraph"] == report["callgraph"]
    assert committed["probes"]["scenarios"] == report["probes"]["scenarios"]


@pytest.mark.skipif(
    ENGINE is None or not os.path.basename(ENGINE).startswith("graphviz-pure"),
    reason=f"the committed pictures are drawn by graphviz-pure; this machine has {ENGINE or 'no layout program'}",
)
@pytest.mark.parametrize("version", sorted(p.parent.name for p in (ROOT / "reports").glob("torch-*/callgraph.dot")))
def test_committed_pictures_are_what_graphviz_pure_draws(version: str) -> None:
    """graphviz-pure measures text with the fonts it carries, so any machine redraws a committed picture
    byte for byte; a difference means graphviz-pure changed its output and the pictures need redrawing.

    Witness: the committed callgraph.svg files."""
    folder = ROOT / "reports" / version
    drawing = render_svg((folder / "callgraph.dot").read_text(encoding="utf-8"))
    assert drawing.svg is not None, drawing.problem
    same = drawing.svg == (folder / "callgraph.svg").read_text(encoding="utf-8")
    assert same, f"reports/{version}/callgraph.svg is not what graphviz-pure draws from its callgraph.dot"
