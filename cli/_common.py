"""Small helpers shared by the commands."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.base.errors import InputError, OutputError

__all__ = [
    "TARGET_HELP",
    "add_budget_options",
    "add_target_options",
    "check_output_file",
    "load_with_inputs",
    "parse_shape",
    "progress",
    "run_failed",
]

TARGET_HELP = """\
TARGET says where the model comes from:
  package.module:callable, path/to/file.py:callable
                    a factory taking no arguments that returns a model or
                    (model, example_inputs): a tensor, a tuple of arguments or
                    a dict of keyword arguments
  demo:NAME         a built-in demo (demo:mha, demo:encoder, demo:tiny-lm)
  hf:NAME_OR_PATH   a Hugging Face transformers model from a local folder or
                    the local cache (never downloaded); --random-init builds
                    it from its config.json alone, with random weights
  timm:NAME         a timm model, random weights (pip install timm)
  torchvision:NAME  a torchvision model, random weights (pip install torchvision)
Without example inputs they are made up: token ids for a model that starts
with nn.Embedding or has a vocabulary in its config, images of the config's
size for vision models, (B, T, E) floats for one that starts with an attention
layer (see --input-shape).
"""


@contextlib.contextmanager
def progress(text: str) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr while the block runs (only on a terminal); yields a function to change its text.

    Progress never goes to stdout, so piped output and JSON stay clean.
    """
    err = Console(stderr=True)
    with err.status(text, spinner="dots") as status:
        yield lambda message: status.update(message)


def add_target_options(p: Any) -> None:
    """TARGET and ``--random-init``."""
    p.add_argument(
        "target",
        metavar="TARGET",
        help="module:callable, file.py:callable, demo:NAME, hf:NAME_OR_PATH, timm:NAME or torchvision:NAME",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="hf: build the model from its config alone, with random weights (reads no weight file)",
    )


def check_output_file(path: Path, flag: str) -> Path:
    """Refuse, before any work is done, an output file that cannot be written."""
    if path.is_dir():
        raise OutputError(f"{flag} {str(path)!r} is a folder; give a file name such as {path / 'out.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{flag} {str(path)!r}: folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"{flag} {str(path)!r} is not writable; choose another path")
    return path


def parse_shape(text: str) -> tuple[int, int]:
    """``"2,16"`` -> ``(2, 16)``."""
    try:
        b, t = (int(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"--input-shape {text!r} is not B,T (two positive integers), e.g. 2,16") from None
    if b < 1 or t < 1:
        raise InputError(f"--input-shape {text!r} needs positive integers, e.g. 2,16")
    return b, t


def add_budget_options(p: Any) -> None:
    """``--max-tokens`` / ``--max-attention-mb`` (docs/tutorial.md#limits)."""
    from qkvtrace.base.limits import DEFAULT_MAX_ATTENTION_MB, DEFAULT_MAX_TOKENS

    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"refuse inputs of more than N tokens (batch x sequence; default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--max-attention-mb",
        type=float,
        default=DEFAULT_MAX_ATTENTION_MB,
        metavar="MB",
        help=f"refuse inputs whose attention needs more MB (default {DEFAULT_MAX_ATTENTION_MB:g})",
    )


def load_with_inputs(target: str, input_shape: str | None, max_tokens: int, max_attention_mb: float, *,
                     random_init: bool = False) -> Any:  # fmt: skip
    """Load TARGET, make inputs if needed, and refuse them if over budget — before any forward."""
    from qkvtrace.analyses.guard import Budget, check_budget
    from qkvtrace.analyses.target import load_target

    shape = parse_shape(input_shape) if input_shape else None
    loaded = load_target(target, random_init=random_init)
    if shape is not None or not (loaded.args or loaded.kwargs):
        b, t = shape or (2, 16)
        (loaded.args, loaded.kwargs), loaded.synthesized = loaded.make_inputs(b, t), True
    try:
        check_budget(loaded.model, loaded.args, loaded.kwargs, Budget(max_tokens, max_attention_mb))
    except ValueError as exc:
        raise InputError(f"{target}: {exc} (--max-tokens / --max-attention-mb)") from None
    return loaded


def run_failed(target: str, doing: str, exc: BaseException) -> InputError:
    """The one line for a model that raised while a command ran it (``doing``: "forward and backward", ...)."""
    return InputError(
        f"running {target}{' ' + doing if doing else ''} raised {type(exc).__name__}: {exc}; "
        "return (model, example_inputs) from the factory or adjust --input-shape"
    )
