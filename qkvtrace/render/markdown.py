"""``report.md``: a per-version report readable on GitHub. Reads the report dict only."""

from __future__ import annotations

from typing import Any

from qkvtrace.records import kernel_refusal
from qkvtrace.render.graph import short_name

__all__ = ["report_markdown"]


def _cell(text: Any) -> str:
    s = "" if text is None else str(text)
    return " ".join(s.split()).replace("|", "\\|")


def _code_cell(text: Any) -> str:
    s = _cell(text)
    return f"`{s}`" if s else ""


def _environment(env: dict[str, Any]) -> list[str]:
    rows = [
        ("torch", env.get("torch_version")),
        ("git version", env.get("torch_git_version")),
        ("CUDA (build)", env.get("torch_cuda_version")),
        ("CUDA available", env.get("cuda_available")),
        ("python", env.get("python_version")),
        ("platform", env.get("platform")),
        ("MHA fast path enabled", env.get("mha_fastpath_enabled")),
        (
            "SDPA backends enabled",
            ", ".join(f"{k}={v}" for k, v in sorted(env.get("sdp_enabled", {}).items())),
        ),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in rows)]


def _what_runs_when(scenarios: list[dict[str, Any]]) -> list[str]:
    out = [
        "| scenario | path | SDPA backend | why not fast path (PyTorch's words) "
        "| why not a faster kernel (PyTorch's words) | aten ops |",
        "|---|---|---|---|---|---|",
    ]
    for s in scenarios:
        if s.get("error"):
            out.append(f"| {_cell(s['description'])} | *error* | | {_cell(s['error'])} | | |")
            continue
        calls = s["calls"]
        paths = sorted({c["path"] for c in calls})
        backends = sorted({c["sdpa_backend"] or "none" for c in calls})
        whys = sorted({c["why_not_fast_path"] or c.get("why_not_fused_layer") or "" for c in calls} - {""})
        kernel_whys = sorted({": ".join(found) for c in calls if (found := kernel_refusal(c.get("sdpa_refusals")))})
        ops = []
        for c in calls:
            for op in c["aten_ops"]:
                if op not in ops:
                    ops.append(op)
        out.append(
            f"| {_cell(s['description'])} | {', '.join(paths)} | {', '.join(backends)} | "
            f"{'<br>'.join(_cell(w) for w in whys)} | {'<br>'.join(_cell(w) for w in kernel_whys)} | "
            f"{'<br>'.join(_code_cell(o) for o in ops)} |"
        )
    return out


def _conditions(conditions: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for block in conditions:
        out.append(f"**{short_name(block['function'])}** (`{block['function']}`)")
        out.append("")
        if block.get("missing"):
            out.append("*not found in this PyTorch*")
            out.append("")
            continue
        out += ["| # | reason (verbatim) | condition |", "|---|---|---|"]
        for i, c in enumerate(block["conditions"], 1):
            out.append(f"| {i} | {_code_cell(c['reason'])} | {_code_cell(c['condition'])} |")
        out.append("")
    return out


def _sources(sources: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for s in sources:
        where = f"{s['file']}:{s['lineno']}" if s.get("file") else s["kind"]
        summary = f"<code>{s['name']}</code> — {where}"
        if s.get("aten_ops"):
            summary += " → " + ", ".join(f"<code>{o}</code>" for o in s["aten_ops"])
        fence = "```"
        while fence in s["text"]:
            fence += "`"
        lang = "python" if s["kind"] == "python" else "text"
        out += ["<details>", f"<summary>{summary}</summary>", "", f"{fence}{lang}", s["text"].rstrip("\n"), fence,
                "", f"sha256 `{s['sha256'][:16]}…`" + (f" · {s['note']}" if s.get("note") else ""), "", "</details>",
                ""]  # fmt: skip
    return out


def report_markdown(report: dict[str, Any], *, svg_name: str | None = "callgraph.svg") -> str:
    """The whole ``report.md`` text."""
    env = report["environment"]
    n_cond = sum(len(b["conditions"]) for b in report["fast_path_conditions"])
    lines = [
        f"# Attention in PyTorch {env['torch_version']}",
        "",
        f"Written by `qkvtrace inspect`. {len(report['sources'])} functions on the attention path, "
        f"{n_cond} fast-path conditions, {len(report['probes']['scenarios'])} scenarios run.",
        "",
        "## Environment",
        "",
        *_environment(env),
        "",
        "## What runs when",
        "",
        "Each scenario ran on this PyTorch under the qkvtrace tracer; path, backend and reason are what it observed.",
        "",
        *_what_runs_when(report["probes"]["scenarios"]),
        "",
        *behaviour_markdown(report["probes"]),
        "## Call graph",
        "",
        "Solid edges were observed while the scenarios ran; dashed grey ones exist only in the source. "
        "Green: fast path and fused encoder layer; orange: the Python fallback; blue: direct SDPA.",
        "",
        f"![call graph]({svg_name})" if svg_name else "*(Graphviz `dot` was not installed: see `callgraph.dot`.)*",
        "",
        "## Fast-path conditions",
        "",
        "Every reason PyTorch assigns when it refuses a fast path, in source order, with the test that leads to it.",
        "",
        *_conditions(report["fast_path_conditions"]),
    ]
    if report.get("missing"):
        lines += ["## Missing in this PyTorch", ""]
        lines += [f"- `{m['name']}`: {m['reason']}" for m in report["missing"]]
        lines.append("")
    lines += ["## Sources", "", *_sources(report["sources"])]
    return "\n".join(lines).rstrip("\n") + "\n"


def _mask_semantics(records: list[dict[str, Any]]) -> list[str]:
    out = [
        "| API | `True` means | masked positions get 0 | rows sum to 1 | observed weights for `[[T, F], [F, T]]` |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        weights = r.get("observed_weights")
        shown = "<br>".join(str(row) for row in weights) if weights else _cell(r.get("method") or r.get("error"))
        out.append(
            f"| `{r['api']}` | **{r.get('true_means')}** | {r.get('masked_prob_zero')} | "
            f"{r.get('rows_sum_to_one') if r.get('rows_sum_to_one') is not None else 'n/a'} | {shown} |"
        )
    return out


def _fully_masked(records: list[dict[str, Any]]) -> list[str]:
    out = ["| API | backend | a fully-masked row returns | gradient finite |", "|---|---|---|---|"]
    for r in records:
        result = r["result"] if r["result"] != "error" else f"error: {_cell(r.get('error'))}"
        if r.get("values"):
            result += f" {r['values']}"
        grad = "n/a" if r.get("grad_finite") is None else str(r["grad_finite"])
        out.append(f"| {r['api']} | {r.get('backend') or ''} | {result} | {grad} |")
    return out


def _agreement(data: dict[str, Any]) -> list[str]:
    out = ["| computation | dtype | max abs difference to the reference |", "|---|---|---|"]
    for r in data.get("sdpa", []):
        diff = r["max_abs_diff"] if r.get("max_abs_diff") is not None else f"error: {_cell(r.get('error'))}"
        out.append(f"| SDPA, backend {r['backend']} | {r['dtype']} | {diff} |")
    for r in data.get("mha", []):
        out.append(f"| MHA {r['path']} path vs. by hand with the 3 `in_proj_weight` slices | float32 | "
                   f"{r['max_abs_diff_to_by_hand']} |")  # fmt: skip
    out += [
        "",
        f"Gradient norms of the Q, K, V slices of `in_proj_weight` after one backward: "
        f"{data.get('slice_gradient_norms')} — all different: **{data.get('slice_gradients_differ')}** "
        "(the packed weight is three matrices, not one shared one).",
    ]
    return out


def _inductor(data: dict[str, Any]) -> list[str]:
    if data.get("skipped"):
        return [f"Not measured: {data['skipped']}."]
    out = ["Each form compiled with `torch.compile(backend=\"inductor\")` inside a trace; what its generated code",
           "calls, read from PyTorch's compile log.", "",
           "| form | mode | replaced | what the compiled code calls |", "|---|---|---|---|"]  # fmt: skip
    for row in data.get("forms", []):
        if row.get("error"):
            replaced, calls = "?", f"not measured: {row['error']}"
        else:
            replaced = "yes" if row["fused"] else "no"
            calls = ", ".join(f"`{r}`" for r in row["runs"]) or "(nothing that names its nodes)"
        out.append(f"| `{row['written']}` | {row['mode']} | {replaced} | {calls} |")
    return out


def behaviour_markdown(probes: dict[str, Any]) -> list[str]:
    """The measured-warnings sections (empty when the report has none)."""
    lines: list[str] = []
    if probes.get("mask_semantics"):
        lines += ["## Boolean mask semantics (measured)", "", *_mask_semantics(probes["mask_semantics"]), ""]
    if probes.get("fully_masked_rows"):
        lines += ["## Fully-masked rows (measured)", "", *_fully_masked(probes["fully_masked_rows"]), ""]
    if probes.get("agreement"):
        lines += ["## Agreement with the reference attention", ""]
        lines += ["Reference: `softmax(Q K^T / sqrt(d_head) + M) V` in float64.", ""]
        lines += [*_agreement(probes["agreement"]), ""]
    if probes.get("inductor"):
        lines += ["## What inductor does with attention written by hand (measured)", ""]
        lines += [*_inductor(probes["inductor"]), ""]
    if probes.get("reference"):
        from qkvtrace.render.tutorial import reference_markdown

        lines += ["## The tutorial's models against PyTorch (measured)", ""]
        lines += [*reference_markdown(probes["reference"]), ""]
    return lines
