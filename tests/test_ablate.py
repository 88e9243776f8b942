"""`qkvtrace ablate`: the ablated attention against PyTorch's own, the tutorial's claims, fair runs, the CLI."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkvtrace.analyses.ablate import (
    ABLATE_SCHEMA,
    MODES,
    TASKS,
    check_properties,
    make_attention,
    make_model,
    run_ablation,
    train_run,
    training_batches,
)
from qkvtrace.base.errors import SchemaError
from qkvtrace.records.validation import check_document, load_json

ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
ATTENTION_MODES = [m for m in MODES if m != "no_attention"]
#: the modes of docs/ablate.md's table, in its order (written here, not read from the module)
DOCUMENTED_MODES = ["full", "identity_qkv", "shared_qk", "uniform", "identity_v", "no_attention"]


def qkv(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qkvtrace", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def small() -> dict:
    """Every mode, two seeds, a few steps: the shape of a study, not its outcome."""
    return run_ablation("lookup", seeds=[0, 1], steps=5).to_dict()


# -- the attention of each mode, against PyTorch's scaled_dot_product_attention ----------------------


@pytest.mark.parametrize("mode", ATTENTION_MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_each_mode_is_sdpa_of_the_q_k_v_it_names(mode: str, causal: bool) -> None:
    """Witness: PyTorch's scaled_dot_product_attention on the Q, K, V each mode names, built here."""
    torch.manual_seed(0)
    attn = make_attention(8, mode)
    x = torch.randn(3, 5, 8)
    zero = torch.zeros_like(x)
    proj = {name: mod for name, mod in attn.named_children()}

    def p(name: str) -> torch.Tensor:
        return proj[name](x)

    q, k, v = {
        "full": lambda: (p("q_proj"), p("k_proj"), p("v_proj")),
        "identity_qkv": lambda: (x, x, x),
        "shared_qk": lambda: (p("q_proj"), p("q_proj"), p("v_proj")),
        "uniform": lambda: (zero, zero, p("v_proj")),
        "identity_v": lambda: (p("q_proj"), p("k_proj"), x),
    }[mode]()
    with torch.no_grad():
        out, weights = attn(x, causal=causal)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5))


def test_each_mode_has_only_the_projections_it_uses() -> None:
    """Witness: the parameter names each mode needs, written here from the tutorial's definitions."""
    names = {m: sorted(n for n, _ in make_attention(8, m).named_parameters()) for m in ATTENTION_MODES}
    assert names == {
        "full": ["k_proj.weight", "q_proj.weight", "v_proj.weight"],
        "identity_qkv": [],
        "shared_qk": ["q_proj.weight", "v_proj.weight"],
        "uniform": ["v_proj.weight"],
        "identity_v": ["k_proj.weight", "q_proj.weight"],
    }
    with pytest.raises(ValueError, match="unknown attention mode"):
        make_attention(8, "no_attention")


@pytest.mark.parametrize("mode", MODES)
def test_only_attention_carries_other_positions_to_the_last(mode: str) -> None:
    """The tutorial's no_attention mode: without attention the last position cannot read any other; with it, it can.

    Witness: two inputs built here that differ only in the first token, and the model's output on each.
    """
    torch.manual_seed(0)
    model = make_model(20, 6, 4, mode, d_model=16).eval()
    a = torch.randint(0, 20, (4, 6))
    b = a.clone()
    b[:, 0] = (a[:, 0] + 1) % 20  # change only the first token
    with torch.no_grad():
        moved = (model(a) - model(b)).abs().max().item()
    if mode == "no_attention":
        assert moved == 0.0
    else:
        assert moved > 1e-6


# -- the tutorial's claims, measured ----------------------------------------------------------------------


def test_the_tutorials_claims_hold_and_are_measured() -> None:
    """Witness: every measured number recomputed here — uniform rows against 1/T and 1/t written here, the
    causal output against PyTorch's SDPA(0, 0, V, is_causal=True) and V's running mean by cumsum, the
    diagonal share from softmax(XXᵀ/√D) written here; ``holds`` decided here from those numbers."""
    props = {p.name: p for p in check_properties(d_model=8, seq_len=6)}
    assert set(props) == {"uniform_rows", "uniform_causal_rows", "uniform_causal_mean", "identity_qkv_diagonal"}
    torch.manual_seed(0)  # check_properties' defaults draw X first, then the uniform module's V
    x = torch.randn(64, 6, 8)
    uniform = make_attention(8, "uniform")
    t = torch.arange(1, 7, dtype=x.dtype)
    with torch.no_grad():
        _, w = uniform(x)
        out_c, w_c = uniform(x, causal=True)
        v = uniform.get_submodule("v_proj")(x)
        running_mean = v.cumsum(dim=1) / t[None, :, None]
        pytorch_c = F.scaled_dot_product_attention(torch.zeros_like(x), torch.zeros_like(x), v, is_causal=True)
    assert (pytorch_c - running_mean).abs().max().item() <= 1e-6  # PyTorch's equal-score causal rows: 1/t
    expected = {
        "uniform_rows": (w - 1 / 6).abs().max().item(),
        "uniform_causal_rows": (w_c - torch.ones(6, 6).tril() / t[:, None]).abs().max().item(),
        "uniform_causal_mean": (out_c - running_mean).abs().max().item(),
        "identity_qkv_diagonal": (x @ x.transpose(-2, -1) / math.sqrt(8)).softmax(-1).diagonal(dim1=-2, dim2=-1)
        .mean().item(),
    }
    for name, value in expected.items():
        assert props[name].measured == pytest.approx(value, rel=1e-6, abs=1e-12), name
    for name in ("uniform_rows", "uniform_causal_rows", "uniform_causal_mean"):
        assert expected[name] <= 1e-6 and props[name].holds is True, name
    assert expected["identity_qkv_diagonal"] > 1 / 6 and props["identity_qkv_diagonal"].holds is True


def test_identity_qkv_diagonal_share_is_the_mean_of_softmax_xxt_diagonal() -> None:
    """Witness: the share recomputed here as the mean diagonal of softmax(XXᵀ/√D), the tutorial's formula."""
    torch.manual_seed(0)
    x = torch.randn(64, 6, 8)
    expected = (x @ x.transpose(-2, -1) / math.sqrt(8)).softmax(-1).diagonal(dim1=-2, dim2=-1).mean().item()
    (prop,) = [p for p in check_properties(d_model=8, seq_len=6, batch=64, seed=0) if p.name == "identity_qkv_diagonal"]
    assert prop.measured == pytest.approx(expected, rel=1e-6)


# -- fair runs: data, order, seeds ----------------------------------------------------------------------


def test_lookup_eval_data_are_held_out_and_answers_are_right() -> None:
    """Witness: the lookup rule applied here to each row (the last token 16 + i names position i)."""
    x_tr, y_tr, x_ev, y_ev = TASKS["lookup"].split(0)
    train = {tuple(r) for r in x_tr.tolist()}
    assert len(train) == x_tr.size(0) and not train & {tuple(r) for r in x_ev.tolist()}
    for x, y in ((x_tr, y_tr), (x_ev, y_ev)):
        index = x[:, -1] - 16
        assert ((index >= 0) & (index < 9)).all()
        assert torch.equal(y, x[torch.arange(x.size(0)), index])


def test_marker_answer_is_the_token_after_the_one_marker() -> None:
    """Witness: the marker (16) found here in each row and the token after it read here."""
    x_tr, y_tr, x_ev, y_ev = TASKS["marker"].split(0)
    assert not {tuple(r) for r in x_tr.tolist()} & {tuple(r) for r in x_ev.tolist()}
    for x, y in ((x_tr, y_tr), (x_ev, y_ev)):
        assert ((x == 16).sum(dim=1) == 1).all() and (x[:, -1] == 17).all()
        after = (x == 16).int().argmax(dim=1) + 1
        assert (after < x.size(1) - 1).all() and torch.equal(y, x[torch.arange(x.size(0)), after])
    assert train_run(TASKS["marker"], "full", seed=0, steps=1).answer_weight is None


def test_sentiment_holds_out_one_positive_and_one_negative_per_seed() -> None:
    """Witness: labels and rows of each split counted here; the task's eight sentences."""
    held = set()
    for seed in range(4):
        x_tr, _, x_ev, y_ev = TASKS["sentiment"].split(seed)
        assert sorted(y_ev.tolist()) == [0, 1] and x_tr.size(0) == 6
        assert not {tuple(r) for r in x_tr.tolist()} & {tuple(r) for r in x_ev.tolist()}
        held |= {tuple(r) for r in x_ev.tolist()}
    assert len(held) == 8  # over four seeds, every sentence is held out once


def test_batches_depend_only_on_the_seed() -> None:
    """Witness: the same call made twice, another call with a different number, and the sizes asked for here."""
    one = [b.tolist() for b in training_batches(100, 16, 20, seed=3)]
    assert one == [b.tolist() for b in training_batches(100, 16, 20, seed=3)]
    assert one != [b.tolist() for b in training_batches(100, 16, 20, seed=4)]
    assert all(len(b) == 16 for b in one) and len(one) == 20


def test_a_run_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    """Witness: PyTorch's global RNG state saved here before the run, and a second run with the same arguments."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = train_run(TASKS["lookup"], "full", seed=1, steps=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert a == train_run(TASKS["lookup"], "full", seed=1, steps=3)
    assert a != train_run(TASKS["lookup"], "full", seed=2, steps=3)


def test_means_and_stds_come_from_the_listed_runs(small: dict) -> None:
    """Witness: mean and std recomputed here with ``statistics``; uniform rows are 1/T (T = 10) by construction."""
    assert [m["mode"] for m in small["modes"]] == DOCUMENTED_MODES
    assert small["steps"] == 5 and small["seeds"] == [0, 1]
    for m in small["modes"]:
        assert [r["seed"] for r in m["runs"]] == [0, 1]
        for key in ("accuracy", "loss"):
            values = [r[key] for r in m["runs"]]
            assert m[f"{key}_mean"] == pytest.approx(statistics.fmean(values))
            assert m[f"{key}_std"] == pytest.approx(statistics.stdev(values))
        assert (m["runs"][0]["diagonal_share"] is None) == (m["mode"] == "no_attention")
        assert (m["runs"][0]["answer_weight"] is None) == (m["mode"] == "no_attention")
    uniform = next(m for m in small["modes"] if m["mode"] == "uniform")
    for r in uniform["runs"]:  # rows are 1/T in trained models too
        assert r["diagonal_share"] == pytest.approx(1 / 10) and r["answer_weight"] == pytest.approx(1 / 10)


def test_answer_weight_is_the_last_rows_weight_on_the_answer_position() -> None:
    """Recomputed from the model's own weights (steps=0 leaves the seeded initialisation).

    Witness: softmax(q_proj(h) k_proj(h)ᵀ/√D) computed here from the attention's input h, then the lookup rule.
    """
    task = TASKS["lookup"]
    run = train_run(task, "full", seed=7, steps=0)
    torch.manual_seed(7)
    model = make_model(task.vocab_size, task.seq_len, task.n_classes, "full", d_model=task.d_model).eval()
    _, _, x_ev, y_ev = task.split(7)
    attn = model.get_submodule("blocks.0.attn")
    seen: list[torch.Tensor] = []
    handle = attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        logits, (returned,) = model(x_ev, return_weights=True)
    handle.remove()
    [h] = seen
    with torch.no_grad():
        q, k = attn.get_submodule("q_proj")(h), attn.get_submodule("k_proj")(h)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(task.d_model)).softmax(-1)
    torch.testing.assert_close(returned, weights, atol=1e-6, rtol=1e-5)
    index = x_ev[:, -1] - 16
    assert run.answer_weight == pytest.approx(weights[torch.arange(x_ev.size(0)), -1, index].mean().item(), rel=1e-5)
    assert run.diagonal_share == pytest.approx(weights.diagonal(dim1=-2, dim2=-1).mean().item(), rel=1e-5)
    assert run.accuracy == pytest.approx((logits.argmax(-1) == y_ev).float().mean().item())
    assert train_run(TASKS["sentiment"], "full", seed=0, steps=1).answer_weight is None  # no single answer position


# -- the JSON file ----------------------------------------------------------------------------------------


def test_the_json_validates_and_damage_is_refused(small: dict) -> None:
    """Witness: the schema file, and the damage written here (an accuracy of 1.5, a missing field)."""
    assert check_document(small, name="a.json") == ABLATE_SCHEMA
    bad = json.loads(json.dumps(small))
    bad["modes"][2]["runs"][1]["accuracy"] = 1.5
    with pytest.raises(SchemaError, match=r"a.json: /modes/2/runs/1/accuracy: expected at most 1, got 1.5"):
        check_document(bad, name="a.json")
    del bad["modes"][0]["accuracy_std"]
    with pytest.raises(SchemaError, match=r"/modes/0/accuracy_std: missing"):
        check_document(bad, name="a.json")


# -- the command line -------------------------------------------------------------------------------------------


def test_cli_writes_json_markdown_and_keeps_progress_off_stdout(tmp_path: Path) -> None:
    """Witness: the files the command wrote, read here, the arguments given and the documented modes."""
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    proc = qkv("ablate", "--seeds", "2", "--steps", "3", "--json", out, "--md", md)
    assert proc.returncode == 0, proc.stderr
    assert "qkvtrace ablate: task lookup, 3 steps, seeds 0, 1" in proc.stdout
    assert "training" not in proc.stdout  # the progress bar is on stderr only
    for mode in DOCUMENTED_MODES:
        assert mode in proc.stdout
    data = load_json(out, ABLATE_SCHEMA)
    assert data["task"]["name"] == "lookup" and data["steps"] == 3 and data["torch_version"] == torch.__version__
    text = md.read_text()
    assert "| mode | what it keeps | accuracy | loss |" in text
    assert "max \\|w - 1/T\\| <= 1e-06" in text  # a | inside a cell is escaped
    assert text.count("\n| `") == len(DOCUMENTED_MODES)
    check = qkv("validate", out)
    assert check.returncode == 0 and "ok (qkvtrace.ablate/1)" in check.stdout


def test_cli_sentiment_task(tmp_path: Path) -> None:
    """Witness: the file the command wrote; 8 sentences with 2 held out, by construction of the task."""
    proc = qkv("ablate", "--task", "sentiment", "--seeds", "1", "--steps", "2", "--json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    data = load_json(tmp_path / "s.json", ABLATE_SCHEMA)
    assert data["task"]["train_size"] == 6 and data["task"]["eval_size"] == 2 and not data["task"]["routing"]
    assert "does not need routing" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--task", "nope"], "--task 'nope': unknown task"),
        (["--seeds", "0"], "--seeds 0"),
        (["--steps", "0"], "--steps 0"),
        (["--json", "/nonexistent-folder/a.json"], "does not exist"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    """Witness: the bad arguments written here and the words each must name."""
    proc = qkv("ablate", *args)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_plot(tmp_path: Path) -> None:
    """Witness: the SVG file the command wrote, read here."""
    pytest.importorskip("matplotlib")
    chart = tmp_path / "a.svg"
    proc = qkv("ablate", "--seeds", "2", "--steps", "2", "--plot", chart)
    assert proc.returncode == 0, proc.stderr
    svg = chart.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_cli_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    """Witness: matplotlib hidden here through sys.modules, and the chart path the test named, checked absent."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "from qkvtrace.cli.main import main\n"
        f"sys.exit(main(['ablate', '--seeds', '1', '--steps', '1', '--plot', {str(tmp_path / 'a.svg')!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2
    assert 'pip install "qkvtrace[plot]"' in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == "" and not (tmp_path / "a.svg").exists()  # refused before any training


# -- the outcome -------------------------------------------------------------------------------------------------


def _retrained_full_lookup(run: int) -> tuple[float, float]:
    """Held-out accuracy and answer weight of ``full`` on lookup, trained and measured here: the model,
    data split and batch order of the run, AdamW as documented, then argmax and the last row's weight on
    the answer position read from the model's own outputs."""
    task = TASKS["lookup"]
    x_tr, y_tr, x_ev, y_ev = task.split(run)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run)
        model = make_model(task.vocab_size, task.seq_len, task.n_classes, "full", d_model=task.d_model,
                           n_layers=task.n_layers, pool=task.pool)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.01)
    model.train()
    for idx in training_batches(x_tr.size(0), task.batch_size, task.default_steps, run):
        loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        logits, maps = model(x_ev, return_weights=True)
    answer = x_ev[:, -1] - 16  # the index token @i names position i
    weight = maps[-1][torch.arange(x_ev.size(0)), -1, answer].mean().item()
    return (logits.argmax(-1) == y_ev).float().mean().item(), weight


@pytest.mark.slow
def test_full_beats_the_modes_that_cannot_route_on_lookup() -> None:
    """With the default steps, every full run beats every uniform / no_attention run by far.

    Witness: the margin is recomputed here from the runs' accuracies, and run 0's full model is trained
    again here; its accuracy and answer weight are measured on its own outputs.
    """
    result = run_ablation("lookup", seeds=[0, 1, 2], modes=["full", "uniform", "no_attention"])
    full = [r.accuracy for r in result.mode("full").runs]
    others = [r.accuracy for m in ("uniform", "no_attention") for r in result.mode(m).runs]
    assert min(full) > max(others)
    assert statistics.fmean(full) - max(statistics.fmean([r.accuracy for r in result.mode(m).runs])
                                         for m in ("uniform", "no_attention")) > 0.5  # fmt: skip
    assert result.routing_margin() is not None and result.routing_margin()["every_full_run_above"] is True
    accuracy, answer_weight = _retrained_full_lookup(0)
    run0 = result.mode("full").runs[0]
    assert (run0.accuracy, run0.answer_weight) == pytest.approx((accuracy, answer_weight), rel=1e-4)
    assert accuracy > 0.9 and answer_weight > 0.5  # it routes: the last row looks at the answer
    assert statistics.fmean(full) > 0.95
    assert statistics.fmean(r.accuracy for r in result.mode("no_attention").runs) < 0.15  # chance is 1/16
