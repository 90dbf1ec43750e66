"""Prediction's shared steps: feature columns as Arrow hands them to a UDF -> the numpy form
training fed the model -> the model's outputs -> prediction columns. Used by ``transform``'s
UDF (:func:`prediction_udf`) and the MLflow pyfunc (:mod:`sparktrain.mlflow.models`).

Example::

    outputs = predict_columns(predict, [frame["features"]], specs, None, 256, 1)
    output_series(outputs, [True], len(frame))   # [pd.Series of floats]
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pandas as pd
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparktrain.data.batch import arrow_to_numpy, model_ready, values_to_numpy
from sparktrain.data.columns import ARRAY, SCALAR, VECTOR, ColumnSpec
from sparktrain.data.prepare import stored_value

if TYPE_CHECKING:
    import numpy as np


def feature_expr(spec: ColumnSpec) -> Column:
    """A feature column in the form the prediction UDF reads (what training read)."""
    return stored_value(spec)


def series_values(series: Any, spec: ColumnSpec) -> np.ndarray:
    """A pandas feature column from Arrow in the numpy form a ``transformation_fn`` gets in
    training (:mod:`sparktrain.data.batch`); struct columns (images) arrive as DataFrames."""
    if isinstance(series, pd.DataFrame):
        return values_to_numpy(series.to_dict("records"), spec)
    if spec.kind == SCALAR:
        return series.to_numpy(dtype=spec.dtype)
    return values_to_numpy(list(series.to_numpy()), spec)


def as_model_input(value: np.ndarray) -> np.ndarray:
    """Scalar columns as ``(rows, 1)``, the shape training fed the model."""
    return value.reshape(-1, 1) if value.ndim == 1 else value


def series_to_numpy(series: pd.Series, spec: ColumnSpec) -> np.ndarray:
    """A pandas numeric feature column from Arrow as training fed it to the model (scalars as
    ``(rows, 1)``)."""
    return as_model_input(series_values(series, spec))


def predict_columns(predict: Callable[[List[Any]], List[Any]], columns: Sequence[Any],
                    specs: Sequence[ColumnSpec], transform: Optional[Callable],
                    batch_size: int, n_outputs: int,
                    feature_names: Optional[Sequence[str]] = None) -> List[Any]:
    """The model's outputs for pandas input ``columns`` (one per spec, as Arrow hands them to a
    pandas UDF): :func:`predict_batch` of their numpy forms. Used by the MLflow pyfunc
    (:mod:`sparktrain.mlflow.models`) and by ``transform`` where Spark has no Arrow UDFs."""
    batch = {spec.name: series_values(s, spec) for s, spec in zip(columns, specs, strict=True)}
    return predict_batch(predict, batch, specs, transform, batch_size, n_outputs, feature_names)


def arrow_values(array: Any, spec: ColumnSpec) -> np.ndarray:
    """An Arrow feature column in the numpy form training fed it (no pandas in between)."""
    if spec.kind in (VECTOR, ARRAY) and not (spec.shape or spec.size):
        # a model built by hand, its sizes unknown: the values tell (as series_values does)
        return values_to_numpy(array.to_pylist(), spec)
    values = arrow_to_numpy(array, spec)
    if spec.kind in (SCALAR, VECTOR, ARRAY) and values.dtype != spec.dtype:
        return values.astype(spec.dtype)
    return values


def predict_batch(predict: Callable[[List[Any]], List[Any]], batch: Dict[str, Any],
                  specs: Sequence[ColumnSpec], transform: Optional[Callable],
                  batch_size: int, n_outputs: int,
                  feature_names: Optional[Sequence[str]] = None) -> List[Any]:
    """The model's outputs (numpy, one row per input row) for ``batch`` (numpy columns by
    name): ``transform`` first (the model's ``predict_transformation_fn``), then ``predict`` on
    the ``feature_names`` columns (default: the specs' names) in slices of ``batch_size``
    rows."""
    import numpy as np

    names = list(feature_names) if feature_names else [spec.name for spec in specs]
    rows = len(next(iter(batch.values())))
    if transform is not None:  # decoding, as in training (vectorized per Arrow batch)
        batch = transform(batch)
    batch = model_ready(batch, names, transform is not None)
    features = [as_model_input(batch[name]) for name in names]
    parts: List[List[Any]] = []
    for start in range(0, max(rows, 1), batch_size):
        parts.append(predict([f[start:start + batch_size] for f in features]))
    return [np.concatenate([p[i] for p in parts]) if rows else np.zeros(0)
            for i in range(n_outputs)]


def output_series(outputs: Sequence[Any], scalar_out: Sequence[bool],
                  rows: int) -> List[pd.Series]:
    """The prediction columns' values: a float per row for a one-number output, else a flat
    list of floats per row (``array<double>``)."""
    return [pd.Series(o.reshape(rows).astype("float64")) if scalar
            else pd.Series(list(o.reshape(rows, -1).astype("float64")))
            for o, scalar in zip(outputs, scalar_out, strict=True)]


def _list_of_doubles() -> Any:
    import pyarrow as pa

    return pa.list_(pa.field("element", pa.float64(), nullable=False))  # array<double> not null


def output_arrays(outputs: Sequence[Any], scalar_out: Sequence[bool], rows: int) -> Any:
    """The prediction column's Arrow values: ``double`` for a one-number output, else
    ``array<double>`` built from the flat values (no Python object per row); several outputs
    as a struct of ``_0``, ``_1``, ..."""
    import numpy as np
    import pyarrow as pa

    arrays = []
    for output, scalar in zip(outputs, scalar_out, strict=True):
        values = np.ascontiguousarray(output, dtype=np.float64).reshape(rows, -1)
        if scalar:
            arrays.append(pa.array(values.reshape(rows)))
            continue
        width = values.shape[1]
        offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
        arrays.append(pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)),
                                               type=_list_of_doubles()))
    if len(arrays) == 1:
        return arrays[0]
    return pa.StructArray.from_arrays(arrays, names=[f"_{i}" for i in range(len(arrays))])


def _pass_batches(batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow``'s identity: Arrow record batches through unchanged."""
    yield from batches


def with_profile(result: DataFrame, profile: Any) -> DataFrame:
    """``result`` run in a stage with ``profile`` (stage-level scheduling), or as it is.

    A DataFrame carries a ResourceProfile only through ``mapInPandas``/``mapInArrow(...,
    profile=)`` (pyspark >= 4.0, SPARK-46812); the prediction UDF is a column expression, so an
    identity ``mapInArrow`` on top takes the profile. There is no shuffle between the two, so
    they share one stage, and Spark runs a stage with the profile of its RDDs (the DAGScheduler
    merges a stage's profiles, core/.../DAGScheduler.scala ``mergeResourceProfilesForStage``):
    the UDF's tasks get the profile's GPUs in ``TaskContext.resources()``. The cost is one more
    Arrow round trip of the rows through Python.
    """
    if profile is None:
        return result
    check_profiles(result)
    return result.mapInArrow(_pass_batches, result.schema, profile=profile)


def takes_profiles(df: DataFrame) -> bool:
    """Whether this pyspark attaches a ResourceProfile to a DataFrame stage
    (``mapInArrow(..., profile=)``: pyspark >= 4.0, classic and Connect)."""
    import inspect

    return "profile" in inspect.signature(df.mapInArrow).parameters


def check_profiles(df: DataFrame) -> None:
    """``ValueError`` naming what to do where a ``resource_profile`` cannot be attached."""
    if not takes_profiles(df):
        raise ValueError("resource_profile needs pyspark >= 4.0 (DataFrame.mapInArrow(..., "
                         "profile=)); with older Spark set the GPUs for the whole session "
                         "(spark.task.resource.gpu.amount) and leave resource_profile unset")


# Python-worker-wide cache of loaded predictors: deserialize a model once per worker process,
# not once per task or batch (Python workers are reused across tasks by default).
_PREDICTORS: Dict[str, Callable] = {}


def _predictor(key: str, factory: Callable) -> Callable:
    predict = _PREDICTORS.get(key)
    if predict is None:
        if len(_PREDICTORS) >= 4:
            _PREDICTORS.clear()
        predict = _PREDICTORS[key] = factory()
    return predict


def one_tokenizer_thread() -> None:
    """A Hugging Face tokenizer in a Python worker: one thread, the task slots being the
    parallelism (as in the decode workers); the user's value wins."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _worker_transform(transform_bytes: Optional[bytes]) -> Optional[Callable]:
    import pickle

    one_tokenizer_thread()
    return pickle.loads(transform_bytes) if transform_bytes is not None else None


def prediction_udf(key: str, factory: Callable, specs: Sequence[ColumnSpec],
                   types: Sequence[T.DataType], batch_size: int,
                   transform_bytes: Optional[bytes] = None,
                   feature_names: Optional[Sequence[str]] = None) -> Callable[..., Column]:
    """The iterator UDF predicting ``types`` from the ``specs`` columns with the predictor
    ``factory()`` makes (once per Python worker and ``key``).

    An Arrow UDF (pyspark >= 4.1, ``arrow_udf``): Arrow record batches become the numpy arrays
    training fed the model and the outputs Arrow arrays, with no pandas in between (measured in
    bench/bench_transform.py). Older pyspark: the same steps in an iterator ``pandas_udf``.
    """
    multi = len(types) > 1
    # nullable fields: what pandas and Arrow build, and Spark 4 compares the nullability
    return_type = (T.StructType([T.StructField(f"_{i}", t, True) for i, t in enumerate(types)])
                   if multi else types[0])
    scalar_out = [isinstance(t, T.DoubleType) for t in types]
    if not hasattr(F, "arrow_udf"):
        return _pandas_prediction_udf(key, factory, specs, scalar_out, return_type, batch_size,
                                      transform_bytes, feature_names)

    def predict_arrow(batches):  # type hints set below: they select the UDF's shape
        transform = _worker_transform(transform_bytes)
        predict = _predictor(key, factory)
        for arrays in batches:
            arrays = arrays if isinstance(arrays, tuple) else (arrays,)
            batch = {spec.name: arrow_values(a, spec)
                     for a, spec in zip(arrays, specs, strict=True)}
            outputs = predict_batch(predict, batch, specs, transform, batch_size, len(types),
                                    feature_names)
            yield output_arrays(outputs, scalar_out, len(arrays[0]))

    import pyarrow as pa

    # Spark picks the iterator Arrow UDF flavour from these hints (SCALAR_ARROW_ITER).
    predict_arrow.__annotations__ = {
        "batches": Iterator[Tuple[pa.Array, ...]] if len(specs) > 1 else Iterator[pa.Array],
        "return": Iterator[pa.Array]}
    # pyspark's stubs have only the functionType forms, not this type-hinted (f, returnType) one
    return F.arrow_udf(predict_arrow, return_type)  # type: ignore[call-overload]


def _pandas_prediction_udf(key: str, factory: Callable, specs: Sequence[ColumnSpec],
                           scalar_out: Sequence[bool], return_type: T.DataType,
                           batch_size: int, transform_bytes: Optional[bytes],
                           feature_names: Optional[Sequence[str]]) -> Callable[..., Column]:
    """:func:`prediction_udf` as an iterator ``pandas_udf`` (pyspark < 4.1)."""
    multi = len(scalar_out) > 1

    def predict_batches(batches):  # type hints set below: they select the UDF's shape
        transform = _worker_transform(transform_bytes)
        predict = _predictor(key, factory)
        for columns in batches:
            columns = columns if isinstance(columns, tuple) else (columns,)
            rows = len(columns[0])
            outputs = predict_columns(predict, columns, specs, transform, batch_size,
                                      len(scalar_out), feature_names)
            series = output_series(outputs, scalar_out, rows)
            yield pd.DataFrame({f"_{i}": s for i, s in enumerate(series)}) if multi else series[0]

    # Spark picks the iterator pandas_udf flavour from these hints (SCALAR_ITER).
    predict_batches.__annotations__ = {
        "batches": Iterator[Tuple[pd.Series, ...]] if len(specs) > 1 else Iterator[pd.Series],
        "return": Iterator[pd.DataFrame] if multi else Iterator[pd.Series]}
    # pyspark's stubs have only the functionType forms, not this type-hinted (f, returnType) one
    return F.pandas_udf(predict_batches, return_type)  # type: ignore[call-overload]
