"""The HTML of a trace: notebook displays, the self-contained page, ``trace --html`` and ``grads --html``.

The pages are read back with the standard library's ``html.parser``, never
with qkvtrace's own code; what they must say comes from the model built for
the test (names, number of calls, inputs), from PyTorch's own source (its
fast-path reason) and from attention weights and gradients computed here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from _html_model import HEADS, TOKENS, WIDTH, WORDS, Mixed, build, causal_weights
from _mha_reasons import reason_under
from _witness import ENV

import qkvtrace
from qkvtrace.render.html_page import trace_page
from qkvtrace.render.html_parts import MapBounds


class Page(HTMLParser):
    """Tags with their attributes, the calls table's rows (cells as text) and each ``<title>``'s text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.rows: list[dict[str, object]] = []
        self.titles: list[str] = []
        self.styles: list[str] = []
        self._cell: list[str] | None = None
        self._title: list[str] | None = None
        self._style: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "tr" and "data-call" in a:
            self.rows.append({**a, "cells": []})
        elif tag == "td" and self.rows and self._cell is None and self.rows[-1].get("open", True):
            self._cell = []
        elif tag == "title":
            self._title = []
        elif tag == "style":
            self._style = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[-1]["cells"].append("".join(self._cell).strip())  # type: ignore[attr-defined]
            self._cell = None
        elif tag == "tr" and self.rows:
            self.rows[-1]["open"] = False
        elif tag == "title" and self._title is not None:
            self.titles.append("".join(self._title))
            self._title = None
        elif tag == "style" and self._style is not None:
            self.styles.append("".join(self._style))
            self._style = None

    def handle_data(self, data: str) -> None:
        for part in (self._cell, self._title, self._style):
            if part is not None:
                part.append(data)


def traced() -> tuple[Mixed, torch.Tensor, qkvtrace.TraceResult]:
    """One forward and backward of the test model, traced with attention maps."""
    model, x = build()
    with qkvtrace.trace(model, attention_maps=True) as t:
        model(x).pow(2).mean().backward()
    return model, x, t.result


def test_the_page_needs_nothing_from_elsewhere(tmp_path: Path) -> None:
    """Witness: the standard library's HTML parser -- no tag loads a file or address; styles import nothing."""
    _, _, result = traced()
    path = result.save_html(tmp_path / "trace.html")
    page = Page(path.read_text(encoding="utf-8"))
    for tag, attrs in page.tags:
        assert tag not in ("link", "iframe", "object", "embed", "img"), tag
        for name in ("src", "href", "data", "srcset"):
            value = attrs.get(name)
            assert value is None or value.startswith(("#", "data:image/png;base64,")), (tag, name, value)
    assert all("@import" not in s and "url(" not in s for s in page.styles)
    assert any(tag == "script" for tag, _ in page.tags)  # the sorting and filtering, inline


def test_one_row_per_call_with_the_models_names_paths_and_pytorchs_reason(tmp_path: Path) -> None:
    """Witness: the model built here (two forwards: mha then attend, each twice) and PyTorch's source (its reason)."""
    model, x = build()
    with qkvtrace.trace(model) as t:
        model(x)
        model(x)
    page = trace_page(t.result)
    rows = Page(page).rows
    assert [r["data-module"] for r in rows] == ["mha", "attend", "mha", "attend"]
    assert "No attention maps were asked for" in page  # the trace had no attention_maps=True: the page says how
    assert [r["cells"][2] for r in rows] == ["fallback", "sdpa", "fallback", "sdpa"]  # path as text, not colour alone
    training = reason_under("self.training")
    assert [r["cells"][-1] for r in rows if r["data-module"] == "mha"] == [training, training]


def test_a_calls_heatmap_holds_its_weights_with_the_tokens_as_labels(tmp_path: Path) -> None:
    """Witness: softmax(QKᵀ/√d) with the causal triangle removed, computed here from the Q, K the module made."""
    model, _, result = traced()
    q, k, _ = model.attend.kept
    expected = causal_weights(q.detach(), k.detach())[0]  # batch item 0: [H, T, T]
    page = Page(result.html(tokens=[WORDS, WORDS]))
    for head in range(HEADS):
        cells = {}
        prefix = f"attend, call 1: head {head}, batch item 0"
        at = page.titles.index(prefix)
        for title in page.titles[at + 1 : at + 1 + TOKENS * TOKENS]:
            match = re.fullmatch(r"(\S+) → (\S+): ([0-9.]+)", title)
            assert match, title
            cells[(WORDS.index(match[1]), WORDS.index(match[2]))] = float(match[3])
        assert len(cells) == TOKENS * TOKENS
        for (i, j), value in cells.items():
            assert value == pytest.approx(float(expected[head, i, j]), abs=6e-4), (head, i, j)


def test_notebook_displays(tmp_path: Path) -> None:
    """Witness: the model built here, and the gradient reaching V computed by ``torch.autograd.grad`` on a twin run.

    A result (with the routes picture of its backward pass), a call, a route
    and a map each display themselves as HTML; the result's plain repr stays
    one line a terminal can read.
    """
    _, x, result = traced()
    twin, _ = build()
    out = twin(x)
    v = twin.attend.kept[2]
    (grad_v,) = torch.autograd.grad(out.pow(2).mean(), v)
    text = repr(result)
    assert "\n" not in text and "2 attention calls" in text
    shown = result._repr_html_()
    assert len(Page(shown).rows) == 2
    assert "How the loss reaches W_Q, W_K, W_V" in shown and "(the backward pass the trace saw)" in shown
    call = result.calls[1]
    details = call._repr_html_()
    assert '<details class="call" id="call-1" open>' in details and "attend" in details
    route = next(r for r in result.routes if r.call == 1)
    assert f"{grad_v.norm().item():.3g}" in route._repr_html_()
    assert len(re.findall("<svg", call.map_tensors._repr_html_())) == HEADS


def test_what_is_past_a_bound_is_named(tmp_path: Path) -> None:
    """Witness: the model built here (2 calls of 6 tokens): bounds below them leave out calls and maps, and say so."""
    _, _, result = traced()
    page = trace_page(result, max_calls=1, bounds=MapBounds(max_tokens=4))
    assert "1 more call(s) not shown" in page
    assert f"Map not drawn: {TOKENS}×{TOKENS} is longer than 4 on a side" in page
    assert len(Page(page).rows) == 1
    one_head = trace_page(result, bounds=MapBounds(max_heads=1))
    assert f"{HEADS - 1} more head(s) of this call not drawn here" in one_head


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=300)  # fmt: skip


def test_trace_html_from_the_command_line(tmp_path: Path) -> None:
    """Witness: the demo's own inputs and vocabulary (the map's row labels are the words of batch item 0)."""
    from qkvtrace.analyses.demos import VOCABULARY, demo_tiny_lm

    _, (ids,) = demo_tiny_lm()
    words = [VOCABULARY[i] for i in ids[0].tolist()]
    proc = _cli("trace", "demo:tiny-lm", "--show-maps", "--html", "page.html", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = Page((tmp_path / "page.html").read_text(encoding="utf-8"))
    assert [r["data-module"] for r in page.rows] == ["blocks.0.attention", "blocks.1.attention"]
    first = page.titles.index("blocks.0.attention, call 0: head 0, batch item 0")
    labels = [t.split(" → ")[0] for t in page.titles[first + 1 : first + 1 + len(words) ** 2 : len(words)]]
    assert labels == words


def test_grads_html_draws_the_routes_inline(tmp_path: Path) -> None:
    """Witness: the encoder demo's own layers (two), and an SVG parsed as a part of the page, with nothing to fetch."""
    proc = _cli("grads", "demo:encoder", "--html", "routes.html", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "routes.html").read_text(encoding="utf-8")
    assert "<!DOCTYPE svg" not in text and "<?xml" not in text
    page = Page(text)
    assert sum(tag == "svg" for tag, _ in page.tags) >= 1
    assert [r["data-module"] for r in page.rows] == ["layers.0.self_attn", "layers.1.self_attn"]


def test_html_into_a_missing_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    """Witness: the file system (no such folder): one line on stderr, exit 2, nothing written."""
    proc = _cli("trace", "demo:mha", "--html", str(tmp_path / "no" / "page.html"), cwd=tmp_path)
    assert proc.returncode == 2
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
    assert "--html" in proc.stderr
    assert not (tmp_path / "no").exists()


def test_a_long_map_is_a_picture_whose_shades_follow_the_weights(tmp_path: Path) -> None:
    """Witness: softmax(QKᵀ/√d) with the causal triangle removed, computed here, and the PNG decoded by Pillow.

    Past ``max_svg_tokens`` a head is a PNG in a ``data:`` URI, a pixel per weight: the picture is T×T, the
    removed triangle is one colour and the lightest, and along each row a larger weight is never lighter.
    """
    pil = pytest.importorskip("PIL.Image", reason="Pillow is not installed (it comes with matplotlib)")
    import base64
    import io

    tokens = 60
    model, _ = build()
    x = torch.randn(1, tokens, WIDTH, generator=torch.Generator().manual_seed(3))
    with qkvtrace.trace(model, attention_maps=True, heads=[0]) as t:
        model(x)
    q, k, _ = model.attend.kept
    w = causal_weights(q.detach(), k.detach())[0, 0]  # [T, T] of batch item 0, head 0
    page = trace_page(t.result, bounds=MapBounds(max_svg_tokens=48))
    sources = [a["src"] for tag, a in Page(page).tags if tag == "img"]
    assert len(sources) == 2  # mha's and attend's head 0
    image = pil.open(io.BytesIO(base64.b64decode(sources[1].split(",", 1)[1]))).convert("RGB")
    assert image.size == (tokens, tokens)
    light = [[sum(image.getpixel((j, i))) for j in range(tokens)] for i in range(tokens)]
    removed = {light[i][j] for i in range(tokens) for j in range(i + 1, tokens)}
    assert len(removed) == 1 and removed.pop() == max(max(row) for row in light)
    for i in range(tokens):
        for a in range(i + 1):
            for b in range(i + 1):
                if w[i, a] > w[i, b] + 2 / 255:
                    assert light[i][a] <= light[i][b], (i, a, b)
