"""Reading and writing report JSON. No PyTorch here: reports made elsewhere can be read anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkvtrace.errors import SchemaError
from qkvtrace.validation import load_json

__all__ = ["REPORT_SCHEMA", "dumps_report", "load_report"]

REPORT_SCHEMA = "qkvtrace.report/1"


def dumps_report(report: dict[str, Any]) -> str:
    """The canonical JSON text of a report (sorted keys, stable floats)."""
    return json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def load_report(path: str | Path) -> dict[str, Any]:
    """Read ``report.json`` (or the folder holding it), checked against the ``qkvtrace.report/1`` schema.

    Raises :class:`~qkvtrace.errors.SchemaError` with one line naming the file
    and the first bad place (a JSON pointer) when it is not such a report.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.exists():
        raise SchemaError(f"{p}: does not exist; give a report folder or its report.json")
    return load_json(p, REPORT_SCHEMA)
