"""The history of the attention path across PyTorch releases (``qkvtrace.history/1``).

A history is built from saved reports alone — no PyTorch — by diffing each
release with the one before it (:func:`qkvtrace.analyses.diff.diff_reports`, the very
diff ``qkvtrace diff`` prints) and gathering the changes by item:

* each attention-path function: the releases where its source changed, and
  whether the change was to its code, only to its docstring, or only to
  comments and layout (its syntax tree without docstrings is the same);
* each fast-path condition: the release that added, reworded or removed it,
  with PyTorch's own words;
* each behaviour probe (scenario, mask semantics, fully-masked rows,
  agreement): the release where its result changed, from what to what;
* the call graph: the releases where it gained or lost edges;
* the APIs a release lacks (its report's ``missing``).

Releases are ordered by version number; the order of the inputs does not
matter. Collection only: rendering lives in ``qkvtrace.render.history_render``.
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from qkvtrace.analyses.diff import diff_reports
from qkvtrace.analyses.reportio import load_report
from qkvtrace.base.errors import InputError

__all__ = ["HISTORY_SCHEMA", "build_history", "find_reports", "headline_rows", "source_change", "version_key"]

HISTORY_SCHEMA = "qkvtrace.history/1"


def version_key(version: str) -> tuple[Any, ...]:
    """``"2.10.0+cu128"`` -> ``((2, 10, 0), "2.10.0+cu128")``: numeric order, then the full text."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    numbers = tuple(int(x) for x in match.group(1).split(".")) if match else ()
    return numbers, version


def find_reports(paths: Iterable[str | Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Load every report named: report folders, ``report.json`` files, or folders of report folders.

    Each is validated (:func:`~qkvtrace.analyses.reportio.load_report`); the first
    that fails raises :class:`~qkvtrace.base.errors.SchemaError` naming its file.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file() or (path / "report.json").exists():
            files.append(path if path.is_file() else path / "report.json")
        elif path.is_dir():
            found = sorted(p / "report.json" for p in path.iterdir()
                           if p.is_dir() and not p.name.startswith(".") and (p / "report.json").exists())  # fmt: skip
            if not found:
                raise InputError(f"{path}: holds no report folders (torch-<version>/report.json); "
                                 "collect some with `qkvtrace history --python PY --out DIR`")  # fmt: skip
            files += found
        else:
            raise InputError(f"{path}: does not exist; give a folder of reports or a report.json")
    return [(f, load_report(f)) for f in files]


# -- sources: code, docstring or layout ----------------------------------------


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(text))
    except SyntaxError:  # not Python (a builtin's signature line), or a fragment
        return None


def _split_docstrings(tree: ast.Module) -> tuple[str, list[str]]:
    """The tree's dump without docstrings, and the docstrings in order."""
    docs: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.append(value.value)
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree), docs


def source_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What kind of change one function's source saw: ``code``, ``docstring`` or ``layout``.

    ``layout`` is comments and whitespace only (same syntax tree and
    docstrings). A builtin's recorded text is its signature and
    documentation, so any change to it is ``docstring``: its code is not visible.
    """
    if old.get("kind") == "builtin" and new.get("kind") == "builtin":
        return "docstring"
    a, b = _parse(old["text"]), _parse(new["text"])
    if a is None or b is None:
        return "code"
    code_a, docs_a = _split_docstrings(a)
    code_b, docs_b = _split_docstrings(b)
    if code_a != code_b:
        return "code"
    return "docstring" if docs_a != docs_b else "layout"


# -- building ---------------------------------------------------------------------


def _short(name: str) -> str:
    return name.replace("torch.nn.modules.", "").replace("torch.nn.functional.", "F.")


def build_history(reports: Sequence[tuple[Path | str, dict[str, Any]] | dict[str, Any]]) -> dict[str, Any]:
    """The ``qkvtrace.history/1`` object of these reports (at least two releases)."""
    items = [r if isinstance(r, tuple) else (None, r) for r in reports]
    by_version: dict[str, tuple[Path | str | None, dict[str, Any]]] = {}
    for origin, report in items:
        version = str(report["environment"]["torch_version"])
        if version in by_version:
            raise InputError(f"two reports of torch {version} ({by_version[version][0]} and {origin}); keep one")
        by_version[version] = (origin, report)
    releases = sorted(by_version, key=version_key)
    if len(releases) < 2:
        raise InputError(f"a history needs reports of at least two releases (got {len(releases)})")
    ordered = [by_version[v][1] for v in releases]

    steps: list[dict[str, Any]] = []
    sources: dict[str, dict[str, Any]] = {}
    conditions: list[dict[str, Any]] = []
    probes: dict[tuple[str, str], dict[str, Any]] = {}
    callgraph: list[dict[str, Any]] = []

    first = ordered[0]
    for s in first["sources"]:
        sources[s["name"]] = {"name": s["name"], "kind": s["kind"], "first_seen": releases[0], "changes": []}

    for a, b in itertools.pairwise(ordered):
        diff = diff_reports(a, b)
        prev, now = diff["a"], diff["b"]
        steps.append({"from": prev, "to": now, "summary": diff["summary"]})
        sa = {s["name"]: s for s in a["sources"]}
        sb = {s["name"]: s for s in b["sources"]}
        for name in diff["sources"]["added"]:
            entry = sources.setdefault(name, {"name": name, "kind": sb[name]["kind"], "first_seen": now, "changes": []})
            entry["changes"].append({"release": now, "from": prev, "change": "added"})
        for name in diff["sources"]["removed"]:
            sources[name]["changes"].append({"release": now, "from": prev, "change": "removed"})
        for name in diff["sources"]["changed"]:
            sources[name]["changes"].append({"release": now, "from": prev, "change": source_change(sa[name], sb[name])})
        fp = diff["fast_path_conditions"]
        for c in fp["added"]:
            conditions.append({"release": now, "from": prev, "function": c["function"], "change": "added",
                               "reason": c["reason"], "condition": c["condition"]})  # fmt: skip
        for c in fp["removed"]:
            conditions.append({"release": now, "from": prev, "function": c["function"], "change": "removed",
                               "reason": c["reason"], "condition": c["condition"]})  # fmt: skip
        for c in fp["reworded"]:
            conditions.append({"release": now, "from": prev, "function": c["function"], "change": "reworded",
                               "reason": c["became"], "condition": c["condition_became"],
                               "was": c["was"], "condition_was": c["condition_was"]})  # fmt: skip
        for ch in diff["probes"]["changed"]:
            slot = probes.setdefault((ch["kind"], ch["key"]), {"kind": ch["kind"], "key": ch["key"], "changes": []})
            slot["changes"].append({"release": now, "from": prev, "was": ch["was"], "became": ch["became"]})
        g = diff["callgraph"]
        if g["edges_added"] or g["edges_removed"]:
            callgraph.append({"release": now, "from": prev, "edges_added": g["edges_added"],
                              "edges_removed": g["edges_removed"]})  # fmt: skip

    lacking: dict[str, list[str]] = {}
    for version, report in zip(releases, ordered, strict=True):
        for m in report.get("missing", []):
            lacking.setdefault(m["name"], []).append(version)

    order = {c: i for i, c in enumerate(("added", "reworded", "removed"))}
    conditions.sort(key=lambda c: (version_key(c["release"]), c["function"], order[c["change"]], c["reason"]))
    return {
        "schema": HISTORY_SCHEMA,
        "releases": releases,
        "reports": [
            {
                "torch_version": v,
                # facts about the release and what it could run, never the machine that measured it:
                # a report made again with another Python (or on another machine) is the same release
                "torch_git_version": r["environment"].get("torch_git_version", ""),
                "cuda_available": bool(r["environment"].get("cuda_available", False)),
                "missing": sorted(m["name"] for m in r.get("missing", [])),
            }
            for v, r in zip(releases, ordered, strict=True)
        ],
        "steps": steps,
        "sources": [sources[n] for n in sorted(sources)],
        "fast_path_conditions": conditions,
        "probes": [probes[k] for k in sorted(probes)],
        "callgraph": callgraph,
        "missing": [{"name": n, "releases": v} for n, v in sorted(lacking.items())],
    }


# -- headlines --------------------------------------------------------------------


def _outcome(value: Any) -> str:
    """A probe value in a few words."""
    if value is None:
        return "absent"
    if isinstance(value, dict):
        if "result" in value:
            return str(value["result"])
        if "true_means" in value:
            return f"True means {value['true_means']}"
        if "error" in value:
            return "error"
    if isinstance(value, list):
        paths = sorted({str(c.get("path")) for c in value if isinstance(c, dict)})
        backends = sorted({str(c.get("sdpa_backend") or "none") for c in value if isinstance(c, dict)})
        return f"{'/'.join(paths) or 'no call'} ({'/'.join(backends) or '-'})"
    return str(value)


def headline_rows(history: dict[str, Any]) -> list[tuple[str, str]]:
    """One line per release that changed something, most telling first.

    Every word comes from the history (and so from the reports); nothing is remembered.
    """
    rows: list[tuple[str, str]] = []
    for step in history["steps"]:
        release = step["to"]
        parts: list[str] = []
        kinds: dict[str, int] = {}
        for s in history["sources"]:
            for c in s["changes"]:
                if c["release"] == release:
                    kinds[c["change"]] = kinds.get(c["change"], 0) + 1
        if kinds:
            order = ("code", "docstring", "layout", "added", "removed")
            parts.append("functions: " + ", ".join(f"{kinds[k]} {k}" for k in order if k in kinds))
        reworded = 0
        for c in history["fast_path_conditions"]:
            if c["release"] != release:
                continue
            if c["change"] == "reworded":
                reworded += 1
            else:
                parts.append(f"{_short(c['function'])} fast-path condition {c['change']}: “{c['reason']}”")
        if reworded:
            parts.append(f"{reworded} fast-path condition{'s' if reworded > 1 else ''} reworded")
        for g in history["callgraph"]:
            if g["release"] == release:
                parts.append(f"call graph +{len(g['edges_added'])}/−{len(g['edges_removed'])} edges")
        grouped: dict[str, list[str]] = {}
        moved = 0
        for p in history["probes"]:
            for ch in p["changes"]:
                if ch["release"] != release:
                    continue
                if p["kind"] == "agreement":
                    moved += 1
                    continue
                label = p["kind"].replace("_", " ")
                where = p["key"].split(" / ")[-1] if p["kind"] == "fully_masked_rows" else p["key"]
                grouped.setdefault(f"{label} {_outcome(ch['was'])} → {_outcome(ch['became'])}", []).append(where)
        parts += [f"{label}: {', '.join(dict.fromkeys(where))}" for label, where in grouped.items()]
        if moved:
            parts.append(f"{moved} agreement figure{'s' if moved > 1 else ''} moved")
        if parts:
            rows.append((release, "; ".join(parts)))
    return rows
