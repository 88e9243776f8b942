"""Attention health over a long run: ``trace(model, keep="changes", health_every=N)``.

Witnesses: logits and entropies computed in this file, in float64, from the
module's own projection weights and the masks the test built (``_witness``);
``W_q`` grown by the test step by step (logit growth by construction);
slice gradient norms read by the test from ``.grad`` right after its
backward; an untraced run of the same training for bit-identical outputs;
TensorBoard's own reader for the event file.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _witness import benchmark
from torch import nn

import qkvtrace
from qkvtrace.facts import health as health_module

E, H, B, L = 16, 4, 2, 7
D = E // H


# -- the test's own computation -------------------------------------------------------------------


def _witness(q: torch.Tensor, k: torch.Tensor, scale: float, open_: torch.Tensor | None) -> dict[str, list[float]]:
    """Per head max logit, mean entropy over rows seeing a key, least entropy over rows seeing two keys.

    ``q`` ``[B, H, L, d]``, ``k`` ``[B, H, S, d]``, ``open_`` bool broadcastable to ``[B, H, L, S]`` (True = the
    key is seen). Float64, one query row at a time, no library function but softmax's definition.
    """
    q, k = q.double(), k.double()
    b, h, length, _ = q.shape
    s = k.shape[2]
    full = torch.ones(b, h, length, s, dtype=torch.bool) if open_ is None else open_.expand(b, h, length, s)
    out: dict[str, list[float]] = {"max_logit": [], "entropy_mean": [], "entropy_min": []}
    for head in range(h):
        top, entropies, least = -math.inf, [], math.inf
        for i in range(b):
            for row in range(length):
                keys = [j for j in range(s) if full[i, head, row, j]]
                if not keys:
                    continue
                logits = [float(q[i, head, row] @ k[i, head, j]) * scale for j in keys]
                top = max(top, *logits)
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                p = [math.exp(x - m) / z for x in logits]
                ent = -sum(pi * math.log(pi) for pi in p if pi > 0)
                entropies.append(ent)
                if len(keys) >= 2:
                    least = min(least, ent)
        out["max_logit"].append(top)
        out["entropy_mean"].append(sum(entropies) / len(entropies))
        out["entropy_min"].append(least)
    return out


def _mha_qk(mha: nn.MultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K of a batch-first self-attention call, from the module's packed ``in_proj_weight``."""
    w, bias = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    q = x @ w[:E].T + bias[:E]
    k = x @ w[E : 2 * E].T + bias[E : 2 * E]
    return (t.reshape(B, -1, H, D).transpose(1, 2) for t in (q, k))  # type: ignore[return-value]


def _close(got: list[float | None], want: list[float], rel: float = 1e-4) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is not None and math.isclose(g, w, rel_tol=rel, abs_tol=1e-5), (got, want)


def _heads(record: qkvtrace.facts.health.HealthRecord, name: str) -> list[float | None]:
    return [getattr(h, name) for h in record.heads]


def _close_heads(record: qkvtrace.facts.health.HealthRecord, want: dict[str, list[float]]) -> None:
    """Each head's max logit and entropies in ``record`` against the witness's."""
    for name in ("max_logit", "entropy_mean", "entropy_min"):
        _close(_heads(record, name), want[name])


class CausalSDPA(nn.Module):
    """A user's attention calling ``F.scaled_dot_product_attention`` with ``is_causal=True`` (separate Q/K/V)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(E, E, bias=False)
        self.k = nn.Linear(E, E, bias=False)
        self.v = nn.Linear(E, E, bias=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(p(x).reshape(x.shape[0], -1, H, D).transpose(1, 2) for p in (self.q, self.k, self.v))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class HandWritten(nn.Module):
    """Attention written by hand: softmax of ``q·kᵀ/√d`` plus a padding mask, times V."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(x.shape[0], -1, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        scores = scores.masked_fill(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return (probs @ v).transpose(1, 2).reshape(x.shape)


# -- logit growth by construction --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fallback", "fast"])
def test_growing_w_q_shows_in_max_logit_and_entropy_with_a_padding_mask(mode: str, tmp_path: Path) -> None:
    """``W_q`` multiplied by 1.6 after every step (zero Q bias): the logits grow by construction, the entropy falls.

    MHA's fallback (training) and fast path (eval, no_grad), a key padding
    mask hiding the last two keys of item 1. Witness: ``_witness`` on Q and K
    projected by the test from ``in_proj_weight``, the padding mask as the
    test built it (True = key hidden), scale ``1/√d``.
    """
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True
    open_ = (~pad)[:, None, None, :]
    mha.train(mode == "fallback")
    wants: list[dict[str, list[float]]] = []
    with qkvtrace.trace(mha, keep="changes", health_every=2, stream_to=tmp_path / "run.jsonl") as t:
        for step in range(7):
            if step % 2 == 0:
                q, k = _mha_qk(mha, x)
                wants.append(_witness(q, k, 1 / math.sqrt(D), open_))
            with torch.set_grad_enabled(mode == "fallback"):
                mha(x, x, x, key_padding_mask=pad, need_weights=False)
                mha(x, x, x, key_padding_mask=pad, need_weights=False)  # a second call: not measured
            with torch.no_grad():
                mha.in_proj_weight[:E] *= 1.6
            t.step()
    records = t.health
    assert [r.step for r in records] == [0, 2, 4, 6]
    assert {r.path for r in records} == {mode}
    assert [r.call for r in records] == [0, 4, 8, 12]  # the first call of each measured step
    for r, want in zip(records, wants, strict=True):
        _close_heads(r, want)
    tops = [max(w["max_logit"]) for w in wants]
    assert all(b > a for a, b in itertools.pairwise(tops))  # the construction grows them


def test_causal_sdpa_with_weight_and_gradient_norms() -> None:
    """A direct SDPA call with ``is_causal=True``: row 0 sees one key (left out of ``entropy_min``).

    Witness: ``_witness`` with the causal triangle built by the test; the Q/K/V
    slice weight norms from the test's own ``torch.linalg.vector_norm`` of
    each weight; gradient norms read from ``.grad`` right after the test's
    backward, before its optimizer step and ``zero_grad()``.
    """
    model = CausalSDPA()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(B, L, E)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    wants, weights, grads = [], [], []
    with qkvtrace.trace(model, keep="changes", health_every=3) as t:
        for step in range(6):
            if step % 3 == 0:
                q, k, _ = model.heads(x.detach())
                wants.append(_witness(q.detach(), k.detach(), 1 / math.sqrt(D), causal))
                weights.append({p: float(torch.linalg.vector_norm(getattr(model, p).weight.detach())) for p in "qkv"})
            model(x).square().mean().backward()
            if step % 3 == 0:
                grads.append({p: float(torch.linalg.vector_norm(getattr(model, p).weight.grad)) for p in "qkv"})
            opt.step()
            opt.zero_grad()
            t.step()
            assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # removed at each step's end
    assert [r.step for r in t.health] == [0, 3]
    for r, want, wn, gn in zip(t.health, wants, weights, grads, strict=True):
        assert r.path == "sdpa" and r.reason is None
        _close_heads(r, want)
        _close([r.weight_norms[p] for p in "qkv"], [wn[p] for p in "qkv"])
        _close([r.grad_norms[p] for p in "qkv"], [gn[p] for p in "qkv"])


def test_blocks_of_query_rows_give_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores made a few query rows at a time (block bound lowered to 2 rows) still match the witness.

    Witness: ``_witness`` on the causal SDPA module's own Q and K.
    """
    monkeypatch.setattr(health_module, "_BLOCK_FLOATS", B * H * L * 2)
    model = CausalSDPA()
    x = torch.randn(B, L, E)
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1) as t:
        model(x)
        t.step()
        q, k, _ = model.heads(x)
    want = _witness(q, k, 1 / math.sqrt(D), torch.ones(L, L, dtype=torch.bool).tril())
    _close_heads(t.health[0], want)


class BiasedSDPA(CausalSDPA):
    """SDPA with a float ``attn_mask``: an ALiBi bias (``-slope_h·|i-j|``) and ``-inf`` above the diagonal."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        q, k, v = self.heads(x)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("rows", [None, 3], ids=["one-block", "blocks-of-3-rows"])
def test_an_alibi_bias_is_in_the_logits(rows: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float ``[H, L, L]`` mask: ALiBi slopes per head plus ``-inf`` above the diagonal; logits include the bias.

    Witness: ``_witness`` on logits the test computes itself, ``scale·q·kᵀ +
    bias`` from the module's Q and K, in one block and in blocks of 3 query rows.
    """
    if rows is not None:
        monkeypatch.setattr(health_module, "_BLOCK_FLOATS", B * H * L * rows)
    model = BiasedSDPA()
    x = torch.randn(B, L, E)
    slopes = torch.tensor([2.0 ** (-i) for i in range(1, H + 1)])
    pos = torch.arange(L)
    distance = (pos[:, None] - pos[None, :]).abs().float()
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    bias = (-slopes[:, None, None] * distance).masked_fill(~causal, float("-inf"))  # [H, L, L]
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1) as t:
        model(x, bias)
        t.step()
        q, k, _ = model.heads(x)
    logits = q.double() @ k.double().transpose(-2, -1) / math.sqrt(D) + bias.double()  # [B, H, L, L]
    # the witness reads row r's logits back as logits[r] · e_j: "queries" the logits, "keys" the identity
    eye = torch.eye(L, dtype=torch.float64).expand(B, H, L, L)
    want = _witness(logits.nan_to_num(neginf=0.0), eye, 1.0, causal)
    _close_heads(t.health[0], want)


def test_fused_encoder_layer_and_hand_written_attention() -> None:
    """The fused encoder layer (eval, no_grad) and attention written by hand give the witness's numbers.

    Hand-written attention gives its entropies from its own probabilities.
    Witness: ``_witness`` on Q and K from the layer's ``in_proj_weight`` and
    from the hand-written module's ``qkv``.
    """
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True).eval()
    hand = HandWritten()
    x = torch.randn(B, L, E)
    blocked = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    blocked[0, ..., -3:] = True
    with torch.no_grad():
        with qkvtrace.trace(layer, keep="changes", health_every=1) as t:
            layer(x)
            t.step()
        with qkvtrace.trace(hand, keep="changes", health_every=1) as th:
            hand(x, blocked)
            th.step()
        q, k = _mha_qk(layer.self_attn, x)
        want = _witness(q, k, 1 / math.sqrt(D), None)
        qh, kh, _ = (t_.reshape(B, L, H, D).transpose(1, 2) for t_ in hand.qkv(x).chunk(3, dim=-1))
        want_hand = _witness(qh, kh, 1 / math.sqrt(D), ~blocked)
    (r,) = t.health
    assert r.path == "fused_encoder_layer"
    _close_heads(r, want)
    (rh,) = th.health
    assert rh.path == "hand_written"
    _close_heads(rh, want_hand)


# -- a real optimizer --------------------------------------------------------------------------------


def _train(
    health_every: int | None, steps: int
) -> tuple[list[torch.Tensor], nn.MultiheadAttention, list[float], object]:
    """An MHA trained with Adam at a high learning rate (0.1) to copy token 0's input to every query.

    Returns the outputs, the module, the witness's max logit (over heads) at
    every 5th step before that step's call, and the trace (``None`` untraced).
    """
    gen = torch.Generator()  # its default state: the same weights and input for every run
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(B, L, E, generator=gen)
    target = x[:, :1].expand(B, L, E)
    opt = torch.optim.Adam(mha.parameters(), lr=0.1)
    outs: list[torch.Tensor] = []
    tops: list[float] = []
    t = qkvtrace.trace(mha, keep="changes", health_every=health_every) if health_every else None
    with t if t is not None else torch.enable_grad():
        for step in range(steps):
            if step % 5 == 0:
                q, k = _mha_qk(mha, x)
                tops.append(max(_witness(q, k, 1 / math.sqrt(D), None)["max_logit"]))
            out, _ = mha(x, x, x, need_weights=False)
            (out - target).square().mean().backward()
            outs.append(out.detach().clone())
            opt.step()
            opt.zero_grad()
            if t is not None:
                t.step()
    return outs, mha, tops, t


def test_high_learning_rate_training_grows_the_max_logit() -> None:
    """Adam at lr 0.1 sharpens attention onto token 0: the max logit grows, and the trace follows it.

    Witness: the test's own max logit over heads (``_witness`` on Q and K from
    ``in_proj_weight`` before each measured step's call) grows more than 4x
    over 30 steps, and each measured step's record equals it.
    """
    _, _, tops, t = _train(5, 30)
    assert tops[-1] > 4 * tops[0]  # the test's own computation shows the growth
    got = [max(h.max_logit for h in r.heads) for r in t.health]  # type: ignore[attr-defined]
    assert [r.step for r in t.health] == [0, 5, 10, 15, 20, 25]  # type: ignore[attr-defined]
    _close(got, tops)  # type: ignore[arg-type]


def test_outputs_and_weights_are_bit_identical_with_health_every_step() -> None:
    """Every step measured (``health_every=1``, gradient hooks included): outputs and trained weights unchanged.

    Witness: the same training run untraced (``torch.equal`` on every output and parameter).
    """
    outs, mha, _, _ = _train(None, 12)
    outs_t, mha_t, _, t = _train(1, 12)
    assert len(t.health) == 12  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_t, strict=True))
    for (name, a), (_, b) in zip(mha.named_parameters(), mha_t.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(not p._post_accumulate_grad_hooks for p in mha_t.parameters())  # type: ignore[attr-defined]


# -- the stream, summarize, TensorBoard -------------------------------------------------------------


def test_summarize_alerts_at_the_step_the_witness_crosses_the_threshold(tmp_path: Path) -> None:
    """``W_q`` doubled every step; ``qkvtrace summarize`` names the steps where the max logit and the entropy
    crossed their thresholds.

    Witness: the test's max logit and lowest head's mean entropy per step
    (``_witness``) and the documented thresholds (logit over 50 and over
    twice its first value; entropy under 1 nat and under half its first); TensorBoard's own
    reader for the per-head scalars; the stream's lines checked by ``qkvtrace validate``; the HTML page's and
    the notebook's curves hold the same values, a point per measured step.
    """
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    stream = tmp_path / "run.jsonl"
    writer = SummaryWriter(str(tmp_path / "tb"))
    wants = []
    with qkvtrace.trace(mha, keep="changes", health_every=1, stream_to=stream, tensorboard=writer) as t:
        for _ in range(9):
            q, k = _mha_qk(mha, x)
            wants.append(_witness(q, k, 1 / math.sqrt(D), None))
            mha(x, x, x, need_weights=False)
            with torch.no_grad():
                mha.in_proj_weight[:E] *= 2.0
            t.step()
    writer.close()
    tops = [max(w["max_logit"]) for w in wants]
    crossed = next(s for s, v in enumerate(tops) if v > 50 and v > 2 * tops[0])
    lows = [min(w["entropy_mean"]) for w in wants]
    fell = next(s for s, v in enumerate(lows) if v < 1 and v < 0.5 * lows[0])
    page = tmp_path / "health.html"
    env = {"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "qkvtrace", "summarize", str(stream), "--html", str(page)]
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    assert out.returncode == 1, out.stderr  # an alert: the documented exit code of a check that found a problem
    alert = next(line for line in out.stdout.splitlines() if line.startswith("alert (root)"))
    said = dict(part.strip().split(" ", 1) for part in alert.removeprefix("alert (root):").split(";"))
    assert f"at step {crossed}:" in said["max"] and said["max"].startswith("logit")
    assert f"at step {fell}:" in said["entropy"]
    # the same alert from Python, without the stream
    (found,) = t.health_alerts
    assert found["module"] == "" and f"max logit {tops[crossed]:.3g} at step {crossed}:" in found["alert"]
    assert f"at step {fell}:" in found["alert"].split("entropy", 1)[1]
    lines = [json.loads(x) for x in stream.read_text().splitlines()]
    assert [ln["step"] for ln in lines if ln["kind"] == "health"] == list(range(9))
    check = subprocess.run([sys.executable, "-m", "qkvtrace", "validate", str(stream)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # the page's and the notebook's curves: a point per measured step, its value in its tooltip
    for text in (page.read_text(), t.health._repr_html_(), t._repr_html_()):
        points = re.findall(r"<title>max logit at step (\d+): ([-0-9.e+]+)</title>", text)
        assert [int(step) for step, _ in points] == list(range(9))
        _close([float(v) for _, v in points], tops, rel=1e-3)
        low = re.findall(r"<title>entropy \(nats\) at step (\d+): ([-0-9.e+]+)</title>", text)
        _close([float(v) for _, v in low], lows, rel=1e-3)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for head in range(H):
        got = [e.value for e in events.Scalars(f"qkvtrace/health/(root)/max_logit/head{head}")]
        _close(got, [w["max_logit"][head] for w in wants])  # type: ignore[arg-type]


def test_summarize_of_a_healthy_run_says_no_alert_and_exits_0(tmp_path: Path) -> None:
    """The same run with ``W_q`` left as it is: no alert, exit 0.

    Witness: the test's max logit and lowest head's mean entropy per step (``_witness``): none crosses the
    documented thresholds (the premise, asserted), and the command's exit code and its line."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    stream = tmp_path / "run.jsonl"
    wants = []
    with qkvtrace.trace(mha, keep="changes", health_every=1, stream_to=stream) as t:
        for _ in range(5):
            q, k = _mha_qk(mha, x)
            wants.append(_witness(q, k, 1 / math.sqrt(D), None))
            mha(x, x, x, need_weights=False)
            t.step()
    assert max(max(w["max_logit"]) for w in wants) < 50 and min(min(w["entropy_mean"]) for w in wants) > 1
    env = {"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "qkvtrace", "summarize", str(stream)], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no alert:" in out.stdout and "\nalert" not in out.stdout
    assert t.health_alerts == []


def test_health_needs_a_long_run() -> None:
    """``health_every`` without ``keep="changes"``, or not a count, is a usage error (ValueError).

    Witness: the calls the test makes.
    """
    with pytest.raises(ValueError, match="keep='changes'"):
        qkvtrace.trace(nn.Linear(1, 1), health_every=10)
    with pytest.raises(ValueError, match="health_every"):
        qkvtrace.trace(nn.Linear(1, 1), keep="changes", health_every=-1)


def test_a_flex_attention_call_says_what_it_cannot_give() -> None:
    """A flex_attention call has a health record with no per-head values and the reason why.

    Witness: the flex_attention call built here (its ``score_mod`` and ``block_mask`` are the user's functions).
    """
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    class Flex(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return flex.flex_attention(q, q, q)

    model = Flex()
    with qkvtrace.trace(model, keep="changes", health_every=1) as t, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns once per process that flex runs uncompiled
        model(torch.randn(1, 2, 8, 8))
        t.step()
    (r,) = t.health
    assert r.path == "flex" and r.heads == []
    assert r.reason is not None and "score_mod" in r.reason


def _profiled_host_reads() -> type:
    """``benchmarks/host_reads.py``'s profiler counter: the one the overhead benchmark prints."""
    return benchmark("host_reads").ProfiledHostReads  # type: ignore[no-any-return]


def test_a_measured_step_reads_nothing_back_before_t_step() -> None:
    """A measured step's forward and backward (padding mask, causal SDPA) add no host read; ``t.step()`` reads.

    Witness: ``torch.profiler``'s aten ops (every read to the host goes through ``_local_scalar_dense``,
    ``nonzero``, ``equal`` or ``is_nonzero``), counted for the untraced step and for the measured one.
    """
    counter = _profiled_host_reads()
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    causal = CausalSDPA()
    x = torch.randn(B, L, E)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True

    def step() -> None:
        mha(x, x, x, key_padding_mask=pad, need_weights=False)[0].sum().backward()
        causal(x).sum().backward()

    with counter() as plain:
        step()
    model = nn.ModuleDict({"mha": mha, "causal": causal})
    with qkvtrace.trace(model, keep="changes", health_every=2) as t:
        step()  # step 0: measured, and each call signature seen once
        t.step()
        step()
        t.step()
        with counter() as traced:
            step()  # step 2: measured
        t.step()
    assert {r.step for r in t.health} == {0, 2} and len(t.health) == 4
    assert all(h.max_logit is not None for r in t.health for h in r.heads)
    assert traced.count == plain.count, traced.ops


class FoldedSoftcap(nn.Module):
    """Attention written by hand on ``[B·H, T, d]``: ALiBi bias and soft-cap (in ``order``), a causal ``where``."""

    def __init__(self, bias: torch.Tensor, order: str) -> None:
        super().__init__()
        self.num_heads = H
        self.order = order
        self.qkv = nn.Linear(E, 3 * E)
        self.register_buffer("alibi", bias)  # [B·H, L, L]

    def heads(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [t.reshape(B, L, H, D).transpose(1, 2).reshape(B * H, L, D) for t in self.qkv(x).chunk(3, dim=-1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        if self.order == "bias_then_cap":
            s = torch.baddbmm(self.alibi, q, k.transpose(1, 2), alpha=1 / math.sqrt(D))
            s = torch.tanh(s / 5.0) * 5.0
        else:
            s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
            s = torch.tanh(s / 5.0) * 5.0 + self.alibi
        s = torch.where(torch.ones(L, L, dtype=torch.bool).tril(), s, torch.finfo(s.dtype).min)
        return torch.bmm(torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("order", ["cap_then_bias", "bias_then_cap"])
def test_hand_written_folded_heads_with_softcap_and_alibi(order: str) -> None:
    """``[B·H, T, d]`` attention with a soft-cap and an ALiBi bias, causal: the logits are rebuilt from Q, K,
    scale, soft-cap then bias, and kept only where their softmax is the model's own probabilities.

    Witness: the test's own float64 logits from the module's ``qkv`` (the
    module's formula, written here), read by ``_witness`` as rows against the
    identity. With the bias added before the cap the rebuilt logits are not
    the model's: ``max_logit`` is ``None`` and says why; the entropies (from
    the model's probabilities) still equal the witness's.
    """
    slopes = torch.tensor([2.0 ** (-i) for i in range(1, H + 1)])
    pos = torch.arange(L)
    alibi = (-slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()).repeat(B, 1, 1)  # [B·H, L, L]
    model = FoldedSoftcap(alibi, order)
    x = torch.randn(B, L, E) * 3
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1) as t:
        model(x)
        t.step()
        q, k, _ = model.heads(x)
    scores = q.double() @ k.double().transpose(1, 2) / math.sqrt(D)
    if order == "bias_then_cap":
        logits = torch.tanh((scores + alibi.double()) / 5.0) * 5.0
    else:
        logits = torch.tanh(scores / 5.0) * 5.0 + alibi.double()
    eye = torch.eye(L, dtype=torch.float64).expand(B, H, L, L)
    want = _witness(logits.view(B, H, L, L), eye, 1.0, torch.ones(L, L, dtype=torch.bool).tril())
    (r,) = t.health
    assert r.path == "hand_written"
    for name in ("entropy_mean", "entropy_min"):
        _close(_heads(r, name), want[name])
    if order == "cap_then_bias":
        _close(_heads(r, "max_logit"), want["max_logit"])
    else:
        assert _heads(r, "max_logit") == [None] * H
        assert r.reason is not None and "do not give its probabilities" in r.reason


class GroupedSDPA(nn.Module):
    """Grouped-query attention: 4 query heads share 2 key/value heads (``enable_gqa=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(E, E, bias=False)
        self.kv = nn.Linear(E, E, bias=False)  # 2 heads of K, 2 of V

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q(x).reshape(B, L, H, D).transpose(1, 2)
        k, v = (t.reshape(B, L, H // 2, D).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_grouped_query_attention_pairs_each_query_head_with_its_key_head() -> None:
    """``enable_gqa=True``: query head h is scored against key head ``h // 2``.

    Witness: ``_witness`` on the module's Q and its K repeated per group by the test (``repeat_interleave``).
    """
    if "enable_gqa" not in str(getattr(F.scaled_dot_product_attention, "__doc__", "")):
        pytest.skip("this PyTorch's SDPA has no enable_gqa")
    model = GroupedSDPA()
    x = torch.randn(B, L, E)
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1) as t:
        model(x)
        t.step()
        q, k, _ = model.heads(x)
    want = _witness(q, k.repeat_interleave(2, dim=1), 1 / math.sqrt(D), None)
    (r,) = t.health
    assert len(r.heads) == H
    _close_heads(r, want)


def test_a_long_sequence_is_measured_without_its_whole_map() -> None:
    """T = 4096, causal SDPA: no allocation during the measured call and ``t.step()`` is as large as the
    ``[T, T]`` float32 map (64 MB); the values are still there.

    Witness: ``torch.profiler``'s memory events (``profile_memory=True``), and the map's size computed here.
    """
    from torch.profiler import ProfilerActivity, profile

    t_len = 4096
    model = CausalSDPA()
    x = torch.randn(1, t_len, E)
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1) as t:
        model(x)
        t.step()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(x)
            t.step()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert biggest < t_len * t_len * 4, f"{biggest / 2**20:.0f} MB in one allocation"
    assert len(t.health) == 2 and all(h.max_logit is not None for h in t.health[-1].heads)


def test_merge_sets_the_ranks_health_side_by_side_and_marks_the_rank_that_alerts_alone(tmp_path: Path) -> None:
    """Two ranks' streams: rank 1 doubles ``W_q`` every step, rank 0 keeps it. ``qkvtrace merge`` shows each
    rank's max logit first → last and alert, and marks the module: rank 1 alerts, rank 0 does not.

    Witness: the test's max logit per step (``_witness``) on each rank, and the documented thresholds (over 50
    and over twice the first value). Fault caught: health lines left out of the merge."""
    tops: dict[int, list[float]] = {}
    x = torch.randn(B, L, E)
    for rank, growth in ((0, 1.0), (1, 2.0)):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(E, H, batch_first=True)
        tops[rank] = []
        with qkvtrace.trace(mha, keep="changes", health_every=1, stream_to=tmp_path / f"run.rank{rank}.jsonl") as t:
            for _ in range(8):
                q, k = _mha_qk(mha, x)
                tops[rank].append(max(_witness(q, k, 1 / math.sqrt(D), None)["max_logit"]))
                mha(x, x, x, need_weights=False)
                with torch.no_grad():
                    mha.in_proj_weight[:E] *= growth
                t.step()
    env = {"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    merged_file = tmp_path / "merged.json"
    out = subprocess.run([sys.executable, "-m", "qkvtrace", "merge", str(tmp_path), "--json", str(merged_file)],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr  # the same kernels on both ranks
    [health] = json.loads(merged_file.read_text())["health"]
    assert health["module"] == "" and health["differs"] is True
    by_rank = {r["rank"]: r for r in health["ranks"]}
    for rank in (0, 1):
        _close(by_rank[rank]["max_logit"], [tops[rank][0], tops[rank][-1]], rel=1e-3)
    crossed = next(s for s, v in enumerate(tops[1]) if v > 50 and v > 2 * tops[1][0])
    assert by_rank[0]["alert"] is None and f"max logit {tops[1][crossed]:.3g} at step {crossed}:" in by_rank[1]["alert"]
    assert "attention health across ranks" in out.stdout and "ranks differ" in out.stdout
    check = subprocess.run([sys.executable, "-m", "qkvtrace", "validate", str(merged_file)], capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


class _Scalars:
    """A writer with TensorBoard's ``add_scalar`` that keeps what it was given."""

    def __init__(self) -> None:
        self.got: dict[str, list[tuple[int, float]]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.got.setdefault(tag, []).append((step, float(value)))


def test_every_health_number_reaches_tensorboard_and_the_stream(tmp_path: Path) -> None:
    """One measured training step of a causal SDPA module: per head its max logit, mean and least entropy, and
    its Q, K and V weight and gradient norms, each as a scalar of that step and in the stream's health line.

    Witness: ``_witness`` with the causal triangle built here; the norms of each projection's weight and of
    its ``.grad`` read by the test right after its backward. Catches a health number, a head or a part not
    written, written under another tag or step, or a health line missing from the stream."""
    model = CausalSDPA()
    x = torch.randn(B, L, E)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q, k, _ = model.heads(x)
    want = _witness(q.detach(), k.detach(), 1 / math.sqrt(D), causal)
    weights = {p: float(torch.linalg.vector_norm(getattr(model, p).weight.detach())) for p in "qkv"}
    scalars, stream = _Scalars(), tmp_path / "run.jsonl"
    with qkvtrace.trace(model, keep="changes", health_every=1, tensorboard=scalars, stream_to=stream) as t:
        model(x).square().mean().backward()
        grads = {p: float(torch.linalg.vector_norm(getattr(model, p).weight.grad)) for p in "qkv"}
        t.step()
    tag = "qkvtrace/health/(root)"
    for name in ("max_logit", "entropy_mean", "entropy_min"):
        got = [scalars.got[f"{tag}/{name}/head{h}"] for h in range(H)]
        assert [steps for steps, _ in (g[0] for g in got)] == [0] * H and all(len(g) == 1 for g in got)
        _close([g[0][1] for g in got], want[name])
    for kind, norms in (("weight_norm", weights), ("grad_norm", grads)):
        got = [scalars.got[f"{tag}/{kind}/{p}"] for p in "qkv"]
        assert all(len(g) == 1 and g[0][0] == 0 for g in got)
        _close([g[0][1] for g in got], [norms[p] for p in "qkv"])
    health = [json.loads(line) for line in stream.read_text().splitlines() if '"health"' in line]
    assert [(h["kind"], h["step"], h["module"]) for h in health] == [("health", 0, "")]
    _close([h["max_logit"] for h in health[0]["heads"]], want["max_logit"])


def test_each_module_measured_in_a_step_gets_its_health_line(tmp_path: Path) -> None:
    """Two causal SDPA modules, one after the other, measured at step 0, streamed without TensorBoard: a
    health line for each.

    Witness: the two modules the test put in the model (named ``0`` and ``1`` by ``nn.Sequential``). Catches
    the lines after the first one of a step left out."""
    model = nn.Sequential(CausalSDPA(), CausalSDPA())
    stream = tmp_path / "run.jsonl"
    with torch.no_grad(), qkvtrace.trace(model, keep="changes", health_every=1, stream_to=stream) as t:
        model(torch.randn(B, L, E))
        t.step()
    health = [json.loads(line) for line in stream.read_text().splitlines() if '"health"' in line]
    assert sorted((h["step"], h["module"]) for h in health) == [(0, "0"), (0, "1")]
