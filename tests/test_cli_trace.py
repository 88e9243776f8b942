"""`qkvtrace trace` through the real command line (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _mha_reasons import reason_under
from _witness import ENV, profiled, qkv
from torch import nn

from qkvtrace.analyses.demos import demo_encoder

#: the outermost attention op of a call -> the path it names (eval, no_grad: the fused kernels of PyTorch)
PATH_OF_OP = {
    "aten::_transformer_encoder_layer_fwd": "fused_encoder_layer",
    "aten::_native_multi_head_attention": "fast",
}


def assert_usage_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "factories.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def raises():
                raise ValueError("no weights here")

            def not_a_model():
                return [1, 2, 3]

            def with_inputs():
                torch.manual_seed(0)
                m = nn.MultiheadAttention(32, 4, batch_first=True)
                x = torch.randn(3, 5, 32)
                return m, (x, x, x)

            def with_kwargs():
                torch.manual_seed(0)
                m = nn.MultiheadAttention(32, 4, batch_first=True)
                x = torch.randn(3, 5, 32)
                return m, {"query": x, "key": x, "value": x, "need_weights": False}

            class Classifier(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.emb = nn.Embedding(50, 32)
                    self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

                def forward(self, ids):
                    x = self.emb(ids)
                    return self.attn(x, x, x, need_weights=False)[0].mean(1)

            def classifier():
                return Classifier()

            def plain_linear():
                return nn.Sequential(nn.Linear(4, 4))
            """
        )
    )
    return tmp_path


def test_encoder_demo_json_matches_library(tmp_path: Path) -> None:
    """Witness: torch.profiler on an untraced eval/no_grad run of the demo encoder (its attention ops per call,
    and the path its outermost op names); the module names of the demo's two layers."""
    out = tmp_path / "t.json"
    proc = qkv("trace", "demo:encoder", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == "qkvtrace.trace/3"
    # The same model run untraced in this process, under the profiler.
    model, (x,) = demo_encoder()
    model.eval()
    with torch.no_grad():
        segments = profiled(lambda: model(x)).segments
    assert [c["path"] for c in data["calls"]] == [PATH_OF_OP.get(s[0], "fallback") for s in segments]
    assert [c["module"] for c in data["calls"]] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert [c["aten_ops"] for c in data["calls"]] == segments
    for key in ("index", "module", "module_type", "path", "why_not_fast_path", "sdpa_backend",
                "aten_ops", "inputs", "qkv", "output"):  # fmt: skip
        assert key in data["calls"][0]
    assert "fused_encoder_layer" in proc.stdout and "layers.0.self_attn" in proc.stdout
    assert "2 attention calls" in proc.stdout


def test_tiny_lm_backward_records_gradients(tmp_path: Path) -> None:
    """Witness: the demo LM's construction (two blocks, each one packed projection and SDPA with is_causal=True)."""
    out = tmp_path / "lm.json"
    proc = qkv("trace", "demo:tiny-lm", "--train", "--backward", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {c["path"] for c in data["calls"]} == {"sdpa"}
    assert all(c["inputs"]["is_causal"] for c in data["calls"])
    modules = sorted(g["module"] for g in data["gradients"])
    assert modules == ["blocks.0.attention", "blocks.1.attention"]
    for g in data["gradients"]:
        norms = [g[p]["grad_norm"] for p in "qkv"]
        assert all(n is not None and n > 0 for n in norms)
        assert len(set(norms)) == 3  # packed, not shared


def test_train_mode_reports_pytorch_reason(tmp_path: Path) -> None:
    """Witness: the reason PyTorch's source assigns under ``self.training`` (so the call falls back)."""
    out = tmp_path / "mha.json"
    proc = qkv("trace", "demo:mha", "--train", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    call = json.loads(out.read_text())["calls"][0]
    assert call["path"] == "fallback"
    # verbatim from PyTorch: the whole string its source assigns when `self.training` holds
    assert call["why_not_fast_path"] == reason_under("self.training")


def test_file_target_with_inputs(factories: Path, tmp_path: Path) -> None:
    """Witness: the factories the test wrote (their inputs' shape and ``need_weights``)."""
    for name, need_weights in (("with_inputs", True), ("with_kwargs", False)):
        out = tmp_path / f"{name}.json"
        proc = qkv("trace", f"{factories / 'factories.py'}:{name}", "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        call = json.loads(out.read_text())["calls"][0]
        assert call["inputs"]["query_shape"] == [3, 5, 32]
        assert call["inputs"]["need_weights"] is need_weights


def test_module_target_and_synthesized_token_ids(factories: Path, tmp_path: Path) -> None:
    """Witness: the factory the test wrote (module ``attn``, width 32) and the ``--input-shape`` it passes."""
    out = tmp_path / "c.json"
    proc = qkv("trace", "factories:classifier", "--input-shape", "4,7", "--json", str(out), cwd=factories)
    assert proc.returncode == 0, proc.stderr
    call = json.loads(out.read_text())["calls"][0]
    assert call["module"] == "attn"
    assert call["inputs"]["query_shape"] == [4, 7, 32]


@pytest.mark.parametrize(
    ("target", "needles"),
    [
        ("nonexistent_pkg_xyz:build", ["nonexistent_pkg_xyz", "cannot import"]),
        ("does/not/exist.py:build", ["does/not/exist.py", "does not exist"]),
        ("justaname", ["justaname", "package.module:callable"]),
        ("demo:nope", ["nope", "encoder"]),
    ],
)
def test_bad_targets(target: str, needles: list[str]) -> None:
    """Witness: the target built by the test, and the message the test expects."""
    assert_usage_error(qkv("trace", target), *needles)


@pytest.mark.parametrize(
    ("name", "needles"),
    [
        ("missing", ["has no attribute 'missing'"]),
        ("raises", ["raises()", "ValueError", "no weights here"]),
        ("not_a_model", ["not_a_model", "list", "nn.Module"]),
        ("plain_linear", ["cannot make example inputs", "(model, example_inputs)"]),
    ],
)
def test_bad_factories(factories: Path, name: str, needles: list[str]) -> None:
    """Witness: the factories the test wrote, and the message the test expects."""
    assert_usage_error(qkv("trace", f"{factories / 'factories.py'}:{name}"), *needles)


def test_unwritable_json_leaves_no_file(tmp_path: Path) -> None:
    """Witness: the file and folder the test made, listed with ``iterdir``, and the message the test expects."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert_usage_error(qkv("trace", "demo:mha", "--json", str(blocker / "out.json")), "does not exist")
    assert_usage_error(qkv("trace", "demo:mha", "--json", str(tmp_path)), "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_bad_json_target_writes_nothing(tmp_path: Path) -> None:
    """Witness: the path the test chose, which must not exist afterwards."""
    out = tmp_path / "t.json"
    assert_usage_error(qkv("trace", "nonexistent_pkg_xyz:build", "--json", str(out)))
    assert not out.exists()


def test_unknown_command_and_bad_shape() -> None:
    """Witness: the arguments built by the test, and the message the test expects."""
    assert_usage_error(qkv("frobnicate"), "frobnicate")
    assert_usage_error(qkv("trace", "demo:encoder", "--input-shape", "2x3"), "--input-shape")


def test_help_teaches() -> None:
    """Witness: the words the test expects in the help."""
    proc = qkv("trace", "--help")
    assert proc.returncode == 0
    for needle in ("TARGET", "demo:encoder", "--backward", "reason", "fast path"):
        assert needle in proc.stdout


def _readme_output(command: str) -> list[str]:
    """The lines docs/trace.md shows under ``$ {command}``, up to the end of its code block."""
    lines = (Path(__file__).resolve().parent.parent / "docs" / "trace.md").read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    end = lines.index("```", start)
    return [line.rstrip() for line in lines[start:end]]


def _printed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return [line.rstrip() for line in proc.stdout.splitlines()]


def _shown_weight_norms(lines: list[str]) -> list[list[float]]:
    """The ``|W| q/k/v`` cell of each call row of a sample table, as numbers."""
    header = next(line for line in lines if "|W| q/k/v" in line)
    column = [c.strip() for c in header.split("┃")].index("|W| q/k/v")
    rows = [[c.strip() for c in line.split("│")] for line in lines if line.startswith("│ #")]
    return [[float(v) for v in row[column].split("/")] for row in rows]


def _packed_norms(weight: torch.Tensor) -> list[float]:
    """Norms of the three row blocks of a packed in_proj_weight, computed here."""
    return [float(block.detach().norm()) for block in weight.chunk(3)]


def test_readme_trace_samples_are_what_trace_prints() -> None:
    """Change detector (the README's text is the tool's output), plus a witness: the ``|W| q/k/v``
    numbers recomputed from the demos' weights, built here with the demos' manual_seed(0) and shapes."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 8, batch_first=True)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    witnessed = {
        "qkvtrace trace demo:encoder --columns weights":
            [_packed_norms(lay.self_attn.in_proj_weight) for lay in encoder.layers],
        "qkvtrace trace demo:mha --train --backward --columns weights,grads": [_packed_norms(mha.in_proj_weight)],
    }  # fmt: skip
    for command, norms in witnessed.items():
        shown = _shown_weight_norms(_readme_output(command))
        assert len(shown) == len(norms)
        for row, want in zip(shown, norms, strict=True):
            assert row == pytest.approx(want, abs=0.005), (command, row, want)  # printed to 3 digits
    if not torch.__version__.startswith("2.13.0"):  # PyTorch's reasons and kernels differ by release
        pytest.skip("the documented samples were printed by torch 2.13.0, the release its commands install")
    for command in witnessed:
        proc = subprocess.run([sys.executable, "-m", "qkvtrace", *command.split()[1:]], capture_output=True,
                              text=True, env={**ENV, "COLUMNS": "100"}, timeout=300)  # fmt: skip
        assert _printed(proc) == _readme_output(command)


def test_readme_library_model_sample_is_what_trace_prints(tmp_path: Path) -> None:
    """docs/trace.md's tiny BERT, made from its config alone as the page says, traced by name.

    Witness: the page's sample is a change detector (the tool's output, once) against a run now; independently,
    the attention modules are the BertSelfAttention modules of the model built here from the same config, and the
    kernel each mode names is the one torch.profiler sees in an untraced forward of that model.
    """
    transformers = pytest.importorskip("transformers")
    if not torch.__version__.startswith("2.13.0"):  # the header names the release; reasons differ by release
        pytest.skip("the documented samples were printed by torch 2.13.0, the release its commands install")
    transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128).save_pretrained(tmp_path / "tiny-bert")  # fmt: skip
    env = {**ENV, "HF_HUB_OFFLINE": "1"}
    for command, columns in (("qkvtrace trace hf:./tiny-bert --random-init --columns type", "100"),
                             ("qkvtrace trace hf:./tiny-bert --random-init --train", "60")):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "qkvtrace", *command.split()[1:]], capture_output=True,
                              text=True, env={**env, "COLUMNS": columns}, cwd=tmp_path, timeout=300)  # fmt: skip
        shown = command if columns == "100" else f"COLUMNS={columns} {command}"
        assert _printed(proc) == _readme_output(shown)
        train = "--train" in command
        config = transformers.AutoConfig.from_pretrained(tmp_path / "tiny-bert")
        model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").train(train)
        attention = [n for n, m in model.named_modules() if type(m).__name__ == "BertSelfAttention"]
        assert len(attention) == 2 and all(n in proc.stdout for n in attention), attention
        with torch.profiler.profile() as prof, torch.set_grad_enabled(train):
            model(torch.randint(0, 1000, (1, 8)))
        ops = {e.name for e in prof.events()}
        kernel = "MATH" if "aten::_scaled_dot_product_attention_math" in ops else "FLASH_ATTENTION"
        assert kernel == ("MATH" if train else "FLASH_ATTENTION"), ops & {"aten::_scaled_dot_product_attention_math"}
        assert proc.stdout.count(kernel) >= 2


def test_help_names_the_library_targets() -> None:
    """Witness: the target forms and options the test expects in the help."""
    out = qkv("trace", "--help").stdout
    for needle in ("hf:NAME_OR_PATH", "timm:NAME", "torchvision:NAME", "--random-init", "--columns"):
        assert needle in out, needle
