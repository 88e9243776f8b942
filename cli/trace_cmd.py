"""``qkvtrace trace TARGET``: record every attention call of a model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from qkvtrace.base.errors import InputError, OutputError
from qkvtrace.cli._common import (
    TARGET_HELP,
    add_budget_options,
    add_target_options,
    check_output_file,
    load_with_inputs,
    progress,
    run_failed,
)
from qkvtrace.render.terminal import COLUMNS, blind_spots, summary_line, trace_table

__all__ = ["register", "run"]

_HELP = """\
Run a model once under qkvtrace and show, for every attention call, the path
PyTorch took (fast / fallback / fused_encoder_layer / sdpa / flex, or
hand_written: softmax(QKᵀ)V written in the model's own code), PyTorch's own
reason for refusing the fast path, the SDPA kernel that ran, the norms of the
Q/K/V slices of the projection and, with --backward, of their gradients.
Module names, paths, backends and reasons are printed whole at any terminal
width: one row per call when they fit, one block per call when they do not.
Secondary columns are asked for with --columns.

{TARGET_HELP}
By default the model runs as inference does: model.eval() under
torch.no_grad(), where PyTorch's fast paths can be taken. --train switches to
training mode; --backward runs with gradients on and backpropagates the loss
`qkvtrace grads` uses: next-token cross-entropy for a language model (token
ids in, one score per vocabulary entry out), else <output, R> with R a fixed
random N(0, 1) tensor -- a plain sum of the output would have zero gradient
through a final LayerNorm. The output says which one ran.
"""

_EPILOG = """\
examples:
  qkvtrace trace demo:encoder
  qkvtrace trace demo:tiny-lm --train --backward --json trace.json
  qkvtrace trace my_pkg.model:build --input-shape 4,128
  qkvtrace trace demo:tiny-lm --maps maps/ --show-maps   # attention maps, kernels unchanged
  qkvtrace trace demo:tiny-lm --show-maps --backward --html trace.html   # one page to open or send
  qkvtrace trace hf:./tiny-bert --random-init --columns type,weights
  qkvtrace trace timm:vit_tiny_patch16_224 --input-shape 1,1
  qkvtrace trace demo:tiny-lm --compile            # what inductor makes of each attention
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "trace",
        help="record every attention call of a model (path, reason, kernel, Q/K/V)",
        description=_HELP.replace("{TARGET_HELP}", TARGET_HELP),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_options(p)
    p.add_argument(
        "--backward",
        action="store_true",
        help="enable grad, backpropagate next-token cross-entropy (language models) or <output, R> "
        "(R fixed random), record Q/K/V gradients",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="mode", action="store_const", const="train", help="model.train() before the run")
    mode.add_argument(
        "--eval",
        dest="mode",
        action="store_const",
        const="eval",
        help="model.eval() before the run (default)",
    )
    p.add_argument("--input-shape", metavar="B,T", help="batch and sequence length of made-up inputs (default 2,16)")
    p.add_argument("--compile", metavar="BACKEND", nargs="?", const="inductor", default=None,
                   help="run the model through torch.compile (backend inductor unless named: aot_eager, eager, "
                        "...) and show what the compiled graphs do with each attention (rows marked compiled)"
                   )  # fmt: skip
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the qkvtrace.trace/3 JSON here")
    p.add_argument("--html", metavar="FILE", type=Path,
                   help="also write one self-contained HTML page (no network needed to open it): the "
                        "calls table, sortable and filterable, each call's details, and the maps with "
                        "--maps/--show-maps")  # fmt: skip
    p.add_argument("--columns", metavar="LIST", type=_columns, default=None,
                   help=f"secondary columns, comma-separated: {', '.join(COLUMNS)} or all "
                        "(default: grads when --backward recorded gradients)")  # fmt: skip
    _add_map_options(p)
    add_budget_options(p)
    p.set_defaults(run=run, mode="eval")


def _add_map_options(p: Any) -> None:
    from qkvtrace.base.limits import DEFAULT_MAX_MAP_MB, DEFAULT_MAX_MAP_TOKENS

    g = p.add_argument_group("attention maps (computed on the side; the model keeps its path and kernel)")
    g.add_argument("--maps", metavar="DIR", type=Path,
                   help="write a heatmap per call and head and a grid per call (PNG and SVG) into DIR, and the "
                        'maps into --json; needs pip install "qkvtrace[plot]"')  # fmt: skip
    g.add_argument("--show-maps", action="store_true", help="print small maps (T <= 24) in the terminal")
    g.add_argument("--map-heads", metavar="LIST", type=_indices, default=None,
                   help="only these heads, e.g. 0,3 (default: all, as heads= in Python)")  # fmt: skip
    g.add_argument("--map-batch", metavar="LIST", type=_indices, default=None,
                   help="only these batch items, e.g. 0 (default: all, as batch_index= in Python); the terminal "
                        "and the pictures draw the first of them")  # fmt: skip
    g.add_argument("--max-map-tokens", metavar="N", type=int, default=DEFAULT_MAX_MAP_TOKENS,
                   help=f"no map longer than N on a side (default {DEFAULT_MAX_MAP_TOKENS})")  # fmt: skip
    g.add_argument("--max-map-mb", metavar="MB", type=float, default=DEFAULT_MAX_MAP_MB,
                   help=f"memory all maps of the run may hold (default {DEFAULT_MAX_MAP_MB:g})")  # fmt: skip


def _indices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated indices, got {text!r}") from None


def _columns(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if names == ["all"]:
        return list(COLUMNS)
    unknown = [c for c in names if c not in COLUMNS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown column {unknown[0]!r}; choose from {', '.join(COLUMNS)} or all")
    return names


def run(args: argparse.Namespace, console: Console) -> int:
    import torch

    for path, flag in ((args.json, "--json"), (args.html, "--html")):
        if path is not None:
            check_output_file(path, flag)
    if args.maps is not None:
        _check_maps_dir(args.maps)
    with progress(f"loading {args.target}") as status:
        loaded = load_with_inputs(args.target, args.input_shape, args.max_tokens, args.max_attention_mb,
                                  random_init=args.random_init)  # fmt: skip
        status(f"running {args.target}")
        result, loss_kind = _run(args, loaded)
    mode = args.mode + (", backward" if args.backward else "") + (f", compiled: {args.compile}" if args.compile else "")
    title = f"qkvtrace trace {args.target}  (torch {torch.__version__}, {mode})"
    console.print(trace_table(result, title=title, width=console.width, columns=args.columns), crop=False)
    console.print(summary_line(result, width=console.width), soft_wrap=True)
    if loss_kind is not None:
        from qkvtrace.analyses.grads import LOSS_TEXT

        console.print(f"backward of {LOSS_TEXT[loss_kind]}", markup=False, highlight=False, soft_wrap=True)
    for line in blind_spots(result):  # silence is not absence: say what the trace could not see
        console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    if args.show_maps or args.maps is not None:
        _maps_out(args, result, loaded, console)
    if args.json is not None:
        result.save(args.json, maps=args.maps is not None)
        console.print(f"wrote {args.json}")
    if args.html is not None:
        from qkvtrace.render.maps_render import token_labels

        result.save_html(args.html, title=title, tokens=token_labels(loaded.model, loaded.args))
        console.print(f"wrote {args.html}")
    return 0


def _check_maps_dir(path: Path) -> None:
    try:
        import matplotlib  # noqa: F401  (refuse before the run, not after)
    except ImportError:
        raise OutputError(f"--maps {str(path)!r}: attention map pictures need matplotlib; "
                          'install it with pip install "qkvtrace[plot]"') from None  # fmt: skip
    if path.exists() and not path.is_dir():
        raise OutputError(f"--maps {str(path)!r}: exists and is not a folder")


def _maps_out(args: argparse.Namespace, result: Any, loaded: Any, console: Console) -> None:
    from qkvtrace.render.maps_render import terminal_maps, token_labels, write_map_pictures

    tokens = token_labels(loaded.model, loaded.args)  # per batch item; each map names the items it holds
    if args.show_maps:
        for part in terminal_maps(result, tokens, width=console.width):
            console.print(part)
    if args.maps is not None:
        files = write_map_pictures(result, args.maps, tokens)
        console.print(f"wrote {len(files)} map pictures (PNG and SVG) into {args.maps}")


def _run(args: argparse.Namespace, loaded: Any) -> tuple[Any, str | None]:
    """The trace result, and the kind of loss backpropagated (``None`` without --backward)."""
    import torch

    import qkvtrace
    from qkvtrace.analyses.grads import make_loss
    from qkvtrace.analyses.target import first_tensor

    model, call_args, call_kwargs = loaded.model, loaded.args, loaded.kwargs
    model.train(args.mode == "train")
    if args.compile is not None:
        backends = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in backends:
            raise InputError(f"--compile {args.compile!r}: not a torch.compile backend here; choose from "
                             f"{', '.join(sorted(backends))}")  # fmt: skip
    maps = args.show_maps or args.maps is not None
    options = {"attention_maps": True, "heads": args.map_heads, "batch_index": args.map_batch,
               "max_map_tokens": args.max_map_tokens, "max_map_mb": args.max_map_mb} if maps else {}  # fmt: skip
    try:
        tracer = qkvtrace.trace(model, **options)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(f"attention map options: {exc}") from None
    loss_kind = None
    with tracer as tr, torch.set_grad_enabled(args.backward):
        runner = model if args.compile is None else torch.compile(model, backend=args.compile)
        try:
            out = runner(*call_args, **call_kwargs)
        except Exception as exc:
            raise run_failed(args.target, "on its example inputs", exc) from exc
        if args.backward:
            first = first_tensor(out)
            if first is None or not first.requires_grad:
                raise InputError(
                    f"{args.target}: the output does not require grad, so there is nothing to backward through"
                )
            loss_kind, loss = make_loss(model, tuple(call_args), first)
            loss.backward()
    return tr.result, loss_kind
