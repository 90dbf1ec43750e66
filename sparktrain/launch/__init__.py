"""Launching training on Spark: barrier tasks (:mod:`.barrier`) and one file per engine.

Backends are looked up by name and imported only when used, so a missing framework fails with
an install hint, and adding a backend touches no estimator.
"""
from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any, Dict, Tuple

from sparktrain.plugins import load

# backend name -> ("module:Class", the framework module it needs)
TORCH_BACKENDS: Dict[str, Tuple[str, str]] = {
    "torch": ("sparktrain.launch.torch_ddp:TorchDDP", "torch"),
    "horovod": ("sparktrain.launch.horovod_torch:HorovodTorch", "horovod.torch"),
}

KERAS_BACKENDS: Dict[str, Tuple[str, str]] = {
    "tensorflow": ("sparktrain.launch.tf_multiworker:TensorFlowMultiWorker", "tensorflow"),
    # TFSparkNode, not just the package: it also needs six, TensorFlow and pkg_resources
    "tfos": ("sparktrain.launch.tfos:TensorFlowOnSpark", "tensorflowonspark.TFSparkNode"),
}

INSTALL_HINTS = {
    "tensorflow": "TensorFlow and Keras 3: pip install 'sparktrain[tf]' (or 'sparktrain[tf-cpu]' "
                  "where tensorflow-cpu is the TensorFlow you use)",
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
    lines in the user's process) and imports ``pkg_resources``, which warns that it is deprecated."""
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


def check_backend(registry: Dict[str, Tuple[str, str]], name: str) -> None:
    """Fail before launch, with an install hint, if ``name``'s framework does not import."""
    requirement = registry[name][1]
    try:
        import_quietly(requirement)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(requirement, f"pip install {requirement.split('.')[0]}")
        raise ValueError(f"backend={name!r} needs {requirement!r}, which does not import here "
                         f"({exc}). Install {hint}.") from None


def load_backend(registry: Dict[str, Tuple[str, str]], name: str) -> Any:
    """The backend class registered as ``name`` (imports its framework)."""
    return load(registry[name][0])
