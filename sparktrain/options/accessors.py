"""``getX``/``setX`` accessors generated from Param declarations, Horovod's spellings included.

Example::

    @with_accessors
    class MyParams(Params):
        num_proc = Param(Params._dummy(), "num_proc", "processes", TypeConverters.toInt)

    MyParams().setNumProc(4).getNumProc()    # 4
"""
from __future__ import annotations

from typing import Any, Callable, Type

from pyspark.ml.param import Param, Params

# Horovod's accessor names where they are not get/set + the param's name in CamelCase
# (horovod/spark/common/params.py, 0.28.1); both spellings exist here.
HOROVOD_ACCESSOR_NAMES = {"shuffle_buffer_size": "ShufflingBufferSize",
                          "train_reader_num_workers": "TrainReaderNumWorker",
                          "val_reader_num_workers": "ValReaderNumWorker",
                          "inmemory_cache_all": "InMemoryCacheAll"}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _getter(name: str, doc: str) -> Callable:
    def get(self: Params) -> Any:
        return self.getOrDefault(name)
    get.__doc__ = f"The value of ``{name}``: {doc}."
    return get


def _setter(name: str, doc: str) -> Callable:
    def set_(self: Params, value: Any) -> Params:
        return self._set(**{name: value})
    set_.__doc__ = f"Set ``{name}`` ({doc}); returns this object."
    return set_


def with_accessors(cls: Type[Params]) -> Type[Params]:
    """Add ``getX``/``setX`` for every Param declared on ``cls`` that has no hand-written one
    (``X``: the param's name in CamelCase, plus Horovod's spelling where it differs).

    Example: ``EstimatorParams.num_proc`` gives ``getNumProc()`` and ``setNumProc(4)``.
    """
    for param in [v for v in vars(cls).values() if isinstance(v, Param)]:
        for suffix in dict.fromkeys([_camel(param.name),
                                     HOROVOD_ACCESSOR_NAMES.get(param.name, "")]):
            for prefix, make in (("get", _getter), ("set", _setter)):
                method = f"{prefix}{suffix}"
                if suffix and not hasattr(cls, method):
                    function = make(param.name, param.doc)
                    function.__name__ = method
                    function.__qualname__ = f"{cls.__name__}.{method}"
                    setattr(cls, method, function)
    return cls
