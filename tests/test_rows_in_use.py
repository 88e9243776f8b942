"""Q/K/V rows where models really run: inference, re-wired modules, two kernel calls, latent attention.

Every expected row here is known by construction: the model's own forward
says which rows of which weight become Q, K and V (the ``truth`` of each
call, written in the test). Where the rows come from a graph, a second
witness is autograd itself on a copy of the model, asked in the test which
weight rows reach the tensors the kernel received.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkvtrace

E, H, B, L = 16, 4, 2, 5
D = E // H


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[B, L, H*D] -> [B, H, L, D]"""
    return t.reshape(B, L, H, D).transpose(1, 2)


def _merge(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2).reshape(B, L, -1)


def _expand(rows: list[list[int]] | None) -> list[int]:
    assert rows is not None
    return [i for a, b in rows for i in range(a, b)]


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


_MODES: dict[str, Callable[[], object]] = {
    "train": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
}  # fmt: skip


def _rows_by_autograd(model: nn.Module, run: Callable[[nn.Module], object], weight: str) -> dict[str, list[int]]:
    """Witness: on a copy of ``model`` with grad on, the rows of ``weight`` whose gradient is non-zero when each
    of the Q, K, V handed to ``F.scaled_dot_product_attention`` is back-propagated alone (the test's own capture)."""
    twin = copy.deepcopy(model).requires_grad_(True)
    seen: list[tuple[torch.Tensor, ...]] = []
    real = F.scaled_dot_product_attention

    def capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q, k, v))
        return real(q, k, v, *args, **kwargs)  # type: ignore[arg-type]

    F.scaled_dot_product_attention = capture  # type: ignore[assignment]
    try:
        with torch.enable_grad():
            run(twin)
    finally:
        F.scaled_dot_product_attention = real
    w = twin.get_parameter(weight)
    out = {}
    for part, t in zip("qkv", seen[0], strict=True):
        (g,) = torch.autograd.grad(t, w, torch.randn_like(t), retain_graph=True, allow_unused=True)
        out[part] = [] if g is None else g.ne(0).any(1).nonzero().flatten().tolist()
    return out


class Fusable(nn.Module):
    """Separate ``q_proj/k_proj/v_proj`` until :meth:`fuse` builds one ``qkv`` from them (as libraries offer
    for inference); the forward then uses ``qkv``: Q, K, V are its rows ``[0,E)``, ``[E,2E)``, ``[2E,3E)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.qkv: nn.Linear | None = None

    def fuse(self) -> None:
        self.qkv = nn.Linear(E, 3 * E)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            self.qkv.bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is None:
            q, k, v = (_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = (_heads(t) for t in self.qkv(x).split(E, dim=-1))
        return _merge(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_a_module_fused_after_its_first_call_gets_the_fused_rows(mode: str) -> None:
    """Witness: by construction, before ``fuse()`` Q is all of ``q_proj.weight``; after it Q, K, V are the
    thirds of ``qkv.weight``; in training the gradient record's norms are those of ``qkv.weight.grad``'s rows
    (read in the test)."""
    torch.manual_seed(0)
    model = Fusable()
    x = torch.randn(B, L, E)
    with qkvtrace.trace(model) as t:
        model(x).sum().backward()  # derived here, from separate projections
        model.fuse()
        model.zero_grad()
        with _MODES[mode]():  # type: ignore[attr-defined]
            out = model(x)
        if mode == "train":
            out.pow(2).sum().backward()
    before, after = t.calls
    assert before.qkv.layout == "separate" and before.qkv.q.param == "q_proj.weight"
    assert after.qkv.layout == "packed", after.qkv.reason
    for i, part in enumerate("qkv"):
        s = getattr(after.qkv, part)
        assert s.param == "qkv.weight" and _expand(s.rows) == list(range(i * E, (i + 1) * E))
        assert s.weight_norm == pytest.approx(_norm(model.qkv.weight[i * E : (i + 1) * E]), rel=1e-5)
    if mode == "train":
        fused = [g for g in t.gradients if g.backward_index == 1]
        assert len(fused) == 1
        grad = model.qkv.weight.grad
        assert grad is not None
        for i, part in enumerate("qkv"):
            assert getattr(fused[0], part).grad_norm == pytest.approx(_norm(grad[i * E : (i + 1) * E]), rel=1e-5)


class Ordered(nn.Module):
    """``q, k, v`` taken from ``proj(x).chunk(3)`` in the order the caller passes: by construction part ``p``
    is rows ``order.index(p)·E + [0, E)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor, order: str = "qkv") -> torch.Tensor:
        chunks = dict(zip(order, self.proj(x).chunk(3, dim=-1), strict=True))
        return _merge(F.scaled_dot_product_attention(*(_heads(chunks[p]) for p in "qkv")))


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_a_split_order_chosen_by_an_argument_is_read_per_call(mode: str) -> None:
    """Witness: ``Ordered``'s construction, and autograd on a copy for each order (the test's own capture)."""
    torch.manual_seed(0)
    model = Ordered()
    x = torch.randn(B, L, E)
    orders = ["qkv", "kvq", "vqk", "qkv"]
    with _MODES[mode](), qkvtrace.trace(model) as t:  # type: ignore[attr-defined]
        for order in orders:
            model(x, order)
    assert len(t.calls) == len(orders)
    for call, order in zip(t.calls, orders, strict=True):
        by_autograd = _rows_by_autograd(model, lambda m, o=order: m(x, o), "proj.weight")
        for part in "qkv":
            want = list(range(order.index(part) * E, (order.index(part) + 1) * E))
            assert _expand(getattr(call.qkv, part).rows) == want == by_autograd[part], (order, part)


class Differential(nn.Module):
    """Two SDPA calls a forward (differential attention): call ``i`` takes rows ``i·E + [0, E)`` of each of
    ``q_proj``, ``k_proj`` and ``v_proj`` (each ``Linear(E, 2E)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, 2 * E), nn.Linear(E, 2 * E), nn.Linear(E, 2 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q1, q2 = self.q_proj(x).chunk(2, dim=-1)
        k1, k2 = self.k_proj(x).chunk(2, dim=-1)
        v1, v2 = self.v_proj(x).chunk(2, dim=-1)
        a = F.scaled_dot_product_attention(_heads(q1), _heads(k1), _heads(v1))
        b = F.scaled_dot_product_attention(_heads(q2), _heads(k2), _heads(v2))
        return _merge(a - 0.5 * b)


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_each_of_two_kernel_calls_of_a_module_gets_its_own_rows(mode: str) -> None:
    """Witness: ``Differential``'s construction; in training, each call's gradient norms against the rows of
    the real ``.grad`` read in the test."""
    torch.manual_seed(0)
    model = Differential()
    x = torch.randn(B, L, E)
    with _MODES[mode](), qkvtrace.trace(model) as t:  # type: ignore[attr-defined]
        out = model(x)
        if mode == "train":
            out.pow(2).sum().backward()
    first, second = t.calls
    for i, call in enumerate((first, second)):
        for part in "qkv":
            s = getattr(call.qkv, part)
            assert s.param == f"{part}_proj.weight", call.qkv.reason
            assert _expand(s.rows) == list(range(i * E, (i + 1) * E)), (i, part)
    if mode == "train":
        assert len(t.gradients) == 2
        got = sorted(g.v.grad_norm for g in t.gradients)
        grad = model.v_proj.weight.grad
        assert grad is not None
        assert got == pytest.approx(sorted(_norm(grad[i * E : (i + 1) * E]) for i in range(2)), rel=1e-5)


NOPE, ROPE, RANK = 4, 2, 8  # per-head dims without and with rotary, and the latent rank


class Latent(nn.Module):
    """Latent attention as DeepSeek-V2 lays it out: Q from a low-rank ``q_a_proj → q_b_proj``; K per head is
    ``[k_nope from kv_b_proj, k_rope]`` where ``k_rope`` is rows ``[RANK, RANK+ROPE)`` of ``kv_a_proj``, shared
    by every head; V per head from ``kv_b_proj``. By construction K names ``kv_b_proj`` rows
    ``h·(NOPE+D) + [0, NOPE)`` and ``kv_a_proj`` rows ``[RANK, RANK+ROPE)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(E, RANK)
        self.q_b_proj = nn.Linear(RANK, H * (NOPE + ROPE))
        self.kv_a_proj = nn.Linear(E, RANK + ROPE)
        self.kv_b_proj = nn.Linear(RANK, H * (NOPE + D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(torch.relu(self.q_a_proj(x))).view(B, L, H, NOPE + ROPE).transpose(1, 2)
        latent, k_rope = self.kv_a_proj(x).split([RANK, ROPE], dim=-1)
        kv = self.kv_b_proj(latent).view(B, L, H, NOPE + D).transpose(1, 2)
        k_nope, v = kv.split([NOPE, D], dim=-1)
        k_rope = (k_rope * 2.0).view(B, 1, L, ROPE).expand(B, H, L, ROPE)  # a stand-in for the rotation
        k = torch.cat([k_nope, k_rope], dim=-1)
        return _merge(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("mode", ["train", "no_grad"])
def test_latent_attention_names_every_weight_of_k(mode: str) -> None:
    """Witness: ``Latent``'s construction; K's weight norm is that of all its rows together, computed in the
    test; Q names the nearer of the chained ``q_a_proj → q_b_proj`` and says so."""
    torch.manual_seed(0)
    model = Latent()
    x = torch.randn(B, L, E)
    with _MODES[mode](), qkvtrace.trace(model) as t:  # type: ignore[attr-defined]
        out = model(x)
        if mode == "train":
            out.pow(2).sum().backward()
    [call] = t.calls
    q, k, v = call.qkv.q, call.qkv.k, call.qkv.v
    assert q.param == "q_b_proj.weight" and _expand(q.rows) == list(range(H * (NOPE + ROPE)))
    assert "q_a_proj" in (q.evidence or "")
    nope = [h * (NOPE + D) + i for h in range(H) for i in range(NOPE)]
    assert k.param == "kv_b_proj.weight" and _expand(k.rows) == nope
    assert k.also is not None and [(a.param, _expand(a.rows)) for a in k.also] == [
        ("kv_a_proj.weight", list(range(RANK, RANK + ROPE)))
    ]
    both = (_norm(model.kv_b_proj.weight[nope]) ** 2 + _norm(model.kv_a_proj.weight[RANK : RANK + ROPE]) ** 2) ** 0.5
    assert k.weight_norm == pytest.approx(both, rel=1e-5)
    assert v.param == "kv_b_proj.weight" and _expand(v.rows) == [h * (NOPE + D) + NOPE + i for h in range(H)
                                                                 for i in range(D)]  # fmt: skip
    if mode == "train":
        [grad] = t.gradients
        gb, ga = model.kv_b_proj.weight.grad, model.kv_a_proj.weight.grad
        assert gb is not None and ga is not None
        want = (_norm(gb[nope]) ** 2 + _norm(ga[RANK : RANK + ROPE]) ** 2) ** 0.5
        assert grad.k.grad_norm == pytest.approx(want, rel=1e-5)


class Cached(nn.Module):
    """A module that appends K and V to a cache it is passed (a decoding loop's KV cache), then attends over
    the whole cache: Q, K, V are rows ``[0,E)``, ``[E,2E)``, ``[2E,3E)`` of ``qkv.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = (t.reshape(B, -1, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(B, -1, E)


def test_a_decoding_loop_with_a_cache_has_rows_and_its_cache_is_untouched() -> None:
    """Witness: ``Cached``'s construction; the cache and outputs of an untraced loop of the same steps (the
    module is run again to read its rows: that run must not write into the caller's cache)."""
    torch.manual_seed(0)
    model = Cached().eval()
    steps = [torch.randn(B, 1, E) for _ in range(4)]
    plain: list[torch.Tensor] = []
    traced: list[torch.Tensor] = []
    with torch.inference_mode():
        outs = [model(s, plain) for s in steps]
        with qkvtrace.trace(model) as t:
            touts = [model(s, traced) for s in steps]
    assert all(torch.equal(a, b) for a, b in zip(outs, touts, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert len(t.calls) == len(steps)
    for call in t.calls:
        for i, part in enumerate("qkv"):
            s = getattr(call.qkv, part)
            assert s.param == "qkv.weight" and _expand(s.rows) == list(range(i * E, (i + 1) * E)), call.qkv.reason


class Noisy(Fusable):
    """``Fusable`` whose forward, the one that calls the kernel, draws from the global random generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.0 * torch.randn_like(x)  # noise scaled to nothing: the output stays Fusable's
        q, k, v = (_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return _merge(F.scaled_dot_product_attention(q, k, v))


def test_reading_rows_in_inference_runs_no_hook_and_touches_no_state() -> None:
    """Witness: the user's hook on ``q_proj`` counts its calls (one per forward, as untraced); the global RNG
    state (the forward draws from it), every parameter's ``.grad`` and ``requires_grad``, and the output equal an
    untraced run's."""
    torch.manual_seed(0)
    model = Noisy().eval().requires_grad_(False)
    calls: list[int] = []
    model.q_proj.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(B, L, E)
    torch.manual_seed(1)
    with torch.no_grad():
        plain = model(x)
    state = torch.get_rng_state()
    torch.manual_seed(1)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        out = model(x)
    assert torch.equal(out, plain) and torch.equal(torch.get_rng_state(), state)
    assert calls == [1, 1]
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert t.calls[0].qkv.layout == "separate"


class HandWrittenGQA(nn.Module):
    """Attention written by hand over a fused projection laid out ``k, q, v``: Q is rows ``[E, 2E)``."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, q, v = (_heads(t) for t in self.c_attn(x).split(E, dim=-1))
        w = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
        return _merge(w @ v)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_attention_written_by_hand_has_rows_in_inference(mode: str) -> None:
    """Witness: ``HandWrittenGQA``'s construction (Q rows ``[E, 2E)``, K ``[0, E)``, V ``[2E, 3E)``)."""
    torch.manual_seed(0)
    model = HandWrittenGQA().eval()
    with _MODES[mode](), qkvtrace.trace(model) as t:  # type: ignore[attr-defined]
        model(torch.randn(B, L, E))
    [call] = t.calls
    assert call.path == "hand_written"
    for part, start in (("q", E), ("k", 0), ("v", 2 * E)):
        assert _expand(getattr(call.qkv, part).rows) == list(range(start, start + E)), call.qkv.reason


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_deepseek_v2_latent_attention_rows_by_its_layout(mode: str) -> None:
    """Witness: DeepSeek-V2's layout in the transformers library, read from its config: Q is every row of
    ``q_b_proj`` (behind ``q_a_proj``); K per head is ``kv_b_proj`` rows ``h·(nope+v) + [0, nope)`` plus the
    rotary rows ``[kv_lora_rank, kv_lora_rank + rope)`` of ``kv_a_proj_with_mqa``; V per head ``kv_b_proj`` rows
    ``h·(nope+v) + nope + [0, v)``. Run with its own KV cache (a prompt, then one decoding step), outputs equal an
    untraced run's."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV2Config"):
        pytest.skip("this transformers has no DeepSeek-V2")
    nope, rope, vdim, rank, heads = 8, 4, 8, 8, 2
    config = transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=16, kv_lora_rank=rank,
        qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=vdim, n_routed_experts=2, num_experts_per_tok=1,
        first_k_dense_replace=1, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config).train(mode == "train")
    ids = torch.randint(0, 64, (1, 5))

    def run() -> list[torch.Tensor]:
        first = model(ids, use_cache=True)
        second = model(ids[:, -1:], past_key_values=first.past_key_values, use_cache=True)
        return [first.logits, second.logits]

    with _MODES[mode]():  # type: ignore[attr-defined]
        plain = run()
        with qkvtrace.trace(model) as t:
            traced = run()
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    k_rows = [h * (nope + vdim) + i for h in range(heads) for i in range(nope)]
    v_rows = [h * (nope + vdim) + nope + i for h in range(heads) for i in range(vdim)]
    assert len(t.calls) == 2
    for call in t.calls:
        q, k, v = call.qkv.q, call.qkv.k, call.qkv.v
        assert q.param == "q_b_proj.weight" and _expand(q.rows) == list(range(heads * (nope + rope))), call.qkv.reason
        assert "q_a_proj" in (q.evidence or "")
        assert k.param == "kv_b_proj.weight" and _expand(k.rows) == k_rows
        assert k.also is not None
        assert [(a.param, _expand(a.rows)) for a in k.also] == [("kv_a_proj_with_mqa.weight",
                                                                 list(range(rank, rank + rope)))]  # fmt: skip
        assert v.param == "kv_b_proj.weight" and _expand(v.rows) == v_rows


def test_inside_a_users_profiler_the_module_is_not_run_again() -> None:
    """Witness: the user's own ``torch.profiler`` -- the operations it records with the trace open are those it
    records untraced (a second run of the module would add its matmuls); once the profiler is closed, the next
    call of the same module has its rows (``Ordered``'s construction)."""
    torch.manual_seed(0)
    model = Ordered().eval()
    x = torch.randn(B, L, E)

    def ops(traced: bool) -> list[str]:
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if traced:
                with qkvtrace.trace(model) as t:
                    model(x)
                [call] = t.calls
                assert call.qkv.layout is None and "profiler" in (call.qkv.reason or "")
            else:
                model(x)
        return [e.name for e in prof.events() if e.name in ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear")]

    assert ops(traced=True) == ops(traced=False)
    with torch.no_grad(), qkvtrace.trace(model) as t:
        model(x)
    assert _expand(t.calls[0].qkv.q.rows) == list(range(E))


def test_a_module_fused_under_inference_mode_has_rows_and_norms() -> None:
    """Witness: ``Fusable``'s construction after ``fuse()`` (thirds of ``qkv.weight``), whose weight is made
    under ``inference_mode`` here (an inference tensor: no version counter, no graph), and the norms of those
    rows computed in the test."""
    torch.manual_seed(0)
    model = Fusable().eval()
    x = torch.randn(B, L, E)
    with torch.inference_mode(), qkvtrace.trace(model) as t:
        model(x)
        model.fuse()
        model(x)
    assert t.result.warnings == []
    before, after = t.calls
    assert before.qkv.layout == "separate" and after.qkv.layout == "packed", after.qkv.reason
    assert model.qkv is not None and model.qkv.weight.is_inference()
    for i, part in enumerate("qkv"):
        s = getattr(after.qkv, part)
        assert _expand(s.rows) == list(range(i * E, (i + 1) * E))
        assert s.weight_norm == pytest.approx(_norm(model.qkv.weight[i * E : (i + 1) * E]), rel=1e-5)
