"""Stand-in for PyTorch's ``test/test_cpp_extensions_open_device_registration.py``.

Not PyTorch's file: ``test_transformers.py`` imports two helpers from it at
module level, and only its ``TestSDPAPrivateUse1Only`` class uses them, in
``setUpClass``, to build a C++ extension from ``test/cpp_extensions/`` (not
copied here). This stand-in keeps the import working and skips that class
(``unittest.SkipTest`` raised in ``setUpClass`` skips every test of the class),
in the plain and the traced run alike.
"""

from __future__ import annotations

import unittest

REASON = "needs PyTorch's test/cpp_extensions sources, not copied into benchmarks/pytorch_tests"


def remove_build_path() -> None:
    raise unittest.SkipTest(REASON)


def generate_faked_module() -> object:
    raise unittest.SkipTest(REASON)
