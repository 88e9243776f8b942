"""qkvtrace.facts.dataflow read directly: the rows it names, the reasons it gives, and when an answer is reused.

The models are small modules written here that project with ``nn.Linear``
(or a ``Conv1D``-style ``[in, out]`` weight) and call
``F.scaled_dot_product_attention``; each keeps the Q, K, V it handed the
kernel (``self.seen``) so the module's public functions can be called on
them. The witnesses:

* rows by construction: a packed ``qkv`` ``nn.Linear`` split in thirds gives
  part ``i`` the rows ``[j·E, (j+1)·E)`` of the ``j``-th third the forward
  hands it; a separate projection gives all of its rows;
* which tensors the test built alike or differently (for
  :func:`~qkvtrace.facts.dataflow.signature`: the same layout at another sequence
  length must give the same signature, other rows a different one);
* PyTorch's own autograd (gradients and ``.grad`` of an untouched run) for
  what the derivation must leave as it found it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.facts import dataflow, lineage

E, H = 8, 2
Rows = tuple[tuple[int, int], ...]
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _third(j: int, e: int = E) -> Rows:
    return ((j * e, (j + 1) * e),)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


class Packed(nn.Module):
    """One packed ``qkv`` Linear cut in thirds; ``order[i]`` is the third that becomes part ``i``."""

    def __init__(self, bias: bool = True, e: int = E) -> None:
        super().__init__()
        self.e = e
        self.qkv = nn.Linear(e, 3 * e, bias=bias)

    def forward(self, x: torch.Tensor, order: tuple[int, int, int] = (0, 1, 2), heads: int = 0,
                contiguous: bool = False) -> torch.Tensor:  # fmt: skip
        chunks = self.qkv(x).chunk(3, -1)
        q, k, v = (chunks[i] for i in order)
        if heads:  # [.., L, E] -> [.., heads, L, E // heads]
            q, k, v = (t.unflatten(-1, (heads, self.e // heads)).transpose(-3, -2) for t in (q, k, v))
        if contiguous:
            q, k, v = (t.contiguous() for t in (q, k, v))
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


class Stacked(nn.Module):
    """``nn.MultiheadAttention``'s packed route: ``[3, B, L, e]`` made contiguous, Q, K, V its three slabs."""

    def __init__(self, e: int = E) -> None:
        super().__init__()
        self.e = e
        self.qkv = nn.Linear(E, 3 * e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.qkv(x).unflatten(-1, (3, self.e)).permute(2, 0, 1, 3).contiguous()
        q, k, v = s[0], s[1], s[2]
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


class Separate(nn.Module):
    """Three Linears, Q, K, V their outputs as they are (no view of anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def _seen(model: nn.Module, x: torch.Tensor, **kwargs: object) -> QKV:
    model(x, **kwargs)
    return model.seen


def _rows(found: object) -> tuple[Rows, Rows, Rows]:
    assert isinstance(found, qkvtrace.facts.slices.Projection), found
    return found.spec.q.rows, found.spec.k.rows, found.spec.v.rows


# -- signature: the same for the same layout at any length, different for other rows -------------------------


#: route -> (batch, lengths): a 1-token step only where its layout is that of the prompt (with one batch
#: row, a ``[3, 1, 1, e]`` slab is contiguous as it comes, and a size-1 dimension's stride is anyone's)
ROUTES = {"chunk": (2, (5, 1, 6)), "heads": (2, (5, 6)), "copies": (2, (5, 1, 6)), "stacked": (2, (5, 1, 6)),
          "separate": (2, (5, 1, 6)), "width1": (1, (5, 6))}  # fmt: skip


@pytest.mark.parametrize("route", list(ROUTES))
def test_signature_is_the_same_at_every_sequence_length(route: str) -> None:
    """Witness: one module, one layout, prompts of 5 and 6 tokens and a 1-token decoding step.

    The routes: thirds of a packed output as views, split into heads, copied out (views of nothing),
    ``nn.MultiheadAttention``'s stacked slabs, three Linears. Catches a signature that reads the
    length: a width taken from the wrong dimension, strides or a
    storage offset that grow with the length (``nn.MultiheadAttention``'s stacked ``[3, B, L, E]``
    slabs start ``B·L·E`` apart; with one feature per part, ``L`` apart), a stride equal to the width
    kept (a one-token step's batch stride).
    """
    torch.manual_seed(0)
    model: nn.Module = {"chunk": Packed, "heads": Packed, "copies": Packed, "stacked": Stacked, "separate": Separate,
                        "width1": lambda: Stacked(e=1)}[route]()  # fmt: skip
    kwargs = {"heads": {"heads": H}, "copies": {"contiguous": True}}.get(route, {})
    batch, lengths = ROUTES[route]
    sigs = set()
    for length in lengths:
        qkv = _seen(model, _x(batch, length, E), **kwargs)
        sigs.add(dataflow.signature(model, qkv))
    assert len(sigs) == 1


def test_signature_tells_apart_views_that_take_other_rows_without_a_graph() -> None:
    """Witness: the same three views of one packed output handed over as ``q, k, v`` and as ``k, q, v``.

    Under ``torch.no_grad`` no graph says which is which: only their offsets in the tensor they view do.
    Catches a signature that drops the offset, or takes the width from the view rather than the packed
    tensor (every offset is then a multiple of it), or stops at a tensor without ``grad_fn``.
    """
    model = Packed()
    with torch.no_grad():
        q, k, v = _seen(model, _x(2, 5, E))
        assert dataflow.signature(model, (q, k, v)) != dataflow.signature(model, (k, q, v))
        assert dataflow.signature(model, (q, k, v)) == dataflow.signature(model, _seen(model, _x(2, 7, E)))


def test_signature_tells_apart_offsets_in_inference_mode() -> None:
    """Witness: ``q, k, v`` against ``k, q, v`` of one packed output under ``inference_mode``.

    There a view keeps no ``_base``: the raw storage offset is what says which third a part took.
    Catches an offset reduced modulo the part's own width (0 for every third).
    """
    model = Packed()
    with torch.inference_mode():
        q, k, v = _seen(model, _x(2, 5, E))
        assert q._base is None  # what makes this case: no base to measure the offset against
        assert dataflow.signature(model, (q, k, v)) != dataflow.signature(model, (k, q, v))


def test_signature_tells_apart_views_of_one_flat_buffer() -> None:
    """Witness: three equal-shaped views of one 1-D buffer, handed over in two orders.

    The buffer's only dimension is its width; the views start ``n`` and ``2n`` into it. Catches a
    signature that takes the width from the view when the tensor it views is 1-D.
    """
    model = Packed()
    n = 2 * 5 * E
    flat = torch.arange(3 * n, dtype=torch.float32)
    q, k, v = (flat[i * n:(i + 1) * n].view(2, 5, E) for i in range(3))
    assert dataflow.signature(model, (q, k, v)) != dataflow.signature(model, (k, q, v))


def test_signature_tells_one_packed_tensor_from_three() -> None:
    """Witness: thirds of one packed output against the same thirds of three separate outputs.

    Shapes, strides and offsets are alike; only whether Q, K, V share a storage differs (a model that
    packs them against one that copies each). Catches a storage start computed wrongly or not compared.
    """
    model = Packed()
    with torch.no_grad():
        one = _seen(model, _x(2, 5, E))
        a, b, c = (_seen(model, _x(2, 5, E) + i) for i in range(3))
        three = (a[0], b[1], c[2])
        assert dataflow.signature(model, one) != dataflow.signature(model, three)


def test_signature_tells_apart_head_widths() -> None:
    """Witness: views at the same offsets of one ``[B, L, 3E]`` output, 8 features wide and 6 wide.

    Catches a signature that leaves out the last dimension of Q, K, V (or reads another dimension).
    """
    model = Packed()
    with torch.no_grad():
        packed = model.qkv(_x(2, 5, E))
        wide = tuple(packed[..., i * E:(i + 1) * E] for i in range(3))
        narrow = tuple(packed[..., i * E:i * E + 6] for i in range(3))
        assert dataflow.signature(model, wide) != dataflow.signature(model, narrow)


@pytest.mark.parametrize("bias", [True, False])
def test_signature_reads_the_split_order_from_the_graph(bias: bool) -> None:
    """Witness: contiguous copies of the thirds, handed over as ``q, k, v`` and as ``k, v, q``.

    The copies share nothing and start at offset 0: only the graph (which output of the split each
    was made from) tells the orders apart. The input is 2-D, so the walk reaches a leaf (the bias's
    ``AccumulateGrad``, or the input's missing node) within its four steps. Catches a signature that
    does not read the graph, or gives up reading it there.
    """
    model = Packed(bias=bias)
    x = _x(5, E)
    a = dataflow.signature(model, _seen(model, x, contiguous=True))
    b = dataflow.signature(model, _seen(model, x, order=(1, 2, 0), contiguous=True))
    assert a != b


def test_signature_takes_what_is_not_a_dense_tensor() -> None:
    """Witness: a call that handed the kernel ``None`` for one part, and one that handed a 0-dim view.

    Catches a signature that raises on them (the tracer asks for one on every call).
    """
    model = Packed()
    q, k, v = _seen(model, _x(2, 5, E))
    assert dataflow.signature(model, (None, k, v)) != dataflow.signature(model, (q, k, v))
    assert dataflow.signature(model, (q, None, v)) != dataflow.signature(model, (q, k, v))
    assert dataflow.signature(model, (q[0, 0, 0], k, v)) != dataflow.signature(model, (q, k, v))


# -- derived_projection: once per module and signature ---------------------------------------------------


class Inner(nn.Module):
    """Attention handed a packed projection by its parent: the rows live in ``Outer.qkv``."""

    def forward(self, packed: torch.Tensor, order: tuple[int, int, int] = (0, 1, 2), heads: int = 1) -> torch.Tensor:
        chunks = packed.chunk(3, -1)
        q, k, v = (chunks[i].unflatten(-1, (heads, E // heads)).transpose(-3, -2) for i in order)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.attn = nn.Linear(E, 3 * E), Inner()

    def forward(self, x: torch.Tensor, order: tuple[int, int, int] = (0, 1, 2), heads: int = 1) -> torch.Tensor:
        return self.attn(self.qkv(x), order, heads)


def _by_order(order: tuple[int, int, int]) -> tuple[Rows, Rows, Rows]:
    return _third(order[0]), _third(order[1]), _third(order[2])


def test_without_a_signature_each_layout_is_read_anew() -> None:
    """Witness: rows by construction for the split orders ``q, k, v`` and ``v, q, k``.

    ``derived_projection`` called without ``sig`` computes the call's signature itself. Catches one
    that does not (every call then shares the first call's answer) or computes it from the wrong input.
    """
    model = Packed()
    x = _x(2, 5, E)
    for order in [(0, 1, 2), (2, 0, 1)]:
        assert _rows(dataflow.derived_projection(model, _seen(model, x, order=order), [model])) == _by_order(order)


def test_an_answer_is_kept_per_module_and_signature() -> None:
    """Witness: rows by construction, derived once with the parent that holds the projection among
    ``holders``; the same layout asked again with the attention module alone (where no projection could
    be found) must be given that kept answer, holder included.

    Catches an answer that is not kept, not found again, or given back with the wrong holder or slices.
    """
    model = Outer()
    x = _x(2, 5, E)
    first = dataflow.derived_projection(model.attn, _seen(model.attn, model.qkv(x)), [model.attn, model])
    again = dataflow.derived_projection(model.attn, _seen(model.attn, model.qkv(_x(2, 7, E))), [model.attn])
    for found in (first, again):
        assert _rows(found) == _by_order((0, 1, 2))
        assert isinstance(found, qkvtrace.facts.slices.Projection) and found.holder is model
        assert found.spec.q.param == "qkv.weight"


def test_eight_layouts_are_kept_per_module_and_the_oldest_forgotten_first() -> None:
    """Witness: rows by construction for nine layouts (split orders at 1 and 2 heads), each derived
    with the projection's parent among ``holders``; asked again without it, a kept layout keeps its
    rows and a forgotten one says no projection was found.

    Catches fewer than eight layouts kept, and the newest forgotten instead of the oldest.
    """
    model = Outer()
    x = _x(2, 5, E)
    layouts = list(itertools.product(itertools.permutations(range(3)), (1, 2)))[:9]

    def ask(i: int, holders: list[nn.Module]) -> object:
        order, heads = layouts[i]
        model(x, order, heads)
        return dataflow.derived_projection(model.attn, model.attn.seen, holders)

    for i in range(8):
        assert _rows(ask(i, [model.attn, model])) == _by_order(layouts[i][0])
    assert _rows(ask(0, [model.attn])) == _by_order(layouts[0][0])  # all eight kept
    assert _rows(ask(8, [model.attn, model])) == _by_order(layouts[8][0])
    assert _rows(ask(8, [model.attn])) == _by_order(layouts[8][0])  # the newest kept
    forgotten = ask(0, [model.attn])
    assert isinstance(forgotten, str) and forgotten.startswith("not derived: no nn.Linear"), forgotten


def test_a_graph_already_freed_gives_a_reason_not_an_exception() -> None:
    """Witness: PyTorch refuses a second backward through a graph whose saved tensors were freed.

    Q is scaled by a constant tensor (a rotary-style product, which saves it for backward); after
    ``backward()`` without ``retain_graph`` the probe cannot run. Catches the refusal lost (``None``)
    or misnamed.
    """
    torch.manual_seed(0)
    model = Packed()
    q, k, v = _seen(model, _x(2, 5, E))
    q = q * torch.linspace(0.5, 1.5, E)
    (q.sum() + k.sum() + v.sum()).backward()
    with pytest.raises(RuntimeError) as refused:
        torch.autograd.grad([q], [model.qkv.weight], [torch.ones_like(q)])
    found = dataflow.derived_projection(model, (q, k, v), [model])
    assert found == f"not derived: autograd could not read the rows (RuntimeError: {refused.value})"


def test_a_direct_call_without_a_graph_says_so() -> None:
    """Witness: Q, K, V made under ``torch.no_grad`` outside any traced forward, so no function of theirs was
    written down: the reason says both, in that order, and is not kept for a later call of the layout.

    Catches the reason lost on the way (``None``, or ``"None, ..."``) and an unknown kept as lasting.
    """
    model = Packed()
    with torch.no_grad():
        qkv = _seen(model, _x(2, 5, E))
        found = dataflow.derived_projection(model, qkv, [model])
    assert found == "not derived: no graph: grad is disabled (torch.no_grad); " + lineage.NOT_RECORDED
    assert not lineage.lasting(found)


def test_an_answer_given_while_profiling_is_not_kept() -> None:
    """Witness: rows by construction, for a ``torch.no_grad`` call traced while ``torch.profiler``
    records (no replay then: its work would show in the profile) and the same call after it stops.

    Catches the profiling answer kept for the layout (the later call would get no rows) and a rows
    answer not kept.
    """
    torch.manual_seed(0)
    model = Packed()
    x = _x(2, 5, E)
    with qkvtrace.trace(model) as t, torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            model(x)
        model(x)
        model(x)
    assert len(t.calls) == 3
    assert t.calls[0].qkv is None or t.calls[0].qkv.q is None or t.calls[0].qkv.q.rows is None
    for call in t.calls[1:]:
        got = tuple(tuple(map(tuple, p.rows)) for p in (call.qkv.q, call.qkv.k, call.qkv.v))
        assert got == _by_order((0, 1, 2))


# -- derive_projection: the reasons it gives -------------------------------------------------------------


def test_reasons_for_calls_that_give_no_rows() -> None:
    """Witness: calls built here to lack what a derivation needs, each named in the documented reason:
    two tensors, nested tensors, a leaf K made by ``torch.randn``, a detached V, frozen weights.

    Catches reasons that name another part, another case or another condition (a frozen model with
    gradients on is not "grad is disabled").
    """
    model = Packed()
    q, k, v = _seen(model, _x(2, 5, E))
    assert dataflow.derive_projection((q, k), [model]) == "the kernel did not receive three tensors"
    nested = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)])
    assert dataflow.derive_projection((nested, nested, nested), [model]) == "nested Q/K/V: their rows are not derived"
    leaf = torch.randn(k.shape, requires_grad=True)
    assert dataflow.derive_projection((q, leaf, v), [model]) == "not derived: K is a leaf tensor: no projection made it"
    assert dataflow.derive_projection((q, k, v.detach()), [model]) == (
        "not derived: no graph: V has no autograd history (nothing it came from requires grad)")
    model.requires_grad_(False)
    frozen = _seen(model, _x(2, 5, E))
    assert dataflow.derive_projection(frozen, [model]) == (
        "not derived: no graph: Q has no autograd history (nothing it came from requires grad)")
    with torch.no_grad():
        assert dataflow.derive_projection(frozen, [model]) == "not derived: no graph: grad is disabled (torch.no_grad)"


class Bare(nn.Module):
    """Q, K, V from a matmul with a bare ``nn.Parameter``: no ``nn.Linear`` or ``Conv1D`` anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, 3 * E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.w).chunk(3, -1)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_reasons_for_parts_no_projection_reaches() -> None:
    """Witness: a model with no projection module, and a K multiplied by 0 (its gradient is exactly zero).

    Catches the part named in lower case.
    """
    bare = Bare()
    assert dataflow.derive_projection(_seen(bare, _x(2, 5, E)), [bare]) == (
        "not derived: no nn.Linear or Conv1D weight of this module or its parents is consumed on the way back "
        "from Q (within 512 autograd nodes)")
    model = Packed()
    q, k, v = _seen(model, _x(2, 5, E))
    assert dataflow.derive_projection((q, k * 0, v), [model]) == (
        "not derived: no output feature of a projection reaches K with a non-zero gradient")


def test_a_grad_the_model_retains_is_put_back() -> None:
    """Witness: ``q.grad`` as PyTorch's own ``backward()`` left it (``retain_grad``), before the derivation.

    Catches the retained ``.grad`` cleared rather than restored.
    """
    model = Packed()
    q, k, v = _seen(model, _x(2, 5, E))
    q.retain_grad()
    F.scaled_dot_product_attention(q, k, v).square().sum().backward(retain_graph=True)
    before = q.grad.clone()
    assert _rows(dataflow.derive_projection((q, k, v), [model])) == _by_order((0, 1, 2))
    assert q.grad is not None and torch.equal(q.grad, before)


def test_the_graph_is_left_for_the_models_own_backward() -> None:
    """Witness: the gradients PyTorch gives an identical model whose call was not read.

    Q passes a product with a constant (rotary-style: the product saves it for backward); a probe
    that frees the graph's buffers would make the model's own ``backward()`` fail.
    """
    torch.manual_seed(0)
    model = Packed()
    twin = Packed()
    twin.load_state_dict(model.state_dict())
    x, cos = _x(2, 5, E), torch.linspace(0.5, 1.5, E)
    losses = []
    for m, read in ((model, True), (twin, False)):
        q, k, v = _seen(m, x)
        q = q * cos
        if read:
            assert _rows(dataflow.derive_projection((q, k, v), [m])) == _by_order((0, 1, 2))
        losses.append(F.scaled_dot_product_attention(q, k, v).square().sum())
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


# -- which weights, which names -------------------------------------------------------------------------


class Latent(nn.Module):
    """Latent attention: K is a rotary feature straight from ``kv_a`` joined to per-head features from
    ``kv_b``, which reads ``kv_a``'s other (compressed) features; V is ``kv_b``'s other features.

    ``kv_a``: rows ``[0, 8)`` compressed, row 8 rotary. ``kv_b``: rows ``[0, 2)`` K, ``[2, 5)`` V.
    """

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(E, 3)
        self.kv_a = nn.Linear(E, 9)
        self.kv_b = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.kv_a(x)
        b = self.kv_b(a[..., :8])
        q, k, v = self.q(x), torch.cat([a[..., 8:9], b[..., :2]], -1), b[..., 2:5]
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_part_made_of_two_weights_names_each_with_only_its_direct_rows() -> None:
    """Witness: rows by construction (class docstring): K's own weight is ``kv_b`` (2 rows), beside it
    ``kv_a``'s rotary row 8 only -- its compressed rows reach K only through ``kv_b``.

    Catches the gradient not stopped at ``kv_b`` while ``kv_a`` is probed (``kv_a`` credited with rows
    0-8 and taken for K's own weight), the search ending at the first weight found, the weights ordered
    other than by how many rows each gives, and the second weight left out.
    """
    model = Latent()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection)
    k = found.spec.k
    assert (k.param, k.rows) == ("kv_b.weight", ((0, 2),))
    assert [(p.param, p.rows, p.bias_param, p.bias_rows) for p in k.also] == [
        ("kv_a.weight", ((8, 9),), "kv_a.bias", ((8, 9),))]
    assert (found.spec.v.param, found.spec.v.rows, found.spec.v.also) == ("kv_b.weight", ((2, 5),), ())
    assert (found.spec.q.param, found.spec.q.rows, found.spec.q.also) == ("q.weight", ((0, 3),), ())


class LowRank(nn.Module):
    """Q through a low-rank pair ``q_a -> q_b``; K, V the halves of ``kv``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a, self.q_b, self.kv = nn.Linear(E, 4), nn.Linear(4, E), nn.Linear(E, 2 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b(self.q_a(x))
        k, v = self.kv(x).chunk(2, -1)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def _behind(before: str, name: str) -> str:
    return (f"{dataflow.EVIDENCE} (the nearest projection: {before} feeds {name} and is named only for rows that "
            "reach this part without passing another projection)")


def test_a_projection_behind_the_nearest_is_said_in_the_evidence() -> None:
    """Witness: the model's own wiring: ``q_a`` feeds ``q_b``, which gives Q all its rows; nothing feeds ``kv``.

    Catches the projection behind not found, found as the nearest itself, named by its type or
    ``None``, or said in place of the evidence rather than after it; and a note for a part with
    nothing behind.
    """
    model = LowRank()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection)
    assert (found.spec.q.param, found.spec.q.rows) == ("q_b.weight", ((0, E),))
    assert found.spec.q.evidence == _behind("q_a", "q_b")
    assert (found.spec.k.param, found.spec.k.rows, found.spec.k.evidence) == ("kv.weight", ((0, E),), dataflow.EVIDENCE)


class Twice(nn.Module):
    """Q is ``q`` applied twice (one weight, two matmuls); K, V from their own Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(self.q(x)), self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_weight_applied_twice_is_not_behind_itself() -> None:
    """Witness: the only projection behind Q's nearest matmul is the same weight: no other to name.

    Catches the weight named as the projection behind itself.
    """
    model = Twice()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection)
    assert (found.spec.q.param, found.spec.q.rows, found.spec.q.evidence) == ("q.weight", ((0, E),), dataflow.EVIDENCE)


class Fed(nn.Module):
    """A parent whose ``down`` feeds the attention module ``attn`` (which holds Q, K, V's own Linears)."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.attn = nn.Linear(E, E), Separate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.down(x))


def test_the_holder_is_the_innermost_module_holding_the_weights() -> None:
    """Witness: ``attn`` holds ``q``, ``k``, ``v``; its parent is among ``holders`` too; the projection
    behind them (``down``) is the parent's, outside ``attn``, so it is named by its type.

    Catches the outermost holder taken, and a projection outside the holder named ``None`` or ``NoneType``.
    """
    model = Fed()
    model(_x(2, 5, E))
    found = dataflow.derive_projection(model.attn.seen, [model.attn, model])
    assert isinstance(found, qkvtrace.facts.slices.Projection) and found.holder is model.attn
    assert [p.param for _, p in found.spec.parts()] == ["q.weight", "k.weight", "v.weight"]
    assert found.spec.q.evidence == _behind("Linear", "q")


class SelfProjecting(nn.Linear):
    """Attention that is its own packed projection (an ``nn.Linear`` subclass), fed by its child ``down``."""

    def __init__(self) -> None:
        super().__init__(E, 3 * E)
        self.down = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = super().forward(self.down(x)).chunk(3, -1)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_holder_that_is_the_projection_names_its_own_weight() -> None:
    """Witness: the module's own ``weight`` and ``bias`` (no prefix: it is the holder), thirds by
    construction, and its child ``down`` feeding "it".

    Catches a prefix on an empty name, and the holder's name in the evidence taken for a word.
    """
    model = SelfProjecting()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection)
    assert [(p.param, p.rows, p.bias_param) for _, p in found.spec.parts()] == [
        ("weight", _third(j), "bias") for j in range(3)]
    assert found.spec.q.evidence == _behind("down", "it")


def test_a_projection_without_bias_has_no_bias_rows() -> None:
    """Witness: ``nn.Linear(bias=False)``: no bias parameter, so no bias rows.

    Catches bias rows named for a weight with no bias.
    """
    model = Packed(bias=False)
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection)
    assert [(p.rows, p.bias_param, p.bias_rows) for _, p in found.spec.parts()] == [
        (_third(j), None, ()) for j in range(3)]


class FlatViews(nn.Module):
    """Three Linears whose weights are views of one flat parameter, made in the forward (FSDP's unsharded
    parameters: each weight has a ``grad_fn`` of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Parameter(torch.randn(3 * E * E))
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        for m in (self.q, self.k, self.v):
            del m.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, m in enumerate((self.q, self.k, self.v)):
            m.weight = self.flat[i * E * E:(i + 1) * E * E].view(E, E)
        q, k, v = self.q(x), self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_weights_that_are_views_are_found() -> None:
    """Witness: ``q``, ``k``, ``v`` each give all ``E`` rows of their own weight (a view of ``flat``).

    Catches weights found only as leaves (``AccumulateGrad``), not by their own ``grad_fn``.
    """
    model = FlatViews()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection), found
    assert [(p.param, p.rows) for _, p in found.spec.parts()] == [(f"{n}.weight", ((0, E),)) for n in "qkv"]


class Transposed(nn.Module):
    """Q computed as ``q.weight @ xᵀ`` (output features first), then transposed back."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.q.weight @ x.T).T, self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_matmul_with_features_first_is_not_read() -> None:
    """Witness: the matmul's output is ``[E, L]`` with ``L = 5 != E``: its columns are tokens, not features.

    Catches the check on the last dimension skipped, and the weight's name left out of the reason.
    """
    model = Transposed()
    assert dataflow.derive_projection(_seen(model, _x(5, E)), [model]) == (
        "not derived: the matmul MmBackward0 that consumes q.weight does not give one column per output feature")


class OneToken(nn.Module):
    """One unbatched token: ``down`` feeds Q, computed as a matrix-vector product ``q.weight @ h``."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        q, k, v = (self.q.weight @ h).unsqueeze(0), self.k(h).unsqueeze(0), self.v(h).unsqueeze(0)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_matrix_vector_projection_is_read() -> None:
    """Witness: all ``E`` rows of ``q.weight`` make Q; ``down`` feeds ``q`` (the model's wiring).

    The matmul's output is 1-D; its weight is its first input. Catches a 1-D output refused or indexed
    past its one dimension, and the search for a projection behind stopping at the weight input.
    """
    model = OneToken()
    found = dataflow.derive_projection(_seen(model, _x(E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection), found
    assert (found.spec.q.param, found.spec.q.rows, found.spec.q.evidence) == (
        "q.weight", ((0, E),), _behind("down", "q"))


class Biased(nn.Module):
    """Q is a learned term ``x @ rel`` (a bare parameter: a matmul that is no projection) plus ``q(x)``;
    ``q`` is applied to the input twice (the two terms meet again below)."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(E, E))
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.q(x)
        q, k, v = x @ self.rel + a + a * 2, self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_the_search_goes_past_other_matmuls_and_reads_each_node_once() -> None:
    """Witness: Q's only projection is ``q`` (all ``E`` rows), reached after the ``x @ rel`` matmul and
    by two paths (``a`` and ``a * 2``).

    Catches the search ending at a matmul that consumes no projection weight, and a node reached twice
    read twice (``q`` then named beside itself).
    """
    model = Biased()
    found = dataflow.derive_projection(_seen(model, _x(5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection), found
    assert (found.spec.q.param, found.spec.q.rows, found.spec.q.also) == ("q.weight", ((0, E),), ())


class Embedded(nn.Module):
    """Token ids embedded (an ``nn.Embedding``: a 2-D weight, no projection) and fed to ``Packed``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn = nn.Embedding(11, E), Packed()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.attn(self.emb(ids))


def test_other_modules_with_two_dimensional_weights_are_passed_over() -> None:
    """Witness: rows by construction in ``attn.qkv``, under a parent holding an ``nn.Embedding``.

    Catches a module without ``nf`` that is not an ``nn.Linear`` breaking the search for projections.
    """
    model = Embedded()
    model(torch.arange(10).view(2, 5))
    found = dataflow.derive_projection(model.attn.seen, [model.attn, model])
    assert _rows(found) == _by_order((0, 1, 2))


class OutIn(nn.Module):
    """A module with an ``nf`` attribute but an ``[out, in]`` weight applied by ``F.linear``: not ``Conv1D``."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nf, nx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class OutInAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = OutIn(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_an_nf_module_whose_weight_is_not_in_out_is_no_projection() -> None:
    """Witness: ``weight.shape[1]`` is ``E``, not ``nf = 3E``: by the module's own attributes this is not a
    ``Conv1D`` ``[in, out]`` weight, and it is no ``nn.Linear``.

    Catches a module taken for ``Conv1D`` on having an integer ``nf`` alone.
    """
    model = OutInAttention()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, str) and found.startswith("not derived: no nn.Linear or Conv1D weight"), found


class Flipped(nn.Module):
    """The packed Linear applied with its rows reversed (``weight.flip(0)``): output feature ``j`` is row
    ``3E-1-j``, so Q (the first third of the output) is made of rows ``[2E, 3E)``, V of ``[0, E)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.qkv.weight.flip(0), self.qkv.bias.flip(0)).chunk(3, -1)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_weight_reordered_before_its_matmul_is_never_named_with_the_matmuls_rows() -> None:
    """Witness: rows by construction through the flip (class docstring).

    Only transposes and casts may stand between a weight and its matmul; a reordering op would make the
    matmul's output feature ``j`` some other row of the weight. Catches the walk to the weight going
    through any single-input node (Q would then be named rows ``[0, E)``).
    """
    model = Flipped()
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, str) or _rows(found) == (_third(2), _third(1), _third(0)), found


@pytest.mark.parametrize(("steps", "derived"), [(509, True), (510, False)])
def test_the_search_stops_at_its_bound(steps: int, derived: bool) -> None:
    """Witness: Q is the first third of a packed Linear, then ``steps`` additions (one autograd node each):
    the Linear's matmul is node ``steps + 2`` counting from Q's own. The reason gives the bound, 512
    nodes: the walk stops once it has seen 512, so the matmul is read as node 511 and not as node 512.

    Catches the bound moved by one.
    """
    model = Packed()
    q, k, v = _seen(model, _x(5, E))
    for _ in range(steps):
        q = q + 1
    found = dataflow.derive_projection((q, k, v), [model])
    if derived:
        assert _rows(found) == _by_order((0, 1, 2))
    else:
        assert found == ("not derived: no nn.Linear or Conv1D weight of this module or its parents is consumed on "
                         "the way back from Q (within 512 autograd nodes)")  # fmt: skip


class Tied(nn.Module):
    """Q and K projected by one weight held by two Linears (``k.weight`` is ``q.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E, bias=False), nn.Linear(E, E, bias=False), nn.Linear(E, E, bias=False)
        self.k.weight = self.q.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        self.seen = (q, k, v)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_shared_weight_is_named_as_pytorch_names_it() -> None:
    """Witness: ``named_parameters()``, which names a parameter shared by two modules once, by the first.

    Catches the shared weight named by the last module holding it.
    """
    model = Tied()
    name = {id(p): n for n, p in model.named_parameters()}
    found = dataflow.derive_projection(_seen(model, _x(2, 5, E)), [model])
    assert isinstance(found, qkvtrace.facts.slices.Projection), found
    assert [p.param for _, p in found.spec.parts()] == [name[id(model.q.weight)], name[id(model.q.weight)],
                                                       name[id(model.v.weight)]]  # fmt: skip
    assert name[id(model.k.weight)] == "q.weight"  # the witness itself: PyTorch names it by ``q``
