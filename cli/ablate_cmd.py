"""``qkvtrace ablate``: the tutorial's Q/K/V ablations, trained with seeds and reported as means.

The modes are explained in docs/tutorial.md#without-the-projections.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.cli._common import check_output_file

__all__ = ["register", "run"]

_HELP = """\
Train one tiny model per attention mode and seed, on the same data in the
same order with the same optimizer and steps, and compare held-out accuracy:

  full          learned W_Q, W_K, W_V
  identity_qkv  Q = K = V = X, no projections
  shared_qk     W_Q = W_K, W_V kept
  uniform       QK^T = 0: every weight row is 1/T
  identity_v    learned W_Q, W_K; V = X
  no_attention  LayerNorm + FFN + residual only

Tasks:
  lookup     (default) 9 random tokens then an index token @i; answer: the
             token at position i, read from the last position. The answer
             must be routed there, so uniform and no_attention cannot learn it.
  marker     11 random tokens with one marker M, then a query; answer: the
             token right after M. Needs two layers; 1000 steps by default,
             10-14 s a run, and not every seed learns it (see docs/ablate.md).
  sentiment  the tutorial's 8 sentences (its one-sentence case); train on 6, evaluate on the
             held-out 2. A sanity task: 2 sentences say little about
             generalisation, and train accuracy 1.0 is memorisation.

Per mode: held-out accuracy and loss as mean ± sample std over the seeds,
and every run. Also measured, not assumed: uniform rows are 1/T, and with a
causal mask row t is the mean of the first t values; identity_qkv's share of
weight on the diagonal. Progress goes to stderr. The modes are explained in
docs/tutorial.md#without-the-projections.

Exit 0 done; 1 a claim of the tutorial did not hold on this PyTorch; 2 bad input.
"""

_EPILOG = """\
examples:
  qkvtrace ablate                                # lookup, 5 seeds, 400 steps (about 40 s of CPU time)
  qkvtrace ablate --seeds 3 --steps 100          # quicker, noisier
  qkvtrace ablate --task sentiment --md ablate.md
  qkvtrace ablate --json ablate.json --plot ablate.svg   # chart needs: pip install "qkvtrace[plot]"
"""


def register(sub: Any) -> None:
    from qkvtrace.analyses.ablate import TASKS

    p = sub.add_parser("ablate", help="Q/K/V ablations (tutorial: without the projections) trained with several seeds",
                       description=_HELP, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seeds", type=int, default=5, metavar="N", help="runs per mode, seeds 0..N-1 (default 5)")
    p.add_argument("--steps", type=int, metavar="N",
                   help="optimizer steps per run (default: the task's, " +
                        ", ".join(f"{t.name} {t.default_steps}" for t in TASKS.values()) + ")")  # fmt: skip
    p.add_argument("--task", default="lookup", metavar="NAME",
                   help=f"{', '.join(TASKS)} (default lookup)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", type=Path, help="write the study as JSON (qkvtrace.ablate/1)")
    p.add_argument("--md", metavar="FILE", type=Path, help="write the tables as Markdown")
    p.add_argument("--plot", metavar="FILE", type=Path, help="chart of mean ± std per mode (.svg, .png, .pdf)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qkvtrace.analyses.ablate import MODES, TASKS, RunResult, run_ablation
    from qkvtrace.base.errors import InputError, OutputError
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.ablate_render import ablate_chart, ablate_markdown, ablate_table, margin_line, properties_table

    if args.task not in TASKS:
        raise InputError(f"--task {args.task!r}: unknown task; choose one of {', '.join(TASKS)}")
    if args.seeds < 1:
        raise InputError(f"--seeds {args.seeds}: give a positive number of runs per mode")
    if args.steps is not None and args.steps < 1:
        raise InputError(f"--steps {args.steps}: give a positive number of optimizer steps")
    for flag in ("json", "md", "plot"):
        if getattr(args, flag) is not None:
            check_output_file(getattr(args, flag), f"--{flag}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (refuse before minutes of training, not after)
        except ImportError:
            raise OutputError(
                f'--plot {str(args.plot)!r}: charts need matplotlib; install it with pip install "qkvtrace[plot]"'
            ) from None

    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        bar = progress.add_task(f"training {args.task}: modes x seeds", total=len(MODES) * args.seeds)

        def advance(mode: str, run: RunResult) -> None:
            progress.update(bar, advance=1, description=f"{mode} seed {run.seed} acc {run.accuracy:.3f}")

        result = run_ablation(args.task, seeds=range(args.seeds), steps=args.steps, on_run=advance)

    console.print(ablate_table(result))
    console.print(margin_line(result), markup=False)
    console.print(properties_table(result))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    if args.md is not None:
        atomic_write_text(args.md, ablate_markdown(result))
    if args.plot is not None:
        ablate_chart(result, args.plot)
    broken = [p for p in result.properties if not p.holds]
    if broken:
        console.print(f"[bold red]a claim did not hold[/]: {', '.join(p.name for p in broken)}")
        return 1
    return 0
