"""Every command's terminal output at 80, 100 and 200 columns: names whole, reasons uncut, colour only on a terminal.

The model has module names of 40 to 90 characters, as real models do
(``model.encoder.layer.11.attention.self``), and calls that take four
different paths, so PyTorch's reasons, paths and backends all appear. What
must appear comes from witnesses (``witnessed``): the model's own modules,
torch.profiler and PyTorch's own reasons on an untraced run, and the committed
reports read here; never from qkvtrace's output.
"""

from __future__ import annotations

import io
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
from _witness import learn_kernel_backends, local_at_return, profiled
from rich.console import Console
from torch import nn

from qkvtrace.analyses.reportio import load_report
from qkvtrace.render.diff_render import diff_renderable
from qkvtrace.render.terminal import calls_table, trace_table

HERE = Path(__file__).resolve().parent
REPORTS = HERE.parent / "reports"
WIDTHS = (80, 100, 200)
SGR = re.compile(r"\x1b\[([0-9;]*)m")

FACTORY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class HandWrittenScaledDotProductAttentionBlock(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.query_key_value_projection = nn.Linear(width, 3 * width)

        def forward(self, x):
            q, k, v = self.query_key_value_projection(x).chunk(3, dim=-1)
            return F.scaled_dot_product_attention(q, k, v)


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            # 3 heads: PyTorch refuses the fast path ("self.num_heads is not even")
            self.multi_head_self_attention_with_odd_head_count = nn.MultiheadAttention(width, 3, batch_first=True)
            self.sequence_first_cross_attention = nn.MultiheadAttention(width, 4)  # batch_first=False
            self.hand_written_scaled_dot_product_attention_block = HandWrittenScaledDotProductAttentionBlock(width)

        def forward(self, x):
            x = self.multi_head_self_attention_with_odd_head_count(x, x, x, need_weights=False)[0]
            t = x.transpose(0, 1)
            x = self.sequence_first_cross_attention(t, t, t, need_weights=False)[0].transpose(0, 1)
            return self.hand_written_scaled_dot_product_attention_block(x)


    class LongNames(nn.Module):
        def __init__(self, width=24):
            super().__init__()
            self.transformer_encoder_stack_with_descriptive_names = nn.ModuleList([Block(width)])
            self.fused_encoder_layer_at_the_end = nn.TransformerEncoderLayer(width, 4, 48, batch_first=True)

        def forward(self, x):
            for block in self.transformer_encoder_stack_with_descriptive_names:
                x = block(x)
            return self.fused_encoder_layer_at_the_end(x)


    def build():
        torch.manual_seed(0)
        return LongNames(), (torch.randn(2, 6, 24),)
    """
)


def _env(columns: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TERM")}
    return {**env, "COLUMNS": str(columns), "PYTHONWARNINGS": "ignore", **extra}


def qkv(*args: str, columns: int = 80, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True,
                          env=_env(columns, **env), cwd=cwd or HERE.parent, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("widths")
    (folder / "long_names.py").write_text(FACTORY)
    return folder


@pytest.fixture(scope="module")
def traced(factory: Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """stdout and the JSON trace of the same run, at each width."""
    runs = {}
    for width in WIDTHS:
        out = factory / f"t{width}.json"
        proc = qkv("trace", "long_names.py:build", "--json", str(out), columns=width, cwd=factory)
        assert proc.returncode == 0, proc.stderr
        runs[width] = (proc.stdout, json.loads(out.read_text()))
    return runs


@pytest.fixture(scope="module")
def witnessed(factory: Path) -> list[dict[str, Any]]:
    """The calls of the factory's model from witnesses: names and types of its attention modules; attention ops,
    backends (learned by forcing each one) and paths from torch.profiler, and PyTorch's ``why_not_fast_path``
    read with sys.settrace, both on an untraced eval/no_grad run (what ``qkvtrace trace`` runs)."""
    sys.path.insert(0, str(factory))
    try:
        import long_names  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    model, (x,) = long_names.build()
    model.eval()
    with torch.no_grad():
        segments = profiled(lambda: model(x)).segments
        _, found = local_at_return(nn.MultiheadAttention.forward.__code__, "why_not_fast_path", lambda: model(x))
    reasons = iter(found)
    backends = learn_kernel_backends(2, 2, 6, 8)
    attention = [(n, m) for n, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention) or type(m).__name__.startswith("HandWritten")]  # fmt: skip
    calls = []
    for index, ((name, module), ops) in enumerate(zip(attention, segments, strict=True)):
        if ops[0] == "aten::_transformer_encoder_layer_fwd":
            path, reason = "fused_encoder_layer", None
        elif isinstance(module, nn.MultiheadAttention):
            reason = next(reasons) or None
            path = "fast" if ops[0] == "aten::_native_multi_head_attention" else "fallback"
        else:
            path, reason = "sdpa", None
        calls.append({"index": index, "module": name, "module_type": type(module).__name__, "path": path,
                      "sdpa_backend": next((backends[op] for op in ops if op in backends), None),
                      "why_not_fast_path": reason, "aten_ops": ops})  # fmt: skip
    return calls


def _flat(text: str) -> str:
    return " ".join(text.split())


def _why_cells(out: str) -> str:
    """Output with each table row reduced to its last cell (the reason column), so wrapped reasons rejoin."""
    lines = []
    for line in out.splitlines():
        cells = [c for c in line.split("│") if c.strip()] if line.startswith("│") else [line]
        lines.append(cells[-1] if cells else "")
    return _flat("\n".join(lines))


def assert_whole(out: str, calls: list[dict[str, Any]], width: int) -> None:
    """Every module name, path and backend whole on one line; every reason uncut; nothing cropped."""
    lines = out.splitlines()
    assert "…" not in out, out  # rich's ellipsis: something was cut
    for call in calls:
        for fact in (call["module"], call["path"], call["sdpa_backend"] or "none"):
            assert any(fact in line for line in lines), f"{fact!r} is not whole on one line at {width}:\n{out}"
        if call["why_not_fast_path"]:
            assert _flat(call["why_not_fast_path"]) in _why_cells(out), (call["why_not_fast_path"], out)
    names = [c["module"] for c in calls]
    for line in lines:  # only a name longer than the terminal may run past it
        assert len(line) <= width or any(n in line for n in names), (width, line)


@pytest.mark.parametrize("width", WIDTHS)
def test_trace_shows_every_name_whole(traced: dict[int, tuple[str, dict[str, Any]]], width: int,
                                      witnessed: list[dict[str, Any]]) -> None:  # fmt: skip
    """Witness: ``witnessed`` (the model's modules, torch.profiler and PyTorch's reasons on an untraced run)."""
    out, data = traced[width]
    calls = witnessed
    facts = ("module", "path", "sdpa_backend", "why_not_fast_path")
    assert [[c[f] for f in facts] for c in data["calls"]] == [[c[f] for f in facts] for c in calls]
    assert {c["path"] for c in calls} >= {"fallback", "sdpa", "fused_encoder_layer"}, calls
    assert max(len(c["module"]) for c in calls) > width - 10 or width == 200  # names as long as the terminal
    assert sum(1 for c in calls if len(c["module"]) >= 40) >= 3
    assert any(c["why_not_fast_path"] for c in calls)
    assert_whole(out, calls, width)
    assert "\x1b[" not in out  # piped: plain text


def test_layout_follows_the_width(traced: dict[int, tuple[str, dict[str, Any]]],
                                  witnessed: list[dict[str, Any]]) -> None:  # fmt: skip
    """Wide: one table row per call, and it fits; narrow: one block per call, titled by the module name.

    Witness: ``witnessed`` (the model's attention modules, in the order the profiler saw their calls)."""
    wide, _ = traced[200]
    assert "┏" in wide and max(len(line) for line in wide.splitlines()) <= 200
    narrow, _ = traced[80]
    assert "┏" not in narrow
    for call in witnessed:
        assert f"#{call['index']}  {call['module']}" in narrow.splitlines()


@pytest.mark.parametrize("width", WIDTHS)
def test_secondary_columns_keep_names_whole(traced: dict[int, tuple[str, dict[str, Any]]], width: int,
                                            witnessed: list[dict[str, Any]]) -> None:  # fmt: skip
    """--columns all adds the type, norms and kernels; the numbers give way, the names do not.

    Witness: ``witnessed`` (module types from the model, attention ops from torch.profiler); the JSON is input."""
    from qkvtrace.records import TraceResult

    _, data = traced[200]
    result = TraceResult.from_dict(data)
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None)
    console.print(trace_table(result, title="t", width=width, columns=["type", "weights", "grads", "ops"]), crop=False)
    out = buf.getvalue()
    assert_whole(out, witnessed, width)
    for call in witnessed:
        assert call["module_type"] in out
        for op in call["aten_ops"]:
            assert any(op in line for line in out.splitlines()), op


def test_columns_option_and_bad_column(factory: Path) -> None:
    """Witness: the columns the test asks for, and the headers and message the test expects."""
    proc = qkv("trace", "long_names.py:build", "--columns", "type,weights", columns=200, cwd=factory)
    assert proc.returncode == 0, proc.stderr
    assert "module type" in proc.stdout and "|W| q/k/v" in proc.stdout and "|dW|" not in proc.stdout
    bad = qkv("trace", "demo:mha", "--columns", "speed")
    assert bad.returncode == 2 and "unknown column 'speed'" in bad.stderr and bad.stdout == ""


def _colours(text: str) -> set[str]:
    """SGR parameters that set a colour (foreground or background)."""
    found = set()
    for params in SGR.findall(text):
        parts = params.split(";")
        for i, p in enumerate(parts):
            if p in ("38", "48") or (p.isdigit() and (30 <= int(p) <= 37 or 40 <= int(p) <= 47 or 90 <= int(p) <= 107)):
                if i == 0 or parts[i - 1] not in ("38", "48", "5", "2"):
                    found.add(p)
    return found


def test_colour_only_on_a_terminal_and_never_with_no_color(factory: Path) -> None:
    """Witness: the FORCE_COLOR / NO_COLOR environment the test sets; colour codes counted with a regex here."""
    coloured = qkv("trace", "long_names.py:build", columns=100, cwd=factory, FORCE_COLOR="1")
    assert coloured.returncode == 0 and _colours(coloured.stdout), coloured.stdout
    plain = qkv("trace", "long_names.py:build", columns=100, cwd=factory, FORCE_COLOR="1", NO_COLOR="1")
    assert plain.returncode == 0
    assert not _colours(plain.stdout), repr(plain.stdout[:400])
    # the same words either way
    assert _flat(SGR.sub("", plain.stdout)) == _flat(SGR.sub("", coloured.stdout))


def test_progress_goes_to_stderr_only(factory: Path) -> None:
    """Witness: the target the test passes and the terminal it fakes (FORCE_COLOR) or not."""
    on_terminal = qkv("trace", "long_names.py:build", cwd=factory, FORCE_COLOR="1")
    assert "running long_names.py:build" in on_terminal.stderr  # the spinner, on stderr
    assert "running long_names.py:build" not in on_terminal.stdout
    piped = qkv("trace", "long_names.py:build", cwd=factory)
    assert piped.stderr == "" and "running" not in piped.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_check_calls_keep_names_whole(factory: Path, width: int, witnessed: list[dict[str, Any]]) -> None:
    """The calls `check` lists, rendered at each width, from the calls the tracer saw.

    Witness: ``witnessed`` (the model's modules, torch.profiler and PyTorch's reasons on an untraced run)."""
    sys.path.insert(0, str(factory))
    try:
        import long_names  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    from qkvtrace.analyses.check import run_checks

    model, args = long_names.build()
    report = run_checks(model, args, causal=True, trials=1, modes=("inference",))
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(calls_table(report.calls, "calls", width=width), crop=False)
    assert len(report.calls["inference"]) == len(witnessed) == 4
    assert_whole(buf.getvalue(), witnessed, width)


@pytest.mark.parametrize("width", WIDTHS)
def test_diff_names_whole(width: int, tmp_path: Path) -> None:
    """Function names in `diff --full` (call-graph edges, fast-path conditions, sources) are never folded.

    Witness: the two committed reports, read here: edges in one call graph and not the other, functions whose
    source text differs."""
    proc = qkv("diff", str(REPORTS / "torch-2.4.1+cu121"), str(REPORTS / "torch-2.13.0+cpu"), "--full", "--json",
               str(tmp_path / "d.json"), columns=width)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    old, new = load_report(REPORTS / "torch-2.4.1+cu121"), load_report(REPORTS / "torch-2.13.0+cpu")
    edges = [{(e["caller"], e["callee"]) for e in r["callgraph"]["edges"]} for r in (old, new)]
    texts = [{s["name"]: s["text"] for s in r["sources"]} for r in (old, new)]
    changed = sorted(n for n in texts[0].keys() & texts[1].keys() if texts[0][n] != texts[1][n])
    assert changed and edges[0] ^ edges[1]
    out = proc.stdout
    lines = out.splitlines()
    assert "…" not in out
    for edge in edges[0] ^ edges[1]:
        for name in edge:
            assert any(name in line for line in lines), (width, name)
    for name in changed:
        assert f"changed: {name}" in lines
    assert "\x1b[" not in out


def test_diff_source_in_syntax_colour_on_a_terminal_plain_when_piped(tmp_path: Path) -> None:
    """Witness: the committed reports' source texts, read here: the first function whose text differs, and
    every + / - line of its unified diff found in the new / old text. Colour codes counted with a regex here."""
    a, b = str(REPORTS / "torch-2.4.1+cu121"), str(REPORTS / "torch-2.13.0+cpu")
    assert qkv("diff", a, b, "--json", str(tmp_path / "d.json")).returncode == 0
    diff = json.loads((tmp_path / "d.json").read_text())
    old, new = ({s["name"]: s["text"].splitlines() for s in load_report(r)["sources"]} for r in (a, b))
    name = min(n for n in old.keys() & new.keys() if old[n] != new[n])
    unified = diff["source_diffs"][name].splitlines()
    assert all(line[1:] in new[name] for line in unified if line.startswith("+") and not line.startswith("+++"))
    assert all(line[1:] in old[name] for line in unified if line.startswith("-") and not line.startswith("---"))
    piped = qkv("diff", a, b, "--full", columns=100).stdout.splitlines()
    start = piped.index(f"changed: {name}") + 1
    assert piped[start : start + len(unified)] == unified  # the unified diff, line for line, uncut
    coloured = qkv("diff", a, b, "--full", columns=100, FORCE_COLOR="1").stdout
    added = next(line for line in unified if line.startswith("+") and "def " in line)
    row = next(line for line in coloured.splitlines() if SGR.sub("", line) == added)
    assert len(_colours(row)) >= 2, repr(row)  # the marker and the code in their own colours
    assert len(set(SGR.findall(row))) >= 3, repr(row)  # `def`, the name, the rest: highlighted, not one colour


def test_diff_renderable_tints_changed_lines_on_rich_terminals() -> None:
    """Witness: the colour systems the test gives rich's Console (truecolor or standard), for a committed diff."""
    diff = json.loads((REPORTS / "diffs" / "torch-2.4.1+cu121..torch-2.13.0+cpu.json").read_text())
    renders = {}
    for system in ("truecolor", "standard"):
        buf = io.StringIO()
        Console(file=buf, width=100, force_terminal=True, color_system=system).print(
            diff_renderable(diff, width=100, full=True), crop=False
        )
        renders[system] = buf.getvalue()
    assert "48;2;" in renders["truecolor"]  # a background tint on + / - lines
    assert "48;2;" not in renders["standard"]  # not where it could make text unreadable


@pytest.fixture(scope="module")
def scenarios() -> list[dict[str, Any]]:
    from qkvtrace.analyses.probes import run_scenarios

    return run_scenarios()[0]


@pytest.mark.parametrize("width", WIDTHS)
def test_probe_scenarios_keep_paths_and_reasons_whole(scenarios: list[dict[str, Any]], width: int) -> None:
    """probe's first table, from the scenarios measured here, at each width.

    Witness: the renderer's input (the scenarios measured here) against its printed text at a width chosen
    here: what is checked is that no fact is cut, not the facts, whose witness is the untraced profiler run in
    test_witness.py."""
    from qkvtrace.render.terminal import scenarios_table

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(scenarios_table(scenarios, width=width), crop=False)
    out = buf.getvalue()
    lines = out.splitlines()
    assert "…" not in out and all(len(line) <= width for line in lines), out
    calls = [c for s in scenarios for c in s.get("calls") or []]
    assert {"fast", "fallback", "fused_encoder_layer", "sdpa"} <= {c["path"] for c in calls}
    for c in calls:
        for fact in (c["path"], c["sdpa_backend"] or "none"):
            assert any(fact in line for line in lines), (width, fact)
        if c["why_not_fast_path"]:  # wrapped between words at most, never cut
            assert all(word in _why_cells(out).split() for word in c["why_not_fast_path"].split()), c
            if "│" not in out:
                assert _flat(c["why_not_fast_path"]) in _flat(out)


@pytest.mark.slow
def test_compare_progress_on_stderr_only(tmp_path: Path) -> None:
    """compare collects twice (tens of seconds): a spinner on stderr on a terminal, nothing in stdout.

    Witness: the terminal the test fakes (FORCE_COLOR), and the diff schema name the test expects."""
    proc = qkv("compare", "--python", sys.executable, "--python", sys.executable, "--out", str(tmp_path),
               "--json", str(tmp_path / "d.json"), columns=100, FORCE_COLOR="1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "collecting under" in proc.stderr and "(2 of 2)" in proc.stderr
    assert "collecting under" not in proc.stdout
    assert json.loads((tmp_path / "d.json").read_text())["schema"] == "qkvtrace.diff/1"


def test_report_diff_leads_with_behaviour_and_names_sources_without_full() -> None:
    """Without --full: behaviour before sources, changed functions named, no unified diff printed.

    Witness: the committed 2.4.1 → 2.13.0 diff JSON (what changed), read here.
    """
    a, b = str(REPORTS / "torch-2.4.1+cu121"), str(REPORTS / "torch-2.13.0+cpu")
    out = qkv("diff", a, b, columns=200).stdout
    diff = json.loads((REPORTS / "diffs" / "torch-2.4.1+cu121..torch-2.13.0+cpu.json").read_text())
    lines = out.splitlines()
    sources = next(i for i, line in enumerate(lines) if line.startswith("source changed:"))
    assert lines.index("behaviour that changed (measured)") < lines.index("fast-path conditions") < sources
    for name in diff["sources"]["changed"]:
        assert name in out and f"changed: {name}" not in out.splitlines()
    assert not any(line.startswith("@@") for line in out.splitlines())
