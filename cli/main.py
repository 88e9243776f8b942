"""The ``qkvtrace`` command: parse, call the library, render, map errors to exit codes.

Exit codes (every command): 0 done; 1 a check ran and found a problem;
2 bad input or usage (one line on stderr; ``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console

from qkvtrace import __version__
from qkvtrace.base.errors import QkvtraceError

# PyTorch warns at import when NumPy is absent; qkvtrace never uses NumPy,
# so the warning would only be noise on every command. (Importing qkvtrace
# above does not import torch: its names load on first use.)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

_DESCRIPTION = """\
See what really happens inside PyTorch attention: which path ran and why,
which SDPA kernel, what the packed Q/K/V weights and their gradients look like.
"""

_EPILOG = """\
examples:
  qkvtrace inspect                                 # per-version report into reports/
  qkvtrace trace demo:encoder                      # the fused encoder path, per layer
  qkvtrace trace demo:mha --train --backward       # fallback path, Q/K/V gradients
  qkvtrace trace my_pkg.models:build --json t.json # your own model factory
  qkvtrace trace path/to/model.py:make --input-shape 4,128
  qkvtrace grads demo:tiny-lm --svg routes.svg      # how the loss reaches W_Q, W_K, W_V, drawn
  qkvtrace probe                                   # mask semantics, NaN rows, backends
  qkvtrace check demo:tiny-lm --causal             # leakage by perturbation
  qkvtrace diff reports/torch-A reports/torch-B    # what changed between versions
  qkvtrace history reports/                        # which release changed what, 2.0 onwards
  qkvtrace ablate --seeds 5 --md ablate.md         # Q/K/V ablations, mean ± std over seeds
  qkvtrace validate reports/*/report.json t.json   # check saved JSON against its schema
  qkvtrace merge traces/ --json merged.json        # per-rank traces of a torchrun job; ranks that disagree
  qkvtrace advise demo:mha                         # which change would speed each call up, measured
  qkvtrace walkthrough --text "我 喜欢 机器人"      # one sentence through Q/K/V, step by step

exit codes: 0 done, 1 a check found a problem, 2 bad input or usage (--debug: traceback)

"""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from qkvtrace.cli import (
        ablate_cmd,
        advise_cmd,
        check_cmd,
        diff_cmd,
        grads_cmd,
        history_cmd,
        inspect_cmd,
        merge_cmd,
        probe_cmd,
        summarize_cmd,
        trace_cmd,
        validate_cmd,
        walkthrough_cmd,
    )

    parser = _Parser(
        prog="qkvtrace",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qkvtrace {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    trace_cmd.register(sub)
    grads_cmd.register(sub)
    inspect_cmd.register(sub)
    probe_cmd.register(sub)
    check_cmd.register(sub)
    diff_cmd.register(sub)
    history_cmd.register(sub)
    ablate_cmd.register(sub)
    validate_cmd.register(sub)
    merge_cmd.register(sub)
    summarize_cmd.register(sub)
    walkthrough_cmd.register(sub)
    advise_cmd.register(sub)
    for command in sub.choices.values():  # `qkvtrace trace X --debug` works too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        code: int = args.run(args, console)
        return code
    except QkvtraceError as exc:
        if args.debug:
            raise
        err.print(f"qkvtrace {args.command}: error: {exc}", markup=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("qkvtrace: interrupted; nothing was written", markup=False)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
