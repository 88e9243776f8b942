"""The tutorial's models (3.2, 5.1, 7, 8) against PyTorch, loaded with the same weights.

Every number here is measured: the bounds say how close float32 and
bfloat16 must be, and the negative tests show the measurement can tell a
right loading from a wrong one (a Q/K swap in the packed split, the wrong
norm placement), so a small error is evidence and not an accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from qkvtrace.analyses import reference
from qkvtrace.analyses.reference import (
    MultiHeadSelfAttention,
    TransformerBlock,
    attention,
    compare,
    load_encoder_layer,
    load_mha,
    measure,
)

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "reports" / "torch-2.13.0+cpu" / "report.json"


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return measure()


def _rel(err: float | None, scale: float | None) -> float:
    assert err is not None and scale is not None
    return err / max(1.0, scale)


def test_every_comparison_runs_in_both_dtypes(rows: list[dict[str, Any]]) -> None:
    """Witness: the tutorial's case names and the two dtypes, written here."""
    keys = {(r["key"], r["dtype"]) for r in rows}
    cases = {r["key"] for r in rows}
    assert {"3.2", "5.1", "5.1 padded", "5.1 eval", "7 post-norm", "7 pre-norm", "7 post-norm eval", "8"} <= cases
    assert keys == {(c, d) for c in cases for d in ("float32", "bfloat16")}
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]


def test_float32_agrees_closely_and_bfloat16_within_its_precision(rows: list[dict[str, Any]]) -> None:
    """Witness: the 5.1 eval case rebuilt here and its error measured here on PyTorch's own output; the
    bounds are float32's and bfloat16's precision, written here."""
    for dtype in (torch.float32, torch.bfloat16):  # 5.1 eval, recomputed without measure() or compare()
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.0).to(dtype).eval()
        ref = MultiHeadSelfAttention(32, 4).to(dtype).eval()
        load_mha(ref, mha)
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            ours, theirs = ref(x), mha(x, x, x, need_weights=False)[0]
        assert isinstance(ours, torch.Tensor)
        err = float((ours.double() - theirs.double()).abs().max())
        [row] = [r for r in rows if r["key"] == "5.1 eval" and r["dtype"] == str(dtype).removeprefix("torch.")]
        assert row["forward_max_abs_err"] == pytest.approx(err, rel=0.06, abs=1e-12), (row, err)
        assert row["output_max_abs"] == pytest.approx(float(theirs.double().abs().max()), rel=0.06), row
    for r in rows:
        grads = r["grad_max_abs_err"] is not None
        assert grads == ("eval" not in r["key"]), r  # gradients compared wherever PyTorch ran with grad on
        bound = 1e-5 if r["dtype"] == "float32" else 3e-2  # bfloat16 keeps 8 bits: eps 7.8e-3
        assert _rel(r["forward_max_abs_err"], r["output_max_abs"]) < bound, r
        if grads:
            assert _rel(r["grad_max_abs_err"], r["grad_max_abs"]) < bound, r


def test_bfloat16_really_ran_in_bfloat16(rows: list[dict[str, Any]]) -> None:
    """Each case's bfloat16 error is far above its float32 error: the dtype was applied on both sides.

    Witness: the MHA pair rebuilt here in each dtype; the dtype of PyTorch's output read here.
    """
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(32, 4, batch_first=True).to(dtype).eval()
        ref = MultiHeadSelfAttention(32, 4).to(dtype).eval()
        load_mha(ref, mha)
        x = torch.randn(2, 6, 32).to(dtype)
        with torch.no_grad():
            ours = ref(x)
            assert isinstance(ours, torch.Tensor)
            assert ours.dtype == mha(x, x, x, need_weights=False)[0].dtype == dtype
    by = {(r["key"], r["dtype"]): r for r in rows}
    for key in {r["key"] for r in rows}:
        fp32, bf16 = by[key, "float32"], by[key, "bfloat16"]
        assert bf16["forward_max_abs_err"] > 100 * fp32["forward_max_abs_err"], key


def test_pytorch_side_paths_as_the_tracer_recorded(rows: list[dict[str, Any]]) -> None:
    """Witness: PyTorch's documented fast-path rules (training refuses it; eval MHA and encoder layers take
    it) and the SDPA modules written in the reference, stated here."""
    path = {r["key"]: r["path"] for r in rows if r["dtype"] == "float32"}
    assert path["5.1"] == "fallback"  # training: PyTorch refuses the fast path
    assert path["5.1 eval"] == "fast"
    assert path["7 pre-norm eval"] == path["7 post-norm eval"] == "fused_encoder_layer"
    assert path["8"] == path["3.2"] == "sdpa"


# -- the measurement can tell right from wrong ------------------------------------------------------


def _mha_pair() -> tuple[MultiHeadSelfAttention, nn.MultiheadAttention, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    ref = MultiHeadSelfAttention(16, 4)
    pairs = [(a, b) for _, a, _, b in load_mha(ref, mha)]
    return ref, mha, pairs


def _run_pair(ref: MultiHeadSelfAttention, mha: nn.MultiheadAttention, pairs: list[Any]) -> reference.Agreement:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    return compare(lambda: ref(x), lambda: mha(x, x, x, need_weights=False)[0], pairs)  # type: ignore[arg-type,return-value]


def _forward_err(ref: MultiHeadSelfAttention, mha: nn.MultiheadAttention) -> float:
    """Max |ours - PyTorch's| on one input, measured here without ``compare``."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = ref(x)
        assert isinstance(ours, torch.Tensor)
        return float((ours - mha(x, x, x, need_weights=False)[0]).abs().max())


def test_packed_split_order_matters() -> None:
    """Witness: PyTorch's own MHA output and ``.grad``, compared here; the wrong split is built here."""
    ref, mha, pairs = _mha_pair()
    right = _run_pair(ref, mha, pairs)
    assert right.forward_max_abs_err < 1e-5 and right.grad_max_abs_err is not None and right.grad_max_abs_err < 1e-5
    assert _forward_err(ref, mha) < 1e-5
    x = torch.randn(2, 5, 16)
    for a, b in pairs:
        a.grad = b.grad = None
    ours = ref(x)
    assert isinstance(ours, torch.Tensor)
    ours.square().sum().backward()
    mha(x, x, x, need_weights=False)[0].square().sum().backward()
    for a, b in pairs:
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    for a, b in (("q", "k"), ("k", "v")):
        wrong, same_mha, wrong_pairs = _mha_pair()
        with torch.no_grad():  # the slices of in_proj_weight written in the wrong order
            w = wrong.qkv.weight
            w[wrong.rows(a)], w[wrong.rows(b)] = w[wrong.rows(b)].clone(), w[wrong.rows(a)].clone()
        bad = _run_pair(wrong, same_mha, wrong_pairs)
        assert bad.forward_max_abs_err > 1e3 * max(right.forward_max_abs_err, 1e-7), (a, b)
        assert _forward_err(wrong, same_mha) > 1e3 * max(_forward_err(ref, mha), 1e-7), (a, b)


def test_rows_are_where_forward_reads_q_k_v() -> None:
    """Witness: the heads built here from the named rows, through PyTorch's SDPA and the output projection."""
    torch.manual_seed(1)
    ref = MultiHeadSelfAttention(16, 2)
    x = torch.randn(1, 4, 16)
    w, bias = ref.qkv.weight, ref.qkv.bias

    def heads(part: str) -> torch.Tensor:  # [1,T,D] -> [1,H,T,Dh]
        return (x @ w[ref.rows(part)].T + bias[ref.rows(part)]).view(1, 4, 2, 8).transpose(1, 2)

    context = torch.nn.functional.scaled_dot_product_attention(heads("q"), heads("k"), heads("v"))
    expected = ref.out_proj(context.transpose(1, 2).reshape(1, 4, 16))
    out = ref(x)
    assert isinstance(out, torch.Tensor)
    assert torch.allclose(out, expected, atol=1e-6)


def test_norm_first_is_told_apart() -> None:
    """Witness: PyTorch's nn.TransformerEncoderLayer output, compared here with the block's."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    errors = {}
    for layer_first in (False, True):
        for block_first in (False, True):
            layer = nn.TransformerEncoderLayer(16, 4, 64, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=layer_first)  # fmt: skip
            block = TransformerBlock(16, 4, norm_first=block_first)
            load_encoder_layer(block, layer)
            with torch.no_grad():
                errors[layer_first, block_first] = float((block(x) - layer(x)).abs().max())
    assert errors[False, False] < 1e-5 and errors[True, True] < 1e-5
    assert errors[False, True] > 0.1 and errors[True, False] > 0.1


def test_causal_mask_by_hand_is_sdpa_is_causal_and_not_full_attention() -> None:
    """Witness: PyTorch's SDPA with is_causal=True and without a mask, and the mask built here."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    hand, weights = attention(q, k, v, causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((hand - sdpa).abs().max()) < 1e-5
    assert float(weights[..., causal.logical_not()].abs().max()) == 0.0  # masked positions get 0
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert float((hand - full).abs().max()) > 0.1


# -- in the report, its Markdown, and diff -------------------------------------------------------------


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "qkvtrace", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip


def test_report_markdown_shows_the_table(rows: list[dict[str, Any]]) -> None:
    """Witness: the heading and the pre-norm block's row, written here."""
    from qkvtrace.render.markdown import report_markdown

    report = json.loads(REPORT.read_text())
    report["probes"]["reference"] = rows
    text = report_markdown(report)
    assert "## The tutorial's models against PyTorch (measured)" in text
    row = ("| The Transformer block | Transformer block, pre-norm | nn.TransformerEncoderLayer(norm_first=True), "
           "training | float32 |")
    assert row in text


def test_diff_shows_a_moved_error_and_a_changed_path(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    """Witness: the two reports the test wrote, with the changes it made (and the one it left as noise)."""
    base = json.loads(REPORT.read_text())
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, tweak in ((a, False), (b, True)):
        folder.mkdir()
        report = json.loads(json.dumps(base))
        report["probes"]["reference"] = json.loads(json.dumps(rows))
        if tweak:
            for r in report["probes"]["reference"]:
                if (r["key"], r["dtype"]) == ("5.1", "float32"):
                    r["forward_max_abs_err"] = 1e-3  # numerics moved by far more than 4x
                if (r["key"], r["dtype"]) == ("8", "bfloat16"):
                    r["sdpa_backend"] = "MATH"
                if (r["key"], r["dtype"]) == ("7 pre-norm", "float32"):
                    r["forward_max_abs_err"] *= 1.5  # noise: not a change
        (folder / "report.json").write_text(json.dumps(report))
    done = _cli("diff", a, b, "--json", tmp_path / "d.json")
    assert done.returncode == 0, done.stderr
    changed = json.loads((tmp_path / "d.json").read_text())["probes"]["changed"]
    moved = {c["key"]: c for c in changed if c["kind"] == "reference"}
    assert set(moved) == {"tutorial model 5.1 vs PyTorch, float32", "tutorial model 8 vs PyTorch, bfloat16"}
    assert moved["tutorial model 5.1 vs PyTorch, float32"]["became"]["forward_max_abs_err"] == 1e-3
    assert moved["tutorial model 8 vs PyTorch, bfloat16"]["became"]["sdpa_backend"] == "MATH"
    assert "tutorial model 5.1 vs PyTorch, float32" in done.stdout  # the terminal shows it too
    # a report made before the table existed is not a change of PyTorch
    old = json.loads(json.dumps(base))
    old["probes"].pop("reference", None)
    (a / "report.json").write_text(json.dumps(old))
    done = _cli("diff", a, b, "--json", tmp_path / "d2.json")
    assert done.returncode == 0, done.stderr
    changed = json.loads((tmp_path / "d2.json").read_text())["probes"]["changed"]
    assert not [c for c in changed if c["kind"] == "reference"]


@pytest.mark.slow
def test_probe_prints_the_table_and_writes_it(tmp_path: Path) -> None:
    """Witness: the file the command wrote, read here, and the case names written here."""
    done = _cli("probe", "--json", tmp_path / "p.json")
    assert done.returncode == 0, done.stderr
    assert "the tutorial's models vs. PyTorch" in done.stdout
    data = json.loads((tmp_path / "p.json").read_text())
    assert {r["key"] for r in data["reference"]} >= {"3.2", "5.1", "7 pre-norm", "8"}
    assert _cli("validate", tmp_path / "p.json").returncode == 0


def test_readme_and_committed_report_hold_this_table(rows: list[dict[str, Any]]) -> None:
    """docs/probe.md's table has the committed 2.13.0 report's rows, and on that PyTorch a new measurement equals it.

    Witness: the committed report (written by ``qkvtrace inspect``). The page's table was printed on another
    CPU than the report, so its float32 digits may differ; its rows, dtypes, bfloat16 errors and paths may not.
    """
    committed = json.loads(REPORT.read_text())["probes"]["reference"]
    lines = (ROOT / "docs" / "probe.md").read_text(encoding="utf-8").splitlines()
    for r in committed:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[r["dtype"]]
        route = r["path"] if r.get("sdpa_backend") in (None, "none") else f"{r['path']} ({r['sdpa_backend']})"
        err = f" {r['forward_max_abs_err']:.2g} │" if dtype == "bf16" else ""
        assert any(r["label"] in line and f"│ {dtype} " in line and err in line and f"│ {route} " in line
                   for line in lines), r  # fmt: skip
    if torch.__version__ == json.loads(REPORT.read_text())["environment"]["torch_version"]:
        # same PyTorch: the same rows, paths and backends; the rounding errors themselves depend on the CPU's
        # kernels and thread count (measured: 2.4e-7 here where the committed report, made on another
        # machine, has 3.6e-7), so each must be within 4x of the committed one, the factor at which
        # `qkvtrace diff` calls numerics moved
        errors = ("forward_max_abs_err", "grad_max_abs_err")
        assert [{k: v for k, v in r.items() if k not in errors} for r in rows] == [
            {k: v for k, v in r.items() if k not in errors} for r in committed
        ]
        for now, then in zip(rows, committed, strict=True):
            for key in errors:
                if then[key] is None or now[key] is None:
                    assert now[key] == then[key], (now["label"], key)
                elif then[key] == 0 or now[key] == 0:
                    assert max(now[key], then[key]) < 1e-6, (now["label"], key)
                else:
                    assert 1 / 4 <= now[key] / then[key] <= 4, (now["label"], key, now[key], then[key])
