"""``qkvtrace diff A B`` and ``qkvtrace compare --python A --python B``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from qkvtrace.analyses.reportio import REPORT_SCHEMA
from qkvtrace.base.errors import InputError, QkvtraceError
from qkvtrace.cli._common import check_output_file, progress
from qkvtrace.records.validation import check_document

__all__ = ["collect_in", "register", "run_compare", "run_diff"]

_DIFF_HELP = """\
Compare two traces of your model, or two per-version reports.

Two traces (`qkvtrace trace TARGET --json FILE`, made under two PyTorch
releases, before and after a change, in training and in eval): calls are
matched by module and order, and for each what changed -- path, SDPA
backend, PyTorch's reasons, its words refusing faster kernels, the aten
kernels, how masks were read, NaN and fully-masked rows, and Q/K/V weight,
activation and gradient norms beyond --rtol -- plus calls that appeared or
vanished. Exit 1 when anything changed, 0 when nothing did (use it in CI).

Two reports (folders written by `qkvtrace inspect`, or their report.json):
what users feel first -- behaviour probes whose result changed (paths,
backends, reasons, mask semantics, fully-masked rows) --, then fast-path
conditions that appeared, vanished or were reworded, call-graph edges, and
the attention-path functions whose source changed (with unified diffs under
--full; line-number moves alone are not changes).

No PyTorch is needed: files made on other machines compare anywhere.
"""

_COMPARE_HELP = """\
Run the collection in two Python environments (say, two virtual environments
with different PyTorch versions), write both reports into OUT, and diff them.

With a TARGET, trace your model instead: the same TARGET, built and fed from
the same seed, is traced once in each environment (with --train: a training
step, backward on a seeded random cotangent), both traces are written into
OUT/traces/, and the two are diffed call by call as `qkvtrace diff A.json
B.json` does; exit 1 when something changed.

The other environments need only torch: qkvtrace's collecting code is shipped
to them on PYTHONPATH and uses no rendering library.
"""


def register(sub: Any) -> None:
    d = sub.add_parser("diff", help="compare two reports: sources, fast-path conditions, call graph, behaviour",
                       description=_DIFF_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  qkvtrace diff old.json new.json            # two traces of your model\n"
                              "  qkvtrace diff reports/torch-2.4.1+cu121 reports/torch-2.13.0+cpu \\\n"
                              "      --md d.md --svg d.svg                  # two reports")  # fmt: skip
    d.add_argument("a", metavar="A", type=Path, help="the older trace JSON, or report (folder or report.json)")
    d.add_argument("b", metavar="B", type=Path, help="the newer one, of the same kind")
    d.add_argument("--json", metavar="FILE", type=Path,
                   help="write the qkvtrace.tracediff/1 (traces) or qkvtrace.diff/1 (reports) JSON")  # fmt: skip
    d.add_argument("--md", metavar="FILE", type=Path, help="write the diff as Markdown")
    d.add_argument("--svg", metavar="FILE", type=Path, help="reports: write the union call graph as SVG")
    d.add_argument("--rtol", metavar="R", type=float, default=1e-4,
                   help="traces: the relative change a norm may make unreported (default 1e-4)")  # fmt: skip
    d.add_argument("--full", action="store_true", help="reports: print every source diff, not only the names")
    d.set_defaults(run=run_diff)

    c = sub.add_parser("compare", help="collect in two Python environments and diff them in one go",
                       description=_COMPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  qkvtrace compare --python ~/venvs/torch24/bin/python "
                              "--python ~/venvs/torch213/bin/python")  # fmt: skip
    c.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="trace this model in both environments (module:callable, file.py:callable, demo:NAME, "
                        "hf:NAME...); without it, compare the reports")  # fmt: skip
    # PY kept as typed: Path("./python") is "python", which `which` would look up on PATH instead
    c.add_argument("--python", action="append", metavar="PY", default=[], required=True,
                   help="a Python interpreter with torch installed; give exactly two")  # fmt: skip
    c.add_argument("--train", action="store_true", help="with TARGET: a training step instead of inference")
    c.add_argument("--input-shape", metavar="B,T", help="with TARGET: batch and length of made-up inputs")
    c.add_argument("--random-init", action="store_true", help="with TARGET hf:NAME: random weights")
    c.add_argument("--rtol", metavar="R", type=float, default=1e-4,
                   help="with TARGET: the relative change a norm may make unreported (default 1e-4)")  # fmt: skip
    c.add_argument("--out", metavar="DIR", type=Path, default=Path("reports"),
                   help="where the two reports and diffs/ go (default reports/)")  # fmt: skip
    c.add_argument("--json", metavar="FILE", type=Path, help="also write the qkvtrace.diff/1 JSON here")
    c.add_argument("--md", metavar="FILE", type=Path, help="also write the diff as Markdown here")
    c.set_defaults(run=run_compare)


def _outputs(args: argparse.Namespace) -> None:
    for flag in ("json", "md", "svg"):
        path = getattr(args, flag, None)
        if path is not None:
            check_output_file(path, f"--{flag}")


def _write_diff(a: dict[str, Any], b: dict[str, Any], diff: dict[str, Any], *, json_path: Path | None,
                md_path: Path | None, svg_path: Path | None) -> str | None:  # fmt: skip
    """Write what was asked for; return a warning when the asked-for picture could not be drawn."""
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.diff_render import diff_dot, diff_markdown
    from qkvtrace.render.graph import render_svg

    drawing = render_svg(diff_dot(a, b, diff)) if svg_path is not None else None
    svg = drawing.svg if drawing is not None else None
    warning = None
    if svg_path is not None and svg is not None:
        atomic_write_text(svg_path, svg)
    elif svg_path is not None:
        left = " (the existing file is left as it was)" if svg_path.exists() else ""
        warning = f"{svg_path} was not drawn{left}: {drawing.problem if drawing else ''}"
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(diff, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    if md_path is not None:
        svg_name = os.path.relpath(svg_path, md_path.parent) if svg_path is not None and svg is not None else None
        atomic_write_text(md_path, diff_markdown(diff, svg_name=svg_name))
    return warning


def _kind(path: Path) -> str:
    """``"trace"`` or ``"report"``: what the file (or report folder) holds, from its schema id."""
    from qkvtrace.records.validation import read_json

    if path.is_dir() or path.name == "report.json":
        return "report"
    document = read_json(path)
    schema = document.get("schema") if isinstance(document, dict) else None
    return "trace" if isinstance(schema, str) and schema.startswith("qkvtrace.trace/") else "report"


def _run_trace_diff(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.tracediff import diff_traces
    from qkvtrace.records.validation import check_document, load_json

    if args.svg is not None:
        raise InputError("--svg draws the call graph of two reports; two traces have none")
    if not args.rtol >= 0:
        raise InputError(f"--rtol must be 0 or more, got {args.rtol}")
    a, b = load_json(args.a), load_json(args.b)
    diff = diff_traces(a, b, rtol=args.rtol)
    check_document(diff, name="the trace diff", expected="qkvtrace.tracediff/1")
    return _show_trace_diff(diff, args, console)


def _show_trace_diff(diff: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    """Print a trace diff, write --json/--md; exit 1 when anything changed (a CI check), else 0."""
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.tracediff_render import tracediff_markdown, tracediff_renderable

    console.print(tracediff_renderable(diff, width=console.width), crop=False)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(diff, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    if args.md is not None:
        atomic_write_text(args.md, tracediff_markdown(diff))
    return 1 if diff["changed"] or diff["appeared"] or diff["vanished"] else 0


def run_diff(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.diff import diff_reports
    from qkvtrace.analyses.reportio import load_report
    from qkvtrace.render.diff_render import diff_renderable

    _outputs(args)
    kinds = {_kind(args.a), _kind(args.b)}
    if kinds == {"trace"}:
        return _run_trace_diff(args, console)
    if "trace" in kinds:
        raise InputError(f"{args.a} and {args.b} are not of one kind: give two traces or two reports")
    a, b = load_report(args.a), load_report(args.b)
    diff = diff_reports(a, b)
    console.print(diff_renderable(diff, width=console.width, full=args.full), crop=False)
    warning = _write_diff(a, b, diff, json_path=args.json, md_path=args.md, svg_path=args.svg)
    if warning:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    return 0


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def collect_in(python: str | Path, env_extra: dict[str, str] | None = None, module: str = "qkvtrace.analyses.report",
               module_args: tuple[str, ...] = (), schema: str = REPORT_SCHEMA) -> dict[str, Any]:  # fmt: skip
    """Run a collector (the report's, or a trace's) under another interpreter and return what it printed."""
    import qkvtrace

    # absolute (the collector runs in another folder), but not resolved: a venv's python is a link that must stay one
    exe = os.path.abspath(shutil.which(str(python)) or str(python))
    if not Path(exe).is_file() or not os.access(exe, os.X_OK):
        raise InputError(f"--python {str(python)!r} is not an executable file; give the path to a python binary")
    probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] >= (3, 10))"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() not in ("True", "False"):
        raise InputError(f"--python {str(python)!r} does not run as a Python interpreter")
    if probe.stdout.strip() != "True":
        raise InputError(f"--python {str(python)!r} is older than Python 3.10, which the collector needs")
    has_torch = subprocess.run([exe, "-c", "import torch"], capture_output=True, text=True, timeout=300)
    if has_torch.returncode != 0:
        last = _tail(has_torch.stderr, 1)
        raise InputError(f"--python {str(python)!r} cannot import torch ({last}); install torch in that environment")
    with tempfile.TemporaryDirectory(prefix="qkvtrace-collector-") as shipped:
        # ship only the qkvtrace package, not this environment's site-packages
        shutil.copytree(Path(qkvtrace.__file__).parent, Path(shipped) / "qkvtrace",
                        ignore=shutil.ignore_patterns("__pycache__", "cli"))  # fmt: skip
        env = {**os.environ, **(env_extra or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shipped, (env_extra or {}).get("PYTHONPATH", "")) if p)
        # run in the shipped folder: `-m` puts the working directory first on sys.path, which would
        # otherwise import a checkout's qkvtrace instead of the copy shipped above
        proc = subprocess.run([exe, "-W", "ignore", "-m", module, *module_args], capture_output=True, text=True,
                              env=env, cwd=shipped, timeout=1800)  # fmt: skip
    if proc.returncode == 2 and proc.stderr.strip() and len(proc.stderr.strip().splitlines()) == 1:
        raise QkvtraceError(f"{proc.stderr.strip()} (under {python})")  # the collector's own one-line refusal
    if proc.returncode != 0:
        raise QkvtraceError(
            f"the collector crashed under {python} (exit {proc.returncode}); its last lines:\n{_tail(proc.stderr)}"
        )
    what = "report" if schema == REPORT_SCHEMA else "trace"
    try:
        report: dict[str, Any] = json.loads(proc.stdout)
    except ValueError as exc:  # JSONDecodeError, or a number Python will not convert
        raise QkvtraceError(f"the collector under {python} printed no {what} ({exc})") from None
    check_document(report, name=f"the {what} collected under {python}", expected=schema)
    return report


def _compare_traces(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.tracediff import diff_traces
    from qkvtrace.records import TRACE_SCHEMA, atomic_write_text

    if not args.rtol >= 0:
        raise InputError(f"--rtol must be 0 or more, got {args.rtol}")
    module_args = [args.target, *(["--train"] if args.train else []), *(["--random-init"] if args.random_init else [])]
    module_args += ["--cwd", os.getcwd()]  # TARGET relative to where the user runs, as `qkvtrace trace` reads it
    if args.input_shape:
        module_args += ["--input-shape", args.input_shape]
    traces = []
    folder = args.out / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    for n, python in enumerate(args.python, 1):
        with progress(f"tracing {args.target} under {python} ({n} of 2)"):  # stderr only
            trace = collect_in(python, module="qkvtrace.analyses.tracecollect", module_args=tuple(module_args),
                               schema=TRACE_SCHEMA)  # fmt: skip
        path = folder / f"{_safe(args.target)}.{'ab'[n - 1]}.torch-{trace.get('torch_version')}.json"
        atomic_write_text(path, json.dumps(trace, indent=1, sort_keys=True) + "\n")
        console.print(f"torch {trace.get('torch_version')} ← {python}: wrote {path}")
        traces.append(trace)
    return _show_trace_diff(diff_traces(*traces, rtol=args.rtol), args, console)


def _safe(target: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in target)


def run_compare(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.diff import diff_reports
    from qkvtrace.cli.inspect_cmd import picture_note, prepare_out, replaced_or_kept, write_report_dir
    from qkvtrace.render.diff_render import diff_renderable

    if len(args.python) != 2:
        raise InputError(f"give exactly two --python interpreters (got {len(args.python)})")
    _outputs(args)
    if args.target is not None:
        return _compare_traces(args, console)
    prepare_out(args.out)
    reports = []
    for n, python in enumerate(args.python, 1):
        with progress(f"collecting under {python} ({n} of {len(args.python)})"):  # stderr only
            report = collect_in(python)
        written = write_report_dir(report, args.out)
        console.print(f"torch {report['environment']['torch_version']} ← {python}: wrote {written.folder}/"
                      + replaced_or_kept(written))  # fmt: skip
        note = picture_note(written)
        if note:
            console.print(note)
        reports.append(report)
    a, b = reports
    diff = diff_reports(a, b)
    console.print(diff_renderable(diff, width=console.width), crop=False)
    diffs = args.out / "diffs"
    diffs.mkdir(exist_ok=True)
    stem = f"torch-{diff['a']}..torch-{diff['b']}"
    warning = _write_diff(
        a, b, diff, json_path=diffs / f"{stem}.json", md_path=diffs / f"{stem}.md", svg_path=diffs / f"{stem}.svg"
    )
    _write_diff(a, b, diff, json_path=args.json, md_path=args.md, svg_path=None)
    console.print(f"wrote {diffs / stem}.md (+ .json" + (")" if warning else ", .svg)"))
    if warning:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    return 0
