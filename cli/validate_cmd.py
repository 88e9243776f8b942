"""``qkvtrace validate FILE...``: check qkvtrace JSON files against the shipped schemas."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.base.errors import QkvtraceError

__all__ = ["register", "run_validate"]

_HELP = """\
Check JSON files written by qkvtrace (traces, reports, diffs, probe and check
results) against the JSON Schema of the id in their "schema" key; the schemas
ship inside the package (qkvtrace/schemas/). A report folder stands for its
report.json. Each good file gets one line on stdout; each bad one gets one
line on stderr naming the file and the first bad place as a JSON pointer,
the same line `qkvtrace diff` prints when it refuses a file. Exit 0 when
every file is good, 2 otherwise: a check to run on files kept as CI artifacts.
"""


def register(sub: Any) -> None:
    from qkvtrace.records.validation import schema_ids

    p = sub.add_parser("validate", help="check qkvtrace JSON files against their schemas",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  qkvtrace validate reports/torch-*/report.json reports/diffs/*.json\n"
                              "  qkvtrace validate --schema qkvtrace.trace/3 t.json")  # fmt: skip
    p.add_argument("files", metavar="FILE", type=Path, nargs="+", help="a qkvtrace JSON file or a report folder")
    p.add_argument("--schema", metavar="ID", choices=schema_ids(),
                   help=f"require this schema id ({', '.join(schema_ids())}); default: any of them")  # fmt: skip
    p.set_defaults(run=run_validate)


def run_validate(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.records.streams import read_stream
    from qkvtrace.records.validation import load_json
    from qkvtrace.tracer.monitor import STREAM_SCHEMA

    bad = 0
    for path in args.files:
        if path.is_dir() and (path / "report.json").is_file():
            path = path / "report.json"
        try:
            if path.suffix == ".jsonl" and path.is_file():  # a long run's stream: every line checked
                lines, _ = read_stream(path)
                said = f"{len(lines)} lines, {STREAM_SCHEMA}"
            else:
                said = load_json(path, args.schema)["schema"]
        except QkvtraceError as exc:
            if args.debug:
                raise
            bad += 1
            print(f"qkvtrace validate: error: {exc}", file=sys.stderr)
            continue
        console.print(f"{path}: ok ({said})", markup=False, soft_wrap=True)
    return 2 if bad else 0
