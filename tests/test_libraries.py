"""The tracer on attention code qkvtrace did not write: tiny models of the libraries people use.

Each model is built from a config object with random weights (fixed seed, no
download) and run twice, in eval under ``no_grad`` and in training with a
backward pass: once un-instrumented under ``torch.profiler`` (the witness),
once inside ``qkvtrace.trace``. The traced run must give the same outputs and
gradients bit for bit, record one call per attention layer of the model, name
the real module that made it, and agree with the witness on the kernels, the
path and the backend. The Q/K/V slices it reports are checked against norms
computed here from the model's own parameters, whatever form the library
stores them in: separate ``nn.Linear`` weights (BERT, LLaMA with grouped K/V
heads, ViT), one ``Conv1D`` weight stored transposed as ``[E, 3E]`` (GPT-2),
projections held by the *parent* of the module that calls SDPA
(x-transformers), or one fused ``nn.Linear`` laid out per head (GPT-NeoX),
per K/V group (Falcon), or in contiguous parts of unequal widths (Phi-3 with
grouped K/V heads, GPTBigCode with one K/V head); the recorded rows must be
the ones each library's own forward gives Q, K and V. The same models with attention written by hand (softmax of
QKᵀ, "eager") make no SDPA call: the trace records them as ``hand_written``
calls, with the probabilities the library itself returns (``output_attentions``)
and the same Q/K/V rows.

A library that is not installed skips its models (``pip install -e ".[models]"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _witness import SDPA, Witness, learn_kernel_backends, profiled
from torch import nn

import qkvtrace
from qkvtrace.pytest_plugin import assert_paths

SEED = 1234
B, L = 2, 6  # batch, sequence length
VOCAB = 100


@dataclass(frozen=True)
class Slice:
    """Part of one parameter: ``param[index]`` (``index == ()`` for all of it)."""

    param: nn.Parameter
    index: tuple[slice | torch.Tensor, ...] = ()

    def value(self) -> torch.Tensor:
        return self.param.detach()[self.index]

    def grad(self) -> torch.Tensor:
        assert self.param.grad is not None
        return self.param.grad[self.index]

    def rows(self) -> list[int]:
        """The indices this slice takes along its last indexed dimension (all of dimension 0 without one)."""
        if not self.index:
            return list(range(self.param.shape[0]))
        dim = len(self.index) - 1
        return torch.arange(self.param.shape[dim])[self.index[dim]].tolist()


# The Q, K and V parts of one attention layer, read here from the model's own
# parameters: (weight slice, bias slice or None) for each of "q", "k", "v".
Parts = dict[str, tuple[Slice, Slice | None]]


# -- the models -------------------------------------------------------------


@dataclass(frozen=True)
class LibraryModel:
    #: ``(hand_written) -> (model, forward keyword arguments)``; the model's
    #: own switch picks SDPA or its hand-written attention.
    build: Callable[[bool], tuple[nn.Module, dict[str, Any]]]
    #: Class name of the modules that call attention (SDPA or by hand).
    attention_class: str
    #: Number of attention layers, read from the model's own config.
    layers: Callable[[nn.Module], int]
    #: Q/K/V slices of one attention module, given the model and the module's name.
    parts: Callable[[nn.Module, str], Parts]
    #: The projections live in the parent of the module that calls attention.
    qkv_in_parent: bool = False

    def qkv_owner(self, module: str) -> str:
        """Name of the module holding the Q/K/V projections of attention module ``module``."""
        return module.rpartition(".")[0] if self.qkv_in_parent else module


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L))


def _separate(names: tuple[str, str, str]) -> Callable[[nn.Module, str], Parts]:
    """Three ``nn.Linear`` projections, children of the attention module."""

    def parts(model: nn.Module, name: str) -> Parts:
        module = model.get_submodule(name)
        out: Parts = {}
        for part, child in zip("qkv", names, strict=True):
            lin = module.get_submodule(child)
            out[part] = (Slice(lin.weight), None if lin.bias is None else Slice(lin.bias))
        return out

    return parts


def _bert(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=16, attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    model = transformers.BertModel(config)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, -2:] = 0  # the second sequence is padded: SDPA gets a mask
    return model, {"input_ids": _ids(), "attention_mask": mask}


def _gpt2(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.GPT2Model(config), {"input_ids": _ids(), "use_cache": False}


def _gpt2_parts(model: nn.Module, name: str) -> Parts:
    # Conv1D keeps its weight transposed, [in, out] = [E, 3E]: Q is columns [0, E).
    c_attn = model.get_submodule(name).get_submodule("c_attn")
    e = c_attn.weight.shape[0]
    cols = [slice(i * e, (i + 1) * e) for i in range(3)]
    return {
        part: (Slice(c_attn.weight, (slice(None), c)), Slice(c_attn.bias, (c,)))
        for part, c in zip("qkv", cols, strict=True)
    }


def _fused(child: str, rows: Callable[[nn.Module], list[torch.Tensor]]) -> Callable[[nn.Module, str], Parts]:
    """One fused ``nn.Linear`` child; ``rows(attention module)``: the Q, K, V row indices, read from the
    library's own forward (cited at each model)."""

    def parts(model: nn.Module, name: str) -> Parts:
        module = model.get_submodule(name)
        lin = module.get_submodule(child)
        out: Parts = {}
        for part, idx in zip("qkv", rows(module), strict=True):
            out[part] = (Slice(lin.weight, (idx,)), None if lin.bias is None else Slice(lin.bias, (idx,)))
        return out

    return parts


def _ranges(*spans: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in spans])


def _neox_rows(m: nn.Module) -> list[torch.Tensor]:
    # GPTNeoXAttention: query_key_value(x).view(B, T, H, 3 * d).transpose(1, 2).chunk(3, dim=-1)
    h, d = m.config.num_attention_heads, m.head_size
    return [_ranges(*((i * 3 * d + p * d, i * 3 * d + (p + 1) * d) for i in range(h))) for p in range(3)]


def _falcon_rows(m: nn.Module) -> list[torch.Tensor]:
    # FalconAttention._split_heads, new_decoder_architecture: view(B, T, kv, H // kv + 2, d);
    # queries are [:, :, :, :-2], the key [-2], the value [-1] of each group
    h, kv, d = m.num_heads, m.num_kv_heads, m.head_dim
    per, width = h // kv, (h // kv + 2) * d
    return [_ranges(*((g * width, g * width + per * d) for g in range(kv))),
            _ranges(*((g * width + per * d, g * width + (per + 1) * d) for g in range(kv))),
            _ranges(*((g * width + (per + 1) * d, (g + 1) * width) for g in range(kv)))]  # fmt: skip


def _phi3_rows(m: nn.Module) -> list[torch.Tensor]:
    # Phi3Attention: qkv[..., :query_pos], then num_key_value_heads * head_dim for K, the rest for V
    q, kv = m.config.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return [torch.arange(0, q), torch.arange(q, q + kv), torch.arange(q + kv, q + 2 * kv)]


def _bigcode_rows(m: nn.Module) -> list[torch.Tensor]:
    # GPTBigCodeAttention, multi_query: c_attn(x).unsqueeze(1).split((embed_dim, kv_dim, kv_dim), dim=3)
    e, kv = m.embed_dim, m.kv_dim
    return [torch.arange(0, e), torch.arange(e, e + kv), torch.arange(e + kv, e + 2 * kv)]


def _neox(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=16, attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.GPTNeoXModel(config), {"input_ids": _ids(), "use_cache": False}


def _falcon(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
        vocab_size=VOCAB, attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.FalconModel(config), {"input_ids": _ids(), "use_cache": False}


def _phi3(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=16, pad_token_id=0,
        attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.Phi3Model(config), {"input_ids": _ids(), "use_cache": False}


def _bigcode(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTBigCodeConfig(
        n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=VOCAB, multi_query=True,
        attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.GPTBigCodeModel(config), {"input_ids": _ids(), "use_cache": False}


def _llama(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,  # grouped K/V heads
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, attention_dropout=0.1,
        attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.LlamaModel(config), {"input_ids": _ids(), "use_cache": False}


def _vit(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, attn_implementation="eager" if hand_written else "sdpa",
    )  # fmt: skip
    return transformers.ViTModel(config), {"pixel_values": torch.randn(B, 3, 16, 16)}


def _x_transformers(hand_written: bool) -> tuple[nn.Module, dict[str, Any]]:
    xt = pytest.importorskip("x_transformers")
    layers = xt.Decoder(dim=32, depth=2, heads=4, attn_dropout=0.1, attn_flash=not hand_written)
    return xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers), {"x": _ids()}


def _config_layers(attr: str) -> Callable[[nn.Module], int]:
    return lambda model: int(getattr(model.config, attr))


MODELS: dict[str, LibraryModel] = {
    "bert": LibraryModel(_bert, "BertSelfAttention", _config_layers("num_hidden_layers"),
                         _separate(("query", "key", "value"))),
    "gpt2": LibraryModel(_gpt2, "GPT2Attention", _config_layers("n_layer"), _gpt2_parts),
    "llama": LibraryModel(_llama, "LlamaAttention", _config_layers("num_hidden_layers"),
                          _separate(("q_proj", "k_proj", "v_proj"))),
    "vit": LibraryModel(_vit, "ViTAttention", _config_layers("num_hidden_layers"),
                        _separate(("q_proj", "k_proj", "v_proj"))),
    # A Decoder of depth d holds d attention blocks (and d feed-forward blocks). ``Attend``
    # calls SDPA; its parent ``Attention`` holds to_q, to_k and to_v.
    "x_transformers": LibraryModel(_x_transformers, "Attend", lambda model: int(model.attn_layers.depth),
                                   _separate(("to_q", "to_k", "to_v")), qkv_in_parent=True),
    # fused projections laid out four ways: per head interleaved, grouped per K/V head, contiguous with
    # grouped K/V heads, contiguous with one K/V head
    "gpt_neox": LibraryModel(_neox, "GPTNeoXAttention", _config_layers("num_hidden_layers"),
                             _fused("query_key_value", _neox_rows)),
    "falcon": LibraryModel(_falcon, "FalconAttention", _config_layers("num_hidden_layers"),
                           _fused("query_key_value", _falcon_rows)),
    "phi3": LibraryModel(_phi3, "Phi3Attention", _config_layers("num_hidden_layers"), _fused("qkv_proj", _phi3_rows)),
    "gpt_bigcode": LibraryModel(_bigcode, "GPTBigCodeAttention", _config_layers("n_layer"),
                                _fused("c_attn", _bigcode_rows)),
}  # fmt: skip
MODES = ("eval", "train")


# -- running a model --------------------------------------------------------


@dataclass
class Run:
    model: nn.Module
    inputs: dict[str, Any]
    train: bool

    def forward(self) -> Any:
        with torch.set_grad_enabled(self.train):
            return self.model(**self.inputs)

    def backward(self, out: Any) -> None:
        # A fixed random weighting of the first output, so every gradient is far from zero.
        first = tensors(out)[0]
        weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(7))
        (first * weights).sum().backward()


def build(name: str, mode: str, *, hand_written: bool = False) -> Run:
    torch.manual_seed(SEED)
    model, inputs = MODELS[name].build(hand_written)
    config = getattr(model, "config", None)
    if config is not None:  # the library honoured the requested implementation
        assert config._attn_implementation == ("eager" if hand_written else "sdpa")
    model.train(mode == "train")
    return Run(model, inputs, mode == "train")


def tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output (a tensor, or a library's output object)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out)
    return [t for t in items if isinstance(t, torch.Tensor)]


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def attention_modules(name: str, model: nn.Module) -> list[str]:
    """Names of the model's attention modules, in registration order (the order these models run them)."""
    cls = MODELS[name].attention_class
    found = [n for n, m in model.named_modules() if type(m).__name__ == cls]
    assert len(found) == MODELS[name].layers(model), (found, MODELS[name].layers(model))
    return found


def vector_norm(t: torch.Tensor) -> float:
    """Norm in float64 arithmetic, computed apart from the tracer's own code."""
    return math.sqrt(sum(float(x) ** 2 for x in t.detach().reshape(-1).tolist()))


# -- the witness (tests/_witness.py) ---------------------------------------


@pytest.fixture(scope="module")
def kernel_backend() -> dict[str, str]:
    return learn_kernel_backends(B, 4, L, 8)


def untraced(name: str, mode: str, *, hand_written: bool = False) -> tuple[Witness, dict[str, Any]]:
    run = build(name, mode, hand_written=hand_written)
    w = profiled(run.forward)
    if run.train:
        run.backward(w.out)
    return w, grads_of(run.model)


def traced(name: str, mode: str, *, hand_written: bool = False, maps: bool = False
           ) -> tuple[Run, Any, qkvtrace.Trace]:  # fmt: skip
    run = build(name, mode, hand_written=hand_written)
    with qkvtrace.trace(run.model, attention_maps=maps) as t:
        out = run.forward()
        if run.train:
            run.backward(out)
    return run, out, t


def assert_same_results(witness: Witness, witness_grads: dict[str, Any], run: Run, out: Any) -> None:
    expected, got = tensors(witness.out), tensors(out)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"output {i} differs between the traced and the untraced run"
    grads = grads_of(run.model)
    assert grads.keys() == witness_grads.keys()
    for n, g in grads.items():
        w = witness_grads[n]
        assert (g is None) == (w is None), n
        assert g is None or torch.equal(g, w), f"gradient of {n} differs between the traced and the untraced run"


# -- the tests --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_library_model_matches_the_witness(name: str, mode: str, kernel_backend: dict[str, str]) -> None:
    """Witness: the untraced run under torch.profiler (tests/_witness.py), and the model's own attention modules."""
    witness, witness_grads = untraced(name, mode)
    run, out, t = traced(name, mode)

    assert_same_results(witness, witness_grads, run, out)

    modules = attention_modules(name, run.model)
    real = dict(run.model.named_modules())
    calls = t.calls
    assert len(calls) == len(modules) == len(witness.segments), [c.module for c in calls]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [c.module for c in calls] == modules
    assert_paths(t, {"sdpa"})  # each library calls F.scaled_dot_product_attention itself
    for c in calls:
        assert type(real[c.module]).__name__ == c.module_type
        assert c.why_not_fast_path is None, c.why_not_fast_path
        assert c.inputs["training"] is run.train
    # the kernels the witness saw, call by call, and the backend of each
    assert [c.aten_ops for c in calls] == witness.segments
    for c, segment in zip(calls, witness.segments, strict=True):
        assert segment[0] == SDPA and len(segment) == 2, segment
        assert segment[1] in kernel_backend, f"kernel op not seen when forcing backends: {segment[1]}"
        assert c.sdpa_backend == kernel_backend[segment[1]], (c.sdpa_backend, segment)


@pytest.mark.parametrize("name", list(MODELS))
def test_library_model_qkv_slices_and_gradients(name: str) -> None:
    """Witness: norms computed here from the model's own parameters and their .grad, rows per each library's layout."""
    spec = MODELS[name]
    run, _, t = traced(name, "train")
    modules = attention_modules(name, run.model)
    assert [c.module for c in t.calls] == modules

    for c in t.calls:
        assert c.qkv.layout is not None, f"{c.module}: Q/K/V projection not found"
        for part, (weight, bias) in spec.parts(run.model, spec.qkv_owner(c.module)).items():
            info = getattr(c.qkv, part)
            assert info is not None, (c.module, part)
            assert info.shape == list(weight.value().shape), (c.module, part, info.shape)
            recorded = [i for lo, hi in (info.rows or []) for i in range(lo, hi)]
            assert sorted(recorded) == sorted(weight.rows()), (c.module, part, info.rows)
            assert info.weight_norm == pytest.approx(vector_norm(weight.value()), rel=1e-6), (c.module, part)
            if bias is None:
                assert info.bias_norm is None, (c.module, part)
            else:
                assert info.bias_norm == pytest.approx(vector_norm(bias.value()), rel=1e-6), (c.module, part)

    # one gradient record per attention module, read from the real .grad
    records = {g.module: g for g in t.gradients}
    assert sorted(records) == sorted(modules)
    for module, g in records.items():
        assert g.backward_index == 0
        for part, (weight, bias) in spec.parts(run.model, spec.qkv_owner(module)).items():
            sg = getattr(g, part)
            assert sg.grad_norm == pytest.approx(vector_norm(weight.grad()), rel=1e-6), (module, part)
            if bias is None:
                assert sg.bias_grad_norm is None, (module, part)
            else:
                assert sg.bias_grad_norm == pytest.approx(vector_norm(bias.grad()), rel=1e-6), (module, part)


@pytest.mark.parametrize("hand_written", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", list(MODELS))
def test_library_model_qkv_rows_in_inference(name: str, grad_mode: str, hand_written: bool) -> None:
    """Witness: each library's layout read here from the model's own parameters (``spec.parts``), and the
    untraced output. A fresh model in eval, its first call under ``no_grad`` or ``inference_mode`` (no graph,
    the library's own KV cache where it makes one): every call must still name the right rows and norms."""
    spec = MODELS[name]
    run = build(name, "eval", hand_written=hand_written)
    ctx = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with ctx():
        plain = run.model(**run.inputs)
    with ctx(), qkvtrace.trace(run.model) as t:
        out = run.model(**run.inputs)
    assert all(torch.equal(a, b) for a, b in zip(tensors(plain), tensors(out), strict=True))
    assert [c.module for c in t.calls] == attention_modules(name, run.model)
    for c in t.calls:
        assert c.qkv.layout is not None, f"{c.module}: {c.qkv.reason}"
        for part, (weight, _) in spec.parts(run.model, spec.qkv_owner(c.module)).items():
            info = getattr(c.qkv, part)
            recorded = [i for lo, hi in (info.rows or []) for i in range(lo, hi)]
            assert sorted(recorded) == sorted(weight.rows()), (c.module, part, info.rows)
            assert info.weight_norm == pytest.approx(vector_norm(weight.value()), rel=1e-6), (c.module, part)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_hand_written_attention_is_recorded(name: str, mode: str) -> None:
    """Witnesses: the untraced run (no attention kernel in the profiler; outputs and gradients bit for bit); in
    training the Q/K/V rows read from the model's own parameters; in eval the probabilities the library itself
    returns with ``output_attentions=True`` (a separate untraced run)."""
    witness, witness_grads = untraced(name, mode, hand_written=True)
    assert witness.segments == [], "the hand-written variant ran an attention kernel after all"
    run, out, t = traced(name, mode, hand_written=True, maps=True)

    assert_same_results(witness, witness_grads, run, out)
    spec = MODELS[name]
    modules = attention_modules(name, run.model)
    assert [c.module for c in t.calls] == modules  # one record per attention layer, in the order they ran
    assert_paths(t, {"hand_written"})
    assert not {u.module for u in t.result.unobserved} & set(modules)
    real = dict(run.model.named_modules())
    for c in t.calls:
        assert type(real[c.module]).__name__ == c.module_type
        assert c.inputs["training"] is run.train
        assert c.attention_map is not None, c.attention_map_reason
    if run.train:
        for c in t.calls:
            for part, (weight, _) in spec.parts(run.model, spec.qkv_owner(c.module)).items():
                info = getattr(c.qkv, part)
                assert info is not None, (c.module, part, c.qkv.reason)
                recorded = [i for lo, hi in (info.rows or []) for i in range(lo, hi)]
                assert sorted(recorded) == sorted(weight.rows()), (c.module, part, info.rows)
        assert sorted(g.module for g in t.gradients) == sorted(modules)
        return
    if getattr(run.model, "config", None) is None:
        return  # no output_attentions to compare with
    library = build(name, mode, hand_written=True)
    with torch.no_grad():
        returned = library.model(**library.inputs, output_attentions=True).attentions
    assert len(returned) == len(t.calls)
    for c, probs in zip(t.calls, returned, strict=True):
        assert torch.equal(c.attention_map, probs.float()), c.module


@pytest.mark.parametrize("name", list(MODELS))
def test_observed_attention_is_not_listed_unobserved(name: str) -> None:
    """Witness: the model's own attention modules, found here by the library's class name
    (``attention_modules``): every one is recorded and none is listed unobserved."""
    run, _, t = traced(name, "eval")
    attention = set(attention_modules(name, run.model))
    assert {c.module for c in t.calls} == attention
    assert not attention & {u.module for u in t.result.unobserved}
