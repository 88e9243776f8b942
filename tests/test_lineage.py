"""Rows read from the torch functions a call ran (``qkvtrace.facts.lineage``), one way of making Q, K and V at a time.

Each test writes a call's functions into a log itself -- with a ``TorchFunctionMode`` of its own that hands
every function to :func:`qkvtrace.facts.lineage.see`, as the tracer's mode does -- under ``torch.no_grad()``, then
reads the rows from that log. The witness is each module's construction: which output features of which
weight reach Q, K and V, computed in the test.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from qkvtrace.facts import lineage
from qkvtrace.facts.slices import Projection

E, H, D, B, T = 16, 2, 8, 2, 5
WHY = "not derived: no graph: grad is disabled (torch.no_grad)"


class Writing(TorchFunctionMode):
    """The test's own mode: every torch function, written into ``log``."""

    def __init__(self, log: lineage.Log) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        lineage.see(self.log, func, args, kwargs, out)
        return out


def logged(run: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[lineage.Log, Any]:
    log = lineage.Log()
    with torch.no_grad(), Writing(log):
        qkv = run()
    return log, qkv


def rows(found: Projection | str, part: str) -> tuple[str, list[int]]:
    assert isinstance(found, Projection), found
    spec = getattr(found.spec, part)
    return spec.param, [i for lo, hi in spec.rows for i in range(lo, hi)]


def heads(y: torch.Tensor) -> torch.Tensor:
    return y.view(B, -1, H, D).transpose(1, 2)


def test_packed_thirds_by_chunk() -> None:
    """Witness: ``chunk(3)`` of a ``Linear(E, 3E)``: Q, K, V are rows ``[0,E)``, ``[E,2E)``, ``[2E,3E)``; the
    evidence is the log's own."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, qkv = logged(lambda: tuple(heads(t) for t in proj(x).chunk(3, dim=-1)))
    found = lineage.derive(log, qkv, [proj], WHY)
    for i, part in enumerate("qkv"):
        assert rows(found, part) == ("weight", list(range(i * E, (i + 1) * E)))
    assert isinstance(found, Projection) and found.spec.q.evidence == lineage.EVIDENCE
    assert found.spec.layout == "packed" and found.spec.q.bias_param == "bias"


def test_a_part_written_into_a_buffer_through_views() -> None:
    """Witness: K made as an empty buffer whose two halves are written in place through views (DeepSeek-V2's
    way): K's rows are the rows written into it, from both projections; nothing of the real tensors changes."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(E, E), "b": nn.Linear(E, 4)})
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = heads(model["a"](x))
        k = q.new_empty(B, H, T, D)
        k[..., :4] = heads(model["a"](x))[..., :4]
        k[..., 4:] = model["b"](x).view(B, 1, T, 4).expand(B, H, T, 4)
        return q, k, q

    log, qkv = logged(run)
    before = qkv[1].clone()
    found = lineage.derive(log, qkv, [model], WHY)
    assert torch.equal(qkv[1], before)
    assert rows(found, "k") == ("a.weight", [h * D + i for h in range(H) for i in range(4)])
    assert isinstance(found, Projection)
    assert [(a.param, a.rows) for a in found.spec.k.also] == [("b.weight", ((0, 4),))]


def test_a_freed_tensor_joined_beside_stands_in_as_zeros_but_not_one_multiplied() -> None:
    """Witness: K joined (``cat``) to a cache tensor freed before the rows are read: K's rows are the new
    keys' (the old ones' values decide no feature's way); a factor freed before the rows are read does decide
    them, and the reason says it was freed."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, 1, E)
    keep: dict[str, torch.Tensor] = {}

    def run(op: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        other = torch.randn(B, H, 1, D) + 1  # (made outside the log: no tensor argument)
        keep["other"] = other
        if op == "mul":
            k = k * other
        else:
            k = torch.cat([other, k] if op == "cat" else (other, k), dim=2)
        return q, k, v

    for op in ("cat", "cat of a tuple", "mul"):
        log, qkv = logged(lambda op=op: run(op))
        del keep["other"]
        gc.collect()
        found = lineage.derive(log, qkv, [proj], WHY)
        if op != "mul":
            assert rows(found, "k") == ("weight", list(range(E, 2 * E)))
        else:
            assert found == f"{WHY}, and its torch functions give none: a tensor the way from a projection to the " \
                            "kernel read was freed before the kernel call"


def test_a_tensor_changed_in_place_since_it_was_read_says_so() -> None:
    """Witness: a factor of Q changed in place after the call read it (its version counter moved): the rows
    are not read from a value the call did not use."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    gate = torch.ones(D)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        return q * gate, k, v

    log, qkv = logged(run)
    gate.add_(1)
    found = lineage.derive(log, qkv, [proj], WHY)
    assert found == f"{WHY}, and its torch functions give none: a tensor the way from a projection to the kernel " \
                    "read was changed in place since"


class Own(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t + 0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _user_scale(t: torch.Tensor) -> torch.Tensor:  # a function of the "model's own" with a tensor protocol
    return t * 3


def test_a_function_of_the_models_own_and_a_random_draw_give_reasons() -> None:
    """Witness: Q through a function defined here (handed to the log as if a model's) and through
    ``torch.rand_like``: neither is run again, each reason names it; dropout on the way keeps every feature's
    way (rows by construction)."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)

    def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        return q, k, v

    log, (q, k, v) = logged(split)
    with torch.no_grad():
        scaled = _user_scale(q)
    lineage.see(log, _user_scale, (q,), {}, scaled)
    found = lineage.derive(log, (scaled, k, v), [proj], WHY)
    assert isinstance(found, str) and "'_user_scale', a function of the model's own" in found

    log, (q, k, v) = logged(split)
    with torch.no_grad():
        noisy = torch.rand_like(q)
    lineage.see(log, torch.rand_like, (q,), {}, noisy)
    found = lineage.derive(log, (noisy, k, v), [proj], WHY)
    assert isinstance(found, str) and "rand_like on the way from a projection to the kernel draws random" in found

    state = torch.get_rng_state()
    log, qkv = logged(lambda: tuple(F.dropout(t, 0.5, training=True) for t in split()))
    after = torch.get_rng_state()
    found = lineage.derive(log, qkv, [proj], WHY)
    assert torch.equal(torch.get_rng_state(), after) and not torch.equal(state, after)  # no draw while reading
    assert rows(found, "v") == ("weight", list(range(2 * E, 3 * E)))


def test_what_stands_in_the_way_is_said() -> None:
    """Witness: the reasons, word for word: Q made by no function of the log; Q made by a product of two
    activations (no weight); a matmul whose output is not one column per feature."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, (_, k, v) = logged(lambda: tuple(heads(t) for t in proj(x).chunk(3, dim=-1)))
    outside = torch.randn(B, H, T, D)
    assert lineage.derive(log, (outside, k, v), [proj], WHY) == (
        f"{WHY}, and its torch functions give none: Q was not made by a torch function of a watched module's call")

    def products() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, c = (heads(t) for t in proj(x).chunk(3, dim=-1))
        return a @ b.transpose(-1, -2) @ c, b, c

    log, qkv = logged(products)
    assert lineage.derive(log, qkv, [proj], WHY) == (
        "not derived: no nn.Linear or Conv1D weight of this module or its parents is multiplied on the way back "
        "from Q through the call's torch functions")

    log, qkv = logged(lambda: (x @ proj.weight[:E].T, x @ proj.weight[E:2 * E].T, x @ proj.weight[2 * E:].T))
    assert lineage.derive(log, qkv, [proj], WHY) == (
        "not derived: no nn.Linear or Conv1D weight of this module or its parents is multiplied on the way back "
        "from Q through the call's torch functions")  # (a slice of the weight is not the weight)

    log, qkv = logged(lambda: (proj(x).sum(-1, keepdim=True),) * 3)
    found = lineage.derive(log, qkv, [proj], WHY)
    assert isinstance(found, Projection)  # a sum over features reaches every row of the weight
    assert rows(found, "q") == ("weight", list(range(3 * E)))


def test_a_weight_transposed_into_its_matmul_and_a_chain_of_two_projections() -> None:
    """Witness: ``x @ W.T`` reads the weight through a transpose (rows by construction); Q made by ``b(a(x))``
    names the nearer ``b`` and says ``a`` stands behind it."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(E, E), "b": nn.Linear(E, E), "kv": nn.Linear(E, 2 * E)})
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = heads(model["b"](model["a"](x)))
        k, v = (heads(t) for t in (x @ model["kv"].weight.T).chunk(2, dim=-1))
        return q, k, v

    log, qkv = logged(run)
    found = lineage.derive(log, qkv, [model], WHY)
    assert rows(found, "q") == ("b.weight", list(range(E)))
    assert rows(found, "k") == ("kv.weight", list(range(E)))
    assert isinstance(found, Projection)
    assert "(the nearest projection: a feeds b" in found.spec.q.evidence
    assert found.spec.k.evidence == lineage.EVIDENCE


def test_the_call_s_tensors_and_random_state_are_left_as_they_were() -> None:
    """Witness: each real tensor the functions read -- a cache written in place by ``index_copy_``, the
    projection's weight -- compared with a copy taken before the rows were read (values and version counters),
    and the global random state."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, 1, E)
    cache, position = torch.zeros(B, H, 4, D), torch.tensor([1])

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        cache.index_copy_(2, position, k)
        return q, cache, v

    log, qkv = logged(run)
    saved = [(t.clone(), t._version) for t in (cache, proj.weight)]
    state = torch.get_rng_state()
    found = lineage.derive(log, qkv, [proj], WHY)
    assert rows(found, "k") == ("weight", list(range(E, 2 * E)))
    for t, (value, version) in zip((cache, proj.weight), saved, strict=True):
        assert torch.equal(t, value) and t._version == version
    assert torch.equal(torch.get_rng_state(), state)


def test_no_log_a_profiler_and_a_full_log() -> None:
    """Witness: what the call met, each said: no log (not lasting, :data:`NOT_RECORDED`; said for good as
    :data:`UNWATCHED` where no later call will be recorded); a profiler recording (not lasting); a log stops
    taking entries at its bound."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, qkv = logged(lambda: tuple(heads(t) for t in proj(x).chunk(3, dim=-1)))
    missing = lineage.derive(None, qkv, [proj], WHY)
    assert missing == f"{WHY}; {lineage.NOT_RECORDED}" and not lineage.lasting(missing)
    settled = lineage.never_recorded(missing)
    assert settled == f"{WHY}; {lineage.UNWATCHED}" and lineage.lasting(settled)
    assert lineage.never_recorded("other") == "other" and lineage.lasting("other")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = lineage.derive(log, qkv, [proj], WHY)
    assert profiled == f"{WHY}; {lineage.PROFILING}" and not lineage.lasting(profiled)
    full = lineage.Log()
    with torch.no_grad(), Writing(full):
        t = x
        for _ in range(lineage.MAX_OPS + 5):
            t = t.view(-1)
    assert len(full.entries) == lineage.MAX_OPS


def test_a_thread_s_log_starts_empty_and_is_dropped() -> None:
    """Witness: the log object handed out: :func:`start` makes a new empty one for this thread, :func:`stop`
    empties and drops it (nothing it referred to is kept)."""
    log = lineage.start()
    assert lineage.current() is log and not log.entries
    with torch.no_grad(), Writing(log):
        torch.ones(3).add(1)
    assert len(log.entries) == 1 and log.made
    lineage.stop()
    assert lineage.current() is None and not log.entries and not log.made and not log.writes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_other_dtypes_and_a_projection_of_integers(dtype: torch.dtype) -> None:
    """Witness: the construction in bfloat16 too (probes of the projection's own dtype); a "projection" whose
    output is not floating point has no gradient to read, and says so."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E).to(dtype)
    x = torch.randn(B, T, E, dtype=dtype)
    log, qkv = logged(lambda: tuple(heads(t) for t in proj(x).chunk(3, dim=-1)))
    assert rows(lineage.derive(log, qkv, [proj], WHY), "v") == ("weight", list(range(2 * E, 3 * E)))
    w = nn.Linear(E, 3 * E)
    log = lineage.Log()
    ints = torch.ones(B, T, 3 * E, dtype=torch.long)
    lineage.see(log, F.linear, (x.float(), w.weight), {}, ints)
    found = lineage.derive(log, (ints, ints, ints), [w], WHY)
    assert found == f"{WHY}, and its torch functions give none: the projection linear made a torch.int64 tensor"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_factor_written_in_place_after_the_call_used_it_is_made_again(mode: str) -> None:
    """Witness: a gate of ones, made in the call (from a tensor still alive) and multiplied into Q through a
    view of it, then zeroed in place after that product (an inference tensor keeps no version to tell): Q's
    rows are every row of its third (the value the product used), not none (the gate's value now)."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x, ones = torch.randn(B, T, E), torch.ones(D)
    kept: list[torch.Tensor] = []  # (the gate and its view alive when the rows are read, as a module's state is)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        gate = ones.mul(1.0)
        kept.extend((gate, gate.view(1, 1, 1, D)))
        q = q * kept[1]
        gate.zero_()
        return q, k, v

    log = lineage.Log()
    with (torch.no_grad() if mode == "no_grad" else torch.inference_mode()), Writing(log):
        qkv = run()
    assert rows(lineage.derive(log, qkv, [proj], WHY), "q") == ("weight", list(range(E)))


def test_a_part_cut_from_its_projection_says_no_projection_reaches_it() -> None:
    """Witness: Q detached from the projection's output on its way to the kernel: the reason, word for word."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, qkv = logged(lambda: tuple(heads(t).detach() if i == 0 else heads(t)
                                    for i, t in enumerate(proj(x).chunk(3, dim=-1))))  # fmt: skip
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: no projection's output reaches Q through the call's torch "
        "functions")


class Conv1D(nn.Module):
    """GPT-2's projection: an ``[in, out]`` weight, ``addmm(bias, x, weight)`` (the bias first)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


def test_a_projection_behind_a_conv1d_and_one_behind_a_product() -> None:
    """Witness: the construction: Q from ``c_attn`` (a Conv1D, bias first in its ``addmm``) fed by ``a``; K from
    ``b`` fed by ``a``'s output times a fixed matrix (a product that is no projection): Q names ``c_attn``'s
    first third and says ``a`` stands behind it; K names ``b`` and no projection behind."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(E, E), "c_attn": Conv1D(3 * E, E), "b": nn.Linear(E, E)})
    mix = torch.randn(E, E)
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = model["a"](x)
        q, _, v = (heads(t) for t in model["c_attn"](hidden).chunk(3, dim=-1))
        k = heads(model["b"](hidden @ mix))
        return q, k, v

    log, qkv = logged(run)
    found = lineage.derive(log, qkv, [model], WHY)
    assert rows(found, "q") == ("c_attn.weight", list(range(E)))
    assert isinstance(found, Projection)
    assert found.spec.q.dim == 1 and "(the nearest projection: a feeds c_attn" in found.spec.q.evidence
    assert rows(found, "k") == ("b.weight", list(range(E))) and found.spec.k.evidence == lineage.EVIDENCE


def test_a_property_of_a_tensor_on_the_way_is_pytorchs_own() -> None:
    """Witness: the construction: K handed over through ``.mT`` twice (a property of PyTorch's tensors, whose
    function is its descriptor's ``__get__``): K's rows are its third, not a reason naming a function of the
    model's own."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, qkv = logged(lambda: tuple(heads(t).mT.mT for t in proj(x).chunk(3, dim=-1)))
    assert rows(lineage.derive(log, qkv, [proj], WHY), "k") == ("weight", list(range(E, 2 * E)))


def test_parts_that_share_a_saving_function_each_get_their_rows() -> None:
    """Witness: the construction: the projection's output times a per-feature scale (a product that keeps its
    operands for its backward) before the chunk into Q, K, V: each part's rows are read from the same graph."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x, scale = torch.randn(B, T, E), torch.rand(3 * E) + 0.5
    log, qkv = logged(lambda: tuple(heads(t) for t in (proj(x) * scale).chunk(3, dim=-1)))
    found = lineage.derive(log, qkv, [proj], WHY)
    for i, part in enumerate("qkv"):
        assert rows(found, part) == ("weight", list(range(i * E, (i + 1) * E)))


def test_a_part_no_feature_reaches_with_a_gradient_says_so() -> None:
    """Witness: Q multiplied by zero on its way (every feature of its projection has a zero gradient there):
    the reason, word for word."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, qkv = logged(lambda: tuple(heads(t) * (0.0 if i == 0 else 1.0)
                                    for i, t in enumerate(proj(x).chunk(3, dim=-1))))  # fmt: skip
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: no output feature of a projection reaches Q with a non-zero "
        "gradient")


def test_the_walk_back_is_bounded_and_says_so() -> None:
    """Witness: chains of views counted in the test between the projection and Q: 512 functions on Q's way
    back (the projection, the slice, 510 views) are walked; one more and the reason says the bound."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)

    def run(views: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = proj(x)[..., :E]
        for _ in range(views):
            q = q.view(B, T, E)
        k, v = (heads(t) for t in proj(x)[..., E:].chunk(2, dim=-1))
        return heads(q), k, v

    log, qkv = logged(lambda: run(508))  # (the projection, the slice, heads()'s view and transpose: 512 in all)
    assert rows(lineage.derive(log, qkv, [proj], WHY), "q") == ("weight", list(range(E)))
    log, qkv = logged(lambda: run(509))
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: more than 512 torch functions lie between the kernel and its "
        "projections")


def test_a_product_of_activations_on_the_way_freed_since_and_a_buffer_read_through_a_view() -> None:
    """Witness: the construction: Q times a product of two activations made and freed inside the call (its
    value stands in as a probe of its shape; Q's rows are still its projection's); K read through a view of a
    buffer taken before its halves were written into it (the writes are run again: K's rows are both
    halves')."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    a, b = torch.randn(B, H, T, 4), torch.randn(B, H, 4, D)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        q = q * (a.mul(1.0) @ b)
        buffer = k.new_empty(B, H, T, D)
        seen = buffer.view(B, H, T, D)  # (taken before the writes, read after them)
        buffer[..., :4] = k[..., :4]
        buffer[..., 4:] = k[..., 4:]
        return q, seen, v

    log, qkv = logged(run)
    gc.collect()
    found = lineage.derive(log, qkv, [proj], WHY)
    assert rows(found, "q") == ("weight", list(range(E)))
    assert rows(found, "k") == ("weight", list(range(E, 2 * E)))


def test_what_the_rows_copy_of_the_call_s_tensors_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: the size of the one inference tensor the way reads (a factor made in inference mode), counted
    in the test: a bound of exactly its bytes lets it be copied; one byte less and the reason says the bound."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    with torch.inference_mode():
        factor = torch.rand(D) + 0.5
    log = lineage.Log()
    with torch.inference_mode(), Writing(log):
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        qkv = (q * factor, k, v)
    size = factor.numel() * factor.element_size()
    monkeypatch.setattr(lineage, "MAX_COPY_BYTES", size)
    assert rows(lineage.derive(log, qkv, [proj], WHY), "q") == ("weight", list(range(E)))
    monkeypatch.setattr(lineage, "MAX_COPY_BYTES", size - 1)
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: the tensors it reads exceed 0 MiB")


def test_a_projection_s_output_written_in_place_on_the_way() -> None:
    """Witness: the construction: the projection's output scaled in place (``mul_``) before the chunk into Q,
    K, V: the write is run again on a copy of the probe, and each part's rows are its third."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = proj(x)
        out.mul_(0.5)
        q, k, v = (heads(t) for t in out.chunk(3, dim=-1))
        return q, k, v

    log, qkv = logged(run)
    found = lineage.derive(log, qkv, [proj], WHY)
    for i, part in enumerate("qkv"):
        assert rows(found, part) == ("weight", list(range(i * E, (i + 1) * E)))


def test_dropout_by_keyword_native_dropout_and_a_result_written_into_out() -> None:
    """Witness: the construction, with Q passed to ``torch.dropout`` by keyword and V through
    ``torch.native_dropout`` times its own mask (no draw is made to read the rows: the mask stands in as
    ones), and K read through a view of a buffer written by ``out=`` after the view was taken: each part's rows
    are its third, and the global random state does not move while they are read."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        q = torch.dropout(input=q, p=0.5, train=True)
        dropped, mask = torch.native_dropout(v, 0.5, True)
        v = dropped * mask
        buffer = k.new_empty(k.shape)
        seen = buffer.view(k.shape)  # (taken before the write into the buffer, read after it)
        torch.add(k, 1.0, out=buffer)
        return q, seen, v

    log, qkv = logged(run)
    state = torch.get_rng_state()
    found = lineage.derive(log, qkv, [proj], WHY)
    assert torch.equal(torch.get_rng_state(), state)
    for i, part in enumerate("qkv"):
        assert rows(found, part) == ("weight", list(range(i * E, (i + 1) * E)))


def test_a_weight_multiplied_the_other_way_round_says_so() -> None:
    """Witness: a ``Linear(E, 3E)``'s weight ``[3E, E]`` multiplied from the left side of its output features
    (``y @ W``: one column per input feature, not per row): the reason names the matmul and the weight."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"p": nn.Linear(E, 3 * E)})
    y = torch.randn(B, T, 3 * E)
    log, qkv = logged(lambda: (heads(y @ model["p"].weight),) * 3)
    assert lineage.derive(log, qkv, [model], WHY) == (
        f"{WHY}, and its torch functions give none: the matmul matmul that reads p.weight does not give one "
        "column per output feature")


def test_a_view_taken_by_keyword_before_a_write_and_a_function_that_refuses_the_probes() -> None:
    """Witness: the construction: K read through ``torch.transpose(input=buffer, ...)`` taken before the
    buffer's halves were written (a view by keyword: the writes reach it); and a function that runs in the
    call but refuses the probes (``requires_grad_`` on a tensor made by autograd) gives PyTorch's own error as
    the reason."""
    torch.manual_seed(0)
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        buffer = k.new_empty(B, H, T, D)
        seen = torch.transpose(input=buffer, dim0=2, dim1=3)
        buffer[..., :4] = k[..., :4]
        buffer[..., 4:] = k[..., 4:]
        return q, seen.transpose(2, 3), v

    log, qkv = logged(run)
    assert rows(lineage.derive(log, qkv, [proj], WHY), "k") == ("weight", list(range(E, 2 * E)))

    def refusing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        return q.requires_grad_(False), k, v

    log, qkv = logged(refusing)
    found = lineage.derive(log, qkv, [proj], WHY)
    assert isinstance(found, str)
    assert found.startswith(f"{WHY}, and its torch functions give none: running them on probes raised RuntimeError: ")


def test_a_thread_that_never_watched_has_no_log_and_stops_quietly() -> None:
    """Witness: a thread started here, which never turned the watching on: no log, and stopping is a no-op."""
    seen: list[Any] = []

    def thread() -> None:
        seen.append(lineage.current())
        lineage.stop()
        seen.append(lineage.current())

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(10)
    assert seen == [None, None]


def test_a_callable_without_a_name_on_the_way_is_the_model_s_own() -> None:
    """Witness: a ``functools.partial`` of ``torch.mul`` (no ``__name__``, not PyTorch's own object) handed to
    the log as a model's function would be: it is written down under no name and not run again."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    log, (q, k, v) = logged(lambda: tuple(heads(t) for t in proj(x).chunk(3, dim=-1)))
    scale = functools.partial(torch.mul, other=2.0)
    with torch.no_grad():
        scaled = scale(q)
    lineage.see(log, scale, (q,), {}, scaled)
    assert log.entries[-1].name == "" and not log.entries[-1].in_place
    assert lineage.derive(log, (scaled, k, v), [proj], WHY) == (
        f"{WHY}, and its torch functions give none: the way from a projection to the kernel goes through '', a "
        "function of the model's own (not PyTorch's), which is not run again")


def test_what_the_rows_copy_adds_up_and_says_its_bound_in_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Witness: sizes counted in the test: two inference tensors the way reads, each under the bound and both
    over it, are refused together; a 4 MiB cache joined beside K against a 3 MiB bound says "3 MiB"."""
    proj = nn.Linear(E, 3 * E)
    x = torch.randn(B, T, E)
    with torch.inference_mode():
        first, second = torch.rand(D) + 0.5, torch.rand(D) + 0.5
        cache = torch.zeros(B, H, 2**15, D)  # 4 MiB
    log = lineage.Log()
    with torch.inference_mode(), Writing(log):
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        qkv = (q * first * second, k, v)
    one = first.numel() * first.element_size()
    monkeypatch.setattr(lineage, "MAX_COPY_BYTES", one + one // 2)
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: the tensors it reads exceed 0 MiB")
    log = lineage.Log()
    with torch.inference_mode(), Writing(log):
        q, k, v = (heads(t) for t in proj(x).chunk(3, dim=-1))
        qkv = (q, torch.cat([cache, k], dim=2), v)
    monkeypatch.setattr(lineage, "MAX_COPY_BYTES", 3 * 2**20)
    assert lineage.derive(log, qkv, [proj], WHY) == (
        f"{WHY}, and its torch functions give none: the tensors it reads exceed 3 MiB")
