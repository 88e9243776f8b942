"""Assemble the per-version report (``qkvtrace.report/1``) of the installed PyTorch.

Collection only: everything here needs torch and nothing else, so the same
code runs in another virtual environment that has only torch (see DESIGN.md,
collect -> render). The result is a plain dict, deterministic for one
environment: sorted, no timestamps, no absolute paths.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from typing import Any

import torch

from qkvtrace.analyses import behaviour, inductor_forms, probes, reference
from qkvtrace.analyses.reportio import REPORT_SCHEMA, dumps_report, load_report
from qkvtrace.facts import introspect

__all__ = ["REPORT_SCHEMA", "collect_report", "dumps_report", "environment", "load_report", "report_dirname"]


def _flag(owner: Any, name: str) -> bool | None:
    fn = getattr(owner, name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except RuntimeError:  # a backend this build lacks
        return None


def environment() -> dict[str, Any]:
    """What PyTorch is installed and which attention switches are on."""
    cuda = torch.backends.cuda
    return {
        "torch_version": str(torch.__version__),
        "torch_git_version": str(getattr(torch.version, "git_version", "") or ""),
        "torch_cuda_version": getattr(torch.version, "cuda", None),
        "python_version": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "cuda_available": bool(torch.cuda.is_available()),
        "sdp_enabled": {
            name: value
            for name, value in (
                ("flash", _flag(cuda, "flash_sdp_enabled")),
                ("mem_efficient", _flag(cuda, "mem_efficient_sdp_enabled")),
                ("math", _flag(cuda, "math_sdp_enabled")),
                ("cudnn", _flag(cuda, "cudnn_sdp_enabled")),
            )
            if value is not None
        },
        "mha_fastpath_enabled": _flag(getattr(torch.backends, "mha", None), "get_fastpath_enabled"),
    }


def report_dirname(version: str | None = None) -> str:
    """``torch-2.13.0+cpu`` for the installed (or given) version."""
    return f"torch-{version or torch.__version__}"


def collect_report(progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Read sources, conditions, call graph and scenarios from the installed PyTorch."""
    say = progress or (lambda _msg: None)
    say("reading the attention path's source")
    found = introspect.discover()
    say(f"running {len(probes.SCENARIOS)} scenarios")
    scenarios, dynamic = probes.run_scenarios(found.objects, progress=lambda n: say(f"scenario {n}"))
    say("measuring mask semantics, fully-masked rows, agreement")
    measured = behaviour.run_behaviour()
    say("measuring the tutorial's models against PyTorch")
    measured["reference"] = reference.measure()
    measured["inductor"] = inductor_forms.measure(progress=say)

    # Builtins: the aten ops they were seen dispatching to in the scenarios.
    builtin_ops: dict[str, set[str]] = {}
    for edge in dynamic:
        if edge["callee"].startswith("aten::") and not edge["caller"].startswith("aten::"):
            builtin_ops.setdefault(edge["caller"], set()).add(edge["callee"])

    sources = []
    for name in sorted(found.entries):
        entry = found.entries[name].to_dict()
        if entry["kind"] == "builtin":
            entry["aten_ops"] = sorted(builtin_ops.get(name, ()))
        sources.append(entry)

    conditions = []
    for name in introspect.FAST_PATH_FUNCTIONS:
        source = found.entries.get(name)
        if source is None or source.kind != "python":
            conditions.append({"function": name, "conditions": [], "missing": True})
            continue
        conditions.append(
            {
                "function": name,
                "conditions": introspect.fast_path_conditions(name, source.text),
                "missing": False,
            }
        )

    edges: dict[tuple[str, str], dict[str, Any]] = {}
    for caller, callee in found.edges:
        edges[(caller, callee)] = {
            "caller": caller,
            "callee": callee,
            "kind": ["static"],
            "paths": [],
            "scenarios": [],
        }
    for d in dynamic:
        if d["caller"] == d["callee"]:
            continue  # e.g. an op re-dispatched by autocast: not a call edge
        slot = edges.setdefault(
            (d["caller"], d["callee"]),
            {"caller": d["caller"], "callee": d["callee"], "kind": [], "paths": [], "scenarios": []},
        )
        slot["kind"] = sorted({*slot["kind"], "dynamic"})
        slot["paths"] = d["paths"]
        slot["scenarios"] = d["scenarios"]
    nodes = sorted({n for e in edges for n in e} | set(found.entries))

    return {
        "schema": REPORT_SCHEMA,
        "environment": environment(),
        "sources": sources,
        "missing": [{"name": n, "reason": r} for n, r in sorted(found.missing.items())],
        "fast_path_conditions": conditions,
        "callgraph": {
            "nodes": [_node(n, found) for n in nodes],
            "edges": [edges[k] for k in sorted(edges)],
        },
        "probes": {"scenarios": scenarios, **measured},
    }


def _node(name: str, found: introspect.Discovered) -> dict[str, Any]:
    entry = found.entries.get(name)
    if name.startswith("aten::"):
        return {"name": name, "kind": "aten", "file": None}
    if entry is None:
        return {"name": name, "kind": "unknown", "file": None}
    return {"name": name, "kind": entry.kind, "file": entry.file}


if __name__ == "__main__":  # collection in another environment: print the JSON
    sys.stdout.write(dumps_report(collect_report()))
