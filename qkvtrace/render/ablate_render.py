"""Tables and a chart of an ablation study. Reads :class:`~qkvtrace.analyses.ablate.AblationResult` only.

The chart needs matplotlib, the optional extra ``qkvtrace[plot]``; it is
imported only when a chart is asked for.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from qkvtrace.analyses.ablate import AblationResult, ModeResult
from qkvtrace.base.errors import OutputError

__all__ = ["ablate_chart", "ablate_markdown", "ablate_table", "margin_line", "properties_table"]


def _pm(mean: float, std: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _runs(mode: ModeResult) -> str:
    return " ".join(f"{r.accuracy:.3f}" for r in mode.runs)


def _mean_of(mode: ModeResult, attr: str) -> str:
    shares = [getattr(r, attr) for r in mode.runs if getattr(r, attr) is not None]
    return f"{sum(shares) / len(shares):.2f}" if shares else "-"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def ablate_table(result: AblationResult) -> Table:
    """One row per mode: held-out accuracy and loss (mean ± std), every run, parameters."""
    task = result.task
    table = Table(
        title=f"qkvtrace ablate: task {task['name']}, {result.steps} steps, seeds {', '.join(map(str, result.seeds))}",
        caption=f"held-out {task['eval_size']} examples (train {task['train_size']}), chance "
        f"{task['chance_accuracy']:.3f}; ± sample std over seeds; diag: weight a position puts on itself; "
        "→answer: weight the last position puts on the answer",
    )
    table.add_column("mode", style="bold")
    table.add_column("accuracy", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("accuracy per seed", no_wrap=True)
    table.add_column("train acc", justify="right")
    table.add_column("diag", justify="right")
    table.add_column("→answer", justify="right")
    table.add_column("params", justify="right")
    for m in result.modes:
        train = sum(r.train_accuracy for r in m.runs) / len(m.runs)
        style = None if m.routing else "dim"
        table.add_row(m.mode, _pm(m.accuracy_mean, m.accuracy_std), _pm(m.loss_mean, m.loss_std),
                      _runs(m), f"{train:.3f}", _mean_of(m, "diagonal_share"), _mean_of(m, "answer_weight"),
                      f"{m.parameters:,}", style=style)  # fmt: skip
    return table


def properties_table(result: AblationResult) -> Table:
    """The tutorial's claims about the ablated arithmetic, measured."""
    table = Table(title="the tutorial's claims, measured on this PyTorch")
    table.add_column("claim")
    table.add_column("measured", justify="right")
    table.add_column("held against")
    table.add_column("holds")
    for p in result.properties:
        table.add_row(p.claim, f"{p.measured:.3g}", p.expected, "[green]yes[/]" if p.holds else "[bold red]NO[/]")
    return table


def margin_line(result: AblationResult) -> str:
    """Full against the modes that cannot route, in one sentence (plain text)."""
    margin = result.routing_margin()
    if margin is None:
        return "full and a non-routing mode are needed to compare routing"
    gap = margin["accuracy_gap"]
    every = "every full run is above every uniform/no_attention run" if margin["every_full_run_above"] else (
        "some uniform/no_attention run reaches a full run")  # fmt: skip
    line = f"full - best non-routing mode ({margin['best_non_routing']}): {gap:+.3f} held-out accuracy; {every}"
    if not result.task["routing"]:
        line += " (this task does not need routing: no gap is expected)"
    return line


def ablate_markdown(result: AblationResult) -> str:
    """The same study as a Markdown section (table of modes, then the measured claims)."""
    task = result.task
    lines = [
        f"## Q/K/V ablation: task `{task['name']}`",
        "",
        f"{task['description']}",
        "",
        f"{result.steps} steps, seeds {', '.join(map(str, result.seeds))}, AdamW lr {result.optimizer['lr']:g}, "
        f"batch {result.optimizer['batch_size']}; held-out data: {task['eval_size']} examples "
        f"(train {task['train_size']}); chance {task['chance_accuracy']:.3f}; PyTorch {result.torch_version}. "
        "Mean ± sample std over seeds.",
        "",
        "| mode | what it keeps | accuracy | loss | accuracy per seed | train acc | diag | →answer | params |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for m in result.modes:
        train = sum(r.train_accuracy for r in m.runs) / len(m.runs)
        lines.append(
            f"| `{m.mode}` | {m.description} | {_pm(m.accuracy_mean, m.accuracy_std)} | "
            f"{_pm(m.loss_mean, m.loss_std)} | {_runs(m)} | {train:.3f} | {_mean_of(m, 'diagonal_share')} | "
            f"{_mean_of(m, 'answer_weight')} | {m.parameters:,} |"
        )
    lines += [
        "",
        margin_line(result) + ".",
        "",
        "| claim | measured | held against | holds |",
        "| --- | ---: | --- | --- |",
    ]
    for p in result.properties:
        lines.append(f"| {_cell(p.claim)} | {p.measured:.3g} | {_cell(p.expected)} | {'yes' if p.holds else 'NO'} |")
    return "\n".join(lines) + "\n"


def ablate_chart(result: AblationResult, path: Path) -> Path:
    """Bar chart of held-out accuracy and loss per mode (mean ± std), every run as a dot.

    The format follows the file's suffix (``.svg``, ``.png``, ``.pdf``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutputError(
            f'--plot {str(path)!r}: charts need matplotlib; install it with pip install "qkvtrace[plot]"'
        ) from None
    names = [m.mode for m in result.modes]
    xs = list(range(len(names)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    try:
        for ax, what in zip(axes, ("accuracy", "loss"), strict=True):
            means = [getattr(m, f"{what}_mean") for m in result.modes]
            stds = [getattr(m, f"{what}_std") for m in result.modes]
            colours = ["tab:blue" if m.routing else "tab:gray" for m in result.modes]
            ax.bar(xs, means, yerr=stds, capsize=4, color=colours, alpha=0.75)
            for x, m in zip(xs, result.modes, strict=True):
                ax.plot([x] * len(m.runs), [getattr(r, what) for r in m.runs], "k.", markersize=4)
            ax.set_xticks(xs, names, rotation=30, ha="right")
            ax.set_ylabel(f"held-out {what}")
            if what == "accuracy":
                ax.set_ylim(0, 1.05)
                ax.axhline(result.task["chance_accuracy"], color="tab:red", linestyle="--", linewidth=1)
                ax.text(len(xs) - 0.5, result.task["chance_accuracy"], "chance", color="tab:red", ha="right",
                        va="bottom", fontsize=8)  # fmt: skip
        fig.suptitle(f"task {result.task['name']}: mean ± std over {len(result.seeds)} seeds, "
                     f"{result.steps} steps (grey: cannot route)")  # fmt: skip
        fig.tight_layout()
        fig.savefig(path, metadata={"Date": None} if str(path).endswith(".svg") else None)
    finally:
        plt.close(fig)
    return path
