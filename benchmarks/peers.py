"""qkvtrace next to the other ways of looking inside attention, on one model and one input.

Run ``python benchmarks/peers.py`` (``--quick``: the encoder only, sequence
128, three repetitions; ``--repeats N``, ``--threads N``, ``--lengths 128,512``).
The peers are optional: ``pip install ".[peers]"`` (nnsight, TransformerLens);
a missing one is skipped with a line saying so.

Models (random weights, built from a config, CPU, one thread by default)
-------------------------------------------------------------------------
gpt2     transformers ``GPT2LMHeadModel``: d_model 256, 4 layers, 8 heads,
         vocabulary 1000; batch 4 of token ids, sequence 128 and 512. SDPA
         attention, except for ``output_attentions`` (which needs eager).
encoder  ``nn.TransformerEncoder`` of 4 ``TransformerEncoderLayer(256, 8,
         1024, dropout=0, batch_first=True)``, input ``(4, T, 256)``.

Workloads
---------
train    one training step: zero grads, forward, ``sum()`` of the output, backward
infer    one forward in ``eval()`` under ``torch.no_grad()``
weights  one forward in ``eval()`` that also yields every layer's attention
         weights ``[B, H, T, T]``

Contenders
----------
untraced           the workload, nothing else (the baseline of each repetition)
qkvtrace           ``qkvtrace.trace(model)`` with its defaults (train, infer)
qkvtrace maps      ``qkvtrace.trace(model, attention_maps=True)`` (weights)
torch.profiler     ``profile(activities=[CPU], record_shapes=True)`` and ``key_averages()``
output_attentions  transformers' eager attention with ``output_attentions=True`` (gpt2, weights)
nnsight            ``NNsight(model).trace(...)`` saving each attention module's output
numbers alone      no qkvtrace: a bare wrapper around ``F.scaled_dot_product_attention``
                   that computes what each record holds measured on the call's data (the
                   norms of Q, K and V, the output's NaN count, kept on the device) and
                   nothing else (gpt2, train and infer): the floor under any record
TransformerLens    ``run_with_cache`` of a ``TransformerBridge`` (TransformerLens >= 4) around
                   the same GPT-2 (same weights; the bridge runs it with eager attention)

Method: a sample is the CPU time (``time.process_time``) of the unit run
back to back as many times as the baseline needs to fill ``SAMPLE_SECONDS``
(a single forward of a small model is a few milliseconds: one run per sample
measures the machine more than the contender). Every repetition times the
baseline, then each contender in a fixed order, then the baseline again; a
contender's ratio is its sample over the mean of the two baselines around it.
The table gives the median and the range (min-max) of these paired ratios
(with ``--threads`` above 1, CPU time adds up every thread's work). Memory:
the peak of Python allocations during the unit (``tracemalloc``, which does
not see tensor storage) and the tensor storage the contender hands back or
keeps after it (its maps, saved outputs or cache). "Saw" is read
from what each contender handed back in this run (its records, its profiler
rows, its tensors), not from its documentation.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import qkvtrace
from qkvtrace.facts.paths import quiet_native_stderr

D_MODEL, LAYERS, HEADS, FF, VOCAB, BATCH = 256, 4, 8, 1024, 1000, 4

Unit = Callable[[], Any]


@dataclass
class Contender:
    name: str
    #: one unit of work as this contender runs it; ``None`` when it cannot run here (``skip`` says why)
    unit: Unit | None
    #: what the contender handed back in its last run, said in words ("4 calls, path sdpa, ...")
    saw: Callable[[], str] = lambda: ""
    skip: str | None = None
    #: the tensors it hands back or keeps after its last run (maps, saved outputs, a cache)
    held: Callable[[], list[torch.Tensor]] = lambda: []
    ratios: list[float] = field(default_factory=list)
    peak_mb: float = 0.0
    held_mb: float = 0.0


# -- models ------------------------------------------------------------------------------------


def gpt2(length: int, eager: bool = False) -> tuple[nn.Module, torch.Tensor] | str:
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    config = transformers.GPT2Config(n_embd=D_MODEL, n_layer=LAYERS, n_head=HEADS, n_inner=FF, vocab_size=VOCAB,
                                     n_positions=max(length, 128), attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_implementation="eager" if eager else "sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(1))
    return model, ids


def encoder(length: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    return model, torch.randn(BATCH, length, D_MODEL, generator=torch.Generator().manual_seed(1))


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _step(model: nn.Module, x: torch.Tensor) -> Unit:
    def unit() -> Any:
        model.train()
        model.zero_grad(set_to_none=True)
        _logits(model(x)).float().sum().backward()

    return unit


def _forward(model: nn.Module, x: torch.Tensor) -> Unit:
    def unit() -> Any:
        model.eval()
        with torch.no_grad():
            return _logits(model(x))

    return unit


# -- contenders --------------------------------------------------------------------------------


def qkvtrace_contender(model: nn.Module, inner: Unit, maps: bool) -> Contender:
    seen: dict[str, Any] = {}

    def unit() -> Any:
        with qkvtrace.trace(model, attention_maps=maps) as t:
            out = inner()
        seen["trace"] = t
        return out

    def saw() -> str:
        calls = seen["trace"].calls
        if not calls:
            return "no attention call recorded"
        c = calls[0]
        parts = [f"{len(calls)} calls", f"path {c.path}", f"kernel {c.sdpa_backend or ', '.join(c.aten_ops or [])}"]
        if c.why_not_fast_path or c.why_not_fused_layer:
            parts.append("PyTorch's reason")
        if c.qkv.q is not None:
            parts.append("Q/K/V slices")
        if maps:
            n = sum(1 for c in calls if c.attention_map is not None)
            parts.append(f"{n} maps")
        return ", ".join(parts)

    def held() -> list[torch.Tensor]:
        return [c.attention_map for c in seen["trace"].calls if c.attention_map is not None]

    return Contender("qkvtrace maps" if maps else "qkvtrace", unit, saw, held=held)


@contextlib.contextmanager
def numbers_alone(kept: list[Any]) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` replaced by a bare wrapper that adds each call's own numbers to ``kept``
    (the norms of Q, K and V and the output's NaN count, kept on the device), computed by qkvtrace's measuring
    functions (the cheapest exact ones it has), with nothing of a trace around them: the floor under a record."""
    from qkvtrace.facts.slices import norm_of
    from qkvtrace.tracer.build import nan_count

    function = torch.nn.functional.scaled_dot_product_attention

    def measured(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = function(q, k, v, *args, **kwargs)
        with torch.no_grad():
            kept.append((nan_count(out), norm_of(q), norm_of(k), norm_of(v)))
        return out

    torch.nn.functional.scaled_dot_product_attention = measured
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = function


def numbers_contender(inner: Unit) -> Contender:
    kept: list[Any] = []

    def unit() -> Any:
        kept.clear()
        with numbers_alone(kept):
            return inner()

    def saw() -> str:
        return f"{len(kept)} calls' norms and NaN counts; no module, kernel, path, reason or slices"

    return Contender("numbers alone", unit, saw)


def profiler_contender(inner: Unit) -> Contender:
    seen: dict[str, Any] = {}

    def unit() -> Any:
        with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = inner()
        seen["rows"] = prof.key_averages()
        return out

    def saw() -> str:
        names = [r.key for r in seen["rows"]]
        kernels = sorted({n for n in names if "attention" in n or "softmax" in n})
        found = ", ".join(kernels) or "none"
        return f"{len(names)} op rows with shapes; attention ops: {found}; no module, path or reason"

    return Contender("torch.profiler", unit, saw)


def output_attentions_contender(length: int) -> Contender:
    built = gpt2(length, eager=True)
    if isinstance(built, str):
        return Contender("output_attentions", None, skip=built)
    model, ids = built
    seen: dict[str, Any] = {}

    def unit() -> Any:
        model.eval()
        with torch.no_grad():
            out = model(ids, output_attentions=True)
        seen["attentions"] = out.attentions
        return out.logits

    def saw() -> str:
        a = seen["attentions"]
        return f"{len(a)} maps {list(a[0].shape)} (eager attention: not the kernel the model runs)"

    return Contender("output_attentions", unit, saw, held=lambda: list(seen["attentions"]))


def _attention_modules(model: nn.Module) -> tuple[list[str], str]:
    """The modules whose outputs nnsight saves: GPT-2's attention modules; the encoder's layers, whose
    attention module is not called at all on the fused inference path (so it has no output to save)."""
    if isinstance(model, nn.TransformerEncoder):
        return [n for n, m in model.named_modules() if isinstance(m, nn.TransformerEncoderLayer)], "layer"
    return [n for n, m in model.named_modules() if type(m).__name__ == "GPT2Attention"], "attention module"


def nnsight_contender(model: nn.Module, x: torch.Tensor) -> Contender:
    try:
        from nnsight import NNsight
    except ImportError:
        return Contender("nnsight", None, skip='nnsight is not installed (pip install ".[peers]")')
    wrapped = NNsight(model)
    names, what = _attention_modules(model)
    seen: dict[str, Any] = {}

    def unit() -> Any:
        model.eval()
        saved: list[Any] = []  # nnsight runs the block's own source; names bound in it do not come back
        with torch.no_grad(), wrapped.trace(x):
            for n in names:
                saved.append(_submodule(wrapped, n).output.save())
        seen["saved"] = saved
        return saved

    def saw() -> str:
        saved = seen["saved"]
        first = saved[0][0] if isinstance(saved[0], tuple) else saved[0]
        return f"{len(saved)} {what} outputs {list(first.shape)}; no kernel, path, reason or map"

    def held() -> list[torch.Tensor]:
        return [s[0] if isinstance(s, tuple) else s for s in seen["saved"]]

    return Contender("nnsight", unit, saw, held=held)


def _submodule(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _offline_tokenizer() -> Any:
    """A word-level tokenizer over the model's vocabulary, built here: the bridge asks for one, the ids are ours."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0")


def lens_contender(length: int) -> Contender:
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        why = 'transformer_lens >= 4 is not installed (pip install ".[peers]")'
        return Contender("TransformerLens", None, skip=why)
    built = gpt2(length, eager=True)
    if isinstance(built, str):
        return Contender("TransformerLens", None, skip=built)
    model, ids = built  # the same weights as the shared model (same seed); the bridge runs it with eager attention
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=_offline_tokenizer())
    seen: dict[str, Any] = {}

    def unit() -> Any:
        with torch.no_grad():
            out, cache = bridge.run_with_cache(ids)
        seen["cache"] = cache
        return out

    def saw() -> str:
        keys = list(seen["cache"].keys())
        pattern = [k for k in keys if k.endswith("hook_pattern")]
        qkv = [k for k in keys if k.endswith(("hook_q", "hook_k", "hook_v"))]
        return (f"{len(keys)} cached activations: {len(pattern)} maps, {len(qkv)} Q/K/V activations; eager attention "
                "(the bridge's), so not the kernel or path your model runs")  # fmt: skip

    return Contender("TransformerLens", unit, saw, held=lambda: list(seen["cache"].values()))


# -- measuring ---------------------------------------------------------------------------------


#: the least CPU time of one sample; the unit runs as often as the baseline needs to fill it
SAMPLE_SECONDS = 0.25


def _timed(unit: Unit, runs: int = 1) -> float:
    """CPU seconds of one run of ``unit``, from ``runs`` runs back to back."""
    gc.collect()
    start = time.process_time()
    for _ in range(runs):
        unit()
    return (time.process_time() - start) / runs


def _memory(c: Contender) -> tuple[float, float]:
    """Peak Python allocations during one run (MB), and the tensor storage it hands back or keeps (MB)."""
    assert c.unit is not None
    gc.collect()
    tracemalloc.start()
    try:
        c.unit()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in c.held()}
    return peak / 2**20, sum(storages.values()) / 2**20


def measure(baseline: Unit, contenders: Sequence[Contender], repeats: int) -> float:
    """Median baseline seconds; fills each contender's paired ratios, memory and what it saw."""
    live = [c for c in contenders if c.unit is not None and c.skip is None]
    baseline()
    for c in live:  # warm-up: first calls, one-off probing, compilation of kernels
        assert c.unit is not None
        c.unit()
    runs = max(1, round(SAMPLE_SECONDS / max(_timed(baseline), 1e-6)))
    base_times = []
    for _ in range(repeats):
        before = _timed(baseline, runs)
        times = []
        for c in live:
            assert c.unit is not None
            times.append(_timed(c.unit, runs))
        after = _timed(baseline, runs)
        b = (before + after) / 2
        base_times += [before, after]
        for c, t in zip(live, times, strict=True):
            c.ratios.append(t / b)
    for c in live:
        assert c.unit is not None
        c.peak_mb, c.held_mb = _memory(c)
    return statistics.median(base_times)


def contenders_for(model_name: str, workload: str, length: int, model: nn.Module, x: torch.Tensor,
                   inner: Unit) -> list[Contender]:  # fmt: skip
    out: list[Contender] = []
    if workload == "weights":
        out.append(qkvtrace_contender(model, inner, maps=True))
        if model_name == "gpt2":
            out.append(output_attentions_contender(length))
        else:
            out.append(Contender("output_attentions", None, skip="a transformers option; the encoder has none"))
        out.append(nnsight_contender(model, x))
        out.append(lens_contender(length) if model_name == "gpt2" else
                   Contender("TransformerLens", None, skip="bridges transformers models, not nn.TransformerEncoder"))
    else:
        out.append(qkvtrace_contender(model, inner, maps=False))
        if model_name == "gpt2":
            out.append(numbers_contender(inner))
        out.append(profiler_contender(inner))
        if workload == "infer":
            out.append(nnsight_contender(model, x))
    return out


#: attention calls in one forward of either model (4 layers, one attention call each)
CALLS_PER_FORWARD = 4


def print_rows(title: str, base_s: float, contenders: Sequence[Contender]) -> None:
    """One row per contender: its paired ratios, and what the median adds per attention call of the forward
    (the median ratio's excess over the untraced median, shared among the forward's ``CALLS_PER_FORWARD``
    calls; a unit's own enter and exit are in it)."""
    print(f"\n{title}  (untraced median {base_s * 1e3:.1f} ms)")
    print(f"  {'contender':18s} {'ratio median':>12s} {'range':>13s} {'us/call':>8s} {'py peak MB':>10s} "
          f"{'held MB':>8s}  saw")  # fmt: skip
    for c in contenders:
        if c.skip is not None or c.unit is None:
            print(f"  {c.name:18s} skipped: {c.skip}")
            continue
        lo, med, hi = min(c.ratios), statistics.median(c.ratios), max(c.ratios)
        per_call = (med - 1) * base_s / CALLS_PER_FORWARD * 1e6
        print(f"  {c.name:18s} {med:12.2f} {lo:6.2f}-{hi:<6.2f} {per_call:+8.0f} {c.peak_mb:10.1f} "
              f"{c.held_mb:8.1f}  {c.saw()}")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None,
                                epilog="Peers: pip install '.[peers]' (nnsight, transformer_lens); missing ones are "
                                       "skipped with a line.")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 7; --quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--lengths", default=None, help="sequence lengths, comma-separated (default 128,512)")
    p.add_argument("--quick", action="store_true", help="the encoder only, sequence 128, 3 repetitions")
    p.add_argument("--models", default=None, help="gpt2,encoder (default both; --quick: encoder)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    lengths = [int(v) for v in (args.lengths or ("128" if args.quick else "128,512")).split(",")]
    models = (args.models or ("encoder" if args.quick else "gpt2,encoder")).split(",")
    print("qkvtrace peer benchmark")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, qkvtrace {qkvtrace.__version__}, "
          f"threads {torch.get_num_threads()}, {os.cpu_count()} logical CPUs, {platform.platform()}")  # fmt: skip
    print(f"  {repeats} interleaved repetitions; date {time.strftime('%Y-%m-%d')}; load "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg()) if hasattr(os, 'getloadavg') else 'n/a'}")
    for model_name in models:
        for length in lengths:
            if model_name == "gpt2":
                built = gpt2(length)
                if isinstance(built, str):
                    print(f"\ngpt2: skipped: {built}")
                    continue
                model, x = built
            else:
                model, x = encoder(length)
            for workload in ("train", "infer", "weights"):
                m = copy.deepcopy(model)
                inner = _step(m, x) if workload == "train" else _forward(m, x)
                contenders = contenders_for(model_name, workload, length, m, x, inner)
                base = measure(inner, contenders, repeats)
                print_rows(f"{model_name} T={length} {workload}", base, contenders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
