"""``qkvtrace check TARGET``: causal and padding leakage, by perturbation."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.cli._common import add_budget_options, add_target_options, check_output_file, load_with_inputs, progress

TRUE_MEANS = ("ignore", "attend")

__all__ = ["register", "run"]

_HELP = """\
Test a model's attention by changing its input and watching its output —
what a reversed or off-by-one mask, an inverted padding mask, a softmax over
the wrong axis or heads mixed by a wrong view() do, whatever the code says.

  --causal    for every position j, change only j's input: no output at a
              position before j may move ("position 3 reads position 4").
  --padding   mark the tail of the first sequence (and the head of the
              second) as padding, pass the mask as the keyword --mask-arg
              (default key_padding_mask) and change only the padded inputs:
              no real position's output may move.

What True means in the mask is the argument's convention (docs/tutorial.md#masks):
key_padding_mask and src_key_padding_mask say True = ignore (a bool mask,
True on padding); Hugging Face's attention_mask says 1 = attend (an int64
mask, 1 on real tokens). These are the defaults for those names; any other
name is assumed to follow PyTorch (ignore) — say --mask-true-means to be
sure. Before judging, the convention is measured: the padded inputs must move
some real output without a mask, and the mask must remove that somewhere.
The result says whether it did ("confirmed"), and if the opposite convention
would have.

Each check runs in inference (eval + no_grad, where PyTorch's fast paths run)
and in training (train, grad on, dropout reseeded identically), and says in
which mode a failure appears. NaN in an output fails too. The attention
calls of each mode (path, backend, fully-masked rows) are listed after.

Exit 0: every requested check holds; 1: one failed (evidence printed);
2: bad input. Not caught by perturbation: a wrong scale (sqrt(d_model)
instead of sqrt(head_dim)) changes no dependency, only sharpness.
"""


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="causal / padding leakage checks on a model, by perturbation",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  qkvtrace check demo:tiny-lm --causal\n"
                              "  qkvtrace check my_pkg.model:build --causal --padding --mask-arg pad_mask\n"
                              "  qkvtrace check hf:./tiny-bert --random-init --padding \\\n"
                              "      --mask-arg attention_mask")  # fmt: skip
    add_target_options(p)
    p.add_argument("--causal", action="store_true", help="outputs at t must not depend on inputs after t")
    p.add_argument("--padding", action="store_true", help="real positions must not depend on padded ones")
    p.add_argument("--mask-arg", default="key_padding_mask", metavar="NAME",
                   help="keyword the padding mask is passed as (default key_padding_mask)")
    p.add_argument("--mask-true-means", choices=TRUE_MEANS, metavar="ignore|attend",
                   help="what True (1) means in that mask: ignore = padding (PyTorch), attend = real token "
                        "(Hugging Face); default: the argument's known convention, else ignore")  # fmt: skip
    p.add_argument("--mode", choices=("both", "inference", "training"), default="both", help="modes to run in")
    p.add_argument("--trials", type=int, default=2, metavar="N", help="random perturbations per position (default 2)")
    p.add_argument("--input-shape", metavar="B,T", help="batch and sequence length of made-up inputs (default 2,16)")
    p.add_argument("--json", metavar="FILE", type=Path, help="write the findings as JSON")
    add_budget_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.check import MODES, run_checks
    from qkvtrace.base.errors import InputError
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.terminal import calls_table, convention_lines, findings_table

    if not (args.causal or args.padding):
        raise InputError("choose at least one check: --causal and/or --padding")
    if args.trials < 1:
        raise InputError(f"--trials {args.trials}: give a positive number")
    if args.json is not None:
        check_output_file(args.json, "--json")
    modes = MODES if args.mode == "both" else (args.mode,)
    with progress(f"loading {args.target}") as status:
        loaded = load_with_inputs(args.target, args.input_shape, args.max_tokens, args.max_attention_mb,
                                  random_init=args.random_init)  # fmt: skip
        status("perturbing inputs")
        report = run_checks(loaded.model, loaded.args, loaded.kwargs, causal=args.causal, padding=args.padding,
                            mask_arg=args.mask_arg, mask_true_means=args.mask_true_means, trials=args.trials,
                            modes=modes)  # fmt: skip
    console.print(findings_table(report.findings, f"qkvtrace check {args.target}", width=console.width), crop=False)
    for line in convention_lines(report.convention):
        console.print(line)
    console.print(calls_table(report.calls, "attention calls seen during the checks", width=console.width),
                  crop=False)  # fmt: skip
    failed = [f for f in report.findings if not f.passed]
    if failed:
        where = sorted({f"{f.check} ({f.mode})" for f in failed})
        console.print(f"[bold red]FAILED[/]: {', '.join(where)}")
    else:
        console.print("[bold green]all requested checks hold[/]")
    if args.json is not None:
        data = {"schema": "qkvtrace.check/1", "target": args.target, "ok": report.ok,
                "findings": [asdict(f) for f in report.findings], "calls": report.calls,
                "padding_convention": asdict(report.convention) if report.convention else None}  # fmt: skip
        atomic_write_text(args.json, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0 if report.ok else 1
