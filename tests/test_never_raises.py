"""The tracer never raises into a call: when reading a call fails, the caller gets what the call gave.

A failure is injected into each observer -- before the call (finding the
traced module), after it (delivering the record) -- on every entry point.
Witness: the same seeded call with no trace open: its output bit for bit,
the random state after it (dropout draws once, so a second run of the kernel
would show), and, for a refused call, PyTorch's own exception type and
message. What the user may see of the failure is one line in
``result.warnings``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.tracer import registry
from qkvtrace.tracer.observers import flex, layer, mha, sdpa

E, H, B, L = 16, 4, 2, 5


class Boom(Exception):
    """The injected failure (never one PyTorch raises)."""


def _boom(*_: Any, **__: Any) -> Any:
    raise Boom("injected")


class PackedSDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(B, -1, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)


class DirectMHA(nn.Module):
    """A module that calls ``F.multi_head_attention_forward`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.MultiheadAttention(E, H, dropout=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        out, _ = F.multi_head_attention_forward(
            x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.3,
            m.out_proj.weight, m.out_proj.bias, training=self.training, need_weights=False,
        )  # fmt: skip
        return out


class Flex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (t.reshape(B, -1, H, E // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return flex_attention(q, k, v)


def _mha(train: bool) -> nn.Module:
    return nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True).train(train)


class SelfAttend(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.attn = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


#: name -> (model maker, batch-first input?, grad enabled?, the observer modules whose ``deliver`` to break)
CASES: dict[str, tuple[Callable[[], nn.Module], bool, bool]] = {
    "sdpa": (lambda: PackedSDPA().train(), True, True),
    "mha_fast": (lambda: SelfAttend(_mha(False)).eval(), True, False),
    "mha_fallback": (lambda: SelfAttend(_mha(True)), True, True),
    "mha_function": (lambda: DirectMHA().train(), False, True),
    "fused_encoder_layer": (
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False
        ).eval(),
        True,
        False,
    ),
    "flex": (lambda: Flex().eval(), True, False),  # no backward on the CPU
}
OBSERVERS = (sdpa, mha, layer, flex)


def _input(batch_first: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g)
    return x if batch_first else x.transpose(0, 1).contiguous()


def _run(model: nn.Module, x: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(123)
    with torch.set_grad_enabled(grad):
        out = model(x)
    return out.detach(), torch.get_rng_state()


@pytest.fixture(autouse=True)
def _flex_imported() -> None:
    # the flex wrapper is installed only where the process imported FlexAttention before the trace
    pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failing_observer_changes_nothing_the_caller_sees(
    case: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output and random state equal to the untraced run (the witness); the trace only warns."""
    make, batch_first, grad = CASES[case]
    torch.manual_seed(0)
    model = make()
    x = _input(batch_first)
    plain, plain_rng = _run(model, x, grad)
    if where == "before":  # finding the traced module that made the call
        monkeypatch.setattr(registry, "covering", _boom)
        monkeypatch.setattr(registry, "owner_module", _boom)
    else:  # handing the finished record to the traces
        for observer in OBSERVERS:
            monkeypatch.setattr(observer, "deliver", _boom)
    with qkvtrace.trace(model) as t:
        traced, traced_rng = _run(model, x, grad)
    monkeypatch.undo()
    assert torch.equal(plain, traced)
    assert torch.equal(plain_rng, traced_rng)
    assert t.result.warnings, "the trace must say a call could not be recorded"
    assert any("could not be recorded (Boom: injected)" in w for w in t.result.warnings)
    assert not registry.open_calls(), "no half-open call is left on the thread"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("steady", [False, True], ids=["first", "steady"])
def test_a_fallback_whose_reason_cannot_be_read_is_one_call_as_it_was(steady: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading PyTorch's reason from the fallback's frame fails (on a module's first call, or on a call its
    module's slot knows): the caller gets what the untraced call gives, the trace says what it could not
    read, and the module's one call is one call -- not also taken for a direct call of the function.

    Witness: the same model's untraced run (output and random state), and the calls the test makes.
    """
    torch.manual_seed(0)
    model = SelfAttend(_mha(True))
    x = _input(True)
    plain, plain_rng = _run(model, x, True)
    with qkvtrace.trace(model) as t:
        if steady:
            for _ in range(3):
                _run(model, x, True)
        monkeypatch.setattr(mha, "_read_frame", _boom)
        traced, traced_rng = _run(model, x, True)
        monkeypatch.undo()
    assert torch.equal(plain, traced)
    assert torch.equal(plain_rng, traced_rng)
    assert len(t.calls) == (4 if steady else 1), [c.path for c in t.calls]
    assert any("could not be recorded (Boom: injected)" in w for w in t.result.warnings)
    assert not registry.open_calls(), "no half-open call is left on the thread"


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_refused_call_raises_pytorchs_exception_even_when_observing_fails(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call PyTorch refuses: the exception the untraced call raises (type and message) is the one raised.

    Witness: PyTorch's exception from the same call with no trace open.
    """
    model = SelfAttend(_mha(True))
    bad = torch.randn(B, L, E + 1)
    with pytest.raises(Exception) as untraced:
        model(bad)
    if where == "before":
        monkeypatch.setattr(registry, "covering", _boom)
    else:
        monkeypatch.setattr(mha, "deliver", _boom)
    with qkvtrace.trace(model), pytest.raises(Exception) as traced:
        model(bad)
    assert type(traced.value) is type(untraced.value)
    assert str(traced.value) == str(untraced.value)


def test_mha_mask_that_pytorch_drops_is_not_read() -> None:
    """PyTorch's ``test_train_with_is_causal``: a (2, 2) mask on a length-1 sequence with ``is_causal=True``.

    PyTorch drops the mask (no padding mask, no weights) and hands SDPA
    ``is_causal=True``. Witness: the untraced output, and the causal rule
    computed here -- a length-1 query sees its one key, so no row is fully masked.
    """
    torch.manual_seed(0)
    model = nn.MultiheadAttention(4, 1)
    x = torch.randn(1, 1, 4)
    mask = torch.ones(2, 2, dtype=torch.bool).tril().logical_not()
    plain = model(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    with qkvtrace.trace(model) as t:
        traced = model(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    assert torch.equal(plain, traced)
    assert t.result.warnings == []
    [call] = t.calls
    assert call.output["fully_masked_rows"] == 0
