"""Forked children that do not hang on the HDFS clients of their parent.

hdfs-native's client (the ``hdfs://`` filesystem of fsspec where it is installed) runs a tokio
runtime on threads of its own. A child made by ``fork()`` has none of those threads, and fsspec
empties its filesystem cache in every forked child (``os.register_at_fork(after_in_child=...)``
in ``fsspec.spec``): the child drops the parent's clients, and dropping a runtime waits for its
threads to stop, for ever (tokio-rs/tokio#4301; apache/paimon-rust#832 keeps the inherited
runtime allocated for the same reason). Every fork that runs Python in the child hangs before
it does anything: ``subprocess.Popen(preexec_fn=...)`` (pyspark starts its JVM so, when a
notebook makes a second session), ``os.fork``, a DataLoader worker started by ``fork``.

So, once :func:`install` ran (sparktrain's first filesystem does: ``sparktrain.fs.filesystem``),
each live hdfs-native filesystem is held before a fork and, in the child, held for ever: it is
never dropped there, not even when the child's interpreter exits. It stays unusable in the
child (its runtime has no threads), as a forked copy of any threaded client is; the parent is
untouched.

Example::

    import subprocess
    from sparktrain.fs import filesystem
    fs, path = filesystem("hdfs://namenode:8020/user/me")   # installs the hooks
    fs.ls(path)
    subprocess.run(["true"], preexec_fn=lambda: None)   # returns (without this: never)
"""
from __future__ import annotations

import os
import sys
from typing import Any, List

#: the module whose filesystems run a runtime on threads of their own
_NATIVE_MODULES = ("hdfs_native.fsspec",)
_held: List[Any] = []
_installed = False


def _live_native_filesystems() -> List[Any]:
    found: List[Any] = []
    for name in _NATIVE_MODULES:
        module = sys.modules.get(name)  # never import anything around a fork
        for cls in vars(module).values() if module is not None else ():
            cache = getattr(cls, "_cache", None) if isinstance(cls, type) else None
            if isinstance(cache, dict) and cls.__module__ == name:
                found.extend(cache.values())
    return found


def _hold() -> None:
    """Before a fork, in the parent: hold every live native filesystem (once each)."""
    live = _live_native_filesystems()
    if live:
        import ctypes  # noqa: F401 - here, in the parent: the child only looks it up

        known = {id(fs) for fs in _held}
        _held.extend(fs for fs in live if id(fs) not in known)


def _never_drop() -> None:
    """In the child: one reference more that nothing gives back, so no drop ever runs."""
    if _held:
        ctypes = sys.modules["ctypes"]  # imported by _hold before the fork
        for fs in _held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(fs))


def install() -> None:
    """Register the fork hooks (once per process; a no-op where ``os.register_at_fork`` is
    missing)."""
    global _installed
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_hold, after_in_child=_never_drop)
        _installed = True
