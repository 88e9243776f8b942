"""A newcomer's first hour, second round: what they tripped on, through the real command line."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from _witness import qkv

MYMODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        return nn.Sequential(nn.Linear(8, 8), layer), torch.randn(2, 5, 8)
    """
)


@pytest.fixture
def mymodels(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    return tmp_path


@pytest.mark.parametrize("target", ["mymodels.py:build", "mymodels:build"])
def test_compare_reads_a_relative_target_as_trace_does(mymodels: Path, target: str) -> None:
    """Witness: ``qkvtrace trace`` run in the same folder on the same TARGET (its JSON read with json), and the
    same interpreter twice (so no change): compare must find the model of the file written here."""
    traced = qkv("trace", target, "--json", "t.json", cwd=mymodels)
    assert traced.returncode == 0, traced.stderr
    proc = qkv("compare", "--python", sys.executable, "--python", sys.executable, target, "--out", "out", cwd=mymodels)
    assert proc.returncode == 0, proc.stderr
    written = sorted((mymodels / "out" / "traces").glob("*.json"))
    assert len(written) == 2
    ours = json.loads(written[0].read_text())
    theirs = json.loads((mymodels / "t.json").read_text())
    assert [c["module"] for c in ours["calls"]] == [c["module"] for c in theirs["calls"]] == ["1.self_attn"]


BAD = "missing.py:build"


@pytest.mark.parametrize(
    "command",
    [
        ["trace", BAD],
        ["grads", BAD],
        ["check", BAD, "--causal"],
        ["advise", BAD],
        ["compare", "--python", sys.executable, "--python", sys.executable, BAD, "--out", "out"],
    ],
    ids=lambda c: c[0],
)
def test_every_command_refuses_a_missing_target_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """Witness: the file name given here, which does not exist in the folder the command runs in."""
    proc = qkv(*command, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'missing.py'" in lines[0] and "does not exist" in lines[0]


ROOT = Path(__file__).resolve().parents[1]


def test_every_changed_report_row_shows_what_changed() -> None:
    """Witness: the two committed reports read here as plain JSON: for each scenario whose calls differ, the fields
    that differ are found here, and the Markdown row of the diff must show both sides apart, with those values."""
    from qkvtrace.analyses.diff import diff_reports
    from qkvtrace.render.diff_render import diff_markdown

    a, b = (json.loads((ROOT / "reports" / v / "report.json").read_text()) for v in
            ("torch-2.4.1+cu121", "torch-2.13.0+cpu"))  # fmt: skip
    md = diff_markdown(diff_reports(a, b))
    rows = {r.split(" | ")[1]: r.strip("| ").split(" | ") for r in md.splitlines() if r.startswith("| scenario |")}
    sa, sb = ({s["name"]: s for s in r["probes"]["scenarios"]} for r in (a, b))
    checked = 0
    for name, row in rows.items():
        assert row[2] != row[3], row  # was and became read differently
        calls_a, calls_b = (s[name].get("calls") or [] if name in s else [] for s in (sa, sb))
        if len(calls_a) == len(calls_b) == 1 and calls_a[0]["path"] == calls_b[0]["path"]:
            differ = [k for k in ("sdpa_refusals",) if calls_a[0].get(k) != calls_b[0].get(k)]
            for key in differ:
                ra, rb = calls_a[0][key] or {}, calls_b[0][key] or {}
                apart = [k for k in sorted(ra.keys() | rb.keys()) if ra.get(k) != rb.get(k)]
                for backend in apart:
                    assert backend in row[2] and backend in row[3], (name, row)
                    for side, refusals in ((row[2], ra), (row[3], rb)):
                        assert " ".join(refusals.get(backend, ["absent"])) in side, (name, side)
                checked += 1
    assert checked  # sdpa_forced_math is such a row: same path and backend, other refusals


@pytest.mark.parametrize("width, length", [(80, 16), (60, 20), (120, 20)])
def test_terminal_maps_fit_the_width_and_keep_every_label_and_maximum(width: int, length: int) -> None:
    """Witness: PyTorch's own attention weights (``need_weights=True, average_attn_weights=False``) of the same call:
    every head's every row must be printed with its whole label and its maximum, at the console's width."""
    import re

    import torch
    from rich.console import Console
    from torch import nn

    import qkvtrace
    from qkvtrace.render.maps_render import terminal_maps

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(1, length, 16)
    with torch.no_grad():
        _, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
        with qkvtrace.trace(mha, attention_maps=True) as t:
            mha(x, x, x, need_weights=False)
    labels = [f"word{i:02d}" for i in range(length)]
    console = Console(width=width, record=True, color_system=None)
    for part in terminal_maps(t.result, [labels], width=console.width):
        console.print(part)
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    from collections import Counter

    printed = Counter(pair for line in lines  # each head's row: "<label> <shades> <max>", heads side by side
                      for pair in re.findall(r"(word\d\d) [ ·░▒▓█]+ (\d\.\d\d)", line))  # fmt: skip
    want = Counter((labels[q], f"{float(weights[0, h, q].max()):.2f}") for h in range(4) for q in range(length))
    assert printed == want
    assert "…" not in console.export_text()


def test_a_terminal_map_wider_than_the_console_is_named_not_cut() -> None:
    """Witness: the map's width worked out here (label, 20 keys, the max, 2 spaces between) against 30 columns."""
    import torch
    from rich.console import Console
    from torch import nn

    import qkvtrace
    from qkvtrace.render.maps_render import terminal_maps

    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(1, 20, 16)
    with torch.no_grad(), qkvtrace.trace(mha, attention_maps=True) as t:
        mha(x, x, x, need_weights=False)
    console = Console(width=30, record=True, color_system=None)
    for part in terminal_maps(t.result, [[f"word{i:02d}" for i in range(20)]], width=console.width):
        console.print(part)
    text = " ".join(console.export_text().split())
    assert f"{6 + 2 + 20 + 2 + 4} columns wide" in text and "0." not in text


def test_trace_compile_of_a_model_without_hand_written_attention_neither_warns_nor_calls_graphs_reasons(
    tmp_path: Path,
) -> None:
    """Witness: the tiny LM's own source, which calls F.scaled_dot_product_attention (no attention by hand), and
    the profiler of its compiled run here, which names the kernel the compiled code calls."""
    import inspect

    import torch
    from torch.profiler import ProfilerActivity, profile

    from qkvtrace.analyses.demos import CausalSelfAttention, demo_tiny_lm

    assert "scaled_dot_product_attention" in inspect.getsource(CausalSelfAttention.forward)
    model, args = demo_tiny_lm()
    torch._dynamo.reset()
    compiled = torch.compile(model.eval())
    with torch.no_grad():
        compiled(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(*args)
    torch._dynamo.reset()
    kernels = {e.name.removeprefix("aten::") for e in prof.events() if "scaled_dot_product" in e.name}
    assert kernels
    proc = qkv("trace", "demo:tiny-lm", "--compile", "--json", "t.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not watched" not in proc.stdout and "warning" not in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "why not fast" in line)
    assert "compiled code runs" in header
    for line in proc.stdout.splitlines():
        if line.startswith("│ #c"):
            why, runs = (cell.strip() for cell in line.split("│")[5:7])
            assert why == "-" and any(k.startswith(runs.removeprefix("aten.")[:20]) for k in kernels), line
    assert json.loads((tmp_path / "t.json").read_text())["warnings"] == []


def test_a_model_compiled_before_the_trace_is_said_to_be(tmp_path: Path) -> None:
    """A model compiled and warmed up before any trace: its attention is recorded from Dynamo's cache, as the
    graphs compiled inside a trace record it. Witness: the same model, after ``torch._dynamo.reset()``, compiled
    again inside a new trace (records read from PyTorch's compile log as the graph is made): the same modules,
    entry points and kernels."""
    import torch

    import qkvtrace
    from qkvtrace.analyses.demos import demo_tiny_lm

    model, args = demo_tiny_lm()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model.eval())
        with torch.no_grad():
            compiled(*args)  # compiled and warmed up before any trace
            with qkvtrace.trace(model) as t:
                compiled(*args)
        assert not t.result.unobserved, t.result.unobserved
        cached = {op.module: (op.entry, op.runs) for op in t.result.compiled}
        assert set(cached) == {"blocks.0.attention", "blocks.1.attention"}
        assert all("compiled before the trace opened" in op.evidence[0] for op in t.result.compiled)
        torch._dynamo.reset()
        with torch.no_grad(), qkvtrace.trace(model) as again:
            compiled(*args)
        assert {op.module: (op.entry, op.runs) for op in again.result.compiled} == cached
        assert not again.result.unobserved
    finally:
        torch._dynamo.reset()
