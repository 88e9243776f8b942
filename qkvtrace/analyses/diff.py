"""Compare two per-version reports (``qkvtrace.diff/1``).

Works on the saved JSON alone: no PyTorch needed, so any machine can diff
reports made elsewhere. Pure line-number moves are not changes (a source's
identity is its text's sha256); close versions give a nearly empty diff.
"""

from __future__ import annotations

import difflib
from typing import Any

from qkvtrace.analyses.reportio import REPORT_SCHEMA, errors_agree
from qkvtrace.records.validation import check_document

__all__ = ["DIFF_SCHEMA", "diff_reports", "summary_line"]

DIFF_SCHEMA = "qkvtrace.diff/1"



def _version(report: dict[str, Any]) -> str:
    return str(report["environment"]["torch_version"])


def _sources(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, str]]:
    sa = {s["name"]: s for s in a["sources"]}
    sb = {s["name"]: s for s in b["sources"]}
    changed = sorted(n for n in sa.keys() & sb.keys() if sa[n]["sha256"] != sb[n]["sha256"])
    diffs = {}
    for name in changed:
        lines = difflib.unified_diff(
            sa[name]["text"].splitlines(keepends=True),
            sb[name]["text"].splitlines(keepends=True),
            fromfile=f"{_version(a)}/{sa[name].get('file') or name}",
            tofile=f"{_version(b)}/{sb[name].get('file') or name}",
            n=2,
        )
        diffs[name] = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return {
        "changed": changed,
        "added": sorted(sb.keys() - sa.keys()),
        "removed": sorted(sa.keys() - sb.keys()),
    }, diffs


def _conditions(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    ca = {blk["function"]: blk["conditions"] for blk in a["fast_path_conditions"]}
    cb = {blk["function"]: blk["conditions"] for blk in b["fast_path_conditions"]}
    added: list[dict[str, str]] = []
    removed: list[dict[str, str]] = []
    reworded: list[dict[str, str]] = []
    for function in sorted(ca.keys() | cb.keys()):
        old = {(c["reason"], c["condition"]) for c in ca.get(function, [])}
        new = {(c["reason"], c["condition"]) for c in cb.get(function, [])}
        gone, came = sorted(old - new), sorted(new - old)
        # same condition, other words (or same words, other condition): a rewording
        for reason, condition in list(gone):
            match = next((n for n in came if n[1] == condition or n[0] == reason), None)
            if match is not None:
                reworded.append({"function": function, "was": reason, "became": match[0],
                                 "condition_was": condition, "condition_became": match[1]})  # fmt: skip
                gone.remove((reason, condition))
                came.remove(match)
        removed += [{"function": function, "reason": r, "condition": c} for r, c in gone]
        added += [{"function": function, "reason": r, "condition": c} for r, c in came]
    return {"added": added, "removed": removed, "reworded": reworded}


def _edges(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    ea = {(e["caller"], e["callee"]) for e in a["callgraph"]["edges"]}
    eb = {(e["caller"], e["callee"]) for e in b["callgraph"]["edges"]}
    return {
        "edges_added": [{"caller": x, "callee": y} for x, y in sorted(eb - ea)],
        "edges_removed": [{"caller": x, "callee": y} for x, y in sorted(ea - eb)],
    }


_SCENARIO_KEYS = ("module", "path", "sdpa_backend", "why_not_fast_path", "why_not_fused_layer")


def _scenario_view(s: dict[str, Any], refusals: bool = False) -> Any:
    if s.get("error"):
        return {"error": s["error"]}
    keys = (*_SCENARIO_KEYS, "sdpa_refusals") if refusals else _SCENARIO_KEYS
    return [{k: c.get(k) for k in keys} for c in s["calls"]]


def _asks_refusals(probes: dict[str, Any]) -> bool:
    """Reports made before refusals were recorded on every device have no ``sdpa_refusals`` key."""
    return any("sdpa_refusals" in c for s in probes.get("scenarios", []) for c in s.get("calls") or [])


def _agreement_moved(x: float | None, y: float | None) -> bool:
    """An agreement figure moved when it appeared, vanished, or left
    :func:`~qkvtrace.analyses.reportio.errors_agree`."""
    return not errors_agree(x, y)


def _probes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    pa, pb = a.get("probes", {}), b.get("probes", {})
    changed: list[dict[str, Any]] = []

    sa = {s["name"]: s for s in pa.get("scenarios", [])}
    sb = {s["name"]: s for s in pb.get("scenarios", [])}
    refusals = _asks_refusals(pa) and _asks_refusals(pb)  # compared only where both reports asked
    for name in sorted(sa.keys() | sb.keys()):
        was = _scenario_view(sa[name], refusals) if name in sa else None
        became = _scenario_view(sb[name], refusals) if name in sb else None
        if was != became:
            changed.append({"kind": "scenario", "key": name, "was": was, "became": became})

    def keyed(items: list[dict[str, Any]], key: tuple[str, ...], fields: tuple[str, ...], kind: str,
              other: list[dict[str, Any]]) -> None:  # fmt: skip
        ia = {tuple(i.get(k) for k in key): i for i in items}
        ib = {tuple(i.get(k) for k in key): i for i in other}
        for k in sorted(ia.keys() | ib.keys(), key=str):
            was = {f: ia[k].get(f) for f in fields} if k in ia else None
            became = {f: ib[k].get(f) for f in fields} if k in ib else None
            if was != became:
                changed.append({"kind": kind, "key": " / ".join(str(x) for x in k if x is not None),
                                "was": was, "became": became})  # fmt: skip

    keyed(pa.get("mask_semantics", []), ("api",), ("true_means", "masked_prob_zero", "rows_sum_to_one"),
          "mask_semantics", pb.get("mask_semantics", []))  # fmt: skip
    keyed(pa.get("fully_masked_rows", []), ("api", "backend"), ("result", "grad_finite"), "fully_masked_rows",
          pb.get("fully_masked_rows", []))  # fmt: skip
    if pa.get("inductor", {}).get("forms") and pb.get("inductor", {}).get("forms"):  # measured in both
        keyed(pa["inductor"]["forms"], ("form", "mode"), ("fused", "kernel"), "inductor", pb["inductor"]["forms"])

    ag_a, ag_b = pa.get("agreement", {}), pb.get("agreement", {})
    fa = {(r["backend"], r["dtype"]): r.get("max_abs_diff") for r in ag_a.get("sdpa", [])}
    fb = {(r["backend"], r["dtype"]): r.get("max_abs_diff") for r in ag_b.get("sdpa", [])}
    for k in sorted(fa.keys() | fb.keys()):
        if _agreement_moved(fa.get(k), fb.get(k)):
            changed.append({"kind": "agreement", "key": f"SDPA {k[0]} {k[1]}", "was": fa.get(k), "became": fb.get(k)})
    ma = {r["path"]: r["max_abs_diff_to_by_hand"] for r in ag_a.get("mha", [])}
    mb = {r["path"]: r["max_abs_diff_to_by_hand"] for r in ag_b.get("mha", [])}
    for k in sorted(ma.keys() | mb.keys()):
        if _agreement_moved(ma.get(k), mb.get(k)):
            changed.append({"kind": "agreement", "key": f"MHA {k} vs by hand", "was": ma.get(k), "became": mb.get(k)})
    changed += _reference(pa, pb)
    was, became = ag_a.get("slice_gradients_differ"), ag_b.get("slice_gradients_differ")
    if was != became:
        changed.append({"kind": "agreement", "key": "Q/K/V slice gradients differ", "was": was, "became": became})
    return changed


def _reference(pa: dict[str, Any], pb: dict[str, Any]) -> list[dict[str, Any]]:
    """The tutorial's models vs. PyTorch: errors that moved, or a path/backend that changed.

    Compared only when both reports measured it (reports of an older qkvtrace have no ``reference``).
    """
    if "reference" not in pa or "reference" not in pb:
        return []
    ra = {(r["key"], r["dtype"]): r for r in pa["reference"]}
    rb = {(r["key"], r["dtype"]): r for r in pb["reference"]}
    out: list[dict[str, Any]] = []
    for k in sorted(ra.keys() | rb.keys()):
        a, b = ra.get(k), rb.get(k)
        label = f"tutorial model {k[0]} vs PyTorch, {k[1]}"
        if a is None or b is None:
            out.append({"kind": "reference", "key": label, "was": a and _reference_view(a),
                        "became": b and _reference_view(b)})  # fmt: skip
            continue
        moved = any(_agreement_moved(a.get(f), b.get(f)) for f in ("forward_max_abs_err", "grad_max_abs_err"))
        rerouted = (a.get("path"), a.get("sdpa_backend"), a.get("error")) != (
            b.get("path"), b.get("sdpa_backend"), b.get("error"))  # fmt: skip
        if moved or rerouted:
            out.append({"kind": "reference", "key": label, "was": _reference_view(a), "became": _reference_view(b)})
    return out


def _reference_view(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("forward_max_abs_err", "grad_max_abs_err", "path", "sdpa_backend", "error")
    return {f: r.get(f) for f in keys if r.get(f) is not None}


def _plural(n: int, noun: str, verb: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'} {verb}"


def summary_line(diff: dict[str, Any]) -> str:
    """The headline: what changed, most telling first."""
    s, c, g, p = diff["sources"], diff["fast_path_conditions"], diff["callgraph"], diff["probes"]["changed"]
    counts = [
        (len(s["changed"]), "function", "changed"),
        (len(s["added"]), "function", "added"),
        (len(s["removed"]), "function", "removed"),
        (len(c["added"]), "fast-path condition", "added"),
        (len(c["removed"]), "fast-path condition", "removed"),
        (len(c["reworded"]), "fast-path condition", "reworded"),
        (len(g["edges_added"]) + len(g["edges_removed"]), "call edge", "changed"),
    ]
    parts = [_plural(n, noun, verb) for n, noun, verb in counts if n]
    behaviour: dict[str, list[str]] = {}
    for ch in p:
        if ch["kind"] == "fully_masked_rows":
            was = (ch["was"] or {}).get("result", "absent")
            became = (ch["became"] or {}).get("result", "absent")
            behaviour.setdefault(f"fully-masked rows: {was} → {became}", []).append(ch["key"].split(" / ")[-1])
    parts += [f"{label} for {', '.join(sorted(set(where)))}" for label, where in behaviour.items()]
    others = sum(1 for ch in p if ch["kind"] != "fully_masked_rows")
    if others:
        parts.append(_plural(others, "other behaviour probe", "changed"))
    if not parts:
        return f"torch {diff['a']} → {diff['b']}: no change in the attention path"
    return f"torch {diff['a']} → {diff['b']}: " + ", ".join(parts)


def diff_reports(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The ``qkvtrace.diff/1`` object of report ``a`` → report ``b``.

    Both are checked against the ``qkvtrace.report/1`` schema first (what
    :func:`~qkvtrace.analyses.reportio.load_report` returns already passed), so a
    damaged report raises :class:`~qkvtrace.base.errors.SchemaError`, never a ``KeyError``.
    """
    for name, report in (("report A", a), ("report B", b)):
        check_document(report, name=name, expected=REPORT_SCHEMA)
    sources, source_diffs = _sources(a, b)
    result = {
        "schema": DIFF_SCHEMA,
        "a": _version(a),
        "b": _version(b),
        "sources": sources,
        "source_diffs": source_diffs,
        "fast_path_conditions": _conditions(a, b),
        "callgraph": _edges(a, b),
        "probes": {"changed": _probes(a, b)},
    }
    result["summary"] = summary_line(result)
    return result
