"""The exceptions qkvtrace raises on purpose.

::

    QkvtraceError            base: the CLI catches it once and exits 2
    ├── TargetError          TARGET cannot be loaded or does not build a model
    ├── InputError           example inputs cannot be made or used
    ├── OutputError          an output path cannot be written
    └── SchemaError          a JSON file of another schema or version

Every message is one sentence naming the input and what to do about it.
"""

from __future__ import annotations

__all__ = ["InputError", "OutputError", "QkvtraceError", "SchemaError", "TargetError", "first_line"]


class QkvtraceError(Exception):
    """Base of every error qkvtrace raises for bad input or usage."""


class TargetError(QkvtraceError):
    """A TARGET that does not name a loadable model factory."""


class InputError(QkvtraceError):
    """Example inputs that cannot be synthesised or do not fit the model."""


class OutputError(QkvtraceError):
    """An output path that cannot be written."""


class SchemaError(QkvtraceError):
    """A JSON document of an unknown or newer schema."""


def first_line(exc: BaseException) -> str:
    """``"RuntimeError: <first line of the message>"``, for records of what PyTorch refused."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
