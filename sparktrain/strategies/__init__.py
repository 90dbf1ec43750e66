"""Training strategies, one file each, looked up by name like the engines in
:mod:`sparktrain.launch`.

A *strategy* says how the ranks hold the model and apply gradients (replicated, sharded,
parameter servers); an *engine* (backend) says how the ranks are launched and talk. The
estimators validate ``strategy=`` against these registries and the rank loops call the chosen
strategy's methods: they never compare strategy names, so a new strategy is one file plus one
registration, inside sparktrain or in the user's own code.

This module imports no framework: entries are ``"module:Class"`` strings (imported when used)
or classes registered by the user.

Example (a strategy of your own, see ``docs/engines-and-strategies.md``)::

    from sparktrain.strategies import register_torch_strategy
    from sparktrain.strategies.torch_ddp import DataParallel

    class CompressedDataParallel(DataParallel):
        ...

    register_torch_strategy("ddp_compressed", CompressedDataParallel)
    TorchEstimator(..., strategy="ddp_compressed").fit(df)
"""
from __future__ import annotations

from typing import Dict, Tuple, Union

from sparktrain.launch import backends_with, load_backend
from sparktrain.plugins import check_entry, load

Entry = Union[str, type]

TORCH_STRATEGIES: Dict[str, Entry] = {
    "ddp": "sparktrain.strategies.torch_ddp:DataParallel",
    "fsdp": "sparktrain.strategies.torch_fsdp:FullySharded",
}

KERAS_STRATEGIES: Dict[str, Entry] = {
    "multi_worker_mirrored": "sparktrain.strategies.keras_mirrored:MultiWorkerMirrored",
    "parameter_server": "sparktrain.strategies.keras_ps:ParameterServer",
}


def _register(registry: Dict[str, Entry], kind: str, name: str, strategy: Entry) -> None:
    check_entry(f"{kind} strategy", name, strategy)
    registry[name] = strategy


def register_torch_strategy(name: str, strategy: Entry) -> None:
    """Make ``TorchEstimator(strategy=name)`` train with ``strategy``, a subclass of
    :class:`sparktrain.strategies.torch_strategy.TorchStrategy` (or its ``"module:Class"``).
    Registered in this process: register before building (or loading) the estimator. The
    class reaches the executors with the training payload (by value when it is defined in
    your own code), so they need nothing registered."""
    _register(TORCH_STRATEGIES, "torch", name, strategy)


def register_keras_strategy(name: str, strategy: Entry) -> None:
    """Make ``KerasEstimator(strategy=name)`` train with ``strategy``, a subclass of
    :class:`sparktrain.strategies.keras_strategy.KerasStrategy` (or its ``"module:Class"``)."""
    _register(KERAS_STRATEGIES, "keras", name, strategy)


def check_engine(strategy: type, name: str, engines: Dict[str, Tuple[Entry, str]],
                 backend: str) -> type:
    """The engine class registered in ``engines`` as ``backend``; a ``ValueError`` naming the
    engines that fit when it lacks a capability in ``strategy.engine_needs`` (class attributes
    of :mod:`sparktrain.launch.engine`'s interfaces), ``strategy.engine_note`` saying why.
    Strategies ask this instead of comparing engine names."""
    engine = load_backend(engines, backend)
    needs = tuple(getattr(strategy, "engine_needs", ()))
    if all(getattr(engine, capability, False) for capability in needs):
        return engine
    wanted = " or ".join(repr(b) for b in backends_with(engines, *needs)) or "(none registered)"
    note = getattr(strategy, "engine_note", "")
    raise ValueError(f"strategy={name!r} needs backend={wanted}, got backend={backend!r}"
                     f"{': ' + note if note else ''}")


def load_strategy(registry: Dict[str, Entry], name: str) -> type:
    """The strategy class registered as ``name`` (imports its module)."""
    try:
        entry = registry[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; registered: {sorted(registry)}") from None
    return load(entry)
