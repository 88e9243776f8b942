"""PyTorch's fast-path reasons read from the installed source, for tests that must name one exactly.

``reason_under("self.training")`` is the string ``MultiheadAttention.forward``
assigns to ``why_not_fast_path`` in the branch whose condition is
``self.training`` — read with ``ast`` from the running PyTorch, so a test can
compare a recorded reason for equality, not for being some substring of the source.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn


def plain_reasons(function: Callable[..., Any] = nn.MultiheadAttention.forward) -> dict[str, str]:
    """``{condition source: reason}`` for every ``why_not_fast_path = "<plain string>"`` under an ``if``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        for stmt in node.body:
            if (
                isinstance(stmt, ast.Assign)
                and [getattr(t, "id", None) for t in stmt.targets] == ["why_not_fast_path"]
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                found[ast.unparse(node.test)] = stmt.value.value
    return found


def reason_under(condition: str, function: Callable[..., Any] = nn.MultiheadAttention.forward) -> str:
    """The reason assigned when ``condition`` (as ``ast.unparse`` writes it) holds."""
    reasons = plain_reasons(function)
    assert condition in reasons, f"no branch `if {condition}:` assigns a plain reason; found {sorted(reasons)}"
    return reasons[condition]
