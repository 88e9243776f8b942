"""PyTorch's reasons, asked on a stand-in: the exact words, what is handed to the stand-in, when nothing is
asked, and the per-signature cache.

Witness for every reason: what PyTorch itself warns and raises when the test forces that backend
(``torch.nn.attention.sdpa_kernel``) on the very tensors of the call, untraced, read here line by line; the
chosen backend is ``torch._fused_sdp_choice`` on the same tensors, and "ranks above" is PyTorch's
``_get_sdp_priority_order``.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from _witness import DirectSDPA, ranked_above, sdpa_choice
from torch.utils._python_dispatch import TorchDispatchMode

import qkvtrace
from qkvtrace.facts import refusals

attention = pytest.importorskip("torch.nn.attention")
sdpa_kernel, SDPBackend = attention.sdpa_kernel, attention.SDPBackend
if not hasattr(torch._C, "_get_sdp_priority_order"):
    pytest.skip("this PyTorch does not expose its SDPA priority order", allow_module_level=True)

_SUFFIX = re.compile(r"\s*\(Triggered internally at [^)]*\)\s*$")


def _pytorch_words(backend: str, *args: Any, **kwargs: Any) -> list[str]:
    """Every line PyTorch warns when ``backend`` alone may run these arguments, then its error as
    ``"<type>: <message>"``; ``[]`` where the forced backend runs them. Location suffixes cut."""
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                torch._C._nn.scaled_dot_product_attention(*args, **kwargs)
        except RuntimeError as exc:
            error = exc
    if error is None:
        return []
    lines = [_SUFFIX.sub("", str(w.message)).strip() for w in caught]
    lines.append(_SUFFIX.sub("", f"{type(error).__name__}: {error}").strip())
    return [line for line in lines if line]


def _gqa(b: int = 2, hq: int = 4, hk: int = 2, lq: int = 8, lk: int = 8, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, hq, lq, d, generator=g), torch.randn(b, hk, lk, d, generator=g),
            torch.randn(b, hk, lk, d, generator=g))  # fmt: skip


def test_a_traced_gqa_call_with_a_three_dimensional_mask_and_a_scale_gets_pytorchs_exact_words() -> None:
    """A grouped-query call (4 query heads, 2 key heads, ``enable_gqa=True``), a ``scale`` and a 3-D float mask
    ``[H, L, S]``: PyTorch runs MATH; FLASH_ATTENTION refuses the mask's shape (CPU flash accepts GQA and any
    scale, so only the mask refuses it). Witness: every warning line and the error PyTorch gives when the test
    forces each better backend on the untraced tensors with the same arguments. Faults caught: the mask not
    handed to the stand-in (FLASH would then run it), ``enable_gqa`` dropped, made ``None`` or misspelled, or
    ``scale`` misspelled (PyTorch would then refuse the head counts, or raise a TypeError), PyTorch's error
    line dropped or its type misnamed, a ``None`` line."""
    q, k, v = _gqa()
    mask = torch.zeros(4, 8, 8)
    kwargs: dict[str, Any] = {"attn_mask": mask, "scale": 0.5, "enable_gqa": True}
    chosen = sdpa_choice(q, k, v, mask, 0.0, False, scale=0.5, enable_gqa=True)
    assert chosen == "MATH", chosen
    expected = {b: _pytorch_words(b, q, k, v, **kwargs) for b in ranked_above(chosen)}
    assert any("attn mask" in line for line in expected["FLASH_ATTENTION"]), expected  # the premise
    assert expected["FLASH_ATTENTION"][-1].startswith("RuntimeError: ")
    model = DirectSDPA(lambda: (q, k, v), **kwargs)
    with qkvtrace.trace(model) as t:
        model()
    [call] = t.calls
    assert call.sdpa_backend == chosen
    assert call.sdpa_refusals == expected


def test_a_better_backend_that_would_run_the_call_has_no_words() -> None:
    """Asked directly about plain inputs and a GQA call (``enable_gqa=True``, 4 query heads over 2) as if MATH
    had run: PyTorch runs each of them with FLASH_ATTENTION forced, so its answer is ``[]``; EFFICIENT_ATTENTION
    has no CPU kernel and PyTorch says so. Witness: forcing each backend on the same tensors here. Faults
    caught: an answer made of something other than PyTorch's words where it ran (a stray ``"str:"`` line),
    ``enable_gqa`` not handed on (FLASH would refuse the head counts)."""
    for q, k, v, gqa in ((*_gqa(hk=4), False), (*_gqa(), True)):
        extra = {"enable_gqa": True} if gqa else {}
        expected = {b: _pytorch_words(b, q, k, v, **extra) for b in ranked_above("MATH")}
        assert expected["FLASH_ATTENTION"] == []  # the premise: forced FLASH runs it
        assert refusals.refusals(q, k, v, None, 0.0, False, None, gqa, "MATH") == (expected, refusals.SOURCE_FORCED)


def test_nested_and_meta_inputs_are_not_asked() -> None:
    """No stand-in is built for nested inputs or on a device other than CPU and CUDA: nothing is asked, and the
    source says "not asked: " and why (the form ``records.CallRecord.sdpa_refusals_source`` documents). Witness:
    ``Tensor.is_nested`` and ``Tensor.device`` of the tensors built here. Faults caught: the reason's text
    garbled or upper-cased, the device not named."""
    q = torch.nested.nested_tensor([torch.randn(4, n, 16) for n in (3, 5)], layout=torch.jagged)
    assert q.is_nested
    answer, source = refusals.refusals(q, q, q, None, 0.0, False, None, False, "MATH")
    assert answer is None and source.startswith("not asked: ") and "nested" in source
    meta = torch.zeros(2, 4, 8, 16, device="meta")
    answer, source = refusals.refusals(meta, meta, meta, None, 0.3, False, None, False, "MATH")
    assert answer is None and source.startswith("not asked: ") and source.endswith(f" {meta.device.type}")


class _Ops(TorchDispatchMode):
    """A user's dispatch mode: records every op it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_not_asked_inside_a_users_dispatch_mode() -> None:
    """One active ``TorchDispatchMode`` of the user's would see a stand-in call: nothing is asked, and the source
    says "not asked: " and names the mode's kind. Witness: the one mode entered here (PyTorch's dispatch stack
    holds it) and ``TorchDispatchMode.__name__``. Faults caught: asking only when more than one mode is active,
    the reason's text garbled or re-cased."""
    q, k, v = _gqa(b=3, hq=5, hk=5, lq=7, lk=7, d=12)  # a signature no other test asks about
    model = DirectSDPA(lambda: (q, k, v), dropout_p=0.3)
    with _Ops() as mode:
        assert torch._C._len_torch_dispatch_stack() == 1
        with qkvtrace.trace(model) as t:
            model()
    assert mode.ops  # the premise: the mode saw the user's call
    assert t.calls[0].sdpa_refusals is None
    source = t.calls[0].sdpa_refusals_source or ""
    assert source.startswith("not asked: ") and TorchDispatchMode.__name__ in source, source


def test_not_asked_inside_a_users_profiler_says_so() -> None:
    """Asked while a profiler records: nothing is asked and the source says "not asked: " and names the
    profiler. Witness: ``torch.profiler.profile`` active here, and the profiler's own events (no SDPA op from a
    stand-in among them). Fault caught: the reason's text garbled."""
    q, k, v = _gqa(b=1, hq=3, hk=3, lq=6, lk=6, d=10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        answer, source = refusals.refusals(q, k, v, None, 0.3, False, None, False, "MATH")
    assert answer is None and source.startswith("not asked: ") and "profiler" in source
    assert not [e.name for e in prof.events() if "attention" in e.name]


@contextmanager
def _sdpa_entries() -> Iterator[list[int]]:
    """How many times Python enters PyTorch's SDPA builtin meanwhile (``sys.setprofile``'s ``c_call`` events)."""
    count = [0]
    target = torch._C._nn.scaled_dot_product_attention

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is target:
            count[0] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield count
    finally:
        sys.setprofile(previous)


def test_each_signature_is_asked_once_and_the_answer_handed_out_is_a_copy() -> None:
    """A cache asks PyTorch once per signature: the first ``get`` enters PyTorch's SDPA once per backend ranked
    above MATH, the second not at all and answers the same; a caller that changes the answer it was handed
    does not change the next one. Witness: Python's profile hook counting calls of
    ``torch._C._nn.scaled_dot_product_attention``, and forcing FLASH on the tensors here. Faults caught: a cache
    that is never read or never written (every ``get`` asks again), one that keeps only "not asked" answers,
    an answer handed out by reference."""
    q, k, v = _gqa(hk=4)
    cache = refusals.RefusalCache()
    expected = {b: _pytorch_words(b, q, k, v, dropout_p=0.3) for b in ranked_above("MATH")}
    with _sdpa_entries() as first:
        answer = cache.get(q, k, v, None, 0.3, False, None, False, "MATH")
    assert answer == (expected, refusals.SOURCE_FORCED) and first[0] == len(expected)
    answer[0].clear()
    with _sdpa_entries() as second:
        again = cache.get(q, k, v, None, 0.3, False, None, False, "MATH")
    assert second[0] == 0 and again == (expected, refusals.SOURCE_FORCED)


def test_a_not_asked_answer_is_not_kept() -> None:
    """Asked first inside a profiler ("not asked"), then outside it: the second answer is PyTorch's, not the
    first one kept. Witness: forcing each better backend here. Fault caught: "not asked" answers cached by
    signature (they depend on the moment)."""
    q, k, v = _gqa(b=1, hq=2, hk=2, lq=9, lk=9, d=8)
    cache = refusals.RefusalCache()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert cache.get(q, k, v, None, 0.3, False, None, False, "MATH")[0] is None
    expected = {b: _pytorch_words(b, q, k, v, dropout_p=0.3) for b in ranked_above("MATH")}
    assert cache.get(q, k, v, None, 0.3, False, None, False, "MATH") == (expected, refusals.SOURCE_FORCED)


def test_the_cache_tells_apart_what_changes_pytorchs_answer() -> None:
    """Through one cache, calls that differ only in the mask, in ``enable_gqa``, in the backend that ran, or in
    ``is_causal`` each get PyTorch's own answer for themselves. Witness: forcing each backend ranked above the
    chosen one on the tensors here (a 3-D mask refuses FLASH where no mask lets it run; without ``enable_gqa``
    FLASH refuses two head counts it runs with it; asked as if CUDNN_ATTENTION had run, MATH is asked too, and
    refuses a mask with ``is_causal`` that it runs without), and ``_get_sdp_priority_order`` for which backends
    are asked. Faults caught: the key or the question blind to the mask, to ``enable_gqa``, to the chosen
    backend or to ``is_causal``."""
    q, k, v = _gqa()
    same = _gqa(hk=4)
    mask, flat = torch.zeros(4, 8, 8), torch.zeros(8, 8)
    cache = refusals.RefusalCache()
    asks: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        ((same[0], same[1], same[2], None, 0.0, False, None, False), {}, "MATH"),
        ((same[0], same[1], same[2], mask, 0.0, False, None, False), {"attn_mask": mask}, "MATH"),
        ((q, k, v, None, 0.0, False, None, True), {"enable_gqa": True}, "MATH"),
        ((q, k, v, None, 0.0, False, None, False), {}, "MATH"),
        ((q, k, v, None, 0.0, False, None, False), {}, "EFFICIENT_ATTENTION"),
        ((same[0], same[1], same[2], flat, 0.0, False, None, False), {"attn_mask": flat}, "CUDNN_ATTENTION"),
        ((same[0], same[1], same[2], flat, 0.0, True, None, False), {"attn_mask": flat, "is_causal": True},
         "CUDNN_ATTENTION"),
    ]  # fmt: skip
    answers = []
    for args, kwargs, chosen in asks:
        expected = {b: _pytorch_words(b, *args[:3], **kwargs) for b in ranked_above(chosen)}
        answer = cache.get(*args, chosen)
        assert answer == (expected, refusals.SOURCE_FORCED), (kwargs, chosen)
        answers.append(answer[0])
    assert answers[0] != answers[1] and answers[2] != answers[3] and answers[3] != answers[4]  # the premise
    assert answers[5] != answers[6]


def test_the_stand_in_is_built_on_the_calls_device_whatever_the_default_device() -> None:
    """A user who set another default device (``with torch.device("meta")``, as ``torch.set_default_device``
    does) and calls attention on CPU tensors: PyTorch's answer is the one for CPU tensors. Witness: forcing
    each backend on the CPU tensors here, outside the default-device context (with dropout forced FLASH refuses
    CPU tensors, while on meta tensors it runs; a query on meta beside a CPU key is a device mismatch). Faults
    caught: stand-ins built on the default device instead of the call's, for inputs whose last stride is 1 and
    for those whose last stride is not."""
    q, k, v = _gqa(hk=4)
    strided = torch.randn(2, 4, 8, 32)[..., ::2]  # last stride 2
    for args in ((q, k, v), (strided, k, v)):
        expected = {b: _pytorch_words(b, *args, dropout_p=0.3) for b in ranked_above("MATH")}
        assert expected["FLASH_ATTENTION"]  # the premise: PyTorch refuses FLASH on CPU here
        with torch.device("meta"):
            answer = refusals.refusals(*args, None, 0.3, False, None, False, "MATH")
        assert answer == (expected, refusals.SOURCE_FORCED)


def test_releases_without_a_priority_order_ask_every_fused_backend_when_math_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Releases before 2.5 have no ``torch._C._get_sdp_priority_order``; there, when MATH ran, every fused
    backend is asked in ``SDPBackend`` order, and after a fused backend ran nothing is. This release has the
    order, so the test hides qkvtrace's handle on it (``refusals._PRIORITY``), as on such a release. Witness:
    ``SDPBackend``'s own members in value order, less MATH, ERROR and OVERRIDEABLE (no kernel of their own).
    Faults caught: the branch taken for a fused backend instead of MATH or never, the names not read, the
    non-fused backends asked instead of the fused ones."""
    members = sorted(SDPBackend.__members__.values(), key=int)
    fused = [m.name for m in members if m.name not in ("MATH", "ERROR", "OVERRIDEABLE")]
    assert "FLASH_ATTENTION" in fused  # the premise
    monkeypatch.setattr(refusals, "_PRIORITY", None)
    assert refusals.better_backends("MATH") == fused
    assert refusals.better_backends("FLASH_ATTENTION") == []
    assert refusals.better_backends(None) == []


def test_after_a_fresh_import_an_answer_is_not_reused_once_the_backend_is_switched_off() -> None:
    """The same call (dropout, so MATH runs either way) asked with FLASH_ATTENTION enabled, then with
    ``torch.backends.cuda.enable_flash_sdp(False)``: the second answer is not the first one kept (forcing FLASH
    would switch it back on, so the answer says it is off). The module reads which switches PyTorch has when it
    is imported, so it is imported afresh here (``importlib.reload``) before it is asked. Witness: PyTorch's own
    switch, ``torch.backends.cuda.flash_sdp_enabled()``, and forcing FLASH on the tensors here while it is on.
    Fault caught: a cache key blind to PyTorch's run-time switches (the switches not found, or none kept)."""
    fresh = importlib.reload(refusals)
    q, k, v = _gqa(b=1, hq=3, hk=3, lq=11, lk=11, d=8)
    cache = fresh.RefusalCache()
    expected = _pytorch_words("FLASH_ATTENTION", q, k, v, dropout_p=0.3)
    first = cache.get(q, k, v, None, 0.3, False, None, False, "MATH")[0]
    assert first is not None and first["FLASH_ATTENTION"] == expected
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert torch.backends.cuda.flash_sdp_enabled() is False
        second = cache.get(q, k, v, None, 0.3, False, None, False, "MATH")[0]
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert second is not None and second["FLASH_ATTENTION"] != expected
    assert any("flash_sdp_enabled()" in line for line in second["FLASH_ATTENTION"])


def test_a_caller_changing_a_records_reasons_does_not_change_the_next_trace() -> None:
    """Two traces of the same call; between them the caller edits the first record's reasons in place (appends a
    line, empties another backend's list). The second record still holds PyTorch's words. Witness: forcing each
    better backend on the untraced tensors here. Fault caught: the cache handing out its own lists (a copy of
    the dict alone shares them), so one caller's edit shows in every later record of that signature."""
    q, k, v = _gqa(b=2, hq=2, hk=2, lq=13, lk=13, d=8)
    model = DirectSDPA(lambda: (q, k, v), dropout_p=0.3)
    expected = {b: _pytorch_words(b, q, k, v, dropout_p=0.3) for b in ranked_above("MATH")}
    with qkvtrace.trace(model) as first:
        model()
    edited = first.calls[0].sdpa_refusals
    assert edited == expected
    edited["FLASH_ATTENTION"].append("a line of the caller's")
    edited["EFFICIENT_ATTENTION"].clear()
    with qkvtrace.trace(model) as second:
        model()
    assert second.calls[0].sdpa_refusals == expected


def test_a_bool_masks_stand_in_is_on_the_calls_device_whatever_the_default_device() -> None:
    """Asked as if CUDNN_ATTENTION had run (as on a CUDA machine), so that MATH is among the backends asked:
    MATH runs a call whose bool mask is on the call's device, and refuses one whose mask is elsewhere. Under
    another default device (``with torch.device("meta")``) the answer is still the one for the CPU tensors.
    Witness: forcing each backend ranked above CUDNN_ATTENTION on the CPU tensors and mask here, outside the
    default-device context (MATH runs them). Fault caught: a bool mask's stand-in built on the default device
    instead of the mask's."""
    q, k, v = _gqa(hk=4)
    mask = torch.ones(8, 8, dtype=torch.bool)
    expected = {b: _pytorch_words(b, q, k, v, attn_mask=mask) for b in ranked_above("CUDNN_ATTENTION")}
    assert expected["MATH"] == []  # the premise: MATH runs it
    with torch.device("meta"):
        answer = refusals.refusals(q, k, v, mask, 0.0, False, None, False, "CUDNN_ATTENTION")
    assert answer == (expected, refusals.SOURCE_FORCED)


def test_traced_calls_on_nested_and_meta_tensors_say_why_nothing_was_asked() -> None:
    """A model's SDPA call on jagged nested tensors (run by their own ``__torch_function__``, which makes no call
    through SDPA's entry) and one on the ``meta`` device (shapes, no data): each record says why no reasons were
    asked, and the trace closes. Witness: PyTorch's ``Tensor.is_nested`` and ``Tensor.device`` of the tensors
    built here. Faults caught: an empty ``sdpa_refusals_source`` on nested calls, a strided nested call given up
    on (its sizes read for a signature); a trace that cannot close
    because it tries to read numbers out of meta tensors."""
    nested = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged)
    q = nested.transpose(1, 2)
    assert q.is_nested
    model = DirectSDPA(lambda: (q, q, q))
    with qkvtrace.trace(model) as t:
        model()
    call = t.calls[0]
    assert call.sdpa_refusals is None
    assert call.sdpa_refusals_source is not None and call.sdpa_refusals_source.startswith("not asked: nested")
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])  # the older layout
    assert strided.is_nested and strided.layout == torch.strided
    model = DirectSDPA(lambda: (strided, strided, strided))
    with qkvtrace.trace(model) as t:
        model()
    assert not t.result.warnings  # recorded, not given up on
    assert t.calls[0].sdpa_refusals_source.startswith("not asked: nested")
    meta = torch.randn(2, 2, 4, 8, device="meta")
    assert meta.device.type == "meta"
    model = DirectSDPA(lambda: (meta, meta, meta))
    with qkvtrace.trace(model) as t:
        model()
    call = t.calls[0]
    assert call.sdpa_refusals_source == f"not asked: no stand-in is built on {meta.device.type}"
    assert call.output["nan_count"] is None  # no data to count in
