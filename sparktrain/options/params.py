"""Spark ML Params of sparktrain's estimators and models, made from the option declarations.

:func:`params_class` turns a table of :class:`~sparktrain.options.declarations.Option` into a
``Params`` class: one ``Param`` per option (its doc and converter), the defaults, and
``getX``/``setX`` accessors (``X``: the name in CamelCase, plus Horovod's spelling where it
differs, e.g. ``getShufflingBufferSize``). The classes below add only the accessors that do
more than read or write a value.

Example::

    est = TorchEstimator(num_proc=2, input_shapes=[[-1, 1, 8, 8]], ...)
    est.setEpochs(5).getInputShapes()     # [[-1, 1, 8, 8]]
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Type, TypeVar

from pyspark.ml.param import Param, Params

from sparktrain.options.declarations import COMMON, KERAS, MODEL, TORCH, TORCH_MODEL, UNSET, Option

#: Params whose values are Python objects (modules, optimizers, callables): pickled with
#: cloudpickle on save, never written into the JSON metadata
OBJECT_PARAMS = frozenset(o.name for group in (COMMON, TORCH, KERAS, MODEL) for o in group
                          if o.python_object)

P = TypeVar("P", bound=Params)


def camel(name: str) -> str:
    """``batch_size`` -> ``BatchSize``."""
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


def add_accessors(cls: Type[Params], options: Sequence[Option]) -> None:
    """``getX``/``setX`` on ``cls`` for each of ``options`` that has none yet."""
    for option in options:
        for suffix in dict.fromkeys([camel(option.name), option.horovod_accessor]):
            for prefix, make in (("get", _getter), ("set", _setter)):
                method = f"{prefix}{suffix}"
                if suffix and not hasattr(cls, method):
                    function = make(option.name, option.doc)
                    function.__name__ = method
                    function.__qualname__ = f"{cls.__name__}.{method}"
                    setattr(cls, method, function)


class CheckedParams(Params):
    """``Params`` whose converters judge ``None`` too where they say so (``checks_none``, as
    :func:`~sparktrain.options.converters.to_count` of a required count does): pyspark's
    ``_set`` skips the converter for ``None``.

    Example::

        TorchEstimator().setNumProc(None)   # TypeError: num_proc must be an integer >= 1, got None
    """

    def _set(self: P, **kwargs: Any) -> P:
        for name, value in kwargs.items():
            convert = getattr(self, name).typeConverter
            if value is None and getattr(convert, "checks_none", False):
                convert(value)  # raises, naming the option
        return super()._set(**kwargs)


def params_class(name: str, options: Sequence[Option], doc: str) -> Type[Params]:
    """A ``Params`` subclass with a ``Param``, a default and accessors per option."""
    defaults = {o.name: o.default for o in options if o.default is not UNSET}

    def __init__(self: Params) -> None:
        super(cls, self).__init__()
        # a copy per instance: a default list or dict is never shared between estimators
        self._setDefault(**copy.deepcopy(defaults))

    namespace: Dict[str, Any] = {o.name: Param(Params._dummy(), o.name, o.doc, o.convert)
                                 for o in options}
    cls: Type[Params] = type(name, (CheckedParams,), dict(namespace, __init__=__init__,
                                                          __doc__=doc, __module__=__name__))
    add_accessors(cls, options)
    return cls


if TYPE_CHECKING:
    # A type checker cannot see inside the classes params_class makes at run time: it sees
    # each as a CheckedParams whose other attributes (the generated getX/setX accessors and
    # Params) are Any.
    class _Generated(CheckedParams):
        def __getattr__(self, name: str) -> Any: ...

    class _EstimatorOptions(_Generated): ...
    class _ModelOptions(_Generated): ...
    class TorchParams(_Generated): ...
    class KerasParams(_Generated): ...
    class TorchModelParams(_Generated): ...
else:
    _EstimatorOptions = params_class("_EstimatorOptions", COMMON, "The options in COMMON.")
    _ModelOptions = params_class("_ModelOptions", MODEL, "The options in MODEL.")
    TorchParams = params_class("TorchParams", TORCH, "The options only ``TorchEstimator`` has.")
    KerasParams = params_class("KerasParams", KERAS, "The options only ``KerasEstimator`` has.")
    TorchModelParams = params_class("TorchModelParams", TORCH_MODEL,
                                    "The options a ``TorchModel`` adds to every model's.")


class EstimatorParams(_EstimatorOptions):
    """Params of a training estimator (Horovod's set plus sparktrain's own)."""

    def getValBatchSize(self) -> int:
        """``val_batch_size``, or ``batch_size`` where it is not set."""
        return self.getOrDefault("val_batch_size") or self.getOrDefault("batch_size")

    def getMinNumProc(self) -> int:
        """``min_num_proc``, or ``num_proc`` where it is not set."""
        value = self.getOrDefault("min_num_proc")
        return self.getOrDefault("num_proc") if value is None else value

    def getBackendEnv(self) -> Dict[str, str]:
        return dict(self.getOrDefault("backend_env") or {})


class ModelParams(_ModelOptions):
    """Params of a fitted model: which columns go in and which prediction columns come out."""

    def getOutputCols(self) -> List[str]:
        cols = self.getOrDefault("output_cols")
        return list(cols) if cols else [f"{label}__output" for label in self.getLabelCols()]

    # Horovod's ModelParams names (horovod.spark.common.params, 0.28.1), ``setLabelColoumns``
    # spelled as there too.
    def getFeatureColumns(self) -> List[str]:
        return self.getFeatureCols()

    def setFeatureColumns(self, value: List[str]) -> "ModelParams":
        return self.setFeatureCols(value)

    def getLabelColumns(self) -> List[str]:
        return self.getLabelCols()

    def setLabelColumns(self, value: List[str]) -> "ModelParams":
        return self._set(label_cols=value)

    setLabelColoumns = setLabelColumns

    def setParams(self, **kwargs: Any) -> "ModelParams":
        """Set params by keyword (Horovod's ``feature_columns``/``label_columns`` too)."""
        aliases = {"feature_columns": "feature_cols", "label_columns": "label_cols"}
        return self._set(**{aliases.get(k, k): v for k, v in kwargs.items()})


def json_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` that belong in JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}


def object_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` holding Python objects (pickled on save)."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name in OBJECT_PARAMS}
