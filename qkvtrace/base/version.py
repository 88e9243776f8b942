"""This qkvtrace's version (``qkvtrace.__version__``)."""

__version__ = "0.1.0"
