"""Structure checks for qkvtrace's JSON files, against the JSON Schemas it ships.

Every file qkvtrace writes carries a ``"schema"`` key (``qkvtrace.trace/3``,
``qkvtrace.report/1``, ``qkvtrace.diff/1``, ...), and for each id there is one
JSON Schema (Draft 2020-12) in ``qkvtrace/schemas/``, named after it
(``qkvtrace.report/1`` -> ``report-1.json``). Readers go through
:func:`load_json` (or :func:`check_document` for an object already in memory)
before they touch a field, so a damaged or foreign file is refused with one
line naming the file and the first bad place as a JSON pointer::

    report.json: /callgraph/edges/3/caller: expected a string, got null

instead of a ``KeyError`` deep inside ``diff``. The checking itself is
``jsonschema``'s; this module only picks the error to show (the shallowest,
then the first in document order, so the choice never depends on the
library's heuristics) and words it.

``jsonschema`` is imported on first use: ``qkvtrace.analyses.report`` runs as the
collector in other environments that have only torch, and never validates.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkvtrace.base.errors import SchemaError

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator

    from qkvtrace.records import TraceResult

__all__ = [
    "MAX_JSON_BYTES",
    "check_document",
    "load_json",
    "load_trace",
    "read_json",
    "schema_file",
    "schema_ids",
]

#: Files larger than this are refused before reading (reports are ~0.2 MB,
#: a trace of 10,000 calls ~20 MB).
MAX_JSON_BYTES = 256 * 2**20

_PREFIX = "qkvtrace."
_SHOWN = 40  # characters of a value quoted in a message


def _schemas_dir() -> Any:
    return resources.files("qkvtrace") / "schemas"


def schema_file(schema_id: str) -> str:
    """``"qkvtrace.report/1"`` -> ``"report-1.json"``."""
    family, _, version = schema_id.removeprefix(_PREFIX).partition("/")
    return f"{family}-{version}.json"


@functools.cache
def _contents() -> dict[str, dict[str, Any]]:
    """Every shipped schema, by the schema id it describes (its ``title``)."""
    found: dict[str, dict[str, Any]] = {}
    for entry in _schemas_dir().iterdir():
        if entry.name.endswith(".json"):
            schema = json.loads(entry.read_text(encoding="utf-8"))
            found[schema["title"]] = schema
    return found


def schema_ids() -> tuple[str, ...]:
    """The schema ids this qkvtrace reads, sorted."""
    return tuple(sorted(_contents()))


@functools.cache
def _validator(schema_id: str) -> Validator:
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    resources_ = [(s["$id"], Resource.from_contents(s)) for s in _contents().values()]
    registry: Registry[Any] = Registry().with_resources(resources_)
    schema = _contents()[schema_id]
    validator: Validator = Draft202012Validator(schema, registry=registry)
    return validator


# -- reading -------------------------------------------------------------------


def read_json(path: str | Path, *, name: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file, refusing what cannot be one (missing, huge, binary, not UTF-8, not JSON)."""
    p = Path(path)
    name = name or str(p)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise SchemaError(f"{name}: is a folder; give a JSON file")
        if size > max_bytes:
            raise SchemaError(
                f"{name}: {size / 2**20:.0f} MB is more than a qkvtrace JSON file can be "
                f"({max_bytes / 2**20:.0f} MB); is it the right file?"
            )
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SchemaError(f"{name}: does not exist") from None
    except OSError as exc:
        raise SchemaError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    if b"\x00" in raw[:65536]:
        raise SchemaError(f"{name}: is a binary file, not JSON")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{name}: is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{name}: is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise SchemaError(f"{name}: is nested too deeply to be a qkvtrace JSON file") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SchemaError(f"{name}: is not valid JSON ({str(exc).partition(':')[0]})") from None


def load_json(
    path: str | Path, expected: str | tuple[str, ...] | None = None, *, name: str | None = None
) -> dict[str, Any]:
    """Read a qkvtrace JSON file and check it against the schema of its id.

    ``expected``: the schema id the caller can use (``"qkvtrace.report/1"``),
    or several; ``None`` accepts any id this qkvtrace knows. Raises
    :class:`~qkvtrace.base.errors.SchemaError` with one line naming the file.
    """
    name = name or str(path)
    data = read_json(path, name=name)
    check_document(data, name=name, expected=expected)
    result: dict[str, Any] = data
    return result


def load_trace(path: str | Path) -> TraceResult:
    """Read a ``qkvtrace.trace/3`` (or ``/2``, ``/1``) file (``qkvtrace trace ... --json``) into records.

    Keys this version does not know (a file from a newer qkvtrace) are left
    out rather than refused: the schema allows them. The ``fully_masked_rows``
    of a ``/2`` or ``/1`` file, counted with another meaning, are read as
    ``None`` with the reason (``fully_masked_rows_reason``).
    """
    import dataclasses

    from qkvtrace import records

    data = load_json(path, records.TRACE_SCHEMAS)

    def known(cls: Any, obj: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in obj.items() if k in names}

    slimmed = dict(data)
    slimmed["calls"] = [
        {**known(records.AttentionCall, c),
         "qkv": {**c["qkv"], **{p: known(records.SliceInfo, c["qkv"][p]) if c["qkv"][p] is not None else None
                                for p in ("q", "k", "v")}}}
        for c in data["calls"]
    ]  # fmt: skip
    slimmed["gradients"] = [
        {**g, **{p: known(records.SliceGrad, g[p]) for p in ("q", "k", "v")}} for g in data["gradients"]
    ]
    return records.TraceResult.from_dict(slimmed)


# -- checking --------------------------------------------------------------------


def check_document(data: Any, *, name: str, expected: str | tuple[str, ...] | None = None) -> str:
    """Check a parsed document; return its schema id, or raise :class:`SchemaError`."""
    known = schema_ids()
    if not isinstance(data, dict):
        raise SchemaError(f'{name}: expected a JSON object with a "schema" key, got {_kind(data)}')
    schema_id = data.get("schema")
    wanted = known if expected is None else (expected,) if isinstance(expected, str) else expected
    if schema_id not in wanted:
        raise SchemaError(f"{name}: {_schema_refusal(schema_id, wanted)}")
    assert isinstance(schema_id, str)
    try:
        error = _first(_validator(schema_id).iter_errors(data))
    except RecursionError:
        raise SchemaError(f"{name}: is nested too deeply to be a {schema_id} file") from None
    if error is not None:
        pointer, what = _describe(error)
        raise SchemaError(f"{name}: {pointer}: {what}" if pointer else f"{name}: {what}")
    return schema_id


def _schema_refusal(schema_id: Any, wanted: tuple[str, ...]) -> str:
    listed = _alternatives([json.dumps(w) for w in wanted])
    if not isinstance(schema_id, str):
        got = 'no "schema" key' if schema_id is None else _kind(schema_id)
        return f"/schema: expected {listed}, got {got}; is it a qkvtrace file?"
    family, _, version = schema_id.partition("/")
    for w in wanted:
        w_family, _, w_version = w.partition("/")
        if family == w_family and version.isdigit() and w_version.isdigit() and int(version) > int(w_version):
            return f"/schema: {_short(schema_id)} is newer than this qkvtrace reads ({w}); upgrade qkvtrace"
    return f"/schema: expected {listed}, got {_short(schema_id)}; is it the right file?"


def _effective_path(error: ValidationError) -> list[str | int]:
    """Where the error is; for a missing key, the key's own place."""
    path: list[str | int] = list(error.absolute_path)
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        key = next((k for k in missing if error.message.startswith(repr(k))), missing[0] if missing else None)
        if key is not None:
            path.append(key)
    return path


_KEYWORD_RANK = {"type": 0, "required": 1, "const": 2, "enum": 3}


def _order(error: ValidationError) -> tuple[Any, ...]:
    path = _effective_path(error)
    return (
        len(path),  # the shallowest place first: "/callgraph is null" before what lies inside it
        [(isinstance(p, str), p) for p in path],  # then document order (indices before keys never mix)
        _KEYWORD_RANK.get(str(error.validator), len(_KEYWORD_RANK)),
        error.message,
    )


def _first(errors: Iterable[ValidationError]) -> ValidationError | None:
    best = min(errors, key=_order, default=None)
    while best is not None and best.context:  # anyOf/oneOf: say which branch came closest
        best = min(best.context, key=_order)
    return best


def _pointer(path: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _describe(error: ValidationError) -> tuple[str, str]:
    """``("/callgraph/edges/3/caller", "expected a string, got null")``."""
    keyword, value, instance = error.validator, error.validator_value, error.instance
    pointer = _pointer(_effective_path(error))
    if keyword == "required":
        return pointer, "missing (a required key)"
    if keyword == "type":
        types = [value] if isinstance(value, str) else list(value)
        expected = _alternatives([_TYPE_NAMES.get(t, t) for t in types])
        return pointer, f"expected {expected}, got {_kind(instance)}"
    if keyword == "const":
        return pointer, f"expected {_short(value)}, got {_short(instance)}"
    if keyword == "enum":
        return pointer, f"expected {_alternatives([_short(v) for v in value])}, got {_short(instance)}"
    if keyword == "pattern":
        return pointer, f"expected a string matching {value}, got {_short(instance)}"
    if keyword in _BOUNDS:
        return pointer, f"expected {_BOUNDS[keyword]} {value}, got {_short(instance)}"
    if keyword in ("minItems", "maxItems"):
        words = "at least" if keyword == "minItems" else "at most"
        return pointer, f"expected {words} {value} items, got {len(instance)}"
    if keyword == "minLength":
        return pointer, f"expected a string of at least {value} characters, got {_short(instance)}"
    first = " ".join(error.message.split())
    return pointer, first if len(first) <= 120 else first[:119] + "…"


_BOUNDS = {
    "minimum": "at least",
    "exclusiveMinimum": "more than",
    "maximum": "at most",
    "exclusiveMaximum": "less than",
}

_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def _alternatives(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _short(value: Any) -> str:
    """A JSON rendering of ``value``, cut to a few dozen characters."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        text = json.dumps(value, ensure_ascii=False) if not isinstance(value, (dict, list)) else ""
    except (TypeError, ValueError):
        text = ""
    if not text:
        return _kind(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def _kind(value: Any) -> str:
    """``null``, ``true``, ``an integer (3)``, ``a string ("x")``, ``an array (5 items)``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"an integer ({_short(value)})"
    if isinstance(value, float):
        return f"a number ({_short(value)})"
    if isinstance(value, str):
        return f"a string ({_short(value)})"
    if isinstance(value, list):
        return f"an array ({len(value)} item{'' if len(value) == 1 else 's'})"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
