"""`qkvtrace check`: which classic mistakes (docs/tutorial.md#common-mistakes) each check catches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mistakes import MISTAKES, build
from torch import nn

from qkvtrace.analyses.check import CheckReport, run_checks

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}

#: what each check is expected to catch — the table in docs/check.md states the same
CAUGHT_BY_CAUSAL = {"reversed_causal", "off_by_one", "softmax_wrong_dim", "wrong_view"}
CAUGHT_BY_PADDING = {"inverted_padding", "softmax_wrong_dim", "wrong_view"}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_causal_check(mistake: str) -> None:
    """Causal LMs (every mistake applied to a causally masked block).

    Witness: the mistakes built by construction in tests/mistakes.py, and the table CAUGHT_BY_CAUSAL written here.
    """
    model, args = build(mistake)
    report = run_checks(model, args, causal=True, trials=1)
    causal = [f for f in report.findings if f.check == "causal"]
    caught = mistake in CAUGHT_BY_CAUSAL
    # both modes must agree: caught in each, or passed in each
    assert {f.mode: f.passed for f in causal} == {"inference": not caught, "training": not caught}, [
        f.detail for f in causal
    ]


@pytest.mark.parametrize("causal", [True, False], ids=["causal-lm", "encoder"])
@pytest.mark.parametrize("mistake", MISTAKES)
def test_padding_check(mistake: str, causal: bool) -> None:
    """Witness: the mistakes built by construction in tests/mistakes.py, and the table CAUGHT_BY_PADDING."""
    model, args = build(mistake, causal=causal)
    report = run_checks(model, args, padding=True, trials=1)
    padding = [f for f in report.findings if f.check == "padding"]
    caught = mistake in CAUGHT_BY_PADDING
    # both modes must agree: caught in each, or passed in each
    assert {f.mode: f.passed for f in padding} == {"inference": not caught, "training": not caught}, [
        f.detail for f in padding
    ]


def test_leak_pairs_name_positions() -> None:
    """Witness: the off_by_one model's mask, tril(1) by construction: position i also reads i + 1."""
    model, args = build("off_by_one")
    report = run_checks(model, args, causal=True, trials=1, modes=("inference",))
    finding = report.findings[0]
    assert set(finding.leaks) == {(i, i + 1) for i in range(7)}
    assert "position 0 reads position 1" in finding.detail


def test_training_mode_with_dropout_is_reproducible() -> None:
    """Dropout is reseeded per forward: a correct model does not 'leak' in training.

    Witness: the model built here with PyTorch's own square subsequent mask; PyTorch takes no fast path in training.
    """
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.3, batch_first=True)
    x = torch.randn(2, 6, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    model = _Causal(layer, mask)
    report = run_checks(model, (x,), causal=True, trials=1)
    assert report.ok, [f.detail for f in report.findings]
    assert {c["path"] for c in report.calls["training"]} == {"fallback"}


class _Causal(nn.Module):
    def __init__(self, layer: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.mask = layer, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=self.mask, is_causal=True)


def _judged_mask(report: CheckReport, batch: int, length: int) -> torch.Tensor:
    """The (B, T) True = padding mask the padding check judged with, from the positions it reports."""
    assert report.convention is not None
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b, positions in report.convention.padded.items():
        mask[b, positions] = True
    return mask


class _PadsAllOfSequence1(nn.Module):
    """MHA whose key padding mask also blocks every key of sequence 1: all its query rows are fully masked."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.received: list[torch.Tensor] = []

    def blocked(self, key_padding_mask: torch.Tensor) -> torch.Tensor:
        kpm = key_padding_mask.clone()
        kpm[1] = True  # True = padding (nn.MultiheadAttention's convention)
        return kpm

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        self.received.append(key_padding_mask)
        return self.mha(x, x, x, key_padding_mask=self.blocked(key_padding_mask), need_weights=False)[0]


def test_mha_fully_masked_rows_and_nan_are_reported_as_measured() -> None:
    """Whatever MHA returns for fully-masked rows in each mode (NaN or not) is what check reports.

    Witness: the same forward run here untraced in each mode, and the blocked rows counted by hand from the mask.
    """
    torch.manual_seed(0)
    model = _PadsAllOfSequence1()
    x = torch.randn(2, 8, 16)
    report = run_checks(model, (x,), padding=True, trials=1)
    paths = {m: {c["path"] for c in calls} for m, calls in report.calls.items()}
    assert paths == {"inference": {"fast"}, "training": {"fallback"}}
    kpm = _judged_mask(report, x.shape[0], x.shape[1])
    assert any(torch.equal(m, kpm) for m in model.received)
    # key_padding_mask: True = padding (its known convention); the measurement saw the mask remove influence
    assert report.convention is not None and report.convention.true_means == "ignore"
    assert report.convention.source == "known" and report.convention.confirmed is True
    # independent: the same forward, untraced, in each mode; rows whose keys are all blocked, by hand
    heads = model.mha.num_heads  # rows are counted per (batch, head, query), as the kernel sees them
    fully_masked = int(model.blocked(kpm).all(dim=1).sum()) * heads * x.shape[1]
    assert fully_masked == 16
    for mode, train in (("inference", False), ("training", True)):
        model.train(train)
        with torch.set_grad_enabled(train):
            nan = int(torch.isnan(model(x, kpm)).sum())
        nan_findings = [f for f in report.findings if f.check == "nan" and f.mode == mode]
        if nan:
            assert [(f.passed, f.detail) for f in nan_findings] == [
                (False, f"{nan} NaN values in the output (padding check)")
            ]
        else:
            assert nan_findings == []
        [call] = report.calls[mode]
        assert (call["nan_count"], call["fully_masked_rows"]) == (nan, fully_masked), mode
    # seq 0 has real keys in every row: the padding check itself holds in both modes
    assert [f.passed for f in report.findings if f.check == "padding"] == [True, True]


class _CausalWithPadding(nn.Module):
    """Causal attention with a key padding mask and no guard against NaN: with left padding,
    the first query rows of a sequence see only padded keys, and softmax over them is NaN."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.received: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        self.received.append(key_padding_mask)
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)  # (B, T, d) each
        t = ids.shape[1]
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # (B, T, T)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future | key_padding_mask[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def test_nan_in_the_output_fails_the_check() -> None:
    """Witness: the model written here without a NaN guard, run here untraced; fully masked rows counted by hand."""
    torch.manual_seed(0)
    model = _CausalWithPadding()
    ids = torch.randint(0, 50, (2, 8))
    report = run_checks(model, (ids,), padding=True, trials=1)
    kpm = _judged_mask(report, 2, 8)
    assert any(torch.equal(m, kpm) for m in model.received)
    # by hand: a query row i is fully masked when every key j <= i is padding
    allowed = ~kpm[:, None, :] & torch.ones(8, 8, dtype=torch.bool).tril()
    rows = int((~allowed.any(dim=-1)).sum())
    assert rows > 0, "the check's padding mask should leave some causal row without a real key"
    with torch.no_grad():
        nan = int(torch.isnan(model.eval()(ids, kpm)).sum())
    assert nan == rows * 16
    assert not report.ok
    nan_findings = [(f.mode, f.passed, f.detail) for f in report.findings if f.check == "nan"]
    detail = f"{nan} NaN values in the output (padding check)"
    assert nan_findings == [("inference", False, detail), ("training", False, detail)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, env=ENV,
                          cwd=HERE.parent, timeout=300)  # fmt: skip


def test_cli_exit_codes(tmp_path: Path) -> None:
    """Witness: build_reversed of tests/mistakes.py (its mask reads the future, by construction), the file the
    command wrote, and the missing --causal written here."""
    bad = _cli("check", "tests/mistakes.py:build_reversed", "--causal", "--json", str(tmp_path / "r.json"))
    assert bad.returncode == 1, bad.stderr
    assert "FAIL" in bad.stdout and "reads position" in bad.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] is False and data["schema"] == "qkvtrace.check/1"
    good = _cli("check", "demo:tiny-lm", "--causal", "--mode", "inference")
    assert good.returncode == 0, good.stdout + good.stderr
    usage = _cli("check", "demo:tiny-lm")
    assert usage.returncode == 2 and "--causal" in usage.stderr


def test_cli_refuses_over_budget_before_running() -> None:
    """Witness: the budget written here: 64 x 128 tokens is over 1000."""
    proc = _cli("trace", "demo:tiny-lm", "--input-shape", "64,128", "--max-tokens", "1000")
    assert proc.returncode == 2
    assert "max_tokens=1000" in proc.stderr and "Traceback" not in proc.stderr


BERT_FACTORY = '''
import torch
from torch import nn
from transformers import BertConfig, BertModel


class Bert(nn.Module):
    """A tiny Hugging Face BERT on PyTorch's SDPA; its forward takes the HF-style attention_mask (1 = attend)."""

    def __init__(self, invert: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa")
        self.bert = BertModel(config)
        self.invert = invert

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is not None and self.invert:  # the mistake: the padding mask turned over
            attention_mask = 1 - attention_mask
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def correct():
    return Bert(), (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)),)


def inverted():
    return Bert(invert=True), (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)),)
'''


@pytest.fixture(scope="module")
def bert_factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("bert")
    (folder / "bert_factory.py").write_text(BERT_FACTORY)
    return folder / "bert_factory.py"


def test_hf_attention_mask_convention_passes_a_correct_model(bert_factory: Path, tmp_path: Path) -> None:
    """attention_mask is 1 = attend: check knows it, says so, and confirms it on the model before judging.

    Witness: the correct BERT written here, using Hugging Face's documented 1 = attend, and the file the command wrote.
    """
    out = tmp_path / "c.json"
    proc = _cli("check", f"{bert_factory}:correct", "--padding", "--mask-arg", "attention_mask", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    conv = data["padding_convention"]
    assert (conv["mask_arg"], conv["true_means"], conv["source"], conv["confirmed"]) == (
        "attention_mask", "attend", "known", True)  # fmt: skip
    assert conv["influenced"] > 0 and conv["still_influenced"] == 0  # measured: the mask removed the influence
    assert "True means attend" in proc.stdout and "confirmed" in proc.stdout
    assert all(f["passed"] for f in data["findings"])
    assert {c["path"] for calls in data["calls"].values() for c in calls} == {"sdpa"}
    valid = _cli("validate", str(out))
    assert valid.returncode == 0, valid.stdout + valid.stderr


def test_hf_inverted_padding_mask_fails_and_says_why(bert_factory: Path, tmp_path: Path) -> None:
    """Witness: the BERT written here that turns its mask over, by construction, and the file the command wrote."""
    out = tmp_path / "c.json"
    proc = _cli("check", f"{bert_factory}:inverted", "--padding", "--mask-arg", "attention_mask", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: padding (inference), padding (training)" in " ".join(proc.stdout.split())
    conv = json.loads(out.read_text())["padding_convention"]
    assert conv["confirmed"] is False and conv["still_influenced"] == conv["influenced"] > 0
    assert conv["still_influenced_opposite"] == 0  # the other convention would have removed it
    assert "--mask-true-means ignore" in conv["evidence"] and "inverts its mask" in conv["evidence"]


def test_wrong_convention_given_for_a_correct_model_is_not_confirmed(bert_factory: Path) -> None:
    """Telling check the opposite of the truth makes the padding fail — and the measurement says which is right.

    Witness: the correct BERT written here (Hugging Face's 1 = attend), told the opposite here.
    """
    sys.path.insert(0, str(bert_factory.parent))
    try:
        import bert_factory as factory  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    model, args = factory.correct()
    report = run_checks(model, args, padding=True, mask_arg="attention_mask", mask_true_means="ignore", trials=1)
    assert not report.ok
    assert report.convention is not None and report.convention.source == "given"
    assert report.convention.confirmed is False and "--mask-true-means attend" in report.convention.evidence


def test_default_conventions_by_argument_name() -> None:
    """Witness: PyTorch's documented key_padding_mask (True = ignore) and Hugging Face's attention_mask (1 = attend)."""
    from qkvtrace.analyses.check import default_convention

    assert default_convention("key_padding_mask") == ("ignore", "known")
    assert default_convention("src_key_padding_mask") == ("ignore", "known")
    assert default_convention("attention_mask") == ("attend", "known")
    assert default_convention("pad_mask") == ("ignore", "assumed")


def test_mask_ignored_by_the_model_is_not_confirmed() -> None:
    """A model that never passes its mask on: padding leaks, and neither convention removes it.

    Witness: the model written here that drops its mask, by construction.
    """

    class Ignores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    report = run_checks(Ignores(), (torch.randn(2, 8, 16),), padding=True, trials=1, modes=("inference",))
    assert not report.ok and report.convention is not None
    assert report.convention.confirmed is False
    assert report.convention.still_influenced_opposite == report.convention.influenced
    assert "is key_padding_mask passed on to the attention?" in report.convention.evidence


def test_cli_mask_true_means_choices() -> None:
    """Witness: the invalid choice written here."""
    bad = _cli("check", "demo:tiny-lm", "--padding", "--mask-true-means", "padding")
    assert bad.returncode == 2 and "--mask-true-means" in bad.stderr and "Traceback" not in bad.stderr


def test_check_a_library_model_by_name(tmp_path: Path) -> None:
    """hf:FOLDER --random-init: a BERT from its config alone, checked with its own mask convention.

    Witness: the config the test wrote, Hugging Face's 1 = attend, and BertModel's module names.
    """
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            intermediate_size=64).save_pretrained(tmp_path / "bert")  # fmt: skip
    out = tmp_path / "c.json"
    proc = _cli("check", f"hf:{tmp_path / 'bert'}", "--random-init", "--padding", "--mask-arg", "attention_mask",
                "--mode", "inference", "--input-shape", "2,8", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["padding_convention"]["true_means"] == "attend" and data["padding_convention"]["confirmed"] is True
    assert [c["module"] for c in data["calls"]["inference"]] == ["encoder.layer.0.attention.self"]
