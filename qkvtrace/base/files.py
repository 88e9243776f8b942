"""Files written whole or not at all: through a temporary file and a rename."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text"]


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename.

    The file gets the permissions ``open()`` would give it (those of the file it
    replaces, else 0o666 less the umask), not the 0o600 of a temporary file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _new_file_mode(path: Path) -> int:
    """The mode ``open(path, "w")`` would leave: the existing file's, else 0o666 less the process's umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0o022)  # read by setting it back at once (Python < 3.13 has no getter)
        os.umask(umask)
        return 0o666 & ~umask
