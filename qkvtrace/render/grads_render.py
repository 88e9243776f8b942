"""Pictures and tables of ``qkvtrace grads``: how the loss reached W_Q, W_K and W_V.

The picture follows the tutorial's one-sentence case (docs/tutorial.md#one-sentence-end-to-end)
from right to left of the forward pass:
the loss, then each attention module (everything else in it collapsed to one
node), its backward core (the node PyTorch runs), and the split -- the V
route straight into V, the Q and K routes through the softmax and the scores
-- down to the Q, K, V slices of the projection weights. Every edge label is
a measured norm of this pass.
"""

from __future__ import annotations

from typing import Any

import graphviz
from rich.console import Group
from rich.table import Table
from rich.text import Text

from qkvtrace.analyses.grads import PARTS_ORDER, GradsResult, Route, SliceGradient
from qkvtrace.records import rows_label

__all__ = ["fmt", "grads_dot", "grads_table", "node_width", "slice_label"]

V_COLOUR = "#1565c0"  # the V route: straight from attention @ V
QK_COLOUR = "#e65100"  # the Q and K routes: through softmax and the scores
_SYMBOL = {"q": "Q", "k": "K", "v": "V"}


_NARROW = set("ijlrtf.,:;|!'[]() ")
_WIDE = set("mwMW")


def _em(ch: str) -> float:
    """A generous advance width of ``ch`` in ems: at least DejaVu Sans', the widest font renderers fall back to."""
    if ch in _NARROW:
        return 0.42
    if ch in _WIDE:
        return 1.0
    return 0.8 if ch.isupper() else 0.66


def node_width(label: str, fontsize: float = 11.0, shape: str = "box") -> str:
    """The ``width`` (inches) a node needs for ``label`` (lines split by ``\\n``) in any sans-serif font.

    Graphviz sizes a node from its own font metrics; a renderer that draws the
    text with another font (librsvg substitutes DejaVu Sans for Helvetica) can
    overflow a box sized that way. ``width`` is a minimum, so a node sized
    here is never narrower than Graphviz would make it.
    """
    widest = max(sum(_em(ch) for ch in line) for line in label.split("\\n")) * fontsize / 72
    return f"{widest * (1.45 if shape == 'ellipse' else 1.0) + 0.3:.2f}"


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _pct(x: float | None) -> str:
    return "" if x is None else f" ({100 * x:.0f}%)"


def slice_label(s: SliceGradient) -> str:
    """``blocks.0.attention.qkv.weight[0:64]``: a slice of a packed weight, or a whole one."""
    if s.rows is None:
        return s.param
    span = rows_label(s.rows)
    return f"{s.param}[{span}]" if s.dim == 0 else f"{s.param}[:, {span}]"


def _slice_cell(s: SliceGradient, module: str, packed: bool) -> str:
    """A slice as a table cell: its rows when the weight is shared, else the weight's name in the module."""
    if packed and s.rows is not None:
        span = rows_label(s.rows)
        return f"[{span}]" if s.dim == 0 else f"[:, {span}]"
    return s.param.removeprefix(module + ".") if module else s.param


def grads_dot(result: GradsResult, routes: list[Route]) -> str:
    """DOT source of the routes (only calls that have them)."""
    dot = graphviz.Digraph(
        "grads",
        graph_attr={
            "rankdir": "LR",
            "labelloc": "t",
            "fontname": "Helvetica",
            "fontsize": "16",
            "nodesep": "0.2",
            "ranksep": "0.5",
            "label": f"how the loss reaches W_Q, W_K, W_V -- {result.target} (torch {result.torch_version})",
        },
        node_attr={
            "shape": "box",
            "style": "rounded,filled",
            "fillcolor": "white",
            "fontname": "Helvetica",
            "fontsize": "11",
        },
        edge_attr={"fontname": "Helvetica", "fontsize": "10", "arrowsize": "0.6"},
    )
    if result.loss_kind == "traced":  # a trace's own backward pass: its loss is the user's, not measured here
        loss_label = "loss\\n(the backward pass the trace saw)"
    else:
        loss_text = "next-token cross-entropy" if result.loss_kind == "lm" else "<output, R>, R fixed random"
        loss_label = f"loss = {fmt(result.loss)}\\n{loss_text}"
    dot.node("loss", loss_label, shape="ellipse", fillcolor="#eeeeee", width=node_width(loss_label, shape="ellipse"))
    previous = "loss"
    for i, route in enumerate(reversed(routes)):  # backward order: the last call is nearest the loss
        module = f"m{i}"
        title = route.module or "(root)"
        call = f"call {route.call}" if route.call is not None else route.path
        label = f"{title}\\n{call}; rest of the module collapsed"
        dot.node(module, label, fillcolor="#fafafa", width=node_width(label))
        dot.edge(previous, module, color="#9e9e9e", style="dotted", label="" if previous != "loss" else "backward")
        previous = module
        _route_cluster(dot, i, module, route)
    with dot.subgraph(name="cluster_legend") as box:
        box.attr(label="legend", style="rounded", color="#bdbdbd", fontsize="11")
        box.node(
            "legend",
            shape="plaintext",
            style="",
            label=(
                "solid blue: V route (attention @ V, straight into V)\\l"
                "dashed orange: Q and K routes (through softmax and the scores)\\l"
                "labels: norms measured in this backward pass (share of the three routes)\\l"
            ),
        )
    return str(dot.source)


def _route_cluster(dot: graphviz.Digraph, i: int, module: str, route: Route) -> None:
    core, scores = f"c{i}", f"s{i}"
    with dot.subgraph(name=f"cluster_{i}") as sub:
        sub.attr(label=f"{route.module or '(root)'} -- {route.path}", style="rounded,dashed", color="#bdbdbd")
        core_label, scores_label = f"backward kernel\\n{route.backward_kernel}", "softmax(QKᵀ/√d)\\nand the scores"
        sub.node(core, core_label, shape="box", fillcolor="#f3e5f5", width=node_width(core_label))
        sub.node(scores, scores_label, shape="ellipse", fillcolor="#fff3e0",
                 width=node_width(scores_label, shape="ellipse"))  # fmt: skip
        sub.edge(core, scores, color=QK_COLOUR, style="dashed")
        for part in PARTS_ORDER:
            got = getattr(route, part)
            if got is None:
                continue
            act = f"a{i}{part}"
            sub.node(act, _SYMBOL[part], shape="circle", fillcolor="#e3f2fd" if part == "v" else "#fff3e0")
            colour, style = (V_COLOUR, "solid") if part == "v" else (QK_COLOUR, "dashed")
            label = f"‖∂L/∂{_SYMBOL[part]}‖ {fmt(got['norm'])}{_pct(got.get('share'))}"
            sub.edge(
                core if part == "v" else scores,
                act,
                label=label,
                color=colour,
                fontcolor=colour,
                style=style,
                penwidth="2.2" if part == "v" else "1.4",
            )
            s = route.slices.get(part)
            if s is not None:
                weight = f"w{i}{part}"
                weight_label = f"W_{_SYMBOL[part]}\\n{slice_label(s)}"
                sub.node(weight, weight_label, fillcolor="#ffffff", width=node_width(weight_label))
                sub.edge(
                    act,
                    weight,
                    label=f"‖grad‖ {fmt(s.grad_norm)}{_pct(s.share)}",
                    color=colour,
                    fontcolor=colour,
                    style=style,
                )
    dot.edge(module, core, color="#616161")


def grads_table(result: GradsResult, routes: list[Route]) -> Group:
    """The same numbers as the picture: one block per call, titled by its module (never cut)."""
    blocks: list[Any] = [
        Text(
            f"qkvtrace grads {result.target}  (torch {result.torch_version}, "
            f"loss {result.loss_kind} = {fmt(result.loss)})",
            style="bold",
        )
    ]
    for route in routes:
        call = f"call {route.call}" if route.call is not None else "not traced"
        blocks.append(Text(""))
        blocks.append(
            Text.assemble((f"{call}  ", "bold"), (route.module or "(root)", "bold cyan"), f"  ({route.path})")
        )
        kernel = route.backward_kernel or f"none: {route.reason}"
        blocks.append(Text.assemble("  backward kernel  ", (kernel, "magenta")))
        if route.backward_kernel is not None and route.reason is not None:
            blocks.append(Text(f"  no routes: {route.reason}", style="yellow"))
        params = {sl.param for sl in route.slices.values()}
        packed = len(params) == 1 and len(route.slices) > 1
        if packed:
            blocks.append(
                Text.assemble("  weight           ", (next(iter(params)), "cyan"), " (packed: Q, K, V slices)")
            )
        table = Table(box=None, pad_edge=False, padding=(0, 2), show_edge=False)
        table.add_column("  route", no_wrap=True)
        table.add_column("‖∂L/∂·‖", justify="right", no_wrap=True)
        table.add_column("share", justify="right", no_wrap=True)
        table.add_column("slice" if packed else "weight", no_wrap=True)
        table.add_column("‖grad‖", justify="right", no_wrap=True)
        table.add_column("share", justify="right", no_wrap=True)
        for part in ("v", "q", "k"):  # the V route first: it is the direct one
            got, s = getattr(route, part), route.slices.get(part)
            style = "blue" if part == "v" else "dark_orange"
            table.add_row(
                Text(f"  {_SYMBOL[part]}", style=style),
                "–" if got is None else fmt(got["norm"]),
                "" if got is None else _pct(got.get("share")).strip(" ()"),
                "–" if s is None else _slice_cell(s, route.module, packed),
                "–" if s is None else fmt(s.grad_norm),
                "" if s is None else _pct(s.share).strip(" ()"),
            )
        blocks.append(table)
    return Group(*blocks)
