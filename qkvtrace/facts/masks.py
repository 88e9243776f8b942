"""What a mask argument blocks, as the running PyTorch reads it.

Boolean masks mean different things to different APIs (docs/tutorial.md#masks):
``True`` is "attend" for ``F.scaled_dot_product_attention`` and "ignore" for
``nn.MultiheadAttention``'s masks. Nothing here assumes either: SDPA's meaning
is measured on a two-key example, and MHA's masks are read after PyTorch's
own ``F._canonical_mask`` turned them into additive float masks.

Counts are returned as 0-dim tensors and small position lists as
:class:`~qkvtrace.base.lazy.Deferred` values: nothing is read back to the host
while a trace is open.
"""

from __future__ import annotations

import functools

import torch

from qkvtrace.base import compat
from qkvtrace.base.lazy import Deferred
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


def _positions(blocked: torch.Tensor) -> Deferred:
    small = blocked.detach().clone()
    return Deferred(lambda: [list(map(int, idx)) for idx in small.nonzero().tolist()])


def mask_info(
    mask: torch.Tensor, blocked: torch.Tensor, true_means: str | Deferred | None, kind: str | None = None
) -> MaskInfo:
    """Describe ``mask`` given the boolean tensor of what it blocks (counts stay on the device)."""
    is_bool = mask.dtype == torch.bool
    return MaskInfo(
        kind=kind or ("bool" if is_bool else "float"),
        dtype=str(mask.dtype),
        shape=list(mask.shape),
        true_means=true_means if is_bool else None,  # type: ignore[arg-type]  # resolved later
        blocked=blocked.sum(),  # type: ignore[arg-type]
        total=blocked.numel(),
        blocked_positions=_positions(blocked) if blocked.numel() <= _MAX_LISTED else None,  # type: ignore[arg-type]
    )


def blocked_by_additive(mask: torch.Tensor) -> torch.Tensor:
    """Entries of an additive float mask that remove a key (``-inf``)."""
    return torch.isneginf(mask)


def true_means_from_canonical(original: torch.Tensor, canonical: torch.Tensor) -> Deferred | None:
    """Compare a bool mask with PyTorch's additive version of it (decided when resolved)."""
    if original.dtype != torch.bool or original.numel() == 0:
        return None
    blocked = torch.isneginf(canonical).reshape(original.shape)
    same = torch.eq(blocked, original).all()
    opposite = torch.eq(blocked, ~original).all()
    return Deferred(lambda: "ignore" if bool(same) else ("attend" if bool(opposite) else None))


def count_fully_masked(
    query_rows: tuple[int, int, int],
    key_padding_blocked: torch.Tensor | None,
    attn_blocked: torch.Tensor | None,
) -> torch.Tensor | int:
    """Query rows whose keys are all blocked (a 0-dim tensor; ``0`` without masks).

    ``query_rows`` is ``(batch, heads, length)``. ``key_padding_blocked`` is
    ``(B, S)``; ``attn_blocked`` is ``(L, S)``, ``(B*H, L, S)`` or anything
    broadcastable to ``(B, H, L, S)``. Rows are counted as the kernel sees
    them: per batch item, head and query position, whatever the mask's own
    shape (an ``(L, S)`` mask blocking one row counts ``B * H``).
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
    fully = blocked.all(dim=-1)  # (B|1, H|1, L|1)
    return fully.expand(b, h, length).sum()
