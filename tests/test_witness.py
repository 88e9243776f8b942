"""Observe without disturbing (DESIGN.md, principle 1), proven against a witness.

The witness is ``torch.profiler`` on an *un-instrumented* run of the same
model with the same seed and inputs: the ``aten::`` attention kernels it saw,
in order, and the outputs. A traced run must give bit-identical outputs (and
gradients where there is a backward pass), record exactly the witness's
kernels, and name paths, backends and reasons that agree with what the
witness and PyTorch's own source say. Nothing here hard-codes a kernel name or
a reason string: the backend of each kernel is learned by forcing each
backend under the profiler, and reasons are matched against the string
literals of the installed ``MultiheadAttention.forward``.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _witness import SDPA, Witness, learn_kernel_backends, local_at_return, profiled
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkvtrace

B, L, E, H = 2, 5, 32, 4

NATIVE_MHA = "aten::_native_multi_head_attention"
LAYER_FWD = "aten::_transformer_encoder_layer_fwd"


# -- the witness (tests/_witness.py) ---------------------------------------


@pytest.fixture(scope="module")
def kernel_backend() -> dict[str, str]:
    return learn_kernel_backends(B, H, L, E // H)


def _literal_patterns(fn: Callable[..., Any]) -> list[re.Pattern[str]]:
    """Every string literal of ``fn``'s source; f-strings become regexes."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    patterns = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value:
            patterns.append(re.compile(re.escape(node.value)))
        elif isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(re.escape(str(v.value)))
                else:
                    parts.append(".*?")
            patterns.append(re.compile("".join(parts), re.S))
    return patterns


MHA_REASONS = _literal_patterns(nn.MultiheadAttention.forward)
LAYER_REASONS = _literal_patterns(nn.TransformerEncoderLayer.forward)


def in_source(reason: str, patterns: list[re.Pattern[str]]) -> bool:
    return any(p.fullmatch(reason) for p in patterns)


# -- comparing outputs ------------------------------------------------------


def assert_identical(a: Any, b: Any, where: str = "output") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.is_nested == b.is_nested, where
        if a.is_nested:
            xs, ys = a.unbind(), b.unbind()
            assert len(xs) == len(ys), where
            for x, y in zip(xs, ys, strict=True):
                assert torch.equal(x, y), where
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert torch.equal(a, b), f"{where} differs between the traced and the untraced run"
    else:
        assert a == b, where


# -- scenarios --------------------------------------------------------------


@dataclass
class Run:
    model: nn.Module
    forward: Callable[[], Any]  # the forward pass (what the profiler witnesses)
    backward: Callable[[Any], None] | None = None


def _x(*shape: Any, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(requires_grad)


def _mha(*, mode: str = "eval_nograd", need_weights: bool = True, batch_first: bool = True,
         embed_dim: int = E, num_heads: int = H, kdim: int | None = None, vdim: int | None = None,
         masks: str | None = None) -> Callable[[Any], Run]:  # fmt: skip
    def build(_: Any) -> Run:
        mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first, kdim=kdim, vdim=vdim)
        mha.train(mode == "train")
        shape = (B, L, embed_dim) if batch_first else (L, B, embed_dim)
        x = _x(*shape)
        if kdim is None:
            q = k = v = x
        else:
            q = x
            k = _x(B, L + 1, kdim)
            v = _x(B, L + 1, vdim)
        kwargs: dict[str, Any] = {"need_weights": need_weights}
        if masks == "bool":
            kpm = torch.zeros(B, L, dtype=torch.bool)
            kpm[1, -2:] = True  # True = padding for MultiheadAttention
            kwargs["key_padding_mask"] = kpm
            kwargs["attn_mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)
        elif masks == "float":
            kwargs["attn_mask"] = torch.zeros(L, L).masked_fill(
                torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")
            )
        elif masks == "causal":  # True = blocked for MultiheadAttention
            kwargs["attn_mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)
            kwargs["is_causal"] = True
        elif masks == "causal_float":
            kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
            kwargs["is_causal"] = True

        def forward() -> Any:
            if mode == "eval_nograd":
                with torch.no_grad():
                    return mha(q, k, v, **kwargs)
            return mha(q, k, v, **kwargs)

        def backward(out: Any) -> None:
            out[0].square().sum().backward()

        return Run(mha, forward, backward if mode != "eval_nograd" else None)

    return build


def _encoder(*, mode: str, padding: bool = False, causal: bool = False, d_model: int = 64,
             nhead: int = 4) -> Callable[[Any], Run]:  # fmt: skip
    """``mode``: "inference" (eval + inference_mode), "no_grad" (eval), "eval_grad", "train"."""

    def build(_: Any) -> Run:
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=128, dropout=0.0, batch_first=True)
        enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=padding)
        enc.train(mode == "train")
        x = _x(B, 6, d_model)
        kwargs: dict[str, Any] = {}
        if padding:
            kpm = torch.zeros(B, 6, dtype=torch.bool)
            kpm[1, 3:] = True  # True = padding
            kwargs["src_key_padding_mask"] = kpm
        if causal:
            kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(6)
            kwargs["is_causal"] = True

        def forward() -> Any:
            if mode == "inference":
                with torch.inference_mode():
                    return enc(x, **kwargs)
            if mode == "no_grad":
                with torch.no_grad():
                    return enc(x, **kwargs)
            return enc(x, **kwargs)

        def backward(out: Any) -> None:
            out.square().sum().backward()

        return Run(enc, forward, backward if mode in ("train", "eval_grad") else None)

    return build


def _direct_sdpa(kind: str) -> Callable[[Any], Run]:
    def build(cls: Any) -> Run:
        model = cls(E, H).eval()
        x = _x(B, L, E)

        def forward() -> Any:
            if kind == "causal":
                return model(x, is_causal=True)
            if kind == "bool_mask":
                mask = torch.ones(L, L, dtype=torch.bool).tril()  # lower triangle: no row fully blocked
                return model(x, attn_mask=mask)
            with sdpa_kernel(SDPBackend.MATH):
                return model(x)

        def backward(out: Any) -> None:
            out.square().sum().backward()

        return Run(model, forward, backward)

    return build


def _mixed(*, train: bool) -> Callable[[Any], Run]:
    """One model, several kinds of call in one trace (kernel evidence must not be mixed up)."""

    class Mixed(nn.Module):
        def __init__(self, cls: Any) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(E, H, batch_first=True)
            self.attn = cls(E, H)

        def forward(self, x: torch.Tensor) -> Any:
            a, _ = self.mha(x, x, x, need_weights=False)
            b, w = self.mha(a, a, a)
            with sdpa_kernel(SDPBackend.MATH):
                c = self.attn(b)
            d = self.attn(c, is_causal=True)
            e = self.attn(d)
            return e, w

    def build(cls: Any) -> Run:
        model = Mixed(cls).train(train)
        x = _x(B, L, E)

        def forward() -> Any:
            if train:
                return model(x)
            with torch.no_grad():
                return model(x)

        def backward(out: Any) -> None:
            out[0].square().sum().backward()

        return Run(model, forward, backward if train else None)

    return build


# name -> (builder, the module name of each attention call in order, the model calls SDPA itself)
ENC = ["layers.0.self_attn", "layers.1.self_attn"]
MIXED = ["mha", "mha", "attn", "attn", "attn"]
SCENARIOS: dict[str, tuple[Callable[[Any], Run], list[str], bool]] = {
    "mha_eval_nograd_need_weights": (_mha(need_weights=True), [""], False),
    "mha_eval_nograd_no_weights": (_mha(need_weights=False), [""], False),
    "mha_training": (_mha(mode="train"), [""], False),
    "mha_training_no_weights": (_mha(mode="train", need_weights=False), [""], False),
    "mha_eval_grad_enabled": (_mha(mode="eval_grad", need_weights=False), [""], False),
    "mha_seq_first": (_mha(batch_first=False), [""], False),
    "mha_kdim_vdim": (_mha(kdim=24, vdim=20, need_weights=False), [""], False),
    "mha_bool_masks": (_mha(masks="bool", need_weights=False), [""], False),
    "mha_bool_masks_need_weights": (_mha(masks="bool"), [""], False),
    "mha_float_mask": (_mha(masks="float", need_weights=False), [""], False),
    "mha_is_causal": (_mha(masks="causal", need_weights=False), [""], False),
    "mha_is_causal_training": (_mha(mode="train", masks="causal", need_weights=False), [""], False),
    "mha_is_causal_float_mask": (_mha(masks="causal_float", need_weights=False), [""], False),
    "mha_odd_heads": (_mha(embed_dim=48, num_heads=3, need_weights=False), [""], False),
    "encoder_inference": (_encoder(mode="inference"), ENC, False),
    "encoder_inference_padding": (_encoder(mode="inference", padding=True), ENC, False),
    "encoder_training_backward": (_encoder(mode="train"), ENC, False),
    "encoder_training_padding_backward": (_encoder(mode="train", padding=True), ENC, False),
    "encoder_eval_grad_backward": (_encoder(mode="eval_grad"), ENC, False),
    "encoder_inference_causal_mask": (_encoder(mode="inference", causal=True), ENC, False),
    "encoder_odd_heads_no_grad": (_encoder(mode="no_grad", d_model=48, nhead=3), ENC, False),
    "sdpa_is_causal": (_direct_sdpa("causal"), [""], True),
    "sdpa_bool_mask": (_direct_sdpa("bool_mask"), [""], True),
    "sdpa_forced_math": (_direct_sdpa("math"), [""], True),
    "mixed_eval_nograd": (_mixed(train=False), MIXED, False),
    "mixed_training": (_mixed(train=True), MIXED, False),
}


def build(name: str, cls: Any) -> Run:
    torch.manual_seed(1234)
    return SCENARIOS[name][0](cls)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def untraced(name: str, cls: Any) -> tuple[Witness, dict[str, Any]]:
    run = build(name, cls)
    w = profiled(run.forward)
    if run.backward is not None:
        run.backward(w.out)
    return w, grads_of(run.model)


# -- the tests --------------------------------------------------------------


@pytest.mark.parametrize("maps", [False, True], ids=["plain", "maps"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_traced_run_matches_the_witness(
    name: str, maps: bool, packed_attention_cls: Any, kernel_backend: dict[str, str]
) -> None:
    """Witness: the untraced run under torch.profiler (tests/_witness.py), with its outputs and gradients."""
    _, modules, direct = SCENARIOS[name]
    n_calls = len(modules)
    witness, witness_grads = untraced(name, packed_attention_cls)

    run = build(name, packed_attention_cls)
    with qkvtrace.trace(run.model, attention_maps=maps) as t:
        out = run.forward()
        if run.backward is not None:
            run.backward(out)

    # same results, bit for bit (attention weights and gradients included)
    assert_identical(witness.out, out)
    assert_identical(witness_grads, grads_of(run.model), "gradients")

    calls = t.calls
    assert len(calls) == n_calls, [c.path for c in calls]
    assert [c.index for c in calls] == list(range(n_calls))
    assert [c.module for c in calls] == modules

    # the same kernels, in the same order, each attributed to one call
    assert [op for c in calls for op in c.aten_ops] == witness.ops
    assert [c.aten_ops for c in calls if c.aten_ops] == witness.segments

    for c in calls:
        ops = c.aten_ops
        top = ops[0] if ops else None
        # path <=> the outermost kernel the witness saw
        assert (c.path == "fast") == (top == NATIVE_MHA), (c.path, ops)
        assert (c.path == "fused_encoder_layer") == (top == LAYER_FWD), (c.path, ops)
        if direct or c.module == "attn":
            assert c.path == "sdpa" and top == SDPA, (c.path, ops)
        else:
            assert c.path in ("fast", "fallback", "fused_encoder_layer"), c.path
            if c.path == "fallback":
                # the fallback ran SDPA, or (need_weights) its explicit softmax: no kernel
                assert top in (SDPA, None), ops
                assert NATIVE_MHA not in ops
        if top == SDPA:  # SDPA and exactly one kernel under it
            assert len(ops) == 2 and ops[1] in kernel_backend, ops
        # backend <=> the SDPA kernel the witness saw (mapping learned by forcing backends)
        kernels = [op for op in ops if op in kernel_backend]
        unknown_sdpa = [op for op in ops if "scaled_dot_product" in op and op != SDPA and op not in kernel_backend]
        assert not unknown_sdpa, f"kernel ops not seen when forcing backends: {unknown_sdpa}"
        if kernels:
            assert len(kernels) == 1, ops
            assert c.sdpa_backend == kernel_backend[kernels[0]], (c.sdpa_backend, ops)
        else:
            assert c.sdpa_backend is None, (c.sdpa_backend, ops)

    if name == "sdpa_forced_math":
        assert calls[0].sdpa_backend == "MATH"
    if maps:  # the maps were made on the side: every call has one (these scenarios have no refused input)
        assert all(c.attention_map is not None for c in calls), [c.attention_map_reason for c in calls]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_why_not_fast_path_is_pytorchs_own(name: str, packed_attention_cls: Any) -> None:
    """Witness: the string literals of PyTorch's installed forward, the profiler of the untraced run, and
    PyTorch's own reason variables read at return on an untraced run (tests/_witness.py)."""
    witness, _ = untraced(name, packed_attention_cls)
    run = build(name, packed_attention_cls)
    with qkvtrace.trace(run.model) as t:
        run.forward()

    mha_calls = [c for c in t.calls if c.module_type == "MultiheadAttention" and c.path != "fused_encoder_layer"]
    for c in t.calls:
        fast_seen = c.aten_ops[:1] == [NATIVE_MHA]
        if c.path in ("fast", "fused_encoder_layer", "sdpa"):
            assert c.why_not_fast_path is None, (c.path, c.why_not_fast_path)
        else:
            assert not fast_seen
            reason = c.why_not_fast_path
            assert isinstance(reason, str) and reason, f"fallback without a reason: {reason!r}"
            assert in_source(reason, MHA_REASONS), f"{reason!r} is not a string of MultiheadAttention.forward"
        if c.why_not_fused_layer is not None:
            assert in_source(c.why_not_fused_layer, LAYER_REASONS), c.why_not_fused_layer
    # PyTorch took its MHA fast path iff the un-instrumented witness saw the native kernel
    witness_fast = sum(seg[0] == NATIVE_MHA for seg in witness.segments)
    assert sum(c.path == "fast" for c in t.calls) == witness_fast

    # A second reader: the local variable itself, read on an un-instrumented run.
    run = build(name, packed_attention_cls)
    _, reasons = local_at_return(nn.MultiheadAttention.forward.__code__, "why_not_fast_path", run.forward)
    assert len(reasons) == len(mha_calls)
    for c, reason in zip(mha_calls, reasons, strict=True):
        assert c.why_not_fast_path == (reason or None), (c.why_not_fast_path, reason)

    run = build(name, packed_attention_cls)
    _, layer_reasons = local_at_return(
        nn.TransformerEncoderLayer.forward.__code__, "why_not_sparsity_fast_path", run.forward
    )
    if layer_reasons:
        assert [c.why_not_fused_layer for c in t.calls] == [r or None for r in layer_reasons]
    else:
        assert all(c.why_not_fused_layer is None for c in t.calls)


@pytest.mark.parametrize("maps", [False, True], ids=["plain", "maps"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_untraced_traced_untraced_run_the_same_kernels(name: str, maps: bool, packed_attention_cls: Any) -> None:
    """Witness: torch.profiler on the untraced runs before and after the trace, and the module names in SCENARIOS."""
    first = profiled(build(name, packed_attention_cls).forward)

    run = build(name, packed_attention_cls)
    with qkvtrace.trace(run.model, attention_maps=maps) as t:
        second = profiled(run.forward)

    third = profiled(build(name, packed_attention_cls).forward)

    assert first.ops == second.ops == third.ops
    assert_identical(first.out, second.out)
    assert_identical(first.out, third.out)
    # the tracer still recorded every call while an outer profiler ran
    assert [c.module for c in t.calls] == SCENARIOS[name][1]


def test_every_recorded_path_is_in_the_vocabulary() -> None:
    """Witness: the path vocabulary as docs/trace.md tells users (written by hand, read here with a regular
    expression) and the ``path`` enum of the trace/3 JSON schema consumers validate against.
    The paths themselves are checked against the profiler in test_traced_run_matches_the_witness."""
    import json
    import re
    from pathlib import Path

    from qkvtrace.analyses.demos import DEMOS

    root = Path(__file__).resolve().parents[1]
    # the call record's table in docs/trace.md: "| `path` | `fast`, `fallback`, ... or `hand_written` |"
    line = next(x for x in (root / "docs" / "trace.md").read_text().splitlines() if x.startswith("| `path` |"))
    documented = set(re.findall(r"`(\w+)`", line.split("|")[2]))
    schema = json.loads((root / "qkvtrace" / "schemas" / "trace-3.json").read_text())
    enum = set(schema["$defs"]["call"]["properties"]["path"]["enum"])
    assert documented <= enum, (documented, enum)
    seen = set()
    for build in DEMOS.values():
        model, args = build()
        for train in (False, True):
            model.train(train)
            with qkvtrace.trace(model) as t, torch.set_grad_enabled(train):
                model(*args)
            assert t.calls and all(c.path in documented for c in t.calls), [c.path for c in t.calls]
            seen |= {c.path for c in t.calls}
    assert len(seen) >= 3  # the demos reach several paths, so the check is not vacuous


def test_an_attention_traced_without_its_encoder_layer_names_no_layer_reason() -> None:
    """A trace of a layer's MultiheadAttention alone does not cover the layer: its records name no encoder layer's
    reason; a trace of the layer names the one PyTorch's frame held. Witness: ``why_not_sparsity_fast_path``
    itself, read on an un-instrumented run of the same layer, and the module each trace was given."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)  # training: refused
    x = torch.randn(2, 5, 16)
    _, reasons = local_at_return(nn.TransformerEncoderLayer.forward.__code__, "why_not_sparsity_fast_path",
                                 lambda: layer(x))  # fmt: skip
    assert reasons and reasons[0]
    with qkvtrace.trace(layer.self_attn) as alone:
        for _ in range(3):
            layer(x)
    with qkvtrace.trace(layer) as whole:
        for _ in range(3):
            layer(x)
    assert [c.why_not_fused_layer for c in alone.calls] == [None] * 3
    assert [c.why_not_fused_layer for c in whole.calls] == [reasons[0]] * 3
