"""Backend evidence: PyTorch's own selection, profiler evidence, refusal reasons as records."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from qkvtrace import compat, paths


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
