"""``qkvtrace walkthrough``: the tutorial's one-sentence case under a trace, every number checked against PyTorch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import qkvtrace
from qkvtrace.analyses.walkthrough import LABELS, TEXTS, SentimentAttention, run_walkthrough
from qkvtrace.cli.main import main
from qkvtrace.records.validation import load_json

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "qkvtrace", "walkthrough", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def full() -> dict[str, Any]:
    return run_walkthrough()  # the tutorial's run: "我 喜欢 机器人", 100 epochs, lr 0.3, seed 31


def _plain_run() -> tuple[dict[str, int], torch.Tensor, torch.Tensor, torch.Tensor, SentimentAttention, Any]:
    """The walkthrough's set-up written out in plain PyTorch: the vocabulary of the eight sentences in order of
    first appearance, the first sentence's ids, the training batch, the model built after manual_seed(31) and
    SGD at lr 0.3."""
    vocab: dict[str, int] = {"<unk>": 0}
    for text in TEXTS:
        for word in text.split():
            vocab.setdefault(word, len(vocab))
    tokens = torch.tensor([[vocab[w] for w in TEXTS[0].split()]])
    train_ids = torch.tensor([[vocab[w] for w in t.split()] for t in TEXTS])
    torch.manual_seed(31)
    model = SentimentAttention(len(vocab)).train()
    return vocab, tokens, train_ids, torch.tensor(LABELS), model, torch.optim.SGD(model.parameters(), lr=0.3)


def _replay(epochs: int) -> dict[str, Any]:
    """The walkthrough's run replayed in plain PyTorch, no trace: the model built from RNG state 31, SGD lr 0.3,
    the sentence's first forward and step, ``epochs`` epochs on the eight sentences, the sentence after."""
    vocab, tokens, train_ids, train_labels, model, optimizer = _plain_run()
    w = model.attention.in_proj_weight
    rows = {"q": slice(0, 8), "k": slice(8, 16), "v": slice(16, 24)}  # PyTorch's documented packing

    def by_hand() -> torch.Tensor:  # softmax(QKᵀ/√8) from X = E[tokens] + P[:T] and the packed rows
        x = (model.embedding(tokens) + model.position[:, : tokens.shape[1]])[0]
        q, k = x @ w[rows["q"]].T, x @ w[rows["k"]].T
        return (q @ k.T / math.sqrt(8)).softmax(dim=-1).detach()

    hand = by_hand()
    logits, weights = model(tokens, need_weights=True)
    assert weights is not None
    label = LABELS[0]
    loss = F.cross_entropy(logits, torch.tensor([label]))
    before = w.detach().clone()
    optimizer.zero_grad()
    loss.backward()
    assert w.grad is not None
    grad = w.grad.detach().clone()
    unchanged = torch.equal(before, w.detach())
    optimizer.step()
    delta = (w.detach() - before).clone()
    accuracy = 0.0
    for _ in range(epochs):
        optimizer.zero_grad()
        F.cross_entropy(model(train_ids)[0], train_labels).backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = float((model(train_ids)[0].argmax(dim=1) == train_labels).float().mean())
    model.eval()
    with torch.no_grad():
        hand_after = by_hand()
        _, after = model(tokens, need_weights=True)
    assert after is not None
    return {"vocab": vocab, "model": model, "tokens": tokens, "hand": hand, "weights": weights[0].detach(),
            "logits": logits[0].detach(), "loss": float(loss.detach()), "label": label,
            "minus_log_p": float(-torch.log_softmax(logits[0].detach(), dim=-1)[label]), "w_before": before,
            "grad": grad, "unchanged": unchanged, "delta": delta, "rows": rows, "hand_after": hand_after,
            "weights_after": after[0], "train_accuracy": accuracy}  # fmt: skip


@pytest.fixture(scope="module")
def replay() -> dict[str, Any]:
    return _replay(100)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def test_every_check_holds(full: dict[str, Any], replay: dict[str, Any]) -> None:
    """The module's own checks each agree with the same difference measured here.

    Witness: the run replayed in plain PyTorch (``_replay``): softmax(QKᵀ/√8) from the packed rows against
    PyTorch's weights, cross-entropy and −log softmax, and the tracer's map against PyTorch's weights.
    """
    assert full["problems"] == []
    c = full["checks"]
    hand_err = _max_abs(replay["hand"], replay["weights"])  # by hand vs PyTorch, measured here
    assert hand_err < 1e-6 and c["attention_vs_pytorch"] == pytest.approx(hand_err, abs=1e-7)
    assert c["logits_vs_pytorch"] < 1e-6
    assert torch.allclose(torch.tensor(full["logits"]), replay["logits"], rtol=0, atol=6e-5)  # PyTorch's logits
    # the tracer's own attention map (trace(model, attention_maps=True)) of the same calls, before and after
    assert c["attention_vs_tracer_map"] is not None and c["attention_vs_tracer_map"] < 1e-6
    assert full["after"]["attention_after_vs_tracer_map"] is not None
    assert full["after"]["attention_after_vs_tracer_map"] < 1e-6
    model = replay["model"]
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        _, weights = model(replay["tokens"], need_weights=True)
    assert weights is not None
    tracer_map = t.calls[-1].attention_map[0, 0]
    assert _max_abs(tracer_map, weights[0]) < 1e-6  # the map against PyTorch's own weights
    after_err = _max_abs(replay["hand_after"], tracer_map)
    assert full["after"]["attention_after_vs_tracer_map"] == pytest.approx(after_err, abs=1e-7)
    assert c["loss"] == pytest.approx(replay["loss"], abs=1e-6)
    assert c["minus_log_p"] == pytest.approx(replay["minus_log_p"], abs=1e-6)
    assert math.isclose(replay["loss"], replay["minus_log_p"], abs_tol=1e-6)
    p = full["probabilities"][full["label"]["index"]]
    assert math.isclose(c["loss"], -math.log(p), abs_tol=1e-3)  # p is stored at 4 decimals


def test_the_numbers_are_pytorchs_replayed_here(full: dict[str, Any]) -> None:
    """Witness: the same run replayed here in plain PyTorch, no trace: the model built after the same
    manual_seed, PyTorch's own attention weights, logits, cross-entropy, ``.grad`` of the packed weight's
    row blocks [0,8), [8,16), [16,24) (PyTorch's documented packing), the SGD step and 100 epochs."""
    vocab, tokens, train_ids, train_labels, model, optimizer = _plain_run()
    assert full["vocab"] == vocab
    w = model.attention.in_proj_weight
    rows = {"q": slice(0, 8), "k": slice(8, 16), "v": slice(16, 24)}
    for part, r in rows.items():
        assert full["packed"]["weight_norms"][part] == pytest.approx(float(w[r].detach().norm()), rel=1e-6), part

    logits, weights = model(tokens, need_weights=True)
    assert weights is not None
    assert torch.allclose(torch.tensor(full["matrices"]["attention"]), weights[0].detach(), rtol=0, atol=6e-5)
    assert torch.allclose(torch.tensor(full["logits"]), logits[0].detach(), rtol=0, atol=6e-5)
    loss = F.cross_entropy(logits, torch.tensor([full["label"]["index"]]))
    assert full["checks"]["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    optimizer.zero_grad()
    loss.backward()
    assert w.grad is not None
    for part, r in rows.items():
        assert full["gradients"]["grad_norms"][part] == pytest.approx(float(w.grad[r].norm()), rel=1e-5), part
    optimizer.step()

    curve = {r["epoch"]: r for r in full["curve"]}
    for epoch in range(1, 101):
        optimizer.zero_grad()
        batch_loss = F.cross_entropy(model(train_ids)[0], train_labels)
        batch_loss.backward()
        optimizer.step()
        if epoch in curve:
            with torch.no_grad():
                accuracy = float((model(train_ids)[0].argmax(dim=1) == train_labels).float().mean())
            assert curve[epoch]["loss"] == pytest.approx(float(batch_loss), abs=6e-5), epoch
            assert curve[epoch]["train_accuracy"] == accuracy, epoch
    model.eval()
    with torch.no_grad():
        _, after = model(tokens, need_weights=True)
    assert after is not None
    assert torch.allclose(torch.tensor(full["after"]["attention_after"]), after[0], rtol=0, atol=6e-5)


def test_vocabulary_tokens_and_the_packed_layout_from_the_tracer(full: dict[str, Any], replay: dict[str, Any]) -> None:
    """Witness: the vocabulary built here from TEXTS, PyTorch's packing of in_proj_weight (rows 0-8, 8-16,
    16-24) and the replayed model's weight rows; fallback because PyTorch's fast path needs eval mode."""
    assert full["tokens"] == ["我", "喜欢", "机器人"]
    assert full["token_ids"] == [replay["vocab"][w] for w in full["tokens"]]
    assert full["vocab"]["<unk>"] == 0 and len(full["vocab"]) == 17
    packed = full["packed"]
    assert packed["param"] == "in_proj_weight" and packed["shape"] == [24, 8]
    assert packed["rows"] == {"q": [0, 8], "k": [8, 16], "v": [16, 24]}
    # the matrices are the rows the tracer named: their norms are the tracer's weight norms
    for part in "qkv":
        norm = math.sqrt(sum(v * v for row in full["matrices"][f"w_{part}"] for v in row))
        assert math.isclose(norm, packed["weight_norms"][part], rel_tol=1e-3)
        rows = replay["w_before"][replay["rows"][part]]  # PyTorch's rows of the same model, before the step
        assert torch.allclose(torch.tensor(full["matrices"][f"w_{part}"]), rows, rtol=0, atol=6e-5), part
        assert packed["weight_norms"][part] == pytest.approx(float(rows.norm()), rel=1e-6), part
    assert full["traced_call"]["path"] == "fallback" and full["traced_call"]["why_not_fast_path"]


def test_matrices_fit_together(full: dict[str, Any]) -> None:
    """Witness: row sums and QKᵀ/√8 computed here from the reported Q and K."""
    m, t = full["matrices"], len(full["tokens"])
    assert len(m["x"]) == t and all(len(r) == 8 for r in m["x"])
    for row in m["attention"]:
        assert math.isclose(sum(row), 1.0, abs_tol=1e-3)
    # scores = Q K^T / sqrt(8), from the rounded Q and K
    q, k = m["q"], m["k"]
    for i in range(t):
        for j in range(t):
            s = sum(a * b for a, b in zip(q[i], k[j], strict=True)) / math.sqrt(8)
            assert math.isclose(s, m["scores"][i][j], abs_tol=2e-3)


def test_gradients_are_the_tracers_and_the_step_is_minus_lr_grad(full: dict[str, Any], replay: dict[str, Any]) -> None:
    """Witness: the replayed run's ``.grad`` of each packed row block, its weights around backward(), and the
    SGD update Δw measured here against −0.3·grad."""
    g = full["gradients"]
    assert g["backward_index"] == 0
    rows, grad = replay["rows"], replay["grad"]
    for part in "qkv":
        norm = float(grad[rows[part]].norm())  # PyTorch's .grad of this slice
        assert math.isclose(g["grad_norms"][part], norm, rel_tol=1e-5), part
        assert math.isclose(g["grad_norms_by_hand"][part], norm, rel_tol=1e-5), part
    assert len({round(float(grad[rows[p]].norm()), 6) for p in "qkv"}) == 3  # three matrices, not one shared one
    assert replay["unchanged"] is True and g["weights_unchanged_by_backward"] is True
    step = full["step"]
    assert step["lr"] == 0.3
    for part in "qkv":
        assert _max_abs(replay["delta"][rows[part]], -0.3 * grad[rows[part]]) < 1e-6, part  # measured here
    assert step["holds"] and max(step["max_abs_delta_vs_minus_lr_grad"].values()) < 1e-6
    # the update matrix shown is lr times PyTorch's gradient of the Q rows
    assert torch.allclose(torch.tensor(step["delta_w_q"]), -0.3 * grad[rows["q"]], rtol=0, atol=6e-5)
    delta = math.sqrt(sum(v * v for row in step["delta_w_q"] for v in row))
    assert math.isclose(delta, 0.3 * float(grad[rows["q"]].norm()), rel_tol=1e-2)


def test_training_curve_and_honesty(full: dict[str, Any], replay: dict[str, Any]) -> None:
    """Witness: the checkpoint epochs written here, and the replayed run: its attention after training by hand
    against PyTorch's weights, and its training accuracy."""
    curve = full["curve"]
    assert [r["epoch"] for r in curve] == [1, 5, 10, 20, 50, 100]
    assert [r["backward_index"] for r in curve] == [1, 5, 10, 20, 50, 100]  # the tracer's record of that epoch
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert full["after"]["attention_before"] != full["after"]["attention_after"]
    after_err = _max_abs(replay["hand_after"], replay["weights_after"])  # by hand vs PyTorch, measured here
    assert after_err < 1e-6 and full["after"]["attention_after_vs_pytorch"] == pytest.approx(after_err, abs=1e-7)
    assert torch.allclose(torch.tensor(full["after"]["attention_after"]), replay["weights_after"], rtol=0, atol=6e-5)
    assert full["train_accuracy"] == replay["train_accuracy"]
    assert full["memorised"] == (replay["train_accuracy"] == 1.0)
    if full["memorised"]:
        assert "memorisation" in full["honesty"] and "no held-out data" in full["honesty"]


def test_short_training_does_not_claim_memorisation() -> None:
    """Witness: one epoch replayed in plain PyTorch, its training accuracy measured here."""
    data = run_walkthrough(epochs=1)
    assert [r["epoch"] for r in data["curve"]] == [1]
    accuracy = _replay(1)["train_accuracy"]
    assert accuracy < 1.0 and data["train_accuracy"] == accuracy and not data["memorised"]
    assert "memorisation" not in data["honesty"]


def test_same_seed_same_numbers() -> None:
    """Witness: a second call with the same arguments, and a call with another starting number."""
    assert run_walkthrough(epochs=3) == run_walkthrough(epochs=3)
    assert run_walkthrough(epochs=3, seed=1)["matrices"] != run_walkthrough(epochs=3)["matrices"]


def test_cli_prints_every_step_and_writes_valid_json(tmp_path: Path) -> None:
    """Witness: the file the command wrote, read against its schema; the sentence's label in TEXTS/LABELS."""
    done = _cli("--text", TEXTS[4], "--epochs", "20", "--json", tmp_path / "w.json")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for needle in ("vocabulary and token ids", "X = embedding + position", "in_proj_weight [24, 8] = [3D, D]",
                   "W_Q [8, 8]", "scores", "attention", "context", "−log p(negative)", "|dL/dW_Q|",
                   "ΔW = −lr·grad holds", "training on the 8 sentences", "before training", "after training",
                   "故障"):  # fmt: skip
        assert needle in out, needle
    data = load_json(tmp_path / "w.json", "qkvtrace.walkthrough/1")
    assert data["label"] == {"index": 0, "name": "negative", "source": "training set"}
    assert [r["epoch"] for r in data["curve"]] == [1, 5, 10, 20]
    assert "progress" not in out and "epoch 10/" not in out  # progress goes to stderr, never stdout


def test_cli_sentence_outside_the_training_set(tmp_path: Path) -> None:
    """Witness: the sentence written here, with one word (爱) not in TEXTS, and the file the command wrote."""
    done = _cli("--text", "我 爱 机器人", "--epochs", "2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--label" in done.stderr and "Traceback" not in done.stderr
    done = _cli("--text", "我 爱 机器人", "--label", "positive", "--epochs", "2", "--json", tmp_path / "u.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "u.json").read_text(encoding="utf-8"))
    assert data["unknown_words"] == ["爱"] and data["token_ids"][1] == 0
    assert data["label"]["source"] == "given"


@pytest.mark.parametrize(
    ("args", "words"),
    [(("--epochs", "0"), "--epochs"), (("--text", "  "), "--text"), (("--text", " ".join(["我"] * 17)), "--text"),
     (("--lr", "-1"), "--lr"), (("--json", "/nonexistent/w.json"), "--json")],
)  # fmt: skip
def test_cli_bad_input_is_one_line_and_exit_2(
    args: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Witness: the bad arguments written here and the option each must name."""
    code = main(["walkthrough", *args])  # the command line in this process: no torch import per case
    out, err = capsys.readouterr()
    assert code == 2, out
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_a_failed_check_is_a_problem() -> None:
    """What makes the command exit 1: each check, tampered with, is reported in words.

    Witness: the three values the test tampered with.
    """
    from qkvtrace.analyses.walkthrough import problems

    data = run_walkthrough(epochs=1)
    assert problems(data) == []
    tampered = json.loads(json.dumps(data))
    tampered["checks"]["attention_vs_pytorch"] = 1e-3
    tampered["gradients"]["grad_norms"]["k"] *= 1.01
    tampered["step"]["holds"] = False
    found = problems(tampered)
    assert len(found) == 3
    assert any("PyTorch's" in p for p in found) and any("K slice" in p for p in found)
    assert any("-lr * grad" in p for p in found)
