"""A call like its module's previous one is recorded from that record: the same record as one built in full.

In a plain trace (``keep="all"``) most calls of a loop repeat their module's
previous call; their records are copied from that call's record with the
call's own numbers written in (NaN count, fully-masked rows, activation
norms, index, thread, backward side). These tests hold the copies to the
records built field by field: each plan of calls below changes, between
calls, one thing a record is made from (shape, dtype, mode, grad, a weight
moved by an optimizer, a switched-off backend, the arguments...), and the
trace's JSON must be the same with the shortcut as with it switched off.
The per-call numbers are held to the test's own computations too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.facts import paths
from qkvtrace.tracer import again, build
from qkvtrace.tracer.observers import mha_facts
from qkvtrace.tracer.observers import sdpa as sdpa_observer


class Direct(nn.Module):
    """A model's own SDPA call on Q, K and V it projects itself."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


class Leaves(nn.Module):
    """SDPA on the tensors it is given (no projection: the slices say why)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


class FunctionCall(nn.Module):
    """A custom module calling ``F.multi_head_attention_forward`` itself with its own packed weight."""

    def __init__(self, e: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.inner = nn.MultiheadAttention(e, heads)

    def forward(self, x: torch.Tensor, training: bool = True, need_weights: bool = False) -> torch.Tensor:
        m = self.inner
        out, _ = F.multi_head_attention_forward(
            x, x, x, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0,
            m.out_proj.weight, m.out_proj.bias, training=training, need_weights=need_weights,
        )  # fmt: skip
        return out


@contextmanager
def _switched_off(get: Callable[[], bool], set_to: Callable[[bool], None]) -> Iterator[None]:
    """One of PyTorch's switches turned off for the block, then set back."""
    before = get()
    set_to(False)
    try:
        yield
    finally:
        set_to(before)


def _flash_off() -> Any:
    return _switched_off(torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp)


def _fastpath_off() -> Any:
    return _switched_off(torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled)


@contextmanager
def _no_shortcut() -> Iterator[None]:
    """Every record built in full: no previous record is ever found, and no call has a key a slot could know."""
    with mock.patch.object(again, "previous", lambda *a, **k: None), \
            mock.patch.object(sdpa_observer, "steady_key", lambda *a, **k: None), \
            mock.patch.object(mha_facts, "steady_key", lambda *a, **k: None):  # fmt: skip
        yield


def _traced(make: Callable[[], tuple[nn.Module, Callable[[nn.Module, int], Any]]], steps: int,
            shortcut: bool) -> tuple[dict[str, Any], list[Any]]:  # fmt: skip
    """The trace's JSON of ``steps`` steps of a plan, and the outputs, from a model made afresh by ``make``."""
    torch.manual_seed(0)
    model, step = make()
    outs = []
    with nullcontext() if shortcut else _no_shortcut(), qkvtrace.trace(model) as t:
        for i in range(steps):
            torch.manual_seed(100 + i)  # dropout draws the same in both runs
            outs.append(step(model, i))
    return t.to_dict(), outs


def _same_with_and_without(make: Callable[[], tuple[nn.Module, Callable[[nn.Module, int], Any]]],
                           steps: int) -> dict[str, Any]:  # fmt: skip
    _traced(make, steps, shortcut=True)  # every signature's kernels witnessed once: both runs below read them cached
    built, outs_built = _traced(make, steps, shortcut=False)
    copied, outs_copied = _traced(make, steps, shortcut=True)
    for a, b in zip(outs_built, outs_copied, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert len(copied["calls"]) == len(built["calls"]) > 0
    for c, b in zip(copied["calls"], built["calls"], strict=True):  # as JSON: a NaN norm equals a NaN norm
        assert json.dumps(c, sort_keys=True) == json.dumps(b, sort_keys=True), {k for k in c if c[k] != b[k]}
    assert json.dumps(copied, sort_keys=True) == json.dumps(built, sort_keys=True)
    return copied


#: ``enable_gqa`` (grouped-query attention) is an argument of SDPA from torch 2.5 on
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _thrice(states: list[str]) -> list[str]:
    """Each state of a plan for three calls in a row: the first call of a state differs from the call before it
    in what the state changes alone (its record must not be copied), the second is copied from the first, the
    third goes through its module's slot (:mod:`qkvtrace.tracer.slots`)."""
    return [state for state in states for _ in range(3)]


_SDPA_CHANGES = _thrice(["", "dtype", "", "length", "", "short q", "", "short k", "", "causal", "", "dropout",
                        "dropout+wide v", "dropout", "dropout+strided k", "dropout", "dropout+strided v", "dropout",
                        "dropout+flash off", "dropout", "dropout+strided", "dropout+more", "", "eval", "", "no_grad",
                        "inference_mode", "", "flash off", "", "scale", "", "nan", "", "sgd step", "", "strided", "",
                        "q grad", "", "k grad", "", "v grad", "", "autocast", "",
                        *(["gqa", ""] if _HAS_GQA else [])])  # fmt: skip


def _sdpa_plan() -> tuple[nn.Module, Callable[[nn.Module, int], Any]]:
    model = nn.ModuleDict({"direct": Direct(), "leaves": Leaves()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5, 16)
    q = torch.randn(2, 2, 5, 8)

    def step(m: nn.Module, i: int) -> Any:
        change = _SDPA_CHANGES[i]
        parts = set(change.split("+"))
        m.train(change != "eval")
        kwargs: dict[str, Any] = {}
        ctx: Any = nullcontext()
        xi, qi, ki, vi = x, q, q, q
        if change == "dtype":
            qi = ki = vi = q.double()
        elif change == "length":
            xi, qi, ki, vi = torch.randn(2, 7, 16), q[:, :, :3], q[:, :, :3], q[:, :, :3]
        elif change == "causal":
            kwargs["is_causal"] = True
        elif "dropout" in parts:
            kwargs["dropout_p"] = 0.3 if "more" in parts else 0.2
        elif change == "short q":
            qi = q[:, :, :3]  # three queries, five keys
        elif change == "short k":
            ki = vi = q[:, :, :3]
        elif change == "no_grad":
            ctx = torch.no_grad()
        elif change == "inference_mode":
            ctx = torch.inference_mode()
        elif change == "scale":
            kwargs["scale"] = 0.5
        elif change == "nan":
            xi = x.clone()
            xi[0, 1, 3] = float("nan")
        elif change == "sgd step":
            opt.step()  # the weights move: new weight norms
        if "wide v" in parts:  # V's head size is its own
            vi = torch.randn(2, 2, 5, 12)
        if change.endswith(" grad"):
            grown = q.clone().requires_grad_(True)  # one of Q, K and V alone
            qi, ki, vi = (grown if change[0] == n else t for n, t in zip("qkv", (qi, ki, vi), strict=True))
        elif change == "autocast":
            ctx = torch.autocast("cpu")
        if change == "gqa":
            kwargs["enable_gqa"] = True
        strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # its last dimension strided
        if "strided" in parts:
            qi = strided
        elif "strided k" in parts:
            ki = strided
        elif "strided v" in parts:
            vi = strided
        if "flash off" in parts:
            ctx = _flash_off()
        with ctx:
            out = m["direct"](xi, **kwargs)
            out2 = m["leaves"](qi, ki, vi, **kwargs)
        if out.requires_grad and change != "nan":  # no NaN into the weights
            (out.sum() + out2.sum()).backward()
        return torch.cat([out.detach().flatten(), out2.detach().flatten().float()])

    return model, step


def test_sdpa_records_copied_equal_records_built_in_full() -> None:
    """Witness: the same plan traced with the shortcut switched off (every record built field by field from
    the call), and torch.equal on the outputs. Between plain calls the plan changes one thing at a time: the
    dtype, the length, the query's or the keys' length alone, is_causal, dropout and its value, the flash
    switch with and without dropout, the training flag, no_grad, inference_mode after no_grad, the scale,
    the input's values (a NaN), the weights (an SGD step), the strides and requires_grad of Q, K or V alone,
    V's head size, autocast and (torch >= 2.5) enable_gqa."""
    out = _same_with_and_without(_sdpa_plan, len(_SDPA_CHANGES))
    assert {c["sdpa_backend"] for c in out["calls"]} >= {"FLASH_ATTENTION", "MATH"}


_MHA_CHANGES = _thrice(["", "no weights", "", "per-head weights", "", "eval", "", "no_grad", "", "inference_mode",
                       "inference_mode+no weights", "", "cross", "", "length", "", "sgd step", "", "no weights",
                       "no weights+frozen", "no weights", "no weights+flash off", "", "padding", "", "nan", "",
                       "direct eval", "", "direct weights", "", "short query", "", "fastpath off",
                       "fastpath off+cross", "fastpath off+cross+short query", "fastpath off+cross",
                       "fastpath off+cross+long key",
                       "fastpath off", "fastpath off+eval", "fastpath off+eval+no_grad",
                       "fastpath off+eval+inference_mode", "fastpath off", "fastpath off+autocast", "",
                       "train+no_grad", ""])  # fmt: skip


def _mha_plan() -> tuple[nn.Module, Callable[[nn.Module, int], Any]]:
    mha = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)  # its kernel in training: MATH, flash or not
    model = nn.ModuleDict({"mha": mha, "fn": FunctionCall()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, xf = torch.randn(2, 5, 16), torch.randn(5, 2, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, -1] = True

    def step(m: nn.Module, i: int) -> Any:
        change = _MHA_CHANGES[i]
        parts = set(change.split("+"))
        m.train("train" in parts or not parts & {"eval", "no_grad", "inference_mode"})
        if "eval" in parts:
            m.eval()
        for p in (mha.in_proj_weight, mha.in_proj_bias):
            p.requires_grad_("frozen" not in parts)  # the kernel's Q, K and V then need no grad
        kwargs: dict[str, Any] = {}
        ctxs: list[Any] = []
        xi, key = x, x
        if "no weights" in parts:
            kwargs["need_weights"] = False
        if change == "per-head weights":
            kwargs["average_attn_weights"] = False
        elif "no_grad" in parts:
            ctxs.append(torch.no_grad())
        elif "inference_mode" in parts:
            ctxs.append(torch.inference_mode())  # eval, no grad, batch first: the fast path
        if "cross" in parts:
            key = x.clone()  # the query is not the key
        elif change == "length":
            xi = key = torch.randn(2, 7, 16)
        if "short query" in parts:
            xi = x[:, :3]  # three queries, five keys
        if "long key" in parts:
            key = torch.randn(2, 7, 16)
        if "autocast" in parts:
            ctxs.append(torch.autocast("cpu"))
        elif change == "sgd step":
            opt.step()
        elif change == "padding":
            kwargs["key_padding_mask"] = pad
        elif change == "nan":
            xi = key = x.clone()
            xi[1, 0, 2] = float("nan")
        if "flash off" in parts:
            ctxs.append(_flash_off())
        if "fastpath off" in parts:  # PyTorch's reason is then that switch, whatever else the call does
            ctxs.append(_fastpath_off())
        with ExitStack() as stack:
            for ctx in ctxs:
                stack.enter_context(ctx)
            out, _ = m["mha"](xi, key, key, **kwargs)
            out2 = m["fn"](xf, training=change != "direct eval", need_weights=change == "direct weights")
        if out.requires_grad and change != "nan":  # no NaN into the weights
            (out.sum() + out2.sum()).backward()
        return out.detach()

    return model, step


def test_mha_records_copied_equal_records_built_in_full() -> None:
    """Witness: the same plan traced with the shortcut switched off (every record built field by field), and
    torch.equal on the outputs. Between plain calls the plan changes one thing at a time: need_weights,
    average_attn_weights, the training flag, no_grad, inference_mode (the fast path), self- against
    cross-attention, the length, the weights (an SGD step), a weight's requires_grad, a padding mask, the
    flash switch (its kernel then MATH either way, with dropout), a NaN in the input, a direct
    F.multi_head_attention_forward call's training and need_weights arguments, a shorter query than key,
    and cross-attention where PyTorch's reason is the same (the fast path switched off)."""
    out = _same_with_and_without(_mha_plan, len(_MHA_CHANGES))
    assert {c["path"] for c in out["calls"]} == {"fast", "fallback"}


def test_copied_records_hold_each_calls_own_numbers() -> None:
    """Witness: the test's own NaN count of each output (torch.isnan on the tensors it holds) and float64
    norms of the Q, K and V it hands SDPA; the record index is the call's place in the test's loop."""
    torch.manual_seed(3)
    model = Leaves()
    expected_nans, expected_norms = [], []
    with qkvtrace.trace(model) as t:
        for i in range(12):
            q, k, v = (torch.randn(2, 2, 5, 8) * (1 + i) for _ in range(3))
            if i % 3 == 2:
                v[0, 0, i % 5, 0] = float("nan")  # reaches column 0 of every query row of head 0
            out = model(q, k, v)
            expected_nans.append(int(torch.isnan(out).sum()))
            expected_norms.append([float(torch.linalg.vector_norm(x.double())) for x in (q, k, v)])
    assert [c.index for c in t.calls] == list(range(12))
    assert [c.output["nan_count"] for c in t.calls] == expected_nans
    assert sum(expected_nans) > 0
    for call, norms in zip(t.calls, expected_norms, strict=True):
        got = [call.qkv.q.activation_norm, call.qkv.k.activation_norm, call.qkv.v.activation_norm]
        for g, e in zip(got, norms, strict=True):
            assert (g != g and e != e) or abs(g - e) <= 1e-5 * e, (got, norms)


def _full_builds(run: Callable[[], Any]) -> int:
    """How many records ``run()`` builds in full (each is handed to the traces by ``deliver``)."""
    with mock.patch.object(build, "shared_inputs", wraps=build.shared_inputs) as counted:
        run()
    return counted.call_count


def test_a_repeated_call_is_copied_not_built() -> None:
    """Witness: the number of records built in full (one per module for its first call, one more for the
    call after it, whose kernels are then read cached), against the test's own count of calls; the evidence
    of the call's signature, forgotten first: profiled at its first call, cached after."""
    paths.shared_evidence()._ops.clear()  # every signature's kernels profiled again at their next call
    torch.manual_seed(4)
    mha, leaves = nn.MultiheadAttention(16, 2), Leaves()
    x5, q = torch.randn(5, 2, 16), torch.randn(3, 3, 13, 24)
    with qkvtrace.trace(nn.ModuleList([mha, leaves])) as t:
        built = _full_builds(lambda: [(mha(x5, x5, x5), leaves(q, q, q)) for _ in range(100)])
    assert len(t.calls) == 200
    assert built <= 4
    assert [c.evidence for c in t.calls if c.module == "1"][:4] == ["witnessed", "cached", "cached", "cached"]


def test_editing_a_record_leaves_the_next_one_alone() -> None:
    """Witness: the kernels and refusals of the first record as read before the edit (a copy the test keeps)."""
    torch.manual_seed(5)
    model = Leaves()
    q = torch.randn(2, 2, 5, 8)
    with qkvtrace.trace(model) as t:
        for _ in range(4):
            model(q, q, q, dropout_p=0.3)  # dropout: PyTorch's CPU flash kernel refused? its words recorded
    first = t.calls[1]
    ops, refused = list(first.aten_ops or []), {b: list(w) for b, w in (first.sdpa_refusals or {}).items()}
    assert ops
    first.aten_ops.append("edited")  # type: ignore[union-attr]
    for words in (first.sdpa_refusals or {}).values():
        words.append("edited")
    for later in t.calls[2:]:
        assert later.aten_ops == ops
        assert later.sdpa_refusals == refused


def test_nested_traces_and_threads_get_their_own_records() -> None:
    """Witness: the names of the threads the test starts and each trace's own call count (the test's loop);
    an inner trace's records equal the outer trace's for the same calls but for their indices."""
    torch.manual_seed(6)
    model = Leaves()
    q = torch.randn(2, 2, 5, 8)
    with qkvtrace.trace(model, threads="all") as outer:
        for _ in range(3):
            model(q, q, q)
        with qkvtrace.trace(model, threads="all") as inner:
            for _ in range(3):
                model(q, q, q)
        workers = [threading.Thread(target=lambda: [model(q, q, q) for _ in range(3)], name=f"worker-{n}")
                   for n in range(2)]  # fmt: skip
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert len(outer.calls) == 12 and len(inner.calls) == 3
    assert [c.thread for c in outer.calls[:6]] == ["MainThread"] * 6
    assert sorted(c.thread for c in outer.calls[6:]) == ["worker-0"] * 3 + ["worker-1"] * 3
    for da, db in zip(outer.to_dict()["calls"][3:6], inner.to_dict()["calls"], strict=True):
        da.pop("index"), db.pop("index")
        assert da == db
    assert [c.index for c in inner.calls] == [0, 1, 2]


def _traced_per_step(make: Callable[[], tuple[nn.Module, Callable[[nn.Module, int], Any]]], steps: int,
                     shortcut: bool) -> tuple[list[dict[str, Any]], list[Any]]:  # fmt: skip
    """One trace per step of a plan (each trace's JSON), with the trace options switched between traces."""
    torch.manual_seed(0)
    model, step = make()
    outs, found = [], []
    with nullcontext() if shortcut else _no_shortcut():
        for i in range(steps):
            torch.manual_seed(100 + i)
            with qkvtrace.trace(model, refusals=i % 7 != 5, routes=i % 5 != 3) as t:
                outs.append(step(model, i))
            found.append(t.to_dict())
    return found, outs


def test_sdpa_records_of_one_trace_per_step_equal_records_built_in_full() -> None:
    """Witness: the SDPA plan traced one trace per step with every shortcut switched off (each record built
    field by field), and torch.equal on the outputs. A module's first call in a trace is taken by the slot the
    previous trace kept (:mod:`qkvtrace.tracer.slots`) when nothing between the two traces changed what the
    record says; the plan changes, between traces, each thing a call's record is made from, and the trace's
    options: PyTorch's refusals asked or not, routes recorded or not."""
    from qkvtrace.tracer import slots

    revived = []
    real = slots.revive

    def spy(*a: Any, **k: Any) -> Any:
        found = real(*a, **k)
        revived.append(found is not None)
        return found

    _traced_per_step(_sdpa_plan, len(_SDPA_CHANGES), shortcut=True)  # kernels witnessed once for both runs
    built, outs_built = _traced_per_step(_sdpa_plan, len(_SDPA_CHANGES), shortcut=False)
    with mock.patch.object(slots, "revive", spy):
        kept, outs_kept = _traced_per_step(_sdpa_plan, len(_SDPA_CHANGES), shortcut=True)
    for a, b in zip(outs_built, outs_kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for i, (k, b) in enumerate(zip(kept, built, strict=True)):
        assert json.dumps(k, sort_keys=True) == json.dumps(b, sort_keys=True), (i, _SDPA_CHANGES[i])
    assert sum(revived) >= len(_SDPA_CHANGES) // 2, "the kept slots were not taken: the test would show nothing"


def test_a_long_run_or_a_trace_with_maps_after_plain_traces_records_as_alone() -> None:
    """Witness: the same long run (``keep="changes"``, its changes and summary) and the same trace with attention
    maps (its JSON and maps) made with every shortcut switched off. Before them, plain traces of the same model
    kept their slots for the next trace: neither may take one (a long run counts, a map is computed per call)."""

    def run(shortcut: bool) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model, x = Direct(), torch.randn(2, 5, 16)
        with nullcontext() if shortcut else _no_shortcut():
            for _ in range(3):
                with qkvtrace.trace(model):
                    model(x)
            with qkvtrace.trace(model, keep="changes") as long_run:
                for _ in range(3):
                    model(x)
                    long_run.step()
            with qkvtrace.trace(model, attention_maps=True) as mapped:
                model(x)
                model(x)
        maps = [c.attention_map for c in mapped.calls]
        return json.dumps(long_run.summary(), sort_keys=True), len(long_run.changes), mapped.to_dict(), maps

    summary, changes, mapped, maps = run(shortcut=True)
    summary_built, changes_built, mapped_built, maps_built = run(shortcut=False)
    assert summary == summary_built and changes == changes_built
    assert json.dumps(mapped, sort_keys=True) == json.dumps(mapped_built, sort_keys=True)
    assert len(maps) == 2 and all(m is not None for m in maps)
    for a, b in zip(maps, maps_built, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_editing_a_record_after_its_trace_leaves_the_next_trace_alone() -> None:
    """Witness: the next trace's record made with every shortcut switched off (built from the call alone).
    After each trace of one model the caller edits its record everywhere it holds a list, a dict or a slice
    record of its own (``inputs`` is one dict for all calls with equal inputs, by design); the slot a trace kept
    for the next must not see any of it."""
    torch.manual_seed(7)
    x = torch.randn(2, 5, 16)

    def edit(c: Any) -> None:
        (c.aten_ops or []).append("edited")
        for words in (c.sdpa_refusals or {}).values():
            words.append("edited")
        c.output["nan_count"] = -1
        c.qkv.q.weight_norm = -1.0
        c.qkv.k.rows = "edited"

    def third(shortcut: bool) -> dict[str, Any]:
        model = Direct()
        with nullcontext() if shortcut else _no_shortcut():
            for _ in range(3):  # a slot kept by the first or second trace (once the kernels are known)
                with qkvtrace.trace(model) as t:
                    model(x, dropout_p=0.3)
                found = t.to_dict()["calls"][0]
                edit(t.calls[0])  # after the close: whatever record the kept slot was made from
        return found

    torch.manual_seed(8)
    built = third(shortcut=False)
    torch.manual_seed(8)
    kept = third(shortcut=True)
    assert json.dumps(kept, sort_keys=True) == json.dumps(built, sort_keys=True)
