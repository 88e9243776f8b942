"""Render a ``qkvtrace.history/1`` object: Markdown (HISTORY.md) and a release x item chart.

Takes the history dict only; never touches PyTorch. The chart needs
matplotlib (the optional extra ``qkvtrace[plot]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkvtrace.analyses.history import headline_rows, version_key

__all__ = ["chart_rows", "draw_history_chart", "history_markdown"]

PLOT_HINT = 'the chart needs matplotlib: pip install "qkvtrace[plot]"'


def _short(name: str) -> str:
    return name.replace("torch.nn.modules.", "").replace("torch.nn.functional.", "F.")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(value: Any) -> str:
    """A probe value, compact, for a table cell."""
    if value is None:
        return "absent"
    if isinstance(value, dict):
        if "result" in value:
            extra = "" if value.get("grad_finite") in (None, True) else ", grad not finite"
            return f"{value['result']}{extra}" + (f" ({value['error']})" if value.get("error") else "")
        if "true_means" in value:
            return f"True means {value['true_means']}"
        if "error" in value:
            return f"error: {value['error']}"
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
    if isinstance(value, list):
        calls = []
        for c in value:
            why = c.get("why_not_fast_path") or c.get("why_not_fused_layer")
            calls.append(f"{c.get('path')} ({c.get('sdpa_backend') or 'no SDPA'})" + (f": “{why}”" if why else ""))
        return "; ".join(dict.fromkeys(calls)) or "no call"
    return str(value)


def _label(text: str) -> str:
    for long, short in (("F.scaled_dot_product_attention", "SDPA"), ("nn.MultiheadAttention", "MHA"),
                        ("torch.nn.attention.", "attention."), ("fully_masked_rows", "fully-masked rows"),
                        ("mask_semantics", "mask semantics"), ("torch._C.", "C.")):  # fmt: skip
        text = text.replace(long, short)
    return text


def chart_rows(history: dict[str, Any]) -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """Rows of the chart: (item, {release: change}, {release: cell text}) for every item that changed."""
    rows: list[tuple[str, dict[str, str], dict[str, str]]] = []
    for s in history["sources"]:
        if s["changes"]:
            rows.append((f"source: {_label(_short(s['name']))}", {c["release"]: c["change"] for c in s["changes"]}, {}))
    by_function: dict[str, dict[str, dict[str, int]]] = {}
    for c in history["fast_path_conditions"]:
        counts = by_function.setdefault(c["function"], {}).setdefault(c["release"], {})
        counts[c["change"]] = counts.get(c["change"], 0) + 1
    for function, per_release in sorted(by_function.items()):
        kinds = {r: next(iter(n)) if len(n) == 1 else "several" for r, n in per_release.items()}
        marks = {"added": "+", "reworded": "~", "removed": "−"}
        texts = {r: "".join(f"{marks[k]}{n[k]}" for k in marks if k in n) for r, n in per_release.items()}
        rows.append((f"fast-path conditions: {_label(_short(function))}", kinds, texts))
    for p in history["probes"]:
        rows.append((f"{_label(p['kind'])}: {_label(p['key'])}", {c["release"]: "behaviour" for c in p["changes"]}, {}))
    if history["callgraph"]:
        rows.append((
            "call graph edges",
            {g["release"]: "edges" for g in history["callgraph"]},
            {g["release"]: f"+{len(g['edges_added'])}−{len(g['edges_removed'])}" for g in history["callgraph"]},
        ))  # fmt: skip
    return rows


_COLOURS = {
    "code": "#d62728", "docstring": "#9ecae1", "layout": "#dddddd", "added": "#2ca02c", "removed": "#7f7f7f",
    "reworded": "#ff7f0e", "several": "#8c564b", "behaviour": "#9467bd", "edges": "#17becf",
}  # fmt: skip


def draw_history_chart(history: dict[str, Any], path: Path) -> None:
    """A release x item chart: one row per item that changed, a coloured cell where it did.

    Raises ImportError (with the install hint) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(PLOT_HINT) from None

    releases = history["releases"]
    rows = chart_rows(history)
    height = max(3.0, 0.22 * len(rows) + 1.8)
    fig, ax = plt.subplots(figsize=(4.5 + 0.55 * len(releases), height))
    try:
        for y, (_, cells, texts) in enumerate(rows):
            for release, change in cells.items():
                x = releases.index(release)
                ax.add_patch(plt.Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, color=_COLOURS.get(change, "#000000")))
                if release in texts:
                    ax.text(x, y, texts[release], ha="center", va="center", fontsize=5, color="white")
        ax.set_xlim(-0.5, len(releases) - 0.5)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xticks(range(len(releases)))
        ax.set_xticklabels(releases, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label if len(label) <= 70 else label[:67] + "…" for label, _, _ in rows], fontsize=6)
        ax.grid(axis="x", color="#eeeeee", linewidth=0.5)
        ax.set_axisbelow(True)
        used = sorted({c for _, cells, _ in rows for c in cells.values()})
        ax.legend(handles=[Patch(color=_COLOURS[c], label=c) for c in used], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)  # fmt: skip
        ax.set_title(f"what changed in PyTorch attention, torch {releases[0]} … {releases[-1]}", fontsize=9)
        fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    finally:
        plt.close(fig)


def history_markdown(history: dict[str, Any], *, chart_name: str | None = None) -> str:
    """HISTORY.md: headlines, then each kind of change as a table."""
    releases = history["releases"]
    out = [f"# The history of the attention path: torch {releases[0]} … {releases[-1]}", ""]
    out.append("Written by `qkvtrace history` from the reports beside this file "
               f"({len(releases)} releases: {', '.join(releases)}). Each release is compared with the one "
               "before it, exactly as `qkvtrace diff` does.")  # fmt: skip
    out.append("")
    if not any(r["cuda_available"] for r in history["reports"]):
        out.append("Every report was collected without a CUDA device, so GPU-only SDPA backends appear as errors; "
                   "a backend a release did not select when forced is recorded as an error saying so.")  # fmt: skip
        out.append("")
    if chart_name:
        out += [f"![release x item chart]({chart_name})", ""]
    out += ["## Headlines", "", "| release | what changed |", "| --- | --- |"]
    rows = dict(headline_rows(history))
    for step in history["steps"]:
        out.append(f"| {step['to']} | {_cell(rows.get(step['to'], 'no change in the attention path'))} |")
    out.append("")

    out += ["## Functions on the attention path", "",
            "Releases where a function's source changed: **code**, only its **docstring**, or only **layout** "
            "(comments, whitespace). A builtin's code is not visible; its documented text is.", "",
            "| function | kind | first seen | changes |", "| --- | --- | --- | --- |"]  # fmt: skip
    for s in history["sources"]:
        changes = ", ".join(f"{c['release']} ({c['change']})" for c in s["changes"]) or "none"
        out.append(f"| `{_short(s['name'])}` | {s['kind']} | {s['first_seen']} | {changes} |")
    out.append("")

    out += ["## Fast-path conditions", "", "PyTorch's own reason strings, as each release words them.", ""]
    if history["fast_path_conditions"]:
        out += ["| release | function | change | reason |", "| --- | --- | --- | --- |"]
        for c in history["fast_path_conditions"]:
            text = f"“{c['reason']}”" + (f" (was “{c['was']}”)" if c.get("was") else "")
            out.append(f"| {c['release']} | `{_short(c['function'])}` | {c['change']} | {_cell(text)} |")
    else:
        out.append("No fast-path condition changed.")
    out.append("")

    out += ["## Behaviour", "", "Probes whose measured result changed, and from what to what.", ""]
    if history["probes"]:
        out += ["| probe | release | was | became |", "| --- | --- | --- | --- |"]
        for p in history["probes"]:
            for ch in p["changes"]:
                out.append(f"| {p['kind']}: {_cell(p['key'])} | {ch['release']} | {_cell(_value(ch['was']))} "
                           f"| {_cell(_value(ch['became']))} |")  # fmt: skip
    else:
        out.append("No behaviour probe changed.")
    out.append("")

    out += ["## Call graph", ""]
    if history["callgraph"]:
        out += ["| release | edges gained | edges lost |", "| --- | --- | --- |"]
        for g in history["callgraph"]:

            def edges(items: list[dict[str, str]]) -> str:
                return "<br>".join(f"`{_short(e['caller'])}` → `{_short(e['callee'])}`" for e in items) or "-"

            out.append(f"| {g['release']} | {edges(g['edges_added'])} | {edges(g['edges_removed'])} |")
    else:
        out.append("The call graph kept the same edges in every release.")
    out.append("")

    out += ["## What older releases lack", ""]
    if history["missing"]:
        out += ["| API | lacking in |", "| --- | --- |"]
        for m in sorted(history["missing"], key=lambda m: m["name"]):
            out.append(f"| `{m['name']}` | {', '.join(sorted(m['releases'], key=version_key))} |")
    else:
        out.append("Every release has every API qkvtrace uses.")
    out.append("")
    out += ["## Reports", ""]
    for r in history["reports"]:
        v = r["torch_version"]
        device = "with CUDA" if r["cuda_available"] else "CPU only"
        out.append(f"- [torch {v}](torch-{v}/report.md) — {device}, git {r['torch_git_version'][:10] or 'unknown'}")
    out.append("")
    return "\n".join(out)
