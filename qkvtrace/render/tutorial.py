"""Rendering of the tutorial's experiments: the walkthrough and the reference-agreement table.

Reads the plain dicts of :mod:`qkvtrace.analyses.walkthrough` and :mod:`qkvtrace.analyses.reference`;
never touches torch.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["reference_markdown", "reference_table", "walkthrough_renderables"]

# -- the reference table -----------------------------------------------------------------------------

#: The tutorial section (title, anchor in docs/tutorial.md) that writes each model, by the report's key prefix.
TUTORIAL_SECTIONS = {
    "3.2": ("Attention by hand", "attention-by-hand"),
    "5.1": ("Multi-head attention", "multi-head-attention"),
    "7": ("The Transformer block", "the-transformer-block"),
    "8": ("A tiny language model", "a-tiny-language-model"),
}


def _section(key: str) -> str:
    """The title of the tutorial section a reference row's ``section`` (``"3.2"``, ``"7"``...) names."""
    found = TUTORIAL_SECTIONS.get(key.split()[0])
    return found[0] if found else key


def _err(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def _route(r: dict[str, Any]) -> str:
    if r.get("path") is None:
        return "-"
    backend = r.get("sdpa_backend")
    return r["path"] if backend in (None, "none") else f"{r['path']} ({backend})"


def reference_table(rows: list[dict[str, Any]]) -> Table:
    """One row per comparison and dtype: max |ours - PyTorch's| of outputs and gradients."""
    table = Table(title="the tutorial's models vs. PyTorch with the same weights: max |difference|")
    table.add_column("tutorial section")
    table.add_column("comparison")
    table.add_column("dtype")
    table.add_column("output", justify="right")
    table.add_column("grads", justify="right")
    table.add_column("PyTorch ran")
    for r in rows:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(r["dtype"], r["dtype"])
        label = r.get("label") or r["against"]
        if r.get("error"):
            table.add_row(_section(r["section"]), label, dtype, Text(r["error"], style="red"), "", "")
            continue
        table.add_row(_section(r["section"]), label, dtype, _err(r["forward_max_abs_err"]), _err(r["grad_max_abs_err"]),
                      _route(r))  # fmt: skip
    return table


def reference_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The same table in Markdown, for ``report.md``."""
    out = [
        "Each of the models of the project's tutorial (docs/tutorial.md, the section named in the first column) "
        "loaded with the very weights of the "
        "PyTorch module beside it, on the same input; gradients from the same random cotangent, over the input "
        'and every parameter. "PyTorch ran" is the path and SDPA backend the tracer recorded for PyTorch\'s side.',
        "",
        "| tutorial section | model | PyTorch | dtype | output | gradients | \\|output\\| max | \\|grad\\| max "
        "| PyTorch ran |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("error"):
            out.append(f"| {_section(r['section'])} | {r['model']} | {r['against']} | {r['dtype']} | error: "
                       f"{' '.join(str(r['error']).split())} | | | | |")  # fmt: skip
            continue
        errors = " | ".join(_err(r.get(f)) for f in ("forward_max_abs_err", "grad_max_abs_err", "output_max_abs",
                                                     "grad_max_abs"))  # fmt: skip
        cells = [_section(r["section"]), r["model"], r["against"], r["dtype"], errors, _route(r)]
        out.append(f"| {' | '.join(cells)} |")
    return out


# -- the walkthrough ------------------------------------------------------------------------------------


def _matrix(title: str, values: list[list[float]], rows: list[str], cols: list[str], digits: int = 3) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("", style="bold")
    for c in cols:
        table.add_column(c, justify="right")
    for label, row in zip(rows, values, strict=True):
        table.add_row(label, *(f"{v:+.{digits}f}" for v in row))
    return table


def _dims(n: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _maybe(x: float | None) -> str:
    return "(no map)" if x is None else f"{x:.2g}"


def _norms(n: dict[str, float | None]) -> str:
    return " / ".join("-" if n[p] is None else f"{n[p]:.4g}" for p in "qkv")


def walkthrough_renderables(data: dict[str, Any]) -> list[RenderableType]:
    """The walkthrough, section by section, for a rich console."""
    s, m, tokens = data["settings"], data["matrices"], data["tokens"]
    d = s["d_model"]
    packed, call, checks = data["packed"], data["traced_call"], data["checks"]
    out: list[RenderableType] = []

    def head(text: str) -> None:
        out.append(Text(f"\n{text}", style="bold underline"))

    head("1. vocabulary and token ids")
    out.append(Text(" ".join(f"{w}={i}" for w, i in data["vocab"].items())))
    out.append(Text(f"text {s['text']!r} → ids {data['token_ids']}  (label: {data['label']['name']}, "
                    f"from the {data['label']['source']})"))  # fmt: skip
    if data["unknown_words"]:
        out.append(Text(f"not in the vocabulary (read as <unk>): {', '.join(data['unknown_words'])}", style="yellow"))

    head("2. X = embedding + position")
    out.append(_matrix(f"X [{len(tokens)}, {d}]", m["x"], tokens, _dims(d)))

    head("3. W_Q, W_K, W_V: three slices of one packed weight")
    rows = packed["rows"]
    out.append(Text(
        f"the tracer recorded the call of module {call['module']!r} ({call['module_type']}): its projection is "
        f"{packed['param']} {packed['shape']} = [3D, D]; Q rows {rows['q']}, K rows {rows['k']}, V rows {rows['v']}; "
        f"|W_Q| / |W_K| / |W_V| = {_norms(packed['weight_norms'])}"
    ))  # fmt: skip
    out.append(Text(f"rows o0..o{d - 1}: output features, columns i0..i{d - 1}: input features", style="dim"))
    for name in ("w_q", "w_k", "w_v"):
        out.append(_matrix(f"{name.upper()} [{d}, {d}]", m[name], _dims(d, "o"), _dims(d, "i")))

    head("4. Q = X W_Qᵀ, K = X W_Kᵀ, V = X W_Vᵀ")
    for name in ("q", "k", "v"):
        out.append(_matrix(f"{name.upper()} [{len(tokens)}, {d}]", m[name], tokens, _dims(d)))

    head(f"5. scores = Q Kᵀ / √{d}, attention = softmax by row, context = attention V")
    out.append(Text("rows: queries, columns: keys", style="dim"))
    out.append(_matrix("scores", m["scores"], tokens, tokens))
    out.append(_matrix("attention", m["attention"], tokens, tokens))
    out.append(_matrix(f"context [{len(tokens)}, {d}]", m["context"], tokens, _dims(d)))
    out.append(Text(
        f"PyTorch's own attention weights differ from these by at most {checks['attention_vs_pytorch']:.2g}; "
        f"rows sum to 1 within {checks['rows_sum_to_one']:.2g}; the tracer's attention map differs by "
            f"{_maybe(checks.get('attention_vs_tracer_map'))}. PyTorch ran path {call['path']!r} "
        f"(why not fast: {call['why_not_fast_path']!r}; SDPA backend: {call['sdpa_backend'] or 'none'}, "
        f"need_weights={call['need_weights']})."
    ))  # fmt: skip

    head("6. logits, probabilities, loss")
    label = data["label"]["name"]
    probs = data["probabilities"]
    out.append(Text(
        f"context → W_O → mean over tokens → head: logits [negative, positive] = {data['logits']}, "
        f"probabilities = {probs} (by hand vs. PyTorch: {checks['logits_vs_pytorch']:.2g})\n"
        f"cross-entropy = {checks['loss']:.6f};  −log p({label}) = {checks['minus_log_p']:.6f};  "
        f"difference {checks['loss_vs_minus_log_p']:.2g}"
    ))  # fmt: skip

    head("7. one backward: a gradient for each slice (the tracer's gradient record)")
    g = data["gradients"]
    grads = Table(show_edge=False, pad_edge=False)
    for col in ("", "|dL/dW_Q|", "|dL/dW_K|", "|dL/dW_V|"):
        grads.add_column(col, justify="right" if col else "left")
    grads.add_row(f"tracer, backward #{g['backward_index']}", *(f"{g['grad_norms'][p]:.6g}" for p in "qkv"))
    grads.add_row("by hand, from .grad", *(f"{g['grad_norms_by_hand'][p]:.6g}" for p in "qkv"))
    out.append(grads)
    out.append(Text(f"weights unchanged by backward alone: {g['weights_unchanged_by_backward']}"))

    head("8. one optimizer step: ΔW = −lr · grad")
    st = data["step"]
    scaled = [[v * 1000 for v in row] for row in st["delta_w_q"]]
    out.append(_matrix(f"ΔW_Q × 1000 after SGD(lr={st['lr']})", scaled, _dims(d, "o"), _dims(d, "i"), digits=2))
    errs = st["max_abs_delta_vs_minus_lr_grad"]
    verdict = Text("holds" if st["holds"] else "DOES NOT HOLD", style="green" if st["holds"] else "bold red")
    out.append(Text.assemble("ΔW = −lr·grad ", verdict, f": max |ΔW − (−lr·grad)| Q {errs['q']:.2g}, "
                             f"K {errs['k']:.2g}, V {errs['v']:.2g}"))  # fmt: skip

    head(f"9. training on the 8 sentences ({s['optimizer']}, lr {s['lr']}, full batch)")
    curve = Table(show_edge=False, pad_edge=False)
    for col in ("epoch", "loss", "train accuracy", "|dW_Q| / |dW_K| / |dW_V| (tracer)"):
        curve.add_column(col, justify="right")
    for row in data["curve"]:
        curve.add_row(
            str(row["epoch"]), f"{row['loss']:.4f}", f"{row['train_accuracy']:.3f}", _norms(row["grad_norms"])
        )
    out.append(curve)

    head("10. the same sentence before and after training")
    after = data["after"]
    out.append(Group(
        _matrix("before training", after["attention_before"], tokens, tokens),
        _matrix("after training (eval)", after["attention_after"], tokens, tokens),
    ))  # fmt: skip
    out.append(Text(
        f"probabilities [negative, positive]: before {probs}, after {after['probabilities']}; "
        f"|ΔW_Q| / |ΔW_K| / |ΔW_V| since the start: {_norms(after['weight_change_norms'])}; "
        f"the tracer's map of the call after training differs by {_maybe(after.get('attention_after_vs_tracer_map'))}; "
        f"after training PyTorch ran path {after['traced_call']['path']!r} "
        f"(why not fast: {after['traced_call']['why_not_fast_path']!r})"
    ))  # fmt: skip
    out.append(Text(f"\n{data['honesty']}", style="bold yellow" if data["memorised"] else "bold"))
    return out
