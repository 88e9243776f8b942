"""Trace a TARGET in this interpreter and print its ``qkvtrace.trace/3`` JSON:
``python -m qkvtrace.analyses.tracecollect``.

What ``qkvtrace compare --python A --python B TARGET`` runs in each
environment. It needs only torch (no rendering library): the model is built
and its inputs made from a fixed seed, so two environments run the same
model on the same inputs, and the trace goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["collect", "main"]

SEED = 0


def collect(target: str, *, train: bool = False, input_shape: tuple[int, int] | None = None,
            random_init: bool = False) -> dict[str, Any]:  # fmt: skip
    """One seeded run of ``target`` under a trace (with ``train``: a training step, backward included)."""
    from qkvtrace.analyses.target import first_tensor, load_target
    from qkvtrace.tracer import trace

    torch.manual_seed(SEED)
    loaded = load_target(target, random_init=random_init)
    if input_shape is not None or not (loaded.args or loaded.kwargs):
        batch, length = input_shape or (2, 16)
        loaded.args, loaded.kwargs = loaded.make_inputs(batch, length)
    model = loaded.model.train(train)
    torch.manual_seed(SEED)
    with trace(model) as t, torch.set_grad_enabled(train):
        out = model(*loaded.args, **loaded.kwargs)
        first = first_tensor(out)
        if train and first is not None and first.requires_grad:
            # a seeded random cotangent: the same in both environments, and never the zero gradient
            # a sum through a final LayerNorm has
            cotangent = torch.randn(first.shape, generator=torch.Generator().manual_seed(SEED), dtype=torch.float32)
            first.backward(cotangent.to(first.dtype))
    return t.to_dict()


def _shape(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,T (two integers), got {text!r}") from None
    return b, t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkvtrace.analyses.tracecollect", description=__doc__)
    parser.add_argument("target")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--input-shape", type=_shape, default=None)
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--cwd", metavar="DIR", default=None,
                        help="the folder TARGET is relative to (the caller's working directory)")  # fmt: skip
    args = parser.parse_args(argv)
    from qkvtrace.base.errors import QkvtraceError

    if args.cwd is not None:
        # qkvtrace is already imported from the copy the caller shipped, so the user's folder can
        # come first now: `file.py:build` and `module:build` mean what they mean to `qkvtrace trace`
        os.chdir(args.cwd)
    try:
        trace = collect(args.target, train=args.train, input_shape=args.input_shape, random_init=args.random_init)
    except QkvtraceError as exc:  # a bad TARGET: one line for the caller to show, exit 2 as the CLI does
        print(" ".join(str(exc).split()), file=sys.stderr)
        return 2
    json.dump(trace, sys.stdout, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
