"""What reading Q/K/V rows in inference costs: a first inference call of a BERT, and eager generation with a cache.

Run ``python benchmarks/inference_rows.py`` (``--quick``: a 4-layer BERT at length 128 and 16 new tokens;
``--repeats N``; ``--threads N``). Needs transformers (``pip install ".[models]"``).

Workloads (random weights, built from a config, CPU)
-----------------------------------------------------
bert first   transformers ``BertModel``, 12 layers, d_model 768, 12 heads (SDPA attention), batch 8, length 256:
             the first call of a fresh model under ``torch.inference_mode()``. Each sample is a fresh process
             (so the call is a first call, and its peak memory is its own): it imports qkvtrace and opens and
             closes one trace of a tiny module (in both arms: the library's own memory is not the trace's),
             builds the model, then times ``model(ids)`` untraced, or ``with qkvtrace.trace(model):
             model(ids)`` (opening and closing the trace included).
generate     transformers ``LlamaForCausalLM``, eager decoding with its dynamic KV cache: ``generate`` of 32 new
             tokens, greedy, from a prompt of 16, in one process, untraced and inside one trace, alternately; two
             sizes: a small one (4 layers, d_model 256, 4 heads, 2 KV heads: each call's own work is small, so
             this row shows the most a call's record can cost) and one of GPT-2 small's size (12 layers, d_model
             768, 12 heads, 4 KV heads).

Each row prints the median of the paired ratios traced / untraced (each traced sample beside the untraced one
measured just before it) with their range, and how many of the traced calls have their Q/K/V rows. Time is the
process's CPU time (``time.process_time``, every thread's work); the BERT rows also give the peak resident
memory of each process (``ru_maxrss``) and its ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_FIRST = """
import json, resource, sys, time, torch, transformers
layers, length, traced, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
config = transformers.BertConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                                 intermediate_size=3072, attn_implementation="sdpa")
model = transformers.BertModel(config).eval()
ids = torch.randint(0, config.vocab_size, (8, length))
import qkvtrace
with qkvtrace.trace(torch.nn.Linear(2, 2)):  # (both arms: the library loaded and installed once, as in a session)
    pass
with torch.inference_mode():
    start = time.process_time()
    if traced:
        with qkvtrace.trace(model) as t:
            model(ids)
        rows = sum(c.qkv.layout is not None for c in t.calls)
        calls = len(t.calls)
    else:
        model(ids)
        rows = calls = 0
    cpu = time.process_time() - start
print(json.dumps({"cpu": cpu, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rows": rows, "calls": calls}))
"""


def first_call(layers: int, length: int, traced: bool, threads: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _FIRST, str(layers), str(length), "1" if traced else "0",
                           str(threads)], capture_output=True, text=True, check=True)  # fmt: skip
    found: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _row(name: str, ratios: list[float], extra: str = "") -> str:
    return f"{name:<36} {statistics.median(ratios):6.3f}  ({min(ratios):.3f}-{max(ratios):.3f})  {extra}"


def bench_first(layers: int, length: int, repeats: int, threads: int) -> list[str]:
    times, peaks, rows = [], [], ""
    for _ in range(repeats):
        plain = first_call(layers, length, False, threads)
        traced = first_call(layers, length, True, threads)
        times.append(traced["cpu"] / plain["cpu"])
        peaks.append(traced["peak_mib"] / plain["peak_mib"])
        rows = (f"rows on {int(traced['rows'])} of {int(traced['calls'])} calls; untraced {plain['cpu']:.2f} s, "
                f"{plain['peak_mib']:.0f} MiB peak; traced {traced['peak_mib']:.0f} MiB")  # fmt: skip
    name = f"bert first ({layers}x768, len {length})"
    return [_row(name + " time", times, rows), _row(name + " peak memory", peaks)]


#: the decoders' sizes: (name, layers, d_model, heads, KV heads)
_DECODERS = (("small", 4, 256, 4, 2), ("GPT-2 small's size", 12, 768, 12, 4))


def bench_generate(new_tokens: int, repeats: int, threads: int, size: tuple[str, int, int, int, int]) -> list[str]:
    import torch
    import transformers

    import qkvtrace

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    name, layers, width, heads, kv_heads = size
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=width, intermediate_size=2 * width,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 1000, (1, 16))
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "use_cache": True}

    def untraced() -> tuple[float, torch.Tensor]:
        start = time.process_time()
        out = model.generate(prompt, **kwargs)
        return time.process_time() - start, out

    def traced() -> tuple[float, torch.Tensor, int, int]:
        start = time.process_time()
        with qkvtrace.trace(model) as t:
            out = model.generate(prompt, **kwargs)
        cpu = time.process_time() - start
        return cpu, out, sum(c.qkv.layout is not None for c in t.calls), len(t.calls)

    untraced()  # (warm-up: the first generate builds caches of transformers' own)
    ratios, said = [], ""
    for _ in range(repeats):
        a, plain = untraced()
        b, out, rows, calls = traced()
        if not torch.equal(plain, out):
            raise SystemExit("traced generation gave other tokens than untraced")
        ratios.append(b / a)
        said = f"rows on {rows} of {calls} calls; same tokens; untraced {a * 1000:.0f} ms"
    return [_row(f"generate {new_tokens}, {name}", ratios, said)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 4-layer BERT at length 128, 16 new tokens")
    parser.add_argument("--repeats", type=int, default=3, help="paired samples per row (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    layers, length, tokens = (4, 128, 16) if args.quick else (12, 256, 32)
    print(f"{'workload':<36} {'traced / untraced, median (range)'}")
    for line in bench_first(layers, length, args.repeats, args.threads):
        print(line, flush=True)
    for size in _DECODERS:
        for line in bench_generate(tokens, max(args.repeats, 5), args.threads, size):
            print(line, flush=True)


if __name__ == "__main__":
    main()
