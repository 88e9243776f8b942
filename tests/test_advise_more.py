"""``qkvtrace.analyses.advise``'s parts one at a time:
the JSON it writes, what a unit of work returns, how outputs are compared,
how time is judged and the verdict worded, and what the advisor records about itself.

Witnesses: the JSON Schema shipped for the file and Python's own ``json`` and ``statistics``; gradients computed here
with ``torch.autograd``; sleeps and outputs the test's own callables produce (so timing is set by the test, never
read from the machine's luck); PyTorch's own warning words; and the rules module's candidates for calls traced here.
"""

from __future__ import annotations

import copy
import inspect
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.analyses.advice_rules import Candidate, candidates_for
from qkvtrace.analyses.advise import (
    ADVISE_SCHEMA,
    MAX_JOINED,
    RECOMMENDED,
    Advice,
    Measured,
    _judge,
    _max_diff,
    _measure,
    _next_changes,
    _Run,
    _same_call,
    _tensors,
    _traced,
    _verdict,
    advise,
)
from qkvtrace.render.advise_render import advise_table

E, H = 32, 4
SCHEMA = Path(__file__).parent.parent / "qkvtrace" / "schemas" / "advise-1.json"


def _keep(_model: nn.Module) -> tuple[None, list[str]]:
    return None, []


def _cand(change: str = "a change", tolerance: float = 1e-4, drops_outputs: bool = False, apply: Any = _keep
          ) -> Candidate:  # fmt: skip
    return Candidate(change, "nothing", None, apply, tolerance, drops_outputs=drops_outputs)


def _row(**kw: Any) -> Measured:
    base: dict[str, Any] = {"call": 0, "module": "attn", "path": "fallback", "backend": None, "reason": "r",
                            "change": "a change", "scope": None, "gives_up": "nothing"}  # fmt: skip
    base.update(kw)
    return Measured(**base)


# -- the file -----------------------------------------------------------------------------------------------------


def test_saved_json_follows_the_schema_and_states_each_rows_spread(tmp_path: Path) -> None:
    """Witness: the shipped JSON Schema, and min/median/max of ratios written here (``statistics``); a row never
    timed has them null. The file is ``json.dumps(..., indent=2)`` of what it holds plus a newline, read back here.
    Catches a missing or misnamed schema/median/min/max key, min/max of an empty list, and a changed layout."""
    from jsonschema import Draft202012Validator

    timed = _row(ratios=[0.9, 0.5, 0.7], path_after="sdpa", backend_after="MATH", max_abs_diff=0.0, verdict=RECOMMENDED)
    untimed = _row(call=1, change="another", verdict="raised ValueError: no")
    advice = Advice(target="m.py:build", torch_version=torch.__version__, device="cpu", train=False, repeats=3,
                    measured=[timed, untimed], settled=[{"call": 2, "module": "b", "path": "fast", "backend": None,
                                                         "why": "already"}], seconds=1.5)  # fmt: skip
    out = tmp_path / "a.json"
    advice.save(out)
    text = out.read_text(encoding="utf-8")
    data = json.loads(text)
    Draft202012Validator(json.loads(SCHEMA.read_text())).validate(data)
    assert text == json.dumps(data, indent=2) + "\n"
    assert data["schema"] == "qkvtrace.advise/1" == ADVISE_SCHEMA
    first, second = data["measured"]
    assert (first["min"], first["median"], first["max"]) == (0.5, statistics.median([0.9, 0.5, 0.7]), 0.9)
    assert (second["min"], second["median"], second["max"]) == (None, None, None)
    assert first["ratios"] == [0.9, 0.5, 0.7] and second["change"] == "another"
    assert data["target"] == "m.py:build" and data["settled"][0]["why"] == "already"


# -- a unit of work -----------------------------------------------------------------------------------------------


def test_tensors_keeps_floating_tensors_from_nested_outputs() -> None:
    """Witness: the tensors put here into dicts, lists and tuples: integer tensors and other values are left out.
    Catches the integer filter dropped and the nested containers not walked."""
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    ids = torch.arange(3)
    got = _tensors({"x": [a, (b, ids)], "y": {"z": c}, "n": None, "i": 3})
    assert [id(t) for t in got] == [id(a), id(b), id(c)]
    assert _tensors(ids) == [] and _tensors((ids, 1.0)) == []


class _TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x) * scale, self.b(x).sum(0)


def test_a_training_unit_returns_its_own_gradients() -> None:
    """Witness: the gradients of sum(out * probe) computed here with ``torch.autograd.grad`` (probes: N(0, 1) from a
    generator set to 0, per output shape). Outputs of two shapes each get their own probe; the keyword argument is
    passed; the gradients one unit returned are not overwritten by the next unit. Catches kwargs dropped, a probe
    shared by every shape, no backward, gradients not returned or the wrong ones, and zero_grad keeping the tensors."""
    model = _TwoOut()
    x = torch.randn(6, 4)
    run = _Run(model, (x,), {"scale": 3.0}, train=True)
    outs, grads = run()
    ref = copy.deepcopy(model)
    o1, o2 = ref(x, 3.0)
    probe = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)) for o in (o1, o2)]
    want = torch.autograd.grad((o1 * probe[0]).sum() + (o2 * probe[1]).sum(), list(ref.parameters()))
    assert torch.allclose(outs[0], o1.detach()) and torch.allclose(outs[1], o2.detach())
    assert len(grads) == len(want) and all(torch.allclose(g, w, atol=1e-5) for g, w in zip(grads, want, strict=True))
    kept = [g.clone() for g in grads]
    run.args = (2.0 * x,)  # the next unit's gradients differ
    run()
    assert all(torch.equal(g, k) for g, k in zip(grads, kept, strict=True))


def test_an_inference_unit_returns_no_gradients_even_when_the_model_holds_some() -> None:
    """Witness: gradients the test leaves on the parameters by its own backward; an inference unit is no training
    step, so it returns none. Catches gradients returned outside ``train``."""
    model = _TwoOut()
    x = torch.randn(6, 4)
    sum(o.sum() for o in model(x)).backward()
    assert all(p.grad is not None for p in model.parameters())
    outs, grads = _Run(model, (x,), {}, train=False)()
    assert grads == [] and len(outs) == 2


def test_max_diff_compares_tensor_by_tensor() -> None:
    """Witness: differences of tensors written here. Different counts or shapes give ``None``; nothing to compare
    (no tensors, or only empty ones) gives 0.0. Catches the count check joined with 'and' (it would zip unequal
    lists), and a default of None/1.0 or none at all for empty lists."""
    a = [torch.zeros(3), torch.ones(2)]
    b = [torch.zeros(3), torch.tensor([1.0, 1.5])]
    assert _max_diff(a, b) == 0.5
    assert _max_diff(a, b[:1]) is None
    assert _max_diff([torch.zeros(3)], [torch.zeros(4)]) is None
    assert _max_diff([], []) == 0.0
    assert _max_diff([torch.zeros(0)], [torch.zeros(0)]) == 0.0


# -- which call after a change ------------------------------------------------------------------------------------


class _Thrice(nn.Module):
    """One MultiheadAttention called three times, each call told apart by its query length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.attn(x[:, :n], x, x)[0] for n in (2, 3, 4)]
        return torch.cat(outs, 1)


def test_same_call_picks_the_same_occurrence_or_falls_back_to_the_first() -> None:
    """Witness: the query lengths (2, 3, 4) the test model gives its three calls, read from each traced call's shape.
    Catches the occurrence ignored, an index one past the end read, and a fallback to the second call or to a call
    that does not exist."""
    import qkvtrace

    model = _Thrice().eval()
    with qkvtrace.trace(model) as t:
        model(torch.randn(2, 4, E))
    calls = t.result.calls
    mine = [c for c in calls if c.module == "attn"]
    assert len(mine) == 3
    assert [_same_call(calls, "attn", i) for i in range(3)] == mine
    assert _same_call(calls, "attn", 3) is mine[0] and _same_call(calls, "attn", 7) is mine[0]
    assert _same_call(calls, "nope", 0) is None


def test_traced_records_paths_but_no_gradients_or_routes() -> None:
    """Witness: a plain ``qkvtrace.trace`` of the same training unit records gradients and routes by default; the
    advisor's trace is only for paths and kernels, so it records neither. Catches gradients/routes switched on."""
    import qkvtrace

    model = nn.MultiheadAttention(E, H, batch_first=True).train()
    x = torch.randn(2, 5, E)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    root = Root()
    run = _Run(root, (x,), {}, train=True)
    with qkvtrace.trace(root) as t:
        run()
    assert t.result.gradients or t.result.routes  # the premise: the default records them
    result = _traced(run, root)
    assert result.calls and not result.gradients and not result.routes


# -- judging time -------------------------------------------------------------------------------------------------


class _Clock:
    """The test's own clock (handed to the advisor in place of ``time.perf_counter``): it moves only when a unit of
    work of the test's says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Unit:
    """A unit of work that takes ``seconds`` on ``clock`` (several: its successive calls' times, the last one
    repeated) and returns N(0, 1) of shape (4,) drawn from torch's global RNG."""

    def __init__(self, clock: _Clock, *seconds: float, outputs: int = 1) -> None:
        self.clock, self.seconds, self.outputs, self.calls = clock, seconds, outputs, 0

    def __call__(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self.clock.now += self.seconds[min(self.calls, len(self.seconds) - 1)]
        self.calls += 1
        return [torch.randn(4) for _ in range(self.outputs)], []


def test_judge_times_whole_samples_and_estimates_the_model() -> None:
    """Witness: the times the test's clock gives. Today 18 ms a unit (advise's 50 ms sample: 2 units), the change
    9 ms, the whole model 18 ms (2 units a sample): each ratio 0.5, the model's estimate (18 - (18 - 9)) / 18 = 0.5
    with one call of the code, the core's share 18/18 = 1; both outputs are N(0, 1) drawn with torch's RNG set to 0,
    so equal. Catches the sample's loop count wrong on either side or for the model, the estimate's formula, the
    share's formula, the default of one call, and the RNG set to anything but 0 on either side."""
    clock = _Clock()
    today, changed, model = _Unit(clock, 0.018), _Unit(clock, 0.009), _Unit(clock, 0.018)
    m = _row()
    assert _judge(m, _cand(), today, changed, 3, False, model=model, clock=clock) == 0  # type: ignore[arg-type]
    assert m.max_abs_diff == 0.0
    assert (today.calls, changed.calls, model.calls) == (2 + 3 * 2, 1 + 3 * 2, 1 + 3 * 2)
    assert m.ratios == pytest.approx([0.5] * 3, abs=1e-9)
    assert m.model_ratios == pytest.approx([0.5] * 3, abs=1e-9)
    assert m.core_share == pytest.approx(1.0, abs=1e-9)


def test_judge_with_a_slow_model_times_it_once_a_sample() -> None:
    """Witness: a model of 30 ms on the test's clock, longer than half advise's 50 ms sample: one unit a sample.
    Catches a floor of two units."""
    clock = _Clock()
    today, changed, model = _Unit(clock, 0.018), _Unit(clock, 0.009), _Unit(clock, 0.03)
    m = _row()
    _judge(m, _cand(), today, changed, 2, False, model=model, calls=1, clock=clock)  # type: ignore[arg-type]
    assert model.calls == 1 + 2


def test_a_broken_sample_is_discarded_and_taken_again() -> None:
    """Witness: the times the test's clock gives. The change takes 9 ms a unit (today 18: ratio 0.5) but in its
    second repetition 0.01 ms (ratio 0.0006: a broken sample, as when the machine paused the other side) and in
    its fourth 900 ms (ratio 50): both are discarded and taken again, so the three ratios kept are 0.5 and the row
    says two were discarded, in its JSON and in the table."""
    clock = _Clock()
    today = _Unit(clock, 0.018)
    # the first call compares the outputs; then two units a repetition
    changed = _Unit(clock, 0.009, 0.009, 0.009, 0.00001, 0.00001, 0.009, 0.009, 0.9, 0.9, 0.009)
    m = _row()
    assert _judge(m, _cand(), today, changed, 3, False, clock=clock) == 2
    m.discarded = 2
    assert m.ratios == pytest.approx([0.5] * 3, abs=1e-9)
    assert changed.calls == 1 + 5 * 2
    m.path_after = "sdpa"
    assert _verdict(m, _cand()) == RECOMMENDED
    advice = Advice(target="t", torch_version=torch.__version__, device="cpu", train=False, repeats=3, measured=[m])
    assert advice.to_json()["measured"][0]["discarded"] == 2
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(advise_table(advice))
    assert "(2 broken samples taken again)" in console.export_text()


def test_a_verdict_needs_good_repetitions() -> None:
    """Witness: the test's clock. Two repetitions are asked for; the change's ratios come out 0.5, 50, 0.005 and
    5000 (each more than ten times away from the median of those taken, but one): after twice the repetitions
    asked for only one is good, and the verdict says the row was not measured, with the count, instead of
    judging on broken samples. A change that is 1000 times slower in every repetition is measured: consistent
    ratios are a measurement, however large."""
    clock = _Clock()
    m = _row(path_after="sdpa")
    changed = _Unit(clock, 0.018, 0.009, 0.009, 0.9, 0.9, 0.00009, 0.00009, 90.0)
    m.discarded = _judge(m, _cand(), _Unit(clock, 0.018), changed, 2, False, clock=clock)
    assert m.discarded == 3 and m.ratios == pytest.approx([50.0])
    assert _verdict(m, _cand()) == ("not measured: 3 of 4 repetitions were broken samples (more than 10x away "
                                    "from their median); 2 good ones are needed")  # fmt: skip
    slow = _row(path_after="sdpa")
    assert _judge(slow, _cand(), _Unit(clock, 0.018), _Unit(clock, 18.0), 3, False, clock=clock) == 0
    assert slow.ratios == pytest.approx([1000.0] * 3)
    assert _verdict(slow, _cand()).startswith("not faster beyond the spread: 1000.00-1000.00")


def test_judge_compares_outputs_drawn_with_the_rng_at_zero() -> None:
    """Witness: torch.randn(4) with torch's RNG set to 0, drawn here, against the changed side's own draw (the
    changed side adds 1 to it): the difference is exactly 1 only when both sides drew with the RNG set to 0."""
    torch.manual_seed(0)
    want = torch.randn(4)

    def today() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.randn(4)], []

    def changed() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.randn(4) + 1.0], []

    seen: list[torch.Tensor] = []

    def watched() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out, grads = today()
        seen.append(out[0])
        return out, grads

    m = _row()
    _judge(m, _cand(), watched, changed, 2, False)
    assert torch.equal(seen[0], want)
    assert m.max_abs_diff == pytest.approx(1.0, abs=1e-6)


def test_judge_leaves_out_only_the_outputs_a_change_gives_up() -> None:
    """Witness: outputs made here: today returns two, the change one. A change that drops outputs (weights) is
    compared on the one both return; any other change that returns fewer outputs differs in number (``None``).
    Catches the trim applied to every change, and the trimmed list lost."""
    m = _row()
    _judge(m, _cand(drops_outputs=True), _Unit(_Clock(), 0.0, outputs=2), _Unit(_Clock(), 0.0), 2, False)
    assert m.max_abs_diff == 0.0
    m = _row()
    _judge(m, _cand(drops_outputs=False), _Unit(_Clock(), 0.0, outputs=2), _Unit(_Clock(), 0.0), 2, False)
    assert m.max_abs_diff is None


# -- the verdict --------------------------------------------------------------------------------------------------


def test_verdict_boundaries() -> None:
    """Witness: the rule docs/advise.md states, applied by hand to numbers written here: results agree up to the
    tolerance itself; moved means path or backend differ; recommended only when every ratio (and every whole-model
    estimate) is below 1. Catches >= for > on either difference, <= for < on either ratio, a bound of 2 for the
    estimate, the wording of 'differ in number', the path after and the backend in parentheses."""
    c = _cand(tolerance=0.01)
    moved = {"path_after": "sdpa", "backend_after": "MATH", "ratios": [0.5, 0.6]}
    assert _verdict(_row(max_abs_diff=0.01, max_abs_grad_diff=0.01, **moved), c) == RECOMMENDED
    assert _verdict(_row(max_abs_diff=0.02, **moved), c).startswith("changes results: outputs differ by up to 0.02")
    assert _verdict(_row(max_abs_diff=0.0, max_abs_grad_diff=0.02, **moved), c).startswith("changes results")
    assert _verdict(_row(**moved), c) == "changes results: the outputs differ in number or shape"
    assert _verdict(_row(max_abs_diff=0.0, path_after="fallback"), c) == "no other path: the call still runs fallback"
    assert _verdict(_row(max_abs_diff=0.0, path="sdpa", backend="MATH", path_after="sdpa", backend_after="MATH"),
                    c) == "no other path: the call still runs sdpa (MATH)"  # fmt: skip
    at_one = {**moved, "ratios": [0.5, 1.0]}
    assert (
        _verdict(_row(max_abs_diff=0.0, **at_one), c) == "not faster beyond the spread: 0.50-1.00 of today's time "
        "over 2 repetitions"
    )
    core = {**moved, "measured_on": "core"}
    assert _verdict(_row(max_abs_diff=0.0, model_ratios=[0.9, 0.99], **core), c) == RECOMMENDED
    assert _verdict(_row(max_abs_diff=0.0, model_ratios=[0.9, 1.0], **core), c).startswith("not faster")
    assert _verdict(_row(max_abs_diff=0.0, model_ratios=[0.9, 1.5], **core), c).startswith("not faster")


def test_a_change_that_raises_is_the_finding() -> None:
    """Witness: the exceptions the test's own changes raise: the verdict names the type and the first line of the
    message, or the type alone when the message is empty. Catches the wrong line, a missing or mangled verdict, the
    separator left when there is no message, and more than the separator stripped from the end."""
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    base = _Run(model, (x,), {}, False)

    def two_lines(_m: nn.Module) -> Any:
        raise ValueError("first line of size X\nsecond line")

    def silent(_m: nn.Module) -> Any:
        raise KeyError()

    m = _row()
    _measure(m, _cand(apply=two_lines), base, model, (x,), {}, False, 2, 0)
    assert m.verdict == "raised ValueError: first line of size X"
    m = _row()
    _measure(m, _cand(apply=silent), base, model, (x,), {}, False, 2, 0)
    assert m.verdict == "raised KeyError"


class _SdpaDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(E, 3 * E)
        self.attn = _Core()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(2, 8, 3, H, E // H).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v)


class _Core(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


def _flash_refuses_dropout() -> str:
    """PyTorch's own words when its flash kernel is forced on a call with dropout (the first line about dropout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 2, 8, 8)
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    words = [line.split(" (Triggered")[0].strip() for w in caught for line in str(w.message).splitlines()
             if "dropout" in line]  # fmt: skip
    assert words
    return words[0]


def test_a_change_that_leaves_the_kernel_quotes_what_pytorch_refused() -> None:
    """Witness: PyTorch's own warning when the flash kernel is forced here on tensors of the call's shapes with
    dropout (its first line about dropout); a change that changes nothing leaves the call on the math kernel, and the
    verdict quotes that refusal after the backend's name. Catches the refusal not read, not appended, appended in
    place of the verdict, or with the wrong parts."""
    import qkvtrace

    refusal = _flash_refuses_dropout()
    model = _SdpaDropout().train()
    x = torch.randn(2, 8, E)
    with qkvtrace.trace(model, gradients=False, routes=False) as t:
        model(x)
    (call,) = t.result.calls
    m = _row(module="attn", path=call.path, backend=call.sdpa_backend)
    base = _Run(copy.deepcopy(model), (x,), {}, True)
    _measure(m, _cand(), base, model, (x,), {}, True, 2, 0)
    assert m.verdict.startswith(f"no other path: the call still runs {call.path} ({call.sdpa_backend}); "
                                "PyTorch refused FLASH"), m.verdict  # fmt: skip
    assert refusal in m.verdict.split("refused FLASH_ATTENTION: ", 1)[1], (refusal, m.verdict)


# -- the next reason ----------------------------------------------------------------------------------------------


class _Seq(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def _call_of(model: nn.Module, x: torch.Tensor) -> Any:
    import qkvtrace

    with qkvtrace.trace(model, gradients=False, routes=False) as t:
        model(x)
    return t.result.calls[0]


def test_next_changes_answer_the_reason_the_change_uncovered() -> None:
    """Witness: the rules module's candidates for the call traced here on a copy with batch_first=True (PyTorch's
    next reason: grad is enabled): those are the changes to try with batch_first. None when the call moved, when no
    new reason was given, when the reason is unchanged, or when the change already joins as many as may be
    joined (every rule of one call). Catches each of the
    stop conditions joined with 'and' or loosened."""
    model = _Seq(batch_first=False).eval()
    x = torch.randn(8, 2, E)
    call = _call_of(model, x)
    (cand,) = [c for c in candidates_for(call, model, False)[0] if c.change.startswith("batch_first=True")]
    fixed = copy.deepcopy(model)
    fixed.attn.batch_first = True
    after_call = _call_of(fixed, x.transpose(0, 1))
    want = [f"{cand.change} + {c.change}" for c in candidates_for(after_call, fixed, False)[0]
            if c.change not in cand.change]  # fmt: skip
    assert want and call.why_not_fast_path and after_call.why_not_fast_path != call.why_not_fast_path
    m = _row(path=call.path, reason=call.why_not_fast_path, path_after=after_call.path,
             reason_after=after_call.why_not_fast_path)  # fmt: skip
    assert [c.change for c in _next_changes(m, cand, call, model, False)] == want
    assert _next_changes(_row(path=call.path, reason=m.reason, path_after="fast", reason_after=m.reason_after),
                         cand, call, model, False) == []  # fmt: skip
    assert _next_changes(_row(path=call.path, reason=m.reason, path_after=call.path, reason_after=None),
                         cand, call, model, False) == []  # fmt: skip
    assert _next_changes(_row(path=call.path, reason=m.reason, path_after=call.path, reason_after=m.reason),
                         cand, call, model, False) == []  # fmt: skip
    full = copy.copy(cand)
    full.parts = tuple("abcde"[:MAX_JOINED])
    assert _next_changes(m, full, call, model, False) == []
    full.parts = full.parts[:-1]
    assert _next_changes(m, full, call, model, False)


# -- what the advisor records about itself ------------------------------------------------------------------------


class _NoAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_advice_states_its_settings_and_its_own_time() -> None:
    """Witness: the arguments passed here, ``torch.__version__``, a model with no parameters (the device falls back
    to cpu), the default of 7 repetitions in the signature docs/advise.md shows, and the wall time measured here
    around the call. Catches any header field lost or mangled, and the time added to the clock instead of
    subtracted."""
    x = torch.randn(3)
    t0 = time.perf_counter()
    advice = advise(_NoAttention(), x)
    wall = time.perf_counter() - t0
    assert (advice.target, advice.device, advice.train, advice.repeats) == ("", "cpu", False, 7)
    assert advice.torch_version == torch.__version__
    assert 0 <= advice.seconds <= wall
    said: list[str] = []
    advice = advise(_NoAttention(), x, train=True, repeats=3, target="m.py:build", progress=said.append)
    assert (advice.target, advice.device, advice.train, advice.repeats) == ("m.py:build", "cpu", True, 3)
    assert said == ["tracing a copy as given"]
    with pytest.raises(ValueError, match="repeats=1"):
        advise(_NoAttention(), x, repeats=1)


class _SoftCap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, E // H).permute(2, 0, 3, 1, 4)
        scores = torch.tanh(q @ k.transpose(-2, -1) / 30.0) * 30.0
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, E)


def test_a_settled_call_is_listed_with_every_field() -> None:
    """Witness: the test's one-call model (soft-capped scores, which SDPA has no argument for) is the root module
    (named ""), written by hand (no SDPA backend), and its only call is call 0. Catches a settled field misnamed."""
    advice = advise(_SoftCap().eval(), torch.randn(2, 8, E), repeats=2)
    (settled,) = advice.settled
    assert set(settled) == {"call", "module", "path", "backend", "why"}
    assert (settled["call"], settled["module"], settled["path"], settled["backend"]) == (0, "", "hand_written", None)


def test_budget_lists_each_unmeasured_change_under_its_module() -> None:
    """Witness: the rules module's candidates for the call traced here (a root MultiheadAttention, named "(root)" in
    the list): with a budget spent at once each is listed, in order, as 'module: change', with the call's index and
    today's path, backend and scope. Catches a stop at the first, a candidate skipped, a row's fields lost, and the
    root's name."""
    model = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 8, E)
    call = _call_of_root(model, x)
    cands = candidates_for(call, model, False)[0]
    assert len(cands) >= 2
    advice = advise(model, x, x, x, repeats=2, budget=1e-9)
    assert advice.unmeasured == [f"(root): {c.change}" for c in cands]
    assert [(m.change, m.scope, m.call, m.path, m.backend) for m in advice.measured] == [
        (c.change, c.scope, call.index, call.path, call.sdpa_backend) for c in cands
    ]
    assert all(m.verdict.startswith("not measured") for m in advice.measured)


def _call_of_root(model: nn.Module, x: torch.Tensor) -> Any:
    import qkvtrace

    with qkvtrace.trace(model, gradients=False, routes=False) as t:
        model(x, x, x)
    return t.result.calls[0]


def test_a_generous_budget_measures_everything_and_a_training_step_compares_gradients() -> None:
    """Witness: a budget of 1000 s, far more than the test model needs: nothing may be left unmeasured; ``train=True``
    asks for a training step, so the gradients are compared too; the model calls its hand-written attention once, so
    that code's share of the model is above zero and its whole-model estimate is not exactly 1. Catches the time
    spent computed as the clock plus the start, ``train`` lost on the way to the attention core's measurement, the
    verdict lost, and the calls of the same code counted among the others."""
    advice = advise(_SoftCapFree().train(), torch.randn(2, 8, E), train=True, repeats=2, budget=1000.0)
    (row,) = advice.measured
    assert not advice.unmeasured and row.verdict and not row.verdict.startswith("not measured")
    assert row.measured_on == "core" and row.max_abs_grad_diff is not None
    assert row.core_share is not None and row.core_share > 0 and all(r != 1.0 for r in row.model_ratios)


class _SoftCapFree(_SoftCap):
    """The same attention written by hand without the soft-cap: SDPA can take its place (measured on its core)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, E // H).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (E // H) ** 0.5
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, E)


class _ThirdMasked(nn.Module):
    """One MultiheadAttention called three times: twice on an unbatched query (no fast path, and no change for it),
    then batched with a float causal mask of zeros and -inf (a boolean mask would take the fast path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        a = self.attn(x[0], x[0], x[0], need_weights=False)[0] + self.attn(x[1], x[1], x[1], need_weights=False)[0]
        return self.attn(x, x, x, attn_mask=causal, need_weights=False)[0] + a


def test_a_change_is_read_back_from_the_same_occurrence_of_the_call() -> None:
    """Witness: the profiler on a copy of the module called here batched with the boolean mask (PyTorch's fused kernel
    runs, so the third call's path after the change is the fast one), and on the unbatched calls (it does not run:
    those stay where they were); with the float mask an SDPA kernel runs (the row's backend today). The change's row
    must be read from the third call of the module. Catches the occurrence counted from 1, by steps of 2, backwards,
    not at all, or not passed on, and today's backend lost."""
    from torch.profiler import ProfilerActivity, profile

    model = _ThirdMasked().eval()
    x = torch.randn(2, 8, E)
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)

    def ops(fn: Any) -> set[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return {e.name for e in prof.events()}

    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in ops(lambda: model.attn(x, x, x, attn_mask=mask))
        assert "aten::_native_multi_head_attention" not in ops(lambda: model.attn(x[0], x[0], x[0]))
        advice = advise(model, x, repeats=2)
        flash = ops(lambda: model.attn(x, x, x, attn_mask=mask.float().masked_fill(mask, float("-inf")),
                                       need_weights=False))  # fmt: skip
    (row,) = [m for m in advice.measured if m.change.startswith("a boolean mask")]
    assert row.call == 2 and row.path_after == "fast", (row.call, row.path_after)
    assert row.backend is not None and any(row.backend.split("_")[0].lower() in o for o in flash if "scaled_dot" in o)


#: the clock of the advisor's runs of :class:`_PacedModes` (handed to ``advise``)
_PACE = _Clock()


class _PacedModes(nn.MultiheadAttention):
    """A MultiheadAttention whose time the test sets on its own clock (:data:`_PACE`): 80 ms a call as called
    (weights asked for), 10 ms without the weights, 5 ms under inference_mode -- where it also adds 1 to its
    output (so that change alters the results). The machine's own time for the call does not count."""

    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None, need_weights: bool = True,
                attn_mask: Any = None, average_attn_weights: bool = True, is_causal: bool = False) -> Any:  # fmt: skip
        out, weights = super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal)  # fmt: skip
        if torch.is_inference_mode_enabled():
            _PACE.now += 0.005
            return out + 1.0, weights
        _PACE.now += 0.08 if need_weights else 0.01
        return out, weights


def test_recommended_changes_come_first_even_when_another_was_faster() -> None:
    """Witness: the times on the test's clock and the +1 written here: need_weights=False is 8x faster with the same
    results
    (recommended), inference_mode faster still but it changes the output by 1 (not recommended); the schema says
    recommended ones come first, then by median ratio. Catches the recommended rank lost in the sort."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attn = _PacedModes(E, H, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x)[0]

    advice = advise(Model().eval(), torch.randn(2, 8, E), repeats=2, clock=_PACE)
    verdicts = [(m.change, m.verdict) for m in advice.measured]
    assert advice.measured[0].change == "need_weights=False" and advice.measured[0].verdict == RECOMMENDED, verdicts
    fast_other = [m for m in advice.measured if m.change == "run the forward under torch.inference_mode()"]
    assert fast_other and fast_other[0].verdict.startswith("changes results"), verdicts
    assert fast_other[0].median is not None and advice.measured[0].median is not None
    assert fast_other[0].median < advice.measured[0].median, verdicts
    rest = [m.model_median for m in advice.measured[1:]]
    assert rest == sorted(rest, key=lambda r: 9e9 if r is None else r), verdicts


class _Three(nn.Module):
    """Three MultiheadAttention modules, each called once: each has its own change (need_weights=False) and one
    change reaches all three (inference_mode, made to the whole model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.MultiheadAttention(E, H, batch_first=True) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x, x, x)[0] + self.b(x, x, x)[0] + self.c(x, x, x)[0]


def test_a_change_that_reaches_several_calls_is_listed_once_and_the_rest_still_are() -> None:
    """Witness: the rules module's candidates for each of the three calls traced here, taken in call order and kept
    once per (scope, change) -- a change made to the whole model is the same change whichever call asked for it.
    With a budget spent at once, each is listed under the module of the first call that asked for it. Catches a stop
    at the first repeated change, candidates skipped, and the module names in the list."""
    import qkvtrace

    model = _Three().eval()
    x = torch.randn(2, 8, E)
    with qkvtrace.trace(model, gradients=False, routes=False) as t:
        model(x)
    want: dict[tuple[str | None, str], tuple[int, str]] = {}
    for call in t.result.calls:
        for c in candidates_for(call, model, False)[0]:
            want.setdefault((c.scope, c.change), (call.index, call.module))
    assert len(want) == 4 and len(t.result.calls) == 3
    advice = advise(model, x, repeats=2, budget=1e-9)
    assert [((m.scope, m.change), (m.call, m.module)) for m in advice.measured] == list(want.items())
    assert advice.unmeasured == [f"{module}: {change}" for (_, change), (_, module) in want.items()]


def test_progress_counts_each_measurement_once_under_the_roots_name() -> None:
    """Witness: the rules module's candidates for the call traced here (a root MultiheadAttention, whose name is
    empty, shown as "(root)"): the progress lines name them in that order, numbered 1, 2, ... (the callback refuses a
    number it has seen, so a count that stops moving fails at once instead of looping). Catches the count reset or
    stepped by 2, the line lost, and the root's name."""
    model = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 8, E)
    call = _call_of_root(model, x)
    cands = candidates_for(call, model, False)[0]
    said: list[str] = []

    def say(text: str) -> None:
        counts = [line.split("/")[0] for line in said if line.startswith("measuring ")]
        assert text.split("/")[0] not in counts, (text, said)  # each measurement gets its own number
        said.append(text)

    advise(model, x, x, x, repeats=2, progress=say)
    assert said[0] == "tracing a copy as given"
    lines = said[1 : 1 + len(cands)]
    assert [line.split("/")[0] for line in lines] == [f"measuring {i}" for i in range(1, len(cands) + 1)]
    assert [line.split(": ", 1)[1] for line in lines] == [f"{c.change} on (root)" for c in cands]


# -- the order of the rows that are not recommended ------------------------------------------------------------


class _PacedRefusals(nn.MultiheadAttention):
    """A MultiheadAttention whose time the test sets: ``slow`` seconds a call as called (weights asked for), and
    without the weights either ``fast`` seconds with 1 added to its output or, with ``fast=None``, a ValueError;
    under inference_mode it sleeps ``inference`` seconds and adds 1 (so every change alters the results)."""

    slow, fast, inference = 0.0, 0.0, 0.0

    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None, need_weights: bool = True,
                attn_mask: Any = None, average_attn_weights: bool = True, is_causal: bool = False) -> Any:  # fmt: skip
        out, weights = super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal)  # fmt: skip
        if torch.is_inference_mode_enabled():
            time.sleep(self.inference)
            return out + 1.0, weights
        if need_weights:
            time.sleep(self.slow)
            return out, weights
        if self.fast is None:
            raise ValueError("this module refuses need_weights=False")
        time.sleep(self.fast)
        return out + 1.0, weights


def test_rows_that_are_not_recommended_are_ordered_by_their_time_and_untimed_ones_last() -> None:
    """Witness: the sleeps written here. Module a sleeps 2 ms and raises without its weights (a row with no time),
    module b sleeps 20 ms, 1 ms without its weights; under inference_mode a sleeps 2 ms and b 15 ms. Every change
    adds 1 to an output, so none is recommended, and the schema orders them by median time ratio: b's need_weights
    (3/22 of today's time) before inference_mode (17/22), the row with no time last -- the reverse of the order
    they were found in (inference_mode, a's, b's). Catches the ratio left out of the order, and a row with no time
    ranked as None beside timed ones (Python cannot order None and a float)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = _PacedRefusals(E, H, batch_first=True), _PacedRefusals(E, H, batch_first=True)
            self.a.slow, self.a.fast, self.a.inference = 0.002, None, 0.002
            self.b.slow, self.b.fast, self.b.inference = 0.02, 0.001, 0.015

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x, x, x)[0] + self.b(x, x, x)[0]

    advice = advise(Model().eval(), torch.randn(2, 8, E), repeats=2)
    rows = [(m.module, m.change, m.verdict.split(":")[0]) for m in advice.measured]
    assert rows == [
        ("b", "need_weights=False", "changes results"),
        ("a", "run the forward under torch.inference_mode()", "changes results"),
        ("a", "need_weights=False", "raised ValueError"),
    ], (rows, [m.ratios for m in advice.measured])


# -- the calls of the same code -------------------------------------------------------------------------------


class _SlowSoftmax(torch.overrides.TorchFunctionMode):
    """Every softmax called through torch's Python API sleeps 10 ms first; anything else runs as it is."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.softmax, torch.Tensor.softmax):
            time.sleep(0.01)
        return func(*args, **(kwargs or {}))


class _ThreeCores(_SoftCap):
    """The hand-written attention core computed three times in one forward (the same code, three calls)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, E // H).permute(2, 0, 3, 1, 4)
        return sum((q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v for _ in range(3))


def test_the_core_share_counts_every_call_of_the_same_code() -> None:
    """Witness: the test's mode sleeps 10 ms in every softmax; the model computes its core three times, each with
    one softmax, and PyTorch's SDPA calls no softmax (the functions the mode sees for it are listed here). So three
    runs of the core as written take about the whole unit (30 ms of sleep, plus microseconds): the share is near 1,
    not 1/3 (one call counted) nor 2 (each counted twice). Catches the calls of the same code miscounted, or not
    passed on to the core's measurement."""
    seen: list[Any] = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, H, 8, E // H)
    with Watch():
        F.scaled_dot_product_attention(q, q, q)
    assert seen == [F.scaled_dot_product_attention]
    with _SlowSoftmax():
        advice = advise(_ThreeCores().eval(), torch.randn(2, 8, E), repeats=3)
    (row,) = advice.measured
    assert row.measured_on == "core" and row.core_share is not None
    assert 0.6 < row.core_share < 1.3, (row.core_share, row.ratios, row.model_ratios)


# -- train=True all the way down --------------------------------------------------------------------------------


class _FrozenAttention(nn.Module):
    """Two MultiheadAttention modules that stay in eval while the rest trains (``train()`` puts them back): ``a``
    batch-first, ``b`` not; neither is asked for its weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(E, H, batch_first=True)
        self.b = nn.MultiheadAttention(E, H, batch_first=False)
        self.head = nn.Linear(E, E)

    def train(self, mode: bool = True) -> _FrozenAttention:
        super().train(mode)
        self.a.eval()
        self.b.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.transpose(0, 1)
        y = self.a(x, x, x, need_weights=False)[0] + self.b(xt, xt, xt, need_weights=False)[0].transpose(0, 1)
        return self.head(y)


def test_a_training_step_is_never_offered_inference_mode() -> None:
    """Witness: PyTorch itself -- an output made under torch.inference_mode cannot be backpropagated (checked here),
    so no training step can run under it -- and PyTorch's reasons for the two eval-mode modules inside a training
    step: grad for ``a`` (nothing else to change, so it is settled as a training call), batch_first for ``b``,
    then grad once batch_first is changed. The only change measured is b's batch_first, never inference_mode,
    alone or with it. Catches ``train`` lost on the way to the first rules or to the next reason's."""
    model = _FrozenAttention().train()
    x = torch.randn(2, 8, E)
    with torch.inference_mode():
        out = model(x)
    with pytest.raises(RuntimeError):
        out.sum().backward()
    advice = advise(model, x, train=True, repeats=2)
    assert [(m.module, m.change) for m in advice.measured] == [
        ("b", "batch_first=True for b (inputs as (batch, sequence, features))")
    ]
    (row,) = advice.measured
    assert row.reason == "batch_first was not True" and "grad is enabled" in (row.reason_after or "")
    (settled,) = advice.settled
    assert settled["module"] == "a" and settled["why"].startswith("training: "), settled


# -- the next reason after the encoder layer's ------------------------------------------------------------------


def test_a_change_inside_an_encoder_layer_keeps_the_layers_own_reason() -> None:
    """Witness: PyTorch's two reasons for the layer's attention call with a float mask and a hook on the layer (its
    own fast path: the float mask; the layer's fused path: the hook), and the rules module's candidates for the
    call traced on a copy whose attention is given the boolean mask by hand: PyTorch then names grad for the
    attention and still the hook for the layer, so both of their changes are tried with the mask. Catches the
    layer's reason dropped from, or replaced by the attention's in, the call the next changes are read from."""
    import qkvtrace

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True).eval()
    layer.register_forward_hook(lambda _m, _i, _o: None)
    x = torch.randn(2, 8, E)
    mask = torch.full((8, 8), float("-inf")).triu(1)
    changed = copy.deepcopy(layer)
    mha = changed.self_attn

    def bool_mask(*args: Any, attn_mask: Any = None, **kwargs: Any) -> Any:
        return nn.MultiheadAttention.forward(mha, *args, attn_mask=attn_mask.isneginf(), **kwargs)

    mha.forward = bool_mask  # type: ignore[method-assign]
    with qkvtrace.trace(changed, gradients=False, routes=False) as t:
        changed(x, src_mask=mask)
    (after,) = t.result.calls
    assert "grad is enabled" in after.why_not_fast_path and "hooks" in after.why_not_fused_layer
    then = [c.change for c in candidates_for(after, changed, False)[0]]
    assert len(then) == 2
    advice = advise(layer, x, src_mask=mask, repeats=2)
    first = "a boolean mask (True = blocked) instead of a float one"
    assert first in [m.change for m in advice.measured]
    (row,) = [m for m in advice.measured if m.change == first]
    assert "floating-point masks" in (row.reason or "") and row.path_after == row.path
    changes = [m.change for m in advice.measured]
    assert all(f"{first} + {c}" in changes for c in then), (then, changes)


def test_a_verdict_names_the_gradient_that_differs() -> None:
    """Witness: outputs and gradients made here. Both sides return the same output; the changed side's gradient of
    ``attn.in_proj_weight`` (the second of three) is off by 0.8 (as dropout drawn differently on another path makes
    it), the first by 0.08, the third equal: the verdict says it is that gradient that differs, by how much,
    against which tolerance, and that the outputs agree. Without names (a change to the model's own code) it says
    "the gradients"."""
    out = torch.ones(3)
    grads = [torch.zeros(2, 2), torch.zeros(4)]

    class Side:
        def __init__(self, off: float) -> None:
            self.off = off
            self.grad_names = ["attn.out_proj.bias", "attn.in_proj_weight", "attn.out_proj.weight"]

        def __call__(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return [out.clone()], [grads[1] + 0.1 * self.off, grads[0] + self.off, grads[0].clone()]

    m = _row(path_after="sdpa")
    _judge(m, _cand(), Side(0.0), Side(0.8), 2, True)
    assert (m.max_abs_diff, m.max_abs_grad_param) == (0.0, "attn.in_proj_weight")
    assert m.max_abs_grad_diff == pytest.approx(0.8)
    assert _verdict(m, _cand()) == ("changes results: the gradient of attn.in_proj_weight differs by up to 0.8 "
                                    "(more than 0.0001); outputs agree within 0")  # fmt: skip
    m.max_abs_grad_param = None
    assert _verdict(m, _cand()).startswith("changes results: the gradients differ by up to 0.8")


def test_a_root_module_is_called_by_qkvtrace() -> None:
    """Witness: the test hands ``advise`` the MultiheadAttention itself: no code of the test's calls it, the
    advisor's own unit of work does -- the row says so instead of naming a file of qkvtrace's (or the
    ``qkvtrace`` executable); a module called by the test's own forward is placed at the test's line."""
    from qkvtrace.analyses.advice_rules import CALLED_BY_QKVTRACE

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 8, E)
    ticks = iter(range(10**6))
    advice = advise(mha, x, x, x, repeats=2, clock=lambda: next(ticks) * 0.06)  # (one unit a sample: no timing here)
    (row,) = [m for m in advice.measured if m.change == "need_weights=False"]
    assert row.where == CALLED_BY_QKVTRACE
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(advise_table(advice))
    assert "(called by qkvtrace)" in console.export_text() and "at (called" not in console.export_text()


# -- changes joined: each applied on top of the others ---------------------------------------------------------------


class _Watched(nn.MultiheadAttention):
    """A sequence-first MultiheadAttention that writes down, per call, what is in force when it is called (its
    batch_first, its mask's dtype, whether grad is on, need_weights) under the label :func:`advise` last said it
    was measuring; the fast path's own function (``torch._native_multi_head_attention``, wrapped by the test)
    writes down that it ran."""

    seen: ClassVar[dict[str, list[tuple[bool, Any, bool, bool]]]] = {}
    fast: ClassVar[dict[str, int]] = {}
    label = ""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = _MHA_ARGS.bind(self, *args, **kwargs)
        bound.apply_defaults()
        mask = bound.arguments["attn_mask"]
        state = (bool(self.batch_first), None if mask is None else mask.dtype, torch.is_grad_enabled(),
                 bool(bound.arguments["need_weights"]))  # fmt: skip
        _Watched.seen.setdefault(_Watched.label, []).append(state)
        return super().forward(*args, **kwargs)


_MHA_ARGS = inspect.signature(nn.MultiheadAttention.forward)


def test_joined_changes_are_all_in_force_at_once_and_the_ones_that_reach_the_fast_path_are_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Witness: the module's own view of each call made while a row was measured (its ``batch_first``, its mask's
    dtype, grad mode, ``need_weights``, written by the module itself) and a count of PyTorch's fast-path function
    (``torch._native_multi_head_attention``, wrapped by the test). A sequence-first module with a float causal mask
    in ``eval()``: a row joining changes must have a call where every change it names is in force at once, and
    the rows joining batch_first, a boolean mask and inference_mode reach the fast path -- also with one of the
    four left out (need_weights=False is not needed), never with batch_first, the mask or inference_mode left
    out. Catches a change that replaces the one made before it, and joined changes that stop at pairs."""
    native = torch._native_multi_head_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        _Watched.fast[_Watched.label] = _Watched.fast.get(_Watched.label, 0) + 1
        return native(*args, **kwargs)

    monkeypatch.setattr(torch, "_native_multi_head_attention", counted)
    _Watched.seen, _Watched.fast = {}, {}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attn = _Watched(E, H)
            self.register_buffer("mask", torch.triu(torch.full((8, 8), float("-inf")), 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, attn_mask=self.mask)[0]

    def say(text: str) -> None:
        _Watched.label = text.split(": ", 1)[1].rsplit(" on ", 1)[0] if text.startswith("measuring") else text

    ticks = iter(range(10**9))  # (a clock that moves on each reading: no timing depends on the machine)
    advice = advise(Model().eval(), torch.randn(8, 2, E), repeats=2, progress=say, clock=lambda: next(ticks) / 100)
    bf = "batch_first=True for attn (inputs as (batch, sequence, features))"
    boolean = "a boolean mask (True = blocked) instead of a float one"
    inference = "run the forward under torch.inference_mode()"
    no_weights = "need_weights=False"
    wanted = {bf: lambda s: s[0], boolean: lambda s: s[1] == torch.bool, inference: lambda s: not s[2],
              no_weights: lambda s: not s[3]}  # fmt: skip
    rows = {frozenset(m.change.split(" + ")): m for m in advice.measured}
    for names, m in rows.items():
        states = _Watched.seen.get(m.change, [])
        assert any(all(wanted[n](s) for n in names) for s in states), (m.change, set(states))
    fixed = frozenset((bf, boolean, inference))
    for names in (fixed, fixed | {no_weights}):
        assert names in rows, sorted(rows)
        assert _Watched.fast.get(rows[names].change, 0) > 0, (rows[names].change, _Watched.fast)
    for left in (bf, boolean, inference):
        rest = fixed - {left}
        assert rest in rows, (sorted(rows), left)
        assert _Watched.fast.get(rows[rest].change, 0) == 0, (rows[rest].change, _Watched.fast)


# -- a root MultiheadAttention with dropout, read at 80 columns ----------------------------------------------------


def test_a_training_change_that_ends_on_math_names_the_dropout_and_reads_whole_at_80_columns() -> None:
    """Witness: PyTorch's own words refusing its flash kernel for dropout (forced here on a call with dropout), the
    module's dropout as built here, and the words of each row's fields, each of which must appear whole in the table
    printed at 80 columns, whose lines are 80 characters at most. A root ``nn.MultiheadAttention(16, 2,
    dropout=0.1)`` trained: need_weights=False moves its kernel to SDPA's MATH. Catches dropout left unnamed, the
    refusal missing, and a seven-column table cutting words in two at 80 columns."""
    import io

    from rich.console import Console

    refusal = _flash_refuses_dropout()
    torch.manual_seed(0)
    model = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
    ticks = iter(range(10**9))
    x = torch.randn(2, 8, 16)
    advice = advise(model, x, x, x, train=True, repeats=2, clock=lambda: next(ticks) / 100)
    (row,) = [m for m in advice.measured if m.change == "need_weights=False"]
    assert row.backend_after == "MATH", row
    assert "dropout=0.1" in row.verdict and refusal in row.verdict, row.verdict
    assert row.where == "(called by qkvtrace)", row.where
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(advise_table(advice, width=80))
    printed = out.getvalue()
    assert max(len(line) for line in printed.splitlines()) <= 80, printed
    flat = " ".join(printed.split())
    for m in advice.measured:
        for field in (m.change, m.verdict, m.gives_up, m.reason or "", m.where or ""):
            for word in field.split():
                assert word in flat, (word, printed)
