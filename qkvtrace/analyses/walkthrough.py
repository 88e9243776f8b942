"""One sentence through Q, K and V, step by step (docs/tutorial.md#one-sentence-end-to-end), recorded by the tracer.

The tutorial trains a single-head attention classifier on eight short Chinese
sentences (positive / negative) and prints every matrix one sentence goes
through, its gradients, one optimizer step and the training curve. Here the
same model holds its projections the way PyTorch does, in one
``nn.MultiheadAttention(num_heads=1)`` with a packed ``[3D, D]``
``in_proj_weight``, so that :func:`qkvtrace.trace` observes it: the tracer's
call records say where the Q, K and V rows of the packed weight are (and
which path and backend ran), and its gradient records give the per-slice
gradient norms of every backward pass. The matrices (X, Q, K, V, scores,
attention, context) are computed from those rows and checked against what
PyTorch itself returned (its attention weights and logits), so a wrong slice
would show up as a disagreement rather than as a plausible-looking matrix.

:func:`run_walkthrough` returns the ``qkvtrace.walkthrough/1`` object;
nothing here prints (the CLI renders it with rich).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.base.errors import InputError

__all__ = [
    "CHECKPOINTS",
    "LABELS",
    "TEXTS",
    "WALKTHROUGH_SCHEMA",
    "SentimentAttention",
    "build_vocab",
    "run_walkthrough",
]

WALKTHROUGH_SCHEMA = "qkvtrace.walkthrough/1"

#: The tutorial's eight training sentences (space-separated words) and their labels.
TEXTS = (
    "我 喜欢 机器人",
    "我 喜欢 编程",
    "学习 人工 智能",
    "模型 很 有趣",
    "我 讨厌 故障",
    "我 讨厌 延迟",
    "系统 很 糟糕",
    "模型 很 难用",
)
LABELS = (1, 1, 1, 1, 0, 0, 0, 0)
LABEL_NAMES = ("negative", "positive")
#: Epochs at which the training curve is reported (and the last epoch).
CHECKPOINTS = (1, 5, 10, 20, 50, 100)

D_MODEL = 8
MAX_LEN = 16
MAX_EPOCHS = 10_000
DECIMALS = 4
UNK = "<unk>"


def build_vocab(texts: tuple[str, ...] = TEXTS) -> dict[str, int]:
    """Word -> id in order of first appearance, ``<unk>`` first (id 0)."""
    vocab = {UNK: 0}
    for text in texts:
        for word in text.split():
            vocab.setdefault(word, len(vocab))
    return vocab


class SentimentAttention(nn.Module):
    """The tutorial's classifier: embedding + position, one attention head, mean pool, linear head.

    The tutorial (docs/tutorial.md#one-sentence-end-to-end) writes three ``nn.Linear`` projections
    without bias; here they
    are PyTorch's packed ``in_proj_weight`` (``bias=False``), which adds
    MultiheadAttention's output projection ``W_O`` after the context.
    """

    def __init__(self, vocab_size: int, d_model: int = D_MODEL, max_len: int = MAX_LEN) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.randn(1, max_len, d_model) * 0.02)
        self.attention = nn.MultiheadAttention(d_model, 1, bias=False, batch_first=True)
        self.head = nn.Linear(d_model, 2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``X = E[tokens] + P[:T]``: ``[B, T]`` -> ``[B, T, D]``."""
        return self.embedding(tokens) + self.position[:, : tokens.shape[1]]

    def forward(self, tokens: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, 2]`` and, with ``need_weights``, PyTorch's attention weights ``[B, T, T]``."""
        x = self.embed(tokens)
        context, weights = self.attention(x, x, x, need_weights=need_weights)  # [B,T,D], [B,T,T]
        return self.head(context.mean(dim=1)), weights


def _m(t: torch.Tensor) -> list[Any]:
    """A tensor as nested lists at fixed precision."""
    return [[round(float(v), DECIMALS) for v in row] for row in t.detach().double().reshape(-1, t.shape[-1])]


def _v(t: torch.Tensor) -> list[float]:
    return [round(float(v), DECIMALS) for v in t.detach().double().reshape(-1)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(f"{float((a.detach().double() - b.detach().double()).abs().max()):.2g}")


def _tokenize(text: str, vocab: dict[str, int]) -> tuple[list[str], list[int], list[str]]:
    words = text.split()
    if not words:
        raise InputError("--text is empty; give words separated by spaces, e.g. --text '我 喜欢 机器人'")
    if len(words) > MAX_LEN:
        raise InputError(f"--text has {len(words)} words; the model's positions stop at {MAX_LEN}")
    unknown = sorted({w for w in words if w not in vocab})
    return words, [vocab.get(w, 0) for w in words], unknown


def _label_of(text: str, label: str | None) -> tuple[int, str]:
    normalized = " ".join(text.split())
    if label is not None:
        if label not in LABEL_NAMES:
            raise InputError(f"--label {label!r} is not one of {', '.join(LABEL_NAMES)}")
        return LABEL_NAMES.index(label), "given"
    if normalized in TEXTS:
        return LABELS[TEXTS.index(normalized)], "training set"
    raise InputError(
        f"--text {text!r} is not one of the 8 training sentences, so it has no label; "
        "pass --label positive or --label negative"
    )


def _checkpoints(epochs: int) -> list[int]:
    return sorted({e for e in CHECKPOINTS if e <= epochs} | {epochs})


def _by_hand(model: SentimentAttention, tokens: torch.Tensor, rows: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Every matrix of one forward, computed from the packed weight's Q/K/V rows."""
    w = model.attention.in_proj_weight
    x = model.embed(tokens)[0]  # [T, D]
    # copies: the slices are views of the parameter, which the optimizer updates in place
    w_q, w_k, w_v = (w[slice(*rows[p])].detach().clone() for p in "qkv")  # each [D, D]
    q, k, v = x @ w_q.T, x @ w_k.T, x @ w_v.T  # [T, D]
    scores = q @ k.T / math.sqrt(q.shape[-1])  # [T, T]
    attention = scores.softmax(dim=-1)
    context = attention @ v  # [T, D]
    out = context @ model.attention.out_proj.weight.T  # [T, D]; bias=False
    logits = model.head(out.mean(dim=0))
    return {"x": x, "w_q": w_q, "w_k": w_k, "w_v": w_v, "q": q, "k": k, "v": v, "scores": scores,
            "attention": attention, "context": context, "out": out, "logits": logits}  # fmt: skip


def _rows_of(call: Any) -> dict[str, tuple[int, int]]:
    qkv = call.qkv
    if qkv.layout != "packed":
        raise RuntimeError(f"the tracer saw layout {qkv.layout!r}, expected a packed in_proj_weight")
    found = {p: getattr(qkv, p).rows for p in "qkv"}
    if any(r is None or len(r) != 1 for r in found.values()):
        raise RuntimeError(f"the tracer saw Q/K/V rows {found}, expected one range each")
    return {p: (r[0][0], r[0][1]) for p, r in found.items()}


def _map_err(call: Any, attention: torch.Tensor) -> float | None:
    """Max |difference| to the attention map the tracer recomputed for ``call`` (``None`` without one)."""
    weights = getattr(call, "attention_map", None)  # [B, H, Tq, Tk] for the batch items and heads it kept
    if weights is None:
        return None
    return _err(attention, weights[0, 0])


def _call_view(call: Any) -> dict[str, Any]:
    return {
        "path": call.path,
        "why_not_fast_path": call.why_not_fast_path,
        "sdpa_backend": call.sdpa_backend,
        "training": bool(call.inputs.get("training")),
        "need_weights": bool(call.inputs.get("need_weights")),
    }


def _grad_view(record: Any) -> dict[str, float | None]:
    return {p: getattr(record, p).grad_norm for p in "qkv"}


def run_walkthrough(
    text: str = TEXTS[0],
    epochs: int = 100,
    *,
    label: str | None = None,
    lr: float = 0.3,
    seed: int = 31,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the tutorial's one-sentence case on ``text`` under a trace and return the ``qkvtrace.walkthrough/1`` object.

    ``label``: ``"positive"``/``"negative"``, needed only for a sentence
    outside the training set. ``progress(epoch, epochs)`` is called per epoch.
    """
    from qkvtrace.tracer import trace

    if not 1 <= epochs <= MAX_EPOCHS:
        raise InputError(f"--epochs {epochs}: give a number from 1 to {MAX_EPOCHS}")
    if not (lr > 0 and math.isfinite(lr)):
        raise InputError(f"--lr {lr}: give a positive learning rate")
    vocab = build_vocab()
    words, ids, unknown = _tokenize(text, vocab)
    target, label_source = _label_of(text, label)
    train_ids = torch.tensor([[vocab[w] for w in t.split()] for t in TEXTS])  # [8, 3]
    train_labels = torch.tensor(LABELS)
    tokens = torch.tensor([ids])  # [1, T]
    y = torch.tensor([target])

    torch.manual_seed(seed)
    model = SentimentAttention(len(vocab))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    w = model.attention.in_proj_weight

    with trace(model, attention_maps=True) as t:
        # -- one forward of the sentence, every matrix ---------------------------------------------
        model.train()
        logits, torch_weights = model(tokens, need_weights=True)
        first_call = t.calls[0]
        rows = _rows_of(first_call)
        hand = _by_hand(model, tokens, rows)
        assert torch_weights is not None
        probabilities = logits.softmax(dim=-1)[0]
        loss = F.cross_entropy(logits, y)
        minus_log_p = -torch.log(probabilities[target])
        before = {p: w[slice(*rows[p])].detach().clone() for p in "qkv"}
        attention_before = hand["attention"].detach().clone()

        # -- one backward: the tracer's per-slice gradient record -------------------------------------
        optimizer.zero_grad()
        loss.backward()
        assert w.grad is not None
        grads = {p: w.grad[slice(*rows[p])].detach().clone() for p in "qkv"}
        unchanged = all(torch.equal(before[p], w[slice(*rows[p])]) for p in "qkv")
        optimizer.step()
        step_errors = {p: _err(w[slice(*rows[p])] - before[p], -lr * grads[p]) for p in "qkv"}
        delta_q = (w[slice(*rows["q"])] - before["q"]).detach()
        first_record = t.gradients[0]

        # -- training on the eight sentences --------------------------------------------------------------
        curve: list[dict[str, Any]] = []
        marks = set(_checkpoints(epochs))
        for epoch in range(1, epochs + 1):
            optimizer.zero_grad()
            batch_logits, _ = model(train_ids)
            batch_loss = F.cross_entropy(batch_logits, train_labels)
            batch_loss.backward()
            optimizer.step()
            if epoch in marks:
                with torch.no_grad():
                    predicted = model(train_ids)[0].argmax(dim=1)
                record = t.gradients[-1]
                curve.append({
                    "epoch": epoch,
                    "loss": round(float(batch_loss.detach()), DECIMALS),
                    "train_accuracy": float((predicted == train_labels).float().mean()),
                    "grad_norms": _grad_view(record),
                    "backward_index": record.backward_index,
                })  # fmt: skip
            if progress is not None:
                progress(epoch, epochs)

        # -- the same sentence after training ------------------------------------------------------------
        model.eval()
        with torch.no_grad():
            final_logits, final_weights = model(tokens, need_weights=True)
            after = _by_hand(model, tokens, rows)
        last_call = t.calls[-1]
    assert final_weights is not None

    final_accuracy = curve[-1]["train_accuracy"]
    memorised = final_accuracy == 1.0
    honesty = (
        f"Training accuracy {final_accuracy:.0%} on the 8 training sentences. "
        + (
            "That is memorisation, not understanding: the model has fitted the same 8 sentences it is scored on, "
            "there is no held-out data, and it says nothing about any other sentence."
            if memorised
            else "Even so, this accuracy is measured on the training sentences only, with no held-out data."
        )
        + " The attention map changed with training, but the embedding, positions and head changed too, "
        "so the fall in loss cannot be credited to attention alone."
    )
    data = {
        "schema": WALKTHROUGH_SCHEMA,
        "torch_version": str(torch.__version__),
        "settings": {
            "text": " ".join(words),
            "epochs": epochs,
            "lr": lr,
            "seed": seed,
            "d_model": D_MODEL,
            "optimizer": "SGD",
        },
        "vocab": vocab,
        "tokens": words,
        "token_ids": ids,
        "unknown_words": unknown,
        "label": {"index": target, "name": LABEL_NAMES[target], "source": label_source},
        "training_set": [{"text": s, "label": LABEL_NAMES[lab]} for s, lab in zip(TEXTS, LABELS, strict=True)],
        "traced_call": {**_call_view(first_call), "module": first_call.module, "module_type": first_call.module_type},
        "packed": {
            "param": first_call.qkv.q.param if first_call.qkv.q is not None else None,
            "shape": list(w.shape),
            "rows": {p: list(rows[p]) for p in "qkv"},
            "weight_norms": {p: getattr(first_call.qkv, p).weight_norm for p in "qkv"},
        },
        "matrices": {
            name: _m(hand[name]) for name in ("x", "w_q", "w_k", "w_v", "q", "k", "v", "scores", "attention", "context")
        },
        "logits": _v(logits[0]),
        "probabilities": _v(probabilities),
        "checks": {
            "attention_vs_pytorch": _err(hand["attention"], torch_weights[0]),
            "attention_vs_tracer_map": _map_err(first_call, hand["attention"]),
            "logits_vs_pytorch": _err(hand["logits"], logits[0]),
            "rows_sum_to_one": _err(hand["attention"].sum(-1), torch.ones(len(words))),
            "loss": round(float(loss.detach()), 6),
            "minus_log_p": round(float(minus_log_p.detach()), 6),
            "loss_vs_minus_log_p": _err(loss, minus_log_p),
        },
        "gradients": {
            "backward_index": first_record.backward_index,
            "grad_norms": _grad_view(first_record),
            "grad_norms_by_hand": {p: round(float(grads[p].norm()), 6) for p in "qkv"},
            "weights_unchanged_by_backward": unchanged,
        },
        "step": {
            "lr": lr,
            "delta_w_q": _m(delta_q),
            "max_abs_delta_vs_minus_lr_grad": step_errors,
            "holds": all(e <= 1e-6 for e in step_errors.values()),
        },
        "curve": curve,
        "after": {
            "traced_call": _call_view(last_call),
            "attention_before": _m(attention_before),
            "attention_after": _m(after["attention"]),
            "attention_after_vs_pytorch": _err(after["attention"], final_weights[0]),
            "attention_after_vs_tracer_map": _map_err(last_call, after["attention"]),
            "probabilities": _v(final_logits.softmax(dim=-1)[0]),
            "weight_change_norms": {
                p: round(float((w[slice(*rows[p])] - before[p]).detach().norm()), 4) for p in "qkv"
            },
        },
        "train_accuracy": final_accuracy,
        "memorised": memorised,
        "honesty": honesty,
    }
    data["problems"] = problems(data)
    return data


#: How far a check may be off before it is a problem (float32 on 3x8 matrices is ~1e-7).
TOLERANCE = 1e-5


def problems(data: dict[str, Any]) -> list[str]:
    """The walkthrough's checks that failed, in words (empty when all hold)."""
    found = []
    checks, grads = data["checks"], data["gradients"]
    for key, what in (("attention_vs_pytorch", "the attention computed from the Q/K/V rows differs from PyTorch's"),
                      ("logits_vs_pytorch", "the logits computed by hand differ from PyTorch's"),
                      ("rows_sum_to_one", "attention rows do not sum to 1"),
                      ("loss_vs_minus_log_p", "cross-entropy differs from -log p(label)")):  # fmt: skip
        if checks[key] > TOLERANCE:
            found.append(f"{what} (by {checks[key]:.2g})")
    for where, value in (("before", checks.get("attention_vs_tracer_map")),
                         ("after", data["after"].get("attention_after_vs_tracer_map"))):  # fmt: skip
        if value is not None and value > TOLERANCE:
            found.append(f"{where} training, the tracer's attention map differs from the attention (by {value:.2g})")
    if data["after"]["attention_after_vs_pytorch"] > TOLERANCE:
        found.append("after training, the attention computed by hand differs from PyTorch's")
    for p in "qkv":
        traced, hand = grads["grad_norms"][p], grads["grad_norms_by_hand"][p]
        if traced is None or abs(traced - hand) > TOLERANCE * max(1.0, abs(hand)):
            found.append(f"the tracer's gradient norm of the {p.upper()} slice ({traced}) is not the .grad's ({hand})")
    if not grads["weights_unchanged_by_backward"]:
        found.append("backward() changed the weights")
    if not data["step"]["holds"]:
        found.append("the optimizer step is not -lr * grad")
    return found
