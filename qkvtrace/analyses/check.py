"""Behaviour checks on a user's model, by perturbation (``qkvtrace check``).

Reading code cannot tell whether a mask is the right way round; changing the
input can. Each check runs the model in the modes it really runs in:

* ``inference``: ``model.eval()`` under ``torch.no_grad()`` — where PyTorch's
  fast paths are taken and can behave differently;
* ``training``: ``model.train()`` with gradients on; the random state is
  reseeded before every forward so dropout draws the same masks each time.

``causal``: perturb one position ``j`` at a time; any output at ``i < j``
that moves is a leak "position i reads position j". ``padding``: mark the
tail of the first sequence as padding and perturb only its contents; any
moved output at a real position is a leak. NaN anywhere is reported too.

What ``True`` means in a padding mask depends on the argument
(docs/tutorial.md#masks): ``key_padding_mask`` says True = ignore this key, Hugging Face's
``attention_mask`` says 1 = attend to it. The convention is explicit
(:data:`KNOWN_CONVENTIONS` gives the default for names whose convention is
known) and measured before judging: without padding, changing the padded
inputs must move some real position's output, and the mask in the chosen
convention must remove that influence somewhere — else the report says the
convention could not be confirmed, and whether the opposite one would have
removed it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qkvtrace.analyses.target import first_mha, first_tensor
from qkvtrace.base.errors import InputError
from qkvtrace.tracer import trace

__all__ = ["KNOWN_CONVENTIONS", "CheckReport", "Convention", "Finding", "default_convention", "run_checks"]

MODES = ("inference", "training")
TRUE_MEANS = ("ignore", "attend")

#: What True (or 1) means in padding-mask arguments whose convention is known.
KNOWN_CONVENTIONS: dict[str, str] = {
    "key_padding_mask": "ignore",  # nn.MultiheadAttention, F.multi_head_attention_forward
    "src_key_padding_mask": "ignore",  # nn.TransformerEncoder(Layer), nn.Transformer
    "tgt_key_padding_mask": "ignore",
    "memory_key_padding_mask": "ignore",
    "attention_mask": "attend",  # Hugging Face models: 1 = a real token, 0 = padding
}


@dataclass
class Finding:
    """The outcome of one check in one mode."""

    check: str  # "causal" | "padding" | "nan"
    mode: str  # "inference" | "training"
    passed: bool
    detail: str
    #: (query, key) position pairs where the query's output moved with the key's input.
    leaks: list[tuple[int, int]] = field(default_factory=list)
    max_change: float = 0.0


@dataclass
class Convention:
    """How the padding mask was passed, and whether the model was seen to honour it."""

    #: the keyword argument the mask is passed as
    mask_arg: str
    #: ``"ignore"``: True marks padding (PyTorch); ``"attend"``: 1 marks a real token (Hugging Face)
    true_means: str
    #: where ``true_means`` came from: ``"given"``, ``"known"`` (:data:`KNOWN_CONVENTIONS`) or ``"assumed"``
    source: str
    #: True: the mask removed padded inputs' influence on at least one real position that had it
    #: without padding; False: it did not; None: nothing to remove (no real position was influenced)
    confirmed: bool | None
    #: the measurement, in words
    evidence: str
    #: real positions influenced by the padded inputs without padding / with the mask in this
    #: convention / with the mask in the opposite convention
    influenced: int = 0
    still_influenced: int = 0
    still_influenced_opposite: int = 0
    #: per sequence (only the first two carry padding): the padded positions
    padded: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class CheckReport:
    findings: list[Finding]
    #: per mode: the attention calls the tracer saw (path, backend, fully-masked rows)
    calls: dict[str, list[dict[str, Any]]]
    #: the padding mask's convention and its measurement (``None`` without ``padding``)
    convention: Convention | None = None

    @property
    def ok(self) -> bool:
        return all(f.passed for f in self.findings)


def _seq_dim(model: nn.Module) -> int:
    mha = first_mha(model)
    return 0 if mha is not None and not mha.batch_first else 1


@contextlib.contextmanager
def _mode(model: nn.Module, mode: str) -> Iterator[None]:
    was_training = model.training
    model.train(mode == "training")
    try:
        with torch.set_grad_enabled(mode == "training"):
            yield
    finally:
        model.train(was_training)


class _Runner:
    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> None:
        self.model, self.args, self.kwargs, self.seed = model, args, kwargs, seed
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None or x.dim() < 2:
            raise InputError("the model's first argument must be a (batch, sequence, ...) tensor to be perturbed")
        self.x = x
        self.seq_dim = _seq_dim(model)
        self.length = int(x.shape[self.seq_dim])
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        self.vocab = emb.num_embeddings if emb is not None and not x.is_floating_point() else None

    def forward(self, x: torch.Tensor, mode: str, extra: dict[str, Any] | None = None,
                without: str | None = None) -> torch.Tensor:  # fmt: skip
        """The model's output on ``x`` (keyword arguments plus ``extra``, less ``without``)."""
        args = tuple(x if a is self.x else a for a in self.args)
        kwargs = {k: v for k, v in {**self.kwargs, **(extra or {})}.items() if k != without}
        with _mode(self.model, mode), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            try:
                out = self.model(*args, **kwargs)
            except TypeError as exc:
                raise InputError(f"calling the model failed: {exc}") from exc
        t = first_tensor(out)
        if t is None:
            raise InputError("the model returned no tensor to compare")
        if t.dim() <= self.seq_dim or t.shape[self.seq_dim] != self.length:
            raise InputError(
                f"the output {tuple(t.shape)} has no sequence dimension of length {self.length} at dim "
                f"{self.seq_dim}; these checks compare outputs position by position"
            )
        return t.detach().float()

    def perturb(self, x: torch.Tensor, positions: list[int], batch: slice, gen: torch.Generator) -> torch.Tensor:
        y = x.clone()
        index: list[Any] = [slice(None)] * x.dim()
        index[self.seq_dim] = positions
        index[1 - self.seq_dim] = batch
        target = y[tuple(index)]
        if self.vocab is not None:
            new = (target + torch.randint(1, max(self.vocab, 2), target.shape, generator=gen)) % self.vocab
        else:
            scale = float(x.float().std()) or 1.0
            new = target + torch.randn(target.shape, generator=gen, dtype=torch.float32).to(x.dtype) * scale
        y[tuple(index)] = new
        return y

    def perturb_where(self, x: torch.Tensor, where_bt: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Change the inputs at the (batch, position) entries of ``where_bt``."""
        where = where_bt if self.seq_dim == 1 else where_bt.T  # to the input's layout
        y = x.clone()
        target = y[where]
        if self.vocab is not None:
            new = (target + torch.randint(1, max(self.vocab, 2), target.shape, generator=gen)) % self.vocab
        else:
            scale = float(x.float().std()) or 1.0
            new = target + torch.randn(target.shape, generator=gen, dtype=torch.float32).to(x.dtype) * scale
        y[where] = new
        return y

    def moved_bt(self, a: torch.Tensor, b: torch.Tensor, tol: float) -> torch.Tensor:
        """Per (batch, position): did the output move by more than ``tol``?"""
        diff = (a - b).abs().nan_to_num(0.0)
        per = diff.amax(dim=list(range(2, diff.dim()))) if diff.dim() > 2 else diff
        per = per if self.seq_dim == 1 else per.T
        return per > tol

    def moved(self, a: torch.Tensor, b: torch.Tensor, tol: float) -> torch.Tensor:
        """Per sequence position: did the output move by more than ``tol``?"""
        diff = (a - b).abs().nan_to_num(0.0)
        dims = [d for d in range(diff.dim()) if d != self.seq_dim]
        return diff.amax(dim=dims) > tol


def _tolerance(base: torch.Tensor, rtol: float) -> float:
    finite = base[torch.isfinite(base)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return rtol * max(scale, 1e-6)


def _nan_finding(base: torch.Tensor, mode: str, what: str) -> Finding | None:
    if not bool(torch.isnan(base).any()):
        return None
    n = int(torch.isnan(base).sum())
    return Finding("nan", mode, False, f"{n} NaN values in the output ({what})")


def _causal(r: _Runner, mode: str, trials: int, rtol: float) -> list[Finding]:
    base = r.forward(r.x, mode)
    tol = _tolerance(base, rtol)
    gen = torch.Generator().manual_seed(1234)
    leaks: set[tuple[int, int]] = set()
    worst = 0.0
    for _ in range(trials):
        for j in range(1, r.length):
            out = r.forward(r.perturb(r.x, [j], slice(None), gen), mode)
            moved = r.moved(out, base, tol)
            for i in range(j):
                if bool(moved[i]):
                    leaks.add((i, j))
            index = [slice(None)] * out.dim()
            index[r.seq_dim] = slice(0, j)
            worst = max(worst, float((out - base)[tuple(index)].abs().nan_to_num(0.0).max()))
    pairs = sorted(leaks)
    if pairs:
        shown = ", ".join(f"position {i} reads position {j}" for i, j in pairs[:6])
        more = f" (+{len(pairs) - 6} more)" if len(pairs) > 6 else ""
        detail = f"future positions leak into earlier outputs: {shown}{more}"
    else:
        detail = f"no output at a position t moved when inputs after t changed ({trials} trial(s) per position)"
    findings = [Finding("causal", mode, not pairs, detail, pairs, worst)]
    nan = _nan_finding(base, mode, "causal check")
    return findings + ([nan] if nan else [])


def _padding_mask(batch: int, length: int) -> torch.Tensor:
    """True = padding: the tail of sequence 0 and, with a second sequence, the head of sequence 1."""
    n_pad = max(1, length // 4)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, length - n_pad :] = True  # right padding
    if batch > 1:
        mask[1, :n_pad] = True  # left padding, as in batched generation
    return mask


def default_convention(mask_arg: str) -> tuple[str, str]:
    """``(true_means, source)`` for an argument name: its known convention, else PyTorch's (assumed)."""
    known = KNOWN_CONVENTIONS.get(mask_arg)
    return (known, "known") if known else ("ignore", "assumed")


def _mask_value(pad: torch.Tensor, true_means: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (B, T) padding mask in a convention: True = padding (``ignore``) or True = real token (``attend``).

    The dtype is bool for ``ignore`` (PyTorch's masks) and int64 for ``attend`` (what Hugging Face
    tokenizers return), unless ``dtype`` is given.
    """
    value = pad if true_means == "ignore" else ~pad
    return value.to(dtype or (torch.bool if true_means == "ignore" else torch.int64))


def _opposite(true_means: str) -> str:
    return "attend" if true_means == "ignore" else "ignore"


def _moved_real(r: _Runner, mode: str, pad: torch.Tensor, mask: torch.Tensor | None, mask_arg: str, rtol: float,
                seed: int) -> torch.Tensor:  # fmt: skip
    """(B, T): real positions whose output moved when only the padded inputs changed, with ``mask`` passed
    (``None``: the argument left out)."""
    extra, without = ({mask_arg: mask}, None) if mask is not None else (None, mask_arg)
    base = r.forward(r.x, mode, extra, without)
    out = r.forward(r.perturb_where(r.x, pad, torch.Generator().manual_seed(seed)), mode, extra, without)
    return r.moved_bt(out, base, _tolerance(base, rtol)) & ~pad


def _confirm(r: _Runner, mode: str, mask_arg: str, true_means: str, source: str, rtol: float) -> Convention:
    """Measure whether the mask, in this convention, removes the padded inputs' influence anywhere."""
    batch = int(r.x.shape[1 - r.seq_dim])
    pad = _padding_mask(batch, r.length)
    other = _opposite(true_means)
    dtype = _mask_value(pad, true_means).dtype  # the opposite convention is tried in the same dtype
    try:  # the influence to remove: the model as it runs without a padding mask ...
        free = _moved_real(r, mode, pad, None, mask_arg, rtol, 99)
        unpadded = f"without {mask_arg}"
    except Exception:  # ... or, where the mask is required, with one that pads nothing
        free = _moved_real(r, mode, pad, _mask_value(torch.zeros_like(pad), true_means), mask_arg, rtol, 99)
        unpadded = "with no position padded"
    chosen = _moved_real(r, mode, pad, _mask_value(pad, true_means), mask_arg, rtol, 99)
    try:
        opposite = _moved_real(r, mode, pad, _mask_value(pad, other, dtype), mask_arg, rtol, 99)
    except Exception:  # a model may reject a mask it never meets in use; then it is not measured
        opposite = free
    n_free, n_chosen, n_opp = int(free.sum()), int(chosen.sum()), int(opposite.sum())
    removed, removed_opp = int((free & ~chosen).sum()), int((free & ~opposite).sum())
    said = f"{mask_arg}= (True = {true_means})"
    if n_free == 0:
        confirmed: bool | None = None
        evidence = (f"could not be confirmed: {unpadded}, changing the padded inputs moved no real "
                    f"position's output ({mode}), so there was no influence for the mask to remove")  # fmt: skip
    elif removed:
        confirmed = True
        evidence = (f"confirmed ({mode}): {unpadded}, changing the padded inputs moved {n_free} real "
                    f"position(s); with {said} it moved {n_chosen}")  # fmt: skip
    else:
        confirmed = False
        evidence = (f"NOT confirmed ({mode}): {unpadded}, changing the padded inputs moved {n_free} real "
                    f"position(s), and with {said} still {n_chosen}: the mask removed no influence")  # fmt: skip
        if removed_opp:
            evidence += (f"; with True = {other} it moved {n_opp}: {mask_arg} probably means {other} "
                         f"(--mask-true-means {other}), or the model inverts its mask")  # fmt: skip
        else:
            evidence += f"; with True = {other} neither ({n_opp}): is {mask_arg} passed on to the attention?"
    padded = {b: [int(t) for t in pad[b].nonzero().flatten().tolist()] for b in range(min(batch, 2))}
    return Convention(mask_arg, true_means, source, confirmed, evidence, n_free, n_chosen, n_opp, padded)


def _padding(r: _Runner, mode: str, trials: int, rtol: float, conv: Convention) -> list[Finding]:
    batch = int(r.x.shape[1 - r.seq_dim])
    pad = _padding_mask(batch, r.length)  # (B, T), True = padding
    mask_arg = conv.mask_arg
    extra = {mask_arg: _mask_value(pad, conv.true_means)}
    base = r.forward(r.x, mode, extra)
    tol = _tolerance(base, rtol)
    gen = torch.Generator().manual_seed(4321)
    moved_real = torch.zeros_like(pad)
    worst = 0.0
    for _ in range(trials):
        out = r.forward(r.perturb_where(r.x, pad, gen), mode, extra)
        moved = r.moved_bt(out, base, tol) & ~pad
        moved_real |= moved
        diff = (out - base).abs().nan_to_num(0.0)
        worst = max(worst, float(diff.amax(dim=list(range(2, diff.dim()))).masked_fill(pad if r.seq_dim == 1
                    else pad.T, 0.0).max()) if diff.dim() > 2 else 0.0)  # fmt: skip
    positions = [(int(b), int(t)) for b, t in moved_real.nonzero().tolist()]
    leaks = [(t, -1) for _, t in positions]
    padded = conv.padded
    how = f"mask passed as {mask_arg}=, True = {conv.true_means}"
    if positions:
        shown = ", ".join(f"sequence {b} position {t}" for b, t in positions[:6])
        more = f" (+{len(positions) - 6} more)" if len(positions) > 6 else ""
        detail = (
            f"outputs at real positions moved when only padded inputs changed: {shown}{more} "
            f"(padded: {padded}; {how})"
        )
    else:
        detail = f"real positions ignore the padded ones {padded} ({how})"
    findings = [Finding("padding", mode, not positions, detail, leaks, worst)]
    nan = _nan_finding(base, mode, "padding check")
    return findings + ([nan] if nan else [])


def _calls(r: _Runner, mode: str, extra: dict[str, Any] | None) -> list[dict[str, Any]]:
    with trace(r.model, gradients=False) as t:
        r.forward(r.x, mode, extra)
    return [
        {
            "module": c.module,
            "path": c.path,
            "sdpa_backend": c.sdpa_backend,
            "why_not_fast_path": c.why_not_fast_path,
            "fully_masked_rows": c.output.get("fully_masked_rows"),
            "nan_count": c.output.get("nan_count"),
        }
        for c in t.calls
    ]


def run_checks(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    causal: bool = False,
    padding: bool = False,
    mask_arg: str = "key_padding_mask",
    mask_true_means: str | None = None,
    trials: int = 2,
    rtol: float = 1e-4,
    modes: tuple[str, ...] = MODES,
    seed: int = 0,
) -> CheckReport:
    """Run the requested checks in each mode; see the module docstring.

    ``mask_true_means`` (``"ignore"`` or ``"attend"``) says what True means in the padding mask;
    ``None`` takes it from :data:`KNOWN_CONVENTIONS`, else assumes PyTorch's ``"ignore"``.
    """
    if not (causal or padding):
        raise InputError("choose at least one check: --causal and/or --padding")
    if mask_true_means is not None and mask_true_means not in TRUE_MEANS:
        raise InputError(f"mask_true_means {mask_true_means!r}: choose 'ignore' or 'attend'")
    r = _Runner(model, args, dict(kwargs or {}), seed)
    if r.length < 2:
        raise InputError(f"the sequence has length {r.length}; checks need at least 2 positions")
    conv = None
    if padding:
        true_means, source = (mask_true_means, "given") if mask_true_means else default_convention(mask_arg)
        conv = _confirm(r, "inference" if "inference" in modes else modes[0], mask_arg, true_means, source, rtol)
    findings: list[Finding] = []
    calls: dict[str, list[dict[str, Any]]] = {}
    extra = None
    for mode in modes:
        if causal:
            findings += _causal(r, mode, trials, rtol)
        if conv is not None:
            findings += _padding(r, mode, trials, rtol, conv)
            pad = _padding_mask(int(r.x.shape[1 - r.seq_dim]), r.length)
            extra = {conv.mask_arg: _mask_value(pad, conv.true_means)}
        calls[mode] = _calls(r, mode, extra)
    return CheckReport(findings, calls, conv)
