"""The tutorial's own models, and how closely PyTorch agrees with them.

The tutorial (docs/tutorial.md) teaches attention with four pieces of code
of its own, keyed here by the numbers the report uses: attention written out
by hand (3.2), multi-head self-attention from scratch with one packed
``[3D, D]`` projection (5.1), a Transformer block (7) and a tiny causal
language model (8). They are written here from the tutorial's
description, then loaded with the very weights of PyTorch's modules and run
on the same inputs:

* 3.2 against ``F.scaled_dot_product_attention`` with a boolean mask;
* 5.1 against ``nn.MultiheadAttention``: its packed ``in_proj_weight`` split
  into the Q, K and V slices, each written where 5.1's reshape reads it;
* 7 against ``nn.TransformerEncoderLayer``, post-norm and pre-norm
  (``norm_first`` both ways), in training and on the fused inference path;
* 8's attention (the hand-written causal mask) against SDPA with
  ``is_causal=True``, through the whole model.

:func:`measure` returns, per comparison and dtype (float32, bfloat16), the
largest absolute difference of the outputs and of every gradient (inputs and
parameters), and the path and backend PyTorch took as the tracer recorded
them. Nothing is expected in advance: a PyTorch whose numerics change gives
other numbers, and ``qkvtrace diff`` shows the moves.

Collection only: torch and nothing else, so the report collector can run it
in environments that have only torch.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.base.errors import first_line

__all__ = [
    "Agreement",
    "MultiHeadSelfAttention",
    "TinyCausalLM",
    "TransformerBlock",
    "attention",
    "compare",
    "load_encoder_layer",
    "load_mha",
    "measure",
]

# -- 3.2: attention by hand (docs/tutorial.md#attention-by-hand) ------------------------------------------------


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(Q Kᵀ / sqrt(d_k)) V`` with the tutorial's mask convention: ``True`` = may attend.

    ``q``: ``[..., Tq, Dh]``, ``k``: ``[..., Tk, Dh]``, ``v``: ``[..., Tk, Dv]``;
    returns ``(context [..., Tq, Dv], weights [..., Tq, Tk])``.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


# -- 5.1: multi-head self-attention from scratch (docs/tutorial.md#multi-head-attention) ------------------------------


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with one packed ``[3D, D]`` projection, split after the matmul.

    ``kernel="hand"`` computes the weights explicitly (3.2, the tutorial's
    way); ``kernel="sdpa"`` hands the same Q, K, V to
    ``F.scaled_dot_product_attention`` (``is_causal=True`` for a causal call),
    so one set of weights can run both ways.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, kernel: str = "hand") -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if kernel not in ("hand", "sdpa"):
            raise ValueError(f"kernel must be 'hand' or 'sdpa', got {kernel!r}")
        self.d_model, self.num_heads, self.kernel = d_model, num_heads, kernel
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def rows(self, part: str) -> slice:
        """The rows of ``qkv.weight`` that ``forward`` reads as ``part`` (``"q"``, ``"k"`` or ``"v"``).

        ``forward`` reshapes the ``3D`` outputs as ``[3, H, Dh]``: the first
        ``D`` rows are Q, the next ``D`` are K, the last ``D`` are V.
        """
        i = "qkv".index(part)
        return slice(i * self.d_model, (i + 1) * self.d_model)

    def forward(
        self,
        x: torch.Tensor,
        causal: bool = False,
        padding_mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``x``: ``[B, T, D]``; ``padding_mask``: ``[B, T]``, ``True`` = a real token."""
        b, t, _ = x.shape
        # [B,T,3D] -> [B,T,3,H,Dh] -> [3,B,H,T,Dh]
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        allowed = None  # [B or 1, 1, T, T], True = may attend
        if causal:
            allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if padding_mask is not None:
            keys = padding_mask[:, None, None, :]  # [B,1,1,T]
            allowed = keys if allowed is None else allowed & keys
        p = self.dropout if self.training else 0.0
        weights: torch.Tensor | None
        if self.kernel == "sdpa":
            if allowed is not None and not (causal and padding_mask is None):
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
            else:
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
            weights = None
        else:
            context, weights = attention(q, k, v, allowed)  # [B,H,T,Dh], [B,H,T,T]
            context = F.dropout(weights, p) @ v if p else context
        context = context.transpose(1, 2).contiguous().reshape(b, t, self.d_model)  # heads side by side
        out = self.out_proj(context)
        return (out, weights) if return_weights else out


# -- 7: a Transformer block (docs/tutorial.md#the-transformer-block) ----------------------------------


class TransformerBlock(nn.Module):
    """Attention then a GELU feed-forward, each with a residual and a LayerNorm.

    The tutorial writes the pre-norm block (``norm_first=True``): ``x + attn(LN(x))``,
    then ``x + FFN(LN(x))``; ``norm_first=False`` is the original post-norm
    block: ``LN(x + attn(x))``, then ``LN(x + FFN(x))``.
    """

    def __init__(
        self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0, norm_first: bool = True,
        kernel: str = "hand",
    ) -> None:  # fmt: skip
        super().__init__()
        hidden = int(d_model * mlp_ratio)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = MultiHeadSelfAttention(d_model, num_heads, dropout, kernel=kernel)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_model), nn.Dropout(dropout)
        )

    def _attend(self, x: torch.Tensor, causal: bool, padding_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.attention(x, causal=causal, padding_mask=padding_mask)
        assert isinstance(out, torch.Tensor)
        return out

    def forward(self, x: torch.Tensor, causal: bool = False, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            x = x + self._attend(self.norm1(x), causal, padding_mask)
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self._attend(x, causal, padding_mask))
        return self.norm2(x + self.ffn(x))


# -- 8: a tiny causal language model (docs/tutorial.md#a-tiny-language-model) -----------------------------------------


class TinyCausalLM(nn.Module):
    """Token + position embeddings, causal pre-norm blocks, a final LayerNorm, a tied output head."""

    def __init__(
        self, vocab_size: int, max_len: int = 32, d_model: int = 32, num_heads: int = 4, num_layers: int = 2,
        dropout: float = 0.0, kernel: str = "hand",
    ) -> None:  # fmt: skip
        super().__init__()
        self.max_len = max_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, dropout=dropout, kernel=kernel) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # input and output share one table

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids``: ``[B, T]`` -> logits ``[B, T, V]``."""
        t = token_ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.max_len}")
        x = self.token_embedding(token_ids) + self.position_embedding(torch.arange(t, device=token_ids.device))
        for block in self.blocks:
            x = block(x, causal=True)
        return self.lm_head(self.norm(x))


# -- loading PyTorch's weights ---------------------------------------------------------------------


@torch.no_grad()
def load_mha(
    ref: MultiHeadSelfAttention, mha: nn.MultiheadAttention
) -> list[tuple[str, torch.Tensor, str, torch.Tensor]]:
    """Copy ``mha``'s weights into ``ref``: ``in_proj_weight`` split into Q, K, V, each into ``ref.rows(part)``.

    Returns the pairs ``(ref name, ref parameter, torch name, torch parameter)``
    that now hold the same numbers, for comparing gradients.
    """
    if mha.in_proj_weight is None or mha.in_proj_bias is None or mha.out_proj.bias is None:
        raise ValueError("load_mha needs a MultiheadAttention with a packed in_proj_weight and biases")
    for part, w, b in zip("qkv", mha.in_proj_weight.chunk(3, dim=0), mha.in_proj_bias.chunk(3, dim=0), strict=True):
        ref.qkv.weight[ref.rows(part)] = w
        ref.qkv.bias[ref.rows(part)] = b
    ref.out_proj.weight.copy_(mha.out_proj.weight)
    ref.out_proj.bias.copy_(mha.out_proj.bias)
    return [
        ("qkv.weight", ref.qkv.weight, "in_proj_weight", mha.in_proj_weight),
        ("qkv.bias", ref.qkv.bias, "in_proj_bias", mha.in_proj_bias),
        ("out_proj.weight", ref.out_proj.weight, "out_proj.weight", mha.out_proj.weight),
        ("out_proj.bias", ref.out_proj.bias, "out_proj.bias", mha.out_proj.bias),
    ]


@torch.no_grad()
def load_encoder_layer(
    block: TransformerBlock, layer: nn.TransformerEncoderLayer
) -> list[tuple[str, torch.Tensor, str, torch.Tensor]]:
    """Copy an encoder layer's weights into ``block`` (its attention through :func:`load_mha`)."""
    pairs = [("attention." + a, p, "self_attn." + b, q) for a, p, b, q in load_mha(block.attention, layer.self_attn)]
    for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2"), ("ffn.0", "linear1"), ("ffn.3", "linear2")):
        mine, other = block.get_submodule(ours), layer.get_submodule(theirs)
        for name in ("weight", "bias"):
            getattr(mine, name).copy_(getattr(other, name))
            pairs.append((f"{ours}.{name}", getattr(mine, name), f"{theirs}.{name}", getattr(other, name)))
    return pairs


# -- measuring agreement -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """How far two computations that should be equal are apart."""

    #: Largest ``|a - b|`` over the outputs.
    forward_max_abs_err: float
    #: Largest ``|grad_a - grad_b|`` over the inputs' and the paired parameters' gradients;
    #: ``None`` when no gradient was compared.
    grad_max_abs_err: float | None
    #: Largest ``|output|``: the scale the errors are measured against.
    output_max_abs: float
    #: Largest ``|grad|`` over the same gradients (``None`` without gradients).
    grad_max_abs: float | None = None


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def compare(
    run_a: Callable[[], torch.Tensor],
    run_b: Callable[[], torch.Tensor],
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    grad: bool = True,
) -> Agreement:
    """Run both, compare outputs; with ``grad``, back-propagate the same random cotangent through both.

    ``pairs`` are tensors (inputs with ``requires_grad``, parameters) whose
    ``.grad`` should match between the two computations; their ``.grad`` is
    reset first.
    """
    for a, b in pairs:
        a.grad = None
        b.grad = None
    out_a, out_b = run_a(), run_b()
    err = _max_abs(out_a, out_b)
    scale = float(out_b.detach().double().abs().max())
    if not grad:
        return Agreement(err, None, scale)
    g = torch.randn(out_b.shape, generator=torch.Generator().manual_seed(1)).to(out_b.dtype)
    (out_a * g).sum().backward()
    (out_b * g).sum().backward()
    grad_err = grad_scale = 0.0
    for a, b in pairs:
        if a.grad is None or b.grad is None:
            raise RuntimeError("a compared tensor received no gradient")
        grad_err = max(grad_err, _max_abs(a.grad, b.grad))
        grad_scale = max(grad_scale, float(b.grad.detach().double().abs().max()))
    return Agreement(err, grad_err, scale, grad_scale)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.2g}")


D_MODEL, HEADS, BATCH, SEQ = 32, 4, 2, 6


def _x(dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(0)).to(dtype)
    return x.requires_grad_(grad)


def _padding() -> torch.Tensor:
    valid = torch.ones(BATCH, SEQ, dtype=torch.bool)  # True = a real token (the tutorial's convention)
    valid[1, -2:] = False
    return valid


@dataclass(frozen=True)
class _Case:
    key: str
    section: str
    model: str
    against: str
    #: a few words for narrow tables
    label: str
    #: ``run(dtype)`` -> (agreement, the tracer's calls of PyTorch's side)
    run: Callable[[torch.dtype], tuple[Agreement, list[Any]]]


def _traced(module: nn.Module) -> Any:
    from qkvtrace.tracer import trace  # late: the tracer imports this package's other modules

    return trace(module, gradients=False)


class _SDPA(nn.Module):
    """PyTorch's side of 3.2: a module whose forward is one SDPA call, so the tracer records it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _case_sdpa_mask(dtype: torch.dtype) -> tuple[Agreement, list[Any]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, D_MODEL // HEADS, generator=g).to(dtype) for _ in "qkv")
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()  # True = may attend, for both
    # separate leaves: one q, k, v shared by both graphs would sum both gradients
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    sdpa = _SDPA()
    with _traced(sdpa) as t:
        agreement = compare(
            lambda: attention(qa, ka, va, mask)[0], lambda: sdpa(qb, kb, vb, mask), [(qa, qb), (ka, kb), (va, vb)]
        )
    return agreement, t.calls


def _mha_pair(dtype: torch.dtype) -> tuple[MultiHeadSelfAttention, nn.MultiheadAttention, list[Any]]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True, dropout=0.0).to(dtype)
    ref = MultiHeadSelfAttention(D_MODEL, HEADS).to(dtype)
    pairs = load_mha(ref, mha)
    return ref, mha, pairs


def _case_mha(train: bool, padded: bool) -> Callable[[torch.dtype], tuple[Agreement, list[Any]]]:
    def run(dtype: torch.dtype) -> tuple[Agreement, list[Any]]:
        ref, mha, pairs = _mha_pair(dtype)
        ref.train(train)
        mha.train(train)
        valid = _padding() if padded else None
        xa, xb = _x(dtype, train), _x(dtype, train)

        def theirs() -> torch.Tensor:
            kpm = None if valid is None else ~valid  # nn.MultiheadAttention: True = ignore this key
            return mha(xb, xb, xb, key_padding_mask=kpm, need_weights=False)[0]

        def ours() -> torch.Tensor:
            out = ref(xa, padding_mask=valid)
            assert isinstance(out, torch.Tensor)
            return out

        with _traced(mha) as t, torch.set_grad_enabled(train):
            agreement = compare(ours, theirs, [(xa, xb)] + [(a, b) for _, a, _, b in pairs], grad=train)
        return agreement, t.calls

    return run


def _case_block(norm_first: bool, train: bool) -> Callable[[torch.dtype], tuple[Agreement, list[Any]]]:
    def run(dtype: torch.dtype) -> tuple[Agreement, list[Any]]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(
            D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=norm_first,
        ).to(dtype)  # fmt: skip
        block = TransformerBlock(D_MODEL, HEADS, norm_first=norm_first).to(dtype)
        pairs = load_encoder_layer(block, layer)
        layer.train(train)
        block.train(train)
        xa, xb = _x(dtype, train), _x(dtype, train)
        if train:
            with _traced(layer) as t:
                agreement = compare(lambda: block(xa), lambda: layer(xb), [(xa, xb)] + [(a, b) for _, a, _, b in pairs])
        else:  # inference, where PyTorch may take its fused encoder-layer path
            with _traced(layer) as t, torch.inference_mode():
                agreement = compare(lambda: block(xa), lambda: layer(xb), [], grad=False)
        return agreement, t.calls

    return run


def _case_causal_lm(dtype: torch.dtype) -> tuple[Agreement, list[Any]]:
    torch.manual_seed(0)
    hand = TinyCausalLM(vocab_size=64, d_model=D_MODEL, num_heads=HEADS).to(dtype)
    fused = copy.deepcopy(hand)
    for block in fused.blocks:
        assert isinstance(block, TransformerBlock)
        block.attention.kernel = "sdpa"
    tokens = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(0))
    pairs = list(zip(hand.parameters(), fused.parameters(), strict=True))
    with _traced(fused) as t:
        agreement = compare(lambda: hand(tokens), lambda: fused(tokens), pairs)
    return agreement, t.calls


def _cases() -> list[_Case]:
    cases = [
        _Case("3.2", "3.2", "attention by hand", "F.scaled_dot_product_attention, causal bool mask",
              "by hand vs SDPA, bool mask", _case_sdpa_mask),
        _Case("5.1", "5.1", "multi-head self-attention", "nn.MultiheadAttention, training",
              "vs MHA, train", _case_mha(True, False)),
        _Case("5.1 padded", "5.1", "multi-head self-attention", "nn.MultiheadAttention, training, key_padding_mask",
              "vs MHA, train, key padding", _case_mha(True, True)),
        _Case("5.1 eval", "5.1", "multi-head self-attention", "nn.MultiheadAttention, eval + no_grad",
              "vs MHA, eval", _case_mha(False, False)),
    ]  # fmt: skip
    for norm_first in (False, True):
        name = "pre-norm" if norm_first else "post-norm"
        cases.append(_Case(f"7 {name}", "7", f"Transformer block, {name}",
                           f"nn.TransformerEncoderLayer(norm_first={norm_first}), training",
                           f"vs EncoderLayer {name}, train", _case_block(norm_first, True)))  # fmt: skip
        cases.append(_Case(f"7 {name} eval", "7", f"Transformer block, {name}",
                           f"nn.TransformerEncoderLayer(norm_first={norm_first}), eval + inference_mode",
                           f"vs EncoderLayer {name}, eval", _case_block(norm_first, False)))  # fmt: skip
    cases.append(
        _Case("8", "8", "tiny causal LM, hand-written causal mask", "the same LM with SDPA is_causal=True",
              "causal LM vs SDPA is_causal", _case_causal_lm)
    )  # fmt: skip
    return cases


DTYPES = (torch.float32, torch.bfloat16)


def _paths(calls: list[Any]) -> tuple[str | None, str | None]:
    if not calls:
        return None, None
    paths = sorted({c.path for c in calls})
    backends = sorted({c.sdpa_backend or "none" for c in calls})
    return "/".join(paths), "/".join(backends)


def _rows(dtypes: tuple[torch.dtype, ...]) -> Iterator[dict[str, Any]]:
    for case in _cases():
        for dtype in dtypes:
            row: dict[str, Any] = {
                "key": case.key,
                "section": case.section,
                "model": case.model,
                "against": case.against,
                "label": case.label,
                "dtype": str(dtype).replace("torch.", ""),
            }
            try:
                agreement, calls = case.run(dtype)
            except Exception as exc:  # a comparison this PyTorch cannot run (dtype, kernel) is recorded, not fatal
                row.update(forward_max_abs_err=None, grad_max_abs_err=None, output_max_abs=None, grad_max_abs=None,
                           path=None, sdpa_backend=None, error=first_line(exc))  # fmt: skip
            else:
                path, backend = _paths(calls)
                row.update(
                    forward_max_abs_err=_sig(agreement.forward_max_abs_err),
                    grad_max_abs_err=_sig(agreement.grad_max_abs_err),
                    output_max_abs=_sig(agreement.output_max_abs),
                    grad_max_abs=_sig(agreement.grad_max_abs),
                    path=path,
                    sdpa_backend=backend,
                )
            yield row


def measure(dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[dict[str, Any]]:
    """The agreement table: one row per comparison and dtype (see the module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(_rows(dtypes))
