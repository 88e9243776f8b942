"""``qkvtrace history``: reports from many PyTorch releases, and the timeline they tell."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qkvtrace.base.errors import InputError, QkvtraceError
from qkvtrace.cli._common import check_output_file

__all__ = ["register", "run"]

_HELP = """\
The history of PyTorch attention, release by release.

Collect: with --python, run the report collector under each interpreter (one
virtual environment per PyTorch release; the collector is shipped to it on
PYTHONPATH, so it needs only torch) and write OUT/torch-<version>/ for each,
the same report.json/report.md/callgraph.svg as `qkvtrace inspect`. A
release that lacks an API qkvtrace uses says so in its report ("missing").

Timeline: from the reports in OUT (or the folders given), written without
PyTorch: for each attention-path function the releases where its source
changed (and whether only its docstring did); for each fast-path condition
the release that added, reworded or removed it, with its text; for each
behaviour probe the release where its result changed; the releases where the
call graph gained or lost edges. Written as OUT/HISTORY.md, OUT/history.json
(qkvtrace.history/1) and OUT/history.png, a release x item chart (needs the
optional extra: pip install "qkvtrace[plot]").

benchmarks/collect_history.sh makes, collects and removes one environment
per release (every minor release from 2.0).
"""

_EPILOG = """\
examples:
  qkvtrace history reports/                          # timeline of the reports there
  qkvtrace history --python /tmp/t20/bin/python --python /tmp/t21/bin/python --out reports/
  qkvtrace history reports/ --json h.json --md h.md --chart h.png
  benchmarks/collect_history.sh 2.0.1 2.1.2          # one venv per release, made and removed
"""


def register(sub: Any) -> None:
    p = sub.add_parser("history", help="collect reports of many releases; the timeline of what changed when",
                       description=_HELP, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("reports", nargs="*", metavar="REPORTS", type=Path,
                   help="a folder of torch-<version>/ reports, or report folders/report.json files")  # fmt: skip
    p.add_argument("--python", action="append", metavar="PY", default=[],  # as typed: see compare's --python
                   help="an interpreter with torch installed: collect its report into --out (repeatable)")  # fmt: skip
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="where reports and the timeline go, created if missing (default: REPORTS if one folder, "
                        "else reports)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", type=Path, help="the qkvtrace.history/1 JSON (default OUT/history.json)")
    p.add_argument("--md", metavar="FILE", type=Path, help="the timeline as Markdown (default OUT/HISTORY.md)")
    p.add_argument("--chart", metavar="FILE", type=Path, help="the release x item chart (default OUT/history.png)")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    p.add_argument("--no-timeline", action="store_true", help="with --python: only collect the reports")
    p.set_defaults(run=run)


def _out(args: argparse.Namespace) -> Path | None:
    """Where reports and the timeline go: --out; else the one folder of reports given; else none."""
    if args.out is not None:
        return Path(args.out)
    if len(args.reports) == 1 and args.reports[0].is_dir() and not (args.reports[0] / "report.json").is_file():
        return Path(args.reports[0])
    return Path("reports") if args.python and not args.reports else None


def _collect(pythons: list[str], out: Path, console: Console) -> None:
    from qkvtrace.cli.diff_cmd import collect_in
    from qkvtrace.cli.inspect_cmd import picture_note, prepare_out, replaced_or_kept, write_report_dir

    prepare_out(out)
    err = Console(stderr=True, highlight=False)  # progress on stderr, never mixed into what stdout carries
    for n, python in enumerate(pythons, 1):
        with err.status(f"collecting under {python} ({n} of {len(pythons)})", spinner="dots"):
            report = collect_in(python)
        written = write_report_dir(report, out)
        missing = ", ".join(m["name"] for m in report.get("missing", []))
        console.print(f"torch {report['environment']['torch_version']} ← {python}: wrote {written.folder}/"
                      + replaced_or_kept(written)
                      + (f"; this release lacks {missing}" if missing else ""))  # fmt: skip
        note = picture_note(written)
        if note:
            console.print(note)


def _summary(history: dict[str, Any]) -> Table:
    from qkvtrace.analyses.history import headline_rows

    table = Table(title=f"qkvtrace history — torch {history['releases'][0]} … {history['releases'][-1]}")
    table.add_column("release", style="bold")
    table.add_column("what changed")
    for release, text in headline_rows(history):
        table.add_row(release, text)
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    out = _out(args)
    if args.python:
        if out is None:
            raise InputError("with --python and report folders, say where the new reports go: --out DIR")
        _collect(args.python, out, console)
        if args.no_timeline:
            return 0
    elif not args.reports:
        raise InputError("give a folder of reports (e.g. reports/) or --python interpreters to collect from")
    from qkvtrace.analyses.history import build_history, find_reports
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.history_render import history_markdown

    sources = list(args.reports) or [out]

    def default(name: str) -> Path | None:
        return out / name if out is not None else None

    json_path = args.json or default("history.json")
    md_path = args.md or default("HISTORY.md")
    chart_path = None if args.no_chart else (args.chart or default("history.png"))
    if json_path is None and md_path is None and chart_path is None:
        raise InputError("several report folders: give --out DIR for the timeline (or --json/--md/--chart FILE)")
    reports = find_reports(s for s in sources if s is not None)
    if args.out is not None:  # --out names a folder to write into: made here, as inspect makes it
        from qkvtrace.cli.inspect_cmd import prepare_out

        prepare_out(args.out)
    for path, given, flag in ((json_path, args.json, "--json"), (md_path, args.md, "--md"),
                              (chart_path, args.chart, "--chart")):  # fmt: skip
        if path is not None:
            check_output_file(path, flag if given is not None else "--out")  # the option the user gave

    history = build_history(reports)
    chart_note = None
    chart_drawn = False
    if chart_path is not None:
        try:
            from qkvtrace.render.history_render import draw_history_chart

            draw_history_chart(history, chart_path)
            chart_drawn = True
        except ImportError as exc:  # matplotlib missing: the timeline is still written, unless the chart was asked for
            if args.chart is not None:
                raise QkvtraceError(str(exc)) from None
            chart_note = str(exc)
    written = []
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(history, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        written.append(str(json_path))
    if md_path is not None:
        chart_name = os.path.relpath(chart_path, md_path.parent) if chart_drawn and chart_path is not None else None
        atomic_write_text(md_path, history_markdown(history, chart_name=chart_name))
        written.insert(0, str(md_path))
    if chart_drawn:
        written.append(str(chart_path))
    console.print(_summary(history))
    console.print(f"wrote {', '.join(written)}")
    if chart_note:
        console.print(f"[yellow]note:[/] no chart: {escape(chart_note)}")
    return 0
