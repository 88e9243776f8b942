"""Turn a TARGET string into a model and example inputs.

``TARGET`` is ``package.module:callable``, ``path/to/file.py:callable`` or
``demo:NAME``. The callable returns a model, or ``(model, example_inputs)``
where ``example_inputs`` is a tuple of positional arguments or a dict of
keyword arguments. Without example inputs they are synthesised from the
model's first layer (:func:`synthesize_inputs`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkvtrace.demos import DEMOS
from qkvtrace.errors import InputError, TargetError

__all__ = ["Loaded", "first_mha", "first_tensor", "load_target", "synthesize_inputs"]

_FORM = "package.module:callable, path/to/file.py:callable or demo:NAME"


@dataclass
class Loaded:
    """A model and the inputs to call it with."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: True when the inputs were made up by :func:`synthesize_inputs`.
    synthesized: bool = False


def _split(target: str) -> tuple[str, str]:
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name or not name.replace("_", "a").replace("-", "a").isalnum():
        raise TargetError(f"TARGET {target!r} is not of the form {_FORM}; try `qkvtrace trace demo:encoder`")
    return where, name


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise TargetError(f"TARGET file {str(path)!r} does not exist; give a path to a .py file")
    mod_name = f"_qkvtrace_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"TARGET file {str(path)!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise TargetError(f"importing {str(path)!r} raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)
    return module


def _import_module(name: str) -> Any:
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current folder is importable
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"cannot import module {name!r} ({exc}); check the spelling, install it, "
            "or run from the folder that contains it"
        ) from exc
    except Exception as exc:
        raise TargetError(f"importing module {name!r} raised {type(exc).__name__}: {exc}") from exc


def load_target(target: str) -> Loaded:
    """Import and call the factory named by ``target``."""
    where, name = _split(target)
    if where == "demo":
        factory = DEMOS.get(name)
        if factory is None:
            raise TargetError(f"unknown demo {name!r}; choose one of: {', '.join(sorted(DEMOS))}")
        label = f"demo:{name}"
    else:
        is_file = where.endswith(".py") or "/" in where or "\\" in where
        module = _import_file(Path(where)) if is_file else _import_module(where)
        factory = getattr(module, name, None)
        if factory is None:
            found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            hint = f"; callables there: {', '.join(found[:8])}" if found else ""
            raise TargetError(f"{where!r} has no attribute {name!r}{hint}")
        label = target
    if isinstance(factory, nn.Module):
        produced: Any = factory
    elif callable(factory):
        try:
            produced = factory()
        except Exception as exc:
            raise TargetError(
                f"calling {label}() raised {type(exc).__name__}: {exc}; fix the factory "
                "(it is called with no arguments)"
            ) from exc
    else:
        raise TargetError(f"{label} is a {type(factory).__name__}, not a callable that returns a model")
    return _unpack(label, produced)


def _unpack(label: str, produced: Any) -> Loaded:
    if isinstance(produced, nn.Module):
        return Loaded(produced)
    if isinstance(produced, tuple) and len(produced) == 2 and isinstance(produced[0], nn.Module):
        model, inputs = produced
        if isinstance(inputs, dict):
            return Loaded(model, (), dict(inputs))
        if isinstance(inputs, torch.Tensor):
            return Loaded(model, (inputs,))
        if isinstance(inputs, (tuple, list)):
            return Loaded(model, tuple(inputs))
        raise TargetError(
            f"{label} returned example inputs of type {type(inputs).__name__}; "
            "use a tensor, a tuple of arguments or a dict of keyword arguments"
        )
    raise TargetError(f"{label} returned a {type(produced).__name__}, not an nn.Module or (model, example_inputs)")


def synthesize_inputs(model: nn.Module, batch: int, length: int) -> tuple[Any, ...]:
    """Inputs for a model that starts with an embedding or an attention layer.

    * first leaf is ``nn.Embedding``: token ids ``(batch, length)``;
    * otherwise the first attention layer fixes the width: ``(batch, length,
      embed_dim)`` floats (``(length, batch, embed_dim)`` when it is not
      ``batch_first``), passed three times to a bare ``MultiheadAttention``.
    """
    if batch < 1 or length < 1:
        raise InputError(f"--input-shape needs positive B,T, got {batch},{length}")
    first_leaf = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first_leaf, nn.Embedding):
        return (torch.randint(0, first_leaf.num_embeddings, (batch, length)),)
    mha = first_mha(model)
    if mha is not None:
        shape = (batch, length, mha.embed_dim) if mha.batch_first else (length, batch, mha.embed_dim)
        x = torch.randn(*shape)
        return (x, x, x) if model is mha else (x,)
    raise InputError(
        f"cannot make example inputs for {type(model).__name__}: it starts with neither "
        "nn.Embedding nor an attention layer; return (model, example_inputs) from your factory"
    )


def first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor in a model's output (a tensor, or nested tuples/lists/dicts)."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def first_mha(model: nn.Module) -> nn.MultiheadAttention | None:
    """The first ``MultiheadAttention`` of a model (or of its first encoder/decoder layer)."""
    for m in model.modules():
        mha = m if isinstance(m, nn.MultiheadAttention) else getattr(m, "self_attn", None)
        if isinstance(mha, nn.MultiheadAttention):
            return mha
    return None
