"""Launching training on Spark: barrier tasks (:mod:`.barrier`) and one file per engine.

Engines (``backend=``) are classes behind one interface per framework
(:class:`~sparktrain.launch.engine.TorchEngine`, :class:`~sparktrain.launch.engine.KerasEngine`),
registered by name here, as the strategies are in :mod:`sparktrain.strategies`. Entries are
``"module:Class"`` strings imported only when used, each with the framework module it needs, so
a missing framework fails before launch with an install hint. The estimators and strategies ask
the engine class its capabilities and never compare engine names: adding an engine is one file
plus one registration, inside sparktrain or in your own code.

Example (see ``docs/engines-and-strategies.md``)::

    from sparktrain.launch import register_torch_backend
    from sparktrain.launch.torch_ddp import TorchDDP

    class LoggedDDP(TorchDDP):
        ...

    register_torch_backend("logged_ddp", LoggedDDP)
    TorchEstimator(..., backend="logged_ddp").fit(df)
"""
from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any, Dict, List, Tuple, Union

from sparktrain.launch.engine import KerasEngine, TorchEngine
from sparktrain.plugins import check_entry, load

Entry = Union[str, type]

# backend name -> (the engine: a class or its "module:Class", the framework module it needs)
TORCH_BACKENDS: Dict[str, Tuple[Entry, str]] = {
    "torch": ("sparktrain.launch.torch_ddp:TorchDDP", "torch"),
    "horovod": ("sparktrain.launch.horovod_torch:HorovodTorch", "horovod.torch"),
}

KERAS_BACKENDS: Dict[str, Tuple[Entry, str]] = {
    "tensorflow": ("sparktrain.launch.tf_multiworker:TensorFlowMultiWorker", "tensorflow"),
    # TFSparkNode, not just the package: it also needs six, TensorFlow and pkg_resources
    "tfos": ("sparktrain.launch.tfos:TensorFlowOnSpark", "tensorflowonspark.TFSparkNode"),
}

INSTALL_HINTS = {
    "tensorflow": "TensorFlow and Keras 3: pip install 'sparktrain[tf]' (or 'sparktrain[tf-cpu]' "
                  "where tensorflow-cpu is the TensorFlow you use; in a clone of sparktrain, "
                  "./scripts/setup.sh --keras)",
    "horovod.torch": "Horovod compiled for PyTorch with Gloo: in a clone of sparktrain run "
                     "./scripts/setup.sh --horovod (compiles it once, about 3 minutes on 2 "
                     "cores, then reuses the cached wheel), or HOROVOD_WITH_PYTORCH=1 "
                     "HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "
                     "pip install --no-build-isolation horovod==0.28.1 (after torch)",
    "torch": "PyTorch: pip install 'sparktrain[torch]'",
    "tensorflowonspark.TFSparkNode": "TensorFlowOnSpark 2.2.5 with six (needed, not declared) "
                                     "and setuptools<81: pip install 'sparktrain[tfos]'",
}


def import_quietly(name: str) -> Any:
    """Import ``name`` leaving the root logger as it was: tensorflowonspark runs
    ``logging.basicConfig(level=INFO)`` when imported (which would turn on every library's INFO
    lines in the user's process) and imports ``pkg_resources``, which warns that it is
    deprecated."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pkg_resources is deprecated")
            return importlib.import_module(name)
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def _register(registry: Dict[str, Tuple[Entry, str]], kind: str, base: type, name: str,
              engine: Entry, requires: str) -> None:
    check_entry(f"{kind} engine", name, engine, base)
    if not isinstance(requires, str) or not requires:
        raise ValueError(f"requires must name the module the engine needs (e.g. 'torch'), "
                         f"got {requires!r}")
    registry[name] = (engine, requires)


def register_torch_backend(name: str, engine: Entry, requires: str = "torch") -> None:
    """Make ``TorchEstimator(backend=name)`` train with ``engine``, a subclass of
    :class:`sparktrain.launch.engine.TorchEngine` (or its ``"module:Class"``); ``requires``:
    the module it needs, checked (with an install hint) before launch. Registered in this
    process: register before building (or loading) the estimator. The class reaches the
    executors with the training payload (by value when it is defined in your own code), so
    they need nothing registered."""
    _register(TORCH_BACKENDS, "torch", TorchEngine, name, engine, requires)


def register_keras_backend(name: str, engine: Entry, requires: str = "tensorflow") -> None:
    """Make ``KerasEstimator(backend=name)`` train with ``engine``, a subclass of
    :class:`sparktrain.launch.engine.KerasEngine` (or its ``"module:Class"``); its class
    reaches the barrier tasks pickled, as for torch."""
    _register(KERAS_BACKENDS, "keras", KerasEngine, name, engine, requires)


def check_backend(registry: Dict[str, Tuple[Entry, str]], name: str) -> None:
    """Fail before launch, with an install hint, if ``name``'s framework does not import."""
    requirement = registry[name][1]
    try:
        import_quietly(requirement)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(requirement, f"pip install {requirement.split('.')[0]}")
        raise ValueError(f"backend={name!r} needs {requirement!r}, which does not import here "
                         f"({exc}). Install {hint}.") from None


def load_backend(registry: Dict[str, Tuple[Entry, str]], name: str) -> Any:
    """The engine class registered as ``name`` (imports its module)."""
    try:
        entry = registry[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(registry)}") from None
    return load(entry[0])


def backends_with(registry: Dict[str, Tuple[Entry, str]], *capabilities: str) -> List[str]:
    """The registered engines (names) that have all of ``capabilities`` (class attributes
    that are true); those whose module does not import here are left out. For messages::

        backends_with(TORCH_BACKENDS, "torch_distributed")   # ["torch"]
    """
    found = []
    for name in registry:
        try:
            engine = load_backend(registry, name)
        except ImportError:
            continue
        if all(getattr(engine, c, False) for c in capabilities):
            found.append(name)
    return found
