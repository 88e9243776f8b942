"""Pictures of attention maps: heatmaps (matplotlib, ``qkvtrace[plot]``) and a compact terminal view.

``write_map_pictures`` draws, for every call that has an ``attention_map``,
one heatmap per head and one grid of all its heads (the call is one layer's
attention), each as PNG and SVG. Axes carry the tokens when their strings are
known (:func:`token_labels`), positions otherwise. Rows whose keys were all
masked are drawn grey and named, never as NaN colours.

A map is one layer's and one head's weighting of the values for one input,
not an explanation of the model's decision (docs/tutorial.md#common-mistakes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from qkvtrace.records import AttentionCall, TraceResult

__all__ = ["PLOT_HINT", "TERMINAL_MAX_TOKENS", "call_labels", "terminal_maps", "token_labels", "write_map_pictures"]

PLOT_HINT = 'attention map pictures need matplotlib: pip install "qkvtrace[plot]"'
#: longest side of a map printed in the terminal
TERMINAL_MAX_TOKENS = 24
_SHADES = " ·░▒▓█"


def token_labels(model: Any, args: Sequence[Any]) -> list[list[str]] | None:
    """Token strings per batch item, when the model's first argument is token ids.

    Strings come from the model's ``vocabulary`` (a list indexed by id, or a
    ``{token: id}`` dict) or ``id_to_token``; without one the ids themselves
    label the axes (``#17``), which still says which token sits where.
    """
    import torch

    ids = args[0] if args else None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2 or ids.is_nested:
        return None
    vocab = getattr(model, "vocabulary", None) or getattr(model, "id_to_token", None)
    if isinstance(vocab, dict):
        vocab = {v: k for k, v in vocab.items()} if all(isinstance(v, int) for v in vocab.values()) else vocab
    rows = []
    for row in ids.tolist():
        labels = []
        for i in row:
            try:
                labels.append(str(vocab[i]) if vocab is not None else f"#{i}")
            except (KeyError, IndexError, TypeError):
                labels.append(f"#{i}")
        rows.append(labels)
    return rows


def call_labels(call: AttentionCall, batch: int, tokens: list[list[str]] | None) -> tuple[list[str], list[str]]:
    """Labels of the query rows and key columns of ``call``'s map for batch item ``batch``."""
    w = call.attention_map
    lq, lk = int(w.shape[-2]), int(w.shape[-1])
    row = tokens[batch] if tokens is not None and batch < len(tokens) else None
    queries = row if row is not None and len(row) == lq else [str(i) for i in range(lq)]
    keys = row if row is not None and len(row) == lk else [str(i) for i in range(lk)]
    if row is not None and len(row) < lk and len(row) == lq:  # bias_k / add_zero_attn keys after the tokens
        keys = row + [f"+{i}" for i in range(lk - len(row))]
    return queries, keys


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name or "root")


def _title(call: AttentionCall) -> str:
    kernel = f", {call.sdpa_backend}" if call.sdpa_backend else ""
    return f"{call.module or '(root)'}: call {call.index}, {call.path}{kernel}"


def write_map_pictures(result: TraceResult, directory: Path, tokens: list[list[str]] | None = None) -> list[Path]:
    """Heatmaps per call and head plus a grid per call, as PNG and SVG; returns the files written.

    Draws the first batch item of each map. Raises ``ImportError`` with
    :data:`PLOT_HINT` when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(PLOT_HINT) from None
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#bbbbbb")

    def draw(ax: Any, call: AttentionCall, pos: int, head_pos: int, small: bool, ylabel: bool = True) -> Any:
        batch = (call.attention_map_batch or [0])[pos]
        w = call.attention_map[pos, head_pos].numpy()
        full = call.attention_map_fully_masked[pos, head_pos].numpy()
        shown = np.ma.masked_array(w, mask=np.repeat(full[:, None], w.shape[1], axis=1))
        image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        queries, keys = call_labels(call, batch, tokens)
        size = 5 if small else 7
        step_q, step_k = max(1, len(queries) // 32), max(1, len(keys) // 32)
        ax.set_yticks(range(0, len(queries), step_q), queries[::step_q], fontsize=size)
        ax.set_xticks(range(0, len(keys), step_k), keys[::step_k], fontsize=size, rotation=90)
        ax.set_xlabel("key", fontsize=size + 1)
        if ylabel:
            ax.set_ylabel("query", fontsize=size + 1)
        for q in np.flatnonzero(full):
            ax.text(w.shape[1] / 2 - 0.5, q, "fully masked", ha="center", va="center", fontsize=size, color="black")
        return image

    def save(fig: Any, stem: str) -> None:
        for ext in ("png", "svg"):
            path = directory / f"{stem}.{ext}"
            with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: tokens can be searched
                fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Date": None} if ext == "svg" else None)
            written.append(path)
        plt.close(fig)

    for call in result.calls:
        if call.attention_map is None:
            continue
        heads = call.attention_map_heads or list(range(call.attention_map.shape[1]))
        batch = (call.attention_map_batch or [0])[0]
        stem = f"call{call.index:03d}_{_slug(call.module)}"
        for hp, head in enumerate(heads):
            fig, ax = plt.subplots(figsize=(4.2, 3.8))
            image = draw(ax, call, 0, hp, small=False)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
            ax.set_title(f"{_title(call)}\nhead {head}, batch item {batch}", fontsize=8)
            save(fig, f"{stem}_head{head}")
        cols = min(4, len(heads))
        rows = (len(heads) + cols - 1) // cols
        # constrained layout: each head's tick labels get their own room, clear of the head to their left
        fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.0 * rows), squeeze=False, layout="constrained")
        for hp, head in enumerate(heads):
            ax = axes[hp // cols][hp % cols]
            image = draw(ax, call, 0, hp, small=True, ylabel=hp % cols == 0)  # "query" once per row of heads
            ax.set_title(f"head {head}", fontsize=8)
        for extra in range(len(heads), rows * cols):
            axes[extra // cols][extra % cols].axis("off")
        fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.02, pad=0.02)
        fig.suptitle(f"{_title(call)}, batch item {batch}: attention weights per head", fontsize=9)
        save(fig, f"{stem}_grid")
    return written


def terminal_maps(result: TraceResult, tokens: list[list[str]] | None = None,
                  max_tokens: int = TERMINAL_MAX_TOKENS, width: int = 100) -> list[RenderableType]:  # fmt: skip
    """A compact rendering per call and head (first batch item): one shaded cell per weight.

    Each row is one query's distribution over the keys, shaded on its own:
    ``" ·░▒▓█"`` stand for 0 and up to 1/5 … 5/5 of that row's largest weight,
    printed at the end of the row. (Against the head's largest weight a causal
    map is all ``·``: row 0 holds a single weight of 1.) A fully masked row
    reads ``fully masked``. Maps longer than ``max_tokens`` on a side are
    named, not drawn. As many heads go side by side as fit in ``width`` (the
    console's columns) whole; a map that alone is wider than ``width`` is
    named with the width it needs, never drawn cut.
    """
    out: list[RenderableType] = []
    for call in result.calls:
        if call.attention_map is None:
            reason = call.attention_map_reason or "no map"
            out.append(Text(f"attention map of {_title(call)}: {reason}", style="yellow"))
            continue
        w = call.attention_map
        batch = (call.attention_map_batch or [0])[0]
        heads = call.attention_map_heads or list(range(w.shape[1]))
        if max(w.shape[-2], w.shape[-1]) > max_tokens:
            out.append(Text(f"attention map of {_title(call)}: {w.shape[-2]}x{w.shape[-1]} is too large for the "
                            f"terminal (at most {max_tokens}); write pictures with --maps DIR"))  # fmt: skip
            continue
        queries, keys = call_labels(call, batch, tokens)
        tables = []
        for hp, head in enumerate(heads):
            title = f"head {head}  (row max)"
            table = Table(title=title, box=None, pad_edge=False, show_header=False, padding=(0, 1),
                          min_width=len(title))  # fmt: skip
            table.add_column(justify="right", style="dim", no_wrap=True)
            table.add_column(no_wrap=True)
            table.add_column(justify="right", style="dim", no_wrap=True)
            full = call.attention_map_fully_masked[0, hp].tolist()
            for q, row in enumerate(w[0, hp].tolist()):
                top = max(row)
                scale = top if top > 0 else 1.0
                shades = "".join(_SHADES[min(5, int(x / scale * 5 + 0.9999))] for x in row)
                if full[q]:
                    table.add_row(queries[q][:10], "fully masked", "")
                else:
                    table.add_row(queries[q][:10], shades, f"{top:.2f}")
            tables.append(table)
        # one head's width: label, the row of shades (or "fully masked"), the row's max "0.00", 2 spaces
        # between columns; heads sit 6 spaces apart
        labels = max((len(q[:10]) for q in queries), default=0)
        body = max(len(keys), len("fully masked") if call.attention_map_fully_masked.any() else 0)
        one = max(labels + 2 + body + 2 + 4, len(f"head {max(heads)}  (row max)"))
        if one > width:
            out.append(Text(f"attention map of {_title(call)}: {one} columns wide, wider than this terminal's "
                            f"{width}; widen it (COLUMNS={one}) or write pictures with --maps DIR", style="yellow"))
            continue
        grid = Table.grid(padding=(0, 3))
        for _ in tables:
            grid.add_column()
        per_row = max(1, (width + 6) // (one + 6))
        for start in range(0, len(tables), per_row):
            chunk = tables[start : start + per_row]
            grid.add_row(*chunk, *([""] * (len(tables) - len(chunk))))
        key_line = " ".join(keys) if len(" ".join(keys)) < 200 else f"{len(keys)} keys"
        out.append(Group(Text(f"attention map of {_title(call)}, batch item {batch}", style="bold"),
                         Text(f"keys (columns, in order): {key_line}", style="dim"), grid))  # fmt: skip
    if out:
        out.append(Text("shades, per row (one query's weights over the keys), as parts of that row's max "
                        "(printed at its end): ' ' 0, '·' ≤1/5, '░' ≤2/5, '▒' ≤3/5, '▓' ≤4/5, '█' ≤1. "
                        "A map is one layer's and one head's weighting, not an explanation of the model's "
                        "decision.", style="dim"))  # fmt: skip
    return out
