"""Read the attention path's source out of the installed PyTorch.

The tutorial (docs/tutorial.md#how-pytorch-runs-attention) says: read the actual source of your version with
``inspect``. This module does it for every function on the attention path:
it starts from the entry points users touch and follows the calls their
source makes (by AST, resolved against the function's own globals) to a
bounded depth, so a helper that only some version calls shows up in that
version's report. Builtins (C++) get their signature/docstring.

Nothing here imports a rendering library: the collection runs in any
environment that has torch.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import os
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ENTRY_POINTS",
    "FAST_PATH_FUNCTIONS",
    "Discovered",
    "SourceEntry",
    "discover",
    "fast_path_conditions",
    "torch_relative",
]

#: Where reading starts: dotted names as users know them.
ENTRY_POINTS: tuple[str, ...] = (
    "torch.nn.modules.activation.MultiheadAttention.__init__",
    "torch.nn.modules.activation.MultiheadAttention._reset_parameters",
    "torch.nn.modules.activation.MultiheadAttention.forward",
    "torch.nn.modules.activation.MultiheadAttention.merge_masks",
    "torch.nn.modules.transformer.TransformerEncoderLayer.forward",
    "torch.nn.modules.transformer.TransformerEncoderLayer._sa_block",
    "torch.nn.modules.transformer.TransformerEncoder.forward",
    "torch.nn.modules.transformer.TransformerDecoderLayer.forward",
    "torch.nn.modules.transformer.TransformerDecoderLayer._sa_block",
    "torch.nn.modules.transformer.TransformerDecoderLayer._mha_block",
    "torch.nn.modules.transformer.Transformer.forward",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.attention.sdpa_kernel",
)

#: Functions whose ``why_not_*`` reason assignments make the fast-path table.
FAST_PATH_FUNCTIONS: tuple[str, ...] = (
    "torch.nn.modules.activation.MultiheadAttention.forward",
    "torch.nn.modules.transformer.TransformerEncoderLayer.forward",
    "torch.nn.modules.transformer.TransformerEncoder.forward",
)

#: Python code in these modules is read and followed; calls elsewhere in
#: torch are kept only when they are attention builtins.
_FOLLOW_MODULES = (
    "torch.nn.functional",
    "torch.nn.modules.activation",
    "torch.nn.modules.transformer",
    "torch.nn.attention",
)
_ATTENTION_WORDS = ("attention", "multi_head", "transformer", "sdp", "in_projection", "mask")
_REASON_VARS = ("why_not_fast_path", "why_not_sparsity_fast_path")

_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__))


def torch_relative(path: str | None) -> str | None:
    """A file path relative to the torch package root (``nn/functional.py``)."""
    if path is None:
        return None
    full = os.path.abspath(path)
    if full.startswith(_TORCH_ROOT + os.sep):
        return os.path.relpath(full, _TORCH_ROOT).replace(os.sep, "/")
    return os.path.basename(full)


@dataclass
class SourceEntry:
    """One function on the attention path, as the installed PyTorch has it."""

    name: str
    kind: str  # "python" | "builtin"
    file: str | None
    lineno: int | None
    sha256: str
    text: str
    #: Why the text is a signature only (builtin) or why it is missing.
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "file": self.file,
            "lineno": self.lineno,
            "sha256": self.sha256,
            "text": self.text,
            "note": self.note,
        }


@dataclass
class Discovered:
    """The result of :func:`discover`: entries, static call edges, what was missing."""

    entries: dict[str, SourceEntry] = field(default_factory=dict)
    #: ``(caller, callee)`` names found in the callers' source.
    edges: set[tuple[str, str]] = field(default_factory=set)
    #: Entry points this PyTorch does not have: name -> reason.
    missing: dict[str, str] = field(default_factory=dict)
    #: Resolved objects by name (not serialised; used by the dynamic call graph).
    objects: dict[str, Any] = field(default_factory=dict)


def resolve(dotted: str) -> Any:
    """Import the longest module prefix of ``dotted`` and walk the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _python_name(fn: Any) -> str | None:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    return f"{module}.{qualname}"


def _is_builtin(obj: Any) -> bool:
    return isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
        callable(obj) and not inspect.isfunction(obj) and type(obj).__name__ == "builtin_function_or_method"
    )


def _entry_for(name: str, obj: Any) -> SourceEntry:
    fn = inspect.unwrap(obj) if callable(obj) else obj
    if inspect.isfunction(fn):
        try:
            lines, lineno = inspect.getsourcelines(fn)
            text = "".join(lines)
            return SourceEntry(name, "python", torch_relative(inspect.getsourcefile(fn)), lineno, _sha(text), text)
        except (OSError, TypeError) as exc:  # no .py on disk (zipped or stripped install)
            text = f"{name}{_signature(fn)}"
            return SourceEntry(name, "python", None, None, _sha(text), text, note=f"no source: {exc}")
    # C++ builtin: inspect.getsource raises TypeError; keep what Python exposes.
    doc = inspect.getdoc(fn) or ""
    text = doc if doc else f"{name}{_signature(fn)}"
    return SourceEntry(name, "builtin", None, None, _sha(text), text, note="builtin: implemented in C++")


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):  # many builtins have no signature
        return "(...)"


class _CallFinder(ast.NodeVisitor):
    """Dotted call targets in a function body: ``F.linear``, ``self.merge_masks``, ``foo``."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def visit_Call(self, node: ast.Call) -> None:
        dotted = _dotted(node.func)
        if dotted is not None:
            self.targets.append(dotted)
        self.generic_visit(node)


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _function_ast(text: str) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return None


def _resolve_call(target: str, fn: Any, owner: type | None) -> tuple[str, Any] | None:
    """Resolve a call target of ``fn``'s source to ``(name, object)`` in torch."""
    head, _, rest = target.partition(".")
    if head == "self" and owner is not None:
        attr = rest.split(".")[0]
        for klass in owner.__mro__:
            if attr in vars(klass):
                obj = vars(klass)[attr]
                name = _python_name(obj)
                return (name, obj) if name else None
        return None
    globs = getattr(fn, "__globals__", {})
    if head not in globs:
        return None
    obj = globs[head]
    accessed = [head]
    for attr in rest.split(".") if rest else []:
        obj = getattr(obj, attr, None)
        accessed.append(attr)
        if obj is None:
            return None
    if not callable(obj) or isinstance(obj, type):
        return None
    if _is_builtin(obj):
        base = globs[head]
        if isinstance(base, types.ModuleType):
            name = ".".join([base.__name__, *accessed[1:]])
        else:
            name = f"{fn.__module__}.{target}"
        return name, obj
    name = _python_name(inspect.unwrap(obj))
    return (name, obj) if name else None


def _follow(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in _FOLLOW_MODULES)


def _keep_builtin(name: str) -> bool:
    if not name.startswith("torch."):
        return False
    leaf = name.rsplit(".", 1)[-1]
    return any(w in leaf for w in _ATTENTION_WORDS)


def _owner_class(name: str) -> type | None:
    module = name.rpartition(".")[0]
    try:
        obj = resolve(module)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


def discover(entry_points: tuple[str, ...] = ENTRY_POINTS, depth: int = 3) -> Discovered:
    """Read the entry points and what their source calls, ``depth`` levels down."""
    found = Discovered()
    frontier: list[tuple[str, Any, int]] = []
    for dotted in entry_points:
        try:
            obj = resolve(dotted)
        except (ImportError, AttributeError) as exc:
            found.missing[dotted] = f"{type(exc).__name__}: {exc}"
            continue
        frontier.append((dotted, obj, 0))
    while frontier:
        name, obj, level = frontier.pop(0)
        if name in found.entries:
            continue
        entry = _entry_for(name, obj)
        found.entries[name] = entry
        found.objects[name] = obj
        if entry.kind != "python" or level >= depth or entry.note:
            continue
        fn = inspect.unwrap(obj)
        tree = _function_ast(entry.text)
        if tree is None:
            continue
        finder = _CallFinder()
        finder.visit(tree)
        owner = _owner_class(name)
        for target in finder.targets:
            resolved = _resolve_call(target, fn, owner)
            if resolved is None:
                continue
            callee, callee_obj = resolved
            if callee == name:
                continue
            if _is_builtin(callee_obj):
                if not _keep_builtin(callee):
                    continue
            elif not _follow(callee):
                continue
            found.edges.add((name, callee))
            if callee not in found.entries:
                frontier.append((callee, callee_obj, level + 1))
    return found


def _reason_text(node: ast.AST) -> str | None:
    """A plain string's value; an f-string in its source form, placeholders kept.

    ``ast.unparse`` joins implicitly concatenated pieces and normalises quotes,
    so re-wrapping a long message across lines is not reported as a change.
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, (ast.JoinedStr, ast.BinOp)):
        return ast.unparse(node)
    return None


def _reason_assignments(body: list[ast.stmt]) -> Iterator[tuple[str, ast.Assign]]:
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id in _REASON_VARS for t in stmt.targets):
            var = next(t.id for t in stmt.targets if isinstance(t, ast.Name) and t.id in _REASON_VARS)
            yield var, stmt


def fast_path_conditions(name: str, text: str) -> list[dict[str, str]]:
    """Every non-empty reason assigned to ``why_not_*`` in source order, with its condition.

    The condition is ``ast.unparse`` of the innermost ``if``/``elif`` test that
    guards the assignment (``"<always>"`` when none does).
    """
    tree = _function_ast(text)
    if tree is None:
        return []
    out: list[tuple[int, dict[str, str]]] = []

    def visit(body: list[ast.stmt], condition: str) -> None:
        for var, assign in _reason_assignments(body):
            reason = _reason_text(assign.value)
            if reason:
                out.append((assign.lineno, {"variable": var, "reason": reason, "condition": condition}))
        for stmt in body:
            if isinstance(stmt, ast.If):
                visit(stmt.body, ast.unparse(stmt.test))
                visit(stmt.orelse, f"not ({ast.unparse(stmt.test)})")
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                for sub in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, sub, []) or [], condition)
            elif isinstance(stmt, ast.FunctionDef) and stmt.name == name.rsplit(".", 1)[-1]:
                visit(stmt.body, condition)

    visit(list(ast.iter_child_nodes(tree)), "<always>")  # type: ignore[arg-type]
    # An elif's own test is the meaningful condition: "not (previous)" only
    # appears for a bare else, which PyTorch's chains do not use for reasons.
    out.sort(key=lambda item: item[0])
    return [d for _, d in out]
