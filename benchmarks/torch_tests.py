"""Does an open ``qkvtrace.trace`` change the outcome of PyTorch's own tests?

Run ``python benchmarks/torch_tests.py PATH [-k EXPR]
[--mode after-import|before-import|per-test] [--model EXPR] [--json OUT]
[--timeout S] [-- PYTEST_ARGS...]``.

``PATH`` is a test file or folder, typically one of PyTorch's own
(``test/test_transformers.py`` from the PyTorch source of the installed
release: the wheel ships ``torch/testing/_internal`` but not ``test/``, and
those files also need ``expecttest`` and ``hypothesis``;
``benchmarks/pytorch_tests/PROVENANCE.md`` says which copies were measured).

Method
------
pytest runs the selection twice, one run after the other, in subprocesses of
this same interpreter, both with ``-p no:qkvtrace`` (qkvtrace's own pytest
plugin, which an installed qkvtrace registers in every pytest run, stays out):

1. plain: nothing of qkvtrace is imported -- checked: the run records whether
   ``qkvtrace`` is in ``sys.modules`` at the end of the run, and a plain run that
   imported it (through a ``conftest.py`` or another plugin) is no baseline
   (exit 2);
2. traced: ``--mode after-import`` (default) enters one
   ``qkvtrace.trace(MODEL)`` once collection is over -- every test module
   already imported, as in a program that imports its libraries and then
   opens a trace -- and leaves it at session end; ``--mode before-import``
   enters it at session start, before the test modules are imported (a
   module that binds ``scaled_dot_product_attention`` by name at import then
   binds the wrapper, which hides identity changes the after-import mode
   shows); ``--mode per-test`` enters a fresh trace around each test (setup,
   call and teardown). ``MODEL`` (``--model``, default ``nn.Linear(1, 1)``)
   is evaluated with ``torch`` and ``nn`` in scope; the default installs
   every wrapper while tracing no model of the tests.

Both runs load ``torch_tests_plugin`` (beside this file), which records each
test's outcome (passed, failed, skipped, error, xfailed, xpassed) and the
first line of its failure, and checks at session end that PyTorch's attention
entry points (``F.scaled_dot_product_attention``,
``F.multi_head_attention_forward``, ``nn.MultiheadAttention.forward``,
``nn.TransformerEncoderLayer.forward``, ``torch._native_multi_head_attention``,
``torch._transformer_encoder_layer_fwd``) are the very objects they were at
session start.

Printed: the counts of each run, whether PyTorch's functions were its own
again at the end of each run, and every test whose outcome differs between
the runs, with the first line of its traced message. A test that fails in
both runs is not a difference: PyTorch's own suite has failures on some
machines.

Exit codes: 0 no test differs and everything was restored; 1 some test
differs, the traced run left a PyTorch function replaced, or the traced run
could not run the tests the plain run ran; 2 bad input (a missing path, a
selection with no tests, a plain run that could not run the tests or that
imported qkvtrace, a run that did not finish within ``--timeout``), with one
line on stderr saying why.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
PLUGIN = "torch_tests_plugin"
MODES = ("after-import", "before-import", "per-test")
# qkvtrace's own pytest plugin (entry point name): loaded into every pytest run
# of an environment where qkvtrace is installed, and it imports qkvtrace.
NO_QKVTRACE_PLUGIN = ("-p", "no:qkvtrace")
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
# pytest's own exit codes (pytest.ExitCode)
PYTEST_OK, PYTEST_TESTS_FAILED, PYTEST_INTERRUPTED, PYTEST_INTERNAL, PYTEST_USAGE, PYTEST_NO_TESTS = range(6)


class BadInput(Exception):
    """Something the user must fix; the message is the one line printed on stderr."""


@dataclass
class Run:
    """One pytest run: outcomes by node id, the end-of-session check, and how it ended."""

    name: str
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    session: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    returncode: int = 0
    seconds: float = 0.0
    log_tail: str = ""

    def counts(self) -> dict[str, int]:
        c = Counter(entry["outcome"] for entry in self.outcomes.values())
        return {k: c.get(k, 0) for k in OUTCOMES}

    def changed(self) -> dict[str, str]:
        identity = (self.session or {}).get("identity") or {}
        return {name: state for name, state in identity.items() if state != "same object"}


@dataclass
class Difference:
    nodeid: str
    plain: str
    traced: str
    message: str | None


# -- running pytest ----------------------------------------------------------------


def pytest_command(path: Path, keyword: str | None, extra: Sequence[str], plugins: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", *NO_QKVTRACE_PLUGIN]
    cmd += ["-p", PLUGIN]
    for plugin in plugins:
        cmd += ["-p", plugin]
    if keyword:
        cmd += ["-k", keyword]
    return cmd + list(extra)


def child_env(out: Path, mode: str, model: str, extra_paths: Sequence[Path]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(HERE), *map(str, extra_paths)]
    if importlib.util.find_spec("qkvtrace") is None:
        paths.append(str(REPO_ROOT))  # run from a checkout without installing it
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["QKVTRACE_TT_OUT"] = str(out)
    env["QKVTRACE_TT_MODE"] = mode
    env["QKVTRACE_TT_MODEL"] = model
    return env


def read_results(out: Path, run: Run) -> None:
    if not out.exists():
        return
    for line in out.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        payload = json.loads(line)
        if "session" in payload:
            run.session = payload["session"]
        elif "error" in payload:
            run.errors.append(payload["error"])
        else:
            run.outcomes[payload["nodeid"]] = {"outcome": payload["outcome"], "message": payload["message"]}


def run_pytest(
    name: str,
    cmd: Sequence[str],
    env: dict[str, str],
    out: Path,
    log: Path,
    timeout: float | None,
    cwd: Path,
) -> Run:
    run = Run(name)
    start = time.perf_counter()
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group: pytest and anything it started
            proc.wait()
            run.returncode = -9
    run.seconds = time.perf_counter() - start
    run.log_tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:])
    read_results(out, run)
    if run.returncode == -9:
        raise BadInput(
            f"the {name} run did not finish within --timeout {timeout:g} s "
            f"({len(run.outcomes)} tests done); raise --timeout or select fewer tests with -k"
        )
    return run


def stopped(run: Run) -> str | None:
    """Why a run said nothing about the tests (no tests, pytest could not run them), or None."""
    if run.errors:
        return f"the {run.name} run: {run.errors[0]}"
    if run.returncode == PYTEST_NO_TESTS:
        return f"the {run.name} run selected no tests; check PATH and -k"
    if run.returncode in (PYTEST_INTERRUPTED, PYTEST_INTERNAL, PYTEST_USAGE) or run.session is None:
        lines = [line.strip() for line in run.log_tail.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        hint = (errors or lines or ["no output"])[-1]
        if "No module named" in run.log_tail:
            hint += " (PyTorch's test files need expecttest and hypothesis: pip install expecttest hypothesis)"
        return f"the {run.name} run stopped before running the tests (pytest exit {run.returncode}): {hint}"
    return None


def imported_qkvtrace(run: Run) -> bool:
    """Whether ``qkvtrace`` was in ``sys.modules`` at the end of the run."""
    return bool((run.session or {}).get("qkvtrace_imported"))


# -- comparing ---------------------------------------------------------------------


def compare(plain: Run, traced: Run) -> list[Difference]:
    diffs = []
    for nodeid in sorted(set(plain.outcomes) | set(traced.outcomes)):
        a = plain.outcomes.get(nodeid, {"outcome": "missing", "message": None})
        b = traced.outcomes.get(nodeid, {"outcome": "missing", "message": None})
        if a["outcome"] != b["outcome"]:
            diffs.append(Difference(nodeid, a["outcome"], b["outcome"], b["message"] or a["message"]))
    return diffs


def left_replaced(plain: Run, traced: Run) -> dict[str, str]:
    """PyTorch functions the traced run left replaced although the plain run did not."""
    before = plain.changed()
    return {name: state for name, state in traced.changed().items() if name not in before}


def torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "not installed"
    return str(torch.__version__)


def summary(path: Path, args: argparse.Namespace, plain: Run, traced: Run, diffs: list[Difference]) -> dict[str, Any]:
    return {
        "path": str(path),
        "keyword": args.keyword,
        "pytest_args": list(args.pytest_args),
        "mode": args.mode,
        "model": args.model,
        "torch_version": torch_version(),
        "runs": {
            run.name: {
                "counts": run.counts(),
                "total": len(run.outcomes),
                "seconds": round(run.seconds, 1),
                "pytest_exit": run.returncode,
                "identity": (run.session or {}).get("identity"),
                "trace_error": (run.session or {}).get("trace_error"),
                "qkvtrace_imported": (run.session or {}).get("qkvtrace_imported"),
            }
            for run in (plain, traced)
        },
        "left_replaced": left_replaced(plain, traced),
        "differences": [d.__dict__ for d in diffs],
        "outcomes": {
            nodeid: {
                "plain": plain.outcomes.get(nodeid, {}).get("outcome"),
                "traced": traced.outcomes.get(nodeid, {}).get("outcome"),
            }
            for nodeid in sorted(set(plain.outcomes) | set(traced.outcomes))
        },
    }


# -- printing ----------------------------------------------------------------------


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_report(report: dict[str, Any], diffs: list[Difference], tty: bool) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=not tty)
    runs = report["runs"]
    title = f"{report['path']}  (torch {report['torch_version']}, trace: {report['mode']}, model: {report['model']})"
    if tty:
        table = Table(title=title, box=box.SIMPLE_HEAVY)
        table.add_column("run")
        for outcome in (*OUTCOMES, "total", "seconds"):
            table.add_column(outcome, justify="right")
        for name, run in runs.items():
            table.add_row(name, *(str(run["counts"][o]) for o in OUTCOMES), str(run["total"]), f"{run['seconds']:g}")
        console.print(table)
    else:
        console.print(title)
        for name, run in runs.items():
            counts = ", ".join(f"{run['counts'][o]} {o}" for o in OUTCOMES if run["counts"][o])
            console.print(f"{name}: {run['total']} tests: {counts or 'none'} ({run['seconds']:g} s)")
    for name, run in runs.items():
        identity = run["identity"] or {}
        changed = {k: v for k, v in identity.items() if v != "same object"}
        if changed:
            for fn, state in changed.items():
                console.print(f"{name} run: at session end {fn} was not PyTorch's own object ({state})")
        else:
            console.print(
                f"{name} run: at session end all {len(identity)} PyTorch attention functions were PyTorch's own objects"
            )
        if run["trace_error"]:
            console.print(f"{name} run: {run['trace_error']}")
    if runs["plain"]["qkvtrace_imported"] is False:
        console.print("plain run: qkvtrace was not imported (checked at the end of the run)")
    if report.get("traced_stopped"):
        console.print(report["traced_stopped"])
    if not diffs:
        console.print(f"no test changed outcome ({runs['plain']['total']} compared)")
        return
    if tty:
        table = Table(title=f"{plural(len(diffs), 'test')} changed outcome", box=box.SIMPLE_HEAVY)
        table.add_column("test", overflow="fold")
        table.add_column("plain")
        table.add_column("traced")
        table.add_column("traced message", overflow="fold", max_width=60)
        for d in diffs:
            table.add_row(d.nodeid, d.plain, d.traced, d.message or "")
        console.print(table)
    else:
        console.print(f"{plural(len(diffs), 'test')} changed outcome:")
        for d in diffs:
            console.print(f"  {d.nodeid}  {d.plain} -> {d.traced}  {d.message or ''}".rstrip())


# -- entry point -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Arguments after -- go to pytest unchanged, e.g. -- -x --maxfail 5.",
    )
    parser.add_argument("path", type=Path, help="a test file or folder (e.g. PyTorch's test/test_transformers.py)")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help='pytest -k selection, e.g. "cpu or CPU"')
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="after-import",
        help="when the traced run opens its trace: once, after the test modules are imported (default); "
        "once, before they are imported; or a fresh trace around each test",
    )
    parser.add_argument(
        "--model",
        default="nn.Linear(1, 1)",
        metavar="EXPR",
        help="what is traced: an expression using torch and nn (default: nn.Linear(1, 1))",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write counts, differences and every outcome")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop a run that takes more than S seconds (exit 2); default: no limit",
    )
    # A pytest plugin (a .py file) loaded into the traced run only. It lets the
    # tests of this script prove that a change really is reported as one.
    parser.add_argument("--plugin", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS", help="passed to pytest")
    return parser.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    if not args.path.exists():
        raise BadInput(f"{args.path}: no such file or folder")
    if args.path.is_file() and args.path.suffix != ".py":
        raise BadInput(f"{args.path}: not a Python test file or folder")
    if args.timeout is not None and args.timeout <= 0:
        raise BadInput(f"--timeout {args.timeout:g}: give a positive number of seconds")
    if args.plugin is not None and not (args.plugin.is_file() and args.plugin.suffix == ".py"):
        raise BadInput(f"--plugin {args.plugin}: not a .py file")
    if args.json is not None:
        parent = args.json.parent if str(args.json.parent) else Path(".")
        if args.json.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise BadInput(f"--json {args.json}: cannot write there; give a file in an existing, writable folder")
    if importlib.util.find_spec("pytest") is None:
        raise BadInput("pytest is not installed in this Python; pip install pytest")
    try:
        import torch
        from torch import nn

        model = eval(args.model, {"torch": torch, "nn": nn})
    except Exception as exc:
        raise BadInput(f"--model {args.model!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise BadInput(f"--model {args.model!r} evaluates to {type(model).__name__}, not an nn.Module")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
        path = args.path.resolve()
        plugins, extra_paths = [], []
        if args.plugin is not None:
            plugins.append(args.plugin.stem)
            extra_paths.append(args.plugin.resolve().parent)
        # pytest runs in the test file's folder, as PyTorch's tests expect (they
        # import their neighbours), so node ids read test_x.py::Class::test.
        cwd = path if path.is_dir() else path.parent
        tty = sys.stdout.isatty()
        with tempfile.TemporaryDirectory(prefix="qkvtrace-torch-tests-") as tmp:
            runs = []
            for name, mode, run_plugins in (("plain", "off", []), ("traced", args.mode, plugins)):
                out, log = Path(tmp) / f"{name}.jsonl", Path(tmp) / f"{name}.log"
                cmd = pytest_command(path, args.keyword, args.pytest_args, run_plugins)
                env = child_env(out, mode, args.model, extra_paths)
                print(f"{name} run ...", file=sys.stderr, flush=True)
                run = run_pytest(name, cmd, env, out, log, args.timeout, cwd)
                why = stopped(run)
                if why is not None and name == "plain":
                    raise BadInput(why)
                if name == "plain" and imported_qkvtrace(run):
                    raise BadInput(
                        "the plain run imported qkvtrace (a conftest.py or a pytest plugin imports it), "
                        "so it is no baseline; remove that import from the test setup"
                    )
                runs.append(run)
        plain, traced = runs
    except BadInput as exc:
        print(f"torch_tests.py: error: {exc}", file=sys.stderr)
        return 2
    # The plain run ran the tests; a traced run that could not is a finding, not bad input.
    traced_stopped = stopped(traced)
    diffs = compare(plain, traced)
    report = summary(path, args, plain, traced, diffs)
    report["traced_stopped"] = traced_stopped
    print_report(report, diffs, tty)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"JSON written to {args.json}")
    return 1 if diffs or report["left_replaced"] or traced_stopped else 0


if __name__ == "__main__":
    sys.exit(main())
