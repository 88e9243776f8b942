"""What ``torch.compile`` made of attention, read from PyTorch's own compile log.

Compiled code runs with no Python between its kernels, so the wrappers that
record eager calls stand aside there (:mod:`qkvtrace.tracer.install`). What
a compiled graph *does* with attention is decided once, at compile time, and
PyTorch writes it down: while any trace is open, a handler listens on the
structured compile log (the ``torch.__trace`` logger that ``TORCH_TRACE`` and
tlparse read). Each event is emitted from inside the compiler, with the graph
it describes at hand:

* ``dynamo_output_graph``: the FX graph Dynamo captured. Each node carries its
  module stack (``nn_module_stack``) and example values (shapes, dtypes); the
  frame's own locals resolve a module path such as ``L['self'].layers[0].attn``
  to the module object, so the owner is the traced module itself, not a name
  that looks right.
* ``aot_inference_graph`` / ``aot_forward_graph`` / ``aot_backward_graph``: the
  ATen graphs AOTAutograd made (``aot_eager``, ``inductor``); each node names
  the Dynamo node it came from (``from_node``, or ``source_fn_stack``).
* ``inductor_output_code``: the code inductor generated, whose comments name,
  for every kernel it calls, the Dynamo nodes and the ATen ops it came from --
  so a hand-written softmax that inductor's pattern matcher replaced with an
  SDPA kernel shows up as exactly that.

The handler reads the graphs and stores plain records; it never changes a
graph, a guard or a cache key, and it runs only while a graph is compiled.
A graph compiled before the trace opened is not in the log the trace hears.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qkvtrace.records import CompiledAttention
from qkvtrace.tracer import compiled_code, compiled_sdpa, registry
from qkvtrace.tracer.build import dtype_name
from qkvtrace.tracer.observers import handwritten

if TYPE_CHECKING:
    from qkvtrace.tracer.session import Trace

__all__ = ["RUNTIME_NOT_OBSERVED", "forget", "listening", "module_at", "read_aot", "read_code", "record_graph",
           "root_name"]

RUNTIME_NOT_OBSERVED = (
    "not observed: compiled code runs its kernels with no Python between them; a counting hook added after "
    "compiling never runs, and one present when compiling makes Dynamo compile again"
)

_LOG = "torch.__trace"
_DYNAMO = "dynamo_output_graph"
_AOT = ("aot_inference_graph", "aot_forward_graph", "aot_backward_graph")
_CODE = "inductor_output_code"
_BREAK = "dynamo_graph_break_reason"
#: Dynamo starts compiling a frame (logged before it traces the frame's code)
_START = "dynamo_start"

#: Dynamo graph targets that are an attention entry point, by the function's name
_ENTRY = {
    "scaled_dot_product_attention": "sdpa",
    "multi_head_attention_forward": "MultiheadAttention",
    "_native_multi_head_attention": "MultiheadAttention",
    "_transformer_encoder_layer_fwd": "fused_encoder_layer",
    "flex_attention": "flex",
}
_MODULE_ENTRY = {"MultiheadAttention": "MultiheadAttention", "TransformerEncoderLayer": "fused_encoder_layer",
                 "TransformerDecoderLayer": "MultiheadAttention"}  # fmt: skip
_MATMUL = {"matmul", "bmm", "baddbmm", "einsum", "__matmul__"}
_SOFTMAX = {"softmax", "_softmax", "safe_softmax", "_safe_softmax"}
#: operations that carry the scores to the softmax, or its probabilities to the value matmul, unchanged in kind
_BETWEEN = {
    "truediv", "div", "mul", "__truediv__", "__mul__", "add", "__add__", "iadd", "__iadd__", "sub", "masked_fill",
    "masked_fill_", "where", "tanh", "float", "to", "type", "type_as", "view", "reshape", "contiguous", "transpose",
    "dropout", "_dropout", "clone", "squeeze", "unsqueeze", "half", "bfloat16", "dropout_",
}  # fmt: skip
_MASKING = {"add", "__add__", "iadd", "__iadd__", "sub", "masked_fill", "masked_fill_", "where"}
#: the head of a module path in Dynamo's module stacks: the compiled frame's local that holds it
_LOCAL = re.compile(r"L\['([^']+)'\]")


def _name(target: Any) -> str:
    """The bare name of an FX node's target (a function, a method name or an op overload)."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[-1] if "::" not in name else name.split("::")[-1].split(".")[0]


@dataclass
class _Pending:
    """One attention operation of a Dynamo graph, as each open trace names it."""

    nodes: tuple[str, ...]
    entry: str
    #: the device of its tensors, whose kernel-to-backend table names the SDPA backend
    device: str
    #: its nodes also by the names they were made under (AOTAutograd's graphs name the Dynamo nodes so)
    names: frozenset[str] = frozenset()
    #: the Dynamo nodes computed from its output (their backward is not attention's)
    after: frozenset[str] = frozenset()
    #: positions, in the tuple inductor's forward code returns, of what its forward calls made or read
    saved: set[int] | None = None
    returned: int = 0
    records: list[tuple[Trace, CompiledAttention]] = field(default_factory=list)


#: graph key (frame id, frame compile id) -> its attention operations, while traces are open
_graphs: dict[tuple[Any, ...], list[_Pending]] = {}
_lock = threading.Lock()
_users = 0
_handler: _Handler | None = None


class _Handler(logging.Handler):
    #: the trace log's ``propagate`` before the handler came, restored when it goes
    propagated = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            metadata = getattr(record, "metadata", None)
            if not isinstance(metadata, dict) or not metadata:
                return
            event = next(iter(metadata))
            if event == _START:  # before Dynamo reads a module's hooks: it must not compile the watching ones in
                handwritten.stop_watching_for_compile()
                return
            if event == "artifact" and (metadata.get("artifact") or {}).get("name") == _BREAK:
                _graph_break(getattr(record, "payload", None) or "")
                return
            if event not in (_DYNAMO, _CODE, *_AOT):
                return
            key = (metadata.get("frame_id"), metadata.get("frame_compile_id"))
            if event == _DYNAMO:
                _read_dynamo(key, sys._getframe(1))
            elif event in _AOT:
                _read_aot(key, event, sys._getframe(1))
            else:
                read_code(key, getattr(record, "payload", None) or "")
        except Exception as e:  # never into the compiler: what could not be read is said in the trace
            for t in registry.open_traces():
                t.note(f"a torch.compile log event could not be read ({type(e).__name__}: {e})")

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class listening:
    """Listen on PyTorch's compile log while at least one trace is open."""

    def __enter__(self) -> listening:
        global _users, _handler
        with _lock:
            if _users == 0:
                _handler = _Handler(logging.DEBUG)
                log = logging.getLogger(_LOG)
                # PyTorch's trace log never propagates (it sets so when it configures logging); if something
                # turned that off, the user's own handlers would now receive its records: keep them its own
                _handler.propagated = log.propagate
                log.propagate = False
                log.addHandler(_handler)
            _users += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _users, _handler
        with _lock:
            _users -= 1
            if _users == 0 and _handler is not None:
                log = logging.getLogger(_LOG)
                log.removeHandler(_handler)
                log.propagate = _handler.propagated
                _handler = None
                _graphs.clear()


def _graph_break(payload: str) -> None:
    """Dynamo gave up on part of a frame: that part runs eagerly, where the trace stands aside."""
    lines = [line.strip() for line in payload.splitlines() if line.strip()]
    said = [next((x for x in lines if x.startswith(key)), None) for key in ("Graph break", "Explanation:")]
    reason = "; ".join(x for x in said if x) or next(
        (x for x in reversed(lines) if not x.startswith(("File ", "^", "~"))), ""
    )
    ident = threading.get_ident()
    for t in registry.open_traces():
        if t.thread in (None, ident):
            t.note(
                f"torch.compile broke a graph ({reason[:300] or 'reason not given'}); the code between graphs runs "
                "eagerly while the trace stands aside, so attention there is not observed"
            )


# -- the Dynamo graph: what the model wrote ------------------------------------


#: where the emitting frame holds the graph, when the event's ``payload_fn`` holds only its text
_HELD_AS = {"aot_forward_graph": "fw_module", "aot_backward_graph": "bw_module", "aot_inference_graph": "fw_module"}


def _graph_module(frame: types.FrameType | None, event: str = _DYNAMO) -> tuple[Any, ...]:
    """The GraphModule an event describes (held by the event's ``payload_fn``, or by the frame that emitted it)
    and, for Dynamo's graph, the ``OutputGraph`` that emitted it (its caller's ``self``)."""
    for _ in range(12):
        if frame is None or frame.f_code.co_name == "trace_structured":
            break
        frame = frame.f_back
    if frame is None:
        return None, None
    gm = None
    payload = frame.f_locals.get("payload_fn")
    for cell in getattr(payload, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.fx.GraphModule):
            gm = value
            break
    caller = frame.f_back
    if gm is None and caller is not None:
        held = caller.f_locals.get(_HELD_AS.get(event, "gm"))
        gm = held if isinstance(held, torch.fx.GraphModule) else None
    owner = caller.f_locals.get("self") if caller is not None else None
    return gm, (owner if type(owner).__name__ == "OutputGraph" else None)


def module_at(path: str, scope: dict[str, Any]) -> nn.Module | None:
    """Follow ``L['self'].layers[0].attn`` from the compiled frame's locals to the module object."""
    head = _LOCAL.match(path)
    if head is None:
        return None
    obj: Any = scope.get(head.group(1))
    for attr, index, key in re.findall(r"\.(\w+)|\[(\d+)\]|\['([^']+)'\]", path[head.end() :]):
        if obj is None:
            return None
        if attr:
            obj = getattr(obj, attr, None)
        elif index:
            obj = obj[int(index)] if isinstance(obj, (nn.ModuleList, nn.Sequential)) else None
        else:
            obj = obj._modules.get(key) if isinstance(obj, nn.Module) else None
    return obj if isinstance(obj, nn.Module) else None


def _owner(node: Any, scope: dict[str, Any], root: str) -> nn.Module | None:
    """The innermost module on the node's stack; the frame's own module for a node outside any submodule."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return module_at(path, scope) if isinstance(path, str) else None
    obj = scope.get(root)
    return obj if isinstance(obj, nn.Module) else None


def root_name(gm: Any) -> str:
    """The frame's local that holds its module (``self``, or what the method calls it), as the module stacks
    of the graph's nodes name it."""
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            head = _LOCAL.match(path) if isinstance(path, str) else None
            if head:
                return head.group(1)
    return "self"


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if hasattr(node, "meta") else None


def _tensors(nodes: list[Any]) -> tuple[list[list[int]], list[str], str]:
    """Shapes and dtypes of the tensors the nodes stand for, and their device (``cpu`` when none is known)."""
    shapes, dtypes, device = [], [], "cpu"
    for n in nodes:
        v = _value(n)
        if isinstance(v, torch.Tensor):
            shapes.append([int(s) for s in v.shape])
            dtypes.append(dtype_name(v.dtype))
            device = v.device.type
    return shapes, dtypes, device


def _arg_nodes(node: Any) -> list[Any]:
    return [a for a in node.args if isinstance(a, torch.fx.Node)]


def _sdpa_mask(node: Any) -> str:
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if isinstance(mask, torch.fx.Node):
        v = _value(mask)
        return "bool tensor" if isinstance(v, torch.Tensor) and v.dtype == torch.bool else "float tensor"
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    return "is_causal" if causal is True else "none"


def _hand_written(softmax: Any) -> tuple[Any, Any, list[str]] | None:
    """The scores matmul before a softmax and the value matmul after it, with the masking ops between."""
    masking: list[str] = []
    node, scores = softmax, None
    for _ in range(12):
        args = _arg_nodes(node)
        if not args:
            return None
        node = args[0]
        name = _name(node.target)
        if name in _MATMUL and len(_arg_nodes(node)) >= 2:
            scores = node
            break
        if name not in _BETWEEN:
            return None
        if name in _MASKING:
            masking.append(name)
    if scores is None:
        return None
    frontier, out = [softmax], None
    for _ in range(8):
        users = [u for n in frontier for u in n.users]
        out = next((u for u in users if _name(u.target) in _MATMUL and frontier[0] in _arg_nodes(u)[:1]), None)
        if out is None:
            out = next((u for u in users if _name(u.target) in _MATMUL), None)
        if out is not None:
            break
        frontier = [u for u in users if _name(u.target) in _BETWEEN]
        if not frontier:
            return None
    return (scores, out, masking) if out is not None else None


@dataclass
class _Operation:
    """One attention operation found in a Dynamo graph."""

    owner: nn.Module | None
    entry: str
    mask: str
    inputs: list[Any]
    written: str
    nodes: tuple[str, ...]


def _operation(node: Any, gm: Any, scope: dict[str, Any], root: str) -> _Operation | None:
    """The attention operation ``node`` is (an entry point, a kept module, or the softmax of a hand-written
    matmul-softmax-matmul), or ``None``."""
    if node.op == "call_module":  # a module Dynamo kept whole (releases that do not inline torch.nn modules)
        sub = gm.get_submodule(node.target)
        kind = _MODULE_ENTRY.get(type(sub).__name__) if type(sub).__module__.startswith("torch.nn") else None
        if kind is None:
            return None
        written = f"{type(sub).__name__} (kept whole in the graph)"
        owner = _owner(node, scope, root) if node.meta.get("nn_module_stack") else sub  # the user's own module
        return _Operation(owner, kind, "as the call passes it", _arg_nodes(node)[:3], written, (node.name,))
    if node.op not in ("call_function", "call_method"):
        return None
    entry = _ENTRY.get(_name(node.target))
    if entry is not None:
        owner = _owner(node, scope, root)
        mask = _sdpa_mask(node) if entry == "sdpa" else "as the call passes it"
        if entry == "sdpa" and isinstance(owner, nn.MultiheadAttention):
            entry = "MultiheadAttention"
        return _Operation(owner, entry, mask, _arg_nodes(node)[:3], _written(node), (node.name,))
    if _name(node.target) not in _SOFTMAX:
        return None
    found = _hand_written(node)
    if found is None:
        return None
    scores, out, masking = found
    owner = _owner(node, scope, root)
    return _Operation(
        owner,
        "MultiheadAttention" if isinstance(owner, nn.MultiheadAttention) else "hand_written",
        " → ".join(masking) if masking else "none",
        _arg_nodes(scores)[:2] + [a for a in _arg_nodes(out) if a is not node][:1],
        f"{_written(scores)} → {_written(node)} → {_written(out)}",
        (scores.name, node.name, out.name),
    )


def _read_dynamo(key: tuple[Any, ...], frame: types.FrameType | None) -> None:
    gm, og = _graph_module(frame)
    if gm is None:
        return
    ident = threading.get_ident()
    traces = [t for t in registry.open_traces() if t.thread in (None, ident)]
    record_graph(key, gm, getattr(og, "local_scope", None) or {}, traces, f"Dynamo graph {key[0]}/{key[1]}")


def record_graph(key: tuple[Any, ...], gm: Any, scope: dict[str, Any], traces: list[Trace], said: str) -> None:
    """Record each attention operation of Dynamo's graph ``gm`` in each trace that holds its module; ``scope``:
    the compiled frame's locals (module paths in the graph start at one of them); ``said``: where the graph was
    read, for the records' evidence."""
    root = root_name(gm)
    graph = f"{key[0]}/{key[1]}"
    found: list[_Pending] = []
    for node in gm.graph.nodes:
        op = _operation(node, gm, scope, root)
        if op is None or op.owner is None:
            continue
        shapes, dtypes, device = _tensors(op.inputs)
        pending = _Pending(op.nodes, op.entry, device, *_names_and_after(gm, op.nodes))
        chosen = compiled_sdpa.backend_of_node(node) if _ENTRY.get(_name(node.target)) == "sdpa" else None
        for t in traces:
            module = t.name_of(op.owner)
            if module is None:
                continue
            record = CompiledAttention(
                index=0, module=module, module_type=type(op.owner).__name__, entry=op.entry, written=op.written,
                graph=graph, compiler="dynamo", shapes=shapes, dtypes=dtypes, mask=op.mask,
                runs=[f"{op.written} (the graph as captured: PyTorch picks the kernel when it runs)"],
                evidence=[f"{said}: node {node.name}"], runtime=RUNTIME_NOT_OBSERVED,
            )  # fmt: skip
            if chosen is not None:  # what runs when the graph runs as captured; a backend's own code overrides it
                record.sdpa_backend = chosen
                record.evidence.append(f"sdpa_backend: {compiled_sdpa.EVIDENCE}")
            t.add_compiled(record)
            pending.records.append((t, record))
        if pending.records:
            found.append(pending)
    with _lock:
        for old in _graphs.pop(key, []):  # the same frame compiled again (a restart): the new graph stands
            for t, record in old.records:
                t.drop_compiled(record)
        if found:
            _graphs[key] = found


def forget(key: tuple[Any, ...]) -> None:
    """The graph recorded under ``key`` is read to the end: no event will add to it."""
    with _lock:
        _graphs.pop(key, None)


def _names_and_after(gm: Any, nodes: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """The operation's nodes by their names and by the names they were made under (``source_fn_stack``), and
    the names of every node computed from its last node."""
    by_name = {n.name: n for n in gm.graph.nodes}
    names = set(nodes)
    for name in nodes:
        for entry in by_name[name].meta.get("source_fn_stack") or () if name in by_name else ():
            if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
                names.add(entry[0])
    after: set[str] = set()
    frontier = [by_name[nodes[-1]]] if nodes[-1] in by_name else []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.name not in after and user.op != "output":
                after.add(user.name)
                frontier.append(user)
    return frozenset(names), frozenset(after - set(nodes))


def _written(node: Any) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    if module in ("_operator", "operator"):
        return {"matmul": "@", "truediv": "/", "mul": "*"}.get(name, name)
    return f"{module}.{name}" if module else name


# -- AOTAutograd's graphs and inductor's code: what runs ------------------------


def _source_names(node: Any) -> list[str]:
    """The Dynamo nodes an ATen node came from."""
    names = []
    for origin in node.meta.get("from_node") or ():
        name = getattr(origin, "name", None) or (origin[0] if isinstance(origin, tuple) else None)
        if isinstance(name, str):
            names.append(name)
    for entry in [*(node.meta.get("source_fn_stack") or ()), *(node.meta.get("fwd_source_fn_stack") or ())]:
        if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
            names.append(entry[0])
    return names


def _read_aot(key: tuple[Any, ...], event: str, frame: types.FrameType | None) -> None:
    with _lock:
        pending = bool(_graphs.get(key))
    gm, _ = _graph_module(frame, event) if pending else (None, None)
    if gm is not None:
        read_aot(key, gm, event.split("_")[1])


def read_aot(key: tuple[Any, ...], gm: Any, kind: str) -> None:
    """AOTAutograd's ATen graph (``kind``: ``inference``, ``forward`` or ``backward``) for the graph recorded
    under ``key``: the ATen ops each of its operations runs."""
    with _lock:
        pending = list(_graphs.get(key, ()))
    backward = kind == "backward"
    # each ATen op of interest with the Dynamo nodes it came from, read once for all operations of the graph
    aten = [(set(_source_names(n)), op) for n in gm.graph.nodes
            if n.op == "call_function" and _interesting(op := compiled_code.op_name(n.target))]  # fmt: skip
    for p in pending:
        ops = [op for sources, op in aten if sources & p.names]  # each call, in the graph's order
        if not ops:
            continue
        for _, record in p.records:
            record.compiler = "aot"  # inductor's code, read later, says what inductor made of this graph
            (record.backward if backward else record.runs)[:] = ops
            record.evidence.append(f"AOTAutograd {kind} graph: {', '.join(ops)}")
            if not backward:
                _backend_from(record, ops, p.device)
                written_kernel = "scaled_dot_product" in record.written or record.entry == "flex"
                if written_kernel and not any(k in op for op in ops for k in ("attention", "flex")):
                    record.rewritten = (f"decomposed into ATen ops ({', '.join(dict.fromkeys(ops))}): no attention "
                                       "kernel is called")


def _interesting(op: str) -> bool:
    return any(s in op for s in ("attention", "bmm", "softmax", "matmul", "baddbmm", "flex", "_native_multi_head",
                                 "_transformer_encoder"))  # fmt: skip


def _backend_from(record: CompiledAttention, ops: list[str], device: str) -> None:
    from qkvtrace.facts.paths import shared_evidence

    kernels = ["aten::" + op.split("aten.")[-1] for op in ops if "aten." in op]
    backend = shared_evidence().backend_of(device, kernels)
    if backend is not None:
        record.sdpa_backend = backend


def read_code(key: tuple[Any, ...], text: str | compiled_code.Code) -> None:
    """Inductor's generated code (its text, or as :func:`compiled_code.parse` read it) for the graph recorded
    under ``key``: what runs for each of its operations."""
    with _lock:
        pending = list(_graphs.get(key, ()))
    if not pending or not text:
        return
    code = compiled_code.parse(text) if isinstance(text, str) else text
    operations = [compiled_code.Operation(p.nodes, p.entry, p.after) for p in pending]
    if code.is_backward:
        chosen = compiled_code.backward(code, operations, [p.saved for p in pending], pending[0].returned)
    else:
        chosen = compiled_code.forward(code, operations)
    for p, mine in zip(pending, chosen, strict=True):
        names = [code.calls[i].callee for i in mine]
        if not code.is_backward:
            p.saved = compiled_code.saved_positions(code, mine)
            p.returned = len(code.returned)
        for _, record in p.records:
            record.compiler = "inductor"
            if code.is_backward:
                record.backward = names
            else:
                record.runs = names
                _backend_from(record, names, p.device)
                _rewrites(record, names)
                if not mine and len(p.nodes) > 1:
                    record.rewritten = "inductor rewrote it: no call in the generated code comes from its nodes"
            if code.is_backward:
                said = "calls reading what its forward calls made or read"
                record.evidence.append(f"inductor backward code, {said}: {', '.join(names) or 'none'}")
            else:
                record.evidence.append(f"inductor forward code: {', '.join(names) or 'no call named for it'}")


def _rewrites(record: CompiledAttention, kernels: list[str]) -> None:
    fused = next((c for c in kernels if c.startswith("aten.")
                  and any(s in c for s in ("scaled_dot_product", "_efficient_attention", "flash_attention"))),
                 None)  # fmt: skip
    by_hand = record.entry == "hand_written" or (record.entry == "MultiheadAttention" and "softmax" in record.written)
    if by_hand and fused:
        record.rewritten = f"inductor's pattern matcher replaced the matmul-softmax-matmul with {fused}"
    elif record.entry != "flex" and not by_hand and fused is None and not any(c.startswith(("aten.", "extern"))
                                                                             for c in kernels):  # fmt: skip
        record.rewritten = "inductor compiled it into generated code: no attention kernel is called for it"
