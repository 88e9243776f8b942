"""The pytest plugin (entry point ``pytest11``): the ``qkvtrace`` fixture and the assertions.

Each test writes a small test file the way a user would, runs pytest on it
with ``pytester`` (in this process: the plugin comes from the installed entry
point, as in a user's suite), and reads what pytest printed. Expected paths,
backends and PyTorch's reasons are measured here on the installed PyTorch,
never written out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _witness import learn_kernel_backends, local_at_return, profiled
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkvtrace
from qkvtrace.pytest_plugin import (
    assert_backend,
    assert_no_future_leak,
    assert_no_nan_rows,
    assert_paths,
    assert_same_as_report,
    format_calls,
)

pytest_plugins = ["pytester"]

REPORTS = Path(__file__).resolve().parent.parent / "reports"
NATIVE_MHA = "aten::_native_multi_head_attention"  # the MHA fast path's kernel

#: shared by the generated test files: a user's own attention block calling SDPA
MODELS = """
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, causal: bool = True, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.causal, self.heads = causal, heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        return y.transpose(1, 2).reshape(b, t, d)


class Net(nn.Module):
    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.attention = Block(causal)

    def forward(self, x, mask=None):
        return self.attention(x, mask)


def mha():
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 2, batch_first=True)
"""


@pytest.fixture(scope="module", autouse=True)
def _warm_up() -> None:
    """Import, before pytester snapshots ``sys.modules``, what the generated tests will import.

    pytester's in-process runs delete the modules imported during the run
    afterwards; PyTorch modules that register operators (``torch._dynamo``
    pulls some in) cannot be imported twice in one process.
    """
    import torch._dynamo
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qkvtrace.analyses.check import run_checks
    from qkvtrace.records.validation import load_json  # noqa: F401

    torch.manual_seed(0)
    block = nn.Linear(16, 48)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.attention(x).view(1, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 4, 16)

    with sdpa_kernel(SDPBackend.MATH):
        run_checks(Net(), (torch.randn(1, 4, 16),), causal=True, trials=1)
    m = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(1, 4, 16)
    with qkvtrace.trace(m) as t:
        m(x, x, x)[0].sum().backward()
    t.to_dict()


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(models=MODELS)
    return pytester


def _mha_reason_in_training() -> str:
    """PyTorch's own reason for refusing the fast path to an MHA in training: its local
    ``why_not_fast_path``, read with ``sys.settrace`` on an untraced run (no qkvtrace involved)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, batch_first=True).train()
    x = torch.randn(2, 5, 16)
    _, reasons = local_at_return(nn.MultiheadAttention.forward.__code__, "why_not_fast_path",
                                 lambda: m(x, x, x, need_weights=False))  # fmt: skip
    (reason,) = reasons
    assert reason, "PyTorch let a training-mode MHA call take its fast path"
    return str(reason)


@functools.cache
def _mha_path_in_inference() -> tuple[str, str | None]:
    """The path and SDPA backend of ``mha()`` in eval under no_grad: torch.profiler on an untraced run (fast iff
    its outermost attention op is ``_native_multi_head_attention``; the backend of an SDPA kernel in it, if any)."""
    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        (segment,) = profiled(lambda: m(x, x, x, need_weights=False)).segments
    backends = learn_kernel_backends(2, 2, 5, 8)
    ran = [backends[op] for op in segment if op in backends]
    return ("fast" if segment[0] == NATIVE_MHA else "fallback"), (ran[0] if ran else None)


def test_entry_point_is_registered() -> None:
    """Witness: the installed distribution's metadata, read with importlib.metadata; the module name written here."""
    found = [ep for ep in entry_points(group="pytest11") if ep.name == "qkvtrace"]
    assert [ep.value for ep in found] == ["qkvtrace.pytest_plugin"]


def test_fixture_and_passing_assertions(suite: pytest.Pytester) -> None:
    """Witness: torch.profiler on an untraced eval/no_grad run of the same MHA (``_mha_path_in_inference``);
    the backend forced with ``sdpa_kernel(MATH)`` on a block that calls SDPA itself."""
    path, backend = _mha_path_in_inference()
    suite.makepyfile(
        test_user="""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from models import Net, mha
        from qkvtrace.pytest_plugin import assert_backend, assert_no_nan_rows, assert_paths

        def test_inference_is_fast(qkvtrace):
            m = mha().eval()
            x = torch.randn(2, 5, 16)
            with torch.no_grad(), qkvtrace(m) as t:
                m(x, x, x, need_weights=False)
            assert_paths(t, {__PATH__})
            qkvtrace.assert_backend(t, __BACKEND__)    # the profiler's SDPA kernel in the call, if any
            assert_no_nan_rows(t)

        def test_math_backend(qkvtrace):
            net = Net()
            with sdpa_kernel(SDPBackend.MATH), qkvtrace(net) as t:
                net(torch.randn(2, 5, 16))
            assert_paths(t, "sdpa")
            assert_backend(t, "MATH")
            assert_backend(t.result, {"MATH", "FLASH_ATTENTION"})
            assert_backend(t.to_dict(), "MATH")
        """.replace("__PATH__", repr(path)).replace("__BACKEND__", repr(backend))
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(passed=2)


def test_assert_paths_failure_shows_the_offending_calls(suite: pytest.Pytester) -> None:
    """Witness: PyTorch's own ``why_not_fast_path``, read with sys.settrace on an untraced run (set, so the
    call falls back), and the message the test expects."""
    reason = _mha_reason_in_training()
    suite.makepyfile(
        test_user="""
        import torch
        from models import mha

        def test_training_is_fast(qkvtrace):
            m = mha().train()
            x = torch.randn(2, 5, 16)
            with qkvtrace(m) as t:
                m(x, x, x, need_weights=False)
            qkvtrace.assert_paths(t, {"fast"})
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "AssertionError: 1 of 1 attention call took a path outside {'fast'}:" in out
    result.stdout.re_match_lines([r"E\s+#\s+module\s+path\s+backend\s+why not fast path$"])
    path = "fallback"
    result.stdout.re_match_lines([rf"E\s+0\s+\(root\)\s+{path}\s+\S+\s+{reason}$"])
    # the traceback points at the user's line, not into the plugin
    assert "qkvtrace/pytest_plugin.py" not in out
    # the table is in the message already: no second copy in a report section
    assert "qkvtrace: attention calls of this test" not in out


def test_any_failure_of_a_test_using_the_fixture_shows_its_calls(suite: pytest.Pytester) -> None:
    """Witness: PyTorch's own ``why_not_fast_path``, read with sys.settrace on an untraced run (set, so the
    call falls back), and the section the test expects."""
    reason = _mha_reason_in_training()
    suite.makepyfile(
        test_user="""
        import torch
        from models import mha

        def test_own_assert(qkvtrace):
            m = mha().train()
            x = torch.randn(2, 5, 16)
            with qkvtrace(m) as t:
                m(x, x, x, need_weights=False)
            with torch.no_grad(), qkvtrace(m.eval()) as t2:
                m(x, x, x, need_weights=False)
            assert t.calls[0].path == t2.calls[0].path
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*- qkvtrace: attention calls of this test -*", "trace 0: 1 attention call:", "*#  module*"]
    )
    result.stdout.re_match_lines([rf"\s+0\s+\(root\)\s+fallback\s+\S+\s+{reason}$", r"trace 1: 1 attention call:"])


def test_assert_backend_failure(suite: pytest.Pytester) -> None:
    """Witness: the backend forced with ``sdpa_kernel(MATH)``, and PyTorch's flash switch read under it here."""
    with sdpa_kernel(SDPBackend.MATH):
        assert not torch.backends.cuda.flash_sdp_enabled(), "sdpa_kernel(MATH) left PyTorch's flash switch on"
    suite.makepyfile(
        test_user="""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from models import Net
        from qkvtrace.pytest_plugin import assert_backend

        def test_flash(qkvtrace):
            net = Net()
            with sdpa_kernel(SDPBackend.MATH), qkvtrace(net) as t:
                net(torch.randn(2, 5, 16))
            assert_backend(t, "FLASH_ATTENTION")
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*1 of 1 attention call ran another SDPA backend than {'FLASH_ATTENTION'}*"])
    # the user forced MATH: PyTorch's flash switch is off, and the failure says so
    result.stdout.re_match_lines(
        [r"E\s+0\s+attention\s+sdpa\s+MATH\s+-\s+FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled\(\) is False"]
    )


def test_assert_no_nan_rows_failure(suite: pytest.Pytester) -> None:
    """Witness: the mask built by the test (row 2 masked everywhere), and PyTorch's own SDPA output for
    such a mask (``_fully_masked_output``): NaN there or not decides the outcomes."""
    suite.makepyfile(
        test_user="""
        import torch
        from models import Net
        from qkvtrace.pytest_plugin import assert_no_nan_rows

        def _mask():
            mask = torch.ones(5, 5, dtype=torch.bool).tril()
            mask[2] = False                      # query row 2 may attend to nothing
            return mask

        def test_rows(qkvtrace):
            net = Net()
            with qkvtrace(net) as t:
                net(torch.randn(2, 5, 16), _mask())
            assert_no_nan_rows(t)

        def test_nan_values_only(qkvtrace):
            net = Net()
            with qkvtrace(net) as t:
                out = net(torch.randn(2, 5, 16), _mask())
            if torch.isnan(out).any():
                assert_no_nan_rows(t, fully_masked=False)   # must fail: the output has NaN
            else:
                assert_no_nan_rows(t, fully_masked=False)   # must pass: no NaN on this backend
        """
    )
    result = suite.runpytest("-q")
    out = result.stdout.str()
    assert (
        "test_user.py::test_rows" in out and "1 of 1 attention call had NaN outputs or fully masked query rows" in out
    )
    result.stdout.re_match_lines(
        [r"E\s+#\s+module\s+path\s+backend\s+why not fast path\s+NaN values\s+fully masked rows$"]
    )
    # the row of the call, with its (non-zero) count of fully masked rows
    result.stdout.re_match_lines([r"E\s+0\s+attention\s+sdpa\s+\S+\s+-\s+\d+\s+[1-9]\d*$"])
    # whether a fully masked row is NaN or zero is the installed PyTorch's business: measured here
    net_out = _fully_masked_output()
    expected = {"failed": 2} if torch.isnan(net_out).any() else {"failed": 1, "passed": 1}
    result.assert_outcomes(**expected)


def _fully_masked_output() -> torch.Tensor:
    torch.manual_seed(0)
    q = k = v = torch.randn(2, 2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[2] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_assert_no_future_leak(suite: pytest.Pytester) -> None:
    """Witness: the models built by the test: SDPA with ``is_causal=True`` (no leak) and without (a leak from
    position 1 into position 0), and the message the test expects."""
    suite.makepyfile(
        test_user="""
        import torch
        from models import Net
        from qkvtrace.pytest_plugin import assert_no_future_leak

        def test_causal():
            assert_no_future_leak(Net(causal=True), torch.randn(1, 4, 16))

        def test_not_causal():
            assert_no_future_leak(Net(causal=False), torch.randn(1, 4, 16), modes=["inference"])
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*causal check failed in inference mode: future positions leak into earlier outputs: "
            "position 0 reads position 1*",
            "*attention calls in inference mode:",
        ]
    )
    result.stdout.re_match_lines([r"E\s+0\s+attention\s+sdpa\s+\S+\s+-$"])


def test_empty_trace_fails_and_names_what_it_could_not_see(suite: pytest.Pytester) -> None:
    """Witness: the model built by the test (no softmax, so no attention call; its root is a LinearAttention),
    and the message the test expects."""
    suite.makepyfile(
        test_user="""
        import torch
        from torch import nn

        class LinearAttention(nn.Module):  # no softmax over the keys: not attention the trace recognises
            def __init__(self):
                super().__init__()
                self.attn = nn.Linear(16, 48)

            def forward(self, x):
                q, k, v = self.attn(x).chunk(3, -1)
                return torch.nn.functional.elu(q) @ (torch.nn.functional.elu(k).transpose(-2, -1) @ v)

        def test_nothing_seen(qkvtrace):
            m = LinearAttention()
            with qkvtrace(m) as t:
                m(torch.randn(2, 5, 16))
            qkvtrace.assert_paths(t, {"fast"})
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the trace recorded no attention call, so nothing shows that attention took a path in {'fast'}*",
            "*(root) (LinearAttention): *",
        ]
    )


def test_same_as_saved_trace(suite: pytest.Pytester) -> None:
    """Witness: the golden file the generated test wrote; the inference path from torch.profiler on an untraced
    run, and PyTorch's own training reason read with sys.settrace (set, so that call falls back)."""
    reason = _mha_reason_in_training()
    path, _ = _mha_path_in_inference()
    suite.makepyfile(
        test_user="""
        import torch
        from models import mha
        from qkvtrace.pytest_plugin import assert_same_as_report

        def _trace(qkvtrace, train):
            m = mha().train(train)
            x = torch.randn(2, 5, 16)
            with torch.set_grad_enabled(train), qkvtrace(m) as t:
                m(x, x, x, need_weights=False)
            return t

        def test_save_then_same(qkvtrace, tmp_path):
            _trace(qkvtrace, False).save(tmp_path / "golden.json")
            assert_same_as_report(_trace(qkvtrace, False), tmp_path / "golden.json")

        def test_changed(qkvtrace, tmp_path):
            _trace(qkvtrace, False).save(tmp_path / "golden.json")
            assert_same_as_report(_trace(qkvtrace, True), tmp_path / "golden.json")
        """
    )
    result = suite.runpytest("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.re_match_lines([r"E\s+AssertionError: the trace differs from .*golden.json \(trace on torch "])
    result.stdout.re_match_lines([r"E\s+#\s+module\s+field\s+reference\s+trace$",
                                  rf"E\s+0\s+\(root\)\s+path\s+{path}\s+fallback$",
                                  rf"E\s+0\s+\(root\)\s+why_not_fast_path\s+null\s+{reason}$"])  # fmt: skip


def _report_of_installed_torch() -> Path:
    folder = REPORTS / f"torch-{torch.__version__}"
    if not (folder / "report.json").is_file():
        pytest.skip(f"no committed report of torch {torch.__version__} under reports/")
    return folder


def test_same_as_committed_report_scenario(qkvtrace: object) -> None:
    """A probe scenario run now matches the report committed for this PyTorch (the upgrade check).

    Witness: the committed report, whose mha_train call is checked here against torch.profiler (its attention
    ops) and PyTorch's own ``why_not_fast_path`` (sys.settrace), both on an untraced run of the scenario.
    """
    from qkvtrace.analyses.probes import SCENARIOS

    folder = _report_of_installed_torch()
    scenario = next(s for s in SCENARIOS if s.name == "mha_train")
    untraced, run_untraced = scenario.build()
    segment, *_ = profiled(lambda: run_untraced(untraced)).segments  # the forward call; its backward follows
    _, (reason,) = local_at_return(nn.MultiheadAttention.forward.__code__, "why_not_fast_path",
                                   lambda: run_untraced(untraced))  # fmt: skip
    committed = json.loads((folder / "report.json").read_text())["probes"]["scenarios"]
    (call,) = next(s for s in committed if s["name"] == "mha_train")["calls"]
    assert (call["aten_ops"], call["why_not_fast_path"]) == (segment, reason), call
    model, run = scenario.build()
    with qkvtrace(model) as t:  # type: ignore[operator]
        run(model)
    assert_same_as_report(t, folder, scenario="mha_train")
    assert_same_as_report(t, folder / "report.json", scenario="mha_train")
    # the same trace is not that of another scenario, and the message says how
    with pytest.raises(AssertionError, match=r"differs from .* scenario 'mha_eval_no_grad'") as info:
        assert_same_as_report(t, folder, scenario="mha_eval_no_grad")
    assert "path" in str(info.value) and "fast" in str(info.value)


def test_same_as_report_needs_a_scenario() -> None:
    """Witness: the trace dict built by the test (a report path, no scenario), and the message the test expects."""
    folder = _report_of_installed_torch()
    with pytest.raises(ValueError, match=r"is a report \(no scenario given\); pass scenario=, one of: .*mha_train"):
        assert_same_as_report({"schema": "qkvtrace.trace/1", "calls": []}, folder)


def test_assertions_work_outside_pytest_on_saved_files(tmp_path: Path) -> None:
    """Plain functions: a trace file written elsewhere (another job, another rank) can be asserted on.

    Witness: torch.profiler on an untraced run of the same call: the fast path iff its outermost
    attention op is ``_native_multi_head_attention``; the backend of an SDPA kernel inside it, if any.
    """
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        (segment,) = profiled(lambda: m(x, x, x, need_weights=False)).segments
    backends = learn_kernel_backends(2, 2, 5, 8)
    path = "fast" if segment[0] == NATIVE_MHA else "fallback"
    ran = [backends[op] for op in segment if op in backends]
    backend = ran[0] if ran else None
    with torch.no_grad(), qkvtrace.trace(m) as t:
        m(x, x, x, need_weights=False)
    t.save(tmp_path / "t.json")
    assert_paths(tmp_path / "t.json", {path})
    assert_backend(str(tmp_path / "t.json"), backend)
    assert_no_nan_rows(tmp_path / "t.json")
    other = "fallback" if path == "fast" else "fast"
    with pytest.raises(AssertionError, match=rf"took a path outside \{{.{other}.\}}"):
        assert_paths(tmp_path / "t.json", other)
    with pytest.raises(AssertionError, match=r"took a path outside \{.flex.\}"):
        assert_paths(t, "flex")


def test_format_calls_adds_rank_when_present() -> None:
    """Witness: the call dicts built by the test, and the table the test writes out."""
    calls = [
        {"index": 0, "rank": 1, "module": "blocks.0.attn", "path": "fallback", "sdpa_backend": "MATH",
         "why_not_fast_path": "training is enabled"},
        {"index": 1, "rank": 1, "module": "", "path": "sdpa", "sdpa_backend": None, "why_not_fast_path": None},
    ]  # fmt: skip
    assert format_calls(calls).splitlines() == [
        "  #  rank  module         path      backend  why not fast path",
        "  0  1     blocks.0.attn  fallback  MATH     training is enabled",
        "  1  1     (root)         sdpa      none     -",
    ]


def test_plugin_can_be_turned_off(suite: pytest.Pytester) -> None:
    """Witness: pytest's own message for an unknown fixture, with the plugin turned off by ``-p no:qkvtrace``."""
    suite.makepyfile(test_user="def test_x(qkvtrace):\n    pass\n")
    result = suite.runpytest("-q", "-p", "no:qkvtrace")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'qkvtrace' not found*"])


def test_leak_assertion_in_process() -> None:
    """The leak assertion on the project's own demo LM (causal by construction) holds in both modes.

    Witness: computed here, changing the last token leaves the outputs at every earlier position as they were.
    """
    from qkvtrace.analyses.demos import demo_tiny_lm

    model, (tokens,) = demo_tiny_lm()
    assert_no_future_leak(model, tokens[:1, :6])
    x = tokens[:1, :6]
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 100  # the demo's vocabulary has 100 tokens
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(changed)[:, :-1], model(x)[:, :-1])


def test_no_nan_rows_fails_when_the_count_is_unknown() -> None:
    """A call that raised has no NaN count: no count is no evidence.

    Witness: the exception PyTorch raises for the same call run untraced.
    """
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(RuntimeError) as untraced:
        m(x, x, x, attn_mask=torch.zeros(3, 3))  # a mask of the wrong shape: PyTorch refuses the call
    raised = f"{untraced.type.__name__}: {untraced.value}"
    with pytest.raises(RuntimeError), qkvtrace.trace(m) as t:
        m(x, x, x, attn_mask=torch.zeros(3, 3))
    (call,) = t.calls
    assert call.error == raised and call.output["nan_count"] is None
    with pytest.raises(AssertionError, match=r"NaN values \?: not counted") as info:
        assert_no_nan_rows(t)
    assert f"raised {raised}" in str(info.value)


def test_format_calls_shows_the_encoder_layers_reason() -> None:
    """An encoder's MHA call carries the layer's reason for refusing its fused path beside the MHA's.

    Witness: PyTorch's own ``why_not_sparsity_fast_path`` (the layer) and ``why_not_fast_path`` (its
    MHA), read with ``sys.settrace`` on an untraced run of the same layer and input.
    """
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    # grad on: the layer refuses its fused path, with its own reason
    _, (layer_reason,) = local_at_return(nn.TransformerEncoderLayer.forward.__code__,
                                         "why_not_sparsity_fast_path", lambda: layer(x))  # fmt: skip
    _, (mha_reason,) = local_at_return(nn.MultiheadAttention.forward.__code__, "why_not_fast_path",
                                       lambda: layer(x))  # fmt: skip
    assert layer_reason and mha_reason, "PyTorch was meant to refuse both fast paths with grad enabled"
    with qkvtrace.trace(layer) as t:
        layer(x)
    (call,) = t.calls
    assert (call.why_not_fused_layer, call.why_not_fast_path) == (layer_reason, mha_reason)
    row = format_calls([dataclasses.asdict(call)]).splitlines()[1]
    shown = "same" if layer_reason == mha_reason else layer_reason
    assert row.endswith(f"{mha_reason} (layer: {shown})"), row


@pytest.mark.slow  # a new interpreter imports torch (~5-10 s); the in-process runs above load the same entry point
def test_a_fresh_pytest_process_finds_the_plugin(suite: pytest.Pytester) -> None:
    """As in a user's CI: a new interpreter, no conftest, the plugin found through its entry point.

    Witness: torch.profiler on an untraced eval/no_grad run of the same MHA (``_mha_path_in_inference``).
    """
    path, _ = _mha_path_in_inference()
    suite.makepyfile(
        test_user="""
        import torch
        from models import mha

        def test_fast(qkvtrace):
            m = mha().eval()
            x = torch.randn(2, 5, 16)
            with torch.no_grad(), qkvtrace(m) as t:
                m(x, x, x, need_weights=False)
            qkvtrace.assert_paths(t, __PATH__)
        """.replace("__PATH__", repr(path))
    )
    result = suite.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1)


def test_empty_trace_file_names_what_it_could_not_see(tmp_path: Path) -> None:
    """Witness: the model built by the test (no softmax, so no attention call; its root is a LinearAttention),
    and the message the test expects."""
    class LinearAttention(nn.Module):  # no softmax over the keys: not attention the trace recognises
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.attn(x).chunk(3, -1)
            return F.elu(q) @ (F.elu(k).transpose(-2, -1) @ v)

    m = LinearAttention()
    with qkvtrace.trace(m) as t:
        m(torch.randn(2, 5, 16))
    assert [(u.module, u.module_type) for u in t.result.unobserved] == [("", "LinearAttention")]
    t.save(tmp_path / "t.json")
    with pytest.raises(AssertionError, match="the trace recorded no attention call") as info:
        assert_backend(tmp_path / "t.json", "MATH")
    assert "\n  (root) (LinearAttention): made no recorded call" in str(info.value)
