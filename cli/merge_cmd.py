"""``qkvtrace merge FILES...``: combine the per-rank traces of a distributed job and flag disagreements."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qkvtrace.cli._common import check_output_file

__all__ = ["register", "run_merge"]

_HELP = """\
Combine the trace files of a torch.distributed job, one per rank (written by
qkvtrace.distributed.save_per_rank: trace.rank0.json, trace.rank1.json, ...),
line their calls up across ranks (the n-th call of each module on every
rank) and flag each call on which the ranks disagree: the path taken, the
SDPA backend, PyTorch's reason for refusing the fast path or the fused
encoder layer, or a call some ranks made and others did not. A rank that
fell off the fast path is a real bug that per-rank logs hide.

The rank of a file comes from its records (rank, world_size: qkvtrace
records them under torch.distributed), else from its name (NAME.rankN.json).
A folder stands for the *.rankN.json files in it. No PyTorch is needed:
files copied from the job's machines merge anywhere.

Exit 0: every rank made the same calls the same way; 1: they disagree (the
table shows where, with the ranks behind each value); 2: bad input (not a
trace, two files of one rank, files of different jobs).
"""

_EPILOG = """\
examples:
  torchrun --nproc-per-node 2 train.py          # each rank: save_per_rank(t, "traces")
  qkvtrace merge traces/ --json merged.json
  qkvtrace merge traces/trace.rank0.json traces/trace.rank1.json
"""


def register(sub: Any) -> None:
    p = sub.add_parser("merge", help="combine per-rank traces of a distributed job; flag ranks that disagree",
                       description=_HELP, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("files", metavar="FILE", type=Path, nargs="+",
                   help="a per-rank trace file (qkvtrace.trace/2 or /1), or a folder of NAME.rankN.json")  # fmt: skip
    p.add_argument("--json", metavar="OUT", type=Path, help="write the qkvtrace.merge/1 JSON (all ranks' traces)")
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


def run_merge(args: argparse.Namespace, console: Console) -> int:
    from qkvtrace.distributed import load_rank_traces, merge_traces, save_merged

    if args.json is not None:
        check_output_file(args.json, "--json")
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
