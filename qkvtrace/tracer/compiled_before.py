"""Graphs ``torch.compile`` made and ran before the trace opened, read from Dynamo's cache.

The usual way to look at a compiled model: it is compiled and warmed up, then a trace is opened around a few
steps. Its graphs were compiled before the trace listened to the compile log, and the compiled code calls no
function the tracer wraps. What they do is still on hand, in Dynamo's own cache: each frame Dynamo compiled keeps
its cache entries on the code object of the function it compiled (``type(module).forward``), each entry's code
calls the compiled function through a global of that function's module (``__compiled_fn_...``), and that compiled
function holds Dynamo's graph (``named_parameters`` of an AOTAutograd function is the graph's own method; the
``eager`` backend's is the graph's ``forward``) and, for inductor, the code inductor generated, forward and
backward (``source_code`` of the compiled graphs it holds). The same readers as for a graph compiled inside the
trace make the records; nothing is called, compiled or changed.

Which of several cache entries a call takes is decided by Dynamo's guards when it runs; every entry is recorded,
and the evidence says how many there were. Dynamo's cache belongs to the code, not to a module: a module is read
only when a ``torch.compile`` wrapper runs it (traced, or found beside the trace); another instance of the same
class that runs eagerly is not.
"""

from __future__ import annotations

import gc
import sys
import types
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qkvtrace.base import compat
from qkvtrace.tracer import compiled, compiled_code

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["read"]

#: how far and how wide to look inside a compiled function for what it holds
_DEPTH, _WIDTH = 10, 4000


def _entries(code: types.CodeType) -> list[Any]:
    """Dynamo's cache entries on ``code`` (none when Dynamo is not loaded or keeps them elsewhere)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    get = getattr(frame, "_debug_get_cache_entry_list", None)
    if get is None:
        return []
    try:
        return list(get(code))
    except Exception:  # another shape in another release
        return []


def _compiled_functions(entry: Any, scope: dict[str, Any]) -> list[tuple[str, Any]]:
    """The compiled functions an entry's code calls (names ``__compiled_fn_...`` in the function's globals)."""
    code = getattr(entry, "code", None)
    names = getattr(code, "co_names", ())
    return [(n, scope[n]) for n in names if n.startswith("__compiled_fn") and n in scope]


def _graph(fn: Any) -> torch.fx.GraphModule | None:
    """Dynamo's graph held by a compiled function."""
    if isinstance(getattr(fn, "__self__", None), torch.fx.GraphModule):  # the graph's own forward (``eager``)
        return fn.__self__  # type: ignore[no-any-return]
    for attr in ("named_parameters", "forward", "__call__"):
        owner = getattr(getattr(fn, attr, None), "__self__", None)
        if isinstance(owner, torch.fx.GraphModule):
            return owner
    original = getattr(fn, "_torchdynamo_orig_callable", None)
    if original is not None and original is not fn:
        return _graph(original)
    return None


def _held(fn: Any, dynamo: torch.fx.GraphModule) -> tuple[list[str], list[torch.fx.GraphModule]]:
    """What a compiled function holds beside Dynamo's graph: the source of each graph inductor compiled (forward,
    and backward once it ran), and AOTAutograd's ATen graphs where no compiler turned them into code."""
    found: dict[int, str] = {}
    graphs: list[torch.fx.GraphModule] = []
    queue: deque[tuple[Any, int]] = deque([(fn, 0)])
    seen: set[int] = set()
    while queue and len(seen) < _WIDTH:
        obj, depth = queue.popleft()
        if isinstance(obj, torch.fx.GraphModule) and obj is not dynamo and id(obj) not in seen:
            seen.add(id(obj))
            graphs.append(obj)
            continue
        if id(obj) in seen or depth > _DEPTH or isinstance(obj, (nn.Module, torch.Tensor, types.ModuleType)):
            continue
        seen.add(id(obj))
        source = getattr(obj, "source_code", None) if not isinstance(obj, type) else None
        if isinstance(source, str) and "def call(" in source:
            found[id(obj)] = source
            continue
        children: list[Any] = []
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                children.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for attr in ("__self__", "__wrapped__", "__func__"):
            if hasattr(obj, attr):
                children.append(getattr(obj, attr))
        held = getattr(obj, "__dict__", None)
        if held is not None and not (isinstance(obj, type) and obj.__module__ in ("builtins", "typing")):
            children += [v for k, v in dict(held).items() if not k.startswith("__")]
        if isinstance(obj, (list, tuple)):
            children += list(obj)
        queue.extend((c, depth + 1) for c in children if not isinstance(c, (str, int, float, bool, bytes)))
    return list(found.values()), graphs


def _kind(gm: torch.fx.GraphModule) -> str:
    """An AOTAutograd graph's kind: a backward graph takes the incoming gradients (``tangents_1``, ...)."""
    return "backward" if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes) \
        else "forward"

def _fits(gm: torch.fx.GraphModule, root: str, module: nn.Module) -> bool:
    """Every module path in the graph leads, from ``module``, to a module of the type the graph names there:
    the graph was made for a module of this structure (Dynamo guards on structure, not on the object)."""
    scope = {root: module}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            if not isinstance(path, str):
                continue
            found = compiled.module_at(path, scope)
            if found is None or (isinstance(kind, type) and type(found) is not kind):
                return False
    return True


def _shared_inline_code() -> tuple[types.CodeType, dict[str, Any]] | None:
    """The code Dynamo compiles for a ``torch.nn`` module given to ``torch.compile`` whole (``nn.Sequential``):
    the function ``wrap_inline`` wraps it in, whose cache entries all such modules share."""
    utils = sys.modules.get("torch._dynamo.external_utils")
    wrap = getattr(utils, "wrap_inline", None)
    code = next((c for c in getattr(getattr(wrap, "__code__", None), "co_consts", ())
                 if isinstance(c, types.CodeType) and c.co_name == "inner"), None)  # fmt: skip
    return (code, vars(utils)) if code is not None else None


def _compiled_wrappers(modules: list[tuple[str, nn.Module]]) -> set[int]:
    """Ids of the traced modules a ``torch.compile`` wrapper (``OptimizedModule``) runs: those the traced ones
    wrap, else any such wrapper in the process (``compiled = torch.compile(model)`` made beside the trace). A
    module no wrapper runs runs eagerly, whatever Dynamo cached for its class."""
    optimized = compat.compiled_module_types()
    if not optimized:
        return set()
    traced = {id(m) for _, m in modules}
    found = {id(getattr(m, "_orig_mod", None)) for _, m in modules if isinstance(m, optimized)} & traced
    if not found:
        for obj in gc.get_objects():  # only where Dynamo cached code for a traced module: see read()
            try:
                if isinstance(obj, optimized) and id(getattr(obj, "_orig_mod", None)) in traced:
                    found.add(id(getattr(obj, "_orig_mod", None)))
            except ReferenceError:  # a weak proxy whose object is gone
                continue
    return found


def _codes(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, types.CodeType, dict[str, Any], str]]:
    """``(name, module, code, its globals, what it is)`` for each compiled code the modules may run, outermost
    first: a module class's own ``forward``; for a ``torch.nn`` module given to ``torch.compile`` whole, the code
    that wraps it."""
    optimized = compat.compiled_module_types()
    found = []
    shared = _shared_inline_code()
    for name, m in modules:
        forward = getattr(type(m), "forward", None)
        code = getattr(forward, "__code__", None)
        if code is None or (optimized and isinstance(m, optimized)):
            continue
        if not type(m).__module__.startswith("torch."):
            found.append((name, m, code, getattr(forward, "__globals__", {}), f"{type(m).__qualname__}.forward"))
        elif shared is not None:
            found.append((name, m, shared[0], shared[1], f"torch.compile's wrapper of {type(m).__qualname__}"))
    return found


def _with_resumed(entries: list[Any], scope: dict[str, Any], what: str,
                  depth: int = 0) -> list[tuple[str, Any, dict[str, Any], str]]:
    """``(number, entry, its function's globals, what it is on)`` for each cache entry, and for the functions
    Dynamo resumes at after a graph break (``__resume_at_...``, whose code holds entries of its own)."""
    found = []
    for number, entry in enumerate(entries):
        found.append((f"{number + 1} of {len(entries)}", entry, scope, what))
        for name in getattr(getattr(entry, "code", None), "co_names", ()):
            resumed = scope.get(name) if name.startswith("__resume_at") else None
            code = getattr(resumed, "__code__", None)
            if code is None or depth >= 8:
                continue
            where = f"{what}, resumed after a graph break ({name})"
            found += _with_resumed(_entries(code), getattr(resumed, "__globals__", scope), where, depth + 1)
    return found


def read(trace: Trace, modules: list[tuple[str, nn.Module]]) -> set[str]:
    """Record the attention of every graph Dynamo compiled for these modules (outermost first) before the trace
    opened; the names of the modules whose graphs were read."""
    read_for: set[str] = set()
    wrapped: set[int] | None = None
    for name, m, code, scope, what in _codes(modules):
        if any(name == r or name.startswith(r + ".") or not r for r in read_for):
            continue  # inside a module whose graphs were read: those graphs hold it
        entries = _entries(code)
        if not entries:
            continue
        if wrapped is None:  # asked once, and only where Dynamo holds code a traced module may run
            wrapped = _compiled_wrappers(modules)
        if id(m) not in wrapped:
            continue
        for number, entry, scope_of, where in _with_resumed(entries, scope, what):
            for fn_name, fn in _compiled_functions(entry, scope_of):
                gm = _graph(fn)
                if gm is None or not _fits(gm, compiled.root_name(gm), m):
                    continue
                # the trace in the key: traces opening in two threads read the same graph each for itself
                key = ("_".join(fn_name.strip("_").split("_")[:3]), f"cache entry {number}", id(trace))
                said = f"Dynamo's cache entry {number} on {where} (compiled before the trace opened), graph {fn_name}"
                compiled.record_graph(key, gm, {compiled.root_name(gm): m}, [trace], said)
                sources, graphs = _held(fn, gm)
                for kind, aten in sorted(((_kind(g), g) for g in graphs), key=lambda e: e[0] == "backward"):
                    compiled.read_aot(key, aten, kind)
                parsed = sorted(map(compiled_code.parse, sources), key=lambda c: c.is_backward)  # forward first
                for generated in parsed:
                    compiled.read_code(key, generated)
                compiled.forget(key)
                read_for.add(name)
    return read_for
