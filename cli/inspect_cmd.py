"""``qkvtrace inspect``: write the per-version report of the installed PyTorch."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from qkvtrace.errors import OutputError

__all__ = ["prepare_out", "register", "run", "write_report_dir"]

_HELP = """\
Read the attention path of the installed PyTorch and write it down:

  report.json    sources (inspect), fast-path conditions, call graph, scenarios
  report.md      the same, readable, with the call-graph picture
  callgraph.dot  Graphviz source; callgraph.svg when Graphviz's `dot` is installed

into OUT/torch-<version>/. An existing report of the same version is replaced
whole; an interrupted run leaves the old one untouched. Two runs in the same
environment write byte-identical report.json files, so reports can live under
version control and be compared with `qkvtrace diff`.
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


def write_report_dir(report: dict[str, Any], out: Path) -> tuple[Path, bool, bool]:
    """Write the report folder atomically; return ``(folder, replaced, svg_written)``."""
    from qkvtrace.render.graph import render_svg, report_graph, to_dot
    from qkvtrace.render.markdown import report_markdown
    from qkvtrace.report import dumps_report, report_dirname

    version = report["environment"]["torch_version"]
    final = out / report_dirname(version)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=out))
        tmp.chmod(0o755)  # mkdtemp makes it private; a report folder is for reading
    except OSError as exc:
        raise OutputError(f"--out {str(out)!r} is not writable ({exc.strerror}); choose another folder") from None
    try:
        dot = to_dot(report_graph(report), f"attention call graph — torch {version}")
        svg = render_svg(dot)
        (tmp / "report.json").write_text(dumps_report(report), encoding="utf-8")
        (tmp / "callgraph.dot").write_text(dot, encoding="utf-8")
        if svg is not None:
            (tmp / "callgraph.svg").write_text(svg, encoding="utf-8")
        md = report_markdown(report, svg_name="callgraph.svg" if svg is not None else None)
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
    return final, replaced, svg is not None


def _summary(report: dict[str, Any], folder: Path, replaced: bool, seconds: float) -> Table:
    env = report["environment"]
    table = Table(title=f"qkvtrace inspect — torch {env['torch_version']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
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
    table.add_row("written", f"{folder}/" + ("  (replaced the previous report of this version)" if replaced else ""))
    table.add_row("took", f"{seconds:.1f} s")
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.report import collect_report

    prepare_out(args.out)
    start = time.perf_counter()
    with console.status("collecting", spinner="dots") as status:
        report = collect_report(progress=lambda msg: status.update(msg))
        status.update("writing the report")
        folder, replaced, has_svg = write_report_dir(report, args.out)
    console.print(_summary(report, folder, replaced, time.perf_counter() - start))
    if not has_svg:
        console.print(
            "[yellow]warning:[/] Graphviz's `dot` program is not installed, so callgraph.svg was not drawn "
            "(callgraph.dot was written). Install it with `apt-get install graphviz` (Debian/Ubuntu), "
            "`brew install graphviz` (macOS) or `conda install graphviz`, then run inspect again."
        )
    return 0
