"""Traces of a ``torch.distributed`` job: one file per rank, and merging them.

qkvtrace does not launch anything: a job runs under ``torchrun`` (or any
launcher that sets up ``torch.distributed``), every rank traces its own
model (a ``DistributedDataParallel`` or ``fully_shard`` wrapped one is
fine: records carry ``rank`` and ``world_size`` and name modules as in the
unwrapped model), and writes its own file::

    with qkvtrace.trace(ddp_model) as t:
        loss = ddp_model(batch).sum(); loss.backward()
    qkvtrace.records.distributed.save_per_rank(t, "traces")     # traces/trace.rank0.json, trace.rank1.json, ...

``qkvtrace merge traces/ --json merged.json`` (:func:`merge_traces`) then
lines the ranks' calls up — the n-th call of each module on every rank —
and flags each call on which ranks disagree about the path, the SDPA
backend or PyTorch's reasons, or which some ranks made and others did not:
a rank that fell off the fast path (a mask built differently on one rank,
a shape that differs with the data) is a real bug that per-rank logs hide.

Nothing here talks to other ranks: each process writes its file, and the
merge reads files, anywhere, without PyTorch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvtrace.base.errors import InputError, OutputError
from qkvtrace.records import TRACE_SCHEMAS, TraceResult, atomic_write_text

__all__ = [
    "COMPARED_FIELDS",
    "MERGE_SCHEMA",
    "RankTrace",
    "load_rank_traces",
    "merge_traces",
    "one_per_rank",
    "rank_file_name",
    "rank_files_in",
    "rank_in_name",
    "save_merged",
    "save_per_rank",
]

MERGE_SCHEMA = "qkvtrace.merge/1"

#: What ranks must agree on for each call (the words of ``AttentionCall``).
COMPARED_FIELDS = ("path", "sdpa_backend", "why_not_fast_path", "why_not_fused_layer")

_RANK_IN_NAME = re.compile(r"rank(\d+)")


def rank_file_name(rank: int, stem: str = "trace") -> str:
    """``trace.rank3.json`` for rank 3."""
    return f"{stem}.rank{rank}.json"


def _this_rank() -> int:
    """The rank of this process: ``torch.distributed``'s when initialised, else torchrun's ``RANK``, else 0."""
    from qkvtrace.base import compat

    rank, _ = compat.distributed_rank()
    if rank is not None:
        return rank
    env = os.environ.get("RANK", "")
    return int(env) if env.isdigit() else 0


def save_per_rank(trace: Any, directory: str | os.PathLike[str], *, stem: str = "trace") -> Path:
    """Write ``trace`` (a :class:`~qkvtrace.Trace` or :class:`~qkvtrace.TraceResult`) as ``DIR/trace.rankN.json``.

    ``N`` is this process's rank in ``torch.distributed`` (torchrun's
    ``RANK`` before the process group exists; 0 in a job of one process).
    ``directory`` is created if missing (every rank may race to create it).
    The file is written atomically; returns its path.
    """
    result = trace.result if hasattr(trace, "result") else trace
    if not isinstance(result, TraceResult):
        raise TypeError(f"save_per_rank needs a qkvtrace trace or TraceResult, got {type(trace).__name__}")
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{folder}: cannot create the folder for per-rank traces ({exc.strerror or exc})") from None
    return result.save(folder / rank_file_name(_this_rank(), stem))


# -- reading the files of a job ----------------------------------------------------------


@dataclass(frozen=True)
class RankTrace:
    """One rank's trace file, read and checked."""

    rank: int
    world_size: int | None
    #: the file's name (no folder: merged files hold no absolute paths)
    name: str
    data: dict[str, Any]


def rank_in_name(path: Path) -> int | None:
    """The ``N`` of ``NAME.rankN.json`` (or ``.jsonl``), ``None`` for a name with no rank."""
    named = _RANK_IN_NAME.findall(path.name)
    return int(named[-1]) if named else None


def rank_files_in(folder: Path, suffix: str = ".json", what: str = "trace files") -> list[Path]:
    """The per-rank files in ``folder`` (``*.rank<N>`` + ``suffix``), by rank."""
    found = [p for p in folder.iterdir() if p.suffix == suffix and rank_in_name(p) is not None]
    if not found:
        raise InputError(f"{folder}: no per-rank {what} (NAME.rankN{suffix}) in this folder")
    return sorted(found, key=lambda p: (rank_in_name(p), p.name))


def _record_values(data: dict[str, Any], key: str) -> set[int]:
    records = [*data["calls"], *data["gradients"]]
    return {r[key] for r in records if r.get(key) is not None}


def _read_one(path: Path) -> RankTrace:
    from qkvtrace.records.validation import load_json

    data = load_json(path, TRACE_SCHEMAS)
    ranks = _record_values(data, "rank")
    worlds = _record_values(data, "world_size")
    if len(ranks) > 1:
        raise InputError(f"{path}: holds records of ranks {sorted(ranks)}; give one file per rank")
    if len(worlds) > 1:
        raise InputError(f"{path}: holds records of world sizes {sorted(worlds)}; give the files of one job")
    if ranks:
        rank = ranks.pop()
    else:  # a trace with no records, or from outside torch.distributed: the file name says
        named = rank_in_name(path)
        if named is None:
            raise InputError(
                f"{path}: its records carry no rank and its name has none (NAME.rankN.json); "
                "write it with qkvtrace.records.distributed.save_per_rank or rename it"
            )
        rank = named
    return RankTrace(rank, worlds.pop() if worlds else None, path.name, data)


def load_rank_traces(paths: Iterable[str | os.PathLike[str]]) -> list[RankTrace]:
    """Read per-rank trace files (a folder stands for its ``*.rankN.json``), sorted by rank.

    Raises :class:`~qkvtrace.base.errors.QkvtraceError` (one line) for a file that
    is not a trace, two files of one rank, or files of jobs of different sizes.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(rank_files_in(p) if p.is_dir() else [p])
    return one_per_rank([_read_one(p) for p in files], "trace")


def one_per_rank(files: Sequence[Any], what: str) -> list[Any]:
    """``files`` (each with ``rank``, ``world_size`` and ``name``) sorted by rank; refused when two share a
    rank or they come from jobs of different world sizes. ``what`` names them in messages."""
    if not files:
        raise InputError(f"no {what} files given")
    by_rank: dict[int, Any] = {}
    for f in files:
        other = by_rank.get(f.rank)
        if other is not None:
            raise InputError(f"{other.name} and {f.name} are both rank {f.rank}; give one file per rank")
        by_rank[f.rank] = f
    worlds = {f.world_size for f in files if f.world_size is not None}
    if len(worlds) > 1:
        shown = ", ".join(f"{f.name}: {f.world_size}" for f in files if f.world_size is not None)
        raise InputError(f"the files come from jobs of different world sizes ({shown}); give the files of one job")
    return [by_rank[r] for r in sorted(by_rank)]


# -- merging -------------------------------------------------------------------------------


def _aligned(traces: Sequence[RankTrace]) -> list[tuple[str, int, dict[int, dict[str, Any]]]]:
    """Calls lined up across ranks: ``(module, occurrence, {rank: call})``, in first-seen order.

    The n-th call of a module on one rank is matched with the n-th call of
    that module on every other rank: execution order within a module, which
    holds for data-parallel jobs whatever the ranks' interleaving of modules.
    """
    slots: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    order: dict[tuple[str, int], tuple[int, int]] = {}
    for t in traces:
        seen: dict[str, int] = {}
        for call in t.data["calls"]:
            n = seen.get(call["module"], 0)
            seen[call["module"]] = n + 1
            key = (call["module"], n)
            slots.setdefault(key, {})[t.rank] = call
            order.setdefault(key, (call["index"], t.rank))
    keys = sorted(slots, key=lambda k: (order[k], k))
    return [(module, n, slots[(module, n)]) for module, n in keys]


def _values(per_rank: dict[int, Any]) -> list[dict[str, Any]]:
    """``[{"value": v, "ranks": [...]}, ...]``: ranks grouped by what they saw, the most common first."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for rank in sorted(per_rank):
        value = per_rank[rank]
        groups.setdefault(repr(value), (value, []))[1].append(rank)
    ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), g[1][0]))
    return [{"value": value, "ranks": ranks} for value, ranks in ordered]


def merge_traces(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """The ``qkvtrace.merge/1`` document of per-rank traces (see ``qkvtrace/schemas/merge-1.json``).

    ``disagreements`` lists, per call and field, the values the ranks saw
    (field ``present`` for a call some ranks did not make); empty when
    every rank made the same calls the same way. ``agree`` says which.
    """
    ranks = [t.rank for t in traces]
    world = next((t.world_size for t in traces if t.world_size is not None), None)
    calls: list[dict[str, Any]] = []
    disagreements: list[dict[str, Any]] = []
    for module, n, per_rank in _aligned(traces):
        first = per_rank[min(per_rank)]
        differs: list[str] = []
        if len(per_rank) != len(ranks):
            differs.append("present")
            disagreements.append({"module": module, "occurrence": n, "field": "present",
                                  "values": _values({r: r in per_rank for r in ranks})})  # fmt: skip
        for field in COMPARED_FIELDS:
            seen = {r: c.get(field) for r, c in per_rank.items()}
            if len({repr(v) for v in seen.values()}) > 1:
                differs.append(field)
                disagreements.append({"module": module, "occurrence": n, "field": field, "values": _values(seen)})
        calls.append(
            {
                "module": module,
                "occurrence": n,
                "module_type": first["module_type"],
                "ranks": [
                    {"rank": r, "index": per_rank[r]["index"], **{f: per_rank[r].get(f) for f in COMPARED_FIELDS}}
                    if r in per_rank
                    else {"rank": r, "index": None}
                    for r in ranks
                ],
                "differs": differs,
            }
        )
    versions = {t.rank: t.data.get("torch_version", "") for t in traces}
    if len(set(versions.values())) > 1:
        disagreements.append({"module": None, "occurrence": None, "field": "torch_version",
                              "values": _values(versions)})  # fmt: skip
    missing = sorted(set(range(world)) - set(ranks)) if world is not None else []
    return {
        "schema": MERGE_SCHEMA,
        "world_size": world,
        "ranks": [
            {
                "rank": t.rank,
                "file": t.name,
                "calls": len(t.data["calls"]),
                "gradients": len(t.data["gradients"]),
                "trace": t.data,
            }
            for t in traces
        ],
        "missing_ranks": missing,
        "compared": list(COMPARED_FIELDS),
        "calls": calls,
        "disagreements": disagreements,
        "agree": not disagreements,
    }


def save_merged(document: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a merged document atomically (sorted keys, as every qkvtrace JSON)."""
    import json

    return atomic_write_text(Path(path), json.dumps(document, indent=2, sort_keys=True) + "\n")
