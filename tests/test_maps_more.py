"""Attention maps at their edges: the options' checks, the bounds at their exact limits, the refusal messages word
for word, heads and batch items picked out of per-head masks, the masks and biases each source takes (MHA's
biases and 3-D masks, a direct ``F.multi_head_attention_forward`` with separate projections, the fused encoder
layer's first norm and masks, attention written by hand), and the reasons given where no map can be made.

Each map is checked against PyTorch itself (``nn.MultiheadAttention``'s own ``need_weights=True,
average_attn_weights=False`` weights, the weights ``F.multi_head_attention_forward`` returns, the probabilities a
model written here computed) or against a float64 softmax written here on Q and K projected here; sizes and
messages are computed here from the shapes built here. The sources of qkvtrace/facts/maps.py are called directly only
where the public API cannot hand them an input (said in each such test).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _witness import sdpa_refusal_of_mask_with_causal
from torch import nn

import qkvtrace
from qkvtrace.facts import maps

B, L, E, H = 2, 5, 16, 4
D = E // H
TOL = {"rtol": 0.0, "atol": 4e-7}  # a float32 map against a float64 or float32 witness, weights in [0, 1]
NESTED_NOTE = (
    "nested input: positions past each sequence's length are padding PyTorch removed; their rows and columns "
    "are 0 (listed in fully_masked)"
)
OWN_SOFTMAX = "the weights the model's own softmax computed"


class SDPAModule(nn.Module):
    """A user's attention that calls SDPA with whatever it is given."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _softmax64(q: torch.Tensor, k: torch.Tensor, *, blocked: torch.Tensor | None = None,
               additive: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:  # fmt: skip
    """softmax(q·kᵀ/√d + additive) in float64 with ``blocked`` (True = removed) and the causal triangle at -inf;
    rows with every key removed are set to 0 here."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if additive is not None:
        s = s + additive.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if blocked is not None:
        s = s.masked_fill(blocked, -math.inf)
    w = torch.softmax(s, dim=-1)
    return w.nan_to_num(0.0)


def _heads(t: torch.Tensor, heads: int = H) -> torch.Tensor:
    """``[B, T, E]`` -> ``[B, heads, T, E / heads]``, written here."""
    b, t_len, e = t.shape
    return t.reshape(b, t_len, heads, e // heads).transpose(1, 2)


def _budget(**options: Any) -> maps.MapBudget:
    return maps.MapBudget(maps.MapOptions(**options))


def _mha(**kwargs: Any) -> nn.MultiheadAttention:
    """A MultiheadAttention whose in_proj_bias is random (PyTorch initialises it to zeros)."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, **kwargs).eval()
    if mha.in_proj_bias is not None:
        with torch.no_grad():
            mha.in_proj_bias.copy_(torch.randn(3 * E))
    return mha


# -- the options -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"max_map_tokens": True}, "max_map_tokens must be a positive int, got True"),
        ({"max_map_tokens": 0}, "max_map_tokens must be a positive int, got 0"),
        ({"max_map_tokens": 2.0}, "max_map_tokens must be a positive int, got 2.0"),
        ({"max_map_mb": True}, "max_map_mb must be a positive number, got True"),
        ({"max_map_mb": 0}, "max_map_mb must be a positive number, got 0"),
        ({"max_map_mb": "1"}, "max_map_mb must be a positive number, got '1'"),
        ({"heads": [-1]}, "heads must be None, an index or a list of indices >= 0, got [-1]"),
        ({"heads": []}, "heads must be None, an index or a list of indices >= 0, got []"),
        ({"heads": [1, True]}, "heads must be None, an index or a list of indices >= 0, got [1, True]"),
        ({"batch_index": "0"}, "batch_index must be None, an index or a list of indices >= 0, got '0'"),
        ({"batch_index": -2}, "batch_index must be None, an index or a list of indices >= 0, got -2"),
    ],
)
def test_bad_options_are_refused_with_the_value_given(option: dict[str, Any], message: str) -> None:
    """Witness: the invalid value written here, quoted back with repr() in the message written here."""
    with pytest.raises(ValueError) as raised:
        qkvtrace.trace(nn.Linear(2, 2), attention_maps=True, **option)
    assert str(raised.value) == message


def test_the_smallest_bounds_and_index_zero_are_accepted() -> None:
    """max_map_tokens=1 and a max_map_mb of one float admit a 1 x 1 map; head 0 and batch item 0 are valid
    indices; a repeated index is kept once. Witness: the one-key call built here, whose only weight is 1 by
    construction (softmax of one score), and the 4 bytes of one float32 written here as the bound."""
    model = SDPAModule()
    q = torch.randn(2, 3, 1, 4)
    with qkvtrace.trace(model, attention_maps=True, max_map_tokens=1, max_map_mb=4 / 2**20, heads=[0, 0],
                        batch_index=0) as t, torch.no_grad():  # fmt: skip
        model(q, q, q)
    (c,) = t.calls
    assert c.attention_map_reason is None
    assert c.attention_map_heads == [0] and c.attention_map_batch == [0]
    assert torch.equal(c.attention_map, torch.ones(1, 1, 1, 1))
    assert torch.equal(c.attention_map_fully_masked, torch.zeros(1, 1, 1, dtype=torch.bool))


def test_options_made_from_none_take_the_documented_defaults() -> None:
    """Witness: the defaults written in qkvtrace/base/limits.py's names, which the docs quote (MapOptions.make called
    directly: the trace passes None for an option not given)."""
    from qkvtrace.base.limits import DEFAULT_MAX_MAP_MB, DEFAULT_MAX_MAP_TOKENS

    made = maps.MapOptions.make(None, None, None, None)
    assert made == maps.MapOptions(DEFAULT_MAX_MAP_TOKENS, float(DEFAULT_MAX_MAP_MB), None, None)
    made = maps.MapOptions.make(7, 2, 3, [1, 0, 1])
    assert made == maps.MapOptions(7, 2.0, (3,), (1, 0))
    assert isinstance(made.max_map_mb, float)


# -- what is asked for against what the call has ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        ({"heads": [4]}, f"heads [4] asked for, but the call has {H} heads"),
        ({"heads": [3, 5, 4]}, f"heads [5, 4] asked for, but the call has {H} heads"),
        ({"batch_index": [2, 0]}, f"batch items [2] asked for, but the call has {B} batch items"),
        ({"batch_index": 2, "heads": 9}, f"batch items [2] asked for, but the call has {B} batch items"),
    ],
)
def test_an_index_past_the_call_is_named_in_the_reason(option: dict[str, Any], reason: str) -> None:
    """Witness: the indices asked for here against the B=2 items and H=4 heads of the Q, K, V built here (the
    first index past the end is the count itself)."""
    model = SDPAModule()
    q = torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True, **option) as t, torch.no_grad():
        model(q, q, q)
    (c,) = t.calls
    assert c.attention_map is None and c.attention_map_reason == reason


# -- the bounds, exactly ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lq", "lk", "floats", "size"),
    [
        (3, 4, "12", "0.0 KB"),  # 48 bytes
        (100, 250, "25,000", "97.7 KB"),  # 100,000 bytes: 97.66 KiB, just under a tenth of a MiB
        (160, 250, "40,000", "0.2 MB"),  # 160,000 bytes: 0.153 MiB
        (512, 1024, "524,288", "2.0 MB"),  # 2 MiB
    ],
)
def test_the_token_bound_refusal_says_the_size_in_words(lq: int, lk: int, floats: str, size: str) -> None:
    """Witness: the sizes computed here by hand for a [1, 1, lq, lk] float32 map (4 bytes a float; KB below a
    tenth of a MiB, MB from there), with max_map_tokens one under the longer side."""
    model = SDPAModule()
    q, k = torch.randn(1, 1, lq, 2), torch.randn(1, 1, lk, 2)
    bound = max(lq, lk) - 1
    with qkvtrace.trace(model, attention_maps=True, max_map_tokens=bound) as t, torch.no_grad():
        model(q, k, k)
    (c,) = t.calls
    assert c.attention_map is None
    assert c.attention_map_reason == (
        f"not computed: T_query={lq}, T_key={lk} is over max_map_tokens={bound} (a map of B·H·T_q·T_k = "
        f"1x1x{lq}x{lk} = {floats} floats, {size}); ask for fewer tokens, heads= or batch_index=, or raise "
        "max_map_tokens"
    )


def test_a_map_exactly_at_the_token_bound_is_made() -> None:
    """Witness: T_query = T_key = max_map_tokens = 5, set here, and the float64 softmax written here."""
    model = SDPAModule()
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True, max_map_tokens=L) as t, torch.no_grad():
        model(q, k, k)
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, _softmax64(q, k).float(), **TOL)


def test_the_memory_bound_admits_up_to_it_and_refuses_past_it() -> None:
    """Three maps of 2x4x5x5 floats (800 bytes each) against a bound of exactly two of them: the second brings
    the total to the bound and is made, the third is refused with the total it would reach. Witness: the sizes
    computed here (800 bytes, 1,600 = the bound, 2,400 bytes = 2.3 KB) and max_map_mb = 1600 / 2**20 written
    here (0.00152588 with :g)."""
    model = SDPAModule()
    q = torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True, max_map_mb=1600 / 2**20) as t, torch.no_grad():
        for _ in range(3):
            model(q, q, q)
    first, second, third = t.calls
    assert first.attention_map is not None and second.attention_map is not None
    assert third.attention_map is None
    assert third.attention_map_reason == (
        "not computed: this map (2x4x5x5 = 200 floats, 0.8 KB) would bring the trace's maps to 2.3 KB, over "
        "max_map_mb=0.00152588; ask for heads= or batch_index=, or raise max_map_mb"
    )


def test_maps_bytes_are_four_per_weight() -> None:
    """Witness: B·H·T_q·T_k·4 multiplied out here (map_bytes called directly: the public API shows it only inside
    a message)."""
    assert maps.map_bytes(2, 3, 5, 7) == 2 * 3 * 5 * 7 * 4


# -- heads and batch items picked out of per-head masks ----------------------------------------------------------


SELECTIONS = [({"heads": [3, 1]}, [0, 1], [3, 1]), ({"batch_index": [1]}, [1], [0, 1, 2, 3]),
              ({"heads": [2], "batch_index": [1, 0]}, [1, 0], [2])]  # fmt: skip


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(("option", "items", "heads"), SELECTIONS)
def test_selected_heads_and_items_read_their_own_slice_of_a_per_head_mask(
    kind: str, option: dict[str, Any], items: list[int], heads: list[int]
) -> None:
    """A mask that differs per batch item and per head: the map of the asked items and heads reads their slice
    of it. Witness: the float64 softmax written here on the full Q, K and mask, cut here to the asked items and
    heads; the fully-masked rows are the rows of the mask built here that attend to nothing."""
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    attend = torch.rand(B, H, L, L) > 0.4
    attend[..., 0] = True
    attend[1, 2, 3] = False  # item 1, head 2, query 3: attends to nothing
    attend[0, 1, 4] = False
    attend[1, 3, 0] = False
    mask = attend if kind == "bool" else torch.randn(B, H, L, L).masked_fill(~attend, -math.inf)
    model = SDPAModule()
    with qkvtrace.trace(model, attention_maps=True, **option) as t, torch.no_grad():
        model(q, k, k, attn_mask=mask)
    (c,) = t.calls
    assert c.attention_map_batch == items and c.attention_map_heads == heads
    want = _softmax64(q, k, blocked=~attend) if kind == "bool" else _softmax64(q, k, additive=mask)
    idx_b, idx_h = torch.tensor(items), torch.tensor(heads)
    want = want.index_select(0, idx_b).index_select(1, idx_h)
    torch.testing.assert_close(c.attention_map, want.float(), **TOL)
    full = (~attend).all(-1).index_select(0, idx_b).index_select(1, idx_h)
    assert torch.equal(c.attention_map_fully_masked, full)


def test_every_batch_item_asked_in_another_order_comes_in_that_order() -> None:
    """batch_index=[1, 0] names every item of a 2-item call: the map's first item is item 1, as its
    attention_map_batch says (the SDPA map had kept PyTorch's order while saying [1, 0]). Witness: the float64
    softmax written here on the Q and K built here, items taken here in the order asked."""
    model = SDPAModule()
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True, batch_index=[1, 0]) as t, torch.no_grad():
        model(q, k, k)
    (c,) = t.calls
    assert c.attention_map_batch == [1, 0]
    torch.testing.assert_close(c.attention_map, _softmax64(q, k)[[1, 0]].float(), **TOL)


def test_an_unmasked_call_flags_no_row_and_has_no_notes() -> None:
    """Witness: the [B, H, T_q] shape of the call built here (no mask, so no row is fully masked), and its
    float32 inputs and dropout_p=0.0 given here (nothing to note)."""
    model = SDPAModule()
    q = torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, q, q, dropout_p=0.0)
    (c,) = t.calls
    assert torch.equal(c.attention_map_fully_masked, torch.zeros(B, H, L, dtype=torch.bool))
    assert c.attention_map_notes is None


def test_a_causal_call_flags_no_row() -> None:
    """Witness: the causal float64 softmax written here (every row keeps key 0) and the [B, H, T_q] shape."""
    model = SDPAModule()
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, k, k, is_causal=True)
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, _softmax64(q, k, causal=True).float(), **TOL)
    assert torch.equal(c.attention_map_fully_masked, torch.zeros(B, H, L, dtype=torch.bool))


def test_a_boolean_mask_with_is_causal_removes_the_keys_of_both() -> None:
    """PyTorch's CPU kernel takes attn_mask and is_causal=True together and removes the keys of both. Witness: the
    float64 softmax written here with the union of the mask built here and the causal triangle, checked here
    against the call's own output (that softmax times V) before the map is compared with it. Where the installed
    PyTorch refuses the two together (2.14 on), the traced call raises PyTorch's own error, unchanged, and its
    record says it."""
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    attend = torch.rand(B, H, L, L) > 0.3
    attend[..., 0] = True
    model = SDPAModule()
    refused = sdpa_refusal_of_mask_with_causal()
    if refused is not None:
        with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad(), pytest.raises(RuntimeError) as err:
            model(q, k, v, attn_mask=attend, is_causal=True)
        assert str(err.value) == refused
        (c,) = t.calls
        assert c.error == f"RuntimeError: {refused}" and c.attention_map is None
        return
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        out = model(q, k, v, attn_mask=attend, is_causal=True)
    want = _softmax64(q, k, blocked=~attend, causal=True)
    torch.testing.assert_close(out.double(), want @ v.double(), rtol=0, atol=1e-6)  # the kernel removed both
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, want.float(), **TOL)
    assert torch.equal(c.attention_map_fully_masked, torch.zeros(B, H, L, dtype=torch.bool))


# -- direct SDPA: the shapes maps take, and why others have none ------------------------------------------------


def test_a_two_dimensional_sdpa_call_has_a_one_by_one_map() -> None:
    """Witness: the float64 softmax written here on the [T, d] query and key built here."""
    model = SDPAModule()
    q, k = torch.randn(L, D), torch.randn(L + 2, D)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, k, k)
    (c,) = t.calls
    assert c.attention_map.shape == (1, 1, L, L + 2)
    torch.testing.assert_close(c.attention_map[0, 0], _softmax64(q, k).float(), **TOL)


def test_a_five_dimensional_sdpa_call_says_why_it_has_no_map() -> None:
    """Witness: the 5-dim query built here."""
    model = SDPAModule()
    q = torch.randn(1, B, H, L, D)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(q, q, q)
    (c,) = t.calls
    assert c.attention_map is None
    assert c.attention_map_reason == "not computed: query of 5 dims (maps are made for 2 to 4: [B, H, T, d])"


class _NoMaterialise:
    """An attn_mask subclass stand-in with no ``_materialize``."""


class _Unusable:
    _materialize = 3


class _FloatBias:
    def _materialize(self, device: Any = None) -> torch.Tensor:
        return torch.zeros(L, L)


class _BoolBias:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def _materialize(self, device: Any = None) -> torch.Tensor:
        self.seen.append(device)
        return torch.ones(L, L, dtype=torch.bool).tril()


def _sdpa_source(q: Any, k: Any, mask: Any = None, *, gqa: bool = False, override: bool = False) -> maps.SDPASource:
    return maps.SDPASource(q, k, mask, False, None, gqa, 0.0, override)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (lambda: _sdpa_source(torch.randn(B, H, L, D), None), "query or key is not a tensor"),
        (lambda: _sdpa_source(None, torch.randn(B, H, L, D)), "query or key is not a tensor"),
        (lambda: _sdpa_source(torch.nested.nested_tensor([torch.randn(H, 2, D), torch.randn(H, 3, D)]),
                              torch.randn(B, H, L, D)),
         "not computed: nested-tensor query or key (ragged lengths)"),
        (lambda: _sdpa_source(torch.randn(B, H, L, D),
                              torch.nested.nested_tensor([torch.randn(H, 2, D), torch.randn(H, 3, D)])),
         "not computed: nested-tensor query or key (ragged lengths)"),
        (lambda: _sdpa_source(torch.randn(H, L, D), torch.randn(B, H, L, D)),
         "not computed: query of 3 dims (maps are made for 2 to 4: [B, H, T, d])"),
        (lambda: _sdpa_source(torch.randn(D), torch.randn(D)),
         "not computed: query of 1 dims (maps are made for 2 to 4: [B, H, T, d])"),
        (lambda: _sdpa_source(torch.randn(B, 4, L, D), torch.randn(B, 2, L, D)),
         "query [2, 4, 5, 4] and key [2, 2, 5, 4] do not pair without enable_gqa"),
        (lambda: _sdpa_source(torch.randn(B, H, L, D), torch.randn(3, H, L, D), gqa=True),
         "query [2, 4, 5, 4] and key [3, 4, 5, 4] do not pair without enable_gqa"),
        (lambda: _sdpa_source(torch.randn(B, 4, L, D), torch.randn(B, 3, L, D), gqa=True),
         "4 query heads cannot share 3 key heads"),
        (lambda: _sdpa_source(torch.randn(B, H, L, D), torch.randn(B, H, L, D), _NoMaterialise(), override=True),
         "not computed: attn_mask is a _NoMaterialise that cannot be materialised"),
        (lambda: _sdpa_source(torch.randn(B, H, L, D), torch.randn(B, H, L, D), _Unusable(), override=True),
         "not computed: attn_mask is a _Unusable that cannot be materialised"),
        (lambda: _sdpa_source(torch.randn(B, H, L, D), torch.randn(B, H, L, D), _FloatBias(), override=True),
         "not computed: _FloatBias did not materialise as a boolean mask"),
    ],
)  # fmt: skip
def test_sdpa_inputs_without_a_map_say_why(source: Any, reason: str) -> None:
    """Inputs PyTorch itself refuses or the tracer never hands over (a ragged query beside a dense key, query
    and key of other ranks or head counts, mask objects that do not materialise): SDPASource called directly.
    Witness: the shapes and objects built here, named in the reason written here."""
    result = source().compute(_budget(), "attn")
    assert result.weights is None and result.reason == reason


def test_an_override_mask_is_materialised_on_the_query_device() -> None:
    """Witness: the device of the query built here, as the mask object written here received it, and the float64
    softmax written here with that object's lower-triangle mask (SDPASource called directly, with a mask object
    that records its argument)."""
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    bias = _BoolBias()
    result = _sdpa_source(q, k, bias, override=True).compute(_budget(), "attn")
    assert bias.seen == [q.device]
    attend = torch.ones(L, L, dtype=torch.bool).tril()
    torch.testing.assert_close(result.weights, _softmax64(q, k, blocked=~attend).float(), **TOL)


# -- MultiheadAttention: biases, 3-D masks, dropout, the causal path ---------------------------------------------


def _mha_witness(mha: nn.MultiheadAttention, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return mha(x, x, x, need_weights=True, average_attn_weights=False, **kwargs)[1]


def test_fast_path_map_reads_the_query_bias() -> None:
    """Witness: nn.MultiheadAttention's own weights for the same input with a random in_proj_bias set here;
    dropout=0.1 on an eval module: nothing drops, nothing to note."""
    mha = _mha(dropout=0.1)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        mha(x, x, x, need_weights=False)
    (c,) = t.calls
    assert c.path == "fast"
    torch.testing.assert_close(c.attention_map, _mha_witness(mha, x), **TOL)
    assert c.attention_map_notes is None


def test_a_three_dimensional_attn_mask_is_read_per_batch_item_and_head() -> None:
    """Witness: nn.MultiheadAttention's own weights for the same call with the [B·H, T, T] float mask built
    here."""
    mha = _mha()
    x = torch.randn(B, L, E)
    attn = torch.randn(B * H, L, L)
    attn[3, 2, 1:] = -math.inf
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        _, w = mha(x, x, x, attn_mask=attn, need_weights=True, average_attn_weights=False)
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, w, **TOL)


def test_a_nested_mha_query_says_why_it_has_no_map() -> None:
    """Witness: the nested (ragged) query built here, which the fast path takes."""
    mha = _mha()
    x = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    with qkvtrace.trace(mha, attention_maps=True) as t, torch.no_grad():
        mha(x, x, x, need_weights=False)
    (c,) = t.calls
    assert c.path == "fast" and c.attention_map is None
    assert c.attention_map_reason == "not computed: nested-tensor query or key (ragged lengths)"


def test_the_causal_mha_source_applies_the_triangle() -> None:
    """PyTorch's fallback hands SDPA is_causal=True instead of the mask; that call's own SDPA inputs are used by
    the trace, so mha_source is called directly here with causal=True. Witness: the float64 causal softmax written
    here on Q and K projected here with the module's in_proj_weight and random in_proj_bias."""
    mha = _mha()
    x = torch.randn(B, L, E)
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    q, k = _heads(F.linear(x, w[:E], b[:E])), _heads(F.linear(x, w[E : 2 * E], b[E : 2 * E]))
    source = maps.mha_source(mha, x, x, None, None, batch_first=True, causal=True)
    result = source.compute(_budget(), "mha")
    torch.testing.assert_close(result.weights, _softmax64(q, k, causal=True).float(), **TOL)
    inputs = source.scores()
    assert isinstance(inputs, maps.ScoreInputs)
    assert inputs.causal is True and inputs.additive is None and inputs.blocked is None
    assert inputs.scale == pytest.approx(1 / math.sqrt(D), rel=1e-15)
    torch.testing.assert_close(inputs.q, q, rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs.k, k, rtol=0, atol=1e-6)


def test_mha_score_inputs_are_the_modules_projection_and_masks() -> None:
    """MHASource.scores (what attention health reads) called directly on a module's call with a padding mask.
    Witness: Q and K projected here with the module's in_proj_weight and in_proj_bias, the float padding mask
    built here, and softmax(scale·q·kᵀ + additive) of those inputs against nn.MultiheadAttention's own weights."""
    mha = _mha()
    x, y = torch.randn(B, L, E), torch.randn(B, L + 1, E)
    kpm = torch.zeros(B, L + 1)
    kpm[1, -2:] = -math.inf
    source = maps.mha_source(mha, x, y, kpm, None, batch_first=True, causal=False)
    inputs = source.scores()
    assert isinstance(inputs, maps.ScoreInputs)
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    torch.testing.assert_close(inputs.q, _heads(F.linear(x, w[:E], b[:E])), rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs.k, _heads(F.linear(y, w[E : 2 * E], b[E : 2 * E])), rtol=0, atol=1e-6)
    assert inputs.causal is False and inputs.blocked is None
    assert torch.equal(inputs.additive, kpm.reshape(B, 1, 1, L + 1))
    with torch.no_grad():
        _, want = mha(x, y, y, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    s = (inputs.q.double() @ inputs.k.double().transpose(-2, -1)) * inputs.scale + inputs.additive.double()
    torch.testing.assert_close(torch.softmax(s, -1).float(), want, **TOL)


_VECTOR = torch.randn(B, L, E)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (lambda: maps.MHASource(None, _VECTOR, True, H, torch.eye(E), torch.eye(E), None, None, None, None),
         "query or key is not a tensor"),
        (lambda: maps.MHASource(_VECTOR, None, True, H, torch.eye(E), torch.eye(E), None, None, None, None),
         "query or key is not a tensor"),
        (lambda: maps.MHASource(torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)]), _VECTOR, True, H,
                                torch.eye(E), torch.eye(E), None, None, None, None),
         "not computed: nested-tensor query or key (ragged lengths)"),
        (lambda: maps.MHASource(_VECTOR, torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)]), True, H,
                                torch.eye(E), torch.eye(E), None, None, None, None),
         "not computed: nested-tensor query or key (ragged lengths)"),
        (lambda: maps.MHASource(_VECTOR, _VECTOR, True, H, None, torch.eye(E), None, None, None, None),
         "the Q or K projection weight is not known for this call"),
        (lambda: maps.MHASource(_VECTOR, _VECTOR, True, H, torch.eye(E), None, None, None, None, None),
         "the Q or K projection weight is not known for this call"),
        (lambda: maps.MHASource(_VECTOR, _VECTOR, True, 3, torch.eye(E), torch.eye(E), None, None, None, None),
         f"embed_dim {E} is not divisible by num_heads 3"),
    ],
)  # fmt: skip
def test_mha_inputs_without_a_map_say_why(source: Any, reason: str) -> None:
    """Inputs nn.MultiheadAttention itself refuses or never passes on (a ragged query beside a dense key, a
    missing projection, an embedding its heads do not divide): MHASource called directly, both for a map and for
    the score inputs. Witness: the objects and sizes built here, named in the reason written here."""
    result = source().compute(_budget(), "mha")
    assert result.weights is None and result.reason == reason
    assert source().scores() == reason


# -- a direct F.multi_head_attention_forward ---------------------------------------------------------------------


class Direct(nn.Module):
    """A model that calls F.multi_head_attention_forward itself, with the options given."""

    def __init__(self, separate: bool = False, bias: bool = True, bias_kv: bool = False, zero_attn: bool = False,
                 dropout: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.separate, self.zero_attn, self.dropout = separate, zero_attn, dropout
        if separate:
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight = (
                nn.Parameter(torch.randn(E, E) / math.sqrt(E)) for _ in range(3)
            )
            self.in_proj_weight = None
        else:
            self.in_proj_weight = nn.Parameter(torch.randn(3 * E, E) / math.sqrt(E))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * E)) if bias else None
        self.bias_k = nn.Parameter(torch.randn(1, 1, E)) if bias_kv else None
        self.bias_v = nn.Parameter(torch.randn(1, 1, E)) if bias_kv else None
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> Any:
        extra = (
            {
                "use_separate_proj_weight": True,
                "q_proj_weight": self.q_proj_weight,
                "k_proj_weight": self.k_proj_weight,
                "v_proj_weight": self.v_proj_weight,
            }
            if self.separate
            else {}
        )
        return F.multi_head_attention_forward(
            x, x, x, E, H, self.in_proj_weight, self.in_proj_bias, self.bias_k, self.bias_v, self.zero_attn,
            self.dropout, self.out.weight, self.out.bias, training=self.training, need_weights=True,
            average_attn_weights=False, **extra, **kwargs,
        )  # fmt: skip


DIRECT_CASES = {
    "separate": {"separate": True},
    "separate_no_bias": {"separate": True, "bias": False},
    "no_bias": {"bias": False},
    "bias_kv": {"bias_kv": True},
    "zero_attn": {"zero_attn": True},
    "bias_kv_zero_attn": {"bias_kv": True, "zero_attn": True, "separate": True},
}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("case", list(DIRECT_CASES))
def test_direct_mha_forward_maps_equal_its_returned_weights(case: str, masked: bool) -> None:
    """Witness: the weights F.multi_head_attention_forward returns for the same call (need_weights=True,
    average_attn_weights=False), with the padding and float attention masks built here."""
    model = Direct(**DIRECT_CASES[case]).eval()
    x = torch.randn(L, B, E)
    kwargs: dict[str, Any] = {}
    if masked:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, -2:] = True
        kwargs = {"key_padding_mask": kpm, "attn_mask": torch.randn(L, L)}
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        _, w = model(x, **kwargs)
    (c,) = t.calls
    assert c.path == "fallback" and c.attention_map is not None, c.attention_map_reason
    torch.testing.assert_close(c.attention_map, w, **TOL)
    assert c.attention_map_notes is None
    if masked:
        assert (c.attention_map[1, :, :, L - 2 : L] == 0).all()


def test_direct_mha_forward_in_training_notes_its_dropout_only_then() -> None:
    """Witness: the same call with training=False (PyTorch drops nothing then) for the weights of both calls, and
    the dropout_p=0.3 given here for the note of the training call alone."""
    model = Direct(dropout=0.3)
    x = torch.randn(L, B, E)
    with qkvtrace.trace(model.eval(), attention_maps=True) as t, torch.no_grad():
        _, want = model(x)
    with qkvtrace.trace(model.train(), attention_maps=True) as t2, torch.no_grad():
        model(x)
    (evaluated,), (trained,) = t.calls, t2.calls
    torch.testing.assert_close(evaluated.attention_map, want, **TOL)
    torch.testing.assert_close(trained.attention_map, want, **TOL)
    assert evaluated.attention_map_notes is None
    assert trained.attention_map_notes == [
        "dropout_p=0.3: the kernel dropped weights at random; this is the weighting before dropout"
    ]


def _direct_args(**changes: Any) -> dict[str, Any]:
    model = Direct()
    a = {"query": torch.randn(L, B, E), "key": None, "num_heads": H, "in_proj_bias": model.in_proj_bias,
         "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
         "in_proj_weight": model.in_proj_weight, "bias_k": None, "add_zero_attn": False, "dropout_p": 0.0,
         "training": False}  # fmt: skip
    a["key"] = a["query"]
    a.update(changes)
    return a


def test_direct_mha_forward_sources_that_cannot_be_projected_say_why() -> None:
    """A call whose query is not a tensor or whose packed weight is missing (F.multi_head_attention_forward would
    raise on either, so function_source is called directly). Witness: the None arguments written here."""
    no_query = maps.function_source(_direct_args(query=None, key=None), None, None, False)
    assert no_query.compute(_budget(), "f").reason == "query or key is not a tensor"
    no_weight = maps.function_source(_direct_args(in_proj_weight=None), None, None, False)
    assert no_weight.compute(_budget(), "f").reason == "the Q or K projection weight is not known for this call"


def test_direct_mha_forward_causal_source_applies_the_triangle() -> None:
    """function_source called directly with causal=True (the trace reads such a call's own SDPA inputs instead).
    Witness: the float64 causal softmax written here on Q and K projected here with the weights passed."""
    a = _direct_args()
    x = a["query"].transpose(0, 1)
    w, b = a["in_proj_weight"].detach(), a["in_proj_bias"].detach()
    q, k = _heads(F.linear(x, w[:E], b[:E])), _heads(F.linear(x, w[E : 2 * E], b[E : 2 * E]))
    result = maps.function_source(a, None, None, True).compute(_budget(), "f")
    torch.testing.assert_close(result.weights, _softmax64(q, k, causal=True).float(), **TOL)
    inputs = maps.function_source(a, None, None, True).scores()  # what attention health reads
    assert isinstance(inputs, maps.ScoreInputs) and inputs.causal is True
    torch.testing.assert_close(inputs.q, q, rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs.k, k, rtol=0, atol=1e-6)


# -- the fused encoder layer ------------------------------------------------------------------------------------


def _layer(norm_first: bool) -> nn.TransformerEncoderLayer:
    """An encoder layer with random norm1 weight and bias, a random in_proj_bias and a large layer_norm_eps (so
    that each of them changes the map)."""
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, norm_first=norm_first,
                                       layer_norm_eps=0.5).eval()  # fmt: skip
    with torch.no_grad():
        layer.norm1.weight.copy_(torch.rand(E) + 0.5)
        layer.norm1.bias.copy_(torch.randn(E))
        layer.self_attn.in_proj_bias.copy_(torch.randn(3 * E))
    return layer


def test_fused_layer_map_reads_its_first_norm_and_qkv_bias() -> None:
    """Witness: the layer's own self_attn with need_weights=True, average_attn_weights=False on norm1(x) (the
    input the attention saw, norm1 applied here)."""
    layer = _layer(norm_first=True)
    x = torch.randn(B, L, E)
    with qkvtrace.trace(layer, attention_maps=True) as t, torch.inference_mode():
        layer(x)
    (c,) = t.calls
    assert c.path == "fused_encoder_layer"
    with torch.no_grad():
        a = layer.norm1(x)
        want = _mha_witness(layer.self_attn, a)
    torch.testing.assert_close(c.attention_map, want, **TOL)
    assert c.attention_map_notes is None


def test_nested_fused_layer_map_has_exactly_the_padding_note() -> None:
    """Witness: the padding mask built here (item 1 has 3 tokens), the layer's own self_attn weights on the padded
    input with that mask, and the note's text as docs/maps.md words it."""
    layer = _layer(norm_first=False)
    enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval()
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3:] = True
    with qkvtrace.trace(enc, attention_maps=True) as t, torch.inference_mode():
        enc(x, src_key_padding_mask=kpm)
    (c,) = t.calls
    assert c.attention_map_notes == [NESTED_NOTE]
    want = _mha_witness(enc.layers[0].self_attn, x, key_padding_mask=kpm)
    torch.testing.assert_close(c.attention_map[0], want[0], **TOL)
    torch.testing.assert_close(c.attention_map[1, :, :3], want[1, :, :3], **TOL)
    assert (c.attention_map[1, :, 3:] == 0).all()
    full = torch.zeros(B, H, L, dtype=torch.bool)
    full[1, :, 3:] = True
    assert torch.equal(c.attention_map_fully_masked, full)


def _layer_source(layer: nn.TransformerEncoderLayer, src: Any, mask: Any, mask_type: Any) -> maps.LayerSource:
    a = layer.self_attn
    return maps.LayerSource(src, H, a.in_proj_weight, a.in_proj_bias, layer.norm_first, layer.norm1.eps,
                            layer.norm1.weight, layer.norm1.bias, mask, mask_type)  # fmt: skip


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask_type", [0, 1, 2])
def test_a_boolean_mask_given_to_the_fused_builtin_blocks_where_true(mask_type: int, norm_first: bool) -> None:
    """nn.TransformerEncoderLayer always hands the builtin a float mask, so a boolean one (True = blocked, as
    MultiheadAttention reads it) is given to LayerSource directly. Witness: the layer's own self_attn with the
    same boolean mask as key_padding_mask (mask_type 1) or attn_mask (0 and 2), on norm1(x) applied here when
    norm_first."""
    layer = _layer(norm_first)
    x = torch.randn(B, L, E)
    if mask_type == 1:
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[1, 3:] = True
        kwargs = {"key_padding_mask": mask}
    else:
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        kwargs = {"attn_mask": mask}
    result = _layer_source(layer, x, mask, mask_type).compute(_budget(), "layer")
    with torch.no_grad():
        a = layer.norm1(x) if norm_first else x
        want = _mha_witness(layer.self_attn, a, **kwargs)
    torch.testing.assert_close(result.weights, want, **TOL)
    assert result.notes == []
    inputs = _layer_source(layer, x, mask, mask_type).scores()
    assert isinstance(inputs, maps.ScoreInputs)
    s = (inputs.q.double() @ inputs.k.double().transpose(-2, -1)) * inputs.scale + inputs.additive.double()
    torch.testing.assert_close(torch.softmax(s, -1).float(), want, **TOL)


def test_a_fused_layer_without_biases() -> None:
    """An encoder layer built with bias=False (its qkv_bias is None), given to LayerSource directly. Witness: the
    layer's own self_attn with need_weights=True on the same input, and Q and K projected here without a bias."""
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, bias=False).eval()
    x = torch.randn(B, L, E)
    source = maps.LayerSource(x, H, layer.self_attn.in_proj_weight, None, False, 1e-5, None, None, None, None)
    result = source.compute(_budget(), "layer")
    torch.testing.assert_close(result.weights, _mha_witness(layer.self_attn, x), **TOL)
    inputs = source.scores()
    assert isinstance(inputs, maps.ScoreInputs)
    w = layer.self_attn.in_proj_weight.detach()
    torch.testing.assert_close(inputs.q, _heads(F.linear(x, w[:E])), rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs.k, _heads(F.linear(x, w[E : 2 * E])), rtol=0, atol=1e-6)


def test_a_nested_src_with_a_padding_mask_of_its_own_keeps_both() -> None:
    """A nested src together with a key padding mask (LayerSource called directly: PyTorch's encoder passes no
    mask with nested input). Witness: the layer's own self_attn on the zero-padded input with the union of the
    given mask and the nested padding, built here; the padded rows are 0 and flagged."""
    layer = _layer(norm_first=False)
    parts = [torch.randn(L, E), torch.randn(3, E)]
    src = torch.nested.nested_tensor(parts)
    given = torch.zeros(B, L)
    given[0, 1] = -math.inf
    result = _layer_source(layer, src, given, 1).compute(_budget(), "layer")
    padded = torch.stack([parts[0], torch.cat([parts[1], torch.zeros(2, E)])])
    kpm = given.clone()
    kpm[1, 3:] = -math.inf
    want = _mha_witness(layer.self_attn, padded, key_padding_mask=kpm)
    torch.testing.assert_close(result.weights[0], want[0], **TOL)
    torch.testing.assert_close(result.weights[1, :, :3], want[1, :, :3], **TOL)
    assert (result.weights[1, :, 3:] == 0).all() and (result.weights[0, :, :, 1] == 0).all()
    assert result.notes == [NESTED_NOTE]


def test_fused_layer_score_inputs_and_reasons() -> None:
    """LayerSource.scores (what attention health reads) called directly. Witness: Q and K projected here from
    norm1(x) with the layer's in_proj_weight and in_proj_bias, and the src objects built here for the reasons."""
    layer = _layer(norm_first=True)
    x = torch.randn(B, L, E)
    inputs = _layer_source(layer, x, None, None).scores()
    assert isinstance(inputs, maps.ScoreInputs)
    w, b = layer.self_attn.in_proj_weight.detach(), layer.self_attn.in_proj_bias.detach()
    with torch.no_grad():
        a = layer.norm1(x)
    torch.testing.assert_close(inputs.q, _heads(F.linear(a, w[:E], b[:E])), rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs.k, _heads(F.linear(a, w[E : 2 * E], b[E : 2 * E])), rtol=0, atol=1e-6)
    assert inputs.additive is None and inputs.blocked is None and inputs.causal is False
    nested = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)])
    assert _layer_source(layer, nested, None, None).scores() == (
        "not computed: nested input (each sequence has its own length)"
    )
    assert _layer_source(layer, None, None, None).scores() == "src is not a tensor"
    assert _layer_source(layer, None, None, None).compute(_budget(), "layer").reason == "src is not a tensor"


# -- attention written by hand: the model's own probabilities ----------------------------------------------------


HB, HH, HT, HD = 2, 2, 5, 4  # H != T: a mask unsqueezed at the wrong place would not broadcast


class HandWritten(nn.Module):
    """Attention written by hand on [B, H, T, d], keeping its own probabilities (as output_attentions does)."""

    def __init__(self, mask: torch.Tensor | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(HH * HD, 3 * HH * HD)
        self.mask, self.drop = mask, nn.Dropout(dropout)
        self.probs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(HB, HT, HH, HD).transpose(1, 2) for t in self.qkv(x).split(HH * HD, -1))
        s = q @ k.transpose(-2, -1) / math.sqrt(HD)
        if self.mask is not None:
            s = s.masked_fill(self.mask, float("-inf"))
        p = s.softmax(-1)
        self.probs = p.detach().clone()
        return (self.drop(p) @ v).transpose(1, 2).reshape(HB, HT, HH * HD)


def _hand_mask(dims: int) -> torch.Tensor:
    """True = removed; item 0 query 2 and (4-dim) item 1 query 4 lose every key, no key column is all removed."""
    mask = torch.zeros(HB, 1, HT, HT, dtype=torch.bool)
    mask[0, 0, 2] = True
    mask[0, 0, 0, 1] = True
    mask[1, 0, 4] = True
    return mask[0, 0] if dims == 2 else mask


@pytest.mark.parametrize(
    ("dims", "option", "items", "heads"),
    [(2, {}, [0, 1], [0, 1]), (2, {"heads": [1], "batch_index": [1, 0]}, [1, 0], [1]),
     (4, {}, [0, 1], [0, 1]), (4, {"heads": [1, 0], "batch_index": 1}, [1], [1, 0])],
)  # fmt: skip
def test_hand_written_map_is_the_models_own_probabilities(
    dims: int, option: dict[str, Any], items: list[int], heads: list[int]
) -> None:
    """Witness: the probabilities the model written here kept, cut here to the asked items and heads; the rows
    its mask (built here) removes entirely, expanded here to [B, H, T]."""
    mask = _hand_mask(dims)
    model = HandWritten(mask).eval()
    x = torch.randn(HB, HT, HH * HD)
    with qkvtrace.trace(model, attention_maps=True, **option) as t, torch.no_grad():
        model(x)
    (c,) = t.calls
    assert c.path == "hand_written"
    assert c.attention_map_batch == items and c.attention_map_heads == heads
    idx_b, idx_h = torch.tensor(items), torch.tensor(heads)
    want = model.probs.index_select(0, idx_b).index_select(1, idx_h)
    torch.testing.assert_close(c.attention_map, want, rtol=0, atol=0, equal_nan=True)
    rows = mask.all(-1)
    rows = (rows if dims == 4 else rows.expand(HB, 1, HT)).expand(HB, HH, HT)
    flagged = rows.index_select(0, idx_b).index_select(1, idx_h)
    assert torch.equal(c.attention_map_fully_masked, flagged)
    # the model's own softmax over a row of -inf is NaN, and the map keeps the model's values as they are
    assert bool(flagged.any()) and bool(torch.isnan(c.attention_map[flagged]).all())
    assert c.attention_map_notes == [OWN_SOFTMAX]


def test_hand_written_map_without_a_mask_flags_no_row() -> None:
    """Witness: the model's own probabilities and the [B, H, T] shape of the call built here (no mask)."""
    model = HandWritten().eval()
    x = torch.randn(HB, HT, HH * HD)
    with qkvtrace.trace(model, attention_maps=True) as t, torch.no_grad():
        model(x)
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, model.probs, rtol=0, atol=0)
    assert c.attention_map_fully_masked.dtype == torch.bool
    assert torch.equal(c.attention_map_fully_masked, torch.zeros(HB, HH, HT, dtype=torch.bool))
    assert c.attention_map_heads == [0, 1] and c.attention_map_batch == [0, 1]


def test_hand_written_bfloat16_with_dropout_notes_both() -> None:
    """Witness: the bfloat16 dtype and dropout=0.3 given to the model here, and its own probabilities (before its
    dropout) as float32."""
    model = HandWritten(dropout=0.3).to(torch.bfloat16).train()
    x = torch.randn(HB, HT, HH * HD, dtype=torch.bfloat16)
    with qkvtrace.trace(model, attention_maps=True) as t:
        model(x)
    (c,) = t.calls
    torch.testing.assert_close(c.attention_map, model.probs.float(), rtol=0, atol=0)
    assert c.attention_map_notes == [
        OWN_SOFTMAX,
        "computed in float32 from torch.bfloat16 inputs; the kernel's own torch.bfloat16 weights may differ in low "
        "bits",
        "dropout_p=0.3: the kernel dropped weights at random; this is the weighting before dropout",
    ]


def test_hand_written_map_over_the_bound_is_refused() -> None:
    """Witness: the sizes of the call built here (2x2x5x5 floats, 400 bytes) against max_map_tokens=4."""
    model = HandWritten().eval()
    with qkvtrace.trace(model, attention_maps=True, max_map_tokens=4) as t, torch.no_grad():
        model(torch.randn(HB, HT, HH * HD))
    (c,) = t.calls
    assert c.attention_map is None
    assert c.attention_map_reason == (
        "not computed: T_query=5, T_key=5 is over max_map_tokens=4 (a map of B·H·T_q·T_k = 2x2x5x5 = 100 floats, "
        "0.4 KB); ask for fewer tokens, heads= or batch_index=, or raise max_map_tokens"
    )
