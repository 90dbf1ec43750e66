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
from typing import Any, Optional


def load(entry: Any) -> Any:
    """The object a ``"module:attr"`` string names, or ``entry`` itself when it is no string."""
    if not isinstance(entry, str):
        return entry
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr)


def check_entry(kind: str, name: Any, entry: Any, base: Optional[type] = None) -> None:
    """Refuse a registration before it is stored: ``name`` a non-empty string, ``entry`` a class
    (a subclass of ``base`` when given) or its ``"module:Class"`` string. ``kind`` names the
    registry in the errors ("torch engine", "keras strategy")."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind}'s name must be a non-empty string, got {name!r}")
    if not isinstance(entry, (str, type)):
        raise TypeError(f"register a {kind} as a class or a 'module:Class' string, "
                        f"got {type(entry).__name__}")
    if base is not None and isinstance(entry, type) and not issubclass(entry, base):
        raise TypeError(f"a {kind} must subclass {base.__module__}.{base.__name__}, "
                        f"got {entry.__name__}")
