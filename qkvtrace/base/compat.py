"""Every "does this PyTorch have X?" question, answered by looking.

Other modules ask here instead of comparing version numbers, so they stay
free of version checks and follow whatever the installed PyTorch offers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "DIST",
    "MissingCapability",
    "backend_forcing_api",
    "dynamo_compiled_code_ids",
    "dynamo_compiled_nothing",
    "forced_backend",
    "fused_sdp_choice",
    "is_compiling",
    "is_jit_tracing",
    "post_accumulate_grad_hooks",
    "raw_sdpa",
    "sdp_backend_name",
    "sdp_backend_names",
    "sdpa_params",
    "sdpa_refusal_checks",
    "torchscript_builtins",
]


def dynamo_compiled_code_ids() -> frozenset[int]:
    """Ids of the code objects whose frames ``torch.compile`` (Dynamo) has compiled in this process; empty when
    Dynamo is not loaded or keeps no such record (its ``convert_frame.input_codes``)."""
    convert = sys.modules.get("torch._dynamo.convert_frame")
    ids = getattr(getattr(convert, "input_codes", None), "seen_ids", None)
    try:
        return frozenset(ids or ())
    except TypeError:  # another shape in another release: no record
        return frozenset()


def dynamo_compiled_nothing() -> bool:
    """Dynamo has compiled no frame in this process (it is not loaded, or its record of compiled code is empty):
    no code holds a cache entry to read. ``False`` where the record has another shape."""
    convert = sys.modules.get("torch._dynamo.convert_frame")
    if convert is None:
        return True
    ids = getattr(getattr(convert, "input_codes", None), "seen_ids", None)
    return isinstance(ids, (set, frozenset)) and not ids


def sdp_backend_names() -> dict[int, str]:
    """``SDPBackend`` member values mapped to their names, read from PyTorch."""
    return dict(_backend_names())


_BACKEND_NAMES: dict[Any, dict[int, str]] = {}


def _backend_names() -> dict[int, str]:
    """:func:`sdp_backend_names`, read once per enum (it is asked per call): not to be changed by callers."""
    enum = _sdp_backend_enum()
    if enum is None:
        return {}
    found = _BACKEND_NAMES.get(enum)
    if found is None:
        found = _BACKEND_NAMES[enum] = {int(member.value): name for name, member in enum.__members__.items()}
    return found


def _sdp_backend_enum() -> Any:
    attention = getattr(torch.nn, "attention", None)
    enum = getattr(attention, "SDPBackend", None)
    if enum is None:  # older releases kept it in torch.backends.cuda
        enum = getattr(torch.backends.cuda, "SDPBackend", None)
    return enum


def sdp_backend_name(value: int) -> str | None:
    """The member name for a backend number, ``None`` for ``ERROR``/unknown."""
    name = _backend_names().get(int(value))
    return None if name in (None, "ERROR") else name


def raw_sdpa() -> Callable[..., torch.Tensor]:
    """SDPA's C++ entry itself: untouched by the wrappers an active trace installs."""
    return torch._C._nn.scaled_dot_product_attention  # type: ignore[no-any-return]


class MissingCapability(RuntimeError):
    """This PyTorch lacks what was asked for; the message names the missing API.

    A ``RuntimeError``, like the one PyTorch raises for a backend it cannot
    run, so a probe that forces a backend records it the same way.
    """


#: ``SDPBackend`` names and the ``torch.backends.cuda.sdp_kernel`` switch of each (the older API).
_SDP_KERNEL_FLAGS = {
    "FLASH_ATTENTION": "enable_flash",
    "EFFICIENT_ATTENTION": "enable_mem_efficient",
    "MATH": "enable_math",
    "CUDNN_ATTENTION": "enable_cudnn",
}


def backend_forcing_api() -> str | None:
    """The dotted name of the API :func:`forced_backend` uses here, ``None`` if there is none."""
    if callable(getattr(getattr(torch.nn, "attention", None), "sdpa_kernel", None)):
        return "torch.nn.attention.sdpa_kernel"
    if callable(getattr(torch.backends.cuda, "sdp_kernel", None)):
        return "torch.backends.cuda.sdp_kernel"
    return None


@contextlib.contextmanager
def forced_backend(name: str | None) -> Iterator[None]:
    """Only the SDPA backend of that ``SDPBackend`` name enabled (no-op for ``None``).

    Uses ``torch.nn.attention.sdpa_kernel`` where it exists, else the older
    ``torch.backends.cuda.sdp_kernel`` switches (releases before it);
    raises :class:`MissingCapability` when neither can force ``name``.
    """
    if name is None:
        yield
        return
    api = backend_forcing_api()
    enum = _sdp_backend_enum()
    if api is None or enum is None or name not in enum.__members__:
        raise MissingCapability(f"this PyTorch cannot force the SDPA backend {name} (no sdpa_kernel API knows it)")
    if api == "torch.nn.attention.sdpa_kernel":
        with torch.nn.attention.sdpa_kernel(enum.__members__[name]):
            yield
        return
    sdp_kernel = torch.backends.cuda.sdp_kernel
    try:
        switches = set(inspect.signature(sdp_kernel).parameters)
    except (TypeError, ValueError):  # no signature to read: no way to know its switches
        switches = set()
    if _SDP_KERNEL_FLAGS.get(name) not in switches:
        raise MissingCapability(f"torch.backends.cuda.sdp_kernel has no switch for the SDPA backend {name}")
    only = {flag: flag == _SDP_KERNEL_FLAGS[name] for flag in _SDP_KERNEL_FLAGS.values() if flag in switches}
    with sdp_kernel(**only):
        yield


def fused_sdp_choice() -> Callable[..., int] | None:
    """PyTorch's own SDPA backend selection function, if it is exposed."""
    return getattr(torch, "_fused_sdp_choice", None)


def sdpa_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> Any:
    """``torch.backends.cuda.SDPAParams`` for these arguments, or ``None``.

    The constructor gained ``enable_gqa`` over time; its arity is read from
    the docstring pybind11 generates rather than guessed from a version.
    """
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    if params_type is None:
        return None
    args: list[Any] = [query, key, value, attn_mask, float(dropout_p), bool(is_causal)]
    doc = params_type.__init__.__doc__ or ""
    if "arg6" in doc:
        args.append(bool(enable_gqa))
    return params_type(*args)


def sdpa_refusal_checks() -> dict[str, Callable[..., bool]]:
    """``torch.backends.cuda.can_use_*`` functions that accept ``debug``."""
    checks: dict[str, Callable[..., bool]] = {}
    for backend, fn_name in (
        ("FLASH_ATTENTION", "can_use_flash_attention"),
        ("EFFICIENT_ATTENTION", "can_use_efficient_attention"),
        ("CUDNN_ATTENTION", "can_use_cudnn_attention"),
    ):
        fn = getattr(torch.backends.cuda, fn_name, None)
        if fn is None:
            continue
        try:
            if "debug" not in inspect.signature(fn).parameters:
                continue
        except (TypeError, ValueError):  # builtins without a signature
            continue
        checks[backend] = fn
    return checks


def _is_compiling_fn() -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn if fn is not None else (lambda: False)


#: ``torch.compiler.is_compiling`` (or its older home): True while Dynamo traces a frame.
is_compiling: Callable[[], bool] = _is_compiling_fn()


#: ``torch._C._is_tracing``: True while ``torch.jit.trace`` records a graph (ops run now would land in it); the
#: builtin itself, asked on every wrapped call
is_jit_tracing: Callable[[], bool] = getattr(torch._C, "_is_tracing", lambda: False)


def torchscript_builtins() -> dict[int, str] | None:
    """TorchScript's table of builtin functions (``id(fn) -> "aten::op"``), built if needed."""
    builtins_mod = getattr(getattr(torch, "jit", None), "_builtins", None)
    get_table = getattr(builtins_mod, "_get_builtin_table", None)
    if get_table is None:
        return None
    table = get_table()
    return table if isinstance(table, dict) else None


def compiled_module_types() -> tuple[type, ...]:
    """Wrapper types ``torch.compile`` returns for a module (``OptimizedModule``).

    Read from ``sys.modules`` only: where Dynamo was never imported no module
    can be compiled, and ``torch._dynamo`` is imported lazily -- asking for the
    attribute would import it (about ten seconds on a first trace).
    """
    found: list[type] = []
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(optimized, type):
        found.append(optimized)
    return tuple(found)


def scripted_module_types() -> tuple[type, ...]:
    """TorchScript module types (``torch.jit.ScriptModule``)."""
    script_module = getattr(getattr(torch, "jit", None), "ScriptModule", None)
    return (script_module,) if isinstance(script_module, type) else ()


def data_parallel_types() -> tuple[type, ...]:
    """Wrappers that hold the user's model as ``.module`` (``DataParallel``, ``DistributedDataParallel``)."""
    found: list[type] = [torch.nn.DataParallel]
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    if isinstance(ddp, type):
        found.append(ddp)
    return tuple(found)


def distributed_rank() -> tuple[int | None, int | None]:
    """``(rank, world_size)`` of this process's default group, ``(None, None)`` outside ``torch.distributed``."""
    dist = DIST
    if dist is None or not dist.is_initialized():
        return None, None
    return int(dist.get_rank()), int(dist.get_world_size())


def _distributed() -> Any:
    dist = getattr(torch, "distributed", None)
    return dist if dist is not None and dist.is_available() else None


#: ``torch.distributed`` where this build has it (a build's answer, asked once)
DIST = _distributed()


def is_dtensor(t: Any) -> bool:
    """A ``DTensor`` (a parameter sharded by FSDP's ``fully_shard``, or a gradient of one)."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def whole(t: Any) -> Any:
    """``t`` itself, or for a ``DTensor`` the whole tensor (a collective: every rank must call it, in order)."""
    return t.full_tensor() if is_dtensor(t) else t


def fsdp1_types() -> tuple[type, ...]:
    """``FullyShardedDataParallel`` (FSDP1), when the user's program has imported it."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    found = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    return (found,) if isinstance(found, type) else ()


@functools.cache
def has_gradient_edge() -> bool:
    """Whether ``torch.autograd.grad`` takes a ``GradientEdge`` (a graph edge) as an input."""
    edge = getattr(torch.autograd.graph, "GradientEdge", None)
    return edge is not None and "GradientEdge" in (inspect.getdoc(torch.autograd.grad) or "")


def post_accumulate_grad_hooks() -> bool:
    """Whether a parameter takes a hook run after its ``.grad`` is accumulated."""
    return hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
