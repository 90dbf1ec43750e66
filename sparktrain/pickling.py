"""cloudpickle that ships the user's own code with the objects that use it.

cloudpickle pickles classes and functions from importable modules *by reference*: executors
(and whoever loads a saved model later) must be able to import the same module. A model class
defined in the user's script, notebook helper file or test module usually is not importable
there. ``dumps`` therefore pickles *by value* every module that the objects' classes and
functions come from, unless it is installed or part of Python itself. Installed means in a
``site-packages`` or ``dist-packages`` folder, wherever it is: the interpreter's own, a user
site (``pip install --user``), Debian's ``dist-packages``, or one added to ``sys.path`` later
(Databricks' notebook-scoped libraries, ``%pip install``). Libraries there must not travel by
value: transformers' classes, for one, cannot be pickled that way.

Code pickled by value keeps its source file's name: cloudpickle >= 3.1.2 writes
``<dynamic-code>`` instead (for byte-identical payloads, cloudpipe/cloudpickle#558), which
turns every frame of the user's code in a rank's or decode worker's traceback into
``File "<dynamic-code>", line 12`` with no source line. With the real name, Python's traceback
shows the line wherever the file exists (local and shared-filesystem clusters) and at least
names it elsewhere.

Example::

    blob = dumps((model, optimizer))   # MyNet from ./my_models.py travels with the blob
"""
from __future__ import annotations

import inspect
import io
import os
import sys
import sysconfig
from collections import ChainMap
from types import CodeType, FunctionType, ModuleType
from typing import Any, Callable, Iterable, Optional, Set

import cloudpickle

_PYTHON = tuple(os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in
                ("stdlib", "platstdlib", "purelib", "platlib"))
_PACKAGE_FOLDERS = {"site-packages", "dist-packages"}
_OWN = ("sparktrain", "torch", "pyspark", "tensorflow", "keras", "tf_keras", "horovod", "numpy")


def _is_installed(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith(_PYTHON) or not _PACKAGE_FOLDERS.isdisjoint(real.split(os.sep)[:-1])


def _is_user_module(module: ModuleType) -> bool:
    name = module.__name__
    path = getattr(module, "__file__", None)
    if name == "__main__" or not path or name.split(".")[0] in _OWN:
        return False  # __main__ is pickled by value by cloudpickle already
    return not _is_installed(path)


def _code_objects(obj: Any) -> Iterable[Any]:
    """Classes and functions reachable from ``obj`` whose modules matter for unpickling."""
    seen: Set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (FunctionType, type)):
            yield item
        elif item is not None and not isinstance(item, (str, bytes, int, float, bool)):
            yield type(item)
            if hasattr(item, "modules") and callable(item.modules):  # torch.nn.Module tree
                stack.extend(type(m) for m in item.modules())
            elif hasattr(item, "__dict__") and not inspect.ismodule(item):
                if type(item).__module__.startswith("sparktrain."):
                    stack.extend(vars(item).values())  # sparktrain's wrappers of user objects
                else:
                    stack.extend(v for v in vars(item).values()
                                 if isinstance(v, (FunctionType, type)))


_DYNAMIC = "<dynamic-code>"


def _code_reduce_keeping_file(code: CodeType) -> Any:
    """cloudpickle's code reducer, with the code's real ``co_filename`` put back."""
    rebuild, args = cloudpickle.Pickler.dispatch_table[CodeType](code)
    if code.co_filename != _DYNAMIC:
        args = tuple(code.co_filename if isinstance(a, str) and a == _DYNAMIC else a
                     for a in args)
    return rebuild, args


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({CodeType: _code_reduce_keeping_file},
                              cloudpickle.Pickler.dispatch_table)


class _ReferencingPickler(_Pickler):
    """Pickles the objects ``refer`` names (returns not ``None`` for) as persistent ids."""

    def __init__(self, out: Any, refer: Callable[[Any], Any]) -> None:
        super().__init__(out)
        self._refer = refer

    def persistent_id(self, obj: Any) -> Any:  # noqa: D102 - pickle's hook
        return self._refer(obj)


def dumps_code(obj: Any, refer: Optional[Callable[[Any], Any]] = None) -> bytes:
    """``cloudpickle.dumps(obj)`` keeping the source file names of code pickled by value;
    with ``refer``, the objects it returns an id for are written as that id (pickle's
    ``persistent_id``: e.g. tensors stored in another file), read back by
    ``pickle.Unpickler.persistent_load``.

    Example::

        fn_bytes = dumps_code(transformation_fn)   # a worker's traceback names its file
    """
    with io.BytesIO() as out:
        (_Pickler(out) if refer is None else _ReferencingPickler(out, refer)).dump(obj)
        return out.getvalue()


def dumps(obj: Any, refer: Optional[Callable[[Any], Any]] = None) -> bytes:
    """``cloudpickle.dumps(obj)``, with the user's own modules pickled by value (and their
    code's file names kept, see the module docstring); ``refer`` as in :func:`dumps_code`."""
    modules = {sys.modules.get(getattr(c, "__module__", None) or "") for c in _code_objects(obj)}
    registered = [m for m in modules if m is not None and _is_user_module(m)]
    for module in registered:
        cloudpickle.register_pickle_by_value(module)
    try:
        return dumps_code(obj, refer)
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)
