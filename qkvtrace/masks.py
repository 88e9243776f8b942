"""What a mask argument blocks, as the running PyTorch reads it.

Boolean masks mean different things to different APIs (seed section 6.3):
``True`` is "attend" for ``F.scaled_dot_product_attention`` and "ignore" for
``nn.MultiheadAttention``'s masks. Nothing here assumes either: SDPA's meaning
is measured on a two-key example, and MHA's masks are read after PyTorch's
own ``F._canonical_mask`` turned them into additive float masks.
"""

from __future__ import annotations

import functools

import torch

from qkvtrace import compat
from qkvtrace.records import MaskInfo

__all__ = ["count_fully_masked", "mask_info", "sdpa_bool_true_means"]

_MAX_LISTED = 64


@functools.cache
def sdpa_bool_true_means() -> str:
    """``"attend"`` or ``"ignore"``: what ``True`` does in SDPA's boolean ``attn_mask``.

    One query, two keys with equal scores, values 1 and 2; the mask is
    ``[True, False]``. Output 1 means only the first key was read.
    """
    q = torch.zeros(1, 1, 1, 1)
    k = torch.zeros(1, 1, 2, 1)
    v = torch.tensor([[[[1.0], [2.0]]]])
    mask = torch.tensor([[True, False]])
    with torch.no_grad():
        out = float(compat.raw_sdpa()(q, k, v, attn_mask=mask))
    return "attend" if abs(out - 1.0) < 1e-4 else "ignore"


def mask_info(mask: torch.Tensor, blocked: torch.Tensor, true_means: str | None) -> MaskInfo:
    """Describe ``mask`` given the boolean tensor of what it blocks."""
    n_blocked = int(blocked.sum())
    positions = None
    if blocked.numel() <= _MAX_LISTED:
        positions = [list(map(int, idx)) for idx in blocked.nonzero().tolist()]
    return MaskInfo(
        kind="bool" if mask.dtype == torch.bool else "float",
        dtype=str(mask.dtype),
        shape=list(mask.shape),
        true_means=true_means if mask.dtype == torch.bool else None,
        blocked=n_blocked,
        total=blocked.numel(),
        blocked_positions=positions,
    )


def blocked_by_additive(mask: torch.Tensor) -> torch.Tensor:
    """Entries of an additive float mask that remove a key (``-inf``)."""
    return torch.isneginf(mask)


def true_means_from_canonical(original: torch.Tensor, canonical: torch.Tensor) -> str | None:
    """Compare a bool mask with PyTorch's additive version of it."""
    if original.dtype != torch.bool or original.numel() == 0:
        return None
    blocked = torch.isneginf(canonical).reshape(original.shape)
    if torch.equal(blocked, original):
        return "ignore"
    if torch.equal(blocked, ~original):
        return "attend"
    return None


def count_fully_masked(
    query_rows: tuple[int, int, int],
    key_padding_blocked: torch.Tensor | None,
    attn_blocked: torch.Tensor | None,
) -> int:
    """Query rows whose keys are all blocked.

    ``query_rows`` is ``(batch, heads, length)``. ``key_padding_blocked`` is
    ``(B, S)``; ``attn_blocked`` is ``(L, S)``, ``(B*H, L, S)`` or anything
    broadcastable to ``(B, H, L, S)``. Rows are counted per batch item and
    query position, and per head only when the mask differs per head.
    """
    b, h, length = query_rows
    parts = []
    if key_padding_blocked is not None:
        parts.append(key_padding_blocked.reshape(b, 1, 1, -1))
    if attn_blocked is not None:
        a = attn_blocked
        if a.dim() == 3 and a.shape[0] == b * h:
            a = a.reshape(b, h, a.shape[-2], a.shape[-1])
        while a.dim() < 4:
            a = a.unsqueeze(0)
        parts.append(a)
    if not parts:
        return 0
    blocked = parts[0]
    for p in parts[1:]:
        blocked = blocked | p
    fully = blocked.all(dim=-1)  # (B|1, H'|1, L|1)
    heads = fully.shape[1]
    return int(fully.expand(b, heads, length).sum())
