"""``qkvtrace walkthrough``: one sentence through Q, K and V, recorded by the tracer.

The tutorial's one-sentence case: docs/tutorial.md#one-sentence-end-to-end.
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
Train the tutorial's single-head attention classifier (8 short sentences,
positive / negative) and show, for one sentence, every step with real numbers
from your PyTorch: the vocabulary and token ids; X = embedding + position;
W_Q, W_K, W_V as the three row slices of the packed [3D, D] in_proj_weight
(where the tracer found them); Q, K, V; the scores, the attention and the
context; logits, probabilities and the loss checked against -log p; the
per-slice gradient norms of the first backward (the tracer's gradient
record, checked against .grad); one SGD step checked against dW = -lr * grad;
the training curve; and the attention before and after training.

Everything runs under qkvtrace.trace(model); each matrix computed from the
recorded Q/K/V rows is checked against what PyTorch itself returned.

Exit 0 when every check holds, 1 when one does not, 2 for bad input.
"""

_EPILOG = """\
examples:
  qkvtrace walkthrough
  qkvtrace walkthrough --text "我 讨厌 延迟" --epochs 50
  qkvtrace walkthrough --text "我 喜欢 模型" --label positive   # a sentence outside the training set
  qkvtrace walkthrough --json walkthrough.json                   # qkvtrace.walkthrough/1
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "walkthrough",
        help="one sentence through Q/K/V: every matrix, gradient and update (docs/tutorial.md#one-sentence-end-to-end)",
        description=_HELP,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--text", default="我 喜欢 机器人", help="words separated by spaces (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=100, metavar="N", help="training epochs (default: 100)")
    p.add_argument(
        "--label",
        choices=("positive", "negative"),
        help="the sentence's label; needed only for a sentence outside the 8 training sentences",
    )
    p.add_argument("--lr", type=float, default=0.3, help="SGD learning rate (default: 0.3, as in the tutorial)")
    p.add_argument("--seed", type=int, default=31, help="torch.manual_seed before building the model (default: 31)")
    p.add_argument("--json", metavar="FILE", type=Path, help="write the qkvtrace.walkthrough/1 JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.walkthrough import run_walkthrough
    from qkvtrace.records import atomic_write_text
    from qkvtrace.render.tutorial import walkthrough_renderables

    if args.json is not None:
        check_output_file(args.json, "--json")
    err = Console(stderr=True)
    with err.status("training", spinner="dots") as status:
        data = run_walkthrough(
            args.text,
            args.epochs,
            label=args.label,
            lr=args.lr,
            seed=args.seed,
            progress=lambda e, n: status.update(f"epoch {e}/{n}") if e % 10 == 0 or e == n else None,
        )
    for renderable in walkthrough_renderables(data):
        console.print(renderable)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        console.print(f"wrote {args.json}")
    if data["problems"]:
        for problem in data["problems"]:
            console.print(f"problem: {problem}", style="bold red", markup=False)
        return 1
    return 0
