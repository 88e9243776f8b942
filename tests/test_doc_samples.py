"""Every sample in README.md and docs/*.md, run or at least checked, so the documentation cannot drift.

A sample is a fenced block whose first line is ``$ qkvtrace ...`` (the command, then what it printed)
or a fenced ``python`` block. An HTML comment on the line before the fence says how it is checked:

* ``<!-- sample: exact -->``: the command is run; its output must be the block's lines after the command;
* ``<!-- sample: excerpt -->``: the command is run; the block's lines must appear in its output, in order;
* ``<!-- sample: runs -->``: the command (or the Python block) is run and must exit 0;
* ``<!-- sample: skip REASON -->``: not run (say why: it takes minutes, needs the network, writes files...).

Without a comment a command is parsed by the real argument parser (every sub-command and option it
names must exist), and a Python block is compiled (it may be a fragment that uses names from its page).
Running samples is slow (``-m slow``); their printed output is compared only on the torch release
that printed it, the one the README's commands install.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"<!--\s*sample:\s*(exact|excerpt|runs|skip)\b\s*(.*?)\s*-->")
ENV = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8", "PYTHONWARNINGS": "ignore"}


def _pinned_torch() -> str:
    """The torch release the README's main command installs (``torch==X``): the one that printed the samples."""
    found = re.search(r"torch==([0-9.]+)", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert found, "README.md's main command pins no torch release"
    return found.group(1)


@dataclass(frozen=True)
class Sample:
    page: str
    line: int
    kind: str  # "command" | "python"
    mode: str  # "exact" | "excerpt" | "runs" | "skip" | "parse" | "compile"
    reason: str
    body: list[str]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _samples() -> list[Sample]:
    out: list[Sample] = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = lines[i].strip()
            if not fence.startswith("```"):
                i += 1
                continue
            end = lines.index("```", i + 1)
            body = lines[i + 1 : end]
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = _MARK.search(prev)
            name = str(page.relative_to(ROOT))
            if fence == "```python":
                mode = mark.group(1) if mark else "compile"
                out.append(Sample(name, i + 1, "python", mode, mark.group(2) if mark else "", body))
            elif body and body[0].startswith("$ qkvtrace"):  # ```text, or a block with no language
                mode = mark.group(1) if mark else "parse"
                out.append(Sample(name, i + 1, "command", mode, mark.group(2) if mark else "", body))
            i = end + 1
    return out


SAMPLES = _samples()
QUICK = [s for s in SAMPLES if s.mode in ("parse", "compile")]
RUN = [s for s in SAMPLES if s.mode in ("exact", "excerpt", "runs")]


def test_there_are_samples_and_marks_are_known() -> None:
    """Witness: the pages themselves; a mark the runner does not know would silently check nothing."""
    assert len(SAMPLES) > 20
    assert any(s.page == "README.md" and s.mode == "exact" for s in SAMPLES)
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if "<!-- sample:" not in line:
                continue
            mark = _MARK.search(line)
            assert mark, f"{page.name}:{n}: unknown sample mark {line.strip()!r}"
            assert mark.group(1) != "skip" or mark.group(2), f"{page.name}:{n}: a skipped sample must say why"


@pytest.mark.parametrize("sample", QUICK, ids=[s.id for s in QUICK])
def test_sample_parses(sample: Sample) -> None:
    """Witness: qkvtrace's own argument parser (argparse) and Python's compiler, not qkvtrace's output."""
    if sample.kind == "python":
        compile("\n".join(sample.body), sample.id, "exec")
        return
    from qkvtrace.cli.main import build_parser

    for line in sample.body:
        if not line.startswith("$ qkvtrace "):
            continue
        argv = shlex.split(line[len("$ qkvtrace ") :], comments=True)
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{sample.id}: `qkvtrace {' '.join(argv)}` is refused by the parser (exit {exc.code})")


def _run(sample: Sample, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    if sample.kind == "python":
        script = tmp_path / "sample.py"
        script.write_text("\n".join(sample.body) + "\n", encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-m", "qkvtrace", *shlex.split(sample.body[0][len("$ qkvtrace ") :], comments=True)]
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("sample", RUN, ids=[s.id for s in RUN])
def test_sample_runs_as_shown(sample: Sample, tmp_path: Path) -> None:
    """Witness: the command or script itself, run now; the page's lines are compared with what it prints."""
    done = _run(sample, tmp_path)
    assert done.returncode == 0, f"{sample.id} exited {done.returncode}:\n{done.stderr[-2000:]}"
    if sample.mode == "runs":
        return
    pinned = _pinned_torch()
    if not torch.__version__.startswith(pinned):  # reasons, kernels and numbers differ by release
        pytest.skip(f"{sample.id} was printed by torch {pinned}, the release the README's commands install")
    shown = [line.rstrip() for line in sample.body[1:]]
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    if sample.mode == "exact":
        assert printed == shown, f"{sample.id}: the page shows other output than the command prints"
        return
    at = 0
    for line in shown:
        while at < len(printed) and printed[at] != line:
            at += 1
        assert at < len(printed), f"{sample.id}: {line!r} is not printed (in this order)"
        at += 1


def _tutorial_sections() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "tutorial.md").read_text(encoding="utf-8")
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize(("title", "body"), _tutorial_sections(), ids=[t for t, _ in _tutorial_sections()])
def test_each_tutorial_section_ends_with_a_command_that_parses(title: str, body: str) -> None:
    """Witness: qkvtrace's argument parser; every section's last paragraph names a command that exists."""
    from qkvtrace.cli.main import build_parser

    last = body.strip().split("\n\n")[-1]
    assert last.startswith("Measure it:"), f"the section {title!r} does not end with the command that measures it"
    commands = re.findall(r"`(qkvtrace [^`]+)`", last)
    assert commands, f"the section {title!r} names no qkvtrace command"
    for command in commands:
        argv = shlex.split(command.replace("TARGET", "demo:tiny-lm"))[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{title}: `{command}` is refused by the parser (exit {exc.code})")
