"""Q/K/V ablations trained and measured properly (docs/tutorial.md#without-the-projections).

The tutorial describes what is left of attention without its projection
matrices, and ends with the rule this module follows: a
random-init attention map only shows the arithmetic; to know what the
matrices are worth, train the full and the ablated models on the same data,
for the same steps, with the same seeds and optimizer, and report means over
several runs. So:

* one attention implementation, :class:`AblationAttention`, whose ``mode``
  removes exactly one thing (:data:`MODES`); ``no_attention`` drops the
  attention sub-layer from the block, leaving LayerNorm + FFN + residual;
* one tiny model (:class:`TinyModel`) around it, the same for every mode;
* tasks (:data:`TASKS`) with held-out evaluation data never seen in
  training: ``lookup``, where the answer sits at another position that the
  last token names, so routing matters; ``marker``, copy the token after a
  marker (two layers; slow, and learned by some seeds only); and
  ``sentiment``, the tutorial's eight sentences (its one-sentence case) as a sanity task;
* for each seed, every mode gets the same training data in the same order,
  the same optimizer settings and the same number of steps; the run seed also
  seeds the model's initialisation (which differs between modes only in the
  parameters a mode has);
* the tutorial's claims about the arithmetic are measured, not assumed
  (:func:`check_properties`): ``uniform`` rows are 1/T, with a causal mask row
  t is the mean of the first t values; ``identity_qkv`` puts more than
  1/T of each row on the token itself.

Nothing here prints: :func:`run_ablation` reports each finished run to an
optional callback, and the renderers (``qkvtrace.render.ablate_render``)
turn the result into tables and a chart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from qkvtrace.analyses.ablate_tasks import TASKS, TaskSpec, sentiment_vocab

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ABLATE_SCHEMA",
    "MODES",
    "MODE_NOTES",
    "NON_ROUTING_MODES",
    "TASKS",
    "AblationResult",
    "ModeResult",
    "Property",
    "RunResult",
    "TaskSpec",
    "check_properties",
    "make_attention",
    "make_model",
    "run_ablation",
    "sentiment_vocab",
    "train_run",
    "training_batches",
]

ABLATE_SCHEMA = "qkvtrace.ablate/1"

#: AdamW's weight decay, the same for every task and mode
WEIGHT_DECAY = 0.01

#: The modes, in the order the tutorial introduces them, after ``full``.
MODES: tuple[str, ...] = ("full", "identity_qkv", "shared_qk", "uniform", "identity_v", "no_attention")

#: What each mode keeps and removes, in a line.
MODE_NOTES: dict[str, str] = {
    "full": "learned W_Q, W_K, W_V",
    "identity_qkv": "Q = K = V = X, no projections (4.1)",
    "shared_qk": "W_Q = W_K, W_V kept (4.2)",
    "uniform": "QK^T = 0: every row uniform; W_V kept (4.3)",
    "identity_v": "learned W_Q, W_K; V = X (4.4)",
    "no_attention": "LayerNorm + FFN + residual only (4.5)",
}

#: Modes that cannot choose where to read from: every query gets the same
#: average (``uniform``) or nothing from other positions (``no_attention``).
NON_ROUTING_MODES: tuple[str, ...] = ("uniform", "no_attention")


# -- the model -------------------------------------------------------------------


def make_attention(d_model: int, mode: str) -> nn.Module:
    """One single-head self-attention whose ``mode`` removes one part (``no_attention`` excluded)."""
    import torch
    from torch import nn

    if mode not in MODES or mode == "no_attention":
        raise ValueError(f"unknown attention mode {mode!r}; one of {', '.join(MODES[:-1])}")

    class AblationAttention(nn.Module):
        """``softmax(QK^T / sqrt(D) [+ causal mask]) V`` with Q, K, V as ``mode`` says.

        ``forward`` returns the context ``[B, T, D]`` and the weights
        ``[B, T, T]``. Only the projections a mode uses exist as parameters.
        """

        def __init__(self) -> None:
            super().__init__()
            self.mode = mode
            if mode in ("full", "shared_qk", "identity_v"):
                self.q_proj = nn.Linear(d_model, d_model, bias=False)
            if mode in ("full", "identity_v"):
                self.k_proj = nn.Linear(d_model, d_model, bias=False)
            if mode in ("full", "shared_qk", "uniform"):
                self.v_proj = nn.Linear(d_model, d_model, bias=False)

        def forward(self, x: torch.Tensor, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            if self.mode == "full":
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            elif self.mode == "identity_qkv":
                q = k = v = x
            elif self.mode == "shared_qk":
                q = k = self.q_proj(x)  # one matrix for both roles
                v = self.v_proj(x)
            elif self.mode == "uniform":
                q = k = torch.zeros_like(x)  # every score 0
                v = self.v_proj(x)
            else:  # identity_v
                q, k, v = self.q_proj(x), self.k_proj(x), x
            scores = q @ k.transpose(-2, -1) / math.sqrt(x.size(-1))  # (B, T, T)
            if causal:
                t = x.size(-2)
                future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            weights = scores.softmax(dim=-1)
            return weights @ v, weights  # (B, T, D), (B, T, T)

    return AblationAttention()


def make_model(
    vocab_size: int, seq_len: int, n_classes: int, mode: str, *, d_model: int = 32, n_layers: int = 1,
    pool: str = "last",
) -> nn.Module:  # fmt: skip
    """A tiny classifier: embedding + learned position, ``n_layers`` pre-LN blocks, a linear head.

    Each block is ``x + W_O attn(LN(x))`` then ``x + FFN(LN(x))``; in
    ``no_attention`` mode only the second half. ``pool`` reads the class
    from the ``last`` position (so nothing reaches it except through
    attention) or from the ``mean`` over positions (as the tutorial's one-sentence case does).
    """
    import torch
    from torch import nn

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if pool not in ("last", "mean"):
        raise ValueError(f"unknown pool {pool!r}; 'last' or 'mean'")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if mode != "no_attention":
                self.ln_attn = nn.LayerNorm(d_model)
                self.attn = make_attention(d_model, mode)
                self.out_proj = nn.Linear(d_model, d_model)
            self.ln_ffn = nn.LayerNorm(d_model)
            self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            weights = None
            if mode != "no_attention":
                context, weights = self.attn(self.ln_attn(x))
                x = x + self.out_proj(context)
            return x + self.ffn(self.ln_ffn(x)), weights

    class TinyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mode = mode
            self.embedding = nn.Embedding(vocab_size, d_model)
            self.position = nn.Parameter(torch.randn(1, seq_len, d_model) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.ln_out = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, n_classes)

        def forward(self, tokens: torch.Tensor, return_weights: bool = False) -> Any:
            x = self.embedding(tokens) + self.position[:, : tokens.size(1)]  # (B, T, D)
            maps = []
            for block in self.blocks:
                x, weights = block(x)
                if weights is not None:
                    maps.append(weights)
            pooled = x[:, -1] if pool == "last" else x.mean(dim=1)  # (B, D)
            logits = self.head(self.ln_out(pooled))
            return (logits, maps) if return_weights else logits

    return TinyModel()


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunResult:
    """One trained model: its seed and what it scored."""

    seed: int
    #: accuracy and mean cross-entropy on the held-out evaluation data
    accuracy: float
    loss: float
    #: the same on the training data, after the last step (memorisation shows here)
    train_accuracy: float
    train_loss: float
    #: mean attention weight a position puts on itself, on the evaluation data (``None`` without attention)
    diagonal_share: float | None
    #: mean weight the reading (last) position puts on the position that holds the answer, in the last
    #: layer, on the evaluation data; ``None`` where the task has no such position or there is no attention
    answer_weight: float | None = None


@dataclass(frozen=True, slots=True)
class ModeResult:
    """All runs of one mode, and their mean and sample standard deviation (0 for one run)."""

    mode: str
    description: str
    routing: bool
    parameters: int
    runs: tuple[RunResult, ...]
    accuracy_mean: float
    accuracy_std: float
    loss_mean: float
    loss_std: float


@dataclass(frozen=True, slots=True)
class Property:
    """A claim of the tutorial about the arithmetic, and what was measured."""

    name: str
    claim: str
    measured: float
    #: what ``measured`` is held against, in words
    expected: str
    holds: bool


@dataclass(frozen=True, slots=True)
class AblationResult:
    """Everything ``qkvtrace ablate`` found; :meth:`to_dict` is the ``qkvtrace.ablate/1`` file."""

    task: dict[str, Any]
    steps: int
    seeds: tuple[int, ...]
    optimizer: dict[str, Any]
    model: dict[str, Any]
    torch_version: str
    modes: tuple[ModeResult, ...]
    properties: tuple[Property, ...]

    def mode(self, name: str) -> ModeResult:
        return next(m for m in self.modes if m.mode == name)

    def routing_margin(self) -> dict[str, Any] | None:
        """Full against the non-routing modes: the gap in mean accuracy, and whether every run is above."""
        names = [m.mode for m in self.modes]
        others = [self.mode(n) for n in NON_ROUTING_MODES if n in names]
        if "full" not in names or not others:
            return None
        full = self.mode("full")
        best = max(others, key=lambda m: m.accuracy_mean)
        return {
            "best_non_routing": best.mode,
            "accuracy_gap": full.accuracy_mean - best.accuracy_mean,
            "every_full_run_above": min(r.accuracy for r in full.runs)
            > max(r.accuracy for m in others for r in m.runs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": ABLATE_SCHEMA,
            "task": self.task,
            "steps": self.steps,
            "seeds": list(self.seeds),
            "optimizer": self.optimizer,
            "model": self.model,
            "torch_version": self.torch_version,
            "modes": [{**asdict(m), "runs": [asdict(r) for r in m.runs]} for m in self.modes],
            "routing_margin": self.routing_margin(),
            "properties": [asdict(p) for p in self.properties],
        }


# -- training ---------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _evaluate(
    model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, task: TaskSpec
) -> tuple[float, float, float | None, float | None]:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits, maps = model(tokens, return_weights=True)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean().item()
        loss = F.cross_entropy(logits, labels).item()
        diagonal = torch.stack([w.diagonal(dim1=-2, dim2=-1).mean() for w in maps]).mean().item() if maps else None
        answer = None
        if maps and task.answer_position is not None:
            where = task.answer_position(tokens)  # (N,)
            answer = maps[-1][torch.arange(tokens.size(0)), -1, where].mean().item()
    return accuracy, loss, diagonal, answer


def training_batches(n: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Indices of each step's batch: shuffled epochs drawn from a generator seeded with ``seed``.

    Nothing but ``seed`` decides them, so every mode sees the same batches in the same order.
    """
    import torch

    order = torch.Generator().manual_seed(seed)
    batch = min(batch_size, n)
    perm, at = torch.randperm(n, generator=order), 0
    for _ in range(steps):
        if at + batch > n:  # a new epoch; the tail that does not fill a batch is skipped
            perm, at = torch.randperm(n, generator=order), 0
        yield perm[at : at + batch]
        at += batch


def train_run(task: TaskSpec, mode: str, seed: int, steps: int) -> RunResult:
    """Train one model from scratch and evaluate it on the held-out data.

    The seed fixes the initialisation and the order of the training batches;
    the global RNG state is restored afterwards.
    """
    import torch
    import torch.nn.functional as F

    x_train, y_train, x_eval, y_eval = task.split(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model(task.vocab_size, task.seq_len, task.n_classes, mode, d_model=task.d_model,
                           n_layers=task.n_layers, pool=task.pool)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=WEIGHT_DECAY)
    model.train()
    for idx in training_batches(x_train.size(0), task.batch_size, steps, seed):
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    accuracy, eval_loss, diagonal, answer = _evaluate(model, x_eval, y_eval, task)
    train_accuracy, train_loss, _, _ = _evaluate(model, x_train, y_train, task)
    return RunResult(seed, accuracy, eval_loss, train_accuracy, train_loss, diagonal, answer)


def _parameters(task: TaskSpec, mode: str) -> int:
    model = make_model(task.vocab_size, task.seq_len, task.n_classes, mode, d_model=task.d_model,
                       n_layers=task.n_layers, pool=task.pool)  # fmt: skip
    return sum(p.numel() for p in model.parameters())


def run_ablation(
    task: str | TaskSpec = "lookup",
    seeds: Sequence[int] = range(5),
    steps: int | None = None,
    modes: Sequence[str] = MODES,
    on_run: Callable[[str, RunResult], None] | None = None,
    threads: int | None = 1,
) -> AblationResult:
    """Train every mode with every seed on ``task``; measure the tutorial's properties.

    ``steps`` defaults to the task's own (``TASKS[name].default_steps``).
    ``on_run(mode, run)`` is called after each run (for progress bars).
    ``threads``: torch's intra-op threads while training (restored after);
    one is fastest for models this small and keeps runs reproducible.
    """
    import torch

    spec = TASKS[task] if isinstance(task, str) else task
    steps = spec.default_steps if steps is None else steps
    seeds = tuple(seeds)
    if steps < 0 or not seeds:
        raise ValueError("steps must be >= 0 and at least one seed given")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        results = []
        for mode in modes:
            runs = []
            for seed in seeds:
                run = train_run(spec, mode, seed, steps)
                runs.append(run)
                if on_run is not None:
                    on_run(mode, run)
            acc_mean, acc_std = _mean_std([r.accuracy for r in runs])
            loss_mean, loss_std = _mean_std([r.loss for r in runs])
            results.append(ModeResult(mode, MODE_NOTES[mode], mode not in NON_ROUTING_MODES, _parameters(spec, mode),
                                      tuple(runs), acc_mean, acc_std, loss_mean, loss_std))  # fmt: skip
        properties = check_properties(d_model=spec.d_model, seq_len=spec.seq_len)
    finally:
        torch.set_num_threads(saved_threads)
    return AblationResult(
        task=spec.info(seeds[0]),
        steps=steps,
        seeds=seeds,
        optimizer={"name": "AdamW", "lr": spec.lr, "weight_decay": WEIGHT_DECAY, "batch_size": spec.batch_size},
        model={
            "d_model": spec.d_model,
            "n_layers": spec.n_layers,
            "heads": 1,
            "pool": spec.pool,
            "ffn": 4 * spec.d_model,
            "norm": "pre-LayerNorm",
        },
        torch_version=str(torch.__version__),
        modes=tuple(results),
        properties=properties,
    )


# -- the tutorial's claims about the arithmetic ----------------------------------------------------


def check_properties(d_model: int = 8, seq_len: int = 6, batch: int = 64, seed: int = 0) -> tuple[Property, ...]:
    """Measure, on random inputs, what the tutorial says the ablated arithmetic does.

    * ``uniform`` (4.3): every weight row is 1/T; with a causal mask row t
      (counting from 1) is 1/t on the first t positions and 0 after, so the
      output at t is the mean of the first t values.
    * ``identity_qkv`` (4.1): each token tends to attend to itself; measured
      as the mean weight on the diagonal, against 1/T (a row that does not
      prefer itself).
    """
    import torch

    tol = 1e-6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        x = torch.randn(batch, seq_len, d_model)
        uniform = make_attention(d_model, "uniform")
        identity = make_attention(d_model, "identity_qkv")
    with torch.no_grad():
        _, w = uniform(x)
        row_err = (w - 1.0 / seq_len).abs().max().item()
        out_c, w_c = uniform(x, causal=True)
        t = torch.arange(1, seq_len + 1, dtype=x.dtype)
        expected_w = torch.ones(seq_len, seq_len).tril() / t[:, None]  # row t: 1/t on the first t
        causal_err = (w_c - expected_w).abs().max().item()
        v = uniform.get_submodule("v_proj")(x)
        running_mean = v.cumsum(dim=1) / t[None, :, None]  # mean of the first t values
        mean_err = (out_c - running_mean).abs().max().item()
        _, w_id = identity(x)
        diagonal = w_id.diagonal(dim1=-2, dim2=-1).mean().item()
    shape = f"T={seq_len}, D={d_model}, {batch} random inputs"
    return (
        Property("uniform_rows", "uniform: every weight row is 1/T (4.3)", row_err,
                 f"max |w - 1/T| <= {tol:g} ({shape})", row_err <= tol),
        Property("uniform_causal_rows", "uniform + causal mask: row t is 1/t on the first t positions (4.3)",
                 causal_err, f"max |w - 1/t| <= {tol:g}", causal_err <= tol),
        Property("uniform_causal_mean", "uniform + causal mask: output t is the mean of the first t values (4.3)",
                 mean_err, f"max |out_t - mean(v_1..v_t)| <= {tol:g}", mean_err <= tol),
        Property("identity_qkv_diagonal", "identity_qkv: each token tends to attend to itself (4.1)", diagonal,
                 f"mean diagonal weight > 1/T = {1 / seq_len:.3f} (X ~ N(0, 1))", diagonal > 1 / seq_len),
    )  # fmt: skip
