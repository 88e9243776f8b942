"""A module's steady calls go through its slot: checked first against one key, captured lean, never stale.

Once a call's record could be copied from its module's previous one (a
plain trace) or was only counted (a long run), the next call like it is
recognised by the facts of its arguments alone and captures only its own
numbers (:mod:`qkvtrace.tracer.slots`). The records such calls end up with
are held to records built in full in ``tests/test_again.py`` (each plan
state runs three times: built, copied, captured); here, what the slot must
notice on its own, and what it costs.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _mha_reasons import reason_under
from torch import nn

import qkvtrace
from qkvtrace.facts import lineage


class Direct(nn.Module):
    """A model's own SDPA call on the tensors it is given."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class Rewired(nn.Module):
    """Q, K and V from three projections, or, once ``fused`` is set, from the thirds of one ``qkv`` added
    later; either way the kernel receives tensors of the very same shapes and strides."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.heads = heads
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.fused:
            q, k, v = (y.contiguous() for y in self.qkv(x).split(d, dim=-1))
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))  # (B, H, T, d)
        return F.scaled_dot_product_attention(q, k, v)


class Packed(nn.Module):
    """Q, K and V from the thirds of one projection's output, split by a view; its ``forward`` names its module
    ``m``, not ``self`` (as a forward replaced or wrapped by a library may), so the module is found at PyTorch's
    ``Module._call_impl``, which called it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(m, x: torch.Tensor) -> torch.Tensor:
        q, k, v = m.qkv(x).view(1, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_a_module_rewired_after_its_slot_was_filled_gets_its_new_rows(mode: str) -> None:
    """Witness: the rows by construction -- Q, K and V are the whole weights of ``q``, ``k`` and ``v`` before
    the module is rewired, and rows [0, 16), [16, 32), [32, 48) of ``qkv.weight`` after -- with the kernel's
    tensors of the same shapes and strides on both sides, so only the module's new child tells them apart."""
    torch.manual_seed(0)
    model = Rewired()
    x = torch.randn(2, 5, 16)
    context: Callable[[], Any] = {"train": nullcontext, "no_grad": torch.no_grad,
                                  "inference_mode": torch.inference_mode}[mode]  # fmt: skip
    with qkvtrace.trace(model) as t:
        for i in range(8):
            if i == 4:
                model.qkv = nn.Linear(16, 48)
                model.fused = True
            with context():
                model(x)
    got = [(c.qkv.q.param, c.qkv.q.rows, c.qkv.k.param, c.qkv.k.rows, c.qkv.v.param, c.qkv.v.rows) for c in t.calls]
    before = ("q.weight", [[0, 16]], "k.weight", [[0, 16]], "v.weight", [[0, 16]])
    after = ("qkv.weight", [[0, 16]], "qkv.weight", [[16, 32]], "qkv.weight", [[32, 48]])
    if mode == "train":
        assert got == [before] * 4 + [after] * 4
    else:  # no graph: the first call rewired is new to a trace that no longer writes the functions down (the
        # model's calls had settled); it says so, and the call after it, watched again, has the new rows
        assert got == [before] * 4 + [(None,) * 6] + [after] * 3
        assert t.calls[4].qkv.reason.endswith(lineage.NOT_RECORDED)
    # the weights' norms, read with the records (copies of records read first): numbers, the test's own
    for c in t.calls:
        if c.qkv.q.param is None:  # (the call said why it has no rows: checked above)
            continue
        weight = (model.qkv.weight[:16] if c.qkv.q.param == "qkv.weight" else model.q.weight).detach().double()
        assert type(c.qkv.q.weight_norm) is float
        assert abs(c.qkv.q.weight_norm - float(torch.linalg.vector_norm(weight))) <= 1e-5 * c.qkv.q.weight_norm


def _functions_in(run: Callable[[], Any]) -> int:
    """How many calls of functions in qkvtrace's files ``run()`` makes (``sys.setprofile``)."""
    ran = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal ran
        if event == "call" and "qkvtrace" in frame.f_code.co_filename:
            ran += 1

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return ran


def _functions_per_call(keep: str, calls: int, kind: str) -> list[int]:
    """How many of qkvtrace's Python functions each of ``calls`` steady calls runs (after five first calls), of a
    model's own SDPA call on the tensors it is given (``direct``) or on Q, K and V it projects (``projected``),
    or of a MultiheadAttention (``mha``)."""
    torch.manual_seed(1)
    model: nn.Module = {
        "projected": Rewired,
        "direct": Direct,
        "mha": lambda: nn.MultiheadAttention(16, 2),
        "layer": lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
    }[kind]()
    q = torch.randn(1, 2, 4, 8)
    x = torch.randn(1, 4, 16)

    def call() -> None:
        if kind == "projected":
            model(x)
        elif kind == "mha":
            model(x, x, x)
        elif kind == "layer":
            model(x)
        else:
            model(q, q, q)

    with qkvtrace.trace(model, keep=keep):  # type: ignore[arg-type]
        for _ in range(5):
            call()
        counts = [_functions_in(call) for _ in range(calls)]
    return counts


@pytest.mark.parametrize(("keep", "kind", "most"), [("changes", "direct", 11), ("all", "direct", 12),
                                                    ("all", "projected", 15), ("changes", "mha", 23),
                                                    ("all", "mha", 27), ("changes", "layer", 36),
                                                    ("all", "layer", 40)])  # fmt: skip
def test_a_steady_call_runs_a_constant_handful_of_functions(keep: str, kind: str, most: int) -> None:
    """Witness: the interpreter's own profile hook (``sys.setprofile``), counting every call of a function of qkvtrace's
    files during each traced call. The same number on every steady call, and a handful: the observer in full ran 69
    (long run) and 78 (records) functions for the direct call, and 69 and 90 for MultiheadAttention (whose two
    wrappers and PyTorch's reason stay); a projected call's slot also checks its Q/K/V weights where PyTorch
    registers them, and their versions and storages. An encoder layer's MultiheadAttention (``need_weights=False``:
    its fallback's SDPA kernel is a third wrapped call) ran 66 and 81 while its kernel was found out anew on every
    call. Measured on 2026-12-05, later: 21, 30, 48, 30, 43, 45 and 59; then 21, 31, 39, 30, 35, 44 and 49 once a
    steady call's backward core was left to its backward pass; 21, 31, 36, 30, 33, 44 and 47 once a slot checked its
    weights' versions itself; 21, 31, 36, 24, 27, 38 and 41 once a steady MultiheadAttention call was opened, and
    its fallback noted, by one function each; 21, 31, 27, 24, 27, 38 and 41 once a slot checked the weights of its
    module's children too (each bound at most two more); 11, 12, 15, 23, 27, 36 and 40 on 2026-12-07 once a model's
    own SDPA call's steady way lived in :mod:`qkvtrace.tracer.hot` alone; a MultiheadAttention whose slot is never
    taken (its facts not kept) ran 85 with records."""
    counts = _functions_per_call(keep, 60, kind)
    assert len(set(counts)) == 1, counts
    assert counts[0] <= most, counts[0]


class _Dropped(nn.Module):
    """A model's own SDPA call with dropout: on the CPU its kernel is decomposed (no fused backward node), so its
    routes are read at the very Q, K and V it received."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize(("kind", "fused"), [("own", False), ("own", True), ("layer", False), ("layer", True)])
def test_a_steady_call_asks_once_per_slot_whether_its_core_can_wait_for_the_backward_pass(
    kind: str, fused: bool
) -> None:
    """Witness: the interpreter's own profile hook (``sys.setprofile``), naming every function of qkvtrace's
    files each steady call runs, and the autograd graph of the kernel's output in an un-instrumented run (its
    backward node's name, as PyTorch gives it). A decomposed kernel's core (dropout, on the CPU) cannot wait:
    its routes are read at its tensors, so only the slot's first steady call asks; a fused one's waits on every
    call. A model's own SDPA call, and an encoder layer's (its MultiheadAttention's fallback kernel)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    x = torch.randn(1, 4, 16)
    model: nn.Module
    if kind == "own":
        model = Direct() if fused else _Dropped()
        args: tuple[torch.Tensor, ...] = (q, k, v)
    else:
        model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0 if fused else 0.1, batch_first=True)
        args = (x,)
    nodes: list[str] = []
    sdpa = F.scaled_dot_product_attention

    def named(*a: Any, **kw: Any) -> torch.Tensor:
        out = sdpa(*a, **kw)
        nodes.append(out.grad_fn.name())
        return out

    F.scaled_dot_product_attention = named
    try:
        model(*args)
    finally:
        F.scaled_dot_product_attention = sdpa
    assert ("ScaledDotProduct" in nodes[0]) == fused
    asked: list[int] = []

    def names(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "steady_verdict" and "qkvtrace" in frame.f_code.co_filename:
            asked[-1] += 1

    with qkvtrace.trace(model) as t:
        for _ in range(8):
            asked.append(0)
            sys.setprofile(names)
            try:
                model(*args)
            finally:
                sys.setprofile(None)
    assert len(t.calls) == 8
    first = asked.index(1)  # the slot's first steady call
    assert asked[first + 1 :] == ([1] if fused else [0]) * (7 - first)


def test_a_long_runs_steady_calls_hold_no_more_memory_the_more_there_are() -> None:
    """Witness: ``tracemalloc``'s peak of the Python memory held at once during 1,000 and during 4,000 steady
    calls in one step (no step end between them to let anything go): the same, and a few kilobytes -- the
    NaN counts waiting to be summed on the device, at most 256 of them."""
    torch.manual_seed(2)
    model = Direct()
    q = torch.randn(1, 2, 4, 8)

    def peak(calls: int) -> int:
        with qkvtrace.trace(model, keep="changes") as t:
            for _ in range(300):
                model(q, q, q)
            t.step()
            gc.collect()
            tracemalloc.start()
            try:
                start = tracemalloc.get_traced_memory()[0]
                for _ in range(calls):
                    model(q, q, q)
                return tracemalloc.get_traced_memory()[1] - start
            finally:
                tracemalloc.stop()

    small, large = peak(1000), peak(4000)
    assert large <= small + 4096, (small, large)
    assert large < 64 * 1024, large


def test_records_captured_by_a_slot_are_built_each_time_they_are_read() -> None:
    """Witness: the test's own loop (how many calls, in which order) and its own NaN count of each output
    (``torch.isnan`` on the tensors it holds); the records are read in the middle of the block and again at
    its end."""
    torch.manual_seed(3)
    model = Direct()
    q = torch.randn(2, 2, 5, 8)
    nan_v = q.clone()
    nan_v[0, 0, 1, 0] = float("nan")  # reaches column 0 of every query row of head 0
    expected = []
    with qkvtrace.trace(model) as t:
        for i in range(10):
            out = model(q, q, nan_v if i % 4 == 3 else q)
            expected.append(int(torch.isnan(out).sum()))
        middle = [(c.index, c.output["nan_count"]) for c in t.calls]
        for i in range(10, 25):
            out = model(q, q, nan_v if i % 4 == 3 else q)
            expected.append(int(torch.isnan(out).sum()))
    assert middle == list(enumerate(expected[:10]))
    assert [(c.index, c.output["nan_count"]) for c in t.calls] == list(enumerate(expected))
    assert sum(expected) > 0


def test_a_multihead_attention_whose_batch_first_flag_flips_is_recorded_as_it_is() -> None:
    """Witness: the module's own ``batch_first`` flag as the test sets it before each call, on a square input
    whose shape is the same either way, so only the flag tells the calls apart."""
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(4, 4, 16)
    flags = [False] * 4 + [True] * 4 + [False] * 3
    with qkvtrace.trace(mha) as t:
        for flag in flags:
            mha.batch_first = flag
            mha(x, x, x)
    assert [c.inputs["batch_first"] for c in t.calls] == flags


def test_a_long_run_sees_each_return_to_an_earlier_combination() -> None:
    """Witness: the test's own plan -- unmasked calls, one masked call, unmasked calls again, for a
    MultiheadAttention and a model's own SDPA call -- whose changes of combination are the events expected:
    the first call, the masked one, and the return to unmasked calls (which a slot filled before the masked
    call must not count as if nothing had changed)."""
    torch.manual_seed(5)
    mha, direct = nn.MultiheadAttention(16, 2), Masked()
    model = nn.ModuleList([mha, direct])
    x = torch.randn(5, 2, 16)
    q = torch.randn(2, 2, 5, 8)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, -1] = True
    attend = torch.ones(5, 5, dtype=torch.bool).tril()
    plan = [False] * 4 + [True] + [False] * 4
    with qkvtrace.trace(model, keep="changes") as t:
        for masked in plan:
            mha(x, x, x, key_padding_mask=pad if masked else None)
            direct(q, q, q, attend if masked else None)
    for module, mask_field in (("0", "key_padding_mask"), ("1", "attn_mask")):
        events = [(e.kind, e.became[mask_field] is not None) for e in t.changes if e.module == module]
        assert events == [("first", False), ("change", True), ("change", False)], (module, events)
        calls = {c["combo"][mask_field] is not None: c["calls"] for c in t.summary()["modules"][module]["combinations"]}
        assert calls == {False: 8, True: 1}


class Masked(nn.Module):
    """A model's own SDPA call with the mask it is given, if any."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_the_first_call_of_a_signature_says_witnessed_and_the_later_ones_cached() -> None:
    """Witness: the evidence cache of the process, emptied by the test first, so that the kernels of the
    first call are profiled now and the later ones read from that profile; MultiheadAttention with
    ``need_weights=False`` (its kernel an SDPA call) and a model's own SDPA call."""
    from qkvtrace.facts import paths

    paths.shared_evidence()._ops.clear()
    torch.manual_seed(6)
    mha, direct = nn.MultiheadAttention(16, 2), Direct()
    x, q = torch.randn(5, 2, 16), torch.randn(2, 2, 5, 8)
    with qkvtrace.trace(nn.ModuleList([mha, direct])) as t:
        for _ in range(5):
            mha(x, x, x, need_weights=False)
            direct(q, q, q)
    for module in ("0", "1"):
        assert [c.evidence for c in t.calls if c.module == module] == ["witnessed"] + ["cached"] * 4


def test_records_read_in_the_middle_and_at_the_end_hold_numbers_not_tensors() -> None:
    """Witness: the test's own NaN count of each output and float64 norm of each Q it hands SDPA, for a
    MultiheadAttention (records built in full or copied) and a model's own SDPA call (records captured by its
    slot), read in the middle of the block and again at its end: each reading reads only what came since."""
    torch.manual_seed(7)
    mha, direct = nn.MultiheadAttention(16, 2), Direct()
    x = torch.randn(5, 2, 16)
    nans: list[int] = []
    norms: list[float] = []

    def run(calls: int) -> None:
        for i in range(calls):
            xi = x.clone()
            if i % 3 == 1:
                xi[0, 0, 0] = float("nan")
            out, _ = mha(xi, xi, xi)
            q = torch.randn(2, 2, 5, 8) * (i + 1)
            y = direct(q, q, q)
            nans.extend([int(torch.isnan(out).sum()), int(torch.isnan(y).sum())])
            norms.append(float(torch.linalg.vector_norm(q.double())))

    with qkvtrace.trace(nn.ModuleList([mha, direct])) as t:
        run(6)
        middle = [(c.output["nan_count"], c.qkv.q.activation_norm if c.module == "1" else None) for c in t.calls]
        run(9)
    end = [(c.output["nan_count"], c.qkv.q.activation_norm if c.module == "1" else None) for c in t.calls]
    assert middle == end[: len(middle)]
    assert [n for n, _ in end] == nans and sum(nans) > 0
    got = [norm for _, norm in end if norm is not None]
    assert all(type(n) is float for n in got)
    assert all(abs(g - e) <= 1e-5 * e for g, e in zip(got, norms, strict=True)), (got, norms)


@pytest.mark.parametrize(("kind", "most"), [("direct", 45), ("projected", 150)])
def test_one_trace_per_call_takes_the_slot_the_previous_trace_kept(kind: str, most: int) -> None:
    """Witness: the interpreter's own profile hook (``sys.setprofile``), counting qkvtrace's functions run by the
    model's call alone (not the trace's opening and closing), one trace per call. From the third trace on, the
    call takes the slot the previous trace kept (after its key, options and slice record were checked): the
    same number every time, and a handful -- with the observer in full, every trace's call ran 118 (direct) and
    219 (projected) functions, its kernels and projection known."""
    torch.manual_seed(3)
    model: nn.Module = Rewired() if kind == "projected" else Direct()
    q, x = torch.randn(1, 2, 4, 8), torch.randn(1, 4, 16)

    def counted() -> int:
        with qkvtrace.trace(model) as t:
            ran = _functions_in(lambda: model(x) if kind == "projected" else model(q, q, q))
        assert len(t.calls) == 1
        return ran

    counts = [counted() for _ in range(8)]
    assert len(set(counts[2:])) == 1, counts
    assert counts[2] <= most, counts


def test_a_model_with_multiheadattention_keeps_its_own_sdpa_calls_slot() -> None:
    """Witness: ``sys.setprofile``, as above, counting the functions of a model's own SDPA call made after a
    MultiheadAttention call in the same model, one trace per step: from the third trace on it takes the slot the
    previous trace kept (the MultiheadAttention's slot, which is not kept, must not stop the others from being
    kept) -- the same handful as the call alone, where the full observer ran 118."""
    torch.manual_seed(4)
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(16, 2), "direct": Direct()})
    q, x = torch.randn(1, 2, 4, 8), torch.randn(4, 1, 16)
    counts = []
    for _ in range(6):
        with qkvtrace.trace(model) as t:
            model["mha"](x, x, x)
            counts.append(_functions_in(lambda: model["direct"](q, q, q)))
        assert len(t.calls) == 2
    assert counts[2] <= 45, counts


@pytest.mark.parametrize("frozen", ["weight and bias", "bias only"])
def test_a_multihead_attention_kernel_whose_arguments_change_under_the_same_key_says_so(frozen: str) -> None:
    """A MultiheadAttention fallback's SDPA kernel (``need_weights=False``) receives Q, K and V projected from
    the module's weights: freezing them changes what the kernel receives while the module's call, its key, stays
    the same. Witness: by construction -- the projected Q, K and V need grad exactly while the input projection's
    weight or bias does (the input itself needs none), and the test sets those flags."""
    torch.manual_seed(7)
    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(5, 2, 16)
    with qkvtrace.trace(mha) as t:
        for _ in range(3):
            mha(x, x, x, need_weights=False)
        mha.in_proj_bias.requires_grad_(False)
        if frozen == "weight and bias":
            mha.in_proj_weight.requires_grad_(False)
        for _ in range(3):
            mha(x, x, x, need_weights=False)
    after = [frozen != "weight and bias"] * 3
    assert [c.inputs["requires_grad"] for c in t.calls] == [[True] * 3] * 3 + [after] * 3


def test_a_steady_multihead_attention_call_whose_reason_changes_is_recorded_in_full() -> None:
    """A MultiheadAttention call with its slot's key whose fast path PyTorch refuses for another reason (the
    fast path switched off) while its SDPA kernel receives what it received before: recorded in full, reasons
    and PyTorch's refusals for its kernel asked as for the calls before. Witness: PyTorch's reasons read from
    its own source for the two branches the test takes (``batch_first`` off, then the fast path switched off),
    and the refusals the trace option asks for (``refusals=True``: each record says where its refusals
    come from)."""
    torch.manual_seed(8)
    mha = nn.MultiheadAttention(16, 2, bias=False).eval()
    x = torch.randn(5, 2, 16)
    try:
        with torch.no_grad(), qkvtrace.trace(mha) as t:
            for _ in range(3):
                mha(x, x, x, need_weights=False)
            torch.backends.mha.set_fastpath_enabled(False)
            for _ in range(2):
                mha(x, x, x, need_weights=False)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    reasons = [reason_under("not self.batch_first")] * 3 + [reason_under("not is_fastpath_enabled")] * 2
    assert [c.why_not_fast_path for c in t.calls] == reasons
    assert all(c.sdpa_refusals is not None and c.sdpa_refusals_source is not None for c in t.calls), t.calls


def test_a_steady_multihead_attention_call_learns_its_kernels_new_arguments() -> None:
    """A module swapped inside a MultiheadAttention (its output projection, same shape and weights) changes the
    key of its SDPA kernel's arguments (they name the module's children) and nothing its call says: the next
    call finds its kernel out anew, and the calls after it are steady again. Witness: the interpreter's own
    profile hook, counting qkvtrace's functions per call, before the swap, on the first call after it and on
    the later ones; and PyTorch's output, the same as the untraced module's."""
    torch.manual_seed(9)
    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(5, 2, 16)
    with qkvtrace.trace(mha, keep="changes"):
        for _ in range(5):
            mha(x, x, x, need_weights=False)
        before = [_functions_in(lambda: mha(x, x, x, need_weights=False)) for _ in range(3)]
        swapped = nn.Linear(16, 16)
        swapped.load_state_dict(mha.out_proj.state_dict())
        mha.out_proj = swapped  # type: ignore[assignment]
        after = [_functions_in(lambda: mha(x, x, x, need_weights=False)) for _ in range(4)]
        traced = mha(x, x, x, need_weights=False)[0]
    assert torch.equal(traced, mha(x, x, x, need_weights=False)[0])
    assert len(set(before)) == 1 and after[0] > before[0], (before, after)
    assert after[1:] == before[:1] * 3, (before, after)


@pytest.mark.parametrize("need_weights", [True, False])
def test_steady_multihead_attention_records_of_a_trace_without_routes_say_so(need_weights: bool) -> None:
    """A trace opened with ``routes=False``: every record of a MultiheadAttention's steady calls says that no
    backward kernel was recorded, and why. Witness: the option the test passes (the trace's own promise for it)."""
    torch.manual_seed(10)
    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(5, 2, 16)
    with qkvtrace.trace(mha, routes=False) as t:
        for _ in range(4):
            mha(x, x, x, need_weights=need_weights)
    assert len(t.calls) == 4
    assert all(c.backward_kernel is None and "routes=False" in (c.backward_reason or "") for c in t.calls), [
        (c.backward_kernel, c.backward_reason) for c in t.calls
    ]


def _change_weight(module: nn.Module, name: str, how: str) -> None:
    """Give ``module``'s parameter ``name`` other values, in one of the ways a user's code does."""
    weight = module._parameters[name]
    assert weight is not None
    new = torch.randn_like(weight) * 3
    if how == "in place":  # an optimizer step: the same tensor, its version moved
        with torch.no_grad():
            weight.copy_(new)
    elif how == "data":  # ``param.data = ...``: the same parameter, another storage
        weight.data = new
    elif how == "replaced":  # another parameter under the name (``load_state_dict(assign=True)`` does this)
        setattr(module, name, nn.Parameter(new))
    elif how == "dict replaced":  # the module's parameter dict itself, another one holding another parameter
        module._parameters = {**module._parameters, name: nn.Parameter(new)}
    else:
        raise AssertionError(how)


def _around_a_change(model: nn.Module, call: Callable[[], Any], change: Callable[[], Any],
                     weight: Callable[[], torch.Tensor]) -> tuple[list[Any], list[float]]:  # fmt: skip
    """Eight steady calls of ``model`` in a trace, ``change()`` made before the fifth: the records, and the norm of
    the query's rows [0, 16) of ``weight()`` (the query's weight as it is then) computed right after each call.
    The change is one the records must show: the norm moves."""
    expected = []
    with qkvtrace.trace(model) as t:
        for i in range(8):
            if i == 4:
                change()
            call()
            expected.append(float(torch.linalg.vector_norm(weight()[:16].detach().double())))
    assert expected[4] != pytest.approx(expected[3], rel=1e-3)
    return t.calls, expected


@pytest.mark.parametrize("how", ["in place", "data", "replaced", "dict replaced"])
@pytest.mark.parametrize("kind", ["mha", "projected"])
def test_a_steady_call_after_its_weights_changed_reports_the_new_weights(how: str, kind: str) -> None:
    """Between two steady calls the query's weight is given new values, in each way a user's code does it; every
    call's record reports the weight it ran with. Witness: the norm of the query's rows of the weight, computed
    by the test (``torch.linalg.vector_norm``) right after each call, from the module's parameter as it is then."""
    torch.manual_seed(11)
    x = torch.randn(2, 5, 16)
    holder: nn.Module
    if kind == "mha":
        model: nn.Module = nn.MultiheadAttention(16, 2, batch_first=True)
        holder, name = model, "in_proj_weight"

        def call() -> None:
            model(x, x, x)
    else:
        model = Rewired()
        holder, name = model.q, "weight"

        def call() -> None:
            model(x)

    calls, expected = _around_a_change(model, call, lambda: _change_weight(holder, name, how),
                                       lambda: holder._parameters[name])  # fmt: skip
    assert [c.qkv.q.weight_norm for c in calls] == pytest.approx(expected, rel=1e-5)


class Deep(nn.Module):
    """Q, K and V from the thirds of a projection two modules down (``proj.0``), as a library's attention block
    holds its projection inside a container."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d, 3 * d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.contiguous() for y in self.proj(x).split(d, dim=-1))
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("how", ["in place", "data", "replaced", "dict replaced", "child replaced",
                                 "children replaced"])  # fmt: skip
def test_a_steady_call_after_a_deeper_projection_changed_reports_the_new_weights(how: str) -> None:
    """The projection two modules below the module that calls SDPA (whose own children stay the same, so its
    call's key does too) is given new weights between two steady calls: by each way of the test above, by a new
    module in its container, or by a new dict of the container's children. Witness: the norm of the query's
    rows of the projection's weight, computed by the test right after each call from the module as it is then."""
    torch.manual_seed(13)
    model = Deep()
    x = torch.randn(2, 5, 16)

    def change() -> None:
        fresh = nn.Linear(16, 48)
        if how == "child replaced":
            model.proj[0] = fresh
        elif how == "children replaced":
            model.proj._modules = {"0": fresh}
        else:
            _change_weight(model.proj[0], "weight", how)

    calls, expected = _around_a_change(model, lambda: model(x), change, lambda: model.proj[0].weight)
    assert [c.qkv.q.param for c in calls] == ["proj.0.weight"] * 8
    assert [c.qkv.q.weight_norm for c in calls] == pytest.approx(expected, rel=1e-5)


def test_a_steady_call_of_a_model_made_in_inference_mode_follows_its_weights() -> None:
    """A model made under ``torch.inference_mode`` has inference tensors for parameters, which keep no version
    counter: a change in place between two steady calls (allowed in inference mode) must still show. Witness: the
    norm of the query's rows of the weight, computed by the test right after each call."""
    torch.manual_seed(14)
    with torch.inference_mode():
        model = Deep()
        x = torch.randn(2, 5, 16)
        calls, expected = _around_a_change(model, lambda: model(x), lambda: model.proj[0].weight.mul_(3),
                                           lambda: model.proj[0].weight)  # fmt: skip
    assert [c.qkv.q.weight_norm for c in calls] == pytest.approx(expected, rel=1e-5)
    assert expected[4] == pytest.approx(3 * expected[3], rel=1e-5)


def test_steady_calls_of_a_module_found_at_call_impl_stay_steady_under_no_grad() -> None:
    """Witness: the interpreter's own profile hook (``sys.setprofile``), counting qkvtrace's functions run by each
    call under ``no_grad``. While a module is watched for its rows its hooks make PyTorch call its forward
    through other frames of its own (``Module._call_impl``'s slow path); the call's place in the forward is the
    same, so its slot still takes it: every call after the first two runs as few of qkvtrace's functions as a
    steady call does (not every other one in full, as when the place was read in PyTorch's frames)."""
    torch.manual_seed(1)
    model = Packed()
    x = torch.randn(1, 4, 16)
    with qkvtrace.trace(model) as t, torch.no_grad():
        counts = [_functions_in(lambda: model(x)) for _ in range(10)]
    assert max(counts[2:]) <= 31, counts
    assert all(c.qkv.layout == "packed" for c in t.calls[1:]), [c.qkv.reason for c in t.calls]
