"""``qkvtrace.distributed``: the documented import path of
:mod:`qkvtrace.records.distributed`, where it lives."""

from qkvtrace.records.distributed import *  # noqa: F403
from qkvtrace.records.distributed import __all__  # noqa: F401
