"""What every fitted sparktrain model shares, whatever the framework.

``transform`` appends prediction columns with an iterator ``pandas_udf``
(:func:`~sparktrain.estimators.prediction.prediction_udf`): the model is deserialized once per
Python worker and predicts whole Arrow batches, never row by row. Subclasses add the framework:
``_predict_fn_factory`` and their saved files.

Example::

    class TorchModel(ModelBase, TorchModelParams):
        def _predict_fn_factory(self, portable=False): ...
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import cloudpickle
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparktrain.data.columns import ARRAY, RAW_KINDS, VARLEN, VECTOR, ColumnSpec
from sparktrain.data.schema import column_spec
from sparktrain.estimators.persistence import ModelReader, ModelWriter
from sparktrain.estimators.prediction import (
    feature_expr,
    prediction_udf,
    series_to_numpy,
    with_profile,
)
from sparktrain.model_files import ModelFile
from sparktrain.options.params import ModelParams
from sparktrain.pickling import dumps
from sparktrain.session.interrupts import guard_predictions
from sparktrain.session.spark_api import is_remote

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


def _family(kind: str) -> str:
    """Kinds that can stand in for each other at prediction (a vector for an array...)."""
    return {VECTOR: "numbers", ARRAY: "numbers", VARLEN: "numbers"}.get(kind, kind)


class ModelBase(Model, ModelParams, MLWritable, MLReadable):
    """A fitted model: framework object + history + the column specs it was trained on."""

    def __init__(self) -> None:
        super().__init__()
        self._history: Dict[str, List[float]] = {}
        self._columns: List[ColumnSpec] = []
        self._output_shapes: List[List[int]] = []

    # -- framework hooks ------------------------------------------------------------------------
    def _predict_fn_factory(self, portable: bool = False
                            ) -> Callable[[], Callable[[List[Any]], List[Any]]]:
        """A picklable zero-argument function returning ``predict(list of numpy features) ->
        list of numpy outputs``; called once per Python worker. It references the weights by
        file where it can; ``portable``: it holds them (for a copy that outlives the store)."""
        raise NotImplementedError

    def _framework_files(self) -> Dict[str, Any]:
        """The files a save writes under ``model/``: bytes, or a :class:`ModelFile` (weights
        already in the store, streamed into the saved directory)."""
        raise NotImplementedError

    @classmethod
    def _from_framework_files(cls, files: Dict[str, ModelFile]) -> "ModelBase":
        """A model from its saved files (references: read only what is needed, when needed)."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------------------------
    def getHistory(self) -> Dict[str, List[float]]:
        """Per-epoch metrics: ``{"loss": [...], "val_loss": [...], "<metric>": [...], ...}``."""
        return {k: list(v) for k, v in self._history.items()}

    def setHistory(self, value: Any) -> "ModelBase":
        """Set the history: a dict of per-epoch lists, or (Horovod's form) a list with one dict
        of numbers per epoch."""
        if isinstance(value, (list, tuple)):
            if not all(isinstance(epoch, dict) for epoch in value):
                raise TypeError("history must be a dict of per-epoch lists or a list of "
                                "per-epoch dicts")
            keys = dict.fromkeys(k for epoch in value for k in epoch)
            value = {k: [epoch.get(k) for epoch in value] for k in keys}
        if not isinstance(value, dict):
            raise TypeError(f"history must be a dict of per-epoch lists, got "
                            f"{type(value).__name__}")
        self._history = {k: list(v) for k, v in value.items()}
        return self

    def plot_history(self, metrics: Optional[Sequence[str]] = None) -> Figure:
        """A matplotlib Figure with one panel per metric (training and validation curves).

        Example: ``model.plot_history()`` in a notebook, or ``.savefig("history.png")``.
        """
        from matplotlib import pyplot as plt  # headless machines fall back to Agg by themselves

        history = self.getHistory()
        names = list(metrics) if metrics else [k for k in history if not k.startswith("val_")]
        missing = [n for n in names if n not in history]
        if not names or missing:
            raise ValueError(f"no history for {missing or names}; recorded: {sorted(history)}")
        fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            for key, label in ((name, "train"), (f"val_{name}", "validation")):
                if key in history:
                    values = history[key]
                    ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
            ax.set_title(name)
            ax.set_xlabel("epoch")
            ax.legend()
        fig.tight_layout()
        plt.close(fig)  # returned, not shown twice by pyplot's state machine
        return fig

    def _output_type(self, shape: Sequence[int]) -> T.DataType:
        size = 1
        for dim in shape:
            size *= dim
        return T.DoubleType() if size == 1 else T.ArrayType(T.DoubleType(), containsNull=False)

    def _complete(self, dataset: DataFrame) -> None:
        """A model built by hand (Horovod's ``TorchModel(model=net, feature_columns=[...],
        label_columns=[...])``) takes its input columns from ``dataset`` and its output shapes
        from one prediction of a zero row on the driver."""
        import numpy as np

        if not self.isDefined(self.feature_cols):
            raise ValueError(f"{type(self).__name__} has no feature columns; pass "
                             f"feature_columns=[...] or call setFeatureCols")
        if not self._columns:
            self._columns = [column_spec(dataset, c, "feature") for c in self.getFeatureCols()]
        if not self._output_shapes:
            if any(not spec.size for spec in self._columns):
                # pyspark's annotation of toPandas does not resolve under mypy
                row: pd.DataFrame = dataset.select(
                    *[feature_expr(s) for s in self._columns]).limit(1).toPandas()
                if row.empty:
                    raise ValueError("cannot tell the feature columns' sizes from an empty "
                                     "DataFrame")
                self._columns = [ColumnSpec(s.name, s.kind, s.dtype, s.size or
                                            series_to_numpy(row.iloc[:, i], s).shape[1])
                                 for i, s in enumerate(self._columns)]
            if any(s.kind in RAW_KINDS for s in self._columns):
                raise ValueError(f"{type(self).__name__} built by hand cannot tell its output "
                                 f"shapes from raw feature columns; fit it with an estimator")
            zeros = [np.zeros((1,) + (s.row_shape or (1,)), dtype=s.dtype)
                     for s in self._columns]
            outputs = self._predict_fn_factory()()(zeros)
            self._output_shapes = [list(o.shape[1:]) for o in outputs]

    def _transform(self, dataset: DataFrame) -> DataFrame:
        if is_remote(dataset.sparkSession):  # a Ctrl-C during the prediction is never lost
            guard_predictions()
        self._complete(dataset)
        specs = self._input_specs()
        for trained in specs:
            role = "feature" if trained.name in self.getFeatureCols() else \
                "input (read by transformation_fn to make the features)"
            found = column_spec(dataset, trained.name, role)
            if _family(found.kind) != _family(trained.kind):
                raise ValueError(f"{role} column {trained.name!r} is a {found.kind} here but "
                                 f"was a {trained.kind} in training")
        outputs = self.getOutputCols()
        if len(outputs) != len(self._output_shapes):
            raise ValueError(f"output_cols has {len(outputs)} names but the model has "
                             f"{len(self._output_shapes)} outputs")
        clash = sorted(set(outputs) & set(dataset.columns))
        if clash:
            raise ValueError(f"output columns {clash} already exist in the DataFrame; choose "
                             f"others with setOutputCols")
        types = [self._output_type(shape) for shape in self._output_shapes]
        factory = self._predict_fn_factory()
        # A worker keeps a predictor per key: keyed by what the factory holds (weights,
        # use_gpu, shapes), it never outlives setModel, setUseGpu or weights changed in place.
        key = hashlib.sha1(cloudpickle.dumps(factory)).hexdigest()
        transform = self.getPredictTransformationFn()
        # pickled by sparktrain (the user's modules by value, as the model's code): Spark's own
        # pickling of the UDF would send a function from an importable user module by
        # reference, and the executors cannot import it
        udf = prediction_udf(key, factory, specs, types, self.getBatchSize(),
                              dumps(transform) if transform is not None else None,
                              self.getFeatureCols())
        prediction = udf(*[feature_expr(s) for s in specs])
        if len(outputs) == 1:
            return with_profile(dataset.withColumn(outputs[0], prediction),
                                 self.getOrDefault("resource_profile"))
        tmp = f"__sparktrain_{self.uid}"
        result = dataset.withColumn(tmp, prediction)
        for i, name in enumerate(outputs):
            result = result.withColumn(name, F.col(f"`{tmp}`.`_{i}`"))
        return with_profile(result.drop(tmp), self.getOrDefault("resource_profile"))

    def _input_specs(self) -> List[ColumnSpec]:
        """The DataFrame columns ``transform`` reads: the feature columns in their order, then
        the ones ``transformation_fn`` reads to make features it creates."""
        features = self.getFeatureCols()
        first = {c.name: c for c in self._columns if c.name in features}
        return [first[name] for name in features if name in first] + \
            [c for c in self._columns if c.name not in first]

    # -- persistence ----------------------------------------------------------------------------
    def _extra_metadata(self, framework_files: List[str]) -> Dict[str, Any]:
        return {"history": self._history, "columns": [c.to_json() for c in self._columns],
                "output_shapes": self._output_shapes,
                "framework_files": framework_files,
                "predict_transformation_fn": self.getPredictTransformationFn() is not None}

    @classmethod
    def _from_saved(cls, metadata: Dict[str, Any], files: Dict[str, ModelFile]) -> "ModelBase":
        model = cls._from_framework_files(files)
        model._history = metadata["history"]
        model._columns = [ColumnSpec.from_json(c) for c in metadata["columns"]]
        model._output_shapes = metadata["output_shapes"]
        return model

    def write(self) -> ModelWriter:
        return ModelWriter(self)

    @classmethod
    def read(cls) -> ModelReader:
        return ModelReader(cls)
