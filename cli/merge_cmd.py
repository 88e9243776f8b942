"""``qkvtrace merge FILES...``: combine the per-rank traces of a distributed job and flag disagreements."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qkvtrace.cli._common import check_output_file

__all__ = ["register", "run_merge"]

_HELP = """\
Combine the trace files of a torch.distributed job, one per rank (written by
qkvtrace.records.distributed.save_per_rank: trace.rank0.json, trace.rank1.json, ...),
line their calls up across ranks (the n-th call of each module on every
rank) and flag each call on which the ranks disagree: the path taken, the
SDPA backend, PyTorch's reason for refusing the fast path or the fused
encoder layer, or a call some ranks made and others did not. A rank that
fell off the fast path is a real bug that per-rank logs hide.

The rank of a file comes from its records (rank, world_size: qkvtrace
records them under torch.distributed), else from its name (NAME.rankN.json).
A folder stands for the *.rankN.json files in it. No PyTorch is needed:
files copied from the job's machines merge anywhere.

Long runs merge too: give the JSON Lines files the ranks streamed
(qkvtrace.trace(model, keep="changes", stream_to="run.jsonl") writes
run.rank0.jsonl, run.rank1.jsonl, ... under torch.distributed). Their
changes are lined up by module and step, and every change or combination
(path, kernel, PyTorch's reason, dtype, masks, training) that some ranks
have and others do not is flagged: "rank 1: encoder.attn fast path → MATH
at step 2", alone. Streams with attention health (health_every=N) show each
module's max logit and entropy per rank, first → last, with each rank's
alert; a module on which some ranks alert and others do not is marked.

Exit 0: every rank made the same calls the same way; 1: they disagree (the
table shows where, with the ranks behind each value); 2: bad input (not a
trace, two files of one rank, files of different jobs).
"""

_EPILOG = """\
examples:
  torchrun --nproc-per-node 2 train.py          # each rank: save_per_rank(t, "traces")
  qkvtrace merge traces/ --json merged.json
  qkvtrace merge traces/trace.rank0.json traces/trace.rank1.json
  qkvtrace merge run.rank0.jsonl run.rank1.jsonl   # long runs (keep="changes", stream_to=)
"""


def register(sub: Any) -> None:
    p = sub.add_parser("merge", help="combine per-rank traces of a distributed job; flag ranks that disagree",
                       description=_HELP, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("files", metavar="FILE", type=Path, nargs="+",
                   help="a per-rank trace file (qkvtrace.trace/3, /2 or /1) or long-run stream (.jsonl), "
                        "or a folder of NAME.rankN.json or NAME.rankN.jsonl")  # fmt: skip
    p.add_argument("--json", metavar="OUT", type=Path,
                   help="write the qkvtrace.merge/1 JSON (traces) or qkvtrace.streammerge/1 (streams)")  # fmt: skip
    p.set_defaults(run=run_merge)


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def _why(entry: dict[str, Any]) -> str:
    """PyTorch's reasons as one cell: the MHA's, then the encoder layer's where it differs."""
    why, layer = entry.get("why_not_fast_path"), entry.get("why_not_fused_layer")
    if layer and layer != why:
        return f"{why} (layer: {layer})" if why else f"(layer: {layer})"
    if why:
        return f"{why} (layer: same)" if layer else str(why)
    return "-" if entry.get("path") in ("sdpa", "flex") else "(fast path taken)"


def disagreements_table(merged: dict[str, Any]) -> Table:
    """One block per call the ranks disagree on: the ranks grouped by what they saw."""
    table = Table(title="calls on which the ranks disagree", title_justify="left")
    for name, justify in (("module", "left"), ("call", "right"), ("ranks", "left"), ("path", "left"),
                          ("backend", "left"), ("why not fast path", "left")):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for call in merged["calls"]:
        if not call["differs"]:
            continue
        groups: dict[tuple[Any, ...], list[int]] = {}
        for entry in call["ranks"]:
            key = (None,) if entry["index"] is None else tuple(entry.get(f) for f in ("path", "sdpa_backend",
                   "why_not_fast_path", "why_not_fused_layer"))  # fmt: skip
            groups.setdefault(key, []).append(entry["rank"])
        module = call["module"] or "(root)"
        for i, (key, ranks) in enumerate(sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))):
            first = i == 0
            cells = [module if first else "", str(call["occurrence"]) if first else "", _ranks_text(ranks)]
            if key == (None,):
                cells += [Text("did not make this call", style="italic"), "", ""]
            else:
                entry = dict(
                    zip(("path", "sdpa_backend", "why_not_fast_path", "why_not_fused_layer"), key, strict=True)
                )
                cells += [str(entry["path"]), entry["sdpa_backend"] or "none", _why(entry)]
            table.add_row(*cells, end_section=i == len(groups) - 1)
    return table


def _rank_groups(ranks: list[int], all_ranks: list[int]) -> str:
    """``"1"`` alone, or ``"0-2 (not 3)"``: who did it, and who did not when some did not."""
    missing = [r for r in all_ranks if r not in ranks]
    return _ranks_text(ranks) + (f" (not {_ranks_text(missing)})" if missing else "")


def run_stream_merge(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.cli.summarize_cmd import describe_change, describe_combination
    from qkvtrace.records import atomic_write_text
    from qkvtrace.records.streams import load_rank_streams, merge_streams
    from qkvtrace.render.terminal import Col, records_view

    streams = load_rank_streams(args.files)
    merged = merge_streams(streams)
    ranks = [s.rank for s in streams]
    world = merged["world_size"]
    of_world = (
        f" of world size {world}" if world is not None else " (no world size: streamed outside torch.distributed)"
    )
    steps = sorted({r["steps"] for r in merged["ranks"]})
    shown_steps = f"{steps[0]} steps" if len(steps) == 1 else f"{steps[0]}-{steps[-1]} steps"
    rows = [
        [
            str(c["step"]),
            c["module"] or "(root)",
            describe_change(c["was"], c["became"]),
            _rank_groups(c["ranks"], ranks),
        ]
        for c in merged["changes"]
    ]
    if rows:
        cols = [Col("step", justify="right"), Col("module"), Col("what changed", "text"), Col("ranks")]
        console.print(
            records_view("changes, lined up across ranks", cols, rows, width=console.width, title_cols=2), crop=False
        )
    odd = [
        [
            c["module"] or "(root)",
            describe_combination(c["combo"]),
            _rank_groups([r["rank"] for r in c["ranks"]], ranks),
            ", ".join(f"{r['rank']}: {r['calls'] if r['calls'] is not None else '?'}" for r in c["ranks"]),
        ]
        for c in merged["combinations"]
        if c["differs"]
    ]
    if odd:
        cols = [Col("module"), Col("ran", "text"), Col("ranks"), Col("calls by rank")]
        console.print(
            records_view("combinations only some ranks used", cols, odd, width=console.width, title_cols=1), crop=False
        )
    if merged.get("health"):
        console.print(_health_view(merged["health"], console.width), crop=False)
    versions = {r["torch_version"] for r in merged["ranks"]}
    if len(versions) > 1:
        seen = " · ".join(f"rank {r['rank']}: {r['torch_version']}" for r in merged["ranks"])
        console.print(f"[bold red]torch_version differs[/]: {seen}", soft_wrap=True)
    summary = f"{len(ranks)} ranks ({_ranks_text(ranks)}){of_world} · {shown_steps} · {_changes(len(rows))}"
    if merged["agree"]:
        console.print(
            f"{summary} · [bold green]every rank ran the same kernels and changed at the same steps[/]", soft_wrap=True
        )
    else:
        n = sum(c["differs"] for c in merged["changes"])
        what = [_changes(n)] if n else []
        what += [f"{len(odd)} combination{'' if len(odd) == 1 else 's'}"] if odd else []
        what += ["the PyTorch version"] if len(versions) > 1 else []
        console.print(f"{summary} · [bold red]ranks disagree on {' and '.join(what)}[/]", soft_wrap=True)
    for r in merged["ranks"]:
        if not r["ended"]:
            console.print(
                f"[yellow]rank {r['rank']} ({r['file']}): the run did not end (still running, or stopped)"
                f"{'; ' + r['note'] if r['note'] else ''}[/]",
                soft_wrap=True,
            )
    if merged["missing_ranks"]:
        console.print(f"[yellow]no file for rank(s) {_ranks_text(merged['missing_ranks'])}[/]", soft_wrap=True)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(merged, indent=1) + "\n")
    return 0 if merged["agree"] else 1


def _first_last(pair: list[float] | None) -> str:
    return "-" if pair is None else f"{pair[0]:.3g} → {pair[1]:.3g}"


def _health_view(health: list[dict[str, Any]], width: int) -> Any:
    """Per module and rank: max logit and entropy first → last, and the alert; a module whose ranks alert
    differently is marked."""
    from qkvtrace.render.terminal import Col, records_view

    rows = []
    for h in health:
        for i, r in enumerate(h["ranks"]):
            mark = Text(" ranks differ", style="bold red") if h["differs"] and i == 0 else Text("")
            rows.append([Text(h["module"] or "(root)") + mark if i == 0 else "", str(r["rank"]),
                         _first_last(r["max_logit"]), _first_last(r["entropy"]), r["alert"] or "-"])  # fmt: skip
    cols = [Col("module"), Col("rank", justify="right"), Col("max logit"), Col("entropy (nats)"), Col("alert", "text")]
    return records_view("attention health across ranks (first → last measured step)", cols, rows, width=width,
                        title_cols=2)  # fmt: skip


def _changes(n: int) -> str:
    return f"{n} change" if n == 1 else f"{n} changes"


def run_merge(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.base.errors import InputError
    from qkvtrace.records.distributed import load_rank_traces, merge_traces, save_merged
    from qkvtrace.records.streams import is_stream

    if args.json is not None:
        check_output_file(args.json, "--json")
    kinds = {is_stream(p) for p in args.files}
    if kinds == {True}:
        return run_stream_merge(args, console)
    if len(kinds) > 1:
        raise InputError("give either per-rank trace files (.json) or long-run streams (.jsonl), not both")
    traces = load_rank_traces(args.files)
    merged = merge_traces(traces)
    ranks = [t.rank for t in traces]
    world = merged["world_size"]
    of_world = f" of world size {world}" if world is not None else " (no world size: traced outside torch.distributed)"
    counts = sorted({t["calls"] for t in merged["ranks"]})
    calls = f"{_calls(counts[0])} each" if len(counts) == 1 else f"{counts[0]}-{_calls(counts[-1])}"
    summary = f"{len(ranks)} ranks ({_ranks_text(ranks)}){of_world} · {calls} · {len(merged['calls'])} lined up"
    if merged["disagreements"]:
        if any(d["module"] is not None for d in merged["disagreements"]):
            console.print(disagreements_table(merged))
        for d in merged["disagreements"]:
            if d["module"] is None:  # job-wide: the ranks ran different PyTorch versions
                seen = " · ".join(f"rank {_ranks_text(g['ranks'])}: {g['value']}" for g in d["values"])
                console.print(f"[bold red]{d['field']} differs[/]: {seen}", soft_wrap=True, markup=True)
        n = len({(d["module"], d["occurrence"]) for d in merged["disagreements"]})
        console.print(f"{summary} · [bold red]{_calls(n)} where ranks disagree[/]", soft_wrap=True)
    else:
        console.print(f"{summary} · [bold green]every rank made the same calls the same way[/]", soft_wrap=True)
    if merged["missing_ranks"]:
        console.print(f"[yellow]no file for rank(s) {_ranks_text(merged['missing_ranks'])}[/]", soft_wrap=True)
    if args.json is not None:
        save_merged(merged, args.json)
    return 1 if merged["disagreements"] else 0
