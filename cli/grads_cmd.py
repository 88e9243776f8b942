"""``qkvtrace grads TARGET``: one forward + backward, and how the loss reached W_Q, W_K, W_V."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.base.errors import InputError, OutputError
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
Run TARGET forward and backward once and show, for every attention call,
how the gradient of the loss reached its Q, K and V and the Q/K/V slices of
the projection weights (docs/tutorial.md#one-sentence-end-to-end): the backward kernel PyTorch ran
for the attention core, the norm of the gradient that reached Q, K and V
(per head in --json) with each route's share, and the gradient norm of each
weight slice.

The V route goes straight from attention @ V into V; the Q and K routes go
through the softmax and the scores, which is why the three slices of a
packed in_proj_weight get different gradients. At initialisation the V
route usually carries most of it.

The loss is next-token cross-entropy for a language model (token ids in,
one score per vocabulary entry out), else <output, R> with a fixed random R
(a plain sum would give zero gradient through a final LayerNorm). Attention
written by hand (a softmax of QK^T in the model's own module with q/k/v
projections) is included.

{TARGET_HELP}
With --svg, a graphviz picture of the same numbers: one node per attention
module, its backward kernel, the V route (solid blue) and the Q/K routes
(dashed orange) down to the weight slices.
"""

_EPILOG = """\
examples:
  qkvtrace grads demo:tiny-lm
  qkvtrace grads demo:encoder --svg routes.svg --json routes.json
  qkvtrace grads my_pkg.model:build --call 3 --svg call3.svg
  qkvtrace grads demo:tiny-lm --html routes.html

exit codes: 0 done; 1 no call had a gradient route to draw (the reasons are printed);
2 bad input
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "grads",
        help="one forward + backward: the gradient routes into Q, K, V and W_Q, W_K, W_V, drawn",
        description=_HELP.replace("{TARGET_HELP}", TARGET_HELP),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_options(p)
    p.add_argument("--call", type=int, metavar="N", help="only call N (its index in `qkvtrace trace`)")
    p.add_argument("--svg", metavar="FILE", type=Path, help="draw the routes with graphviz into this SVG")
    p.add_argument("--json", metavar="FILE", type=Path, help="write the qkvtrace.grads/2 JSON here")
    p.add_argument("--html", metavar="FILE", type=Path,
                   help="write one self-contained HTML page: the routes picture, each call's routes and slices, "
                        "and the trace's calls table with each call's details")  # fmt: skip
    p.add_argument("--eval", action="store_true", help="model.eval() (dropout off) instead of model.train()")
    p.add_argument("--input-shape", metavar="B,T", help="batch and sequence length of made-up inputs (default 2,16)")
    add_budget_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.analyses.grads import NoBackward, measure
    from qkvtrace.render.grads_render import grads_dot, grads_table
    from qkvtrace.render.graph import render_svg

    for path, flag in ((args.svg, "--svg"), (args.json, "--json"), (args.html, "--html")):
        if path is not None:
            check_output_file(path, flag)
    loaded = load_with_inputs(args.target, args.input_shape, args.max_tokens, args.max_attention_mb,
                              random_init=args.random_init)  # fmt: skip
    model = loaded.model
    model.train(not args.eval)
    try:
        with progress(f"running {args.target} forward and backward"):
            result = measure(model, tuple(loaded.args), dict(loaded.kwargs), target=args.target)
    except NoBackward as exc:
        raise InputError(f"{args.target}: {exc}") from None
    except Exception as exc:
        raise run_failed(args.target, "forward and backward", exc) from exc
    routes = result.routes
    if args.call is not None:
        routes = [r for r in routes if r.call == args.call]
        if not routes:
            known = ", ".join(str(r.call) for r in result.routes if r.call is not None) or "none"
            raise InputError(f"--call {args.call}: no such call (calls: {known})")
    console.print(grads_table(result, routes))
    if args.json is not None:
        result.save(args.json)
        console.print(f"wrote {args.json}")
    if args.html is not None:
        result.save_html(args.html)
        console.print(f"wrote {args.html}")
    drawable = [r for r in routes if r in result.drawable()]
    if not drawable:
        console.print("nothing to draw: no call had a gradient route in this pass", style="yellow")
        for r in routes:
            console.print(f"  {r.module or '(root)'} ({r.path}): {r.reason}", markup=False, highlight=False)
        return 1
    if args.svg is not None:
        drawing = render_svg(grads_dot(result, drawable))
        if drawing.svg is None:
            raise OutputError(f"--svg {args.svg}: {drawing.problem}")
        args.svg.write_text(drawing.svg, encoding="utf-8")
        console.print(f"wrote {args.svg} (drawn by {drawing.engine})")
    return 0
