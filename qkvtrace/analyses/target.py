"""Turn a TARGET string into a model and example inputs.

``TARGET`` is ``package.module:callable``, ``path/to/file.py:callable`` or
``demo:NAME``. The callable returns a model, or ``(model, example_inputs)``
where ``example_inputs`` is a tuple of positional arguments or a dict of
keyword arguments. Without example inputs they are synthesised from the
model's first layer (:func:`synthesize_inputs`).

Models from the libraries people use need no factory:

* ``hf:NAME_OR_PATH`` — Hugging Face ``transformers``, from a local folder or
  the local cache only (nothing is downloaded): the class named in the
  config's ``architectures``, else ``AutoModel``. ``random_init`` builds it from
  ``config.json`` alone (seeded), so no weight file is read.
* ``timm:NAME`` / ``torchvision:NAME`` — random weights (nothing downloaded).

Their inputs come from the config: token ids below ``vocab_size`` (at most
``max_position_embeddings`` long), or images of ``image_size``. Each library
is an optional extra; without it the error names what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkvtrace.analyses.demos import DEMOS
from qkvtrace.base.errors import InputError, TargetError

__all__ = ["LIBRARIES", "Loaded", "first_mha", "first_tensor", "load_target", "synthesize_inputs"]

_FORM = ("package.module:callable, path/to/file.py:callable, demo:NAME, hf:NAME_OR_PATH, timm:NAME "
         "or torchvision:NAME")  # fmt: skip

#: TARGET prefix -> (the library it loads from, what to install)
LIBRARIES = {
    "hf": ("transformers", 'pip install "qkvtrace[hf]" (transformers)'),
    "timm": ("timm", 'pip install "qkvtrace[timm]" (timm)'),
    "torchvision": ("torchvision", 'pip install "qkvtrace[torchvision]" (torchvision, built for your torch)'),
}

InputMaker = Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass
class Loaded:
    """A model and the inputs to call it with."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: True when the inputs were made up by :func:`synthesize_inputs` or from the model's config.
    synthesized: bool = False
    #: makes ``(args, kwargs)`` for a batch and sequence length; default :func:`synthesize_inputs`
    input_maker: InputMaker | None = None

    def make_inputs(self, batch: int, length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Made-up ``(args, kwargs)`` for this model: from its config where it has one."""
        if batch < 1 or length < 1:
            raise InputError(f"--input-shape needs positive B,T, got {batch},{length}")
        if self.input_maker is not None:
            return self.input_maker(batch, length)
        return synthesize_inputs(self.model, batch, length), {}


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


def _library(prefix: str, target: str) -> Any:
    module, install = LIBRARIES[prefix]
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # missing, or built for another torch (then importing it fails)
        raise TargetError(f"TARGET {target!r} needs the {module} library, which cannot be imported here "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                          f"{install}") from exc  # fmt: skip


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """Random weights that are the same on every run (the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _hf_inputs(config: Any, target: str) -> InputMaker:
    """Token ids below the vocabulary size, or images of the config's size."""
    vocab = getattr(config, "vocab_size", None)
    image = getattr(config, "image_size", None)
    limit = getattr(config, "max_position_embeddings", None)

    def make(batch: int, length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(vocab, int) and vocab > 0:
            if isinstance(limit, int) and length > limit:
                raise InputError(f"{target}: sequence length {length} is over the config's "
                                 f"max_position_embeddings={limit}; lower --input-shape")  # fmt: skip
            ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
            kwargs = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
            return (ids,), kwargs
        if image is not None:
            return (_images(batch, getattr(config, "num_channels", 3), image),), {}
        raise InputError(f"{target}: its config has neither vocab_size nor image_size to make inputs from; "
                         "write a factory that returns (model, example_inputs)")  # fmt: skip

    return make


def _images(batch: int, channels: int, size: Any) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return torch.randn(batch, channels, h, w, generator=torch.Generator().manual_seed(0))


def _image_inputs(channels: int, size: Any) -> InputMaker:
    return lambda batch, _length: ((_images(batch, channels, size),), {})


def _load_hf(target: str, name: str, random_init: bool) -> Loaded:
    transformers = _library("hf", target)
    folder = Path(name).expanduser()
    where = str(folder) if folder.exists() else name
    if not folder.exists() and (name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1):
        raise TargetError(f"{target}: folder {name!r} does not exist; give a folder written by save_pretrained")
    if folder.exists() and not (folder / "config.json").is_file():
        raise TargetError(f"{target}: folder {where!r} has no config.json; give a model folder "
                          "(save_pretrained writes one)")  # fmt: skip
    try:
        config = transformers.AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as exc:  # not cached / no such folder, or an unknown model_type
        raise TargetError(f"{target}: no usable config in a local folder or the local cache ({_first_line(exc)}); "
                          f"give a folder with config.json, or download it first "
                          f"(hf download {name})") from None  # fmt: skip
    arch = next(iter(getattr(config, "architectures", None) or []), None)
    cls = getattr(transformers, arch, None) if arch else None
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # qkvtrace shows its own progress, on stderr
    try:
        if random_init:
            model = _seeded(lambda: cls(config) if cls is not None else transformers.AutoModel.from_config(config))
        else:
            auto = cls if cls is not None else transformers.AutoModel
            model = auto.from_pretrained(where, local_files_only=True)
    except OSError as exc:  # no weight file there
        raise TargetError(f"{target}: no weights in a local folder or the local cache ({_first_line(exc)}); "
                          "--random-init builds the model from its config alone") from None  # fmt: skip
    except (ValueError, TypeError, ImportError, RuntimeError) as exc:  # what transformers raises for a bad model
        raise TargetError(f"{target}: transformers could not build the model ({_first_line(exc)})") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Loaded(model, input_maker=_hf_inputs(config, target))


def _load_timm(target: str, name: str) -> Loaded:
    timm = _library("timm", target)
    try:
        model = _seeded(lambda: timm.create_model(name, pretrained=False))
    except RuntimeError as exc:  # timm: "Unknown model (...)"
        raise TargetError(f"{target}: {_first_line(exc)}; list names with timm.list_models()") from exc
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    channels, *size = cfg.get("input_size", (3, 224, 224))
    return Loaded(model, input_maker=_image_inputs(channels, size))


def _load_torchvision(target: str, name: str) -> Loaded:
    torchvision = _library("torchvision", target)
    try:
        model = _seeded(lambda: torchvision.models.get_model(name, weights=None))
    except ValueError as exc:  # torchvision: "Unknown model ..."
        raise TargetError(f"{target}: {_first_line(exc)}; list names with torchvision.models.list_models()") from exc
    return Loaded(model, input_maker=_image_inputs(3, getattr(model, "image_size", 224)))


def load_target(target: str, *, random_init: bool = False) -> Loaded:
    """Import and call the factory named by ``target``, or load a library model (``hf:``, ``timm:``, ...)."""
    prefix, sep, rest = target.partition(":")
    if sep and prefix in LIBRARIES:
        if not rest:
            raise TargetError(f"TARGET {target!r} names no model; e.g. {prefix}:NAME")
        if prefix == "hf":
            return _load_hf(target, rest, random_init)
        return _load_timm(target, rest) if prefix == "timm" else _load_torchvision(target, rest)
    if random_init:
        raise TargetError(f"--random-init is for hf: targets; {target!r} builds its own model")
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
    """Inputs for a model whose first layer is an embedding or an attention layer.

    * first layer is ``nn.Embedding``: token ids ``(batch, length)``;
    * first layer is an attention layer (``nn.MultiheadAttention``, or a layer
      holding one as ``self_attn``): ``(batch, length, embed_dim)`` floats
      (``(length, batch, embed_dim)`` when it is not ``batch_first``), passed
      three times to a bare ``MultiheadAttention``.

    "First" is the first layer in the model's registration order. Any other
    first layer (an ``nn.Linear``, a convolution, a norm...) does not say what
    shape the model takes, so nothing is guessed: :class:`InputError` says so.
    """
    if batch < 1 or length < 1:
        raise InputError(f"--input-shape needs positive B,T, got {batch},{length}")
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            return (torch.randint(0, m.num_embeddings, (batch, length)),)
        mha = m if isinstance(m, nn.MultiheadAttention) else getattr(m, "self_attn", None)
        if isinstance(mha, nn.MultiheadAttention):
            shape = (batch, length, mha.embed_dim) if mha.batch_first else (length, batch, mha.embed_dim)
            x = torch.randn(*shape)
            return (x, x, x) if model is mha else (x,)
        if not list(m.children()):
            where = f"its first layer, {name} ({type(m).__name__}), is" if name else "it is a single layer,"
            raise InputError(
                f"cannot make example inputs for {type(model).__name__}: {where} neither nn.Embedding nor "
                "an attention layer, so its input shape is unknown and qkvtrace does not guess it; "
                "return (model, example_inputs) from your factory"
            )
    raise InputError(f"cannot make example inputs for {type(model).__name__}: it has no layers; "
                     "return (model, example_inputs) from your factory")  # fmt: skip


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
