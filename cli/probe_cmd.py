"""``qkvtrace probe``: the behaviour probes alone (no sources, no files unless --json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.cli._common import check_output_file, progress

__all__ = ["register", "run"]

_HELP = """\
Run the behaviour probes of `qkvtrace inspect` on the installed PyTorch and
print them: which path/backend each scenario takes and why; what True means
in each API's boolean mask (measured on a 2x2 example); what a fully-masked
query row returns per API and SDPA backend, and whether its gradient is
finite; how far each backend and MHA path is from the reference attention; and how
far the tutorial's models (attention by hand, multi-head attention from
scratch, the Transformer block, the causal LM's attention) are from
nn.MultiheadAttention, nn.TransformerEncoderLayer and SDPA loaded with the
same weights, outputs and gradients, in float32 and bfloat16.
"""


def register(sub: Any) -> None:
    p = sub.add_parser("probe", help="measure mask semantics, NaN rows, paths and backends on this PyTorch",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--json", metavar="FILE", type=Path, help="write the probes as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.behaviour import run_behaviour
    from qkvtrace.analyses.probes import run_scenarios
    from qkvtrace.analyses.reference import measure as measure_reference
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render import terminal
    from qkvtrace.render.tutorial import reference_table

    if args.json is not None:
        check_output_file(args.json, "--json")
    with progress("running scenarios") as status:  # on stderr: stdout stays plain when piped
        scenarios, _ = run_scenarios(progress=lambda n: status(f"scenario {n}"))
        status("measuring masks, NaN rows, agreement")
        measured = run_behaviour()
        status("measuring the tutorial's models against PyTorch")
        measured["reference"] = measure_reference()
    width = console.width  # tables become one block per row where their names would not fit
    console.print(terminal.scenarios_table(scenarios, width=width), crop=False)
    console.print(terminal.mask_semantics_table(measured["mask_semantics"], width=width), crop=False)
    console.print(terminal.fully_masked_table(measured["fully_masked_rows"], width=width), crop=False)
    console.print(terminal.agreement_table(measured["agreement"], width=width), crop=False)
    console.print(reference_table(measured["reference"]))
    if args.json is not None:
        import torch

        data = {
            "schema": "qkvtrace.probes/1",
            "torch_version": str(torch.__version__),
            "scenarios": scenarios,
            **measured,
        }
        atomic_write_text(args.json, json.dumps(data, indent=1, sort_keys=True) + "\n")
        console.print(f"wrote {args.json}")
    return 0
