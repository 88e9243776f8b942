"""``qkvtrace.demos``: the documented import path of
:mod:`qkvtrace.analyses.demos`, where it lives."""

from qkvtrace.analyses.demos import *  # noqa: F403
from qkvtrace.analyses.demos import __all__  # noqa: F401
