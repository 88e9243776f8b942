"""Reading and writing report JSON. No PyTorch here: reports made elsewhere can be read anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkvtrace.errors import SchemaError

__all__ = ["REPORT_SCHEMA", "dumps_report", "load_report"]

REPORT_SCHEMA = "qkvtrace.report/1"


def dumps_report(report: dict[str, Any]) -> str:
    """The canonical JSON text of a report (sorted keys, stable floats)."""
    return json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def load_report(path: str | Path) -> dict[str, Any]:
    """Read ``report.json`` (or the folder holding it); refuse other schemas."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SchemaError(f"{str(p)!r} does not exist; give a report folder or its report.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"{str(p)!r} is not a readable JSON report ({exc})") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(schema, str) or not schema.startswith("qkvtrace.report/"):
        raise SchemaError(f"{str(p)!r} has schema {schema!r}, not {REPORT_SCHEMA!r}; is it a qkvtrace report?")
    if schema != REPORT_SCHEMA:
        raise SchemaError(
            f"{str(p)!r} has schema {schema!r}, newer than this qkvtrace reads ({REPORT_SCHEMA}); upgrade qkvtrace"
        )
    return data
