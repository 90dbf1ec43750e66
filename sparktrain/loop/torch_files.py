"""A torch module as two files: its weights and a small pickle of everything else.

The weights are ``torch.save`` of the module's ``state_dict`` (read back with
``weights_only=True``, so that file cannot run code, and memory-mapped: Python workers on one
host share its pages through the page cache instead of each holding a copy). The pickle is the
module (and, for training, the optimizer bound to it) with every ``state_dict`` tensor written
as a reference to its key (pickle's ``persistent_id``): a few KiB for any model size. Loading
puts the weights file's tensors in their place, so parameters shared between modules, and an
optimizer's hold on the parameters, stay what they were.

Example::

    arch = dumps_without_weights((net, optimizer), net)       # KiB, whatever the model size
    ref = save_weights(net.state_dict(), "s3://b/st/runs/r1/model/weights.pt")
    net2, optimizer2 = loads_with_weights(arch, load_weights(ref.local_path()))
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, Literal, Mapping, Optional, Tuple, Union

import torch

from sparktrain.model_files import ModelFile
from sparktrain.pickling import dumps

_TAG = "sparktrain.state"  # persistent ids are (_TAG, state_dict key)


def _identity(t: torch.Tensor) -> Tuple[Any, ...]:
    """What makes two tensor objects the same tensor: storage, offset, shape, strides, type
    (``param.data`` is a new Python object at every access)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.device.type)


def state_keys(module: torch.nn.Module) -> Dict[Tuple[Any, ...], str]:
    """Each ``state_dict`` tensor's identity -> its (first) key; empty and meta tensors are
    left out (they have no storage to tell them apart, and cost nothing to pickle)."""
    keys: Dict[Tuple[Any, ...], str] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and tensor.numel() and not tensor.is_meta:
            keys.setdefault(_identity(tensor.detach()), key)
    return keys


def dumps_without_weights(obj: Any, module: torch.nn.Module) -> bytes:
    """``obj`` (the module, or a tuple holding it and its optimizer) pickled with ``module``'s
    ``state_dict`` tensors as references to their keys."""
    keys = state_keys(module)

    def refer(value: Any) -> Any:
        if type(value) is torch.Tensor and value.numel() and not value.is_meta:
            key = keys.get(_identity(value))
            if key is not None:
                return (_TAG, key)
        return None

    return dumps(obj, refer)


class _WeightsUnpickler(pickle.Unpickler):
    def __init__(self, blob: bytes, weights: Mapping[str, torch.Tensor]) -> None:
        import io

        super().__init__(io.BytesIO(blob))
        self._weights = weights

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle's hook
        tag, key = pid
        if tag != _TAG:
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        try:
            return self._weights[key]
        except KeyError:
            raise KeyError(f"the weights file has no tensor {key!r} that the model refers to "
                           f"(it holds {len(self._weights)} others): the files are not of one "
                           f"model") from None


def loads_with_weights(blob: bytes, weights: Mapping[str, torch.Tensor]) -> Any:
    """What :func:`dumps_without_weights` wrote, its tensors taken from ``weights``."""
    return _WeightsUnpickler(blob, weights).load()


def load_weights(path: str, mmap: bool = True) -> Dict[str, torch.Tensor]:
    """A ``torch.save``d state_dict from a local ``path``, memory-mapped (copy-on-write: a
    rank that trains on them gets private pages only for what it writes)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def cpu_state(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def save_weights(state: Mapping[str, torch.Tensor], url: str,
                 storage_options: Optional[Dict[str, Any]] = None) -> ModelFile:
    """``torch.save(state)`` streamed to ``url``; a reference to the written file."""
    with ModelFile.writing(url, storage_options) as out:
        torch.save(cpu_state(state), out)
    return ModelFile.of(url, storage_options)


def materialize_meta(module: torch.nn.Module) -> None:
    """Allocate (uninitialized, on the CPU) the parameters and buffers of ``module`` still on
    the ``meta`` device: models saved by sparktrain before weights were referenced by key."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                sub._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                           requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device="cpu")


def load_module(architecture: bytes, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module (eval mode) from its pickle and its weights; pickles with meta tensors (the
    format before references) get the weights copied in."""
    module = loads_with_weights(architecture, weights)
    if any(t.is_meta for t in module.state_dict().values()):
        materialize_meta(module)
        module.load_state_dict(weights)
    return module.eval()


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s ``state_dict`` tensors (shared ones counted once)."""
    seen = {}
    for tensor in module.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            seen[_identity(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _versions(module: torch.nn.Module) -> Dict[str, Tuple[Any, int]]:
    """Each ``state_dict`` entry's tensor identity and in-place version counter."""
    return {key: (_identity(t.detach()), t._version)
            for key, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


class ModuleFiles:
    """A module kept as files (its architecture pickle and a weights :class:`ModelFile`),
    loaded on first use and then known to equal them until it is changed in place.

    ``trainer`` is the same pickle of ``(module, optimizer)`` with ``optimizer_state()``
    giving the optimizer's state: :meth:`load` then returns both, the optimizer bound to the
    loaded module.

    Example::

        files = ModuleFiles(arch, ModelFile.of(url))
        net = files.load()             # memory-mapped weights
        files.unchanged(net)           # False once an optimizer step or copy_ changed them
    """

    def __init__(self, architecture: bytes, weights: ModelFile, trainer: Optional[bytes] = None,
                 optimizer_state: Any = None) -> None:
        self.architecture = architecture
        self.weights = weights
        self.trainer = trainer
        self.optimizer_state = optimizer_state
        self._loaded: Dict[str, Tuple[Any, int]] = {}

    @classmethod
    def written(cls, module: torch.nn.Module, url: str,
                storage_options: Optional[Dict[str, Any]] = None) -> "ModuleFiles":
        """``module``'s weights written to ``url``; the files, known to equal ``module``."""
        files = cls(dumps_without_weights(module, module),
                    save_weights(module.state_dict(), url, storage_options))
        files._loaded = _versions(module)
        return files

    def load(self) -> Tuple[torch.nn.Module, Any]:
        """``(module, optimizer or None)`` from the files."""
        state = load_weights(self.weights.local_path())
        optimizer = None
        if self.trainer is not None:
            module, optimizer = loads_with_weights(self.trainer, state)
            saved = self.optimizer_state() if self.optimizer_state is not None else None
            if saved is not None and optimizer is not None:
                try:
                    optimizer.load_state_dict(saved)
                except (ValueError, KeyError, RuntimeError):
                    pass  # the optimizer then has the state the fit started from
            module.eval()
        else:
            module = load_module(self.architecture, state)
        self._loaded = _versions(module)
        return module, optimizer

    def unchanged(self, module: torch.nn.Module) -> bool:
        """True when ``module`` is what :meth:`load` returned, not changed in place since (by
        torch's version counters: an optimizer step, ``copy_``, ``load_state_dict``).
        Writes through ``.data`` bypass the counters: call ``setModel`` after those."""
        return bool(self._loaded) and _versions(module) == self._loaded


class ShippedModule:
    """The model and its optimizer as a fit's payload carries them to the ranks: the pickle of
    ``(module, optimizer)`` without weights (KiB) and the weights file in the store, which
    each rank memory-maps (an executor on another host copies it to local disk once).

    Example::

        shipped = ShippedModule.of(net, optimizer, save_weights(net.state_dict(), url))
        net, optimizer = shipped.load()                   # on a rank
        net, optimizer = shipped.load(net0.state_dict())  # preflight: the driver's tensors
    """

    def __init__(self, trainer: bytes, weights: Optional[ModelFile]) -> None:
        self.trainer = trainer
        self.weights = weights

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: Any,
           weights: Optional[ModelFile]) -> "ShippedModule":
        return cls(dumps_without_weights((module, optimizer), module), weights)

    def load(self, state: Optional[Mapping[str, torch.Tensor]] = None
             ) -> Tuple[torch.nn.Module, Any]:
        """``(module, optimizer)``, their tensors from ``state`` or else the weights file."""
        if state is None:
            assert self.weights is not None  # only the driver's checks ship none; they pass state
            state = load_weights(self.weights.local_path())
        module, optimizer = loads_with_weights(self.trainer, state)
        return module, make_optimizer(optimizer, module)


def is_builder(value: Any) -> bool:
    """A zero-argument callable that builds the module (not a module itself)."""
    return callable(value) and not isinstance(value, torch.nn.Module)


def check_builder(fn: Any) -> None:
    """A ``TypeError`` unless ``fn`` can be called with no arguments (a ``forward``-like
    function passed as the model is the usual mistake)."""
    import inspect

    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise TypeError(f"model must be a torch.nn.Module or a zero-argument callable that "
                        f"builds one; {builder_name(fn)!r} takes arguments "
                        f"{inspect.signature(fn)}") from None
    except ValueError:  # no signature to inspect (a builtin): calling it will tell
        pass


def builder_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def build_module(fn: Any, where: str) -> torch.nn.Module:
    """``fn()``, which must be a ``torch.nn.Module``: errors name the callable."""
    from sparktrain.faults import user_code

    with user_code(f"the model callable {builder_name(fn)!r} ({where})"):
        module = fn()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"the model callable {builder_name(fn)!r} returned "
                        f"{type(module).__name__}, not a torch.nn.Module")
    return module


def build_on_meta(fn: Any) -> Optional[torch.nn.Module]:
    """The module ``fn`` builds, on the ``meta`` device (shapes, no memory for weights), for
    the driver's checks; ``None`` when ``fn`` cannot build there (``from_pretrained`` refuses a
    meta device: it loads weights). Any other error is the callable's, raised naming it."""
    from sparktrain.errors import PreflightError

    try:
        with torch.device("meta"):
            return build_module(fn, "built on the driver's meta device to check its shapes")
    except TypeError:
        raise
    except Exception as exc:  # noqa: BLE001 - sorted below
        if "meta" in str(exc).lower():
            return None
        raise PreflightError(f"the model callable {builder_name(fn)!r} failed on the driver "
                             f"(building it on the meta device, to check its shapes before "
                             f"training): {type(exc).__name__}: {exc}") from exc


class BuiltModule(ShippedModule):
    """A model given as a callable: each rank builds it (e.g. ``from_pretrained`` of a path
    every host reads), so the driver never holds its weights; ``optimizer`` is then a callable
    ``params -> Optimizer`` applied to the trainable parameters."""

    def __init__(self, build: Any, optimizer: Any) -> None:
        super().__init__(b"", None)
        self.build = build
        self.optimizer = optimizer

    def load(self, state: Union[Mapping[str, torch.Tensor], Literal["meta"], None] = None
             ) -> Tuple[torch.nn.Module, Any]:
        """``state="meta"``: built on the meta device (the driver's checks)."""
        module = build_on_meta(self.build) if state == "meta" else \
            build_module(self.build, "on this rank")
        if module is None:  # the driver checked it builds there before passing "meta"
            raise RuntimeError(f"the model callable {builder_name(self.build)!r} cannot build "
                               f"on the meta device")
        return module, make_optimizer(self.optimizer, module)


def make_optimizer(optimizer: Any, module: torch.nn.Module) -> Any:
    """``optimizer`` itself, or what the callable ``params -> Optimizer`` makes of the
    module's trainable parameters."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    from sparktrain.faults import user_code

    with user_code("the optimizer callable"):
        made = optimizer([p for p in module.parameters() if p.requires_grad])
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"the optimizer callable returned {type(made).__name__}, not a "
                        f"torch.optim.Optimizer")
    return made
