"""The tasks of ``qkvtrace ablate`` (:mod:`qkvtrace.analyses.ablate`): data made by construction, with held-out splits.

``lookup``: the answer sits at another position that the last token names, so
routing matters; ``marker``: copy the token after a marker (two layers);
``sentiment``: the tutorial's eight sentences (its one-sentence case), a
sanity task. Each :class:`TaskSpec` also carries the model and optimizer
settings every mode trains with on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TASKS", "Split", "TaskSpec", "sentiment_vocab"]


Split = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]


@dataclass(frozen=True)
class TaskSpec:
    """A task and the model and optimizer settings every mode trains with on it."""

    name: str
    description: str
    vocab_size: int
    seq_len: int
    n_classes: int
    chance_accuracy: float
    pool: str
    d_model: int
    n_layers: int
    lr: float
    batch_size: int
    default_steps: int
    #: whether the answer needs information from another position
    routing: bool
    split: Callable[[int], Split] = field(repr=False, compare=False)
    #: where the answer sits in each sequence, for tasks where it sits at one position
    answer_position: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def info(self, seed: int = 0) -> dict[str, Any]:
        x_tr, _, x_ev, _ = self.split(seed)
        return {
            "name": self.name, "description": self.description, "routing": self.routing,
            "vocab_size": self.vocab_size, "seq_len": self.seq_len, "n_classes": self.n_classes,
            "chance_accuracy": self.chance_accuracy, "train_size": int(x_tr.size(0)), "eval_size": int(x_ev.size(0)),
        }  # fmt: skip


_LOOKUP_VALUES = 16  # value tokens 0..15
_LOOKUP_LEN = 10  # 9 value positions, then the query
_LOOKUP_TRAIN, _LOOKUP_EVAL = 4096, 1024
_LOOKUP_DATA_SEED = 1234  # the data are the same for every run; the run seed orders them


def _lookup_split(seed: int) -> Split:
    """Sequences ``v_0 .. v_8 @i``: the answer is ``v_i``; ``@i`` is one of 9 index tokens (16 + i).

    Train and eval sequences are drawn once and are disjoint (checked).
    """
    import torch

    del seed  # the same data for every seed; the order of training batches follows the seed
    g = torch.Generator().manual_seed(_LOOKUP_DATA_SEED)
    n_pos = _LOOKUP_LEN - 1
    seen: set[tuple[int, ...]] = set()
    rows: list[torch.Tensor] = []
    while len(rows) < _LOOKUP_TRAIN + _LOOKUP_EVAL:
        values = torch.randint(0, _LOOKUP_VALUES, (n_pos,), generator=g)
        index = int(torch.randint(0, n_pos, (1,), generator=g))
        row = torch.cat([values, torch.tensor([_LOOKUP_VALUES + index])])
        key = tuple(row.tolist())
        if key not in seen:  # a repeat could land on both sides of the split
            seen.add(key)
            rows.append(row)
    tokens = torch.stack(rows)  # (N, T)
    answers = tokens[torch.arange(tokens.size(0)), tokens[:, -1] - _LOOKUP_VALUES]
    n = _LOOKUP_TRAIN
    return tokens[:n], answers[:n], tokens[n:], answers[n:]


_MARKER_LEN = 12  # 11 positions of values and one marker, then the query token
_MARKER, _QUERY = _LOOKUP_VALUES, _LOOKUP_VALUES + 1


def _unique_rows(make: Callable[[torch.Generator], torch.Tensor], n: int, seed: int) -> torch.Tensor:
    """``n`` distinct rows from ``make``; distinct, so none can land on both sides of a split."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seen: set[tuple[int, ...]] = set()
    rows: list[torch.Tensor] = []
    while len(rows) < n:
        row = make(g)
        key = tuple(row.tolist())
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return torch.stack(rows)


def _marker_split(seed: int) -> Split:
    """``v v M a v ... v ?``: one marker M at a random place; the answer is the token ``a`` right after it."""
    import torch

    del seed  # as for lookup: fixed data, the run seed orders the batches

    def make(g: torch.Generator) -> torch.Tensor:
        row = torch.randint(0, _LOOKUP_VALUES, (_MARKER_LEN,), generator=g)
        row[int(torch.randint(0, _MARKER_LEN - 2, (1,), generator=g))] = _MARKER
        row[-1] = _QUERY
        return row

    tokens = _unique_rows(make, _LOOKUP_TRAIN + _LOOKUP_EVAL, _LOOKUP_DATA_SEED)
    answers = tokens[torch.arange(tokens.size(0)), _marker_answer_position(tokens)]
    n = _LOOKUP_TRAIN
    return tokens[:n], answers[:n], tokens[n:], answers[n:]


def _marker_answer_position(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens == _MARKER).int().argmax(dim=1) + 1


# The eight sentences of the tutorial's one-sentence case, 1 = positive, 0 = negative.
_SENTENCES = (
    ("我 喜欢 机器人", 1), ("我 喜欢 编程", 1), ("学习 人工 智能", 1), ("模型 很 有趣", 1),
    ("我 讨厌 故障", 0), ("我 讨厌 延迟", 0), ("系统 很 糟糕", 0), ("模型 很 难用", 0),
)  # fmt: skip


def sentiment_vocab() -> dict[str, int]:
    """``<unk>`` then every word in order of first appearance, as the tutorial builds it."""
    vocab = {"<unk>": 0}
    for text, _ in _SENTENCES:
        for word in text.split():
            vocab.setdefault(word, len(vocab))
    return vocab


def _sentiment_split(seed: int) -> Split:
    """Six sentences to train on; one positive and one negative held out, rotating with the seed."""
    import torch

    vocab = sentiment_vocab()
    positives = [i for i, (_, y) in enumerate(_SENTENCES) if y == 1]
    negatives = [i for i, (_, y) in enumerate(_SENTENCES) if y == 0]
    held = {positives[seed % len(positives)], negatives[seed % len(negatives)]}
    tokens = torch.tensor([[vocab[w] for w in text.split()] for text, _ in _SENTENCES])
    labels = torch.tensor([y for _, y in _SENTENCES])
    train = [i for i in range(len(_SENTENCES)) if i not in held]
    ev = sorted(held)
    return tokens[train], labels[train], tokens[ev], labels[ev]


TASKS: dict[str, TaskSpec] = {
    "lookup": TaskSpec(
        name="lookup",
        description="9 random tokens (16 values) then an index token @i; answer: the token at position i. "
        "Read from the last position, so the answer must be routed there by attention.",
        vocab_size=_LOOKUP_VALUES + _LOOKUP_LEN - 1, seq_len=_LOOKUP_LEN, n_classes=_LOOKUP_VALUES,
        chance_accuracy=1 / _LOOKUP_VALUES, pool="last", d_model=32, n_layers=1, lr=3e-3, batch_size=64,
        default_steps=400, routing=True, split=_lookup_split,
        answer_position=lambda tokens: tokens[:, -1] - _LOOKUP_VALUES,
    ),
    "marker": TaskSpec(
        name="marker",
        description="11 random tokens (16 values) with one marker M among them, then a query token; answer: the "
        "token right after M. Two layers: one to mark the token after M, one to fetch it into the last position.",
        vocab_size=_LOOKUP_VALUES + 2, seq_len=_MARKER_LEN, n_classes=_LOOKUP_VALUES,
        chance_accuracy=1 / _LOOKUP_VALUES, pool="last", d_model=32, n_layers=2, lr=1e-2, batch_size=64,
        default_steps=1000, routing=True, split=_marker_split,
        # no answer_position: with two layers the answer can travel through another position (M reads the
        # token after it, the last position reads M), so the last layer's weight on it says little
    ),
    "sentiment": TaskSpec(
        name="sentiment",
        description="the tutorial's 8 sentences (one-sentence case), positive/negative; train on 6, evaluate on the "
        "held-out positive and negative (which two rotates with the seed); mean over positions, as the tutorial does.",
        vocab_size=len(sentiment_vocab()), seq_len=3, n_classes=2, chance_accuracy=0.5, pool="mean", d_model=8,
        n_layers=1, lr=1e-2, batch_size=6, default_steps=100, routing=False, split=_sentiment_split,
    ),
}  # fmt: skip
