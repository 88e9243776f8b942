"""``qkvtrace.grads``: the documented import path of
:mod:`qkvtrace.analyses.grads`, where it lives."""

from qkvtrace.analyses.grads import *  # noqa: F403
from qkvtrace.analyses.grads import __all__  # noqa: F401
