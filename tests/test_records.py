"""Every record field, checked against a computation that does not use qkvtrace.

Masks: what a mask blocks is measured from the attention weights PyTorch
returns (a key that gets weight 0 for every query and head is blocked), what
``True`` means is checked against PyTorch's own docstring and a softmax done
by hand. Norms: ``torch.linalg.vector_norm`` of the parameter rows and of the
projected tensors, computed here from the module's weights. ``nan_count`` and
``fully_masked_rows``: counted on the returned output and on the mask, by hand.
Only the public API is used: ``qkvtrace.trace``, ``t.calls``, ``t.to_dict()``.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

E, H, B, L = 8, 2, 2, 4
DH = E // H


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach()))


def _doc(obj: Any) -> str:
    """A docstring with whitespace and RST markup flattened, for phrase look-ups."""
    return " ".join((obj.__doc__ or "").replace("``", "").split())


def _only_call(t: Any) -> dict[str, Any]:
    calls = t.to_dict()["calls"]
    assert len(calls) == 1, [c["path"] for c in calls]
    return calls[0]


def _mha(**kwargs: Any) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, **kwargs)
    with torch.no_grad():
        mha.in_proj_bias.normal_()  # PyTorch initialises it to zeros: a zero norm would prove little
    return mha


def _positions(blocked: torch.Tensor) -> list[list[int]]:
    return [list(map(int, idx)) for idx in blocked.nonzero().tolist()]


def _by_hand_weights(mha: nn.MultiheadAttention, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√d_head) per head, with ``blocked`` (broadcastable to (B, H, L, S)) set to -inf."""
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q, k = (F.linear(x, w[i * E : (i + 1) * E], b[i * E : (i + 1) * E]) for i in (0, 1))
    q, k = (t.reshape(B, L, H, DH).transpose(1, 2) for t in (q, k))  # (B, H, L, dh)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(DH)  # (B, H, L, S)
    return scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)


# -- masks -----------------------------------------------------------------------


def test_mha_key_padding_mask_details_match_the_weights_mha_returns() -> None:
    """Witness: the weights MHA returns (zero for every head and query = blocked), PyTorch's docstring, and a
    softmax done here."""
    mha = _mha().eval()
    x = torch.randn(B, L, E)
    kpm = torch.tensor([[False, False, True, False], [True, False, False, True]])  # no row fully masked
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        _, weights = mha(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    info = _only_call(t)["inputs"]["key_padding_mask"]
    # measured: a (batch, key) is blocked when every head and query gives it weight 0
    blocked = (weights == 0).all(dim=1).all(dim=1)  # (B, S)
    assert 0 < int(blocked.sum()) < blocked.numel()
    measured = "ignore" if torch.equal(blocked, kpm) else "attend" if torch.equal(blocked, ~kpm) else "unclear"
    # documented by PyTorch
    doc = _doc(nn.MultiheadAttention.forward)
    assert "For a binary mask, a True value indicates that the corresponding key value will be ignored" in doc
    assert measured == "ignore"
    # and by hand: the same weights with True = ignore
    torch.testing.assert_close(weights, _by_hand_weights(mha, x, kpm[:, None, None, :]))
    assert info == {
        "kind": "bool",
        "dtype": "torch.bool",
        "shape": [B, L],
        "true_means": measured,
        "blocked": int(blocked.sum()),
        "total": kpm.numel(),
        "blocked_positions": _positions(blocked),
    }


def test_mha_attn_mask_details_match_the_weights_mha_returns() -> None:
    """Witness: the weights MHA returns, PyTorch's docstring, and a softmax done here."""
    mha = _mha().eval()
    x = torch.randn(B, L, E)
    attn_mask = torch.tensor(
        [[False, True, True, False], [False, False, True, True], [True, False, False, False], [False] * 4]
    )
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        _, weights = mha(x, x, x, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    info = _only_call(t)["inputs"]["attn_mask"]
    blocked = (weights == 0).all(dim=0).all(dim=0)  # (L, S): zero for every batch item and head
    measured = "ignore" if torch.equal(blocked, attn_mask) else "attend" if torch.equal(blocked, ~attn_mask) else None
    doc = _doc(nn.MultiheadAttention.forward)
    assert "For a binary mask, a True value indicates that the corresponding position is not allowed to attend" in doc
    assert measured == "ignore"
    torch.testing.assert_close(weights, _by_hand_weights(mha, x, attn_mask))
    assert info["true_means"] == measured
    assert (info["blocked"], info["total"]) == (int(blocked.sum()), attn_mask.numel())
    assert info["blocked_positions"] == _positions(blocked)
    assert _only_call(t)["inputs"]["key_padding_mask"] is None


class _UserSDPA(nn.Module):
    """A user's attention: separate q/k/v projections (v without bias), then SDPA itself."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(E, E), nn.Linear(E, E)
        self.v_proj = nn.Linear(E, E, bias=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (p(x).reshape(B, L, H, DH).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return q, k, v  # (B, H, L, dh) each

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(*self.heads(x), attn_mask=attn_mask)


def _sdpa_weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """The weights SDPA uses, read out by giving it the identity as values: output row = weight row."""
    eye = torch.eye(k.shape[-2]).expand(B, H, -1, -1)
    return F.scaled_dot_product_attention(q, k, eye, attn_mask=attn_mask)  # (B, H, L, S)


def test_sdpa_bool_attn_mask_details_match_what_sdpa_reads() -> None:
    """Witness: SDPA's own weights (read with identity values), its docstring, and a softmax done here."""
    torch.manual_seed(0)
    model = _UserSDPA()
    x = torch.randn(B, L, E)
    mask = torch.tensor([[True, False, True, True], [True, True, False, False], [False, True, True, True], [True] * 4])
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x, mask)
    info = _only_call(t)["inputs"]["attn_mask"]
    with torch.no_grad():
        q, k, _ = model.heads(x)
        weights = _sdpa_weights(q, k, mask)
    blocked = (weights.abs() < 1e-7).all(dim=0).all(dim=0)  # (L, S)
    measured = "ignore" if torch.equal(blocked, mask) else "attend" if torch.equal(blocked, ~mask) else None
    assert "A boolean mask where a value of True indicates that the element *should* take part in attention" in _doc(
        F.scaled_dot_product_attention
    )
    assert measured == "attend"
    by_hand = ((q @ k.transpose(-2, -1)) / math.sqrt(DH)).masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, by_hand)
    assert info == {
        "kind": "bool",
        "dtype": "torch.bool",
        "shape": [L, L],
        "true_means": measured,
        "blocked": int(blocked.sum()),
        "total": mask.numel(),
        "blocked_positions": _positions(blocked),
    }


def test_float_mask_blocks_its_minus_infinities() -> None:
    """Witness: the -inf positions written here, found again as zero weights in SDPA's own output."""
    torch.manual_seed(0)
    model = _UserSDPA()
    x = torch.randn(B, L, E)
    mask = torch.zeros(L, L)
    mask[0, 1] = mask[2, 3] = mask[3, 0] = float("-inf")
    mask[1, 2] = -5.0  # a bias, not a block
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x, mask)
    info = _only_call(t)["inputs"]["attn_mask"]
    with torch.no_grad():
        weights = _sdpa_weights(*model.heads(x)[:2], mask)
    blocked = (weights == 0).all(dim=0).all(dim=0)
    assert _positions(blocked) == [[0, 1], [2, 3], [3, 0]]
    assert (info["kind"], info["true_means"], info["blocked"]) == ("float", None, 3)
    assert info["blocked_positions"] == _positions(blocked)


# -- Q/K/V norms ------------------------------------------------------------------


def test_packed_mha_slice_norms() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the rows of ``in_proj_weight`` and ``in_proj_bias``, computed here."""
    mha = _mha()
    x = torch.randn(B, L, E)
    with qkvtrace.trace(mha) as t:
        mha(x, x, x)
    qkv = _only_call(t)["qkv"]
    assert qkv["layout"] == "packed"
    for i, name in enumerate("qkv"):
        rows = slice(i * E, (i + 1) * E)
        s = qkv[name]
        assert (s["param"], s["rows"], s["shape"]) == ("in_proj_weight", [[i * E, (i + 1) * E]], [E, E])
        assert s["weight_norm"] == pytest.approx(_norm(mha.in_proj_weight[rows]), rel=1e-6)
        assert s["bias_norm"] == pytest.approx(_norm(mha.in_proj_bias[rows]), rel=1e-6)
    # three matrices, not one: the norms computed here differ by far more than the 1e-6 tolerance, so a swapped
    # or repeated slice fails the checks above
    by_hand = [_norm(mha.in_proj_weight[i * E : (i + 1) * E]) for i in range(3)]
    assert all(a != pytest.approx(b, rel=1e-4) for a, b in itertools.combinations(by_hand, 2))


def test_separate_mha_slice_norms() -> None:
    """Witness: ``torch.linalg.vector_norm`` of the module's separate weights and bias rows, computed here."""
    mha = _mha(kdim=6, vdim=5)
    x, k, v = torch.randn(B, L, E), torch.randn(B, L, 6), torch.randn(B, L, 5)
    with qkvtrace.trace(mha) as t:
        mha(x, k, v)
    qkv = _only_call(t)["qkv"]
    assert qkv["layout"] == "separate"
    for i, (name, param) in enumerate((("q", mha.q_proj_weight), ("k", mha.k_proj_weight), ("v", mha.v_proj_weight))):
        s = qkv[name]
        assert (s["param"], s["rows"], s["shape"]) == (f"{name}_proj_weight", [[0, E]], list(param.shape))
        assert s["weight_norm"] == pytest.approx(_norm(param), rel=1e-6)
        assert s["bias_norm"] == pytest.approx(_norm(mha.in_proj_bias[i * E : (i + 1) * E]), rel=1e-6)


def test_user_sdpa_module_norms_and_activation_norms() -> None:
    """Witness: norms of the projections' weights and of Q/K/V recomputed here with ``F.linear``."""
    torch.manual_seed(0)
    model = _UserSDPA()
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        model(x)
    call = _only_call(t)
    assert call["path"] == "sdpa"
    qkv = call["qkv"]
    with torch.no_grad():
        # the tensors handed to SDPA, computed here from the weights (F.linear, not the module)
        handed = [F.linear(x, p.weight, p.bias) for p in (model.q_proj, model.k_proj, model.v_proj)]
    for name, proj, tensor in zip("qkv", (model.q_proj, model.k_proj, model.v_proj), handed, strict=True):
        s = qkv[name]
        assert s["weight_norm"] == pytest.approx(_norm(proj.weight), rel=1e-6)
        assert s["activation_norm"] == pytest.approx(_norm(tensor), rel=1e-5)
        if proj.bias is None:
            assert s["bias_norm"] is None
        else:
            assert s["bias_norm"] == pytest.approx(_norm(proj.bias), rel=1e-6)
    assert qkv["v"]["bias_norm"] is None


# -- output: NaN and fully-masked rows -----------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "fallback", "sdpa"])
def test_nan_count_is_the_number_of_nan_in_the_output(mode: str) -> None:
    """Witness: the NaN put in the input here, and ``torch.isnan`` counted on the returned output."""
    x = torch.randn(B, L, E)
    x[0, 2, 3] = float("nan")  # one NaN in the input of sequence 0
    if mode == "sdpa":
        torch.manual_seed(0)
        model: nn.Module = _UserSDPA()
        with torch.no_grad(), qkvtrace.trace(model) as t:
            out = model(x)
    else:
        mha = _mha().train(mode == "fallback")
        with torch.set_grad_enabled(mode == "fallback"), qkvtrace.trace(mha) as t:
            out, _ = mha(x, x, x, need_weights=False)
    call = _only_call(t)
    assert call["path"] == mode
    expected = int(torch.isnan(out).sum())
    assert 0 < expected < out.numel()
    assert bool(torch.isnan(out[1]).any()) is False  # sequence 1 is untouched
    assert call["output"]["nan_count"] == expected


class _Direct(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("length", [31, 32, 1024])  # 7,936, 8,192 and 262,144 output values
@pytest.mark.parametrize("steady", [False, True])
def test_nan_count_beside_infinities_of_either_sign(length: int, steady: bool) -> None:
    """Witness: ``torch.isnan`` counted on the returned output. V carries NaN, +inf and -inf in channels of its
    own, so the output has whole channels of each (every weight is positive): the count must take the NaN and
    only them, on outputs small and large (``steady``: the module's third call, which its slot records)."""
    q, k = (torch.randn(1, 4, length, 64, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    v = torch.randn(1, 4, length, 64, generator=torch.Generator().manual_seed(3))
    v[0, 0, 5, 1] = float("nan")
    v[0, 1, 7, 2] = float("inf")
    v[0, 2, 9, 3] = float("-inf")
    v[0, 3, 11, 4] = float("inf")
    v[0, 3, 12, 4] = float("-inf")  # +inf and -inf in one channel: NaN out of the sum
    model = _Direct()
    with torch.no_grad(), qkvtrace.trace(model) as t:
        outs = [model(q, k, v) for _ in range(3 if steady else 1)]
    out = outs[-1]
    expected = int(torch.isnan(out).sum())
    assert expected == 2 * length  # channel 1 of head 0 and channel 4 of head 3, every query
    assert bool(torch.isposinf(out).any()) and bool(torch.isneginf(out).any())
    assert t.calls[-1].output["nan_count"] == expected
    assert type(t.calls[-1].output["nan_count"]) is int


def test_fully_masked_rows_counted_by_hand() -> None:
    """Witness: the masks built here; their fully blocked (batch, query) rows are counted by hand (3), in each of
    the H heads the kernel runs."""
    mha = _mha().eval()
    x = torch.randn(B, L, E)
    attn_mask = torch.zeros(L, L, dtype=torch.bool)
    attn_mask[1] = True  # query 1 may attend to nothing (True = not allowed, documented above)
    kpm = torch.tensor([[False, False, False, True], [False, True, True, False]])
    attn_mask[3, :3] = True  # query 3 only sees key 3: padding in sequence 0, real in sequence 1
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        out, _ = mha(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)
    blocked = attn_mask[None, :, :] | kpm[:, None, :]  # (B, L, S)
    by_hand = int(blocked.all(dim=-1).sum())
    assert by_hand == 3  # (0, 1), (0, 3), (1, 1)
    call = _only_call(t)
    assert call["output"]["fully_masked_rows"] == by_hand * H
    assert call["output"]["nan_count"] == int(torch.isnan(out).sum())


def test_fully_masked_rows_of_a_direct_sdpa_call() -> None:
    """Witness: the mask built here with one query row blocked, times the batch size and the heads of the call."""
    torch.manual_seed(0)
    model = _UserSDPA()
    x = torch.randn(B, L, E)
    mask = torch.ones(L, L, dtype=torch.bool)  # True = attend (SDPA, documented and measured above)
    mask[2] = False  # query 2 attends to nothing, in every batch item
    with torch.no_grad(), qkvtrace.trace(model) as t:
        out = model(x, mask)
    call = _only_call(t)
    assert call["output"]["fully_masked_rows"] == B * H * int((~mask).all(dim=-1).sum()) == B * H  # (B, H, L, dh)
    assert call["output"]["nan_count"] == int(torch.isnan(out).sum())


def test_no_mask_no_fully_masked_rows() -> None:
    """Witness: no mask is passed here, and ``torch.isnan`` finds no NaN in the output."""
    mha = _mha().eval()
    x = torch.randn(B, L, E)
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        out, _ = mha(x, x, x, need_weights=False)
    call = _only_call(t)
    assert int(torch.isnan(out).sum()) == 0
    assert (call["output"]["nan_count"], call["output"]["fully_masked_rows"]) == (0, 0)
    assert (call["inputs"]["key_padding_mask"], call["inputs"]["attn_mask"]) == (None, None)


def test_files_written_get_the_permissions_open_would_give(tmp_path: Path) -> None:
    """Witness: a file made by plain ``open()`` in the same folder (its mode is what the umask allows).

    The JSON and the HTML page are written through a temporary file (0o600) and a rename; what lands must be
    readable as any file the user writes, and a file replaced keeps its own mode.
    """
    import stat

    from qkvtrace.records import TraceResult

    (tmp_path / "plain.txt").write_text("x")
    expected = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    result = TraceResult(torch_version="x")
    for path in (result.save(tmp_path / "t.json"), result.save_html(tmp_path / "t.html")):
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
    (tmp_path / "t.json").chmod(0o640)
    assert stat.S_IMODE(result.save(tmp_path / "t.json").stat().st_mode) == 0o640


def test_fully_masked_rows_of_a_per_head_mask_counted_by_hand() -> None:
    """A 3-D (B·H, L, S) mask of a cross-attention call (L=3 queries, S=5 keys) which blocks every key of query 2 in
    batch item 1, head 0 only: one row of one head; the same call with no mask: none.

    Witness: the mask built here, counted by hand per (batch item, head, query), and the NaN the untraced call
    puts in that row of the head's weights.
    """
    mha = _mha().train()
    q, kv = torch.randn(B, 3, E), torch.randn(B, 5, E)
    per_head = torch.zeros(B * H, 3, 5, dtype=torch.bool)
    per_head[1 * H + 0, 2] = True  # PyTorch's (B·H) order: batch item 1, head 0, query 2
    per_head[0 * H + 1, 1, :4] = True  # a row blocked but for one key, elsewhere
    with torch.no_grad():
        _, weights = mha(q, kv, kv, attn_mask=per_head, need_weights=True, average_attn_weights=False)
    assert bool(weights[1, 0, 2].isnan().all()) and not bool(weights[0, 1, 1].isnan().any())  # the premise
    by_hand = int(per_head.reshape(B, H, 3, 5).all(dim=-1).sum())
    assert by_hand == 1
    with qkvtrace.trace(mha) as t:
        mha(q, kv, kv, attn_mask=per_head, need_weights=False)
        mha(q, kv, kv, need_weights=False)
    assert [c["output"]["fully_masked_rows"] for c in t.to_dict()["calls"]] == [by_hand, 0]


@pytest.mark.parametrize("length", [8, 9], ids=["64-entries", "81-entries"])
def test_blocked_positions_are_listed_up_to_64_entries(length: int) -> None:
    """An (L, L) boolean mask of 64 entries has its blocked positions listed; of 81, only counted (the limit the
    record's documentation gives), and a float mask has no 'True means'.

    Witness: the masks built here and their positions, listed here.
    """
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, length, E)
    attn_mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        mha(x, x, x, attn_mask=attn_mask, need_weights=False)
        mha(x, x, x, attn_mask=torch.zeros(length, length).masked_fill(attn_mask, float("-inf")), need_weights=False)
    bool_info, float_info = (c["inputs"]["attn_mask"] for c in t.to_dict()["calls"])
    listed = _positions(attn_mask) if length * length <= 64 else None
    assert (bool_info["blocked_positions"], float_info["blocked_positions"]) == (listed, listed)
    assert (bool_info["true_means"], float_info["true_means"]) == ("ignore", None)
    assert bool_info["blocked"] == float_info["blocked"] == int(attn_mask.sum())


def test_a_one_entry_boolean_mask_still_says_what_true_means() -> None:
    """A (1, 1) boolean mask (one query, one key, not blocked): True means what it means for any other size.

    Witness: MHA's docstring (True = not allowed to attend), checked in the test above, on a mask of one entry.
    """
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, 1, E)
    with torch.no_grad(), qkvtrace.trace(mha) as t:
        mha(x, x, x, attn_mask=torch.zeros(1, 1, dtype=torch.bool), need_weights=False)
    assert _only_call(t)["inputs"]["attn_mask"]["true_means"] == "ignore"
