"""Attention maps computed on the side: the weights of a call, without switching its kernel.

Tools that show attention weights usually force the eager path to get them,
so the picture comes from another computation than the one the model runs
(docs/tutorial.md#how-pytorch-runs-attention). Here the call runs exactly as it would; afterwards, under
``torch.no_grad()`` and on detached tensors, the softmax of the scaled scores
is recomputed from what that very call received:

* a direct ``F.scaled_dot_product_attention`` call: its ``query`` and ``key``,
  ``attn_mask`` (a boolean mask read with the ``True`` meaning measured on
  the running PyTorch), ``is_causal`` (top-left aligned, as SDPA's), ``scale``
  and ``enable_gqa`` (key head ``h // (H_q / H_k)`` serves query head ``h``);
* a ``MultiheadAttention`` call (fast path or fallback) and a direct
  ``F.multi_head_attention_forward`` call: ``query``/``key`` through the
  module's own Q and K projection (packed ``in_proj_weight`` or separate
  ``q/k_proj_weight``, ``in_proj_bias``), ``bias_k`` and ``add_zero_attn``,
  the masks as PyTorch's ``F._canonical_mask`` made them, and ``is_causal``
  where PyTorch replaces the mask by it;
* the fused encoder layer: the builtin's own ``src`` (after its first layer
  norm when ``norm_first``), ``qkv_weight``/``qkv_bias`` and merged mask.

No SDPA or attention kernel is called for it (a profiler sees only matmuls
and a softmax after the real call), and no random number is drawn. A map is
refused, with the reason recorded on the call, before anything is allocated
when it would be over ``max_map_tokens`` or the trace's ``max_map_mb``
(``B·H·T_q·T_k`` floats, docs/tutorial.md#limits).

A map is one layer's and one head's weighting of the values for one input; it
is not an explanation of the model's decision (docs/tutorial.md#common-mistakes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from qkvtrace.base.limits import DEFAULT_MAX_MAP_MB, DEFAULT_MAX_MAP_TOKENS
from qkvtrace.facts import masks

__all__ = [
    "DEFAULT_MAX_MAP_MB",
    "DEFAULT_MAX_MAP_TOKENS",
    "LayerSource",
    "MHASource",
    "MapBudget",
    "MapOptions",
    "MapResult",
    "SDPASource",
    "ScoreInputs",
    "function_source",
    "map_bytes",
    "mha_source",
]


_FLOAT = 4  # bytes of one float32 weight


@dataclass(frozen=True)
class MapOptions:
    """What a trace asked for: which batch items and heads, and the bounds."""

    max_map_tokens: int = DEFAULT_MAX_MAP_TOKENS
    max_map_mb: float = DEFAULT_MAX_MAP_MB
    heads: tuple[int, ...] | None = None
    batch_index: tuple[int, ...] | None = None

    @classmethod
    def make(
        cls,
        max_map_tokens: int | None,
        max_map_mb: float | None,
        heads: int | Sequence[int] | None,
        batch_index: int | Sequence[int] | None,
    ) -> MapOptions:
        tokens = DEFAULT_MAX_MAP_TOKENS if max_map_tokens is None else max_map_tokens
        mb = DEFAULT_MAX_MAP_MB if max_map_mb is None else max_map_mb
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"max_map_tokens must be a positive int, got {max_map_tokens!r}")
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
            raise ValueError(f"max_map_mb must be a positive number, got {max_map_mb!r}")
        return cls(tokens, float(mb), _indices(heads, "heads"), _indices(batch_index, "batch_index"))


def _indices(value: int | Sequence[int] | None, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, int) else tuple(value)
    if not items or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ValueError(f"{name} must be None, an index or a list of indices >= 0, got {value!r}")
    return tuple(dict.fromkeys(items))


@dataclass
class MapBudget:
    """The memory a trace's maps hold so far (the bound is ``options.max_map_mb``)."""

    options: MapOptions
    used_bytes: int = 0


def map_bytes(batch: int, heads: int, t_query: int, t_key: int) -> int:
    """Bytes of a ``[B, H, T_q, T_k]`` float32 map."""
    return batch * heads * t_query * t_key * _FLOAT


@dataclass
class MapResult:
    """A call's map, or why there is none."""

    #: CPU float32 ``[B, H, T_q, T_k]`` (only the asked batch items and heads).
    weights: torch.Tensor | None = None
    #: CPU bool ``[B, H, T_q]``: query rows whose keys were all blocked (their weights are 0 in the maps made here;
    #: a hand-written call's map is its own probabilities, NaN there when its softmax saw only -inf).
    fully_masked: torch.Tensor | None = None
    heads: list[int] | None = None
    batch: list[int] | None = None
    reason: str | None = None
    #: What the map shows that is not exactly what the kernel used (dropout, precision, padding).
    notes: list[str] = field(default_factory=list)


@dataclass
class ScoreInputs:
    """What a call's pre-softmax scores are made from: ``scale·q·kᵀ + additive``, ``blocked`` and the causal
    triangle removed (``q`` ``[B, H, L, d]``, ``k`` ``[B, H_k, S, d]``, masks broadcastable to ``[B, H, L, S]``)."""

    q: torch.Tensor
    k: torch.Tensor
    additive: torch.Tensor | None
    blocked: torch.Tensor | None
    causal: bool
    scale: Any
    #: a soft-cap ``c``: scores become ``c·tanh(scale·q·kᵀ / c)`` before the additive mask (attention written by hand)
    cap: Any = None


# -- the one computation ---------------------------------------------------------


def _select(n: int, asked: tuple[int, ...] | None, what: str) -> list[int] | str:
    if asked is None:
        return list(range(n))
    over = [i for i in asked if i >= n]
    if over:
        return f"{what} {over} asked for, but the call has {n} {what}"
    return list(asked)


def _weights(
    q: torch.Tensor,
    k: torch.Tensor,
    additive: torch.Tensor | None,
    blocked: torch.Tensor | None,
    causal: bool,
    scale: float,
    budget: MapBudget,
    name: str,
) -> MapResult:
    """softmax(q·kᵀ·scale + mask) for ``q`` ``[B, H, L, d]`` and ``k`` ``[B, H_k, S, d]``.

    ``additive`` is a float mask and ``blocked`` a boolean one (True = the
    key is removed), each broadcastable to ``[B, H, L, S]``.
    """
    b, h, length, _ = q.shape
    s = k.shape[-2]
    hk = k.shape[1]
    if h % hk:
        return MapResult(reason=f"{h} query heads cannot share {hk} key heads")
    admitted = _admit(b, h, length, s, budget)
    if isinstance(admitted, MapResult):
        return admitted
    batch, heads = admitted
    group = h // hk
    every_item, every_head = batch == list(range(b)), heads == list(range(h))
    bi = None if every_item else torch.tensor(batch, device=q.device)
    qi = None if every_head else torch.tensor(heads, device=q.device)
    qs, ks = q, k
    if bi is not None:
        qs, ks = qs.index_select(0, bi), ks.index_select(0, bi)
    if qi is not None:
        qs = qs.index_select(1, qi)
    if group > 1 or qi is not None:  # grouped-query attention: key head h // group serves query head h
        ks = ks.index_select(1, torch.tensor([i // group for i in heads], device=q.device))
    # scores, weights: fresh tensors of this map alone, so they are changed in place (no second [b, h, L, S])
    scores = torch.matmul(qs.float() * scale, ks.float().transpose(-2, -1))  # [b, h, L, S]
    shape = (b, h, length, s)
    if additive is not None:
        scores.add_(_pick(additive, shape, bi, qi).float())
    block = None if blocked is None else _pick(blocked, shape, bi, qi)
    if causal:
        upper = torch.ones(length, s, dtype=torch.bool, device=q.device).triu_(1)
        block = upper if block is None else block | upper
    if block is not None:
        scores.masked_fill_(block, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if additive is None and blocked is None:  # nothing or only the causal triangle masked: every row keeps key 0
        full = torch.zeros(weights.shape[:-1], dtype=torch.bool)
    else:
        # every key removed: softmax would be 0/0; read from the (broadcast) boolean mask when it alone removes keys
        full = torch.isneginf(scores).all(dim=-1) if additive is not None else block.all(dim=-1)  # type: ignore[union-attr]
        weights.masked_fill_(full.unsqueeze(-1), 0.0)
        full = full.expand(weights.shape[:-1]).contiguous()
    return MapResult(weights=weights.cpu(), fully_masked=full.cpu(), heads=heads, batch=batch)


def _admit(b: int, h: int, length: int, s: int, budget: MapBudget) -> tuple[list[int], list[int]] | MapResult:
    """The batch items and heads of a ``[b, h, length, s]`` map to keep, or why none is made (the budget is charged)."""
    opts = budget.options
    batch = _select(b, opts.batch_index, "batch items")
    heads = _select(h, opts.heads, "heads")
    if isinstance(batch, str) or isinstance(heads, str):
        return MapResult(reason=batch if isinstance(batch, str) else heads)  # type: ignore[arg-type]
    size = map_bytes(len(batch), len(heads), length, s)
    if max(length, s) > opts.max_map_tokens:
        return MapResult(reason=(
            f"not computed: T_query={length}, T_key={s} is over max_map_tokens={opts.max_map_tokens} "
            f"(a map of B·H·T_q·T_k = {_floats(batch, heads, length, s)}); ask for fewer tokens, heads= or "
            "batch_index=, or raise max_map_tokens"))  # fmt: skip
    if budget.used_bytes + size > opts.max_map_mb * 2**20:
        return MapResult(reason=(
            f"not computed: this map ({_floats(batch, heads, length, s)}) would bring the trace's maps to "
            f"{_size(budget.used_bytes + size)}, over max_map_mb={opts.max_map_mb:g}; "
            "ask for heads= or batch_index=, or raise max_map_mb"))  # fmt: skip
    budget.used_bytes += size
    return batch, heads


def _floats(batch: list[int], heads: list[int], length: int, s: int) -> str:
    """``2x8x10x10 = 1,600 floats, 6.2 KB``: a map's size in words (only for a refusal: not made per call)."""
    size = map_bytes(len(batch), len(heads), length, s)
    return f"{len(batch)}x{len(heads)}x{length}x{s} = {size // _FLOAT:,} floats, {_size(size)}"


def from_weights(weights: torch.Tensor, blocked: torch.Tensor | None, budget: MapBudget, dropout_p: float) -> MapResult:
    """The map of weights a model computed itself (``[B, H, T_q, T_k]``): the asked items and heads, as they are.

    ``blocked`` (broadcastable to ``weights``, True = key removed) marks the
    query rows whose keys were all removed.
    """
    b, h, length, s = weights.shape
    admitted = _admit(b, h, length, s, budget)
    if isinstance(admitted, MapResult):
        return admitted
    batch, heads = admitted
    with torch.no_grad():
        w = weights.detach()[batch][:, heads].float().cpu()
        if blocked is None:
            full = torch.zeros(w.shape[:-1], dtype=torch.bool)
        else:
            rows = blocked.all(dim=-1)
            while rows.dim() < 3:
                rows = rows.unsqueeze(0)
            rows = rows.expand(b, h, length)
            full = rows[batch][:, heads].cpu()
    notes = _float_note(weights.dtype) + _dropout_note(dropout_p)
    return MapResult(
        weights=w,
        fully_masked=full,
        heads=heads,
        batch=batch,
        notes=["the weights the model's own softmax computed", *notes],
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 / 10 else f"{n / 2**10:.1f} KB"


def _pick(mask: torch.Tensor, shape: tuple[int, int, int, int], bi: torch.Tensor | None,
          hi: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The asked batch items and heads of ``mask`` broadcast to ``shape`` (no full-size copy)."""
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if bi is None and hi is None:
        return m  # broadcasts as it is
    m = m.expand(shape)
    if bi is not None:
        m = m.index_select(0, bi.to(m.device))
    if hi is not None:
        m = m.index_select(1, hi.to(m.device))
    return m


def _float_note(dtype: torch.dtype) -> list[str]:
    if dtype in (torch.float32, torch.float64):
        return []
    return [f"computed in float32 from {dtype} inputs; the kernel's own {dtype} weights may differ in low bits"]


def _dropout_note(p: float) -> list[str]:
    if p <= 0:
        return []
    return [f"dropout_p={p:g}: the kernel dropped weights at random; this is the weighting before dropout"]


# -- direct SDPA ---------------------------------------------------------------------


@dataclass
class SDPASource:
    """What a direct ``F.scaled_dot_product_attention`` call received."""

    q: Any
    k: Any
    mask: Any
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    dropout_p: float
    #: the mask overrides ``__torch_function__`` (``CausalBias`` and the like)
    override_mask: bool = False

    def compute(self, budget: MapBudget, name: str) -> MapResult:
        found = self.scores()
        if isinstance(found, str):
            return MapResult(reason=found)
        with torch.no_grad():
            result = _weights(found.q, found.k, found.additive, found.blocked, found.causal, found.scale, budget, name)
        result.notes += _float_note(self.q.dtype) + _dropout_note(self.dropout_p)
        return result

    def scores(self) -> ScoreInputs | str:
        """What the call's scores are made from (detached), or why they cannot be made."""
        q, k, mask = self.q, self.k, self.mask
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            return "query or key is not a tensor"
        if q.is_nested or k.is_nested:
            return "not computed: nested-tensor query or key (ragged lengths)"
        if q.dim() != k.dim() or q.dim() < 2 or q.dim() > 4:
            return f"not computed: query of {q.dim()} dims (maps are made for 2 to 4: [B, H, T, d])"
        q4, k4 = q.detach(), k.detach()
        while q4.dim() < 4:
            q4, k4 = q4.unsqueeze(0), k4.unsqueeze(0)
        if q4.shape[0] != k4.shape[0] or (k4.shape[1] != q4.shape[1] and not self.enable_gqa):
            return f"query {list(q.shape)} and key {list(k.shape)} do not pair without enable_gqa"
        additive = blocked = None
        if self.override_mask:
            materialize = getattr(mask, "_materialize", None)
            if not callable(materialize):
                return f"not computed: attn_mask is a {type(mask).__name__} that cannot be materialised"
            attend = materialize(q.device)
            if not isinstance(attend, torch.Tensor) or attend.dtype != torch.bool:
                return f"not computed: {type(mask).__name__} did not materialise as a boolean mask"
            blocked = ~attend.as_subclass(torch.Tensor)
        elif isinstance(mask, torch.Tensor):
            mask = mask.detach()
            if mask.dtype == torch.bool:
                blocked = ~mask if masks.sdpa_bool_true_means() == "attend" else mask
            else:
                additive = mask
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return ScoreInputs(q4, k4, additive, blocked, self.is_causal, scale)


# -- MultiheadAttention ------------------------------------------------------------------


@dataclass
class MHASource:
    """What an MHA call projects Q and K from, and its masks as PyTorch canonicalised them.

    ``query``/``key`` as passed (``batch_first`` tells their layout);
    ``kpm``/``attn_mask``: PyTorch's additive float masks (``None`` for none).
    """

    query: Any
    key: Any
    batch_first: bool
    num_heads: int
    q_weight: Any
    k_weight: Any
    q_bias: Any
    k_bias: Any
    kpm: Any
    attn_mask: Any
    #: PyTorch ran SDPA with ``is_causal=True`` instead of the mask (fallback, no kpm, no weights)
    causal: bool = False
    bias_k: Any = None
    add_zero_attn: bool = False
    dropout_p: float = 0.0
    notes: list[str] = field(default_factory=list)

    def compute(self, budget: MapBudget, name: str) -> MapResult:
        query, key = self.query, self.key
        if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
            return MapResult(reason="query or key is not a tensor")
        if query.is_nested or key.is_nested:
            return MapResult(reason="not computed: nested-tensor query or key (ragged lengths)")
        if not isinstance(self.q_weight, torch.Tensor) or not isinstance(self.k_weight, torch.Tensor):
            return MapResult(reason="the Q or K projection weight is not known for this call")
        with torch.no_grad():
            result = self._compute(query.detach(), key.detach(), budget, name)
        result.notes += _float_note(query.dtype) + _dropout_note(self.dropout_p) + self.notes
        return result

    def _compute(self, query: torch.Tensor, key: torch.Tensor, budget: MapBudget, name: str) -> MapResult:
        found = self._scores(query, key)
        if isinstance(found, str):
            return MapResult(reason=found)
        return _weights(found.q, found.k, found.additive, found.blocked, found.causal, found.scale, budget, name)

    def scores(self) -> ScoreInputs | str:
        """What the call's scores are made from (Q and K projected again, detached), or why they cannot be made."""
        query, key = self.query, self.key
        if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
            return "query or key is not a tensor"
        if query.is_nested or key.is_nested:
            return "not computed: nested-tensor query or key (ragged lengths)"
        if not isinstance(self.q_weight, torch.Tensor) or not isinstance(self.k_weight, torch.Tensor):
            return "the Q or K projection weight is not known for this call"
        with torch.no_grad():
            return self._scores(query.detach(), key.detach())

    def _scores(self, query: torch.Tensor, key: torch.Tensor) -> ScoreInputs | str:
        h = self.num_heads
        if query.dim() == 2:  # unbatched (L, E)
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        b, length, e = query.shape
        if e % h:
            return f"embed_dim {e} is not divisible by num_heads {h}"
        d = e // h
        q = F.linear(query, self.q_weight.detach(), _det(self.q_bias))
        k = F.linear(key, self.k_weight.detach(), _det(self.k_bias))
        kpm = self.kpm.detach() if isinstance(self.kpm, torch.Tensor) else None
        attn = None if self.causal or not isinstance(self.attn_mask, torch.Tensor) else self.attn_mask.detach()
        if isinstance(self.bias_k, torch.Tensor):  # one more key; the masks get a zero column (F.pad), as PyTorch's
            k = torch.cat([k, self.bias_k.detach().reshape(1, 1, -1).expand(b, 1, -1)], dim=1)
            kpm, attn = _pad(kpm), _pad(attn)
        s = k.shape[1]
        q4 = q.reshape(b, length, h, d).transpose(1, 2)
        k4 = k.reshape(b, s, h, d).transpose(1, 2)
        if self.add_zero_attn:
            k4 = torch.cat([k4, k4.new_zeros(b, h, 1, d)], dim=2)
            kpm, attn = _pad(kpm), _pad(attn)
            s += 1
        additive = None
        if attn is not None:
            if attn.dim() == 3:  # (B*H, L, S), or (H, L, S) for an unbatched call
                attn = attn.reshape(b, h, length, s)
            additive = attn
        if kpm is not None:
            kpm = kpm.reshape(b, 1, 1, s)
            additive = kpm if additive is None else additive + kpm
        return ScoreInputs(q4, k4, additive, None, self.causal, math.sqrt(1.0 / d))  # as PyTorch scales q


def _det(t: Any) -> torch.Tensor | None:
    return t.detach() if isinstance(t, torch.Tensor) else None


def _pad(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else F.pad(mask, (0, 1))


def mha_source(module: Any, query: Any, key: Any, kpm: Any, attn_mask: Any, *, batch_first: bool,
               causal: bool) -> MHASource:  # fmt: skip
    """An ``nn.MultiheadAttention`` call, from the module's own projection."""
    e = int(module.embed_dim)
    bias = module.in_proj_bias
    if module._qkv_same_embed_dim:
        wq, wk = module.in_proj_weight[:e], module.in_proj_weight[e : 2 * e]
    else:
        wq, wk = module.q_proj_weight, module.k_proj_weight
    return MHASource(
        query, key, batch_first, int(module.num_heads), wq, wk,
        None if bias is None else bias[:e], None if bias is None else bias[e : 2 * e],
        kpm, attn_mask, causal, module.bias_k, bool(module.add_zero_attn),
        float(module.dropout) if module.training else 0.0,
    )  # fmt: skip


def function_source(a: dict[str, Any], kpm: Any, attn_mask: Any, causal: bool) -> MHASource:
    """A direct ``F.multi_head_attention_forward`` call, from the weights it was passed (``(L, B, E)``)."""
    query = a["query"]
    e = int(query.shape[-1]) if isinstance(query, torch.Tensor) else 0
    bias = a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        wq, wk = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w = a["in_proj_weight"]
        wq, wk = (w[:e], w[e : 2 * e]) if isinstance(w, torch.Tensor) else (None, None)
    return MHASource(
        query, a["key"], False, int(a["num_heads"]), wq, wk,
        None if bias is None else bias[:e], None if bias is None else bias[e : 2 * e],
        kpm, attn_mask, causal, a["bias_k"], bool(a["add_zero_attn"]),
        float(a["dropout_p"]) if a["training"] else 0.0,
    )  # fmt: skip


# -- the fused encoder layer ------------------------------------------------------------


@dataclass
class LayerSource:
    """What ``torch._transformer_encoder_layer_fwd`` received (``src`` is batch-first)."""

    src: Any
    num_heads: int
    qkv_weight: Any
    qkv_bias: Any
    norm_first: bool
    eps: float
    norm_weight: Any
    norm_bias: Any
    mask: Any
    mask_type: Any

    def compute(self, budget: MapBudget, name: str) -> MapResult:
        src = self.src
        if not isinstance(src, torch.Tensor):
            return MapResult(reason="src is not a tensor")
        notes: list[str] = []
        with torch.no_grad():
            x = src.detach()
            lengths: list[int] | None = None
            if x.is_nested:
                parts = x.unbind()
                lengths = [int(p.shape[0]) for p in parts]
                x = torch.nested.to_padded_tensor(x, 0.0)
                notes.append("nested input: positions past each sequence's length are padding PyTorch "
                             "removed; their rows and columns are 0 (listed in fully_masked)")  # fmt: skip
            x, source = self._as_mha(x, lengths)
            result = source._compute(x, x, budget, name)
            if lengths is not None and result.weights is not None and result.fully_masked is not None:
                rows = torch.arange(x.shape[1])[None, :] >= torch.tensor(lengths)[:, None]  # [B, L] padding rows
                rows = rows.index_select(0, torch.tensor(result.batch)).unsqueeze(1)  # [b, 1, L]
                result.weights = result.weights.masked_fill(rows.unsqueeze(-1), 0.0)
                result.fully_masked = result.fully_masked | rows
        result.notes += _float_note(src.dtype) + notes
        return result

    def scores(self) -> ScoreInputs | str:
        """What the call's scores are made from (Q and K projected again from ``src``), or why they cannot be made."""
        src = self.src
        if not isinstance(src, torch.Tensor):
            return "src is not a tensor"
        if src.is_nested:
            return "not computed: nested input (each sequence has its own length)"
        with torch.no_grad():
            x, source = self._as_mha(src.detach(), None)
            return source._scores(x, x)

    def _as_mha(self, x: torch.Tensor, lengths: list[int] | None) -> tuple[torch.Tensor, MHASource]:
        """``x`` after the layer's first norm (when ``norm_first``), and the MHA call the builtin makes of it."""
        e = x.shape[-1]
        if self.norm_first:
            x = F.layer_norm(x, (e,), _det(self.norm_weight), _det(self.norm_bias), self.eps)
        w, bias = self.qkv_weight.detach(), _det(self.qkv_bias)
        kpm = attn = None
        mask = self.mask
        if isinstance(mask, torch.Tensor):
            mask = mask.detach()
            if mask.dtype == torch.bool:  # MultiheadAttention's convention: True = blocked
                mask = torch.zeros(mask.shape, device=mask.device).masked_fill(mask, float("-inf"))
            if self.mask_type == 1:
                kpm = mask
            else:
                attn = mask
        if lengths is not None:
            ends = torch.tensor(lengths, device=x.device)[:, None]
            pad = torch.arange(x.shape[1], device=x.device)[None, :] >= ends
            extra = torch.zeros(pad.shape, device=x.device).masked_fill(pad, float("-inf"))
            kpm = extra if kpm is None else kpm + extra
        source = MHASource(
            x, x, True, self.num_heads, w[:e], w[e : 2 * e],
            None if bias is None else bias[:e], None if bias is None else bias[e : 2 * e], kpm, attn,
        )  # fmt: skip
        return x, source
