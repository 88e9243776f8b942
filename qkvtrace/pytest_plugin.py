"""qkvtrace in a test suite: a ``qkvtrace`` fixture and assertions about attention.

Installed as a pytest plugin (entry point ``pytest11``, name ``qkvtrace``), so
any suite in an environment with qkvtrace gets the fixture without a
``conftest.py``; ``pytest -p no:qkvtrace`` turns it off. ::

    from qkvtrace.pytest_plugin import assert_backend, assert_paths

    def test_inference_takes_the_fast_path(qkvtrace):
        model = build().eval()
        with torch.no_grad(), qkvtrace(model) as t:     # the factory: qkvtrace.trace(model, ...)
            model(x)
        assert_paths(t, {"fast", "fused_encoder_layer"})

The assertions are plain functions (``qkvtrace.assert_paths(...)`` on the
fixture is the same function): they raise :class:`AssertionError` whose
message names what was expected and shows the offending call records
(module, path, backend, PyTorch's reason) as a table, e.g.::

    AssertionError: 1 of 2 attention calls took a path outside {'fast'}:
      #  module              path      backend  why not fast path
      1  layers.1.self_attn  fallback  none     training is enabled

What is asserted is always what the trace observed on the installed
PyTorch; an assertion about a trace that recorded no call fails (silence is
not evidence), naming the modules the trace could not see.

Importing this module does not import PyTorch: pytest loads the plugin in
every run of every suite in the environment, torch-free ones included.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from qkvtrace.records import TRACE_SCHEMAS, kernel_refusal

if TYPE_CHECKING:
    from torch import nn

    from qkvtrace.tracer import Trace

__all__ = [
    "TraceFactory",
    "assert_backend",
    "assert_no_future_leak",
    "assert_no_nan_rows",
    "assert_paths",
    "assert_same_as_report",
    "calls_of",
    "format_calls",
]

#: The columns every failure table shows (issue: module, path, PyTorch's reason).
_BASE_COLUMNS = ("index", "module", "path", "sdpa_backend", "why")
_HEADERS = {
    "index": "#",
    "rank": "rank",
    "module": "module",
    "path": "path",
    "sdpa_backend": "backend",
    "why": "why not fast path",
    "nan_count": "NaN values",
    "fully_masked_rows": "fully masked rows",
}
_MAX_ROWS = 20  # rows shown in a failure table; the rest are counted


# -- reading what a trace saw ----------------------------------------------------------


def calls_of(t: Any) -> list[dict[str, Any]]:
    """The call records of ``t`` as ``qkvtrace.trace/3`` JSON objects (a ``/2`` or ``/1`` file's as written).

    ``t``: an open or finished :class:`qkvtrace.Trace`, a
    :class:`qkvtrace.TraceResult`, its ``to_dict()`` form, a list of call
    records, or the path of a trace JSON file (checked against its schema).
    """
    if isinstance(t, (str, Path)):
        from qkvtrace.records.validation import load_json

        return list(load_json(t, TRACE_SCHEMAS)["calls"])
    if isinstance(t, Mapping):
        return [dict(c) for c in t["calls"]]
    calls = getattr(t, "calls", t)
    if not isinstance(calls, Iterable):
        raise TypeError(f"expected a qkvtrace trace, its result, its JSON or a file; got {type(t).__name__}")
    return [dict(c) if isinstance(c, Mapping) else dataclasses.asdict(c) for c in calls]


def _unobserved_of(t: Any) -> list[dict[str, Any]]:
    if isinstance(t, (str, Path)):
        from qkvtrace.records.validation import load_json

        t = load_json(t, TRACE_SCHEMAS)
    result = getattr(t, "result", t)
    if isinstance(result, Mapping):
        return [dict(u) for u in result.get("unobserved", [])]
    return [dataclasses.asdict(u) for u in getattr(result, "unobserved", [])]


def _cell(call: Mapping[str, Any], column: str) -> str:
    if column == "why":
        why = call.get("why_not_fast_path")
        layer = call.get("why_not_fused_layer")
        if layer and not why:  # the encoder layer's own reason for not taking its fused path
            why = f"(layer: {layer})"
        elif layer:
            why = f"{why} (layer: same)" if why == layer else f"{why} (layer: {layer})"
        if call.get("error"):
            return f"{why}; raised {call['error']}" if why else f"raised {call['error']}"
        if why is None:
            return "-" if call.get("path") in ("sdpa", "flex") else "(fast path taken)"
        return str(why)
    if column == "why_not_kernel":  # PyTorch's words refusing a backend it ranks above the one it chose
        found = kernel_refusal(call.get("sdpa_refusals"))
        return "-" if found is None else f"{found[0]}: {found[1]}"
    if column in ("nan_count", "fully_masked_rows"):
        value = (call.get("output") or {}).get(column)
        return "?" if value is None else str(value)
    value = call.get(column)
    if column == "module":
        return value or "(root)"
    if column == "sdpa_backend":
        return value or "none"
    return "-" if value is None else str(value)


def format_calls(calls: Sequence[Mapping[str, Any]], extra: Sequence[str] = ()) -> str:
    """A plain-text table of call records: ``#``, module, path, backend, PyTorch's reason, then ``extra``.

    A ``rank`` column is added when the records carry a rank (traces taken
    under ``torch.distributed``). Plain text, so CI logs keep it aligned.
    """
    columns = list(_BASE_COLUMNS[:1])
    if any(c.get("rank") is not None for c in calls):
        columns.append("rank")
    columns += list(_BASE_COLUMNS[1:]) + list(extra)
    shown = list(calls[:_MAX_ROWS])
    table = _table([[_HEADERS.get(c, c) for c in columns]] + [[_cell(call, c) for c in columns] for call in shown])
    if len(calls) > len(shown):
        table += f"\n  ... and {len(calls) - len(shown)} more"
    return table


def _table(rows: list[list[str]]) -> str:
    """Rows of cells (the first is the header), left-aligned in columns, indented by two spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _require_calls(t: Any, what: str) -> list[dict[str, Any]]:
    __tracebackhide__ = True
    calls = calls_of(t)
    if not calls:
        unseen = _unobserved_of(t)
        message = f"the trace recorded no attention call, so nothing shows that {what}"
        if unseen:
            message += "; attention-like modules it could not see:\n" + "\n".join(
                f"  {u['module'] or '(root)'} ({u['module_type']}): {u['reason']}" for u in unseen
            )
        else:
            message += "; did the model run inside the `with` block?"
        raise AssertionError(message)
    return calls


def _set_text(values: Iterable[Any]) -> str:
    return "{" + ", ".join(repr(v) for v in sorted(values, key=str)) + "}"


# -- assertions --------------------------------------------------------------------------


def assert_paths(t: Any, allowed: str | Iterable[str]) -> None:
    """Every recorded call took one of the ``allowed`` paths.

    Paths: ``fast``, ``fallback``, ``fused_encoder_layer``, ``sdpa``, ``flex``
    (the words of ``AttentionCall.path``). The failure lists each call that
    took another path, with PyTorch's reason for refusing the fast one.
    """
    __tracebackhide__ = True
    wanted = {allowed} if isinstance(allowed, str) else set(allowed)
    calls = _require_calls(t, f"attention took a path in {_set_text(wanted)}")
    bad = [c for c in calls if c.get("path") not in wanted]
    if bad:
        raise AssertionError(
            f"{len(bad)} of {_plural(len(calls), 'attention call')} took a path outside {_set_text(wanted)}:\n"
            + format_calls(bad)
        )


def assert_backend(t: Any, backend: str | Iterable[str | None] | None) -> None:
    """Every recorded call ran the SDPA ``backend`` (an ``SDPBackend`` member name, or a set of them).

    ``None`` in the set accepts calls that ran no SDPA kernel (the fast MHA
    path, or the explicit-softmax branch of ``need_weights=True``).
    """
    __tracebackhide__ = True
    wanted = {backend} if backend is None or isinstance(backend, str) else set(backend)
    shown = _set_text("none" if b is None else b for b in wanted)
    calls = _require_calls(t, f"the SDPA backend was in {shown}")
    bad = [c for c in calls if c.get("sdpa_backend") not in wanted]
    if bad:
        # "none" is explained only where it is printed: in the wanted set or in a row of the table
        note = " (backend none: no SDPA kernel ran)" if None in wanted or any(
            c.get("sdpa_backend") is None for c in bad) else ""  # fmt: skip
        raise AssertionError(
            f"{len(bad)} of {_plural(len(calls), 'attention call')} ran another SDPA backend than {shown}"
            f"{note}:\n" + format_calls(bad, extra=("why_not_kernel",))
        )


def assert_no_nan_rows(t: Any, *, fully_masked: bool = True) -> None:
    """No recorded call returned NaN, and (``fully_masked=True``) none had a query row with every key masked.

    A fully masked row is NaN on some APIs, backends and PyTorch versions and
    zero on others (``qkvtrace probe`` shows which on yours); either way its
    output means nothing. ``fully_masked=False`` checks NaN values only.
    A call whose NaN count is unknown (it raised) fails too: no count is no
    evidence. Fully masked rows are checked where the trace counts them
    (not for FlexAttention's block masks).
    """
    __tracebackhide__ = True
    calls = _require_calls(t, "no attention output was NaN")

    def offending(c: Mapping[str, Any]) -> bool:
        out = c.get("output") or {}
        nan = out.get("nan_count")
        return nan is None or nan > 0 or (fully_masked and bool(out.get("fully_masked_rows")))

    bad = [c for c in calls if offending(c)]
    if bad:
        what = "NaN outputs or fully masked query rows" if fully_masked else "NaN outputs"
        what += (
            " (NaN values ?: not counted)" if any((c.get("output") or {}).get("nan_count") is None for c in bad) else ""
        )
        raise AssertionError(
            f"{len(bad)} of {_plural(len(calls), 'attention call')} had {what}:\n"
            + format_calls(bad, ("nan_count", "fully_masked_rows"))
        )


def assert_no_future_leak(
    model: nn.Module,
    *args: Any,
    modes: Sequence[str] = ("inference", "training"),
    trials: int = 1,
    rtol: float = 1e-4,
    **kwargs: Any,
) -> None:
    """No output position of ``model(*args, **kwargs)`` depends on a later input position.

    The ``qkvtrace check --causal`` machinery (:func:`qkvtrace.run_checks`):
    each position's input is changed in turn, in each of ``modes``
    (``inference``: eval + no_grad, where fast paths run; ``training``), and
    any earlier output that moves is a leak. The failure names the leaking
    position pairs and shows the attention calls that ran in that mode.
    """
    __tracebackhide__ = True
    from qkvtrace.analyses.check import run_checks

    report = run_checks(model, args, kwargs, causal=True, trials=trials, rtol=rtol, modes=tuple(modes))
    failed = [f for f in report.findings if not f.passed]
    if failed:
        parts = []
        for f in failed:
            calls = report.calls.get(f.mode, [])
            parts.append(
                f"{f.check} check failed in {f.mode} mode: {f.detail}\n"
                f"  attention calls in {f.mode} mode:\n" + format_calls([dict(c, index=i) for i, c in enumerate(calls)])
            )
        raise AssertionError("\n".join(parts))


_COMPARED = ("module", "path", "sdpa_backend", "why_not_fast_path", "why_not_fused_layer", "aten_ops")


def assert_same_as_report(t: Any, reference: str | Path, *, scenario: str | None = None) -> None:
    """The calls of ``t`` match a saved reference, field by field.

    ``reference`` is either

    * a per-version report (``reports/torch-2.13.0+cpu`` or its
      ``report.json``, written by ``qkvtrace inspect``) with ``scenario``
      naming one of its probe scenarios: the trace of that scenario on the
      running PyTorch must show the calls the report recorded — the check to
      run after a PyTorch upgrade; or
    * a trace file (``qkvtrace.trace/3``, ``/2`` or ``/1``) kept as the expected behaviour of
      your own model.

    Compared per call, in order: module, path, SDPA backend, PyTorch's
    reasons and the aten ops (skipped where either side has no evidence).
    """
    __tracebackhide__ = True
    from qkvtrace.records.validation import load_json

    ref_path = Path(reference)
    if ref_path.is_dir():
        ref_path = ref_path / "report.json"
    data = load_json(ref_path)
    label = str(reference)
    if data["schema"] == "qkvtrace.report/1":
        ref_version = data["environment"]["torch_version"]
        scenarios = {s["name"]: s for s in data["probes"]["scenarios"]}
        if scenario is None or scenario not in scenarios:
            given = "no scenario given" if scenario is None else f"no scenario {scenario!r} in it"
            raise ValueError(f"{label} is a report ({given}); pass scenario=, one of: {', '.join(sorted(scenarios))}")
        expected = scenarios[scenario]["calls"]
        label = f"{label} scenario {scenario!r}"
    elif data["schema"] in TRACE_SCHEMAS:
        if scenario is not None:
            raise ValueError(f"{label} is a trace, not a report; scenario= applies to reports only")
        ref_version = data.get("torch_version", "")
        expected = data["calls"]
    else:
        raise ValueError(f"{label} is a {data['schema']} file; give a report folder, report.json or trace file")
    actual = calls_of(t)
    result = getattr(t, "result", t)
    version = result.get("torch_version", "") if isinstance(result, Mapping) else getattr(result, "torch_version", "")
    where = f"(trace on torch {version or '?'}, reference from torch {ref_version or '?'})"
    differences: list[list[str]] = []
    for i, (exp, got) in enumerate(zip(expected, actual, strict=False)):
        for key in _COMPARED:
            if key not in exp:
                continue
            want, have = exp.get(key), got.get(key)
            if key == "aten_ops" and (want is None or have is None):
                continue  # no evidence on one side: nothing to compare
            if want != have:
                differences.append([str(i), got.get("module") or "(root)", key, _show(want), _show(have)])
    if len(expected) != len(actual):
        differences.append(["-", "-", "number of calls", str(len(expected)), str(len(actual))])
    if differences:
        table = _table([["#", "module", "field", "reference", "trace"], *differences])
        raise AssertionError(
            f"the trace differs from {label} {where}:\n{table}\n  calls of the trace:\n" + format_calls(actual)
        )


def _show(value: Any) -> str:
    return "null" if value is None else value if isinstance(value, str) else json.dumps(value)


# -- the fixture -------------------------------------------------------------------------


class TraceFactory:
    """What the ``qkvtrace`` fixture returns: ``qkvtrace(model, **options)`` is ``qkvtrace.trace(model, **options)``.

    The assertions hang on it too (``qkvtrace.assert_paths(t, {"fast"})``), so
    a test needs no import. Every trace it made is listed in ``traces``; when
    a test using the fixture fails, pytest's report gets a section with their
    calls.
    """

    assert_paths = staticmethod(assert_paths)
    assert_backend = staticmethod(assert_backend)
    assert_no_nan_rows = staticmethod(assert_no_nan_rows)
    assert_no_future_leak = staticmethod(assert_no_future_leak)
    assert_same_as_report = staticmethod(assert_same_as_report)

    def __init__(self) -> None:
        self.traces: list[Trace] = []

    def __call__(self, model: nn.Module, **options: Any) -> Trace:
        from qkvtrace.tracer import trace

        t = trace(model, **options)
        self.traces.append(t)
        return t

    def describe(self) -> str:
        """The calls of every trace made so far, one table per trace (for failure reports)."""
        parts = []
        for n, t in enumerate(self.traces):
            try:
                calls = calls_of(t)
            except Exception as exc:  # a trace never entered or broken by the failing test: say so, do not mask it
                parts.append(f"trace {n}: its calls cannot be read ({type(exc).__name__}: {exc})")
                continue
            parts.append(f"trace {n}: {_plural(len(calls), 'attention call')}" + (":\n" + format_calls(calls)
                         if calls else ""))  # fmt: skip
        return "\n".join(parts)


@pytest.fixture
def qkvtrace() -> TraceFactory:
    """A tracer factory: ``with qkvtrace(model) as t: ...``, plus the assertions as attributes."""
    return TraceFactory()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    factory = getattr(item, "funcargs", {}).get("qkvtrace")
    if report.when == "call" and report.failed and isinstance(factory, TraceFactory) and factory.traces:
        if not _raised_here(call):  # a qkvtrace assertion has already shown its calls
            report.sections.append(("qkvtrace: attention calls of this test", factory.describe()))


def _raised_here(call: pytest.CallInfo[None]) -> bool:
    """Whether the test failed in one of this module's assertions (its last frame is here)."""
    tb = call.excinfo.tb if call.excinfo is not None else None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == __file__
