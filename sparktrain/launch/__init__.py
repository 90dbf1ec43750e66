"""Launching training on Spark: barrier tasks (:mod:`.barrier`) and one file per engine.

Backends are looked up by name and imported only when used, so a missing framework fails with
an install hint, and adding a backend touches no estimator.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# backend name -> ("module:Class", pip requirement that provides it)
TORCH_BACKENDS: Dict[str, Tuple[str, str]] = {
    "torch": ("sparktrain.launch.torch_ddp:TorchDDP", "torch"),
}


def load_backend(registry: Dict[str, Tuple[str, str]], name: str) -> Any:
    """The backend class registered as ``name`` (imports its framework)."""
    target, _ = registry[name]
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)
