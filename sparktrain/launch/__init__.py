"""Launching training on Spark: barrier tasks (:mod:`.barrier`) and one file per engine.

Backends are looked up by name and imported only when used, so a missing framework fails with
an install hint, and adding a backend touches no estimator.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# backend name -> ("module:Class", the framework module it needs)
TORCH_BACKENDS: Dict[str, Tuple[str, str]] = {
    "torch": ("sparktrain.launch.torch_ddp:TorchDDP", "torch"),
    "horovod": ("sparktrain.launch.horovod_torch:HorovodTorch", "horovod.torch"),
}

KERAS_BACKENDS: Dict[str, Tuple[str, str]] = {
    "tensorflow": ("sparktrain.launch.tf_multiworker:TensorFlowMultiWorker", "tensorflow"),
}

INSTALL_HINTS = {
    "tensorflow": "TensorFlow and Keras 3: pip install 'sparktrain[tf]'",
    "horovod.torch": "Horovod compiled for PyTorch with Gloo: run ./scripts/setup.sh, or "
                     "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "
                     "pip install --no-build-isolation horovod==0.28.1 (after torch)",
    "torch": "PyTorch: pip install 'sparktrain[torch]'",
}


def check_backend(registry: Dict[str, Tuple[str, str]], name: str) -> None:
    """Fail before launch, with an install hint, if ``name``'s framework does not import."""
    requirement = registry[name][1]
    try:
        importlib.import_module(requirement)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(requirement, f"pip install {requirement.split('.')[0]}")
        raise ValueError(f"backend={name!r} needs {requirement!r}, which does not import here "
                         f"({exc}). Install {hint}.") from None


def load_backend(registry: Dict[str, Tuple[str, str]], name: str) -> Any:
    """The backend class registered as ``name`` (imports its framework)."""
    target, _ = registry[name]
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)
