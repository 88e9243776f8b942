"""Reading and writing report JSON. No PyTorch here: reports made elsewhere can be read anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkvtrace.base.errors import SchemaError
from qkvtrace.records.validation import load_json

__all__ = [
    "ERROR_FACTOR",
    "ERROR_FLOOR",
    "MACHINE_FIELDS",
    "MAGNITUDE_TOLERANCE",
    "REPORT_SCHEMA",
    "dumps_report",
    "errors_agree",
    "first_difference",
    "load_report",
]

REPORT_SCHEMA = "qkvtrace.report/1"


def dumps_report(report: dict[str, Any]) -> str:
    """The canonical JSON text of a report (sorted keys, stable floats)."""
    return json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def load_report(path: str | Path) -> dict[str, Any]:
    """Read ``report.json`` (or the folder holding it), checked against the ``qkvtrace.report/1`` schema.

    Raises :class:`~qkvtrace.base.errors.SchemaError` with one line naming the file
    and the first bad place (a JSON pointer) when it is not such a report.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.exists():
        raise SchemaError(f"{p}: does not exist; give a report folder or its report.json")
    return load_json(p, REPORT_SCHEMA)


#: Two measurements of an error (a max |difference| between two computations) agree when they are
#: within this factor of each other, or this close in absolute terms: such errors are rounding noise
#: that moves with the CPU, the thread count and the memory layout. ``qkvtrace diff`` uses the same.
ERROR_FACTOR = 4.0
ERROR_FLOOR = 1e-5
#: Other measured numbers (magnitudes and norms, kept to 2 significant figures) agree within 10 %.
MAGNITUDE_TOLERANCE = 0.1
#: Environment fields that describe the machine that ran the collection, not the PyTorch it read.
MACHINE_FIELDS = ("platform", "python_version")


def errors_agree(a: float | None, b: float | None) -> bool:
    """Whether two measured errors are the same finding (see :data:`ERROR_FACTOR`)."""
    if a is None or b is None:
        return a is b
    if abs(a - b) <= ERROR_FLOOR:
        return True
    lo, hi = sorted((abs(a), abs(b)))
    return hi <= ERROR_FACTOR * max(lo, ERROR_FLOOR)


def _is_error(key: str) -> bool:
    return "err" in key or "max_abs_diff" in key


def _first_difference(a: Any, b: Any, where: str, key: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                return f"{where}/{k}"
            found = _first_difference(a[k], b[k], f"{where}/{k}", k)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{where}/{i}", key)
            if found is not None:
                return found
        return None
    numbers = (int, float)
    if isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, numbers) and isinstance(b, numbers)) or isinstance(a, bool) or isinstance(b, bool):
            return where
        if _is_error(key):
            return None if errors_agree(a, b) else where
        return None if abs(a - b) <= MAGNITUDE_TOLERANCE * max(abs(a), abs(b)) else where
    return None if a == b else where


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Where two reports of one PyTorch first say different things (a JSON pointer), else ``None``.

    The machine that made them (:data:`MACHINE_FIELDS`) is not a difference; measured errors compare
    with :func:`errors_agree` and other measured numbers within :data:`MAGNITUDE_TOLERANCE`; every
    other value (sources, conditions, call graph, paths, backends, reasons) must be equal.
    """
    envs = [{k: v for k, v in r.get("environment", {}).items() if k not in MACHINE_FIELDS} for r in (old, new)]
    found = _first_difference(envs[0], envs[1], "/environment", "environment")
    if found is not None:
        return found
    rest = [{k: v for k, v in r.items() if k != "environment"} for r in (old, new)]
    return _first_difference(rest[0], rest[1], "", "")
