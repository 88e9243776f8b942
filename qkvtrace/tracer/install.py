"""One installation of the tracer's wrappers per process.

Why wrappers, and why these: PyTorch refuses its fast paths for many
innocent things -- a forward hook on the encoder layer or its children, an
active ``TorchFunctionMode``, a tensor subclass -- so qkvtrace replaces a few
attributes with thin wrappers instead: ``MultiheadAttention.forward`` (the
module and its arguments as passed), ``torch._native_multi_head_attention``
(the fast path), ``F.multi_head_attention_forward`` (the fallback),
``torch._transformer_encoder_layer_fwd`` (the fused encoder layer) and
``F.scaled_dot_product_attention`` and FlexAttention's ``flex_attention``
(also where a traced model's module bound them to names of their own). Each wrapper calls what it replaced with the very
same arguments and returns its result untouched.

Why one installation per process: traces nest, overlap and end in any order
in any thread. If each trace saved "the original" and put it back, any
order but strict LIFO would leave a finished trace's wrapper in PyTorch. So
the wrappers are made once per process, installed when the first trace
opens and removed when the last one closes (a reference count under a lock),
and a wrapper asks the registry which open traces a call belongs to.
Reusing the same wrapper objects also keeps ``torch.compile``'s caches
valid: a graph compiled inside one trace is reused inside the next.

Why the identity of PyTorch's functions survives (DESIGN.md, principle 8):

* ``__torch_function__`` overrides receive PyTorch's own builtin as
  ``func`` whichever name the caller used -- the wrapper dispatches them as
  PyTorch's C++ entry does -- and the few that compare ``func`` with the
  attribute at call time (``torch.nn.attention.bias.CausalBias``:
  ``func is torch.nn.functional.scaled_dot_product_attention``) are handed
  the attribute instead (:mod:`qkvtrace.tracer.identity`). Both checks hold
  while a trace is open as they do without one, for callers that bound the
  function by name before the trace too.
* TorchScript compiles a Python function from its source and resolves names
  in the function's globals. A wrapper of a Python function is built with
  the globals of the function it wraps (its own state lives in its closure,
  under names PyTorch's sources never use) and points ``__wrapped__`` at it,
  so scripting sees PyTorch's own source resolved in PyTorch's own module.
  A wrapper of a builtin is registered with TorchScript as the ``aten`` op it
  stands for while it is installed. Scripted code calls PyTorch directly:
  the tracer does not see inside it, and says so (``unobserved``).
* Under ``torch.compile`` (and while ``torch.jit.trace`` records a graph) a
  wrapper does nothing but call what it wrapped -- no host reads, no thread
  ids, no caches, no profiler ranges -- so the graphs are the same as
  without the trace.
* A compiled module must also *find* what it was compiled with: Dynamo
  guards every compiled graph on the identity of the functions it loaded
  (``___check_obj_id(F.scaled_dot_product_attention)``), so a module
  compiled before a trace would be recompiled inside it, and one compiled
  inside it recompiled after. So the installation stands aside while a
  compiled module runs (:meth:`Installation.stand_aside`): PyTorch's own
  functions are put back for the call and the wrappers return after it.
  That covers ``torch.compile(module)`` (``OptimizedModule.__call__``,
  patched while wrappers are installed; ``torch.compile`` itself is wrapped
  only to patch it once Dynamo is imported), a traced model's modules
  compiled in place with ``module.compile()`` before the trace, and any
  module compiled in place while a trace is open (``nn.Module.compile``
  calls ``torch.compile`` on the module's own call: the wrapped
  ``torch.compile`` hands that call back standing aside, and what PyTorch
  made is put back when the last trace closes; ``nn.Module`` itself is not
  patched, since setting an attribute of a class with hundreds of
  subclasses empties the attribute caches of them all at every open and
  close). While one runs, no thread's attention calls are observed.

Why a trace never raises into a call: an observer reads a great deal
(frames, masks, shapes, norms) around the one call it must make. Each
wrapper runs its observer through :func:`observed`, which hands it the
wrapped function as a callable that remembers how its one call ended. If
the observer fails anywhere, the caller gets exactly what the call gave --
its result, or its own exception -- (the call is made then if the observer
failed before making it), the thread's open calls are put back as they were,
and every open trace of the thread says in ``warnings`` what could not be
read. A wrapper whose observer may have nothing to do but note something
before the call (the fallback of an open ``MultiheadAttention`` call) asks
that step first and, when it was all, makes the call itself; if the step
fails, the traces say so the same way and the call is made as without one.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkvtrace.base import compat
from qkvtrace.tracer import dispatch, identity, registry
from qkvtrace.tracer.dispatch import redispatch_sdpa
from qkvtrace.tracer.observers import handwritten

__all__ = ["Installation", "code_globals", "installation", "observed"]

Observer = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

_SHIMS = dispatch.SHIMS
#: threads watching for hand-written attention now (read without a call while 0)
_HAND_WRITTEN_ON = handwritten.watching
#: this thread's open calls (:func:`qkvtrace.tracer.registry.open_calls`), read on every wrapped call
_LOCAL = registry.thread_state()


class _Once:
    """The wrapped function, handed to an observer: it remembers how its call ended (``result`` or ``error``, left
    unset until then: a steady call sets one field)."""

    __slots__ = ("error", "fn", "result")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self.result = self.fn(*args, **kwargs)
        except BaseException as exc:
            self.error = exc
            raise
        return result


_UNSET = object()


def observed(
    label: str, observe: Observer, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``observe(original, args, kwargs)``, with the caller getting what ``original`` gives if observing fails.

    Inside a module watched for hand-written attention the watching mode steps
    aside for the call (:mod:`qkvtrace.tracer.observers.handwritten`); a wrapper
    asks this only while some thread watches (else :func:`_observed` at once).
    """
    if _HAND_WRITTEN_ON[0] and handwritten.entry_point_called():
        with handwritten.suspended():
            return _observed(label, observe, original, args, kwargs)
    return _observed(label, observe, original, args, kwargs)


def _observed(
    label: str, observe: Observer, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    once = _Once(original)
    stack = _LOCAL.stack
    depth = len(stack)
    try:
        return observe(once, args, kwargs)
    except Exception as exc:
        error = getattr(once, "error", None)
        if exc is error:
            raise  # the call's own exception, on its way to the caller
        failure = exc
    del stack[depth:]
    registry.report_failure(label, failure)
    if error is not None:
        raise error
    result = getattr(once, "result", _UNSET)
    if result is not _UNSET:
        return result
    return original(*args, **kwargs)


def _make_wrapper(
    label: str,
    original: Callable[..., Any],
    observe: Observer,
    compiled: Callable[..., Any] | None,
    ahead: Callable[[], bool] | None = None,
) -> Callable[..., Any]:
    """A wrapper of ``original`` that hands eager calls to ``observe``.

    ``ahead``: asked first, unless attention written by hand is watched; when it says it observed all there is
    of the call (before it runs), the wrapper makes the call itself. If it fails, the failure is reported and
    the call made as without a trace.

    The closure names start with ``_qkv_`` so that they never shadow a name
    in PyTorch's source when TorchScript resolves it (see the module docstring).
    """
    _qkv_label = label
    _qkv_original = original
    _qkv_observe = observe
    _qkv_ahead = ahead
    _qkv_observed = observed
    _qkv_guarded = _observed
    _qkv_failed = registry.report_failure
    _qkv_watching = _HAND_WRITTEN_ON
    _qkv_compiled = compiled
    _qkv_is_compiling = compat.is_compiling
    _qkv_is_jit_tracing = compat.is_jit_tracing

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _qkv_is_compiling() or _qkv_is_jit_tracing():
            if _qkv_compiled is not None:
                return _qkv_compiled(_qkv_original, args, kwargs)
            return _qkv_original(*args, **kwargs)
        if _qkv_watching[0]:
            return _qkv_observed(_qkv_label, _qkv_observe, _qkv_original, args, kwargs)
        if _qkv_ahead is not None:
            try:
                done = _qkv_ahead()
            except Exception as exc:
                _qkv_failed(_qkv_label, exc)
                done = True
            if done:
                return _qkv_original(*args, **kwargs)
        return _qkv_guarded(_qkv_label, _qkv_observe, _qkv_original, args, kwargs)

    globs = getattr(original, "__globals__", None)
    if globs is None:
        globs = {"__builtins__": builtins}
    name = getattr(original, "__name__", "wrapper")
    fn = types.FunctionType(wrapper.__code__, globs, name, None, wrapper.__closure__)
    for attr in ("__qualname__", "__module__", "__doc__"):
        value = getattr(original, attr, None)
        if value is not None:
            setattr(fn, attr, value)
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    return fn


@dataclass
class _Target:
    label: str
    owner: Any
    attr: str
    #: the TorchScript builtin a wrapper of a builtin stands for
    aten: str | None
    original: Any
    wrapper: Any


def _current(owner: Any, attr: str) -> Any:
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


class Installation:
    """The process-wide installation: reference-counted, thread-safe, reversible."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = 0
        self._targets: list[_Target] | None = None
        #: (id(globals), name) -> [globals, name, original, wrapper, count]
        self._bound: dict[tuple[int, str], list[Any]] = {}
        #: compiled modules running now (the wrappers stand aside while > 0)
        self._aside = 0
        #: ``torch.compile`` and ``OptimizedModule.__call__`` as PyTorch has them, while patched
        self._compile_patches: list[tuple[Any, str, Any, bool]] = []
        #: modules compiled in place (``module.compile()``) whose compiled call stands aside, and what PyTorch made
        self._compiled_here: list[tuple[weakref.ref[nn.Module], Any]] = []

    # -- the wrappers, made once ---------------------------------------------

    def _make_targets(self) -> list[_Target]:
        from qkvtrace.tracer.observers import flex, layer, mha, sdpa

        spec: list[tuple[str, Any, str, str | None, Observer, Callable[..., Any] | None]] = [
            ("nn.MultiheadAttention.forward", nn.MultiheadAttention, "forward", None, mha.observe_forward, None),
            ("torch._native_multi_head_attention", torch, "_native_multi_head_attention",
             "aten::_native_multi_head_attention", mha.observe_native, None),
            ("F.multi_head_attention_forward", F, "multi_head_attention_forward", None, mha.observe_function, None),
            ("torch._transformer_encoder_layer_fwd", torch, "_transformer_encoder_layer_fwd",
             "aten::_transformer_encoder_layer_fwd", layer.observe_layer, None),
            ("F.scaled_dot_product_attention", F, "scaled_dot_product_attention",
             "aten::scaled_dot_product_attention", sdpa.observe_sdpa, redispatch_sdpa),
            # FlexAttention, where this PyTorch has it and the process has imported it (importing it costs seconds)
            ("flex_attention", sys.modules.get("torch.nn.attention.flex_attention"), "flex_attention", None,
             flex.observe_flex, None),
        ]  # fmt: skip
        targets = []
        for label, owner, attr, aten, observe, compiled in spec:
            if owner is None:
                continue
            original = _current(owner, attr)
            ahead = mha.ahead_of_function if observe is mha.observe_function else None
            wrapper = _make_wrapper(label, original, observe, compiled, ahead)
            targets.append(_Target(label, owner, attr, aten, original, wrapper))
        return targets

    def originals(self) -> dict[str, Any]:
        """What each wrapped attribute was before qkvtrace (label -> object)."""
        with self._lock:
            if self._targets is None:
                self._targets = self._make_targets()
            return {t.label: t.original for t in self._targets}

    # -- install / remove ------------------------------------------------------

    def acquire(self) -> None:
        """Install the wrappers if no trace has them installed yet."""
        with self._lock:
            if self._count == 0:
                self._install()
                self._patch_compile()
                if self._aside:  # a compiled module is running: the wrappers come when it returns
                    self._unset()
            self._count += 1

    def release(self) -> None:
        """Remove the wrappers when the last open trace releases them."""
        with self._lock:
            if self._count <= 0:
                return
            self._count -= 1
            if self._count == 0:
                self._remove()

    def _install(self) -> None:
        if self._targets is None:
            self._targets = self._make_targets()
        elif not any(t.label == "flex_attention" for t in self._targets) and _flex_module() is not None:
            self._targets += [t for t in self._make_targets() if t.label == "flex_attention"]
        table = compat.torchscript_builtins()  # built now, while it still sees PyTorch's own functions
        identity.fill_torch_caches()  # likewise PyTorch's cached tables of functions
        done: list[_Target] = []
        try:
            for t in self._targets:
                if _current(t.owner, t.attr) is not t.original:
                    continue  # someone else replaced it since: leave theirs alone
                setattr(t.owner, t.attr, t.wrapper)
                done.append(t)
                if t.aten is not None and table is not None:
                    table[id(t.wrapper)] = t.aten
            # overrides that compare ``func`` with a wrapped builtin's attribute (wrapped Python functions
            # hand overrides their own global, which is the wrapper while it is installed)
            _SHIMS.install((t.owner, t.attr, t.original) for t in done if t.aten is not None)
        except BaseException:
            _SHIMS.remove()
            for t in done:
                self._restore(t, table)
            raise

    def _restore(self, t: _Target, table: dict[int, str] | None) -> None:
        if _current(t.owner, t.attr) is t.wrapper:
            setattr(t.owner, t.attr, t.original)
        if table is not None and t.aten is not None:
            table.pop(id(t.wrapper), None)

    def _remove(self) -> None:
        table = compat.torchscript_builtins()
        assert self._targets is not None
        self._unpatch_compile()
        _SHIMS.remove()
        for t in self._targets:
            self._restore(t, table)
        for globs, name, original, wrapper, _ in self._bound.values():
            if globs.get(name) is wrapper:
                globs[name] = original
        self._bound.clear()

    # -- standing aside while compiled code runs -------------------------------

    @contextlib.contextmanager
    def stand_aside(self) -> Iterator[None]:
        """PyTorch's own functions in place for the block (a compiled module's call), the wrappers after."""
        with self._lock:
            self._aside += 1
            if self._aside == 1 and self._count > 0:
                self._unset()
        try:
            yield
        finally:
            with self._lock:
                self._aside -= 1
                if self._aside == 0 and self._count > 0:
                    self._reset()

    def _unset(self) -> None:
        _SHIMS.remove()
        for t in self._targets or ():
            if _current(t.owner, t.attr) is t.wrapper:
                setattr(t.owner, t.attr, t.original)
        for globs, name, original, wrapper, _ in self._bound.values():
            if globs.get(name) is wrapper:
                globs[name] = original

    def _reset(self) -> None:
        done = []
        for t in self._targets or ():
            if _current(t.owner, t.attr) is t.original:
                setattr(t.owner, t.attr, t.wrapper)
                done.append(t)
        for globs, name, original, wrapper, _ in self._bound.values():
            if globs.get(name) is original:
                globs[name] = wrapper
        _SHIMS.install((t.owner, t.attr, t.original) for t in done if t.aten is not None)

    def _patch_compile(self) -> None:
        """Make compiled modules run with PyTorch's own functions: patch ``OptimizedModule.__call__`` if Dynamo
        is imported, else wrap ``torch.compile`` so that its first use patches it."""
        patched = {(id(owner), attr) for owner, attr, _, _ in self._compile_patches}
        optimized = compat.compiled_module_types()
        if optimized and (id(optimized[0]), "__call__") not in patched:
            self._patch(optimized[0], "__call__", _standing_aside(self, optimized[0].__call__))
        if (id(torch), "compile") not in patched:  # its use also stops the watching for attention written by hand
            self._patch(torch, "compile", _compile_then_patch(self, torch.compile))

    def _patch(self, owner: Any, attr: str, replacement: Any) -> None:
        own = attr in vars(owner)
        self._compile_patches.append((owner, attr, getattr(owner, attr), own))
        setattr(owner, attr, replacement)

    def _unpatch_compile(self) -> None:
        for ref, compiled in self._compiled_here:  # compiled in place: as PyTorch made it again
            module = ref()
            if module is not None and getattr(module.__dict__.get("_compiled_call_impl"), "_qkv_stands_aside", False):
                module._compiled_call_impl = compiled
        self._compiled_here.clear()
        for owner, attr, original, own in reversed(self._compile_patches):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._compile_patches.clear()

    def stand_aside_in(self, model: nn.Module) -> None:
        """Modules of ``model`` compiled in place (``module.compile()``): their compiled call stands aside too,
        until the last trace closes."""
        with self._lock:
            for m in model.modules():
                self._wrap_compiled(m)

    def _wrap_compiled(self, module: nn.Module) -> None:
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None and not getattr(compiled, "_qkv_stands_aside", False):
            module._compiled_call_impl = self._aside_in(module, compiled)

    def _aside_in(self, module: nn.Module, compiled: Any) -> Callable[..., Any]:
        """``module``'s compiled call ``compiled``, standing aside; ``compiled`` is put back when the last trace
        closes."""
        self._compiled_here.append((weakref.ref(module), compiled))
        return _standing_aside(self, compiled)

    # -- names a model's own modules bound ------------------------------------

    def bind_names(self, model: nn.Module, code: list[dict[str, Any]] | None = None) -> list[tuple[int, str]]:
        """Wrap SDPA and FlexAttention where ``model``'s code bound them to names of its own.

        (``from torch.nn.functional import scaled_dot_product_attention`` binds
        the builtin in the importing module's globals, out of reach of the
        attribute on ``F``.) ``code``: the globals its classes' code reads
        (:func:`code_globals`, walked here when not given). Returns keys for :meth:`unbind`.
        """
        if code is None:
            code = code_globals(model.modules())
        with self._lock:
            bindable = ("F.scaled_dot_product_attention", "flex_attention")
            originals = {id(t.original): t for t in self._targets or () if t.label in bindable}
            keys: list[tuple[int, str]] = []
            ids = originals.keys()
            for globs in code:
                # one pass of identities over the module's values (a library's globals hold hundreds), and the
                # names only where one of them is there
                if ids.isdisjoint(map(id, list(globs.values()))):
                    continue
                for gname, value in [(g, v) for g, v in list(globs.items()) if id(v) in originals]:
                    target = originals[id(value)]
                    if value is not target.original:
                        continue
                    key = (id(globs), gname)
                    entry = self._bound.get(key)
                    if entry is None:
                        entry = self._bound[key] = [globs, gname, value, target.wrapper, 0]
                        if not self._aside:  # else when the compiled module running now returns
                            globs[gname] = target.wrapper
                    entry[4] += 1
                    keys.append(key)
            return keys

    def unbind(self, keys: list[tuple[int, str]]) -> None:
        with self._lock:
            for key in keys:
                entry = self._bound.get(key)
                if entry is None:
                    continue
                entry[4] -= 1
                if entry[4] <= 0:
                    globs, name, original, wrapper, _ = entry
                    if globs.get(name) is wrapper:
                        globs[name] = original
                    del self._bound[key]


def code_globals(modules: Iterable[nn.Module]) -> list[dict[str, Any]]:
    """The globals the code of these modules' classes reads (each once; ``torch.nn.functional``'s left out:
    its attribute is wrapped already)."""
    found: list[dict[str, Any]] = []
    seen: set[int] = {id(F.__dict__)}
    for cls in dict.fromkeys(type(m) for m in modules):
        for base in cls.__mro__:
            if base in (nn.Module, object):
                break
            for attr in vars(base).values():
                globs = getattr(attr, "__globals__", None)
                if globs is not None and id(globs) not in seen:
                    seen.add(id(globs))
                    found.append(globs)
    return found


def _standing_aside(inst: Installation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with PyTorch's own functions in place (as a class attribute too: ``self`` is passed on)."""

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        with inst.stand_aside():
            return fn(*args, **kwargs)

    compiled_call._qkv_stands_aside = True  # type: ignore[attr-defined]
    compiled_call.__wrapped__ = fn  # type: ignore[attr-defined]
    return compiled_call


def _compile_then_patch(inst: Installation, compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` that stops the watching for hand-written attention and, once Dynamo is imported,
    patches ``OptimizedModule.__call__``; called by ``nn.Module.compile`` (a module compiled in place), it hands
    back the module's compiled call standing aside."""

    def compile_(*args: Any, **kwargs: Any) -> Any:
        handwritten.stop_watching_for_compile()
        result = compile_fn(*args, **kwargs)
        in_place = sys._getframe(1).f_code is _MODULE_COMPILE
        with inst._lock:
            if inst._count > 0:
                inst._patch_compile()
                owner = getattr(args[0] if args else kwargs.get("model"), "__self__", None)
                if in_place and isinstance(owner, nn.Module):
                    result = inst._aside_in(owner, result)
        return result

    compile_.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    compile_.__doc__ = compile_fn.__doc__
    compile_.__name__ = compile_.__qualname__ = "compile"
    return compile_


#: the code of ``nn.Module.compile``, whose call of ``torch.compile`` compiles a module in place
_MODULE_COMPILE = getattr(inspect.unwrap(nn.Module.compile), "__code__", None)


def _flex_module() -> Any:
    return sys.modules.get("torch.nn.attention.flex_attention")


_INSTALLATION = Installation()


def installation() -> Installation:
    """The one installation of this process."""
    return _INSTALLATION
