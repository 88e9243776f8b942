"""Reading attention health back from a long run's lines: each module's series and its alert (no torch needed:
``qkvtrace summarize`` reads a run's file where PyTorch is not installed)."""

from __future__ import annotations

from typing import Any

__all__ = ["ENTROPY_ALERT", "ENTROPY_DROP", "LOGIT_ALERT", "LOGIT_GROWTH", "alert", "series_of"]

#: a module's max logit over this (any head) ...
LOGIT_ALERT = 50.0
#: ... and over this many times its first value is an alert (a softmax of logits 50 apart is one-hot to e⁻⁵⁰)
LOGIT_GROWTH = 2.0
#: a module's lowest per-head mean entropy under this many nats ...
ENTROPY_ALERT = 1.0
#: ... and under this fraction of its first value is an alert
ENTROPY_DROP = 0.5


def alert(series: list[tuple[int, float | None, float | None]]) -> str | None:
    """The first alert of one module's ``(step, max logit over heads, lowest head's mean entropy)`` series.

    Max logit: over :data:`LOGIT_ALERT` and over :data:`LOGIT_GROWTH` times
    its first value. Entropy: under :data:`ENTROPY_ALERT` nats and under
    :data:`ENTROPY_DROP` of its first value. ``None`` when neither happened.
    """
    logits = [(s, x) for s, x, _ in series if x is not None]
    entropies = [(s, y) for s, _, y in series if y is not None]
    found: list[tuple[int, str]] = []
    if logits:
        first = logits[0][1]
        for s, x in logits:
            if x > LOGIT_ALERT and x > LOGIT_GROWTH * abs(first):
                found.append((s, f"max logit {x:.3g} at step {s}: over {LOGIT_ALERT:g} and over "
                                 f"{LOGIT_GROWTH:g}x its first value {first:.3g}"))  # fmt: skip
                break
    if entropies:
        first = entropies[0][1]
        for s, y in entropies:
            if y < ENTROPY_ALERT and y < ENTROPY_DROP * first:
                found.append((s, f"entropy {y:.3g} nats at step {s}: under {ENTROPY_ALERT:g} and under "
                                 f"{ENTROPY_DROP:g}x its first value {first:.3g}"))  # fmt: skip
                break
    if not found:
        return None
    return "; ".join(text for _, text in sorted(found))


def series_of(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float | None, float | None]]]:
    """Per module, from ``health`` lines (or :meth:`HealthRecord.to_dict`): ``(step, max logit over heads,
    lowest head's mean entropy)`` in step order."""
    out: dict[str, list[tuple[int, float | None, float | None]]] = {}
    for line in sorted(lines, key=lambda x: x["step"]):
        heads = line.get("heads") or []
        logits = [h["max_logit"] for h in heads if h.get("max_logit") is not None]
        entropies = [h["entropy_mean"] for h in heads if h.get("entropy_mean") is not None]
        out.setdefault(line["module"], []).append(
            (line["step"], max(logits) if logits else None, min(entropies) if entropies else None)
        )
    return out
