"""pytest plugin behind ``benchmarks/torch_tests.py``: records outcomes, optionally inside a trace.

``torch_tests.py`` loads this module into both of its pytest runs with
``-p torch_tests_plugin`` and configures it through environment variables
(they are its only interface; nothing here is meant to be loaded by hand):

``QKVTRACE_TT_OUT``
    A JSON-lines file. One line per finished test: ``nodeid``, ``outcome``
    (``passed``, ``failed``, ``skipped``, ``error``, ``xfailed``,
    ``xpassed``) and ``message`` (first line of the failure, error or skip
    reason). Written as each test finishes, so a run that is stopped keeps
    what it did. A last line, ``{"session": ...}``, says whether PyTorch's
    attention functions were PyTorch's own objects again at the end and
    whether ``qkvtrace`` was in ``sys.modules`` then (``qkvtrace_imported``:
    the plain run must say ``false``).
``QKVTRACE_TT_MODE``
    ``off`` (the plain run), ``after-import`` (one ``qkvtrace.trace`` entered
    once collection is over -- every test module imported, as when a user's
    program imports its libraries and then opens a trace -- and left at
    session end), ``before-import`` (the same trace entered at session start,
    before the test modules are imported) or ``per-test`` (a fresh trace
    around each test's setup, call and teardown, also after the imports).
``QKVTRACE_TT_MODEL``
    A Python expression evaluated with ``torch`` and ``nn`` in scope; the
    module it makes is what the trace is given (default ``nn.Linear(1, 1)``:
    every wrapper is installed while no test model is traced).

Why identity: the tracer swaps attributes of PyTorch for wrappers while a
trace is open and puts the originals back when it closes. A test suite that
compares functions by identity (``F.scaled_dot_product_attention is ...``)
or mocks them with ``unittest.mock.patch`` sees those swaps; the end-of-
session check makes sure nothing is left behind.

Why after the imports: a module that binds a function by name at import
(``from torch.nn.functional import scaled_dot_product_attention``) keeps the
object it found then. A trace opened before the import hands it the wrapper,
so the module never sees the swap; a trace opened after it -- the common
case -- leaves the module holding PyTorch's own function while
``F.scaled_dot_product_attention`` is the wrapper, and code that compares the
two (PyTorch's ``CausalBias``) takes another branch.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

OUT_ENV = "QKVTRACE_TT_OUT"
MODE_ENV = "QKVTRACE_TT_MODE"
MODEL_ENV = "QKVTRACE_TT_MODEL"
DEFAULT_MODEL = "nn.Linear(1, 1)"
MODES = ("off", "after-import", "before-import", "per-test")
MESSAGE_LIMIT = 300


def watched() -> dict[str, Any]:
    """PyTorch's attention entry points, as the objects they are right now.

    Keys are the names users write; the set covers everything the tracer has
    ever wrapped, read with ``getattr`` so a name this PyTorch lacks is ``None``.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    return {
        "F.scaled_dot_product_attention": getattr(F, "scaled_dot_product_attention", None),
        "F.multi_head_attention_forward": getattr(F, "multi_head_attention_forward", None),
        "nn.MultiheadAttention.forward": nn.MultiheadAttention.__dict__.get("forward"),
        "nn.TransformerEncoderLayer.forward": nn.TransformerEncoderLayer.__dict__.get("forward"),
        "torch._native_multi_head_attention": getattr(torch, "_native_multi_head_attention", None),
        "torch._transformer_encoder_layer_fwd": getattr(torch, "_transformer_encoder_layer_fwd", None),
    }


def build_model(expression: str) -> Any:
    """Evaluate ``expression`` (e.g. ``nn.Linear(1, 1)``) into an ``nn.Module``."""
    import torch
    from torch import nn

    model = eval(expression, {"torch": torch, "nn": nn})  # the user's own command line
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {expression!r} made a {type(model).__name__}, not an nn.Module")
    return model


def first_line(text: str | None) -> str | None:
    """The first non-empty line; with the next one when the first is only ``SomeError:``."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[0]
    if line.endswith(":") and " " not in line and len(lines) > 1:
        line = f"{line} {lines[1]}"
    return line if len(line) <= MESSAGE_LIMIT else line[: MESSAGE_LIMIT - 1] + "…"


def report_message(report: pytest.TestReport) -> str | None:
    """First line of what pytest would print for this report."""
    longrepr = report.longrepr
    if longrepr is None:
        return None
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        reason = str(longrepr[2])
        return first_line(reason.removeprefix("Skipped: "))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return first_line(crash.message)
    return first_line(str(longrepr))


class Recorder:
    """Collects one outcome per test and writes it as soon as the test is over."""

    def __init__(self, out_path: str, mode: str, model_expr: str) -> None:
        self.out_path = out_path
        self.mode = mode
        self.model_expr = model_expr
        self.current: dict[str, dict[str, Any]] = {}
        self.before: dict[str, Any] = {}
        self.session_trace: Any = None
        self.trace_error: str | None = None
        self._file = open(out_path, "a", encoding="utf-8")  # closed at session end

    def write(self, payload: dict[str, Any]) -> None:
        self._file.write(json.dumps(payload, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    # -- traces ----------------------------------------------------------

    def open_trace(self) -> Any:
        import qkvtrace

        trace = qkvtrace.trace(build_model(self.model_expr))
        trace.__enter__()
        return trace

    @staticmethod
    def close_trace(trace: Any) -> None:
        trace.__exit__(None, None, None)

    # -- outcomes --------------------------------------------------------

    def record(self, report: pytest.TestReport) -> None:
        entry = self.current.setdefault(report.nodeid, {"outcome": None, "message": None})
        wasxfail = getattr(report, "wasxfail", None)
        if report.when == "setup":
            if report.failed:
                entry.update(outcome="error", message=report_message(report))
            elif report.skipped:
                if wasxfail is not None:
                    entry.update(outcome="xfailed", message=first_line(wasxfail))
                else:
                    entry.update(outcome="skipped", message=report_message(report))
        elif report.when == "call":
            if wasxfail is not None:
                outcome = "xfailed" if report.skipped else "xpassed"
                entry.update(outcome=outcome, message=first_line(wasxfail) or report_message(report))
            elif report.passed:
                entry.update(outcome="passed", message=None)
            elif report.failed:
                entry.update(outcome="failed", message=report_message(report))
            else:
                entry.update(outcome="skipped", message=report_message(report))
        elif report.when == "teardown" and report.failed and entry["outcome"] in (None, "passed"):
            message = report_message(report)
            entry.update(outcome="error", message=f"in teardown: {message}" if message else "in teardown")

    def finish(self, nodeid: str) -> None:
        entry = self.current.pop(nodeid, None)
        if entry is None or entry["outcome"] is None:
            return
        self.write({"nodeid": nodeid, **entry})


_recorder: Recorder | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    out_path = os.environ.get(OUT_ENV)
    if not out_path or _recorder is not None:
        return
    mode = os.environ.get(MODE_ENV, "off")
    if mode not in MODES:
        raise pytest.UsageError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    _recorder = Recorder(out_path, mode, os.environ.get(MODEL_ENV, DEFAULT_MODEL))
    _recorder.before = watched()  # first thing, before any other plugin's configure


def _open_session_trace(rec: Recorder) -> None:
    try:
        rec.session_trace = rec.open_trace()
    except Exception as exc:
        rec.write({"error": f"could not open qkvtrace.trace({rec.model_expr}): {type(exc).__name__}: {exc}"})
        raise pytest.UsageError(f"qkvtrace.trace({rec.model_expr}) failed: {exc}") from exc


def pytest_sessionstart(session: pytest.Session) -> None:
    rec = _recorder
    if rec is not None and rec.mode == "before-import":
        _open_session_trace(rec)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collection is over: every test module has been imported."""
    rec = _recorder
    if rec is not None and rec.mode == "after-import":
        _open_session_trace(rec)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, None]:
    rec = _recorder
    if rec is None or rec.mode != "per-test":
        yield
        return
    trace = rec.open_trace()
    try:
        yield
    finally:
        rec.close_trace(trace)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _recorder is not None:
        _recorder.record(report)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _recorder is not None:
        _recorder.finish(nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _recorder
    rec = _recorder
    if rec is None:
        return
    _recorder = None
    if rec.session_trace is not None:
        try:
            rec.close_trace(rec.session_trace)
        except Exception as exc:
            rec.trace_error = f"closing the trace raised {type(exc).__name__}: {exc}"
    after = watched()
    identity = {
        name: ("same object" if after[name] is original else f"changed: now {after[name]!r}")
        for name, original in sorted(rec.before.items())
    }
    rec.write(
        {
            "session": {
                "mode": rec.mode,
                "model": rec.model_expr,
                "identity": identity,
                "trace_error": rec.trace_error,
                "qkvtrace_imported": "qkvtrace" in sys.modules,
                "exitstatus": int(exitstatus),
            }
        }
    )
    rec.close()
