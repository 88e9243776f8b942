"""Behaviour probes: run small attention scenarios on the installed PyTorch.

Each scenario builds a tiny model and runs it in one mode (eval/train, grad
on/off, masks, autocast, a forced SDPA backend...). The tracer of
:mod:`qkvtrace.tracer` records what happened: path, PyTorch's reason, the
backend and the aten ops. The same runs, under ``sys.setprofile``, give the
dynamic edges of the call graph. Nothing is assumed: a scenario that fails
on this PyTorch records the error instead.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.base import compat
from qkvtrace.base.errors import first_line
from qkvtrace.tracer import trace

__all__ = ["SCENARIOS", "Scenario", "run_scenarios"]


@dataclass(frozen=True)
class Scenario:
    """A named way of running attention, and what it exercises."""

    name: str
    description: str
    #: Builds ``(model, run)``; ``run(model)`` performs the forward (and backward).
    build: Callable[[], tuple[nn.Module, Callable[[nn.Module], Any]]]


class DirectSDPA(nn.Module):
    """A block that calls ``F.scaled_dot_product_attention`` itself (HF style)."""

    def __init__(self, d_model: int = 32, heads: int = 4, causal: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        # [B,T,3D] -> [3,B,H,T,Dh]
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(b, t, d)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _mha(embed: int = 32, heads: int = 4, **kw: Any) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(embed, heads, **kw)


def _self_attn(train: bool, grad: bool, **call: Any) -> Callable[[nn.Module], Any]:
    def run(m: nn.Module) -> Any:
        m.train(train)
        x = call.pop("_x", None)
        x = _x(2, 6, 32) if x is None else x
        with torch.set_grad_enabled(grad):
            out = m(x, x, x, **call)
            if grad:
                out[0].sum().backward()
        return out

    return run


def _mha_scenario(name: str, description: str, train: bool, grad: bool,
                  module_kw: dict[str, Any] | None = None, **call: Any) -> Scenario:  # fmt: skip
    return Scenario(
        name,
        description,
        lambda: (_mha(**(module_kw or {"batch_first": True})), _self_attn(train, grad, **call)),
    )


def _padding_mask() -> torch.Tensor:
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 4:] = True  # the second sequence has two padding positions
    return mask


def _causal_bool() -> torch.Tensor:
    return torch.ones(6, 6, dtype=torch.bool).triu(1)  # True above the diagonal


def _float_mask() -> torch.Tensor:
    return torch.zeros(6, 6).masked_fill(_causal_bool(), float("-inf"))


def _odd_heads() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    m = _mha(48, 3, batch_first=True)

    def run(model: nn.Module) -> Any:
        model.eval()
        x = _x(2, 6, 48)
        with torch.no_grad():
            return model(x, x, x, need_weights=False)

    return m, run


def _kdim_vdim() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    m = _mha(32, 4, batch_first=True, kdim=16, vdim=24)

    def run(model: nn.Module) -> Any:
        model.eval()
        with torch.no_grad():
            return model(_x(2, 6, 32), _x(2, 5, 16), _x(2, 5, 24), need_weights=False)

    return m, run


def _autocast() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    m = _mha(batch_first=True)

    def run(model: nn.Module) -> Any:
        model.eval()
        x = _x(2, 6, 32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, x, x, need_weights=False)

    return m, run


def _encoder(train: bool, padded: bool) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], Any]]]:
    def build() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        enc = nn.TransformerEncoder(layer, num_layers=2)

        def run(model: nn.Module) -> Any:
            model.train(train)
            x = _x(2, 6, 32)
            kw = {"src_key_padding_mask": _padding_mask()} if padded else {}
            if train:
                out = model(x, **kw)
                out.sum().backward()
                return out
            with torch.inference_mode():
                return model(x, **kw)

        return enc, run

    return build


def _sdpa(
    backend: str | None, causal: bool = False, masked: bool = False, dropout: float = 0.0
) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], Any]]]:
    def build() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
        torch.manual_seed(0)
        block = DirectSDPA(causal=causal, dropout=dropout)

        def run(model: nn.Module) -> Any:
            model.train(dropout > 0)
            x = _x(2, 6, 32)
            mask = torch.ones(6, 6, dtype=torch.bool).tril() if masked else None
            with torch.set_grad_enabled(dropout > 0), compat.forced_backend(backend):
                return model(x, mask)

        return block, run

    return build


def _scenarios() -> list[Scenario]:
    kpm = _padding_mask
    s = [
        _mha_scenario("mha_eval_no_grad", "MHA, eval + no_grad, need_weights=False", False, False, need_weights=False),
        _mha_scenario(
            "mha_eval_need_weights", "MHA, eval + no_grad, need_weights=True", False, False, need_weights=True
        ),
        _mha_scenario("mha_train", "MHA, training, need_weights=False", True, True, need_weights=False),
        _mha_scenario("mha_train_need_weights", "MHA, training, need_weights=True", True, True, need_weights=True),
        _mha_scenario("mha_eval_grad", "MHA, eval with grad enabled", False, True, need_weights=False),
        _mha_scenario(
            "mha_seq_first",
            "MHA, batch_first=False, eval + no_grad",
            False,
            False,
            module_kw={"batch_first": False},
            need_weights=False,
        ),
        _mha_scenario(
            "mha_bool_key_padding",
            "MHA, bool key_padding_mask, eval + no_grad",
            False,
            False,
            need_weights=False,
            key_padding_mask=kpm(),
        ),
        _mha_scenario(
            "mha_bool_attn_mask",
            "MHA, bool attn_mask, eval + no_grad",
            False,
            False,
            need_weights=False,
            attn_mask=_causal_bool(),
        ),
        _mha_scenario(
            "mha_float_attn_mask",
            "MHA, float attn_mask, eval + no_grad",
            False,
            False,
            need_weights=False,
            attn_mask=_float_mask(),
        ),
        _mha_scenario(
            "mha_is_causal",
            "MHA, is_causal=True with a causal mask, eval + no_grad",
            False,
            False,
            need_weights=False,
            attn_mask=_causal_bool(),
            is_causal=True,
        ),
        Scenario("mha_odd_heads", "MHA, 3 heads (odd), eval + no_grad", _odd_heads),
        Scenario("mha_kdim_vdim", "MHA, kdim/vdim differ (cross-attention), eval + no_grad", _kdim_vdim),
        Scenario("mha_autocast", "MHA under CPU autocast (bfloat16), eval + no_grad", _autocast),
        Scenario("encoder_inference", "TransformerEncoder, eval + inference_mode", _encoder(False, False)),
        Scenario(
            "encoder_padded",
            "TransformerEncoder, eval + inference_mode, src_key_padding_mask (nested tensors)",
            _encoder(False, True),
        ),
        Scenario("encoder_train", "TransformerEncoder, training + backward", _encoder(True, False)),
        Scenario("sdpa_default", "direct F.scaled_dot_product_attention, default choice", _sdpa(None)),
        Scenario("sdpa_causal", "direct SDPA, is_causal=True", _sdpa(None, causal=True)),
        Scenario("sdpa_bool_mask", "direct SDPA, bool attn_mask", _sdpa(None, masked=True)),
    ]
    for name in compat.sdp_backend_names().values():
        if name != "ERROR":
            s.append(
                Scenario(
                    f"sdpa_forced_{name.lower()}",
                    f"direct SDPA forced to {name} with sdpa_kernel",
                    _sdpa(name),
                )
            )
    return s


SCENARIOS: list[Scenario] = _scenarios()


class _CallRecorder:
    """``sys.setprofile`` hook: edges between known functions, and into known builtins."""

    def __init__(self, objects: dict[str, Any]) -> None:
        self.codes: dict[types.CodeType, str] = {}
        self.builtins: dict[int, str] = {}
        for name, obj in objects.items():
            fn = inspect.unwrap(obj) if callable(obj) else obj
            code = getattr(fn, "__code__", None)
            if code is not None:
                self.codes[code] = name
            elif callable(obj):
                self.builtins[id(obj)] = name
        self.edges: set[tuple[str, str]] = set()

    def _caller(self, frame: types.FrameType | None) -> str | None:
        while frame is not None:
            name = self.codes.get(frame.f_code)
            if name is not None:
                return name
            frame = frame.f_back
        return None

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = self.codes.get(frame.f_code)
            if name is not None:
                caller = self._caller(frame.f_back)
                if caller is not None and caller != name:
                    self.edges.add((caller, name))
        elif event == "c_call":
            name = self.builtins.get(id(arg))
            if name is not None:
                caller = self._caller(frame)
                if caller is not None:
                    self.edges.add((caller, name))


def _call_summary(call: Any) -> dict[str, Any]:
    return {
        "module": call.module,
        "path": call.path,
        "why_not_fast_path": call.why_not_fast_path,
        "why_not_fused_layer": call.why_not_fused_layer,
        "sdpa_backend": call.sdpa_backend,
        "sdpa_refusals": call.sdpa_refusals,
        "aten_ops": list(call.aten_ops),
    }


def run_scenarios(
    objects: dict[str, Any] | None = None,
    scenarios: list[Scenario] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every scenario traced, then again under ``sys.setprofile``.

    Returns ``(records, dynamic_edges)``: per scenario its calls (path, reason,
    backend, aten ops) or its error; and the Python/builtin/aten call edges
    observed, each with the scenarios that produced it and the paths their
    calls took.
    """
    records: list[dict[str, Any]] = []
    edges: dict[tuple[str, str], dict[str, set[str]]] = {}
    builtin_by_leaf = {}
    for name, obj in (objects or {}).items():
        if not hasattr(inspect.unwrap(obj) if callable(obj) else obj, "__code__"):
            builtin_by_leaf[name.rsplit(".", 1)[-1]] = name

    def add(edge: tuple[str, str], scenario: Scenario, paths: set[str]) -> None:
        slot = edges.setdefault(edge, {"scenarios": set(), "paths": set()})
        slot["scenarios"].add(scenario.name)
        slot["paths"].update(paths)

    for scenario in scenarios or SCENARIOS:
        if progress is not None:
            progress(scenario.name)
        record: dict[str, Any] = {"name": scenario.name, "description": scenario.description}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, run = scenario.build()
                with trace(model, gradients=False) as t:
                    run(model)
                record["calls"] = [_call_summary(c) for c in t.calls]
                record["error"] = None
            except Exception as exc:  # a scenario this PyTorch cannot run
                record["calls"] = []
                record["error"] = first_line(exc)
            if objects and record["error"] is None:
                recorder = _CallRecorder(objects)
                model, run = scenario.build()
                previous = sys.getprofile()
                sys.setprofile(recorder)
                try:
                    run(model)
                finally:
                    sys.setprofile(previous)
                paths = {c["path"] for c in record["calls"]}
                for edge in recorder.edges:
                    add(edge, scenario, paths)
                for call in record["calls"]:
                    ops = call["aten_ops"]
                    if not ops:
                        continue
                    builtin = builtin_by_leaf.get(ops[0].removeprefix("aten::"))
                    chain = ([builtin] if builtin else []) + ops
                    for a, b in itertools.pairwise(chain):
                        add((a, b), scenario, {call["path"]})
        records.append(record)
    dynamic = [
        {"caller": a, "callee": b, "scenarios": sorted(v["scenarios"]), "paths": sorted(v["paths"])}
        for (a, b), v in sorted(edges.items())
    ]
    return records, dynamic
