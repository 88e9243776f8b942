"""A newcomer's first hour: each friction they met, through the real command line or the public API."""

from __future__ import annotations

import html
import itertools
import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from _witness import qkv
from torch import nn

import qkvtrace


class NormedAttention(nn.Module):
    """Self-attention, then a final LayerNorm: each output row sums to a constant, so sum() has no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.attn(x, x, x, need_weights=False)[0])


def normed_attention() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = NormedAttention()
    return model, torch.randn(2, 5, 16)


FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn

    class NormedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(self.attn(x, x, x, need_weights=False)[0])

    def normed_attention():
        torch.manual_seed(0)
        model = NormedAttention()
        return model, torch.randn(2, 5, 16)
    """
)


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "factories.py").write_text(FACTORIES)
    return tmp_path


def test_trace_backward_through_final_layernorm_is_not_rounding_noise(factories: Path) -> None:
    """`trace --backward` backpropagates a fixed random cotangent, not the output's sum.

    Witness: the same model and inputs built in the test; ``torch.autograd.grad``
    of ``out.sum()`` is ~0 (the LayerNorm makes each row's sum constant), while
    a backward of ``<out, R>`` with R from ``torch.Generator().manual_seed(0)``,
    computed here, gives ``.grad`` rows whose norms the CLI must report.
    """
    model, x = normed_attention()
    w = model.attn.in_proj_weight
    out = model(x)
    (by_sum,) = torch.autograd.grad(out.sum(), w, retain_graph=True)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * r).sum().backward()
    assert by_sum.norm() < 1e-4 * w.grad.norm(), "the witness model must make sum() gradient-free"
    e = 16
    expected = {p: w.grad[i * e : (i + 1) * e].norm().item() for i, p in enumerate("qkv")}

    proc = qkv("trace", "factories.py:normed_attention", "--backward", "--json", "t.json", cwd=factories)
    assert proc.returncode == 0, proc.stderr
    assert "backward of <output, R>" in proc.stdout, proc.stdout
    got = json.loads((factories / "t.json").read_text())["gradients"]
    assert len(got) == 1
    for p in "qkv":
        assert got[0][p]["grad_norm"] == pytest.approx(expected[p], rel=1e-5), p


def _maps_sample() -> str:
    """The README's (or the docs') Python sample of attention maps, whole."""
    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for page in pages:
        for block in page.read_text(encoding="utf-8").split("```python")[1:]:
            code = block.split("```")[0]
            if "attention_maps=True, heads=[0, 3]" in code:
                return code
    pytest.fail("no Python sample of attention_maps=True, heads=[0, 3] in README.md or docs/")


def test_readme_maps_sample_prints_what_its_comment_says(capsys: pytest.CaptureFixture[str]) -> None:
    """The maps sample, run as written after the README's first Python sample, prints its own comment.

    Witness for the path it claims: ``torch.profiler`` on an untraced run of the
    same module in the same mode names ``aten::_native_multi_head_attention``
    (the fast path) exactly when the comment says ``fast``.
    """
    code = _maps_sample()
    expected = [line[2:] for line in code.splitlines() if line.startswith("# ")][-1]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 8, batch_first=True)  # as the README's first Python sample
    x = torch.randn(2, 10, 64)
    scope = {"torch": torch, "nn": nn, "qkvtrace": qkvtrace, "mha": mha, "x": x}
    exec(code, scope)  # the sample, as a reader would paste it
    printed = capsys.readouterr().out.strip()
    with torch.profiler.profile() as prof, torch.no_grad():
        mha(x, x, x, need_weights=False)
    fast = any(e.name == "aten::_native_multi_head_attention" for e in prof.events())
    assert printed.split()[0] == ("fast" if fast else "fallback")
    assert printed == expected


def test_no_made_up_inputs_for_a_model_whose_first_layer_gives_no_shape(tmp_path: Path) -> None:
    """A model starting with ``nn.Linear(8, 32)`` gets no guessed inputs: one line says so and what to do.

    Witness: PyTorch itself, in the test -- the model raises on the
    ``(B, T, embed_dim)`` floats a guess from its attention layer would give,
    so any guess there is wrong; the layer named in the message is the model's
    first entry in ``named_modules`` that has no children.
    """
    (tmp_path / "linear_first.py").write_text(textwrap.dedent(
        """
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoderLayer(32, 4, batch_first=True))
        """))  # fmt: skip
    model = nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoderLayer(32, 4, batch_first=True))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 16, 32))
    first = next(name for name, m in model.named_modules() if not list(m.children()))
    proc = qkv("trace", "linear_first.py:build", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot make example inputs" in lines[0] and "(model, example_inputs)" in lines[0], lines[0]
    assert f"{first} (Linear)" in lines[0] and "does not guess" in lines[0], lines[0]
    assert "raised" not in lines[0], "the model must not have been run on guessed inputs"


CAUSAL = textwrap.dedent(
    """
    import torch
    from torch import nn

    def causal():
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 2, batch_first=True)
        x = torch.randn(1, 8, 16)
        mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)
        return mha, {"query": x, "key": x, "value": x, "attn_mask": mask, "need_weights": False}
    """
)


def test_terminal_map_of_a_causal_model_shades_each_row_on_its_own(tmp_path: Path) -> None:
    """``--show-maps`` shades each query's row against that row's largest weight, and prints that max.

    Witness: PyTorch's own ``need_weights=True, average_attn_weights=False``
    weights of the same module and inputs, computed in the test; each printed
    shade is checked against the legend's rule (' ' for 0, the k-th shade for
    weights up to k/5 of the row's max) and each row's printed max against
    PyTorch's. Against the head's max (row 0's 1.00) most cells would be '·'.
    """
    (tmp_path / "causal_mha.py").write_text(CAUSAL)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(1, 8, 16)
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)
    with torch.no_grad():
        _, weights = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    head0 = weights[0, 0]
    proc = qkv("trace", "causal_mha.py:causal", "--show-maps", "--map-heads", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("head 0")) + 1
    shades = " ·░▒▓█"
    pattern = re.compile(r"^\s*(\S+)  (.{8}) +(\d\.\d\d)\s*$")  # label, two spaces, 8 cells, row max
    for q in range(8):
        m = pattern.match(lines[start + q])
        assert m is not None, lines[start + q]
        row = head0[q]
        top = float(row.max())
        assert float(m.group(3)) == pytest.approx(top, abs=0.006)
        for k, cell in enumerate(m.group(2)):
            level, part = shades.index(cell), float(row[k]) / top
            if level == 0:
                assert part < 1e-3, (q, k, part)
            else:
                assert (level - 1) / 5 - 1e-3 <= part <= level / 5 + 1e-3, (q, k, cell, part)
    assert "as parts of that row's max" in proc.stdout


ROOT = Path(__file__).resolve().parent.parent


def test_history_out_folder_that_does_not_exist_is_created(tmp_path: Path) -> None:
    """``history REPORTS --out DIR`` makes DIR, as ``inspect --out`` does, and writes the timeline there.

    Witness: the file system, and the ``torch_version`` of each committed
    ``reports/torch-*/report.json``, read here as plain JSON.
    """
    two = sorted(ROOT.glob("reports/torch-2.[01].*"))
    assert len(two) == 2
    expected = [json.loads((d / "report.json").read_text())["environment"]["torch_version"] for d in two]
    out = tmp_path / "not" / "yet"
    proc = qkv("history", *map(str, two), "--out", str(out), "--no-chart")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["HISTORY.md", "history.json"]
    assert json.loads((out / "history.json").read_text())["releases"] == expected


def test_history_out_that_is_a_file_names_out_not_json(tmp_path: Path) -> None:
    """An ``--out`` that cannot be a folder is refused naming ``--out``, the option given, never ``--json``.

    Witness: the command line the test wrote (only --out is passed).
    """
    blocker = tmp_path / "file"
    blocker.write_text("x")
    two = sorted(ROOT.glob("reports/torch-2.[01].*"))
    proc = qkv("history", *map(str, two), "--out", str(blocker / "sub"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--out" in lines[0] and "--json" not in lines[0], proc.stderr


def _sdpa_kernels(run: object) -> set[str]:
    """The SDPA kernels ``torch.profiler`` sees in an untraced run."""
    with torch.profiler.profile() as prof:
        run()  # type: ignore[operator]
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


def test_assert_backend_explains_none_only_where_none_is_shown(packed_attention_cls: type[nn.Module]) -> None:
    """``assert_backend``'s "(backend none: ...)" note appears only when a call ran no SDPA kernel or None was asked.

    Witness: ``torch.profiler`` on untraced runs -- under ``sdpa_kernel(MATH)``
    the math kernel runs (so every failing call has a backend); the MHA fast
    path in eval under no_grad runs no SDPA kernel at all.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qkvtrace.pytest_plugin import assert_backend

    net = packed_attention_cls(16, 2)
    x = torch.randn(2, 5, 16)
    with sdpa_kernel(SDPBackend.MATH):
        assert "aten::_scaled_dot_product_attention_math" in _sdpa_kernels(lambda: net(x))
        with qkvtrace.trace(net) as t:
            net(x)
    with pytest.raises(AssertionError) as math_failure:
        assert_backend(t, "FLASH_ATTENTION")
    assert "backend none" not in str(math_failure.value), str(math_failure.value)

    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    with torch.no_grad():
        assert _sdpa_kernels(lambda: mha(x, x, x, need_weights=False)) == set()
        with qkvtrace.trace(mha) as t2:
            mha(x, x, x, need_weights=False)
    with pytest.raises(AssertionError) as none_failure:
        assert_backend(t2, "MATH")
    assert "(backend none: no SDPA kernel ran)" in str(none_failure.value)


def test_cli_and_python_map_the_same_batch_items_by_default(tmp_path: Path) -> None:
    """Without a batch choice, ``trace --maps`` and ``qkvtrace.trace(..., attention_maps=True)`` map every item.

    Witness: PyTorch's own ``need_weights=True, average_attn_weights=False``
    weights of ``demo:mha`` on its own inputs (batch of 2), computed in the test.
    """
    pytest.importorskip("matplotlib")
    from qkvtrace.analyses.demos import demo_mha

    mha, (x, _, _) = demo_mha()
    with torch.no_grad():
        _, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
    assert weights.shape[0] == 2
    with qkvtrace.trace(mha.eval(), attention_maps=True) as t, torch.no_grad():
        mha(x, x, x, need_weights=False)
    assert torch.allclose(t.calls[0].attention_map, weights, atol=1e-5)

    proc = qkv("trace", "demo:mha", "--maps", str(tmp_path / "maps"), "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "t.json").read_text())["calls"][0]["attention_map"]
    assert saved["shape"] == list(weights.shape)
    assert torch.allclose(torch.tensor(saved["values"]), weights, atol=1e-5)
    helps = qkv("trace", "--help").stdout
    assert "--map-batch LIST" in helps and "default: all, as batch_index= in Python" in " ".join(helps.split())


def _dejavu_width(text: str, size: float) -> float:
    """Width of ``text`` in DejaVu Sans (the font librsvg and matplotlib draw with here), by matplotlib's metrics."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    return float(TextPath((0, 0), text, size=size, prop=FontProperties(family="DejaVu Sans")).get_extents().width)


def test_map_grid_labels_clear_the_head_to_their_left(tmp_path: Path) -> None:
    """In a call's grid, "query" is written once per row of heads, left of them, and no head's tick labels
    reach into the head on its left.

    Witness: the grid's own SVG (image and text positions, parsed here) and
    DejaVu Sans widths measured by matplotlib's font metrics; the PNG beside it
    is read for its size.
    """
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    out = tmp_path / "maps"
    proc = qkv("trace", "demo:tiny-lm", "--maps", str(out))
    assert proc.returncode == 0, proc.stderr
    svg = next(out.glob("call000_*_grid.svg")).read_text()
    assert mpimg.imread(next(out.glob("call000_*_grid.png"))).shape[1] > 600
    found = re.findall(r'<image[^>]* x="([-\d.]+)"[^>]* width="([\d.]+)"', svg)
    heads = sorted((float(x), float(x) + float(w)) for x, w in found if float(w) > 20)  # not the thin colour bar
    assert len(heads) == 4
    texts = [
        (style, float(x), angle, html.unescape(t))
        for style, x, angle, t in re.findall(
            r'<text style="([^"]*)" x="([-\d.]+)" y="[-\d.]+" transform="rotate\((-?\d+) [^"]*"\s*>([^<]*)</text>', svg
        )
    ]
    queries = [x for _, x, _, t in texts if t == "query"]
    assert len(queries) == 1 and queries[0] < heads[0][0], queries
    for left, right in itertools.pairwise(heads):
        ticks = [(float(re.search(r"font-size: ([\d.]+)px", style).group(1)), x, t)  # type: ignore[union-attr]
                 for style, x, angle, t in texts
                 if angle == "-0" and "text-anchor: end" in style and left[1] < x <= right[0]]  # fmt: skip
        assert ticks, "each head has token tick labels on its left"
        reach = min(x - _dejavu_width(t, size) for size, x, t in ticks)
        assert reach >= left[1], (reach, left)


def _svg_nodes(svg: str) -> list[tuple[str, list[tuple[float, float, float, str]], tuple[float, float, float, float]]]:
    """(shape, texts (x, y, size, text), bounding box (x0, x1, y0, y1)) of each node of a Graphviz SVG."""
    nodes = []
    for body in re.findall(r'<g id="node\d+" class="node">(.*?)</g>', svg, flags=re.S):
        texts = [
            (float(x), float(y), float(size), html.unescape(t))
            for x, y, size, t in re.findall(
                r'<text[^>]*x="([-\d.]+)" y="([-\d.]+)"[^>]*font-size="([\d.]+)">([^<]*)</text>', body
            )
        ]
        ellipse = re.search(r'<ellipse[^>]*cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" ry="([\d.]+)"', body)
        if ellipse:
            cx, cy, rx, ry = map(float, ellipse.groups())
            nodes.append(("ellipse", texts, (cx - rx, cx + rx, cy - ry, cy + ry)))
            continue
        shape = re.search(r'<(?:path|polygon)[^>]*(?:d|points)="([^"]+)"', body)
        if shape is None:
            continue  # plaintext (the legend)
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", shape.group(1))]
        xs, ys = nums[0::2], nums[1::2]
        nodes.append(("box", texts, (min(xs), max(xs), min(ys), max(ys))))
    return nodes


@pytest.fixture(scope="module")
def grads_svg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grads") / "routes.svg"
    proc = qkv("grads", "demo:tiny-lm", "--svg", str(path))
    if "layout program" in proc.stderr or "Graphviz" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    return path


def test_grads_svg_boxes_hold_their_text_in_a_wider_font(grads_svg: Path) -> None:
    """Each node of the ``grads`` picture is wide enough for its text drawn in DejaVu Sans.

    Witness: the SVG's own node outlines and text positions, parsed here, and
    DejaVu Sans widths from matplotlib's font metrics (the font librsvg draws
    Helvetica with where Helvetica is not installed).
    """
    pytest.importorskip("matplotlib")
    nodes = _svg_nodes(grads_svg.read_text())
    assert len([n for n in nodes if n[0] == "box"]) >= 5
    for shape, texts, (x0, x1, y0, y1) in nodes:
        for x, y, size, text in texts:
            half = _dejavu_width(text, size) / 2
            if shape == "ellipse":
                rx, cy, ry = (x1 - x0) / 2, (y0 + y1) / 2, (y1 - y0) / 2
                room = rx * max(0.0, 1 - ((y - size / 3 - cy) / ry) ** 2) ** 0.5  # the ellipse's half-width there
                assert half <= room, (text, half, room)
            else:
                assert x0 <= x - half and x + half <= x1, (text, x - half, x + half, x0, x1)


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="librsvg's rsvg-convert is not installed")
def test_grads_svg_drawn_by_librsvg_keeps_text_inside_boxes(grads_svg: Path, tmp_path: Path) -> None:
    """Drawn by a second renderer (librsvg), no text ink falls just outside any box of the ``grads`` picture.

    Witness: the PNG ``rsvg-convert`` makes, read pixel by pixel; box outlines
    and text rows come from the SVG, parsed here.
    """
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    svg = grads_svg.read_text()
    png = tmp_path / "routes.png"
    subprocess.run(["rsvg-convert", str(grads_svg), "-o", str(png)], check=True, timeout=120)
    pixels = mpimg.imread(png)[..., :3]
    view_w = float(re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+)', svg).group(1))  # type: ignore[union-attr]
    tx, ty = map(float, re.search(r'class="graph" transform="[^"]*translate\(([-\d.]+) ([-\d.]+)\)', svg).groups())  # type: ignore[union-attr]
    scale = pixels.shape[1] / view_w
    dark = (pixels < 0.25).all(axis=-1)  # text is black; edges and outlines are coloured or grey
    checked = 0
    for shape, texts, (x0, x1, _, _) in _svg_nodes(svg):
        if shape != "box":
            continue
        for _, y, size, _ in texts:
            top, bottom = round((y - size + ty) * scale), round((y + ty) * scale)
            for edge, step in ((x0, -1), (x1, 1)):
                px = round((edge + tx) * scale)
                band = range(px + 2 * step, px + 10 * step, step)
                assert not dark[top:bottom, min(band) : max(band) + 1].any(), (y, edge)
                checked += 1
    assert checked >= 10
