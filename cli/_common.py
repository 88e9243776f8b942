"""Small helpers shared by the commands."""

from __future__ import annotations

import os
from pathlib import Path

from qkvtrace.errors import InputError, OutputError

__all__ = ["check_output_file", "parse_shape"]


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
