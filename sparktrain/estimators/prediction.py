"""Prediction's shared steps: feature columns as Arrow hands them to a pandas UDF -> the numpy
form training fed the model -> the model's outputs -> prediction columns. Used by ``transform``'s
UDF (:mod:`sparktrain.estimators.base`) and the MLflow pyfunc (:mod:`sparktrain.mlflow.models`).

Example::

    outputs = predict_columns(predict, [frame["features"]], specs, None, 256, 1)
    output_series(outputs, [True], len(frame))   # [pd.Series of floats]
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import pandas as pd
from pyspark.sql import Column

from sparktrain.data.batch import model_ready, values_to_numpy
from sparktrain.data.materialize import stored_value
from sparktrain.data.schema import SCALAR, ColumnSpec


def feature_expr(spec: ColumnSpec) -> Column:
    """A feature column in the form the prediction UDF reads (what training read)."""
    return stored_value(spec)


def series_values(series: Any, spec: ColumnSpec):
    """A pandas feature column from Arrow in the numpy form a ``transformation_fn`` gets in
    training (:mod:`sparktrain.data.batch`); struct columns (images) arrive as DataFrames."""
    if isinstance(series, pd.DataFrame):
        return values_to_numpy(series.to_dict("records"), spec)
    if spec.kind == SCALAR:
        return series.to_numpy(dtype=spec.dtype)
    return values_to_numpy(list(series.to_numpy()), spec)


def as_model_input(value: Any):
    """Scalar columns as ``(rows, 1)``, the shape training fed the model."""
    return value.reshape(-1, 1) if value.ndim == 1 else value


def series_to_numpy(series: pd.Series, spec: ColumnSpec):
    """A pandas numeric feature column from Arrow as training fed it to the model (scalars as
    ``(rows, 1)``)."""
    return as_model_input(series_values(series, spec))


def predict_columns(predict: Callable[[List[Any]], List[Any]], columns: Sequence[Any],
                    specs: Sequence[ColumnSpec], transform: Optional[Callable],
                    batch_size: int, n_outputs: int,
                    feature_names: Optional[Sequence[str]] = None) -> List[Any]:
    """The model's outputs (numpy, one row per input row) for pandas input ``columns`` (one
    per spec, as Arrow hands them to the prediction UDF): ``transform`` first (the model's
    ``predict_transformation_fn``), then ``predict`` on the ``feature_names`` columns (default:
    the specs' names) in slices of ``batch_size`` rows. Shared by ``transform``'s UDF and the
    MLflow pyfunc (:mod:`sparktrain.mlflow.models`)."""
    import numpy as np

    names = list(feature_names) if feature_names else [spec.name for spec in specs]
    batch = {spec.name: series_values(s, spec) for s, spec in zip(columns, specs)}
    if transform is not None:  # decoding, as in training (vectorized per Arrow batch)
        batch = transform(batch)
    batch = model_ready(batch, names, transform is not None)
    features = [as_model_input(batch[name]) for name in names]
    rows = len(columns[0])
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
            for o, scalar in zip(outputs, scalar_out)]
