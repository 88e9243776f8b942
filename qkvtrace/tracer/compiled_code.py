"""Which calls of inductor's generated code compute each attention operation, forward and backward.

Inductor writes a ``call`` function per graph: one line per kernel it calls, with a comment before each extern
kernel or ATen fallback naming the graph nodes it came from (``# Topologically Sorted Source Nodes: [...]``):
the node the call computes and the views fused into its arguments. Kernels inductor generates itself carry no
such comment on the CPU; they are tied to attention by the buffers they share with the commented calls.

Forward: a commented call belongs to an attention operation when it names one of the operation's nodes and no
node computed from the operation's output (the out projection's ``addmm`` names the attention output as a fused
view, and its own node, which is computed from it); a generated kernel between the operation's first and last
call that reads what the first wrote and touches what the last reads is the softmax and its kin. A
``MultiheadAttention`` node holds its projections: their matmuls are not listed for it.

Backward: the forward ``call`` returns the user's outputs and then what the backward needs, which are the
backward ``call``'s arguments in the same order. A backward call belongs to an operation when it reads a tensor
that operation's forward calls wrote or read, and names no node computed from the operation's output (the out
projection's weight gradient reads the attention output too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Code", "Operation", "backward", "forward", "op_name", "parse", "saved_positions"]

_SOURCE = re.compile(r"#\s*(?:Topologically Sorted )?Source Nodes: \[(.*?)\]")
_CALLEE = re.compile(r"((?:torch\.ops\.)?aten\.[\w.]+|extern_kernels\.\w+)\(|^\s*((?:cpp|triton|cuda)_\w+)(?:\.run)?\(")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
#: inductor reuses a dead buffer: ``buf4 = buf2; del buf2  # reuse`` (or ``= reinterpret_tensor(buf2, ...)``)
_REUSE = re.compile(r"\s*(buf\d+) = (?:reinterpret_tensor\()?(\w+)\b[^;]*;\s*del \2\b")
_ASSIGNED = re.compile(r"\s*(buf\d+)\s*=")
_BUFFER = re.compile(r"\bbuf\d+\b")
_ELEMENT = re.compile(r"\s*(buf\d+) = (buf\d+)\[\d+\]\s*$")
_ARGS = re.compile(r"^\s*([\w\s,]+?)\s*=\s*args\s*$", re.MULTILINE)
#: names on a call's line that are not tensors
_NOT_TENSORS = {"reinterpret_tensor", "extern_kernels", "torch", "ops", "aten", "default", "out", "alpha", "beta",
                "None", "True", "False", "float32", "float16", "bfloat16", "run", "stream", "grid"}  # fmt: skip


def op_name(target: Any) -> str:
    """``aten._softmax`` for ``torch.ops.aten._softmax.default`` (as graphs and generated code name ops)."""
    text = str(target).removeprefix("torch.ops.")
    return text[:-8] if text.endswith(".default") else text


@dataclass
class Call:
    """One kernel call of the generated ``call``."""

    callee: str
    #: the graph nodes inductor's comment names for it (empty for a kernel inductor generated)
    sources: list[str]
    #: buffers written and tensors read, each followed back through buffer reuse to the name it was made as
    written: list[str]
    read: list[str]
    #: the tensor names on its line as written there
    names: set[str] = field(default_factory=set)

    @property
    def generated(self) -> bool:
        return not self.callee.startswith(("aten.", "extern_kernels."))


@dataclass
class Code:
    """The generated ``call`` of one graph: its calls, its arguments and the tensors it returns."""

    calls: list[Call]
    arguments: list[str]
    #: the tensor each element of the returned tuple is a view of, as named there
    returned: list[str]

    @property
    def is_backward(self) -> bool:
        """A backward graph takes the incoming gradients (``tangents_1``, ...); a forward one never does."""
        return any(a.startswith("tangents_") for a in self.arguments)


def parse(code: str) -> Code:
    body = code.split("def call(", 1)[-1]
    found = _ARGS.search(body.split("\n", 4)[1] if "\n" in body else "")
    arguments = [a.strip() for a in found.group(1).split(",") if a.strip()] if found else []
    calls: list[Call] = []
    sources: list[str] = []
    alias: dict[str, str] = {}
    returned: list[str] = []
    writer: dict[str, int] = {}  # buffer -> the call that wrote it
    for line in body.splitlines():
        reuse = _REUSE.match(line)
        if reuse:
            alias[reuse.group(1)] = alias.get(reuse.group(2), reuse.group(2))
            continue
        element = _ELEMENT.match(line)  # ``buf2 = buf1[0]``: an output of the call that made the tuple
        if element and element.group(2) in writer:
            made = calls[writer[element.group(2)]]
            made.names.add(element.group(1))
            made.written.append(element.group(1))
            writer[element.group(1)] = writer[element.group(2)]
            continue
        m = _SOURCE.search(line)
        if m:
            sources = [x.strip() for x in m.group(1).split(",") if x.strip()]
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        if stripped.startswith("return (") and not returned:
            returned = _returned(stripped[len("return (") :])
            continue
        c = _CALLEE.search(line)
        if c is None:
            continue
        callee = op_name(c.group(1) or c.group(2))
        code_part = line.split("#", 1)[0]
        names = {n for n in _NAME.findall(code_part.split("(", 1)[1] if "(" in code_part else "")
                 if n not in _NOT_TENSORS and not n[0].isdigit()}  # fmt: skip
        assigned = _ASSIGNED.match(line)  # ``buf1 = torch.ops.aten....(...)``
        written = [assigned.group(1)] if assigned else []
        written += _BUFFER.findall(line.split("out=", 1)[1]) if "out=" in line else []
        names.update(written)
        resolved = [alias.get(b, b) for b in written]
        read = [alias.get(n, n) for n in sorted(names) if n not in written]
        generated = c.group(2) is not None
        calls.append(Call(callee, [] if generated else sources, resolved, read, names))
        for b in written:
            writer[b] = len(calls) - 1
        sources = []  # a comment describes the one call after it
    return Code(calls, arguments, returned)


def _returned(text: str) -> list[str]:
    """The tensor each element of ``return (a, reinterpret_tensor(buf3, ...), ...)`` is a view of."""
    elements, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                elements.append(text[start:i])
                break
            depth -= 1
        elif ch == "," and depth == 0:
            elements.append(text[start:i])
            start = i + 1
    names = []
    for element in elements:
        if not element.strip():
            continue
        name = next((n for n in _NAME.findall(element) if n not in _NOT_TENSORS), "")
        names.append(name)
    return names


class Operation(NamedTuple):
    """One attention operation of the graph: its nodes in order, its entry point, and the nodes computed from
    its output."""

    nodes: tuple[str, ...]
    entry: str
    after: frozenset[str]


#: what projects into or out of attention rather than computing it (a MultiheadAttention node holds its own)
_PROJECTIONS = ("extern_kernels.mm", "extern_kernels.addmm", "aten.mm", "aten.addmm", "aten.linear")


def forward(code: Code, operations: list[Operation]) -> list[list[int]]:
    """For each operation, the indices of the calls that compute it."""
    owner: dict[int, int] = {}
    for i, call in enumerate(code.calls):
        named = set(call.sources)
        claims = [(max(call.sources.index(n) for n in op.nodes if n in named), j) for j, op in enumerate(operations)
                  if named & set(op.nodes) and not named & op.after]  # fmt: skip
        if claims and not (call.callee in _PROJECTIONS and operations[max(claims)[1]].entry == "MultiheadAttention"):
            owner[i] = max(claims)[1]
    # the SDPA kernel inductor's pattern matcher puts in place of a hand-written attention comes from a node of
    # its own: such kernels go, in order, to the hand-written operations none of whose calls remain
    fused = ("aten.scaled_dot_product", "aten._scaled_dot_product")
    orphans = [i for i, call in enumerate(code.calls) if i not in owner and call.callee.startswith(fused)]
    vanished = [j for j, op in enumerate(operations) if len(op.nodes) > 1 and j not in owner.values()]
    for i, j in zip(orphans, vanished, strict=False):  # a kernel or an operation left over stays unpaired
        owner[i] = j
    # FlexAttention compiles into a kernel inductor generates from its template, named after the op
    templates = [i for i, call in enumerate(code.calls) if call.generated and "flex_attention" in call.callee]
    flex = [j for j, op in enumerate(operations) if op.entry == "flex" and j not in owner.values()]
    for i, j in zip(templates, flex, strict=False):
        owner[i] = j
    chosen: list[list[int]] = []
    for j in range(len(operations)):
        mine = sorted(i for i, o in owner.items() if o == j)
        if len(mine) > 1:  # generated code between its first and last call: the softmax and its kin
            made = set(code.calls[mine[0]].written)
            used = set(code.calls[mine[-1]].read)
            for i in range(mine[0] + 1, mine[-1]):
                call = code.calls[i]
                touched = set(call.read + call.written)
                if call.generated and made & touched and used & touched:
                    mine.append(i)
        chosen.append(sorted(mine))
    return chosen


def saved_positions(code: Code, calls: list[int]) -> set[int]:
    """Positions in the forward's returned tuple of the tensors these calls wrote or read."""
    touched = {n for i in calls for n in code.calls[i].names}
    return {k for k, name in enumerate(code.returned) if name in touched}


def backward(code: Code, operations: list[Operation], saved: list[set[int] | None], returned: int) -> list[list[int]]:
    """For each operation, the indices of the backward calls that compute its gradient: those reading a tensor
    its forward calls touched (``saved``: positions in the forward's returned tuple of ``returned`` elements), and
    naming no node computed from its output."""
    inputs = [a for a in code.arguments if not a.startswith("tangents_")]
    users = returned - len(inputs)  # the returned tuple starts with the user's outputs
    chosen: list[list[int]] = []
    for op, positions in zip(operations, saved, strict=True):
        if positions is None or users < 0:
            chosen.append([])
            continue
        mine = {inputs[k - users] for k in positions if 0 <= k - users < len(inputs)}
        projections = _PROJECTIONS if op.entry == "MultiheadAttention" else ()
        chosen.append([i for i, call in enumerate(code.calls) if mine & set(call.read)
                       and not op.after & set(call.sources) and call.callee not in projections])  # fmt: skip
    return chosen
