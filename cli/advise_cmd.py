"""``qkvtrace advise TARGET``: the changes that move attention to a faster path, measured on copies."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.base.errors import InputError
from qkvtrace.cli._common import (
    TARGET_HELP,
    add_budget_options,
    add_target_options,
    check_output_file,
    load_with_inputs,
    progress,
    run_failed,
)

__all__ = ["register", "run"]

_HELP = """\
Trace TARGET once (on a copy), and for every attention call that is not on
PyTorch's fastest path for it, read the facts the trace recorded --
PyTorch's own reason, the SDPA backend and its refusals, need_weights, the
masks, the modes -- and turn them into candidate changes: need_weights=False,
torch.inference_mode(), batch_first=True, a boolean mask instead of a float
one, torch.backends.mha fast path on, forward hooks off an encoder layer,
attn_implementation="sdpa" for a transformers model. PyTorch names only the
first reason it meets, so when a change uncovers the next reason, the
changes are measured together, each made on top of the others (up to every
change known for the call); a combination of three or more that reaches
another path is measured again with each change left out in turn.

Every candidate is made on a deep copy and measured against an unchanged
copy: the path and backend the call takes then (traced), the time of the
whole forward (--train: forward and backward) over interleaved
repetitions, and the largest output (and gradient) difference. A change is
recommended only when the call moved to another path or kernel, the
outputs agree, and the changed copy was faster in every repetition. Your
model, its hooks and the random number generators are not touched.

{TARGET_HELP}"""

_EPILOG = """\
examples:
  qkvtrace advise demo:mha
  qkvtrace advise hf:./my-model --random-init --input-shape 4,128
  qkvtrace advise my_pkg.model:build --train --budget 60 --json advice.json

exit codes: 0 done (with or without a recommendation); 2 bad input
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "advise",
        help="which change would move each attention call to a faster path -- measured on copies",
        description=_HELP.replace("{TARGET_HELP}", TARGET_HELP),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_options(p)
    p.add_argument("--train", action="store_true", help="a training step (forward + backward) instead of eval()")
    p.add_argument("--repeats", type=int, default=7, metavar="N", help="interleaved repetitions per change (default 7)")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="stop measuring after this long; the rest is listed")
    p.add_argument("--json", metavar="FILE", type=Path, help="write the qkvtrace.advise/1 JSON here")
    p.add_argument("--input-shape", metavar="B,T", help="batch and sequence length of made-up inputs (default 2,16)")
    add_budget_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.advise import advise
    from qkvtrace.render.advise_render import advise_table

    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.repeats < 2:
        raise InputError(f"--repeats {args.repeats}: at least 2 are needed for a spread")
    if args.budget is not None and args.budget <= 0:
        raise InputError(f"--budget {args.budget:g}: give a positive number of seconds")
    loaded = load_with_inputs(args.target, args.input_shape, args.max_tokens, args.max_attention_mb,
                              random_init=args.random_init)  # fmt: skip
    try:
        with progress(f"tracing {args.target}") as say:
            advice = advise(loaded.model, *loaded.args, train=args.train, repeats=args.repeats, budget=args.budget,
                            target=args.target, progress=say, **dict(loaded.kwargs))  # fmt: skip
    except Exception as exc:
        raise run_failed(args.target, "", exc) from exc
    console.print(advise_table(advice, width=console.width))
    if args.json is not None:
        advice.save(args.json)
        console.print(f"wrote {args.json}")
    return 0
