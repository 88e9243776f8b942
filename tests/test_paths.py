"""Backend evidence: PyTorch's own selection, profiler evidence, refusal reasons as records."""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from qkvtrace.base import compat
from qkvtrace.facts import paths


def test_backend_names_come_from_pytorch() -> None:
    """Witness: PyTorch's ``SDPBackend`` enum, its members' names and values."""
    names = compat.sdp_backend_names()
    assert names == {int(m.value): n for n, m in SDPBackend.__members__.items()}
    assert compat.sdp_backend_name(int(SDPBackend.MATH.value)) == "MATH"
    assert compat.sdp_backend_name(int(SDPBackend.ERROR.value)) is None


def test_sdpa_backend_follows_the_enabled_kernels() -> None:
    """Witness: MATH forced by ``sdpa_kernel``; else ``torch._fused_sdp_choice``, named by ``SDPBackend`` here."""
    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel(SDPBackend.MATH):
        assert paths.sdpa_backend(q, q, q) == "MATH"
    default = paths.sdpa_backend(q, q, q)
    names = {int(m.value): n for n, m in SDPBackend.__members__.items()}
    assert default == names[int(torch._fused_sdp_choice(q, q, q))]


def test_kernel_evidence_sees_the_kernel_and_caches_per_signature() -> None:
    """Witness: the MATH kernel forced by PyTorch's sdpa_kernel; the cache key's switches read from
    torch.backends.cuda."""
    ev = paths.KernelEvidence()
    q = torch.randn(1, 2, 8, 16)
    raw = torch._C._nn.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.MATH):
        _, ops, evidence = ev.run(("t", "math"), raw, q, q, q)
    assert evidence == "witnessed"
    assert ops is not None and "aten::scaled_dot_product_attention" in ops
    assert any("math" in op for op in ops)
    # the same signature is not profiled again; switching a backend off changes the key
    with sdpa_kernel(SDPBackend.MATH):
        _, again, evidence = ev.run(("t", "math"), raw, q, q, q)
    assert again is ops and evidence == "cached"
    # the switches in the cache key are PyTorch's own, read here through torch.backends.cuda
    cuda = torch.backends.cuda
    names = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")

    def switches() -> tuple[bool | None, ...]:
        return tuple(getattr(cuda, n)() if hasattr(cuda, n) else None for n in names)

    assert paths.sdp_flags() == switches()
    with sdpa_kernel(SDPBackend.MATH):
        assert paths.sdp_flags() == switches() and paths.sdp_flags()[2] is True
        assert paths.sdp_flags()[0] is False  # flash switched off: another key than outside


def test_no_evidence_under_a_user_profiler() -> None:
    """Witness: a user's profiler opened here (profilers do not nest), so no op list can be measured."""
    ev = paths.KernelEvidence()
    q = torch.randn(1, 2, 8, 16)
    with torch.autograd.profiler.profile():
        _, ops, evidence = ev.run(("t",), torch._C._nn.scaled_dot_product_attention, q, q, q)
    assert ops is None  # profilers do not nest: no evidence rather than a wrong one
    assert evidence.startswith("unavailable: ")


def _refusing_check(params: object, debug: bool = False) -> bool:
    # the way torch.backends.cuda.can_use_* report: a UserWarning per reason, then False
    if debug:
        warnings.warn("Flash attention requires q,k,v to have the same last dimension", UserWarning, stacklevel=1)
        warnings.warn("Expected query, key and value to all be of dtype: {Half, BFloat16}", UserWarning, stacklevel=1)
    return False


def test_refusal_warnings_become_records() -> None:
    """Witness: the warnings ``_refusing_check`` emits, written in the test."""
    assert paths.warnings_to_reasons(_refusing_check, object()) == [
        "Flash attention requires q,k,v to have the same last dimension",
        "Expected query, key and value to all be of dtype: {Half, BFloat16}",
    ]
    assert paths.warnings_to_reasons(lambda p, debug: True, object()) == []


def test_refusals_with_pytorchs_own_checks_do_not_crash_on_cpu() -> None:
    """Witness: PyTorch's own ``torch.backends.cuda.can_use_*`` checks, called here on the same query (the
    exception one of them raises, where it raises: a CUDA build on a machine without a usable driver)."""
    q = torch.randn(1, 2, 8, 16)
    result = paths.sdpa_refusals(q, q, q, None, 0.0, False)
    if result is None:
        pytest.skip("this PyTorch exposes no can_use_* checks with debug")
    assert set(result) <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"}
    assert all(isinstance(r, list) and all(isinstance(x, str) for x in r) for r in result.values())
    # usable ([]) exactly where PyTorch's own check says so
    cuda = torch.backends.cuda
    try:
        params = cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    except TypeError:  # before enable_gqa
        params = cuda.SDPAParams(q, q, q, None, 0.0, False)
    checks = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn"}
    for backend, reasons in result.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                usable = getattr(cuda, f"can_use_{checks[backend]}_attention")(params, True)
            except RuntimeError as exc:  # a CUDA build with no usable driver: PyTorch's own check raises
                assert reasons == [f"check failed: {exc}"], (backend, reasons)
                continue
        assert (reasons == []) == usable, (backend, reasons)


def test_refusals_are_exactly_what_pytorchs_checks_say() -> None:
    """Witness: PyTorch's ``torch.backends.cuda.can_use_*`` checks that take ``debug``, called here on the same
    ``SDPAParams`` with the warnings recorded here. Catches a lost or skipped check, the params or the check not
    handed on, a check's answer dropped, and the wording of a refusal PyTorch gives no reason for."""
    q = torch.randn(1, 2, 8, 16)
    cuda = torch.backends.cuda
    names = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn"}
    available = {
        backend: getattr(cuda, f"can_use_{short}_attention")
        for backend, short in names.items()
        if hasattr(cuda, f"can_use_{short}_attention")
        and "debug" in inspect.signature(getattr(cuda, f"can_use_{short}_attention")).parameters
    }
    result = paths.sdpa_refusals(q, q, q, None, 0.0, False)
    if not available:
        assert result is None
        return
    try:
        params = cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    except TypeError:  # before enable_gqa
        params = cuda.SDPAParams(q, q, q, None, 0.0, False)
    expected: dict[str, list[str]] = {}
    for backend, check in available.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                usable = check(params, debug=True)
            except (RuntimeError, TypeError) as exc:
                expected[backend] = [f"check failed: {exc}"]
                continue
        said = [str(w.message).strip() for w in caught]
        expected[backend] = [] if usable else (said or ["refused (PyTorch gave no reason)"])
    assert result == expected


def _choice_name(*args: object, **kwargs: object) -> str:
    names = {int(m.value): n for n, m in SDPBackend.__members__.items()}
    return names[int(torch._fused_sdp_choice(*args, **kwargs))]


def test_sdpa_backend_hands_every_argument_to_pytorchs_choice() -> None:
    """Witness: ``torch._fused_sdp_choice`` called here on the same arguments, and PyTorch choosing differently
    with and without each argument (checked here). Catches a dropped mask, dropout, ``enable_gqa`` or ``scale``,
    a wrong ``enable_gqa`` default, and misspelt keywords (PyTorch's TypeError would make the answer None)."""
    q = torch.randn(1, 2, 8, 16)
    mask = torch.zeros(8, 8, requires_grad=True)  # a mask that needs grad keeps the CPU flash kernel out
    assert _choice_name(q, q, q, mask, 0.0, False) != _choice_name(q, q, q, None, 0.0, False)
    assert paths.sdpa_backend(q, q, q, mask) == _choice_name(q, q, q, mask, 0.0, False)
    assert _choice_name(q, q, q, None, 0.5, False) != _choice_name(q, q, q, None, 0.0, False)
    assert paths.sdpa_backend(q, q, q, None, 0.5) == _choice_name(q, q, q, None, 0.5, False)
    q4, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)  # 4 query heads share 2 key/value heads
    grouped, plain = _choice_name(q4, kv, kv, enable_gqa=True), _choice_name(q4, kv, kv)
    assert grouped != plain
    assert paths.sdpa_backend(q4, kv, kv, enable_gqa=True) == grouped
    assert paths.sdpa_backend(q4, kv, kv) == plain
    assert paths.sdpa_backend(q, q, q, scale=0.5) == _choice_name(q, q, q, scale=0.5)


def test_is_flex_op_knows_flex_attentions_operator() -> None:
    """Witness: the names PyTorch gives FlexAttention's operator, read here: the higher-order op's name
    (``flex_attention``) and its autograd Function's class (the event name the profiler records for an eager
    call). Catches a wrong spelling, case or underscore handling in the test."""
    try:
        hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:
        hop = None
    if getattr(hop, "flex_attention", None) is None:
        pytest.skip("this PyTorch has no FlexAttention operator")
    names = [hop.flex_attention.name()]
    if hasattr(hop, "FlexAttentionAutogradOp"):
        names.append(hop.FlexAttentionAutogradOp.__name__)
    assert "_" in names[0]  # the underscore the test must see through
    assert all(paths.is_flex_op(n) for n in names), names
    assert not any(paths.is_flex_op(n) for n in ("aten::scaled_dot_product_attention", "aten::bmm"))


def _attention_ops_under(backend: SDPBackend, q: torch.Tensor) -> list[str]:
    """The ``aten::`` attention ops PyTorch's profiler records for one call with only ``backend`` enabled."""
    with sdpa_kernel(backend), torch.autograd.profiler.profile() as prof:
        torch._C._nn.scaled_dot_product_attention(q, q, q)
    events = sorted(prof.function_events, key=lambda e: e.time_range.start)
    return [e.name for e in events if e.name.startswith("aten::") and "attention" in e.name]


def test_kernel_evidence_keeps_exactly_the_attention_ops_of_the_call() -> None:
    """Witness: PyTorch's profiler run here on the same call, its ``aten::`` ops naming attention; the two
    backends forced by ``sdpa_kernel``. Catches other ops (matmul, softmax) or ops outside the marked call
    kept, one cache entry for every signature, and the marker range taken from another event."""
    q = torch.randn(1, 2, 8, 16)
    raw = torch._C._nn.scaled_dot_product_attention
    x = torch.randn(4, 4)
    ev = paths.KernelEvidence()
    with sdpa_kernel(SDPBackend.MATH):
        _, math_ops, evidence = ev.run(("m",), lambda: (torch.mm(x, x), raw(q, q, q))[1])
    assert evidence == "witnessed"
    assert math_ops == _attention_ops_under(SDPBackend.MATH, q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        _, flash_ops, evidence = ev.run(("f",), raw, q, q, q)
    assert evidence == "witnessed"  # another signature: profiled, not the first one's ops
    assert flash_ops == _attention_ops_under(SDPBackend.FLASH_ATTENTION, q) != math_ops


def test_kernel_evidence_passes_keyword_arguments_on_every_path() -> None:
    """Witness: PyTorch's SDPA called here with ``is_causal=True`` (and seen to differ from the non-causal
    result). Catches keyword arguments dropped when the call is profiled, cached or run under a user's
    profiler."""
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    raw = torch._C._nn.scaled_dot_product_attention
    causal = raw(q, k, v, is_causal=True)
    assert not torch.allclose(causal, raw(q, k, v))
    ev = paths.KernelEvidence()
    for expected_evidence in ("witnessed", "cached"):
        out, _, evidence = ev.run(("c",), raw, q, k, v, is_causal=True)
        assert evidence == expected_evidence
        torch.testing.assert_close(out, causal, rtol=0, atol=0)
    with torch.autograd.profiler.profile():
        out, ops, evidence = paths.KernelEvidence().run(("c",), raw, q, k, v, is_causal=True)
    assert ops is None and evidence.startswith("unavailable: ")
    torch.testing.assert_close(out, causal, rtol=0, atol=0)


def test_kernel_evidence_does_not_wait_for_another_threads_profiling() -> None:
    """Witness: a second thread that holds the evidence's profiler run open (its call waits on an event set
    here), PyTorch's profiler being per thread. Catches waiting for the lock instead of answering
    "unavailable" at once (the call here would then wait for that thread and be profiled)."""
    q = torch.randn(1, 2, 8, 16)
    raw = torch._C._nn.scaled_dot_product_attention
    ev = paths.KernelEvidence()
    inside, release = threading.Event(), threading.Event()

    def held() -> torch.Tensor:
        inside.set()
        release.wait(timeout=3.0)
        return raw(q, q, q)

    worker = threading.Thread(target=lambda: ev.run(("held",), held))
    worker.start()
    try:
        assert inside.wait(timeout=10.0)
        _, ops, evidence = ev.run(("other",), raw, q, q, q)
        still_held = not release.is_set() and worker.is_alive()
    finally:
        release.set()
        worker.join()
    assert still_held
    assert ops is None and evidence.startswith("unavailable: ")


def test_backend_of_names_the_backend_whose_kernel_ran() -> None:
    """Witness: the kernels PyTorch's profiler records here with MATH, then FLASH_ATTENTION, forced by
    ``sdpa_kernel`` (the backends PyTorch's CPU build can run). Catches a calibration that learns nothing,
    the wrong kernel (the generic ``aten::scaled_dot_product_attention``), the wrong device or backend, a
    backend answered for calls with no SDPA op, and a calibration skipped because another device was
    learned."""
    q = torch.randn(1, 2, 8, 16)
    ev = paths.KernelEvidence()
    ev.learn("meta", "aten::bmm", "MATH")  # another device's kernel says nothing about the CPU's
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        ops = _attention_ops_under(backend, q)
        assert ops[0] == "aten::scaled_dot_product_attention" and len(ops) > 1
        assert ev.backend_of("cpu", ops) == backend.name
    assert ev.backend_of("cpu", ["aten::bmm", "aten::_softmax"]) is None  # no SDPA op at all
    assert ev.backend_of("cpu", ["aten::scaled_dot_product_attention"]) is None  # no backend's own kernel


def test_calibrate_once_learns_what_a_profiled_run_cannot() -> None:
    """Witness: the kernel PyTorch's profiler records here under ``sdpa_kernel(MATH)``; a user's profiler
    opened here, under which no calibration can run (profilers do not nest), so only what ``calibrate_once``
    learned before can answer. Catches a calibrate_once that does nothing, or learns for another device."""
    q = torch.randn(1, 2, 8, 16)
    math_ops = _attention_ops_under(SDPBackend.MATH, q)
    ev, untaught = paths.KernelEvidence(), paths.KernelEvidence()
    ev.learn("meta", "aten::bmm", "MATH")
    ev.calibrate_once("cpu")
    with torch.autograd.profiler.profile():
        assert ev.backend_of("cpu", math_ops) == "MATH"
        assert untaught.backend_of("cpu", math_ops) is None
        untaught.calibrate_once("cpu")
    assert untaught.backend_of("cpu", math_ops) == "MATH"
