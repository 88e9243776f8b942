"""Attention maps as HTML: a heatmap per head, drawn inline, with nothing to fetch.

A map of up to ``max_svg_tokens`` on a side is SVG with a cell per weight, the
query and key on its axes (tokens when known) and each cell's value in its
tooltip. A longer one -- up to ``max_tokens`` -- is a PNG written here with the
standard library (a pixel per weight, scaled up without smoothing) in a
``data:`` URI: the same shades in a few kilobytes instead of megabytes of SVG,
its size and masked rows said in words beside it. Past the bounds a map is
named, never dropped silently; every map stays in the result itself.
"""

from __future__ import annotations

import base64
import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from qkvtrace.records import AttentionCall

__all__ = ["DEFAULT_BOUNDS", "DrawBudget", "MapBounds", "call_maps", "map_png", "map_svg", "shade", "tensors_maps"]


@dataclass(frozen=True, slots=True)
class MapBounds:
    """How much of the attention maps goes into HTML; what is past a bound is named, not dropped silently."""

    #: longest query or key side drawn as SVG, a cell per weight with its value (longer: a picture)
    max_svg_tokens: int = 48
    #: longest query or key side drawn at all (a longer map is said, not drawn)
    max_tokens: int = 512
    #: heads drawn per call (of the first batch item the map holds)
    max_heads: int = 8
    #: SVG cells drawn in one document, over all its maps (each some 90 bytes of HTML)
    max_cells: int = 200_000
    #: picture pixels (one per weight) drawn in one document, over all its maps
    max_pixels: int = 8_000_000


DEFAULT_BOUNDS = MapBounds()


class DrawBudget:
    """The SVG cells and picture pixels left to draw in one document."""

    def __init__(self, bounds: MapBounds) -> None:
        self.bounds = bounds
        self.cells = bounds.max_cells
        self.pixels = bounds.max_pixels

    def admit(self, heads: int, n_q: int, n_k: int) -> tuple[int, bool]:
        """How many of ``heads`` heads of ``n_q``×``n_k`` to draw (0 past ``max_tokens``), and whether as SVG.

        The budget is charged for what is drawn.
        """
        if max(n_q, n_k) > self.bounds.max_tokens:
            return 0, False
        svg = max(n_q, n_k) <= self.bounds.max_svg_tokens
        left = self.cells if svg else self.pixels
        shown = max(0, min(heads, self.bounds.max_heads, left // max(1, n_q * n_k)))
        if svg:
            self.cells -= shown * n_q * n_k
        else:
            self.pixels -= shown * n_q * n_k
        return shown, svg


def _esc(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


#: the colour of a weight: white (0) to dark blue (1), through these stops
_STOPS = ((0.0, (247, 251, 255)), (0.25, (198, 219, 239)), (0.5, (107, 174, 214)), (0.75, (33, 113, 181)),
          (1.0, (8, 48, 107)))  # fmt: skip
_MASKED = (189, 189, 189)


def _rgb(w: float) -> tuple[int, int, int]:
    w = min(1.0, max(0.0, w))
    for (a, ca), (b, cb) in itertools.pairwise(_STOPS):
        if w <= b:
            t = (w - a) / (b - a)
            return tuple(round(x + (y - x) * t) for x, y in zip(ca, cb, strict=True))  # type: ignore[return-value]
    return _STOPS[-1][1]


#: the colour of each of 256 levels of weight, for pictures
_LEVELS = [_rgb(i / 255) for i in range(256)]


def shade(w: float) -> str:
    """The colour of weight ``w`` (clamped to [0, 1]) as ``#rrggbb``."""
    r, g, b = _rgb(w)
    return f"#{r:02x}{g:02x}{b:02x}"


def map_svg(weights: Sequence[Sequence[float]], masked: Sequence[bool], queries: Sequence[str], keys: Sequence[str],
            title: str) -> str:  # fmt: skip
    """A heatmap of one head's weights (rows: queries, columns: keys) as inline SVG.

    Each cell's ``<title>`` holds its query, key and value; rows whose keys were
    all masked are grey and say so in their label.
    """
    n_q, n_k = len(weights), len(weights[0]) if weights else 0
    cell = max(6, min(18, 420 // max(n_q, n_k, 1)))
    label_w = 8 + 7 * min(24, max((len(q) for q in queries), default=1) + (9 if any(masked) else 0))
    label_h = 8 + 7 * min(24, max((len(k) for k in keys), default=1))
    width, height = label_w + n_k * cell + 4, label_h + n_q * cell + 4
    grey = "#{:02x}{:02x}{:02x}".format(*_MASKED)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="map" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}">',
             f"<title>{_esc(title)}</title>"]  # fmt: skip
    font = 'font-size="10" font-family="ui-monospace, Menlo, Consolas, monospace"'
    for i, q in enumerate(queries[:n_q]):
        label = f"{q} (masked)" if masked[i] else q
        y = label_h + i * cell + cell / 2 + 3
        parts.append(f'<text x="{label_w - 4}" y="{y:.1f}" text-anchor="end" {font}>{_esc(label[:32])}</text>')
    for j, k in enumerate(keys[:n_k]):
        x = label_w + j * cell + cell / 2 + 3
        parts.append(f'<text transform="translate({x:.1f},{label_h - 4}) rotate(-90)" {font}>{_esc(k[:24])}</text>')
    for i, row in enumerate(weights):
        y = label_h + i * cell
        for j, w in enumerate(row):
            fill = grey if masked[i] else shade(w)
            value = "all keys masked" if masked[i] else f"{w:.3f}"
            parts.append(f'<rect x="{label_w + j * cell}" y="{y}" width="{cell}" height="{cell}" fill="{fill}">'
                         f"<title>{_esc(queries[i])} → {_esc(keys[j])}: {value}</title></rect>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def map_png(weights: Any, masked: Any) -> bytes:
    """A PNG of one head's ``[T_q, T_k]`` weights: a pixel per weight in the heatmap's shades, masked rows grey."""
    import torch

    levels = torch.tensor(_LEVELS, dtype=torch.uint8)
    index = (weights.float().clamp(0, 1) * 255).round().long()
    pixels = levels[index]  # [T_q, T_k, 3]
    pixels[masked.bool()] = torch.tensor(_MASKED, dtype=torch.uint8)
    n_q, n_k = int(pixels.shape[0]), int(pixels.shape[1])
    filtered = torch.cat([torch.zeros(n_q, 1, dtype=torch.uint8), pixels.reshape(n_q, 3 * n_k)], 1)  # filter 0 a row
    rows = bytes(filtered.flatten().tolist())

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", n_k, n_q, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")


def _png_figure(weights: Any, masked: Any, title: str, caption: str) -> str:
    n_q, n_k = int(weights.shape[0]), int(weights.shape[1])
    scale = max(1, 384 // max(n_q, n_k))
    data = base64.b64encode(map_png(weights, masked)).decode("ascii")
    full = int(masked.sum())
    said = f"; {full} fully masked row(s), grey" if full else ""
    return (f'<figure><img class="map" src="data:image/png;base64,{data}" width="{n_k * scale}" '
            f'height="{n_q * scale}" style="image-rendering: pixelated" alt="{_esc(title)}" title="{_esc(title)}">'
            f"<figcaption>{_esc(caption)}: queries 0–{n_q - 1} top to bottom, keys 0–{n_k - 1} left to right"
            f"{said}</figcaption></figure>")  # fmt: skip


_SCALE = ('<p class="dim">Shade: white = weight 0, dark blue = weight 1; grey rows: every key masked '
          "(weights 0). Hover a cell of a small map for its value.</p>")  # fmt: skip


def _figures(weights: Any, full: Any, heads: Sequence[int], batch: int, queries: Sequence[str], keys: Sequence[str],
             title: str, svg: bool) -> str:  # fmt: skip
    """One heatmap per head of the map's first batch item (position 0 of ``weights``)."""
    figures = []
    for hp, head in enumerate(heads):
        caption = f"head {head}, batch item {batch}"
        if svg:
            picture = map_svg(weights[0, hp].tolist(), full[0, hp].tolist(), queries, keys, f"{title}: {caption}")
            figures.append(f"<figure>{picture}<figcaption>{caption}</figcaption></figure>")
        else:
            figures.append(_png_figure(weights[0, hp], full[0, hp], f"{title}: {caption}", caption))
    return "".join(figures)


def _not_drawn(n_q: int, n_k: int, shown: int, heads: int, bounds: MapBounds) -> str:
    if max(n_q, n_k) > bounds.max_tokens:
        return (f'<p class="note">Map not drawn: {n_q}×{n_k} is longer than {bounds.max_tokens} on a side '
                "(it is in the result; draw it with --maps).</p>")  # fmt: skip
    if shown <= 0:
        return ('<p class="note">Map not drawn: the page already holds as many map cells as it may '
                f"({bounds.max_cells:,} cells, {bounds.max_pixels:,} pixels).</p>")  # fmt: skip
    if shown < heads:
        return (f'<p class="note">{heads - shown} more head(s) of this call not drawn here (bound: '
                f"{bounds.max_heads} heads a call, {bounds.max_cells:,} cells and {bounds.max_pixels:,} "
                "pixels a page).</p>")  # fmt: skip
    return ""


def call_maps(call: AttentionCall, tokens: list[list[str]] | None, budget: DrawBudget) -> str:
    """The heatmaps of a call's map (first batch item it holds, up to ``max_heads`` heads), or why none."""
    if call.attention_map is None:
        reason = call.attention_map_reason
        return f'<p class="dim">No attention map: {_esc(reason)}</p>' if reason else ""
    from qkvtrace.render.maps_render import call_labels

    weights, full = call.attention_map, call.attention_map_fully_masked
    n_b, n_h, n_q, n_k = (int(x) for x in weights.shape)
    heads = call.attention_map_heads or list(range(n_h))
    batch = (call.attention_map_batch or [0])[0]
    notes = "".join(f'<p class="note">{_esc(n)}</p>' for n in call.attention_map_notes or [])
    shown, svg = budget.admit(len(heads), n_q, n_k)
    said = _not_drawn(n_q, n_k, shown, len(heads), budget.bounds)
    if shown <= 0:
        return notes + said
    queries, keys = call_labels(call, batch, tokens)
    figures = _figures(weights, full, heads[:shown], batch, queries, keys,
                       f"{call.module or '(root)'}, call {call.index}", svg)  # fmt: skip
    items = f'<p class="dim">Batch item {batch} of the {n_b} the map holds.</p>' if n_b > 1 else ""
    return notes + f'<div class="maps" data-map="call-{call.index}">{figures}</div>' + said + items + _SCALE


def tensors_maps(weights: Any, full: Any, bounds: MapBounds = DEFAULT_BOUNDS) -> str:
    """Heatmaps of a bare ``[B, H, T_q, T_k]`` map (batch position 0, positions as labels), within ``bounds``."""
    _, n_h, n_q, n_k = (int(x) for x in weights.shape)
    shown, svg = DrawBudget(bounds).admit(n_h, n_q, n_k)
    said = _not_drawn(n_q, n_k, shown, n_h, bounds)
    if shown <= 0:
        return said
    figures = _figures(weights, full, range(shown), 0, [str(i) for i in range(n_q)], [str(i) for i in range(n_k)],
                       "attention map", svg)  # fmt: skip
    return f'<div class="maps">{figures}</div>{said}{_SCALE}'
