"""``qkvtrace diff A.json B.json``: what changed between two traces of a model, call by call.

Each test traces one model under two conditions that really change what
runs, and checks the diff against facts obtained independently in the test:
the attention kernels ``torch.profiler`` saw in untraced runs, dtypes and
norms computed here from the tensors and weights, and modules made to run
or not by construction.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace
from qkvtrace.analyses.tracediff import diff_traces


def _profiled_attention_ops(run: Any) -> list[str]:
    """The attention kernels an untraced run dispatches (the witness)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = []
    for e in prof.events():
        if e.name.startswith("aten::") and ("attention" in e.name or e.name in ("aten::_softmax", "aten::softmax")):
            if e.name not in names:
                names.append(e.name)
    return names


def _trace(model: nn.Module, run: Any) -> dict[str, Any]:
    with qkvtrace.trace(model) as t:
        run()
    return t.to_dict()


def _changes(d: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    [call] = d["changed"]
    return {c["field"]: (c["was"], c["became"]) for c in call["changes"]}


def test_eval_versus_training_changes_path_and_kernels() -> None:
    """MultiheadAttention in eval+no_grad (fast path) vs training (fallback).

    Witness: the profiler of untraced runs -- the eval run dispatches
    ``aten::_native_multi_head_attention``, the training run does not.
    """
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)

    def run_eval() -> Any:
        mha.eval()
        with torch.no_grad():
            return mha(x, x, x, need_weights=False)

    def run_train() -> Any:
        mha.train()
        return mha(x, x, x, need_weights=False)

    fast_ops, slow_ops = _profiled_attention_ops(run_eval), _profiled_attention_ops(run_train)
    assert "aten::_native_multi_head_attention" in fast_ops and "aten::_native_multi_head_attention" not in slow_ops
    a, b = _trace(mha, run_eval), _trace(mha, run_train)
    d = diff_traces(a, b)
    ch = _changes(d)
    assert ch["path"] == ("fast", "fallback")
    assert "aten::_native_multi_head_attention" in ch["aten_ops"][0]
    assert "aten::_native_multi_head_attention" not in ch["aten_ops"][1]
    assert set(ch["aten_ops"][1]) <= set(slow_ops)
    assert ch["inputs.training"] == (False, True)
    assert d["appeared"] == d["vanished"] == []


def test_need_weights_changes_the_kernel() -> None:
    """need_weights=False (SDPA) vs True (explicit softmax): witness, the profiler of untraced runs."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).train()
    x = torch.randn(2, 5, 16)
    runs = {w: (lambda w=w: mha(x, x, x, need_weights=w)) for w in (False, True)}
    ops = {w: _profiled_attention_ops(r) for w, r in runs.items()}
    assert "aten::scaled_dot_product_attention" in ops[False]
    assert "aten::scaled_dot_product_attention" not in ops[True]
    d = diff_traces(_trace(mha, runs[False]), _trace(mha, runs[True]))
    ch = _changes(d)
    assert ch["inputs.need_weights"] == (False, True)
    assert ch["sdpa_backend"][1] is None  # no SDPA kernel ran with weights (the profiler above)
    assert "aten::scaled_dot_product_attention" not in (ch["aten_ops"][1] or [])


class Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(2, -1, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_mask_dtype_change_is_reported_as_passed() -> None:
    """A boolean then a float mask: the dtypes in the diff are those of the tensors the test passed."""
    torch.manual_seed(0)
    model = Direct()
    x = torch.randn(2, 5, 16)
    bool_mask = torch.ones(5, 5, dtype=torch.bool).tril()
    float_mask = torch.zeros(5, 5).masked_fill(~bool_mask, float("-inf"))
    a = _trace(model, lambda: model(x, bool_mask))
    b = _trace(model, lambda: model(x, float_mask))
    ch = _changes(diff_traces(a, b))
    was, became = ch["inputs.attn_mask"]
    assert was["dtype"] == str(bool_mask.dtype) and became["dtype"] == str(float_mask.dtype)


def test_weight_norm_change_beyond_tolerance() -> None:
    """W_Q's rows doubled between two traces: witness, the norms of those rows computed here."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)

    def run() -> Any:
        with torch.no_grad():
            return mha(x, x, x, need_weights=False)

    before = float(mha.in_proj_weight[:16].detach().norm())
    a = _trace(mha, run)
    with torch.no_grad():
        mha.in_proj_weight[:16] *= 2
    after = float(mha.in_proj_weight[:16].detach().norm())
    b = _trace(mha, run)
    ch = _changes(diff_traces(a, b))
    assert ch["qkv.q.weight_norm"][0] == pytest.approx(before, rel=1e-6)
    assert ch["qkv.q.weight_norm"][1] == pytest.approx(after, rel=1e-6)
    assert "qkv.k.weight_norm" not in ch and "qkv.v.weight_norm" not in ch


class EagerOrSDPA(nn.Module):
    """One attention, written by hand (eager) or through SDPA, with the same weights (4 heads of 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.num_heads, self.eager = 4, True

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(2, -1, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.eager:
            return ((q @ k.transpose(-2, -1)) * 0.5 + mask).softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_eager_and_sdpa_versions_of_one_model_count_the_same_fully_masked_rows() -> None:
    """The same [T, T] mask (row 1 blocked, built here) on an eager and an SDPA version of one model: no change
    in fully-masked rows. Witness: the mask, whose one blocked row is counted here in each of the 2 x 4 (batch,
    head) pairs the kernels run."""
    torch.manual_seed(0)
    model = EagerOrSDPA()
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(5, 5)
    mask[1] = float("-inf")
    a = _trace(model, lambda: model(x, mask))
    model.eager = False
    b = _trace(model, lambda: model(x, mask))
    want = int(torch.isneginf(mask).all(-1).sum()) * 2 * 4
    assert [(c["path"], c["output"]["fully_masked_rows"]) for c in (*a["calls"], *b["calls"])] == [
        ("hand_written", want), ("sdpa", want)]  # fmt: skip
    assert "output.fully_masked_rows" not in _changes(diff_traces(a, b))


def test_fully_masked_rows_of_an_older_trace_are_not_compared() -> None:
    """A /2 trace counted fully-masked rows otherwise: a diff with it does not report them, and says why.
    Witness: the masks passed here (one row blocked in A, none in B: the /3 counts differ by construction)."""
    torch.manual_seed(0)
    model = Direct()
    x = torch.randn(2, 5, 16)
    blocked = torch.ones(5, 5, dtype=torch.bool)
    blocked[2] = False  # True = attend (SDPA)
    a = _trace(model, lambda: model(x, blocked))
    b = _trace(model, lambda: model(x, torch.ones(5, 5, dtype=torch.bool)))
    assert _changes(diff_traces(a, b))["output.fully_masked_rows"] == (2 * 4, 0)
    older = {**a, "schema": "qkvtrace.trace/2"}
    d = diff_traces(older, b)
    assert d["changed"] == [] or "output.fully_masked_rows" not in _changes(d)
    assert "fully-masked rows not compared: qkvtrace.trace/2 and qkvtrace.trace/3" in d["summary"]
    assert "not compared" not in diff_traces(older, older)["summary"]


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.MultiheadAttention(16, 4, batch_first=True)
        self.second = nn.MultiheadAttention(16, 4, batch_first=True)
        self.use_second = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x, x, x, need_weights=False)[0]
        if self.use_second:
            x = self.second(x, x, x, need_weights=False)[0]
        return x


def test_appeared_and_vanished_calls() -> None:
    """A module made to run only in B (by construction): it appears; swapping the traces, it vanishes."""
    model = TwoBlocks().eval()
    x = torch.randn(2, 5, 16)
    a = _trace(model, lambda: model(x))
    model.use_second = True
    b = _trace(model, lambda: model(x))
    d = diff_traces(a, b)
    assert [e["module"] for e in d["appeared"]] == ["second"] and d["vanished"] == []
    assert [e["module"] for e in diff_traces(b, a)["vanished"]] == ["second"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", "diff", *args], capture_output=True, text=True)


def test_cli_exit_codes_and_outputs(tmp_path: Path) -> None:
    """Exit 1 when something changed, 0 when nothing did; the JSON validates; Markdown names the change.

    Witness: the two traces are of eval and training (path fast vs fallback, shown by the profiler test above).
    """
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    mha.eval()
    with torch.no_grad():
        a = _trace(mha, lambda: mha(x, x, x, need_weights=False))
    mha.train()
    b = _trace(mha, lambda: mha(x, x, x, need_weights=False))
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    changed = _cli(str(pa), str(pb), "--json", str(tmp_path / "d.json"), "--md", str(tmp_path / "d.md"))
    assert changed.returncode == 1, changed.stderr
    assert "fast" in changed.stdout and "fallback" in changed.stdout
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["schema"] == "qkvtrace.tracediff/1"
    assert "| (root) | path | fast | fallback |" in (tmp_path / "d.md").read_text()
    same = _cli(str(pa), str(pa))
    assert same.returncode == 0 and "no change" in same.stdout


def test_cli_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    """A damaged trace, and a trace beside a report: exit 2, one line naming the file (no traceback).

    Witness: the damaged file the test wrote (an index that is not a number), and the committed report folder.
    """
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"schema": "qkvtrace.trace/1", "calls": [], "gradients": [], "routes": [],
                                "unobserved": [], "warnings": [], "torch_version": "x"}))  # fmt: skip
    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"schema": "qkvtrace.trace/1", "calls": [{"index": "zero"}]}')
    out = _cli(str(good), str(damaged))
    assert out.returncode == 2
    assert "damaged.json" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    report = Path(__file__).resolve().parents[1] / "reports" / "torch-2.13.0+cpu"
    if report.exists():
        mixed = _cli(str(good), str(report))
        assert mixed.returncode == 2 and "not of one kind" in mixed.stderr


def test_compare_a_target_across_two_environments(tmp_path: Path) -> None:
    """``qkvtrace compare --python A --python B demo:tiny-lm``, B with the flash backend switched off at start-up.

    Witness: ``torch._fused_sdp_choice`` on the demo's own query shape, with
    the switch on and off, computed here -- the backend each environment's
    trace must report.
    """
    from qkvtrace.analyses.demos import DEMOS  # noqa: F401  (the demo exists in this qkvtrace)

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.backends.cuda.enable_flash_sdp(False)\n")
    wrapper = tmp_path / "python-no-flash"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH="{site}:$PYTHONPATH"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    q = torch.zeros(2, 4, 16, 8)
    on = int(torch._fused_sdp_choice(q, q, q, None, 0.0, True))
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        off = int(torch._fused_sdp_choice(q, q, q, None, 0.0, True))
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    names = {int(v): n for n, v in torch.nn.attention.SDPBackend.__members__.items()}
    assert on != off
    out = subprocess.run([sys.executable, "-m", "qkvtrace", "compare", "demo:tiny-lm", "--python", sys.executable,
                          "--python", str(wrapper), "--out", str(tmp_path / "out"), "--json", str(tmp_path / "d.json")],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1, out.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    backends = {
        (c["was"], c["became"]) for call in d["changed"] for c in call["changes"] if c["field"] == "sdpa_backend"
    }
    assert backends == {(names[on], names[off])}
    assert sorted(p.name.split(".")[1] for p in (tmp_path / "out" / "traces").glob("*.json")) == ["a", "b"]


def _norm_change_traces(tmp_path: Path, factor: float) -> tuple[Path, Path, float, float]:
    """Two traces of one MHA whose W_Q rows are scaled by ``factor`` in between: the files, and |W_Q| before and
    after, computed here from the weights."""
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)

    def run() -> Any:
        with torch.no_grad():
            return mha(x, x, x, need_weights=False)

    before = float(mha.in_proj_weight[:16].detach().double().norm())
    a = _trace(mha, run)
    with torch.no_grad():
        mha.in_proj_weight[:16] *= factor
    after = float(mha.in_proj_weight[:16].detach().double().norm())
    b = _trace(mha, run)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return pa, pb, before, after


def test_rtol_at_its_boundary(tmp_path: Path) -> None:
    """``--rtol`` just below the relative change of |W_Q| reports it (exit 1); just above, nothing (exit 0).

    Witness: the relative change |after - before| / max(before, after) of the norms of W_Q's rows, computed here
    in float64 from the weights the test scaled by 1.01 (K and V untouched).
    """
    pa, pb, before, after = _norm_change_traces(tmp_path, 1.01)
    relative = abs(after - before) / max(before, after)
    below = _cli(str(pa), str(pb), "--rtol", repr(relative * 0.999), "--json", str(tmp_path / "below.json"))
    above = _cli(str(pa), str(pb), "--rtol", repr(relative * 1.001), "--json", str(tmp_path / "above.json"))
    assert (below.returncode, above.returncode) == (1, 0), (below.stdout, above.stdout)
    fields = [c["field"] for call in json.loads((tmp_path / "below.json").read_text())["changed"]
              for c in call["changes"]]  # fmt: skip
    assert fields == ["qkv.q.weight_norm"]
    assert json.loads((tmp_path / "above.json").read_text())["changed"] == []
    assert _cli(str(pa), str(pb), "--rtol", "-0.1").returncode == 2


def test_gradient_norm_changes_are_reported_per_slice() -> None:
    """The loss of B is 3x A's (a fixed random weighting of the outputs): every slice's gradient norm triples, and
    the diff says so with the norms.

    Witness: the norms of the rows of ``in_proj_weight.grad`` and ``in_proj_bias.grad``, computed here after each
    backward pass (rows [0,E), [E,2E), [2E,3E): nn.MultiheadAttention's own layout).
    """
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 16)  # a loss that depends on where each query attends
    traces, want = [], []
    for scale in (1.0, 3.0):
        mha.zero_grad(set_to_none=True)
        with qkvtrace.trace(mha) as t:
            ((mha(x, x, x, need_weights=False)[0] * r).sum() * scale).backward()
        traces.append(t.to_dict())
        w, b = mha.in_proj_weight.grad, mha.in_proj_bias.grad
        assert w is not None and b is not None
        want.append({p: (float(w[i * 16:(i + 1) * 16].norm()), float(b[i * 16:(i + 1) * 16].norm()))
                     for i, p in enumerate("qkv")})  # fmt: skip
    d = diff_traces(*traces)
    got = _changes(d)
    for p in "qkv":
        for j, key in enumerate(("grad_norm", "bias_grad_norm")):
            if (p, key) == ("k", "bias_grad_norm"):  # 0 up to rounding: a bias shared by every key moves no score
                continue
            was, became = got[f"gradients.{p}.{key}"]
            assert (was, became) == (pytest.approx(want[0][p][j], rel=1e-5), pytest.approx(want[1][p][j], rel=1e-5))
            assert became == pytest.approx(3 * was, rel=1e-5)
    assert not any(f.startswith(("qkv.", "path", "sdpa")) for f in got)  # the weights and kernels did not change
    assert diff_traces(*traces, rtol=3.0)["changed"] == []  # a tripling is a relative change of 2/3 < 3


def test_compare_train_traces_a_training_step_in_each_environment(tmp_path: Path) -> None:
    """``qkvtrace compare demo:tiny-lm --train`` with the same interpreter twice: each trace is of a training step
    (training mode, grad on, gradients recorded), and nothing differs (exit 0).

    Witness: the traces compare wrote, read here: a backward pass ran (gradient records exist, one per attention
    module) and every call says training and grad enabled.
    """
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "qkvtrace", "compare", "demo:tiny-lm", "--train", "--python",
                          sys.executable, "--python", sys.executable, "--out", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    traces = [json.loads(p.read_text()) for p in sorted((out / "traces").glob("*.json"))]
    assert len(traces) == 2
    for t in traces:
        assert t["calls"] and all(c["inputs"]["training"] and c["inputs"]["grad_enabled"] for c in t["calls"])
        assert {g["module"] for g in t["gradients"]} == {c["module"] for c in t["calls"]}


def test_every_compared_fact_on_traces_written_by_hand() -> None:
    """Two trace documents written here, differing in one known way per fact; the whole diff, written by hand.

    Witness: the documents and the rules of docs/compare.md applied by hand: calls matched by module and order
    among its calls (not by list order); the facts PyTorch decides compared exactly (a fact one side does not
    record is not a change; refusals only when both sides ran SDPA; a mask by its kind and dtype only); norms
    within ``rtol`` relative (None against a number moves, NaN against NaN does not); gradients from each module's
    last backward pass, for its first call; the appeared and vanished calls; the one-line summary.
    """
    nan = float("nan")
    a = {"schema": "qkvtrace.trace/1", "torch_version": "1.0", "calls": [  # listed out of order on purpose
        {"index": 1, "module": "B", "path": "sdpa", "sdpa_backend": "MATH", "sdpa_refusals": {"W": "w"}},
        {"index": 2, "module": "a", "path": "fallback"},
        {"index": 0, "module": "a", "path": "fallback", "sdpa_backend": "FLASH_ATTENTION",
         "why_not_fast_path": "training is enabled", "sdpa_refusals": {"X": "r"}, "aten_ops": ["k1"],
         "backward_kernel": "bk", "error": None,
         "inputs": {"dtype": "float32", "training": True, "need_weights": False, "only_here": 1,
                    "attn_mask": {"kind": "bool", "dtype": "torch.bool", "other": 1}},
         "output": {"nan_count": 0, "fully_masked_rows": 0},
         "qkv": {"layout": "packed", "q": {"weight_norm": 1.0, "bias_norm": None, "activation_norm": nan},
                 "k": {"weight_norm": 2.0}, "v": {"weight_norm": 3.0}}},
        {"index": 4, "module": "a", "path": "fallback"},
        {"index": 3, "module": "0gone", "path": "fast", "sdpa_backend": None},
    ], "gradients": [
        {"module": "a", "backward_index": 1, "q": {"grad_norm": 5.0, "bias_grad_norm": 1.0}},
        {"module": "a", "backward_index": 0, "q": {"grad_norm": 100.0, "bias_grad_norm": 100.0}},
    ]}
    b = {"schema": "qkvtrace.trace/2", "torch_version": "2.0", "calls": [
        {"index": 3, "module": "0new", "path": "sdpa", "sdpa_backend": None},
        {"index": 2, "module": "new", "path": "sdpa", "sdpa_backend": "MATH"},
        {"index": 0, "module": "a", "path": "fast", "sdpa_backend": "MATH", "why_not_fast_path": None,
         "sdpa_refusals": {"Y": "s"}, "aten_ops": ["k2"], "backward_kernel": "bk", "error": None,
         "inputs": {"dtype": "float16", "training": True, "need_weights": True,
                    "attn_mask": {"kind": "float", "dtype": "torch.float32", "other": 2}},
         "output": {"nan_count": 3, "fully_masked_rows": 0},
         "qkv": {"layout": "separate", "q": {"weight_norm": 1.00005, "bias_norm": 0.5, "activation_norm": nan},
                 "k": {"weight_norm": 2.1}, "v": {"weight_norm": 4.0}}},
        {"index": 1, "module": "B", "path": "sdpa", "sdpa_backend": None, "sdpa_refusals": {"Z": "z"}},
    ], "gradients": [{"module": "a", "backward_index": 0, "q": {"grad_norm": 5.0, "bias_grad_norm": 2.0}},
                     {"module": "B", "backward_index": 0, "v": {"grad_norm": 7.0}}]}  # B: a gradient on one side

    def ch(field: str, label: str, was: Any, became: Any, kind: str = "exact") -> dict[str, Any]:
        return {"field": field, "label": label, "was": was, "became": became, "kind": kind}

    d = diff_traces(a, b)
    assert d["schema"] == "qkvtrace.tracediff/1" and d["rtol"] == 1e-4
    assert (d["a"], d["b"]) == ({"torch_version": "1.0", "calls": 5}, {"torch_version": "2.0", "calls": 4})
    assert d["changed"] == [
        {"module": "a", "occurrence": 0, "index_a": 0, "index_b": 0, "changes": [
            ch("path", "path", "fallback", "fast"),
            ch("sdpa_backend", "SDPA backend", "FLASH_ATTENTION", "MATH"),
            ch("why_not_fast_path", "why not fast", "training is enabled", None),
            ch("sdpa_refusals", "why not a faster kernel", {"X": "r"}, {"Y": "s"}),
            ch("aten_ops", "aten kernels", ["k1"], ["k2"]),
            ch("inputs.dtype", "dtype", "float32", "float16"),
            ch("inputs.need_weights", "need weights", False, True),
            ch("inputs.attn_mask", "attn mask", {"kind": "bool", "dtype": "torch.bool"},
               {"kind": "float", "dtype": "torch.float32"}),
            ch("output.nan_count", "nan count", 0, 3),
            ch("qkv.layout", "Q/K/V layout", "packed", "separate"),
            ch("qkv.q.bias_norm", "|Q| bias", None, 0.5, "norm"),
            ch("qkv.k.weight_norm", "|K| weight", 2.0, 2.1, "norm"),
            ch("qkv.v.weight_norm", "|V| weight", 3.0, 4.0, "norm"),
            ch("gradients.q.bias_grad_norm", "|dQ| bias_grad", 1.0, 2.0, "norm"),
        ]},
        {"module": "B", "occurrence": 0, "index_a": 1, "index_b": 1, "changes": [
            ch("sdpa_backend", "SDPA backend", "MATH", None),
            ch("gradients.v.grad_norm", "|dV| grad", None, 7.0, "norm"),
        ]},
    ]  # fmt: skip
    assert d["vanished"] == [  # in the order of the calls, not of their names
        {"module": "a", "occurrence": 1, "index": 2, "path": "fallback", "sdpa_backend": None},
        {"module": "0gone", "occurrence": 0, "index": 3, "path": "fast", "sdpa_backend": None},
        {"module": "a", "occurrence": 2, "index": 4, "path": "fallback", "sdpa_backend": None},
    ]
    assert d["appeared"] == [
        {"module": "new", "occurrence": 0, "index": 2, "path": "sdpa", "sdpa_backend": "MATH"},
        {"module": "0new", "occurrence": 0, "index": 3, "path": "sdpa", "sdpa_backend": None},
    ]
    assert d["summary"] == (
        "torch 1.0 (5 calls) → 2.0 (4 calls): Q/K/V layout changed in 1 call; SDPA backend changed in 2 calls; "
        "aten kernels changed in 1 call; attn mask changed in 1 call; "
        "dtype changed in 1 call; nan count changed in 1 call; need weights changed in 1 call; path changed in "
        "1 call; why not a faster kernel changed in 1 call; why not fast changed in 1 call; |K| weight changed in "
        "1 call; |Q| bias changed in 1 call; |V| weight changed in 1 call; |dQ| bias_grad changed in 1 call; "
        "|dV| grad changed in 1 call; 2 call(s) appeared; 3 call(s) vanished"
    )
    # a wider rtol keeps the 5 % norm change of K but not the 0.005 % one of Q; NaN against a number moves
    wide = diff_traces(a, b, rtol=0.04)
    assert [c["field"] for c in wide["changed"][0]["changes"] if c["kind"] == "norm"] == [
        "qkv.q.bias_norm", "qkv.k.weight_norm", "qkv.v.weight_norm", "gradients.q.bias_grad_norm"]  # fmt: skip
    # B's gradient record seen from the other side: a gradient on A's side only is a change too
    swapped = {c["field"]: (c["was"], c["became"]) for c in diff_traces(b, a)["changed"][1]["changes"]}
    assert swapped["gradients.v.grad_norm"] == (7.0, None)
    b["calls"][2]["qkv"]["q"]["activation_norm"] = 1.0
    fields = [c["field"] for c in diff_traces(a, b)["changed"][0]["changes"]]
    assert "qkv.q.activation_norm" in fields and "qkv.q.weight_norm" not in fields
    same = diff_traces(a, a)
    assert (same["changed"], same["appeared"], same["vanished"]) == ([], [], [])
    assert same["summary"] == "torch 1.0 (5 calls) → 1.0 (5 calls): no change in what ran"
    one = {"schema": "qkvtrace.trace/1", "torch_version": "x", "calls": [{"index": 0, "module": "m"}]}
    assert diff_traces(one, one)["summary"] == "torch x (1 call) → x (1 call): no change in what ran"


@pytest.mark.parametrize("side", ["A", "B"])
def test_a_document_that_is_not_a_trace_is_refused_with_its_name(side: str) -> None:
    """Witness: a report-schema document written here, given as trace A or as trace B."""
    from qkvtrace.analyses.tracediff import is_trace
    from qkvtrace.base.errors import SchemaError

    trace = {"schema": "qkvtrace.trace/1", "calls": []}
    other = {"schema": "qkvtrace.report/1"}
    args = (other, trace) if side == "A" else (trace, other)
    with pytest.raises(SchemaError) as raised:
        diff_traces(*args)
    assert str(raised.value) == f"trace {side}: expected a qkvtrace.trace file, got 'qkvtrace.report/1'"
    assert is_trace(trace) and not is_trace(other) and not is_trace([trace]) and not is_trace({})


@pytest.mark.parametrize(("was", "became"), [(1.0, 2.0), (2.0, 1.0), (1e-6, 2e-6)])
def test_a_norm_moves_only_beyond_rtol_of_the_larger_value(was: float, became: float) -> None:
    """|a - b| > rtol · max(|a|, |b|): at rtol = 0.5 the halving or doubling sits exactly on the boundary (not a
    change), at 0.4 it is one -- for values near 1 and near 0, either way round.

    Witness: the rule docs/compare.md states, applied here to exactly representable values.
    """

    def doc(norm: float) -> dict[str, Any]:
        return {"schema": "qkvtrace.trace/1", "torch_version": "x", "gradients": [],
                "calls": [{"index": 0, "module": "m", "qkv": {"q": {"weight_norm": norm}}}]}  # fmt: skip

    assert diff_traces(doc(was), doc(became), rtol=0.5)["changed"] == []
    [call] = diff_traces(doc(was), doc(became), rtol=0.4)["changed"]
    assert [(c["field"], c["was"], c["became"]) for c in call["changes"]] == [("qkv.q.weight_norm", was, became)]


def test_appeared_and_vanished_calls_in_call_order() -> None:
    """Thirty calls on one side only, listed in the document against their order, their modules named so that a
    set of them has no useful order. Witness: the call indices written here. Fault caught: the calls that appeared
    or vanished given in a set's order rather than the order the model made them."""
    names = [f"m{(i * 7919) % 101}" for i in range(30)]
    only = [{"index": i, "module": n, "path": "sdpa", "sdpa_backend": "MATH"} for i, n in enumerate(names)]
    shared = {"index": 30, "module": "kept", "path": "sdpa", "sdpa_backend": "MATH"}
    a = {"schema": "qkvtrace.trace/3", "torch_version": "1.0", "calls": [shared, *reversed(only)]}
    b = {"schema": "qkvtrace.trace/3", "torch_version": "2.0", "calls": [shared]}
    assert [c["index"] for c in diff_traces(a, b)["vanished"]] == list(range(30))
    assert [c["index"] for c in diff_traces(b, a)["appeared"]] == list(range(30))


def test_changed_calls_in_call_order() -> None:
    """Thirty calls on both sides, each on another path in B, listed in both documents against their order, their
    modules named so that a set of them has no useful order. Witness: the call indices written here. Fault caught:
    the changed calls given in a set's order rather than the order the model made them."""
    names = [f"m{(i * 7919) % 101}" for i in range(30)]
    calls = [{"index": i, "module": n, "sdpa_backend": "MATH"} for i, n in enumerate(names)]
    a = {"schema": "qkvtrace.trace/3", "torch_version": "1.0", "calls": [{**c, "path": "sdpa"} for c in calls[::-1]]}
    b = {"schema": "qkvtrace.trace/3", "torch_version": "2.0", "calls": [{**c, "path": "fast"} for c in calls[::-1]]}
    changed = diff_traces(a, b)["changed"]
    assert [(c["module"], c["index_a"], c["index_b"]) for c in changed] == [(n, i, i) for i, n in enumerate(names)]


def test_the_note_on_an_older_trace_follows_the_whole_summary() -> None:
    """A /2 trace against a /3 one: the summary says what changed, then why fully-masked rows were not compared.

    Witness: the one call written here on each side (its path changed, its fully-masked rows too) and the rule
    docs/json.md states for /3 (every (batch, head, query) row counted). Fault caught: the note replacing the
    summary instead of following it, or its words changed."""
    call = {"index": 0, "module": "m", "sdpa_backend": "MATH", "output": {"fully_masked_rows": 1}}
    a = {"schema": "qkvtrace.trace/2", "torch_version": "1.0", "calls": [{**call, "path": "sdpa"}]}
    b = {"schema": "qkvtrace.trace/3", "torch_version": "2.0",
         "calls": [{**call, "path": "fast", "output": {"fully_masked_rows": 8}}]}  # fmt: skip
    assert diff_traces(a, b)["summary"] == (
        "torch 1.0 (1 call) → 2.0 (1 call): path changed in 1 call; fully-masked rows not compared: "
        "qkvtrace.trace/2 and qkvtrace.trace/3 count them differently (since qkvtrace.trace/3 every (batch, head, "
        "query) row)")  # fmt: skip
