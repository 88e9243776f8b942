"""Leave no trace (DESIGN.md, principle 3).

After a ``with qkvtrace.trace(model)`` block, whether it ends normally or the
user's code raises: every patched attribute is the very original object, the
trace function is what it was, no hook sits on any module or parameter, module
and global state are unchanged, and no tensor of the run is kept alive.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from typing import Any

import _sdpa_bound_module
import pytest
import torch
import torch.nn.functional as F
from _mha_reasons import reason_under
from _sdpa_bound_module import BoundSDPAAttention
from torch import nn
from torch.nn.modules import module as module_mod

import qkvtrace
from qkvtrace.pytest_plugin import assert_no_nan_rows

E, H, B, L = 32, 4, 2, 5


class UserError(RuntimeError):
    pass


MESSAGE = "user model failed after its first attention call (code 17)"


class Model(nn.Module):
    """MHA, then (optionally) a user error, then an encoder and a direct SDPA module."""

    def __init__(self, attention_cls: Any, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.attn = attention_cls(E, H)

    def after_mha(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.mha(x, x, x, need_weights=False)
        if self.fail:
            raise UserError(MESSAGE)
        y = self.after_mha(y)
        return self.attn(self.encoder(y))


# -- state snapshots ---------------------------------------------------------


def patched_targets() -> dict[str, Any]:
    return {
        "nn.MultiheadAttention.forward": nn.MultiheadAttention.__dict__["forward"],
        "nn.TransformerEncoderLayer.forward": nn.TransformerEncoderLayer.__dict__["forward"],
        "torch._native_multi_head_attention": torch._native_multi_head_attention,
        "torch._transformer_encoder_layer_fwd": torch._transformer_encoder_layer_fwd,
        "F.multi_head_attention_forward": torch.nn.functional.multi_head_attention_forward,
        "F.scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention,
        "bound scaled_dot_product_attention": _sdpa_bound_module.scaled_dot_product_attention,
    }


MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def module_hooks(model: nn.Module) -> dict[str, int]:
    counts = {}
    for name, m in model.named_modules():
        for attr in MODULE_HOOK_DICTS:
            d = getattr(m, attr, None)
            if d:
                counts[f"{name or '<root>'}.{attr}"] = len(d)
    for attr in dir(module_mod):
        if attr.startswith("_global_") and attr.endswith("hooks"):
            d = getattr(module_mod, attr)
            if d:
                counts[f"global {attr}"] = len(d)
    return counts


def tensor_hooks(model: nn.Module) -> dict[str, int]:
    counts = {}
    for name, p in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            d = getattr(p, attr, None)
            if d:
                counts[f"{name}.{attr}"] = len(d)
    return counts


def global_state() -> dict[str, Any]:
    cuda = torch.backends.cuda
    return {
        "gettrace": sys.gettrace(),
        "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "profiler_enabled": torch.autograd._profiler_enabled(),
        "sdp_flags": (
            cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(),
        ),
    }


def module_state(model: nn.Module) -> dict[str, Any]:
    return {
        "training": {n: m.training for n, m in model.named_modules()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }


def make_model(attention_cls: Any, *, fail: bool = False) -> Model:
    model = Model(attention_cls, fail=fail)
    # a mix of flags the tracer must leave exactly as they were
    model.train()
    model.encoder.layers[1].eval()
    model.mha.out_proj.bias.requires_grad_(False)
    model.encoder.layers[0].linear2.weight.requires_grad_(False)
    return model


def assert_hooks_only_on_own_modules(model: nn.Module) -> None:
    kinds = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
    torch_attention = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    for key in module_hooks(model):
        assert not key.startswith("global "), key
        name = key.rsplit(".", 1)[0]
        module = model if name == "<root>" else model.get_submodule(name)
        assert not type(module).__module__.startswith("torch."), key
        assert not any(name == n or name.startswith(n + ".") for n in torch_attention), key


@pytest.fixture
def restore_globals() -> Iterator[None]:
    fastpath = torch.backends.mha.get_fastpath_enabled()
    grad = torch.is_grad_enabled()
    trace_fn = sys.gettrace()
    yield
    torch.backends.mha.set_fastpath_enabled(fastpath)
    torch.set_grad_enabled(grad)
    sys.settrace(trace_fn)


# -- the tests ---------------------------------------------------------------


@pytest.mark.parametrize("ending", ["normal", "raises"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_everything_restored(ending: str, backward: bool, packed_attention_cls: Any) -> None:
    """Witness: PyTorch's attributes, hook dicts and global switches read before the trace, compared (``is``) after."""
    model = make_model(packed_attention_cls, fail=ending == "raises")
    targets = patched_targets()
    state, modstate = global_state(), module_state(model)
    assert module_hooks(model) == {} and tensor_hooks(model) == {}
    x = torch.randn(B, L, E)
    replaced: set[str] = set()
    hooked_params: dict[str, int] = {}

    def run() -> None:
        y = model(x)
        if backward:
            y.square().sum().backward()

    if ending == "normal":
        with qkvtrace.trace(model) as t:
            replaced.update(k for k, v in patched_targets().items() if v is not targets[k])
            hooked_params.update(tensor_hooks(model))
            # module hooks only on the model's own attention-looking modules (watched for attention written by
            # hand), never on or inside PyTorch's attention modules, whose fast paths a hook refuses
            assert_hooks_only_on_own_modules(model)
            run()
    else:
        with pytest.raises(UserError) as info:
            with qkvtrace.trace(model) as t:
                replaced.update(k for k, v in patched_targets().items() if v is not targets[k])
                hooked_params.update(tensor_hooks(model))
                run()
        # the user's own exception, unchanged
        assert type(info.value) is UserError
        assert str(info.value) == MESSAGE
        assert info.value.args == (MESSAGE,)
        assert len(t.calls) == 1 and t.calls[0].module == "mha"
        del info

    # the checks are not vacuous: the tracer did patch and hook while active
    assert {"nn.MultiheadAttention.forward", "F.scaled_dot_product_attention"} <= replaced
    assert any(k.startswith("mha.in_proj_weight") for k in hooked_params), hooked_params

    after = patched_targets()
    for name, original in targets.items():
        assert after[name] is original, f"{name} was not restored"
    assert nn.MultiheadAttention.forward is targets["nn.MultiheadAttention.forward"]
    assert F.scaled_dot_product_attention is targets["F.scaled_dot_product_attention"]
    assert global_state() == state
    assert sys.gettrace() is state["gettrace"]
    assert module_state(model) == modstate
    assert module_hooks(model) == {}
    assert tensor_hooks(model) == {}
    for p in model.parameters():
        assert p._backward_hooks is None or len(p._backward_hooks) == 0

    # and nothing keeps recording once the block is over
    n_calls, n_grads = len(t.calls), len(t.gradients)
    model.fail = False
    model(x).square().sum().backward()
    assert (len(t.calls), len(t.gradients)) == (n_calls, n_grads)


def test_non_default_global_state_is_kept(packed_attention_cls: Any, restore_globals: None) -> None:
    """Witness: the switches set here, read back from PyTorch; the reason string read from PyTorch's source."""
    model = make_model(packed_attention_cls).eval()
    torch.backends.mha.set_fastpath_enabled(False)
    torch.set_grad_enabled(False)
    state, modstate = global_state(), module_state(model)
    with qkvtrace.trace(model) as t:
        model(torch.randn(B, L, E))
    assert global_state() == state
    assert module_state(model) == modstate
    assert torch.backends.mha.get_fastpath_enabled() is False
    assert torch.is_grad_enabled() is False
    # the fast path was refused because the user said so, and the trace says it verbatim
    mha_call = next(c for c in t.calls if c.module == "mha")
    assert mha_call.path == "fallback"
    assert mha_call.why_not_fast_path == reason_under("not is_fastpath_enabled")


def test_exception_inside_attention_propagates_unchanged(restore_globals: None) -> None:
    """Witness: the exception of the same call run untraced, and a weakref to a tensor the test made."""
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E)
    bad_mask = torch.zeros(B + 1, L, dtype=torch.bool)  # wrong batch size

    with pytest.raises(Exception) as plain:
        mha(x, x, x, key_padding_mask=bad_mask)
    trace_fn = sys.gettrace()
    targets = patched_targets()
    refs: list[weakref.ref[torch.Tensor]] = []

    def body() -> None:
        query = x.clone()  # a tensor of this run only
        refs.append(weakref.ref(query))
        mha(query, query, query, key_padding_mask=bad_mask)

    with pytest.raises(Exception) as traced:
        with qkvtrace.trace(mha) as t:
            body()
    assert type(traced.value) is type(plain.value)
    assert str(traced.value) == str(plain.value)
    # the refused call is in the trace, with PyTorch's own error
    assert [c.error for c in t.calls] == [f"{type(plain.value).__name__}: {plain.value}"]
    del traced
    gc.collect()
    assert refs[0]() is None, "the failed call's query is kept alive"
    # the record outlives the tensor: summaries, read after it died
    assert t.to_dict()["calls"][0]["inputs"]["query_shape"] == [B, L, E]
    assert sys.gettrace() is trace_fn
    assert all(patched_targets()[k] is v for k, v in targets.items())
    assert tensor_hooks(mha) == {}


def _debugger_view(model: nn.Module, x: torch.Tensor, traced: bool) -> tuple[Any, Any, dict[str, tuple[int, int]]]:
    """Run ``model`` under a user's own trace function (a debugger, a coverage
    tool); return what ``sys.gettrace()`` was inside and after the block, and
    per code object of interest the (call events, line events) it received."""
    calls: list[Any] = []
    lines: list[Any] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            lines.append(frame.f_code)
        return local

    def user_tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            calls.append(frame.f_code)
        return local

    previous = sys.gettrace()
    sys.settrace(user_tracer)
    try:
        if traced:
            with qkvtrace.trace(model):
                model(x)
                inside = sys.gettrace()
        else:
            model(x)
            inside = sys.gettrace()
        after = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert inside is user_tracer and after is user_tracer
    codes = {
        "MultiheadAttention.forward": nn.MultiheadAttention.forward.__code__,
        "TransformerEncoderLayer.forward": nn.TransformerEncoderLayer.forward.__code__,
        "F.multi_head_attention_forward": F.multi_head_attention_forward.__code__,
        "Model.after_mha": Model.after_mha.__code__,
        "Model.forward": Model.forward.__code__,
    }
    for m in model.modules():
        codes.setdefault(f"{type(m).__name__}.forward", type(m).forward.__code__)
    return inside, after, {k: (calls.count(c), lines.count(c)) for k, c in codes.items()}


def test_pre_existing_trace_function_is_chained_and_restored(packed_attention_cls: Any, restore_globals: None) -> None:
    """A debugger's trace function is restored, and sees the same events with and
    without the trace: the watched MultiheadAttention frame (calls and lines) and
    the user's code before, between and after attention calls.
    Witness: the events the user's trace function counts on the untraced run."""
    model = make_model(packed_attention_cls)
    model.encoder = nn.Identity()  # type: ignore[assignment]  # MHA and the direct SDPA module only
    x = torch.randn(B, L, E)
    *_, plain = _debugger_view(model, x, traced=False)
    *_, traced = _debugger_view(model, x, traced=True)
    assert plain["MultiheadAttention.forward"][0] == 1 and plain["MultiheadAttention.forward"][1] > 0
    assert plain["Model.after_mha"][0] == 1
    assert traced == plain


def test_pre_existing_trace_function_sees_frames_inside_encoder_layers(
    packed_attention_cls: Any, restore_globals: None
) -> None:
    """Same, with MultiheadAttention.forward running inside TransformerEncoderLayer.forward
    (both frames of interest to the tracer at once).
    Witness: the events the user's trace function counts on the untraced run."""
    model = make_model(packed_attention_cls)  # layer 0 training, layer 1 grad enabled: no fused path
    x = torch.randn(B, L, E)
    *_, plain = _debugger_view(model, x, traced=False)
    *_, traced = _debugger_view(model, x, traced=True)
    assert plain["MultiheadAttention.forward"][0] == 3
    assert plain["TransformerEncoderLayer.forward"][0] == 2
    assert traced == plain


@pytest.mark.parametrize("ending", ["normal", "raises"])
@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_no_tensor_kept_alive(ending: str, mode: str, packed_attention_cls: Any) -> None:
    """Witness: weakrefs to the tensors the test made; finite inputs and no mask, so no NaN row by construction."""
    model = make_model(packed_attention_cls, fail=ending == "raises")
    if mode != "train":
        model.eval()
    refs: list[weakref.ref[torch.Tensor]] = []

    def body() -> None:
        x = torch.randn(B, L, E, requires_grad=mode == "train")
        refs.append(weakref.ref(x))
        with torch.set_grad_enabled(mode == "train"):
            y = model(x)
            refs.append(weakref.ref(y))
            if mode == "train":
                y.square().sum().backward()

    if ending == "normal":
        with qkvtrace.trace(model) as t:
            body()
    else:
        with pytest.raises(UserError) as info:
            with qkvtrace.trace(model) as t:
                body()
        del info
    gc.collect()
    assert t.calls, "the trace recorded nothing"
    for i, ref in enumerate(refs):
        assert ref() is None, f"tensor {i} of the run is still alive after the trace"
    # while the trace itself is alive and its records still readable, resolved from summaries:
    # no mask, finite inputs, so no NaN in any recorded output (zero by construction, checked here)
    assert [c.output["nan_count"] for c in t.calls] == [0] * len(t.calls)
    assert not any(c.output.get("fully_masked_rows") for c in t.calls)
    assert_no_nan_rows(t.to_dict())


def test_tensor_made_inside_block_dies_with_trace_alive(restore_globals: None) -> None:
    """Witness: weakrefs to the tensors the test made; one call and one backward by construction."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    with qkvtrace.trace(mha) as t:
        x = torch.randn(B, L, E, requires_grad=True)
        out, weights = mha(x, x, x)
        out.sum().backward()
        refs = [weakref.ref(x), weakref.ref(out), weakref.ref(weights)]
    del x, out, weights
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert len(t.calls) == 1 and len(t.gradients) == 1


@pytest.mark.parametrize("ending", ["normal", "raises"])
def test_module_bound_sdpa_is_traced_and_restored(ending: str) -> None:
    """Witness: the bound function saved before the trace (compared with ``is``) and the untraced output."""
    original = _sdpa_bound_module.scaled_dot_product_attention
    assert original is F.scaled_dot_product_attention
    model = nn.Sequential(BoundSDPAAttention(E, H, fail_after_attention=ending == "raises"))
    x = torch.randn(B, L, E)
    if ending == "normal":
        expected = model(x)
        with qkvtrace.trace(model) as t:
            patched_inside = _sdpa_bound_module.scaled_dot_product_attention is not original
            out = model(x)
        assert torch.equal(out, expected)
    else:
        with pytest.raises(KeyError) as info:
            with qkvtrace.trace(model) as t:
                patched_inside = _sdpa_bound_module.scaled_dot_product_attention is not original
                model(x)
        assert info.value.args == ("bound-sdpa model failed after its attention",)
    assert patched_inside
    assert _sdpa_bound_module.scaled_dot_product_attention is original
    assert F.scaled_dot_product_attention is original
    assert [(c.module, c.path, c.module_type) for c in t.calls] == [("0", "sdpa", "BoundSDPAAttention")]
    assert t.calls[0].qkv.layout == "packed"
    assert tensor_hooks(model) == {}


def test_public_trace_is_the_function_whatever_was_imported_first() -> None:
    """``qkvtrace.trace`` stays the function after every qkvtrace submodule was imported first.

    (A submodule named like a lazily exported attribute, e.g. ``qkvtrace/trace.py``, gets bound
    over the attribute by the import system, and ``qkvtrace.trace(model)`` stops being callable.)
    Run in a fresh interpreter, so that this test's imports cannot hide the problem or cause it.
    Witness: ``type()`` and ``callable()`` of the attribute, after ``pkgutil`` imported every submodule.
    """
    code = textwrap.dedent(
        """
        import importlib, pkgutil, types
        import qkvtrace
        for info in pkgutil.walk_packages(qkvtrace.__path__, "qkvtrace."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
        public = qkvtrace.trace
        print(type(public).__name__, callable(public) and not isinstance(public, types.ModuleType))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["function", "True"], done.stdout


def test_public_face() -> None:
    """A sorted ``__all__`` whose every name imports, in a fresh interpreter, in any order.

    Witness: Python's ``sorted`` and ``getattr`` on the package.
    """
    assert list(qkvtrace.__all__) == sorted(qkvtrace.__all__)
    code = (
        "import qkvtrace, qkvtrace.tracer, qkvtrace.analyses.report, qkvtrace.analyses.diff\n"
        "missing = [n for n in qkvtrace.__all__ if getattr(qkvtrace, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert callable(qkvtrace.trace) and qkvtrace.trace.__module__.startswith('qkvtrace.tracer')\n"
    )
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
