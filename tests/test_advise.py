"""``qkvtrace advise``: each rule on a model built to trigger it, measured on copies.

Witnesses: ``torch.profiler`` on a copy the test changes by hand (which kernel the changed call really runs),
outputs computed here with and without the change, the user's model's own state (parameters, buffers, hooks,
training flag, RNG) read before and after, and the JSON Schema for the file.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from qkvtrace.analyses.advise import RECOMMENDED, advise

E, H = 64, 8
REPEATS = 3


def _ops(fn: Any) -> set[str]:
    """The aten ops one un-instrumented run of ``fn`` calls (the profiler's own event names)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def _by_change(advice: Any, text: str) -> Any:
    found = [m for m in advice.measured if m.change == text]
    assert found, [m.change for m in advice.measured]
    return found[0]


class _Caller(nn.Module):
    """A model that calls its MultiheadAttention as people write it (query, key, value, maybe a mask)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn(x, x, x, attn_mask=mask)[0]


def test_need_weights_false_moves_a_training_call_onto_sdpa() -> None:
    """Witness: the profiler on a copy called here with need_weights=False (an SDPA kernel runs) and on one with the
    default (none runs); the outputs of both, compared here."""
    m = _Caller(batch_first=True)
    x = torch.randn(2, 16, E)
    changed = copy.deepcopy(m.attn).train()
    sdpa_ops = {o for o in _ops(lambda: changed(x, x, x, need_weights=False)) if "scaled_dot_product" in o}
    assert sdpa_ops and not {o for o in _ops(lambda: changed(x, x, x)) if "scaled_dot_product" in o}
    advice = advise(m, x, train=True, repeats=REPEATS)
    row = _by_change(advice, "need_weights=False")
    assert (row.path, row.backend) == ("fallback", None)
    assert row.path_after == "fallback" and row.backend_after is not None
    assert any(row.backend_after.split("_")[0].lower() in o for o in sdpa_ops), (row.backend_after, sdpa_ops)
    with torch.no_grad():
        want = float((changed(x, x, x, need_weights=False)[0] - changed(x, x, x)[0]).abs().max())
    assert row.max_abs_diff == pytest.approx(want, abs=1e-6)
    assert row.max_abs_grad_diff is not None and len(row.ratios) == REPEATS
    assert "weights" in row.gives_up and not row.verdict.startswith("changes results")
    # the call moved and its results agree, so the timing decides, by the rule docs/advise.md states
    assert (row.verdict == RECOMMENDED) is (max(row.ratios) < 1.0), (row.verdict, row.ratios)


def test_batch_first_alone_does_not_help_and_is_not_recommended() -> None:
    """Witness: the profiler on a copy changed here to batch_first=True, still with grad on: PyTorch's fused MHA
    kernel (aten::_native_multi_head_attention) does not run, so the 'obvious' change buys no other path."""
    m = _Caller(batch_first=False).eval()
    x = torch.randn(16, 2, E)  # (L, N, E)
    changed = copy.deepcopy(m.attn)
    changed.batch_first = True
    xb = x.transpose(0, 1)
    assert "aten::_native_multi_head_attention" not in _ops(lambda: changed(xb, xb, xb))
    with torch.inference_mode():
        assert "aten::_native_multi_head_attention" in _ops(lambda: changed(xb, xb, xb))
    advice = advise(m, x, repeats=REPEATS)
    alone = _by_change(advice, "batch_first=True for attn (inputs as (batch, sequence, features))")
    assert alone.verdict.startswith("no other path") and alone.verdict != RECOMMENDED
    assert alone.reason == "batch_first was not True" and "grad is enabled" in (alone.reason_after or "")
    both = [m for m in advice.measured if m.change.startswith("batch_first=True") and "inference_mode" in m.change]
    assert both and both[0].path_after == "fast"  # PyTorch's next reason answered too: the fused kernel runs
    assert both[0].max_abs_diff is not None and both[0].max_abs_diff < 1e-4
    assert alone.where is not None and alone.where.startswith(__file__)


def test_a_float_mask_of_zeros_and_minus_infinity_becomes_a_boolean_one() -> None:
    """Witness: the profiler on a copy called here with the boolean mask (the fused kernel runs), and the outputs
    with the float and the boolean mask, computed here."""
    m = _Caller(batch_first=True).eval()
    x = torch.randn(2, 16, E)
    causal = torch.full((16, 16), float("-inf")).triu(1)
    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in _ops(lambda: m.attn(x, x, x, attn_mask=causal.isneginf()))
        want = float((m(x, causal) - m(x, causal.isneginf())).abs().max())
        advice = advise(m, x, causal, repeats=REPEATS)
    row = _by_change(advice, "a boolean mask (True = blocked) instead of a float one")
    assert row.reason == "floating-point masks are not supported for fast path."
    assert row.path_after == "fast" and row.max_abs_diff == pytest.approx(want, abs=1e-6)


def test_a_float_mask_that_is_a_bias_is_said_to_change_results() -> None:
    """Witness: the outputs with the float bias and with its boolean reading, computed here, differ."""
    m = _Caller(batch_first=True).eval()
    x = torch.randn(2, 16, E)
    bias = torch.linspace(-2.0, 0.0, 16).expand(16, 16).contiguous()  # a bias, not a mask
    with torch.no_grad():
        assert float((m(x, bias) - m(x, bias.isneginf())).abs().max()) > 1e-3
        advice = advise(m, x, bias, repeats=REPEATS)
    row = _by_change(advice, "a boolean mask (True = blocked) instead of a float one")
    assert row.verdict.startswith("changes results")


def test_hooks_on_an_encoder_layer_are_the_reason_and_their_removal_is_measured() -> None:
    """Witness: the profiler on a copy without the hook (the fused encoder-layer kernel runs) and with it (not); the
    hook's own record of the module objects it ran for."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 128, dropout=0.0, batch_first=True).eval()
    seen: list[int] = []  # which module objects the hook ran for (deep copies carry the model's hooks with them)
    layer.register_forward_hook(lambda mod, _i, _o: seen.append(id(mod)))
    x = torch.randn(2, 16, E)
    bare = copy.deepcopy(layer)
    bare._forward_hooks.clear()
    with torch.no_grad():
        assert "aten::_transformer_encoder_layer_fwd" in _ops(lambda: bare(x))
        assert "aten::_transformer_encoder_layer_fwd" not in _ops(lambda: layer(x))
        seen.clear()
        advice = advise(layer, x, repeats=REPEATS)
    row = next(m for m in advice.measured if m.change.startswith("no forward hooks"))
    assert row.path_after == "fused_encoder_layer" and "hooks" in (row.reason or "")
    assert seen and id(layer) not in seen  # only copies were called, never the user's layer
    assert len(layer._forward_hooks) == 1


def test_transformers_eager_attention_becomes_sdpa() -> None:
    """Witness: the profiler on a copy switched here to attn_implementation="sdpa" (an SDPA kernel runs)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=100,
                                     attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 16))
    changed = copy.deepcopy(model)
    changed.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert any("scaled_dot_product" in o for o in _ops(lambda: changed(ids)))
        advice = advise(model, ids, repeats=REPEATS)
    row = _by_change(advice, 'attn_implementation="sdpa" (transformers)')
    assert row.path == "hand_written" and row.path_after == "sdpa"
    assert row.max_abs_diff is not None and row.max_abs_diff < 1e-3
    assert model.config._attn_implementation == "eager"  # the user's model keeps its attention


def test_the_users_model_and_random_state_are_untouched() -> None:
    """Witness: the model's parameters, buffers, training flag and hooks, and torch's RNG state, read here before
    and after."""
    m = _Caller(batch_first=False).train()
    hook = m.attn.register_forward_pre_hook(lambda *_: None)
    x = torch.randn(16, 2, E)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.random.get_rng_state()
    forward = m.attn.forward
    advise(m, x, repeats=2)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert m.training and m.attn.training and m.attn.batch_first is False
    assert list(m.attn._forward_pre_hooks) == [hook.id] and m.attn.forward == forward
    assert all(p.grad is None for p in m.parameters())


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, check=False)  # fmt: skip


def test_cli_writes_json_under_its_schema(tmp_path: Path) -> None:
    """Witness: jsonschema's validator with the shipped schema file, and the demo's own reason read by the
    profiler (demo:mha in eval with grad on: the fused kernel does not run)."""
    from jsonschema import Draft202012Validator

    out = tmp_path / "advice.json"
    run = _cli("advise", "demo:mha", "--repeats", "2", "--json", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    changes = {m["change"] for m in data["measured"]}
    assert {"need_weights=False", "run the forward under torch.inference_mode()"} <= changes
    assert "fastest measured" in run.stdout or "none is recommended" in run.stdout
    schema = json.loads((Path(__file__).parent.parent / "qkvtrace" / "schemas" / "advise-1.json").read_text())
    Draft202012Validator(schema).validate(data)
    assert data["schema"] == "qkvtrace.advise/1" and data["measured"]


@pytest.mark.parametrize("args, needle", [
    (["advise", "no_such_module_xyz:build"], "no_such_module_xyz"),
    (["advise", "demo:mha", "--repeats", "1"], "--repeats 1"),
    (["advise", "demo:mha", "--budget", "0"], "--budget 0"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    """Witness: the exit code and stderr of the command, read here."""
    run = _cli(*args, cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], run.stderr


def test_budget_lists_what_was_not_measured() -> None:
    """Witness: a budget of a millisecond, set here: nothing after the first trace can be measured within it."""
    m = _Caller(batch_first=False).eval()
    advice = advise(m, torch.randn(16, 2, E), repeats=2, budget=0.001)
    assert advice.unmeasured and all(r.verdict.startswith("not measured") for r in advice.measured)


class _HandWritten(nn.Module):
    """Causal attention written by hand, as many models do (optionally with soft-capped logits)."""

    def __init__(self, softcap: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(E, 3 * E)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, E // 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (E // 4) ** 0.5
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, E)


def test_attention_written_by_hand_is_measured_against_sdpa_on_its_shapes() -> None:
    """Witness: the profiler on an SDPA call made here on tensors of the recorded shapes (which kernel runs), and
    the hand-written form and SDPA computed here on the same tensors (their largest difference)."""
    m = _HandWritten().eval()
    x = torch.randn(2, 32, E)
    q, k, v = (torch.randn(2, 4, 32, E // 4) for _ in range(3))
    ops = _ops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    advice = advise(m, x, repeats=REPEATS)
    (row,) = advice.measured
    assert row.path == "hand_written" and row.path_after == "sdpa"
    assert any(row.backend_after.split("_")[0].lower() in o for o in ops if "scaled_dot_product" in o), ops
    assert row.change.startswith("F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)")
    written = (q @ k.transpose(-2, -1) * 0.25).masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1),
                                                          float("-inf")).softmax(-1) @ v  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert row.max_abs_diff is not None and row.max_abs_diff < 1e-4 and float((written - sdpa).abs().max()) < 1e-4
    assert row.where is not None and row.where.startswith(__file__)
    assert "weights" in row.gives_up and len(row.ratios) == REPEATS


def test_soft_capped_attention_written_by_hand_is_settled_with_the_reason() -> None:
    """Witness: the soft-cap the test's own model applies (tanh), which SDPA has no argument for."""
    advice = advise(_HandWritten(softcap=30.0).eval(), torch.randn(2, 16, E), repeats=2)
    assert not advice.measured
    (settled,) = advice.settled
    assert settled["path"] == "hand_written" and "soft-capp" in settled["why"]


def _line_of(fn: Any, text: str) -> str:
    """``file:line`` of the first line of ``fn``'s source that holds ``text``, read with ``inspect``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return f"{inspect.getsourcefile(fn)}:{start + next(i for i, line in enumerate(lines) if text in line)}"


class _Slow(nn.Module):
    """Attention written by hand, then 50 ms of other work: the attention core is a small share of the model's time."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _HandWritten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:

        time.sleep(0.05)
        return self.attn(x)


def test_attention_by_hand_gives_the_whole_model_figure_beside_the_core_and_points_at_its_line(
    tmp_path: Path,
) -> None:
    """Witness: the 50 ms sleep the test model adds (making SDPA of its (2, 4, 32, 16) attention the whole model
    cannot gain more than a few percent, whatever the core alone gains), and the line of the test model's own source
    that computes ``softmax @ v``, read with ``inspect``."""
    with torch.no_grad():
        advice = advise(_Slow().eval(), torch.randn(2, 32, E), repeats=REPEATS)
    (row,) = advice.measured
    assert row.measured_on == "core" and len(row.model_ratios) == REPEATS
    assert row.core_share is not None and row.core_share < 0.2
    assert row.model_median is not None and row.model_median > 0.8, (row.median, row.model_median)
    assert row.where == _line_of(_HandWritten.forward, "@ v")
    from rich.console import Console

    from qkvtrace.render.advise_render import advise_table

    console = Console(width=200, record=True, color_system=None)
    console.print(advise_table(advice))
    text = " ".join(console.export_text().split())
    assert "attention core alone" in text and f"whole model ≈ {row.model_median:.2f}×" in text


def test_training_mha_with_dropout_names_dropout_as_what_forces_math(tmp_path: Path) -> None:
    """Witness: PyTorch's own warning when the flash kernel is forced here on tensors of the call's shapes with the
    module's dropout; and that nothing is timed, so the footer must not claim repetitions."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, H, 16, E // H)
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    lines = [line for w in caught for line in str(w.message).splitlines() if "dropout" in line]
    words = [line.split(" (Triggered")[0].strip() for line in lines]  # PyTorch appends where in its C++ it warned
    assert words, [str(w.message) for w in caught]
    (tmp_path / "drop.py").write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention({E}, {H}, dropout=0.1, batch_first=True)

            def forward(self, x):
                return self.attn(x, x, x, need_weights=False)[0]

        def build():
            torch.manual_seed(0)
            return Model(), torch.randn(2, 16, {E})
    """))
    run = _cli("advise", "drop.py:build", "--train", "--repeats", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "SDPA ran MATH" in text and words[0] in text and "dropout=0.1" in text, text
    assert "repetitions" not in text and "nothing was timed" in text
class _PaceClock:
    """The test's own clock, handed to ``advise``: it moves only as :class:`_Paced` says its calls take."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


_PACE = _PaceClock()


class _Paced(nn.MultiheadAttention):
    """A MultiheadAttention whose calls take as long as the test says, on its clock: ``TODAY`` seconds with the
    weights asked for (as called), and per call of this copy without them (the change) the next of ``changed``
    (the last repeats)."""

    TODAY = 0.03

    def __init__(self, changed: list[float]) -> None:
        super().__init__(E, H, batch_first=True)
        self.changed, self.calls = changed, 0

    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None, need_weights: bool = True,
                attn_mask: Any = None, average_attn_weights: bool = True, is_causal: bool = False) -> Any:  # fmt: skip
        out = super().forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                              is_causal)  # fmt: skip
        if need_weights:
            _PACE.now += self.TODAY
        else:
            _PACE.now += self.changed[min(self.calls, len(self.changed) - 1)]
            self.calls += 1
        return out


#: changed-call durations: a copy's first two calls are its trace and the output comparison, then one call a
#: repetition (TODAY is longer than advise's 0.05 s sample, so one loop a repetition)
PACES = {
    "faster in every repetition": ([0.02] * 2 + [0.02] * 5, True),
    "faster in all but the last": ([0.02] * 2 + [0.02] * 4 + [0.045], False),
    "slower in all but the first": ([0.02] * 2 + [0.02] + [0.045] * 4, False),
}


@pytest.mark.parametrize("pace", sorted(PACES))
def test_recommended_only_when_faster_in_every_repetition(pace: str) -> None:
    """The verdict on a change that moves the call (need_weights=False: onto SDPA) and keeps its results, timed by
    the test: recommended only when every repetition was faster.

    Witness: the times written here, on the test's clock (today 30 ms a call; the change 20 ms, or 45 ms in the
    repetitions the pace names: within ten times of the others, so a measurement, not a broken sample), and the
    rule computed here from them; the ratios advise recorded must show the same pattern, exactly.
    """
    durations, faster_every_time = PACES[pace]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = _Paced(durations)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x)[0]

    advice = advise(Model(), torch.randn(2, 8, E), train=True, repeats=5, clock=_PACE)
    row = _by_change(advice, "need_weights=False")
    assert (row.path, row.backend) == ("fallback", None) and row.backend_after is not None  # the call moved
    assert row.max_abs_diff is not None and row.max_abs_diff < 1e-4  # and its results agree
    slow = [d > _Paced.TODAY for d in durations[2:]]
    assert row.ratios == pytest.approx([1.5 if s else 2 / 3 for s in slow]), row.ratios  # the premise: the clock
    assert row.discarded == 0
    assert (row.verdict == RECOMMENDED) is faster_every_time, row.verdict
    assert (row in advice.recommended) is faster_every_time
