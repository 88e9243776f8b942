"""The table of ``qkvtrace advise``: each measured change, recommended ones first."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from qkvtrace.analyses.advice_rules import CALLED_BY_QKVTRACE
from qkvtrace.analyses.advise import RECOMMENDED, Advice, Measured

__all__ = ["WIDE", "advise_table"]


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
    spread = f"{m.median:.2f}×\n{min(m.ratios):.2f}–{max(m.ratios):.2f}"
    if m.discarded:
        spread += f"\n({m.discarded} broken sample{'s' * (m.discarded > 1)} taken again)"
    if m.measured_on != "core":
        return spread
    model = f"\nwhole model ≈ {m.model_median:.2f}× (estimate)" if m.model_median is not None else ""
    return f"attention core alone:\n{spread}{model}"


def _headline(m: Measured) -> str:
    on = f"on {m.scope or '(root)'}" if m.scope is not None else "on the whole model"
    moved = f"{m.path} → {m.path_after}"
    if m.measured_on != "core":
        return f"fastest measured: {m.change} {on} — {m.median:.2f}× the whole model's time, {moved}"
    share = f"; that code is {m.core_share:.0%} of its time" if m.core_share is not None else ""
    model = (f"; the whole model ≈ {m.model_median:.2f}× (estimated from the core's time{share})"
             if m.model_median is not None else "")  # fmt: skip
    return f"fastest measured: {m.change} {on} — the attention core alone: {m.median:.2f}× its time{model}, {moved}"


def _diff(m: Measured) -> str:
    if m.max_abs_diff is None:
        return "–"
    out = f"{m.max_abs_diff:.2g}"
    return out + (f"\ngrad {m.max_abs_grad_diff:.2g}" if m.max_abs_grad_diff is not None else "")


#: below this many columns each measured change is shown as its own block of fields, one per line (a table of
#: seven columns would cut words in two)
WIDE = 140


def advise_table(advice: Advice, width: int | None = None) -> Group:
    """What ``qkvtrace advise`` prints: the table of measured changes (``width`` below :data:`WIDE`: one block of
    fields per change), what was recommended, the calls left as they are, and how it was measured."""
    mode = "training step" if advice.train else "inference forward (eval)"
    title = f"qkvtrace advise {advice.target} — {mode}, torch {advice.torch_version}, {advice.device}"
    memory = any(m.memory_ratio is not None for m in advice.measured)  # peak memory is measured on CUDA only
    # each field's heading in the table, and its name in a block (``width`` below :data:`WIDE`)
    fields = [("call / module", "call"), ("today: path (backend), PyTorch's reason", "today"), ("change", "change"),
              ("then", "then"), ("time changed / today (median, range)", "time"),
              *([("memory", "memory")] if memory else []), ("max |Δout|", "max |Δout|"),
              ("verdict, and what the change gives up", "verdict")]  # fmt: skip
    rows: list[tuple[str | Text, ...]] = []
    for m in advice.measured:
        style = "green" if m.verdict == RECOMMENDED else ""
        where = "" if not m.where else f"\n{m.where}" if m.where == CALLED_BY_QKVTRACE else f"\nat {m.where}"
        scope = "\nchange to: the whole model" if m.scope is None else ""
        rows.append((
            f"#{m.call} {m.module or '(root)'}{scope}{where}", _today(m), Text(m.change, style=style), _then(m),
            _speed(m), *([f"{m.memory_ratio:.2f}×" if m.memory_ratio is not None else "–"] if memory else []),
            _diff(m), Text(f"{m.verdict}\ngives up: {m.gives_up}", style=style),
        ))  # fmt: skip
    shown: list[RenderableType]
    if width is not None and width < WIDE:
        shown = [Text(title)]
        for row in rows:
            block = Table(show_header=False, show_lines=False, box=None, padding=(0, 1))
            block.add_column(style="dim", no_wrap=True)
            block.add_column(overflow="fold")
            for (_, name), value in zip(fields, row, strict=True):
                block.add_row(name, value)
            shown += [Text(""), block]
    else:
        table = Table(title=title, show_lines=True, title_justify="left")
        for heading, _ in fields:
            table.add_column(heading, overflow="fold")
        for row in rows:
            table.add_row(*row)
        shown = [table]
    parts: list[RenderableType] = shown if advice.measured else [
        Text(f"qkvtrace advise {advice.target}: no attention call has a change to measure", style="bold")]
    best = advice.recommended
    if best:
        parts.append(Text(_headline(best[0]), style="bold green"))
    elif advice.measured:
        parts.append(Text("no change was faster in every repetition: none is recommended", style="yellow"))
    for s in advice.settled:
        parts.append(Text(f"#{s['call']} {s['module'] or '(root)'} ({s['path']}): {s['why']}", style="dim"))
    for u in advice.unmeasured:
        parts.append(Text(f"not measured (budget): {u}", style="yellow"))
    timed = sum(1 for m in advice.measured if m.ratios)
    if timed:
        parts.append(Text(f"measured in {advice.seconds:.1f} s: {timed} change{'s' if timed != 1 else ''} timed, "
                          f"{advice.repeats} interleaved repetitions each, on deep copies "
                          "(your model and its random state untouched)", style="dim"))  # fmt: skip
    else:
        parts.append(Text(f"nothing was timed: no change to measure ({advice.seconds:.1f} s to find that out, "
                          "on a deep copy; your model and its random state untouched)", style="dim"))  # fmt: skip
    return Group(*parts)
