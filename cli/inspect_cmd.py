"""``qkvtrace inspect``: write the per-version report of the installed PyTorch."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qkvtrace.base.errors import OutputError, SchemaError
from qkvtrace.cli._common import progress

if TYPE_CHECKING:  # the CLI imports this module at start-up; drawing libraries load only when needed
    from qkvtrace.render.graph import Drawing

__all__ = ["Written", "picture_note", "prepare_out", "register", "replaced_or_kept", "run", "write_report_dir"]

_HELP = """\
Read the attention path of the installed PyTorch and write it down:

  report.json    sources (inspect), fast-path conditions, call graph, scenarios
  report.md      the same, readable, with the call-graph picture
  callgraph.dot  Graphviz source
  callgraph.svg  the call-graph picture, laid out by graphviz-pure (installed
                 with qkvtrace; the same bytes on every machine), else by
                 Graphviz's `dot` on PATH; $QKVTRACE_DOT names another program

into OUT/torch-<version>/.

An existing report of the same version is kept when it says what this run
found: the same sources, conditions, call graph and scenario results,
measured errors (max |difference| between two computations: rounding noise
that moves from run to run) within a factor of 4 or 1e-5, other measured
numbers within 10 %, whatever Python or machine made it. So a second run, or
the first in a fresh checkout, leaves the files as they were: reports can live
under version control and be compared with `qkvtrace diff`. Otherwise the
report is replaced whole; an interrupted run leaves the old one untouched.

If no picture can be drawn, the previous callgraph.svg is kept, and you are
told whether it still shows this call graph.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="write the per-version report: sources, fast-path conditions, call graph, scenarios",
        description=_HELP,
        epilog="example:\n  qkvtrace inspect --out reports/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", metavar="DIR", type=Path, default=Path("reports"), help="parent folder (default: reports/)")
    p.set_defaults(run=run)


def prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {str(out)!r} is a file, not a folder; give a folder such as reports/")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"--out {str(out)!r} cannot be created ({exc.strerror}); choose another folder") from None


@dataclass(frozen=True)
class Written:
    """What :func:`write_report_dir` did."""

    folder: Path
    #: a report of the same version was there before and was replaced
    replaced: bool
    #: ``"drawn"``; ``"kept"`` (not drawn; the previous picture of the same call graph kept);
    #: ``"kept-stale"`` (not drawn; the previous picture kept, but the call graph changed); ``"none"``
    picture: str
    #: the layout program that drew the picture, or why there is none
    drawing: Drawing
    #: the report there said what this run found (:func:`~qkvtrace.analyses.reportio.first_difference`),
    #: so its numbers and environment were kept and the files were written again from it
    kept: bool = False


def write_report_dir(report: dict[str, Any], out: Path) -> Written:
    """Write the report folder atomically, never losing a picture it cannot redraw."""
    from qkvtrace.analyses.report import dumps_report, report_dirname
    from qkvtrace.analyses.reportio import first_difference
    from qkvtrace.render.graph import render_svg, report_graph, to_dot
    from qkvtrace.render.markdown import report_markdown

    version = report["environment"]["torch_version"]
    final = out / report_dirname(version)
    previous = _previous(final)
    kept = previous is not None and first_difference(previous, report) is None
    if kept and previous is not None:
        # Same findings, other noise (or another machine): keep the report that is there, so a
        # checkout's committed report stays as it was and two runs write the same bytes.
        report = previous
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=out))
        tmp.chmod(0o755)  # mkdtemp makes it private; a report folder is for reading
    except OSError as exc:
        raise OutputError(f"--out {str(out)!r} is not writable ({exc.strerror}); choose another folder") from None
    try:
        dot = to_dot(report_graph(report), f"attention call graph — torch {version}")
        drawing = render_svg(dot)
        (tmp / "report.json").write_text(dumps_report(report), encoding="utf-8")
        (tmp / "callgraph.dot").write_text(dot, encoding="utf-8")
        picture = "none"
        if drawing.svg is not None:
            (tmp / "callgraph.svg").write_text(drawing.svg, encoding="utf-8")
            picture = "drawn"
        elif (final / "callgraph.svg").is_file():
            # No layout program here: keep the picture a previous run (or a commit) left rather than
            # deleting it with the folder; it is still true when the graph it was drawn from is unchanged.
            shutil.copy2(final / "callgraph.svg", tmp / "callgraph.svg")
            same = (final / "callgraph.dot").is_file() and (final / "callgraph.dot").read_text(encoding="utf-8") == dot
            picture = "kept" if same else "kept-stale"
        md = report_markdown(report, svg_name="callgraph.svg" if picture in ("drawn", "kept") else None)
        (tmp / "report.md").write_text(md, encoding="utf-8")
        replaced = final.exists()
        old = None
        if replaced:
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=out))
            old.rmdir()
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Written(final, replaced, picture, drawing, kept)


def _previous(final: Path) -> dict[str, Any] | None:
    """The report already in ``final``, or ``None`` when there is none that reads as a report."""
    from qkvtrace.analyses.reportio import load_report

    if not (final / "report.json").is_file():
        return None
    try:
        return load_report(final)
    except SchemaError:  # damaged or of another schema: it is replaced
        return None


def replaced_or_kept(written: Written) -> str:
    """`` (kept ...)``, `` (replaced)`` or nothing: what happened to a report of the same version."""
    if written.kept:
        return " (kept the report there: it says the same)"
    return " (replaced)" if written.replaced else ""


def picture_note(written: Written) -> str | None:
    """A line for the user when the report's picture was not drawn this time, else ``None``."""
    svg = escape(str(written.folder / "callgraph.svg"))
    why = escape(written.drawing.problem or "")
    if written.picture == "kept":
        return f"[yellow]note:[/] {svg} was not redrawn ({why}); the previous one is kept: the call graph is unchanged"
    if written.picture == "kept-stale":
        return (
            f"[yellow]warning:[/] {svg} was not redrawn ({why}); the previous one is kept but is OUT OF DATE: "
            "the call graph changed (see callgraph.dot); run again once a layout program is installed"
        )
    if written.picture == "none":
        return f"[yellow]warning:[/] {svg} was not drawn ({why}); callgraph.dot was written"
    return None


def _summary(report: dict[str, Any], written: Written, seconds: float) -> Table:
    env = report["environment"]
    table = Table(title=f"qkvtrace inspect — torch {env['torch_version']}", show_header=False)
    table.add_column(style="bold", overflow="fold")  # fold, never cut: names and folders stay whole
    table.add_column(overflow="fold")
    kinds: dict[str, int] = {}
    for s in report["sources"]:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    table.add_row("functions", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    for block in report["fast_path_conditions"]:
        table.add_row("fast-path conditions", f"{len(block['conditions'])} in {block['function'].split('.', 4)[-1]}")
    if report.get("missing"):
        table.add_row("missing", ", ".join(m["name"] for m in report["missing"]))
    edges = report["callgraph"]["edges"]
    dyn = sum(1 for e in edges if "dynamic" in e["kind"])
    table.add_row(
        "call graph",
        f"{len(report['callgraph']['nodes'])} nodes, {len(edges)} edges ({dyn} observed running)",
    )
    for s in report["probes"]["scenarios"]:
        if s["name"] in ("mha_eval_no_grad", "mha_train", "encoder_inference", "sdpa_default"):
            calls = s["calls"]
            paths = ", ".join(sorted({c["path"] for c in calls})) or s.get("error") or "-"
            backend = ", ".join(sorted({c["sdpa_backend"] or "none" for c in calls}))
            table.add_row(s["description"], f"{paths} (backend: {backend})")
    if written.picture == "drawn":
        table.add_row("picture", f"callgraph.svg, drawn by {written.drawing.engine}")
    else:
        table.add_row("picture", {"kept": "callgraph.svg kept from the previous report",
                                  "kept-stale": "callgraph.svg kept from the previous report (out of date)",
                                  "none": "not drawn"}[written.picture])  # fmt: skip
    if written.kept:
        from qkvtrace.analyses.reportio import ERROR_FACTOR, ERROR_FLOOR, MAGNITUDE_TOLERANCE

        replaced = (
            "  (kept the report there: it says the same; measured errors agree within a factor of "
            f"{ERROR_FACTOR:g} or {ERROR_FLOOR:g}, other numbers within {MAGNITUDE_TOLERANCE:.0%})"
        )
    elif written.replaced:
        replaced = "  (replaced the previous report of this version)"
    else:
        replaced = ""
    table.add_row("written", f"{written.folder}/{replaced}")
    table.add_row("took", f"{seconds:.1f} s")
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.report import collect_report

    prepare_out(args.out)
    start = time.perf_counter()
    with progress("collecting") as status:  # on stderr: stdout stays plain when piped
        report = collect_report(progress=status)
        status("writing the report")
        written = write_report_dir(report, args.out)
    console.print(_summary(report, written, time.perf_counter() - start))
    note = picture_note(written)
    if note:
        console.print(note)
    return 0
