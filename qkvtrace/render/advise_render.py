"""The table of ``qkvtrace advise``: each measured change, recommended ones first."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from qkvtrace.advise import RECOMMENDED, Advice, Measured

__all__ = ["advise_table"]


def _today(m: Measured) -> str:
    backend = f" ({m.backend})" if m.backend else ""
    return f"{m.path}{backend}" + (f"\n{m.reason}" if m.reason else "")


def _then(m: Measured) -> str:
    if m.path_after is None:
        return "–"
    backend = f" ({m.backend_after})" if m.backend_after else ""
    reason = f"\n{m.reason_after}" if m.reason_after and m.reason_after != m.reason else ""
    return f"{m.path_after}{backend}{reason}"


def _speed(m: Measured) -> str:
    if not m.ratios:
        return "–"
    return f"{m.median:.2f}×\n{min(m.ratios):.2f}–{max(m.ratios):.2f}"


def _diff(m: Measured) -> str:
    if m.max_abs_diff is None:
        return "–"
    out = f"{m.max_abs_diff:.2g}"
    return out + (f"\ngrad {m.max_abs_grad_diff:.2g}" if m.max_abs_grad_diff is not None else "")


def advise_table(advice: Advice) -> Group:
    mode = "training step" if advice.train else "inference forward (eval)"
    table = Table(title=f"qkvtrace advise {advice.target} — {mode}, torch {advice.torch_version}, {advice.device}",
                  show_lines=True, title_justify="left")  # fmt: skip
    memory = any(m.memory_ratio is not None for m in advice.measured)  # peak memory is measured on CUDA only
    for name in ("call / module", "today: path (backend), PyTorch's reason", "change", "then", "time (median, range)",
                 *(["memory"] if memory else []), "max |Δout|", "verdict, and what the change gives up"):  # fmt: skip
        table.add_column(name, overflow="fold")
    for m in advice.measured:
        style = "green" if m.verdict == RECOMMENDED else None
        where = f"\nat {m.where}" if m.where else ""
        scope = "\nchange to: the whole model" if m.scope is None else ""
        table.add_row(
            f"#{m.call} {m.module or '(root)'}{scope}{where}",
            _today(m),
            Text(m.change, style=style or ""),
            _then(m),
            _speed(m),
            *([f"{m.memory_ratio:.2f}×" if m.memory_ratio is not None else "–"] if memory else []),
            _diff(m),
            Text(f"{m.verdict}\ngives up: {m.gives_up}", style=style or ""),
        )
    parts: list[RenderableType] = [table] if advice.measured else [
        Text(f"qkvtrace advise {advice.target}: no attention call has a change to measure", style="bold")]
    best = advice.recommended
    if best:
        m = best[0]
        on = f"on {m.scope or '(root)'}" if m.scope is not None else "on the whole model"
        parts.append(Text(f"fastest measured: {m.change} {on} — {m.median:.2f}× today's time, "
                          f"{m.path} → {m.path_after}", style="bold green"))  # fmt: skip
    elif advice.measured:
        parts.append(Text("no change was faster in every repetition: none is recommended", style="yellow"))
    for s in advice.settled:
        parts.append(Text(f"#{s['call']} {s['module'] or '(root)'} ({s['path']}): {s['why']}", style="dim"))
    for u in advice.unmeasured:
        parts.append(Text(f"not measured (budget): {u}", style="yellow"))
    parts.append(Text(f"measured in {advice.seconds:.1f} s, {advice.repeats} interleaved repetitions per change, "
                      "each on a deep copy (your model and its random state untouched)", style="dim"))  # fmt: skip
    return Group(*parts)
