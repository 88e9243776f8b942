"""``qkvtrace.validation``: the documented import path of
:mod:`qkvtrace.records.validation`, where it lives."""

from qkvtrace.records.validation import *  # noqa: F403
from qkvtrace.records.validation import __all__  # noqa: F401
