"""The JSON Lines files of long runs: reading one back, and merging the ranks of a job.

A long run (``qkvtrace.trace(model, keep="changes", stream_to=FILE)``)
streams ``qkvtrace.stream/1`` lines while it goes. Under ``torch.distributed``
every rank streams its own file (``run.jsonl`` becomes ``run.rank0.jsonl``,
``run.rank1.jsonl``, ... unless the name holds ``{rank}``), and
``qkvtrace merge`` reads them here: :func:`merge_streams` lines the ranks'
combinations and changes up and flags what some ranks did and others did
not -- a rank that moved to another kernel at step 31,207 while the others
stayed is the bug that per-rank logs hide. Nothing here needs PyTorch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvtrace.base.errors import InputError
from qkvtrace.records.distributed import one_per_rank, rank_files_in, rank_in_name

__all__ = [
    "STREAM_MERGE_SCHEMA",
    "RankStream",
    "is_stream",
    "load_rank_streams",
    "merge_streams",
    "rank_stream_path",
    "read_stream",
]

STREAM_MERGE_SCHEMA = "qkvtrace.streammerge/1"


def rank_stream_path(path: str | os.PathLike[str], rank: int | None, world_size: int | None) -> Path:
    """Where this rank streams: ``{rank}`` in the name filled in; else, in a job of more than one
    rank, ``.rankN`` put before the suffix (``run.jsonl`` -> ``run.rank1.jsonl``): ranks never share a file."""
    text = os.fspath(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank or 0)))
    p = Path(text)
    if rank is None or (world_size or 1) <= 1:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def read_stream(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The lines of a stream, each checked against ``qkvtrace.stream/1``; and a note on a cut last line."""
    from qkvtrace.records.validation import check_document

    if not path.is_file():
        raise InputError(f"{path}: no such file; give the file written by stream_to=")
    lines: list[dict[str, Any]] = []
    note = None
    raw = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for n, text in enumerate(raw, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            if n == len(raw):  # a process killed mid-write leaves its last line cut
                note = f"line {n} is cut short (the run was stopped while writing it); left out"
                continue
            raise InputError(f"{path}: line {n} is not JSON; is it a qkvtrace stream?") from None
        check_document(line, name=f"{path}:{n}", expected="qkvtrace.stream/1")
        lines.append(line)
    if not lines or lines[0].get("kind") != "start":
        raise InputError(f"{path}: does not begin with a qkvtrace stream's start line")
    return lines, note


def is_stream(path: Path) -> bool:
    """A long run's JSON Lines file (or a folder of per-rank ones), rather than a trace file."""
    if path.is_dir():
        return any(p.suffix == ".jsonl" and rank_in_name(p) is not None for p in path.iterdir())
    return path.suffix == ".jsonl"


# -- the ranks of a job -----------------------------------------------------------------------


@dataclass(frozen=True)
class RankStream:
    """One rank's stream, read and checked."""

    rank: int
    world_size: int | None
    name: str
    lines: list[dict[str, Any]]
    #: a cut last line left out (the rank was stopped while writing)
    note: str | None

    @property
    def start(self) -> dict[str, Any]:
        return self.lines[0]

    @property
    def end(self) -> dict[str, Any] | None:
        return next((x for x in self.lines if x["kind"] == "end"), None)

    def events(self) -> list[dict[str, Any]]:
        return [x for x in self.lines if x["kind"] in ("first", "change")]


def _read_rank(path: Path) -> RankStream:
    lines, note = read_stream(path)
    start = lines[0]
    rank = start.get("rank")
    if rank is None:  # streamed outside torch.distributed: the file name says
        rank = rank_in_name(path)
        if rank is None:
            raise InputError(f"{path}: its start line carries no rank and its name has none (NAME.rankN.jsonl)")
    return RankStream(int(rank), start.get("world_size"), path.name, lines, note)


def load_rank_streams(paths: Iterable[str | os.PathLike[str]]) -> list[RankStream]:
    """Read per-rank streams (a folder stands for its ``*.rankN.jsonl``), sorted by rank; one per rank."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(rank_files_in(p, ".jsonl", "streams") if p.is_dir() else [p])
    return one_per_rank([_read_rank(f) for f in files], "stream")


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def merge_streams(streams: Sequence[RankStream]) -> dict[str, Any]:
    """The ranks' combinations and changes lined up (``qkvtrace.streammerge/1``).

    A combination (path, backend, PyTorch's reasons, dtype, masks, training)
    is lined up by module; a change by module, step and what it was and
    became. Either differs when some ranks have it and others do not.
    """
    ranks = [s.rank for s in streams]
    worlds = {s.world_size for s in streams if s.world_size is not None}
    world = worlds.pop() if worlds else None
    combos: dict[str, dict[str, Any]] = {}
    changes: dict[str, dict[str, Any]] = {}
    for s in streams:
        end = s.end
        counted = {} if end is None else end["summary"]["modules"]
        for event in s.events():
            key = _key(event["module"], event["became"])
            entry = combos.setdefault(key, {"module": event["module"], "combo": event["became"], "ranks": {}})
            entry["ranks"].setdefault(
                s.rank, {"rank": s.rank, "calls": None, "first_step": event["step"], "last_step": None}
            )
            if event["kind"] == "change":
                ckey = _key(event["module"], event["step"], event["was"], event["became"])
                change = changes.setdefault(
                    ckey,
                    {
                        "module": event["module"],
                        "step": event["step"],
                        "was": event["was"],
                        "became": event["became"],
                        "ranks": [],
                    },
                )
                if s.rank not in change["ranks"]:
                    change["ranks"].append(s.rank)
        for module, info in counted.items():  # the run ended: its counts per combination
            for c in info["combinations"]:
                used = combos.get(_key(module, c["combo"]))
                if used is not None and s.rank in used["ranks"]:
                    used["ranks"][s.rank].update(calls=c["calls"], first_step=c["first_step"], last_step=c["last_step"])
    combo_rows = [
        {**c, "ranks": [c["ranks"][r] for r in sorted(c["ranks"])], "differs": sorted(c["ranks"]) != ranks}
        for c in combos.values()
    ]
    change_rows = sorted(
        ({**c, "ranks": sorted(c["ranks"]), "differs": sorted(c["ranks"]) != ranks} for c in changes.values()),
        key=lambda c: (c["step"], c["module"]),
    )
    versions = {s.rank: s.start.get("torch_version") for s in streams}
    disagree = (
        any(c["differs"] for c in combo_rows)
        or any(c["differs"] for c in change_rows)
        or len(set(versions.values())) > 1
    )
    health = _health_across(streams)
    return {
        "schema": STREAM_MERGE_SCHEMA,
        "world_size": world,
        "ranks": [
            {
                "rank": s.rank,
                "file": s.name,
                "torch_version": s.start.get("torch_version"),
                "steps": max((x["step"] for x in s.lines if x["kind"] == "step"), default=-1) + 1,
                "calls": sum(x["calls"] for x in s.lines if x["kind"] == "step"),
                "ended": s.end is not None,
                "note": s.note,
            }
            for s in streams
        ],
        "missing_ranks": sorted(set(range(world)) - set(ranks)) if world is not None else [],
        "combinations": combo_rows,
        "changes": change_rows,
        **({"health": health} if health else {}),
        "agree": not disagree,
    }


def _health_across(streams: Sequence[RankStream]) -> list[dict[str, Any]]:
    """Per module, each rank's attention health (``health`` lines): first and last max logit and lowest head
    entropy, and its alert; ``differs`` when some ranks alert and others do not, or alert for another reason."""
    from qkvtrace.records.health_alerts import alert, series_of

    modules: dict[str, list[dict[str, Any]]] = {}
    for s in streams:
        for module, series in series_of([x for x in s.lines if x["kind"] == "health"]).items():
            logits = [x for _, x, _ in series if x is not None]
            entropies = [y for _, _, y in series if y is not None]
            modules.setdefault(module, []).append({
                "rank": s.rank, "steps": len(series), "first_step": series[0][0], "last_step": series[-1][0],
                "max_logit": [logits[0], logits[-1]] if logits else None,
                "entropy": [entropies[0], entropies[-1]] if entropies else None,
                "alert": alert(series),
            })  # fmt: skip
    return [{"module": module, "ranks": ranks, "differs": len({_alerted(r["alert"]) for r in ranks}) > 1}
            for module, ranks in sorted(modules.items())]  # fmt: skip


def _alerted(text: str | None) -> frozenset[str]:
    """What an alert is about: ``max logit``, ``entropy``, both or neither."""
    parts = (text or "").split("; ")
    return frozenset(k for k in ("max logit", "entropy") if any(p.startswith(k) for p in parts))
