"""``qkvtrace.advise``: the documented import path of
:mod:`qkvtrace.analyses.advise`, where it lives."""

from qkvtrace.analyses.advise import *  # noqa: F403
from qkvtrace.analyses.advise import __all__  # noqa: F401
