"""Why not a faster kernel: PyTorch's own words for each backend it ranks above the one it chose.

Witness for every reason: the warning PyTorch itself prints when the test
forces that backend (``torch.nn.attention.sdpa_kernel``) on the very tensors
of the call, untraced; the chosen backend is ``torch._fused_sdp_choice`` on
the same tensors, and "ranks above" is PyTorch's ``_get_sdp_priority_order``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _witness import DirectSDPA, ranked_above, sdpa_choice
from torch import nn

import qkvtrace
from qkvtrace.pytest_plugin import assert_backend

sdpa_kernel = pytest.importorskip("torch.nn.attention").sdpa_kernel
SDPBackend = pytest.importorskip("torch.nn.attention").SDPBackend
if not hasattr(torch._C, "_get_sdp_priority_order"):
    pytest.skip("this PyTorch does not expose its SDPA priority order", allow_module_level=True)


def _pytorch_reasons(backend: str, *args: Any, **kwargs: Any) -> list[str]:
    """What PyTorch warns when ``backend`` is forced on these tensors (the witness), location suffixes cut."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError), sdpa_kernel(getattr(SDPBackend, backend)):
            torch._C._nn.scaled_dot_product_attention(*args, **kwargs)
    lines = [re.sub(r"\s*\(Triggered internally at .*\)\s*$", "", str(w.message)).strip() for w in caught]
    return [line for line in lines if line and not line.endswith("because:")]


def _qkv(q_shape: tuple[int, ...] = (2, 4, 8, 16), v_dim: int = 16, kv_heads: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    b, n, d = q_shape[0], q_shape[-2], q_shape[-1]
    q = torch.randn(q_shape, generator=g)
    k = torch.randn(b, kv_heads, n, d, generator=g)
    v = torch.randn(b, kv_heads, n, v_dim, generator=g)
    if len(q_shape) == 3:
        k, v = k[0], v[0]
    return q, k, v


CASES: dict[str, tuple[Callable[[], tuple[Any, ...]], dict[str, Any]]] = {
    "dropout": (lambda: _qkv(), {"dropout_p": 0.3}),
    "three_dimensional": (lambda: _qkv((4, 8, 16)), {}),
    "value_head_size": (lambda: _qkv(v_dim=8), {}),
    "last_dim_stride": (lambda: tuple(t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in _qkv()), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_refusal_is_pytorchs_own_warning(case: str) -> None:
    """Each refusal PyTorch's CPU selection gives here, read from a traced direct SDPA call.

    Witness: PyTorch's warnings when the test forces FLASH_ATTENTION on the same tensors untraced,
    ``torch._fused_sdp_choice``, ``_get_sdp_priority_order``, and the untraced output.
    """
    make, kwargs = CASES[case]
    args = make()
    chosen = sdpa_choice(*args, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0), False)
    if chosen != "MATH":  # the premise: PyTorch falls back here (releases differ: 2.14 runs 3-D inputs on FLASH)
        pytest.skip(f"torch {torch.__version__} does not refuse FLASH_ATTENTION for {case}: ran {chosen}")
    expected = _pytorch_reasons("FLASH_ATTENTION", *args, **kwargs)
    assert expected, "PyTorch gave no reason when forced (the witness is empty)"
    model = DirectSDPA(make, **kwargs)
    torch.manual_seed(0)
    plain = model()
    with qkvtrace.trace(model) as t:
        torch.manual_seed(0)
        traced = model()
    assert torch.equal(plain, traced)
    [call] = t.calls
    assert call.sdpa_backend == chosen
    assert list(call.sdpa_refusals) == ranked_above(chosen)
    got = call.sdpa_refusals["FLASH_ATTENTION"]
    for line in expected:
        assert line in got
    assert call.sdpa_refusals_source is not None and "stand-in" in call.sdpa_refusals_source


def test_multihead_attention_in_training_says_dropout() -> None:
    """The fallback of a training MHA with dropout: PyTorch's words when FLASH is forced on what SDPA got.

    Witness: forcing FLASH on tensors of the kernel's shapes (batch, heads,
    length, head size) with the module's dropout; the untraced output and
    random state (the stand-in draws nothing from the user's generator).
    """
    mha = nn.MultiheadAttention(16, 4, dropout=0.2, batch_first=True)
    x = torch.randn(2, 5, 16)
    torch.manual_seed(7)
    plain = mha(x, x, x, need_weights=False)[0]
    plain_rng = torch.get_rng_state()
    with qkvtrace.trace(mha) as t:
        torch.manual_seed(7)
        traced = mha(x, x, x, need_weights=False)[0]
        traced_rng = torch.get_rng_state()
    assert torch.equal(plain, traced) and torch.equal(plain_rng, traced_rng)
    q = torch.zeros(2, 4, 5, 4, requires_grad=True)
    expected = _pytorch_reasons("FLASH_ATTENTION", q, q, q, dropout_p=0.2)
    assert expected, "PyTorch gave no reason when forced (the witness is empty: the loop below would pass)"
    assert any("dropout" in line.lower() for line in expected), expected
    [call] = t.calls
    assert call.path == "fallback" and call.sdpa_backend == "MATH"
    assert call.inputs["dropout_p"] == pytest.approx(0.2)
    for line in expected:
        assert line in call.sdpa_refusals["FLASH_ATTENTION"]


def test_no_refusal_when_pytorch_chose_its_first_choice() -> None:
    """Eval, no dropout: PyTorch's first-ranked backend ran (witness: _fused_sdp_choice), nothing to explain."""
    q, k, v = _qkv()
    chosen = sdpa_choice(q, k, v)
    assert ranked_above(chosen) == []
    model = DirectSDPA(lambda: (q, k, v))
    with qkvtrace.trace(model) as t:
        model()
    assert t.calls[0].sdpa_refusals == {}


def test_a_backend_switched_off_says_so() -> None:
    """``torch.backends.cuda.enable_flash_sdp(False)``: PyTorch then picks MATH (its own choice is the witness)."""
    q, k, v = _qkv()
    model = DirectSDPA(lambda: (q, k, v))
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        chosen = sdpa_choice(q, k, v)
        with qkvtrace.trace(model) as t:
            model()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert chosen == "MATH" and t.calls[0].sdpa_backend == "MATH"
    assert t.calls[0].sdpa_refusals["FLASH_ATTENTION"] == [
        "torch.backends.cuda.flash_sdp_enabled() is False: the backend is switched off"
    ]


def test_not_asked_inside_a_users_profiler() -> None:
    """A user's profiler must not see the stand-in: its recorded ops are those of the untraced run (witness)."""
    q, k, v = _qkv((3, 2, 7, 12), v_dim=12, kv_heads=2)  # a signature no other test asks about
    model = DirectSDPA(lambda: (q, k, v), dropout_p=0.3)

    def ops(trace: bool) -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.manual_seed(0)
            if trace:
                with qkvtrace.trace(model) as t:
                    model()
                assert t.calls[0].sdpa_refusals is None
                assert "profiler" in (t.calls[0].sdpa_refusals_source or "")
            else:
                model()
        return sorted(e.name for e in prof.events() if "attention" in e.name)

    assert ops(trace=True) == ops(trace=False)


def test_trace_command_shows_why_not_a_faster_kernel(tmp_path: Path) -> None:
    """The terminal table: the reason column holds PyTorch's dropout warning (witness: forcing FLASH here)."""
    src = tmp_path / "drop.py"
    src.write_text(
        textwrap.dedent(
            """
            import torch, torch.nn.functional as F
            from torch import nn

            class Drop(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.qkv = nn.Linear(16, 48)

                def forward(self, x):
                    q, k, v = (t.reshape(2, -1, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)

            def build():
                return Drop(), (torch.randn(2, 5, 16),)
            """
        )
    )
    out = subprocess.run([sys.executable, "-m", "qkvtrace", "trace", f"{src}:build", "--train"],
                         capture_output=True, text=True, env={"COLUMNS": "250", **_env()})  # fmt: skip
    assert out.returncode == 0, out.stderr
    q = torch.zeros(2, 4, 5, 4, requires_grad=True)
    [reason] = _pytorch_reasons("FLASH_ATTENTION", q, q, q, dropout_p=0.1)
    assert f"not FLASH_ATTENTION: {reason}" in " ".join(out.stdout.replace("│", " ").split())


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


def test_assert_backend_failure_says_why() -> None:
    """``assert_backend("FLASH_ATTENTION")`` on a MATH call: the message carries PyTorch's reason (witness: forcing)."""
    q, k, v = _qkv()
    model = DirectSDPA(lambda: (q, k, v), dropout_p=0.3)
    with qkvtrace.trace(model) as t:
        model()
    [reason] = _pytorch_reasons("FLASH_ATTENTION", q, k, v, dropout_p=0.3)
    with pytest.raises(AssertionError) as failed:
        assert_backend(t, "FLASH_ATTENTION")
    assert reason in " ".join(str(failed.value).split())


def test_the_cached_answer_is_keyed_by_all_a_refusal_can_depend_on() -> None:
    """PyTorch's reasons are asked once per call signature and looked up after. Two calls that differ in one
    property PyTorch's checks read (a dtype, a mask's dtype, which of its dimensions broadcast, its last stride,
    causal, dropout, scale, GQA, grad mode, which inputs require grad, a sequence length up to 128, which sequence
    is longer, a head size, a layout's last stride) must not share an answer; two calls that differ only in values,
    or in lengths both past 128, share it. Witness: the pairs built here, each differing in one property by
    construction. Fault caught: a cache key blind to one of them, which would hand one call another's reasons."""
    from qkvtrace.facts.refusals import signature

    b, h, t, d = 2, 3, 8, 16

    def key(q: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
            mask: Any = None, dropout: float = 0.0, causal: bool = False, scale: Any = None,
            gqa: bool = False) -> Any:  # fmt: skip
        q = torch.randn(b, h, t, d) if q is None else q
        k = torch.randn(b, h, t, d) if k is None else k
        v = torch.randn(b, h, t, d) if v is None else v
        return signature(q, k, v, mask, dropout, causal, scale, gqa, "MATH")

    base = key()
    x = torch.randn(b, h, t, d)
    differing = {
        "q dtype": key(q=x.double()),
        "k dtype": key(k=x.double()),
        "v dtype": key(v=x.double()),
        "a bool mask": key(mask=torch.ones(t, t, dtype=torch.bool)),
        "a float mask": key(mask=torch.zeros(t, t)),
        "causal": key(causal=True),
        "dropout": key(dropout=0.1),
        "scale": key(scale=0.5),
        "gqa": key(gqa=True),
        "q requires grad": key(q=x.clone().requires_grad_()),
        "k requires grad": key(k=x.clone().requires_grad_()),
        "v requires grad": key(v=x.clone().requires_grad_()),
        "query length": key(q=torch.randn(b, h, t + 1, d)),
        "key length": key(k=torch.randn(b, h, t + 1, d), v=torch.randn(b, h, t + 1, d)),
        "head size": key(q=torch.randn(b, h, t, d * 2), k=torch.randn(b, h, t, d * 2)),
        "value head size": key(v=torch.randn(b, h, t, d * 2)),
        "batch": key(q=torch.randn(b + 1, h, t, d)),
        "key heads": key(k=torch.randn(b, 1, t, d)),
        "q last stride": key(q=torch.randn(b, h, d, t).transpose(-2, -1)),
        "k last stride": key(k=torch.randn(b, h, d, t).transpose(-2, -1)),
        "v last stride": key(v=torch.randn(b, h, d, t).transpose(-2, -1)),
    }
    with torch.no_grad():
        differing["grad mode"] = key()
    mask = torch.zeros(1, 1, t, t)
    assert key(mask=mask) != key(mask=torch.zeros(b, h, t, t)), "which dimensions broadcast"
    assert key(mask=mask) != key(mask=torch.zeros(b, h, t, t).half()), "a mask's dtype"
    assert key(mask=torch.zeros(t, t)) != key(mask=torch.zeros(t, t).t().contiguous().t()), "a mask's last stride"
    long_q, longer_q = torch.randn(b, h, 200, d), torch.randn(b, h, 300, d)
    long_k = torch.randn(b, h, 250, d)
    assert key(q=long_q, k=long_k, v=long_k) != key(q=longer_q, k=long_k, v=long_k), "which sequence is longer"
    for name, other in differing.items():
        assert other != base, f"{name} is not in the key"
    assert key() == base and key(mask=torch.zeros(t, t)) == key(mask=torch.ones(t, t)), "values are not in the key"
    assert key(q=long_q, k=torch.randn(b, h, 150, d), v=torch.randn(b, h, 150, d)) == key(
        q=torch.randn(b, h, 400, d), k=long_k, v=long_k), "lengths past 128 (query longer both times) share a key"


def test_the_cached_answer_is_shared_where_nothing_a_check_reads_differs() -> None:
    """The other side of the key: calls that differ only in what no check reads share one answer, and the key
    reads the sizes of three-dimensional inputs (``[B·H, T, d]``) as well as four-dimensional ones. Witness: the
    pairs built here, equal or differing by construction in one property. Faults caught: a key that reads a
    stride other than the last one (a slice of a wider tensor has other strides there), the full lengths rather
    than lengths capped at 128, a length or head size read from the wrong dimension, and the order of two
    lengths read with ``>=`` or ``<=``."""
    from qkvtrace.facts.refusals import signature

    b, h, t, d = 2, 3, 8, 16

    def key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> Any:
        return signature(q, k, v, mask, 0.0, False, None, False, "MATH")

    def x(*shape: int) -> torch.Tensor:
        return torch.randn(*shape)

    base4 = x(b, h, t, d)
    wide = x(b, h, t, 2 * d)[..., :d]  # last stride 1, others those of a wider tensor
    for part in range(3):
        args = [base4, base4, base4]
        args[part] = wide
        assert key(*args) == key(base4, base4, base4), f"input {part}: strides but the last are not in the key"
    mask, wide_mask = torch.zeros(1, h, t, t), torch.zeros(1, h, t, 2 * t)[..., :t]
    assert key(base4, base4, base4, mask) == key(base4, base4, base4, wide_mask)
    assert key(base4, base4, base4, torch.zeros(1, 1, t, t)) != key(base4, base4, base4, torch.zeros(3, 3, t, t))
    # four-dimensional: q's head size, k's, q's heads, each alone
    assert key(x(b, h, t, 2 * d), base4, base4) != key(base4, base4, base4)
    assert key(base4, x(b, h, t, 2 * d), base4) != key(base4, base4, base4)
    assert key(x(b, h + 1, t, d), base4, base4) != key(base4, base4, base4)
    # three-dimensional: lengths, head sizes and batch read from the right dimension; lengths capped at 128
    q3, k3 = x(b * h, t, d), x(b * h, t, d)
    assert key(x(b * h, t + 1, d), k3, k3) != key(q3, k3, k3)
    assert key(q3, x(b * h, t + 1, d), x(b * h, t + 1, d)) != key(q3, k3, k3)
    assert key(x(b * h, 200, d), x(b * h, 150, d), x(b * h, 150, d)) == key(
        x(b * h, 400, d), x(b * h, 300, d), x(b * h, 300, d))
    # which sequence is longer, past the cap: equal, query longer, key longer are three answers
    equal = key(x(b, h, 200, d), x(b, h, 200, d), x(b, h, 200, d))
    q_longer = key(x(b, h, 300, d), x(b, h, 200, d), x(b, h, 200, d))
    k_longer = key(x(b, h, 200, d), x(b, h, 300, d), x(b, h, 300, d))
    assert len({equal, q_longer, k_longer}) == 3
    with pytest.raises((IndexError, RuntimeError)):
        torch.tensor(True).stride(-1)  # a 0-d mask has no last stride: the key must not ask for one
    assert key(base4, base4, base4, torch.tensor(True)) == key(base4, base4, base4, torch.tensor(False))


@pytest.mark.parametrize("lq", [1, 2, 3, 127, 128, 129, 200, 500])
@pytest.mark.parametrize("lk", [1, 2, 3, 127, 128, 129, 200, 500])
def test_the_stand_in_keeps_what_pytorchs_checks_read(lq: int, lk: int) -> None:
    """PyTorch is asked its reasons on a small stand-in of the call (zeros of the call's dtypes, lengths capped at
    128). Witness: the rules written here, applied to the call built here — each length kept when both are at
    most 128, capped at 128 otherwise, at least 1, and which one is longer kept exactly; the leading sizes and head
    sizes as given; each input's dtype, last stride (a slice with stride 3; a broadcast one with stride 0 gets a
    stride of its own, 2) and whether it requires grad (only with grad enabled, and never a bool mask's); a mask's
    broadcast dimensions kept at 1, the others those of the stand-in's scores, a bool mask all True, a float one
    zeros. Faults caught: lengths made equal or swapped in order, caps off by one, strides or grad lost."""
    from qkvtrace.facts.refusals import _stand_in

    b, h, d = 2, 3, 4
    q = torch.randn(b, h, lq, 3 * d, dtype=torch.float64)[..., ::3].requires_grad_()  # last stride 3
    k = torch.randn(b, 1, lk, d, dtype=torch.float64)
    v = torch.randn(1, 1, 1, 2 * d).expand(b, 1, lk, 2 * d)  # last stride 1, broadcast elsewhere
    mask = torch.zeros(1, h, 1, lk).expand(1, h, lq, lk)[..., :]  # last stride 1
    sq, sk, sv, sm = _stand_in(q, k, v, mask)
    a, c = sq.shape[-2], sk.shape[-2]
    if lq <= 128 and lk <= 128:
        assert (a, c) == (lq, lk)
    assert 1 <= a <= 128 and 1 <= c <= 128
    assert (a > c) - (a < c) == (lq > lk) - (lq < lk)
    if lq >= 128 and lk >= 128 and lq != lk:  # both past the cap: the longer at 128, the shorter just below
        assert (max(a, c), min(a, c)) == (128, 127)
    assert sq.shape == (b, h, a, d) and sk.shape == (b, 1, c, d) and sv.shape == (b, 1, c, 2 * d)
    assert (sq.dtype, sk.dtype, sv.dtype) == (q.dtype, k.dtype, v.dtype)
    assert (sq.stride(-1), sk.stride(-1), sv.stride(-1)) == (3, 1, 1)
    assert (sq.requires_grad, sk.requires_grad, sv.requires_grad) == (True, False, False)
    assert sm is not None and sm.shape == (1, h, a, c) and not sm.any() and sm.dtype == mask.dtype
    with torch.no_grad():
        assert not _stand_in(q, k, v, None)[0].requires_grad
    flat = torch.zeros(1, 1, 1, 1).expand(b, h, lq, d)  # stride 0 everywhere
    assert _stand_in(flat, k, v, None)[0].stride(-1) == 2
    blocked = torch.zeros(lq, lk, dtype=torch.bool)
    sb = _stand_in(q, k, v, blocked)[3]
    assert sb is not None and sb.shape == (a, c) and sb.dtype == torch.bool and sb.all() and not sb.requires_grad
    scalar = _stand_in(q, k, v, torch.tensor(0.0))[3]  # a 0-d float mask: no last stride to keep
    assert scalar is not None and scalar.shape == () and scalar.dtype == torch.float32
    three = _stand_in(torch.randn(b * h, lq, d), torch.randn(b * h, lk, d), torch.randn(b * h, lk, d), None)
    assert (three[0].shape, three[1].shape) == ((b * h, a, d), (b * h, c, d))
