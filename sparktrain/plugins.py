"""Plug-ins named by ``"module:attr"`` strings, imported only when first used.

Registries (engines in :mod:`sparktrain.launch`, strategies in :mod:`sparktrain.strategies`,
fit hooks in :mod:`sparktrain.fit_hooks`) name their entries this way so that a registry never
imports a framework or a higher layer: the import happens here, at the moment of use.

Example::

    load("sparktrain.strategies.torch_ddp:DataParallel")   # the class (module imported now)
    load(MyStrategy)                                       # a registered object, as it is
"""
from __future__ import annotations

import importlib
from typing import Any


def load(entry: Any) -> Any:
    """The object a ``"module:attr"`` string names, or ``entry`` itself when it is no string."""
    if not isinstance(entry, str):
        return entry
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr)
