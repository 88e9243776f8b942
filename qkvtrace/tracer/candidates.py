"""Which modules of a traced model look like attention, run compiled, or are watched for attention by hand.

Names are the user's own: the parts only a wrapper adds (``torch.compile``'s
``_orig_mod``, FSDP's and DDP's wrapped modules) are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from torch import nn

from qkvtrace.base import compat
from qkvtrace.facts.projection_rows import weight_dim
from qkvtrace.facts.slices import Projection, guess_projection
from qkvtrace.records import TraceResult, Unobserved
from qkvtrace.tracer.observers import handwritten

if TYPE_CHECKING:
    from qkvtrace.tracer.structure import Walked

__all__ = ["compiled_before", "hand_written_candidates", "inside_compiled", "looks_like_attention",
           "named_for_attention", "note_unobserved", "projection_holders", "region_notes", "regions", "related",
           "runs_compiled", "unobserved_reason", "user_names", "within"]

_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


def runs_compiled(m: nn.Module, optimized: tuple[type, ...]) -> bool:
    """``m`` runs through ``torch.compile``: an ``OptimizedModule``, or compiled in place (``module.compile()``)."""
    return (bool(optimized) and isinstance(m, optimized)) or getattr(m, "_compiled_call_impl", None) is not None


def regions(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, str]]:
    """The modules (by name) that run through ``torch.compile`` or TorchScript, with which of the two."""
    compiled_types = compat.compiled_module_types()
    scripted_types = compat.scripted_module_types()
    found: list[tuple[str, str]] = []
    for name, m in modules:
        if runs_compiled(m, compiled_types):
            found.append((name, "torch.compile"))
        elif scripted_types and isinstance(m, scripted_types):
            found.append((name, "TorchScript"))
    return found


def region_notes(found: list[tuple[str, str]], calls: list[str], compiled: list[str]) -> list[str]:
    """What a trace says of each compiled or scripted region (:func:`regions`), from the modules of its recorded
    ``calls`` and of the attention operations its ``compiled`` graphs hold."""
    notes = []
    for name, kind in found:
        inside = sum(1 for c in calls if within(c, name))
        made = sum(1 for c in compiled if within(c, name))
        if made:
            notes.append(
                f"{name or '(root)'} runs through {kind}: {made} attention operation(s) of its graphs are "
                "recorded under `compiled` (from PyTorch's compile log, or Dynamo's cache for graphs compiled "
                "before the trace opened); how often the compiled code ran them is not observed"
            )
            continue
        if inside:  # Dynamo ran them eagerly (some releases fall back on attention): real calls, recorded
            notes.append(
                f"{name or '(root)'} runs through {kind}: {inside} attention call(s) inside it ran outside "
                "compiled graphs and were recorded; calls inside compiled graphs are not observed"
            )
            continue
        why = (
            " (the trace stands aside while it runs: PyTorch's own functions stay in place, so nothing is "
            "recompiled); graphs compiled before the trace opened are not in the compile log it reads"
            if kind == "torch.compile"
            else ""
        )
        notes.append(
            f"{name or '(root)'} runs through {kind}: attention calls inside it are not observed{why}; "
            "its modules are listed as unobserved"
        )
    return notes


def inside_compiled(model: nn.Module) -> set[int]:
    """Ids of the modules that run inside ``torch.compile``."""
    optimized = compat.compiled_module_types()
    inside: set[int] = set()
    for m in model.modules():
        if runs_compiled(m, optimized):
            inside.update(id(sub) for sub in m.modules())
    return inside


def user_names(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model``'s modules, named as in the model the user wrapped.

    Parts that only a wrapper adds are dropped: ``torch.compile``'s ``_orig_mod``,
    FSDP's ``_fsdp_wrapped_module`` and the ``module`` of ``DistributedDataParallel``
    (``module.encoder.layers.0`` is ``encoder.layers.0``, as in the unwrapped model).
    """
    ddp = compat.data_parallel_types()
    wrapped: set[str] = set()
    for name, m in model.named_modules():
        if ddp and isinstance(m, ddp):
            wrapped.add(f"{name}.module" if name else "module")
        parts = name.split(".") if name else []
        kept = [p for i, p in enumerate(parts) if p not in _WRAPPER_PARTS and ".".join(parts[: i + 1]) not in wrapped]
        yield ".".join(kept), m


def within(name: str, region: str) -> bool:
    """Module ``name`` is the module ``region`` or inside it (``""``, the root, holds every module)."""
    return not region or f"{name}.".startswith(f"{region}.")


def related(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same module, or one contains the other."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def named_for_attention(name: str, module: nn.Module) -> bool:
    """``attn``/``attention`` in the module's own name or its class name."""
    return bool(_ATTENTION_NAME.search(name.rpartition(".")[2]) or _ATTENTION_NAME.search(type(module).__name__))


def looks_like_attention(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return True
    children = list(module.children())
    if not children:
        return False  # a leaf (a projection, a dropout, a norm) is not an attention module
    return named_for_attention(name, module) or isinstance(guess_projection(module), Projection)


def hand_written_candidates(
    named: Iterable[tuple[str, nn.Module]],
    compiled: set[int],
    looks: Callable[[str, nn.Module], bool] | None = None,
) -> list[nn.Module]:
    """The modules watched for attention written by hand: the model's own modules that look like attention
    (leaves named for it too, as ``Attend``), none on or inside PyTorch's attention modules (an active mode
    refuses their fast paths), none scripted or compiled. ``looks``: :func:`looks_like_attention`, or
    its answers kept from an earlier trace."""
    looks = looks or looks_like_attention
    named = [(n, m) for n, m in named if id(m) not in compiled]
    torch_attention = [n for n, m in named if isinstance(m, handwritten.TORCH_ATTENTION)]
    scripted = compat.scripted_module_types()
    return [
        m for name, m in named
        if not type(m).__module__.startswith("torch.") and not (scripted and isinstance(m, scripted))
        and not any(related(name, t) for t in torch_attention)
        and (looks(name, m) or named_for_attention(name, m))
    ]  # fmt: skip


def projection_holders(named: Iterable[tuple[str, nn.Module]], compiled: set[int],
                       watched: Iterable[nn.Module]) -> list[nn.Module]:  # fmt: skip
    """The outermost of the model's own modules that hold a projection weight (an ``nn.Linear``, a ``Conv1D``)
    and are not watched already (``watched``): none on or inside PyTorch's attention modules, none scripted or
    compiled. While one of them runs its first calls (until one meets no new layout), the torch functions it
    calls are written down, so that a module calling SDPA in it, of any name, gets its rows from them when its
    call builds no graph (:mod:`qkvtrace.facts.lineage`)."""
    named = [(n, m) for n, m in named if id(m) not in compiled]
    torch_attention = [n for n, m in named if isinstance(m, handwritten.TORCH_ATTENTION)]
    taken = {id(m) for m in watched}
    scripted = compat.scripted_module_types()
    kept: list[str] = []
    out: list[nn.Module] = []
    for name, m in sorted(named, key=lambda e: (e[0].count(".") + bool(e[0]), e[0])):
        if type(m).__module__.startswith("torch.") or (scripted and isinstance(m, scripted)):
            continue
        if any(related(name, t) for t in torch_attention) or any(within(name, k) for k in kept):
            continue
        if id(m) in taken:  # (its calls are watched, and what it calls with them)
            kept.append(name)
        elif any(weight_dim(d) is not None for d in m.modules()):
            kept.append(name)
            out.append(m)
    return out


def compiled_before(named: Iterable[tuple[str, nn.Module]], name: str, codes: frozenset[int]) -> str | None:
    """The module (``name`` or one holding it) whose forward torch.compile compiled before the trace opened
    (``codes``: the ids of the code objects Dynamo had compiled then)."""
    if not codes:
        return None
    for holder, m in named:
        if holder == name or not holder or name.startswith(holder + "."):  # the module or one holding it
            code = getattr(getattr(type(m), "forward", None), "__code__", None)
            if code is not None and id(code) in codes:
                return holder
    return None


def unobserved_reason(name: str, found: list[tuple[str, str]], before: str | None) -> str:
    """Why an attention-looking module made no recorded call: inside a compiled or scripted region
    (:func:`regions`), compiled before the trace opened (``before``: :func:`compiled_before`), or neither."""
    region = next((r for r in found if within(name, r[0])), None)
    if region is not None:
        where = region[0] or "the model"
        return f"inside {where}, which runs through {region[1]}; the tracer does not see inside it"
    if before is not None:
        whose = "its" if before == name else f"{before or 'the model'}'s"
        return (
            f"made no recorded call: torch.compile compiled {whose} forward"
            " before the trace opened, and that compiled code calls none of the functions the tracer "
            "wraps, nor are its graphs in the compile log the trace reads; call torch._dynamo.reset() "
            "before the trace (or compile inside it) to see them"
        )
    return (
        "made no recorded call: no entry point the tracer wraps ran in it, and no attention written "
        "by hand (matmul of two activations, softmax over the last axis, matmul with a third) was "
        "recognised in its forward; or it did not run in the trace"
    )


def note_unobserved(result: TraceResult, walked: Walked, seen: list[str], names: Iterable[tuple[str, nn.Module]],
                    compiled_codes: frozenset[int]) -> None:  # fmt: skip
    """Add to a closing trace's ``result`` its model's attention-looking modules that made no recorded call (with
    why, where it can be said) and the notes on its compiled or scripted regions. ``seen``: the names of the
    modules that made a recorded call; ``names``: the trace's ``(name, module)`` entries; ``compiled_codes``:
    the code objects Dynamo had compiled when the trace opened."""
    regions_found = walked.answer("regions", lambda: regions(walked.named()))
    compiled_modules = {c.module for c in result.compiled}
    result.warnings += region_notes(regions_found, [c.module for c in result.calls],
                                    [c.module for c in result.compiled])  # fmt: skip
    seen_names = seen + sorted(compiled_modules)
    looking = walked.answer("looking like attention", lambda: sorted(
        (name, i) for i, (name, looks) in enumerate(zip(walked.structure.names, walked.looks_like_attention(),
                                                        strict=True)) if looks))  # fmt: skip
    entries = list(names)
    for name, i in looking:
        m = walked.modules[i]
        if any(related(name, s) for s in seen_names):
            continue
        before = compiled_before(entries, name, compiled_codes)
        reason = unobserved_reason(name, regions_found, before)
        result.unobserved.append(Unobserved(module=name, module_type=type(m).__name__, reason=reason))
    if handwritten.NOT_WATCHED in result.warnings:
        # only worth saying when something stayed silent: every attention-looking module seen (eager or in a
        # compiled graph) leaves no hand-written attention the watch could have found
        result.warnings.remove(handwritten.NOT_WATCHED)
        silent = [u.module or "(root)" for u in result.unobserved]
        if silent:
            result.warnings.append(f"{handwritten.NOT_WATCHED}; made no recorded call: {', '.join(silent)}")
