"""``qkvtrace summarize FILE``: read back the JSON Lines a long run wrote."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.records.health_alerts import ENTROPY_ALERT, ENTROPY_DROP, LOGIT_ALERT, LOGIT_GROWTH, alert, series_of
from qkvtrace.records.streams import read_stream
from qkvtrace.render.terminal import Col, records_view

__all__ = ["describe_change", "describe_combination", "register", "run"]

_HELP = """\
Read the JSON Lines file written by qkvtrace.trace(model, keep="changes",
stream_to=FILE) -- while the run goes or after it ended, or died: a last
line cut short by a killed process is left out and said so -- and print:
which kernels the run's calls used, every change (the step and call where a
module's path, backend, PyTorch's reason, dtype, masks or training mode
differed from its previous call, with PyTorch's reason), and, when the run
ended, per module each combination with its calls and first and last step.
With health_every=N, per module its largest pre-softmax logit and its
lowest head's mean attention entropy, first -> last, and an alert at the
first step where the max logit went over 50 and over twice its first value,
or the entropy under 1 nat and under half its first value.

Exits 0 when done, 1 when it printed an alert (a run's health is a check:
a script or CI step can stop on it), 2 on a file it cannot read.
"""


def register(sub: Any) -> None:
    p = sub.add_parser("summarize", help="read back the changes and counts a long run streamed (JSON Lines)",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  qkvtrace summarize run.jsonl\n"
                              "  qkvtrace summarize run.jsonl --html health.html")  # fmt: skip
    p.add_argument("file", metavar="FILE", type=Path, help="the JSON Lines file of stream_to=")
    p.add_argument("--html", metavar="PAGE", type=Path, default=None,
                   help="also write a self-contained page of the attention health curves per module")  # fmt: skip
    p.set_defaults(run=run)


def describe_combination(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    masks = [f"{k}: {c[k]}" for k in ("attn_mask", "key_padding_mask", "merged_mask") if c.get(k)]
    return (f"{c.get('path')} ({c.get('sdpa_backend') or 'none'})" + ("" if c.get("training") else ", eval")
            + "".join(f", {m}" for m in masks))  # fmt: skip


def describe_change(was: dict[str, Any] | None, became: dict[str, Any]) -> str:
    """Each fact that differs: ``name: was → became``."""
    if not was:
        return describe_combination(became)
    parts = [f"{k}: {was.get(k) if was.get(k) is not None else '-'} → {v if v is not None else '-'}"
             for k, v in became.items() if was.get(k) != v]  # fmt: skip
    return "; ".join(parts) or "-"


def _reason(c: dict[str, Any]) -> str:
    return " ".join(str(c.get("why_not_fast_path") or c.get("why_not_fused_layer") or "-").split())


def run(args: argparse.Namespace, console: Console) -> int:
    lines, note = read_stream(args.file)
    start = lines[0]
    steps = [x for x in lines if x["kind"] == "step"]
    events = [x for x in lines if x["kind"] in ("first", "change")]
    end = next((x for x in lines if x["kind"] == "end"), None)
    backends: Counter[str] = Counter()
    for s in steps:
        backends.update(s["backends"])
    total = sum(backends.values())
    last_step = max((s["step"] for s in steps), default=0)
    state = "ended" if end is not None else "did not end (still running, or stopped)"
    n_steps = last_step + 1 if steps else 0
    console.print(
        f"{args.file}: torch {start.get('torch_version')}, {total} calls over {n_steps} steps, run {state}",
        soft_wrap=True,
    )
    if total:
        console.print("kernels: " + ", ".join(f"{b} {n / total:.1%}" for b, n in backends.most_common()))
    changes = [e for e in events if e["kind"] == "change"]
    rows: list[list[Any]] = [
        [
            str(e["step"]),
            f"#{e['call']}",
            e["module"] or "(root)",
            describe_change(e["was"], e["became"]),
            _reason(e["became"]),
        ]
        for e in changes
    ]
    if rows:
        cols = [
            Col("step", justify="right"),
            Col("call", justify="right"),
            Col("module"),
            Col("what changed", "text"),
            Col("reason now (PyTorch's words)", "text"),
        ]
        console.print(records_view(f"{len(rows)} change(s)", cols, rows, width=console.width, title_cols=3), crop=False)
    else:
        console.print("no change: every module kept its first path, kernel and reason")
    if end is not None:
        table: list[list[Any]] = []
        for module, info in end["summary"]["modules"].items():
            for c in info["combinations"]:
                table.append(
                    [
                        module or "(root)",
                        describe_combination(c["combo"]),
                        str(c["calls"]),
                        str(c["first_step"]),
                        str(c["last_step"]),
                    ]
                )
        cols = [
            Col("module"),
            Col("ran", "text"),
            Col("calls", justify="right"),
            Col("first step", justify="right"),
            Col("last step", justify="right"),
        ]
        console.print(records_view("per module", cols, table, width=console.width, title_cols=2), crop=False)
    alerts = _health(lines, console)
    if args.html is not None:
        from qkvtrace.render.health_render import health_page
        from qkvtrace.render.html_page import save_page

        page = save_page(health_page([x for x in lines if x["kind"] == "health"],
                                     title=f"qkvtrace attention health: {args.file.name}"), args.html)  # fmt: skip
        console.print(f"page: {page}", soft_wrap=True, markup=False)
    if note:
        console.print(note, style="yellow")
    return 1 if alerts else 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _health(lines: list[dict[str, Any]], console: Console) -> int:
    """Per module: max logit and lowest head's mean entropy, first → last, and the first alert; how many modules
    had one."""
    found = [x for x in lines if x["kind"] == "health"]
    if not found:
        return 0
    rows: list[list[Any]] = []
    alerts: list[str] = []
    for module, series in series_of(found).items():
        (s0, x0, y0), (s1, x1, y1) = series[0], series[-1]
        rows.append([module or "(root)", f"{s0} → {s1}", f"{_fmt(x0)} → {_fmt(x1)}", f"{_fmt(y0)} → {_fmt(y1)}"])
        said = alert(series)
        if said is not None:
            alerts.append(f"alert {module or '(root)'}: {said}")
    cols = [
        Col("module"),
        Col("steps", justify="right"),
        Col("max logit (any head)", justify="right"),
        Col("entropy, nats (lowest head's mean)", justify="right"),
    ]
    title = f"attention health, {len({x['step'] for x in found})} measured step(s)"
    console.print(records_view(title, cols, rows, width=console.width, title_cols=1), crop=False)
    for line in alerts:
        console.print(line, style="bold red", soft_wrap=True, markup=False)
    if not alerts:
        console.print(
            f"no alert: no max logit over {LOGIT_ALERT:g} and {LOGIT_GROWTH:g}x its first value, no "
            f"entropy under {ENTROPY_ALERT:g} nat and {ENTROPY_DROP:g}x its first value",
            soft_wrap=True,
        )
    return len(alerts)
