"""Claims the README and docs make, each with the test of the default run that witnesses it.

``WITNESSED`` lists every sentence of the README and docs that names a number
or a guarantee about what qkvtrace does ("bit for bit", "never recompiled",
"under 2 MB", "faster in every repetition", "in its own words", ...) beside the
tests that witness it; a test here checks that the page still says it and that
each witness is collected by the default run (the README's test command, which
leaves ``-m slow`` out). A sentence reworded, or a witness moved under
``-m slow`` or removed, fails here until the list is brought up to date.
Figures of the benchmarks (ratios, milliseconds, dated test counts) are
measurements of one run, said with their date and command, not claims a test
can hold; they are not listed.

docs/probe.md also says what a query row whose keys are all masked returns,
naming the PyTorch version each statement was measured on. Each statement is
listed below with its version; the tests check that docs/probe.md still says
it, that the committed report of that version says the same, and — when the
installed PyTorch is that version — that it is what the installed PyTorch does
now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
TORCH = torch.__version__.split("+")[0]

#: docs/probe.md statements about fully-masked rows: version → (sentence, measured facts it states)
CLAIMS: dict[str, tuple[str, dict[str, Any]]] = {
    "2.13.0": (
        "Note what it found on torch 2.13.0: SDPA returns zeros for a fully-masked row, "
        "**the MHA fast path returns NaN** for the same input",
        {"sdpa": "zero", "mha_fast": "nan"},
    ),
    "2.4.1": (
        "on torch 2.4.1 SDPA itself returned NaN with a non-finite gradient",
        {"sdpa": "nan", "sdpa_grad_finite": False},
    ),
}

#: the committed report's probe rows holding the same facts
REPORT_ROWS = {
    "sdpa": ("F.scaled_dot_product_attention (bool mask)", "default", "result"),
    "sdpa_grad_finite": ("F.scaled_dot_product_attention (bool mask)", "default", "grad_finite"),
    "mha_fast": ("nn.MultiheadAttention fast path (eval, no_grad)", None, "result"),
}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _kind(rows: torch.Tensor) -> str:
    rows = rows.detach()
    if bool(torch.isnan(rows).all()):
        return "nan"
    if bool((rows == 0).all()):
        return "zero"
    return "other"


def _report(version: str) -> dict[str, Any] | None:
    found = sorted((ROOT / "reports").glob(f"torch-{version}+*/report.json")) + sorted(
        (ROOT / "reports").glob(f"torch-{version}/report.json")
    )
    return json.loads(found[0].read_text()) if found else None


def _from_report(report: dict[str, Any], fact: str) -> Any:
    api, backend, key = REPORT_ROWS[fact]
    [row] = [r for r in report["probes"]["fully_masked_rows"] if r["api"] == api and r["backend"] == backend]
    return row[key]


def measure() -> dict[str, Any]:
    """What the installed PyTorch returns for a fully-masked row, with no qkvtrace involved."""
    torch.manual_seed(0)
    # SDPA, default backend: query 0 may attend to no key (True = attend, PyTorch's documentation)
    q, k, v = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[0] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
    sdpa = _kind(out[:, :, 0])
    out.nan_to_num(0.0).sum().backward()  # the kernel's own backward, not NaN fed back in
    grads_finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v) if t.grad is not None)
    # MHA in eval under no_grad, every key of sequence 0 padded (True = ignore, PyTorch's documentation)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[0] = True
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        mha_out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    ops = {e.key for e in prof.key_averages()}
    return {
        "sdpa": sdpa,
        "sdpa_grad_finite": grads_finite,
        "mha_fast": _kind(mha_out[0]),
        "mha_fast_path_ran": "aten::_native_multi_head_attention" in ops,
        "sequence_1_finite": bool(torch.isfinite(mha_out[1]).all()),
    }


@pytest.mark.parametrize("version", sorted(CLAIMS))
def test_readme_states_it_and_the_committed_report_agrees(version: str) -> None:
    """Witness: the text of docs/probe.md and the committed report file, against CLAIMS written here."""
    sentence, facts = CLAIMS[version]
    assert _flat(sentence) in _flat((ROOT / "docs" / "probe.md").read_text()), "docs/probe.md changed: update CLAIMS"
    report = _report(version)
    assert report is not None, f"no committed report for torch {version} under reports/"
    assert {fact: _from_report(report, fact) for fact in facts} == facts


def test_the_installed_pytorch_does_what_the_readme_says() -> None:
    """Witness: ``measure()``: PyTorch's own outputs, gradients and profiler, with no qkvtrace involved."""
    if TORCH not in CLAIMS:
        pytest.skip(f"docs/probe.md states no fully-masked-row behaviour for torch {TORCH}")
    _, facts = CLAIMS[TORCH]
    measured = measure()
    assert measured["mha_fast_path_ran"], "MHA did not take its fast path: the claim is about the fast path"
    assert measured["sequence_1_finite"]
    assert {fact: measured[fact] for fact in facts} == facts


def test_the_committed_report_of_this_version_matches_this_pytorch() -> None:
    """Witness: ``measure()``: PyTorch's own outputs, gradients and profiler, with no qkvtrace involved."""
    report = _report(TORCH)
    if report is None:
        pytest.skip(f"no committed report for torch {TORCH}")
    measured = measure()
    assert measured["mha_fast_path_ran"]
    assert {fact: _from_report(report, fact) for fact in REPORT_ROWS} == {fact: measured[fact] for fact in REPORT_ROWS}


#: (page, sentence as it stands there, the tests of the default run that witness it)
WITNESSED: list[tuple[str, str, list[str]]] = [
    ("README.md", "It recommends a change only when the call moved, the results agree and it was faster in every "
     "repetition.", ["tests/test_advise.py::test_recommended_only_when_faster_in_every_repetition"]),
    ("README.md", "a sequence-first module with a float mask needs\n`batch_first=True`, a boolean mask and "
     "`inference_mode` at once",
     ["tests/test_advise_more.py::test_joined_changes_are_all_in_force_at_once_and_the_ones_that_reach_the_fast_path_are_measured"]),
    ("README.md", "Below 140\ncolumns each change prints as a block of lines.",
     ["tests/test_advise_more.py::test_a_training_change_that_ends_on_math_names_the_dropout_and_reads_whole_at_80_columns"]),
    ("docs/development.md", "runs in three of qkvtrace's modules, each entered once",
     ["tests/test_floors.py::test_a_steady_call_runs_in_at_most_three_modules_and_never_comes_back"]),
    ("docs/long-runs.md", "`t.health_alerts` lists the same alerts so far",
     ["tests/test_health.py::test_summarize_alerts_at_the_step_the_witness_crosses_the_threshold",
      "tests/test_health.py::test_summarize_of_a_healthy_run_says_no_alert_and_exits_0"]),
    ("docs/advise.md", "the changed copy was faster **in every repetition**",
     ["tests/test_advise.py::test_recommended_only_when_faster_in_every_repetition"]),
    ("README.md", "20,000 calls of a module that changes twice, with backward and an SGD step after each training "
     "step, hold under 2 MB, measured with `tracemalloc` in the tests, and hundreds of optimizer steps leave no "
     "more live tensor storages than they found",
     ["tests/test_monitor.py::test_a_long_run_reports_exactly_the_steps_where_attention_changed"]),
    ("docs/long-runs.md", "same path, backend, reasons, dtype, masks\nand mode as its module's previous call — is "
     "counted and builds no record", ["tests/test_steady_state.py::test_a_steady_call_builds_no_record_and_is_counted",
                                      "tests/test_steady_state.py::test_steady_counts_nans_and_masked_rows_equal_the_tests_own"]),
    ("docs/long-runs.md", "What 1,000 such calls leave behind does not grow with the calls.",
     ["tests/test_steady_state.py::test_a_steady_state_keeps_no_more_python_objects_the_longer_it_runs"]),
    ("docs/long-runs.md", "20,000 calls of a module that changes twice, with backward and an SGD step (momentum) "
     "after each training step, hold under 2 MB",
     ["tests/test_monitor.py::test_a_long_run_reports_exactly_the_steps_where_attention_changed"]),
    ("README.md", "Tracing changes nothing that runs — outputs bit for bit, path, kernel, random state",
     ["tests/test_property_invisible.py::test_multihead_attention_traced_equals_untraced",
      "tests/test_property_invisible.py::test_sdpa_traced_equals_untraced",
      "tests/test_property_invisible.py::test_encoder_traced_equals_untraced",
      "tests/test_witness.py::test_untraced_traced_untraced_run_the_same_kernels"]),
    ("README.md", "A `torch.compile`d model is never recompiled by a trace",
     ["tests/test_compiled.py::test_compiled_before_the_trace_is_not_recompiled_inside_it[eager-encoder-train]",
      "tests/test_compiled.py::test_compiled_before_the_trace_is_not_recompiled_inside_it[aot_eager-encoder-train]",
      "tests/test_compiled.py::test_compiled_before_the_trace_is_not_recompiled_inside_it[inductor-encoder-eval]",
      "tests/test_compiled.py::test_compiled_inside_the_trace_is_reused_after_it[aot_eager]"]),
    ("docs/trace.md", "and with `inductor` for an eval encoder",
     ["tests/test_compiled.py::test_compiled_before_the_trace_is_not_recompiled_inside_it[inductor-encoder-eval]"]),
    ("README.md", "why PyTorch did not pick a faster SDPA kernel, in its own words",
     ["tests/test_refusals.py::test_cpu_refusal_is_pytorchs_own_warning",
      "tests/test_refusals.py::test_multihead_attention_in_training_says_dropout"]),
    ("README.md", "which code path ran and PyTorch's own reason why",
     ["tests/test_witness.py::test_why_not_fast_path_is_pytorchs_own"]),
    ("docs/compare.md", "and the gradient norms of the module's last backward pass) within `--rtol` (default "
     "`1e-4`, relative)", ["tests/test_tracediff.py::test_rtol_at_its_boundary",
                           "tests/test_tracediff.py::test_gradient_norm_changes_are_reported_per_slice"]),
    ("docs/compare.md", "The default test run diffs two real PyTorch versions through the CLI",
     ["tests/test_diff.py::test_this_pytorch_against_a_stored_older_version"]),
    ("docs/compare.md", "and `compare --train` with two interpreters",
     ["tests/test_tracediff.py::test_compare_train_traces_a_training_step_in_each_environment"]),
    ("docs/compiled.md", "every attention op of its graphs, read from Dynamo's cache",
     ["tests/test_compiled_kernels.py::test_graphs_compiled_and_run_before_the_trace_are_recorded"
      "[inductor-model-own-class]",
      "tests/test_compiled_kernels.py::test_graphs_compiled_and_run_before_the_trace_are_recorded"
      "[aot_eager-compiled-sequential]"]),
    ("docs/compiled.md", "The lists hold the calls that compute attention and nothing else",
     ["tests/test_compiled_kernels.py::test_runs_and_backward_list_attention_kernels_and_only_those",
      "tests/test_compiled_kernels.py::test_aot_eager_lists_every_attention_op_forward_and_backward"]),
    ("docs/overhead.md", "Traced and untraced outputs (and, for W1, every `.grad`) are bit-identical",
     ["tests/test_overhead_benchmark.py::test_identity_check_says_equal_only_when_the_outputs_are"]),
    ("docs/development.md", "nothing the cache keeps is a tensor once a trace closed",
     ["tests/test_trace_reopen.py::test_a_closed_trace_leaves_no_tensor_alive_in_what_it_keeps_for_the_next[mha]",
      "tests/test_trace_reopen.py::test_a_closed_trace_leaves_no_tensor_alive_in_what_it_keeps_for_the_next[sdpa]"]),
    ("README.md", "A call without a graph gets its rows without any of your model's code running again",
     ["tests/test_observe_only.py::test_side_effects_happen_once_per_call[no_grad]",
      "tests/test_observe_only.py::test_no_module_of_the_model_runs_again_while_its_rows_are_read",
      "tests/test_libraries.py::test_library_model_qkv_rows_in_inference[llama-inference_mode-sdpa]"]),
    ("docs/slices.md", "None of your model's code runs twice: not its `forward`, not a hook, not a collective, a lock "
     "or a random draw, and nothing it keeps outside the module (a KV cache in a dict, a counter, a log file) "
     "changes.",
     ["tests/test_observe_only.py::test_no_module_of_the_model_runs_again_while_its_rows_are_read",
      "tests/test_observe_only.py::test_the_random_state_and_hooks_see_one_run[no_grad]",
      "tests/test_observe_only.py::test_a_collective_in_the_forward_with_one_rank_traced",
      "tests/test_observe_only.py::test_a_lock_held_around_the_kernel_does_not_deadlock[inference_mode]",
      "tests/test_observe_only.py::test_a_cache_kept_outside_the_module_gets_each_step_once[inference_mode]",
      "tests/test_observe_only.py::test_side_effects_happen_once_per_call[inference_mode]"]),
    ("docs/slices.md", "The rows are those of the path this call took: a `forward` that does something else when "
     "gradients are off is read as it ran.",
     ["tests/test_observe_only.py::test_rows_are_those_of_the_path_this_call_took[no_grad]"]),
    ("docs/slices.md", "In a decoding loop, the call after one whose layout was new is written down too, so every "
     "step has its rows",
     ["tests/test_observe_only.py::test_a_cache_kept_outside_the_module_gets_each_step_once[no_grad]",
      "tests/test_rows_in_use.py::test_a_decoding_loop_with_a_cache_has_rows_and_its_cache_is_untouched"]),
    ("docs/slices.md", "once a call's layout is one already seen, nothing more is written down",
     ["tests/test_hand_written_watch.py::test_an_sdpa_user_keeps_its_hooks_for_its_first_call_of_each_trace_only"]),
    ("docs/slices.md", "A step whose keys and values only grew by the new token is recorded like its module's "
     "previous step, with its own shapes; PyTorch is asked again which backend it takes.",
     ["tests/test_decoding.py::test_a_decoding_loops_records_equal_records_built_in_full[cat]",
      "tests/test_decoding.py::test_a_generate_loops_records_say_what_each_step_received"]),
    ("docs/advise.md", "A repetition whose ratio is more than ten times away from the median of the repetitions "
     "(the machine paused one side) is a broken sample: it is discarded and taken again, and the time column says "
     "how many were (`discarded` in the JSON);",
     ["tests/test_advise_more.py::test_a_broken_sample_is_discarded_and_taken_again"]),
    ("docs/advise.md", "or when fewer than two good repetitions were left after twice the repetitions asked for.",
     ["tests/test_advise_more.py::test_a_verdict_needs_good_repetitions"]),
    ("docs/long-runs.md", "`qkvtrace summarize` exits 1 when it prints an alert, so a script or a CI step can stop "
     "on it; a run with no alert exits 0.",
     ["tests/test_health.py::test_summarize_alerts_at_the_step_the_witness_crosses_the_threshold",
      "tests/test_health.py::test_summarize_of_a_healthy_run_says_no_alert_and_exits_0"]),
    ("docs/trace.md", "Each part also names its weight and rows as the calls' slices do (`param`, `rows`), and the "
     "record names the module holding them when it is not the module itself (`holder`)",
     ["tests/test_gradients.py::test_gradient_records_name_their_weights_rows_and_holder"]),
    ("docs/advise.md", "With `--train`, `changes results` says which differs: the outputs, or the gradient of the "
     "parameter that differs the most, by how much, against which tolerance.",
     ["tests/test_advise_more.py::test_a_verdict_names_the_gradient_that_differs"]),
    ("docs/advise.md", "the module you hand `advise` itself is `(called by qkvtrace)`.",
     ["tests/test_advise_more.py::test_a_root_module_is_called_by_qkvtrace"]),
    ("docs/slices.md", "Inside a profiler of your own the functions are not run again on stand-ins",
     ["tests/test_dataflow.py::test_an_answer_given_while_profiling_is_not_kept"]),
    ("docs/slices.md", "each function, the tensors it read and the tensors it made. Nothing is copied.",
     ["tests/test_observe_only.py::test_an_input_viewing_a_large_buffer_copies_nothing_of_it",
      "tests/test_lineage.py::test_the_call_s_tensors_and_random_state_are_left_as_they_were"]),
    ("docs/slices.md", "a module that calls its kernel twice (differential attention, with the other half of V the "
     "second time) gets the rows of each call",
     ["tests/test_observe_only.py::test_differential_attention_gives_each_call_its_own_half_of_v[train]",
      "tests/test_observe_only.py::test_differential_attention_gives_each_call_its_own_half_of_v[inference_mode]"]),
    ("docs/development.md", "A steady call now runs 11 of qkvtrace's functions in a long run and 12 with records",
     ["tests/test_slots.py::test_a_steady_call_runs_a_constant_handful_of_functions[changes-direct-11]",
      "tests/test_slots.py::test_a_steady_call_runs_a_constant_handful_of_functions[all-direct-12]"]),
]  # fmt: skip


@pytest.mark.parametrize(("page", "sentence"), sorted({(p, s) for p, s, _ in WITNESSED}))
def test_each_listed_claim_is_still_on_its_page(page: str, sentence: str) -> None:
    """Witness: the page's text, whitespace folded."""
    assert _flat(sentence) in _flat((ROOT / page).read_text()), f"{page} no longer says it: update WITNESSED"


def test_each_claims_witnesses_run_in_the_default_run() -> None:
    """Witness: pytest's own collection of the witnesses with the default options (``-m 'not slow'`` from
    pyproject.toml), in a fresh interpreter: each witness must be collected, so none is slow or missing."""
    nodes = sorted({n for _, _, witnesses in WITNESSED for n in witnesses})
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    collected = {line.split("[")[0] for line in run.stdout.splitlines() if "::" in line}
    collected |= {line for line in run.stdout.splitlines() if "::" in line}
    missing = [n for n in nodes if n not in collected]
    assert not missing, f"not in the default run: {missing}\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
