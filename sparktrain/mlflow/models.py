"""A fitted sparktrain model as MLflow models: its framework's flavor (``mlflow.pytorch`` or
``mlflow.keras``) and a pyfunc that predicts on a pandas DataFrame of the original feature
columns exactly what ``model.transform`` adds (the same prediction code: ``predict_columns``).

Example::

    uris = log_fitted_model(model, train_df, registered_model_name="digits")
    mlflow.pyfunc.load_model(uris["pyfunc"]).predict(pandas_df)   # a column per output_col
"""
from __future__ import annotations

import pickle
import warnings
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

from sparktrain.estimators.prediction import (
    as_model_input,
    feature_expr,
    output_series,
    predict_columns,
    series_values,
)
from sparktrain.pickling import dumps

EXAMPLE_ROWS = 5
_FLAVORS = {"TorchModel": ("pytorch", "torch"), "KerasModel": ("keras", "keras")}


# MLflow warns at class creation about a predict without type hints: the input is any
# DataFrame of the feature columns, checked against the logged signature instead.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)

    class SparktrainPyfunc(PythonModel):
        """``predict(context, DataFrame of the feature columns)`` -> a DataFrame with one column
        per output column: a float per row, or a list of floats (``array<double>``), as
        ``transform`` gives. The model's ``predict_transformation_fn`` runs first."""

        def __init__(self, model: Any) -> None:
            # the weights inside the pyfunc: an MLflow model must not depend on the store
            self.factory = model._predict_fn_factory(portable=True)
            self.specs = model._input_specs()
            self.feature_names = list(model.getFeatureCols())
            self.outputs = list(model.getOutputCols())
            self.scalar_out = [_size(shape) == 1 for shape in model._output_shapes]
            self.batch_size = model.getBatchSize()
            transform = model.getPredictTransformationFn()
            # pickled by sparktrain: the user's modules by value, as for transform's UDF
            self.transform_bytes = dumps(transform) if transform is not None else None
            self._predict: Optional[Callable[..., Any]] = None  # built by the first predict

        def __getstate__(self) -> Dict[str, Any]:
            return {**self.__dict__, "_predict": None}  # the loaded model is rebuilt on load

        def predict(self, context, model_input, params=None):
            if self._predict is None:
                self._predict = self.factory()
            frame = model_input if isinstance(model_input, pd.DataFrame) else \
                pd.DataFrame(model_input)
            transform = pickle.loads(self.transform_bytes) if self.transform_bytes else None
            columns = [frame[spec.name] for spec in self.specs]
            outputs = predict_columns(self._predict, columns, self.specs, transform,
                                      self.batch_size, len(self.outputs), self.feature_names)
            series = output_series(outputs, self.scalar_out, len(frame))
            return pd.DataFrame(dict(zip(self.outputs, series, strict=True)))


def _size(shape: List[int]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def _jsonable(frame: pd.DataFrame) -> pd.DataFrame:
    """Arrays in object columns as lists: MLflow writes the input example as JSON."""
    return frame.apply(lambda col: col.map(lambda v: v.tolist() if hasattr(v, "tolist") else v)
                       if col.dtype == object else col)


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _requirements(*names: str) -> List[str]:
    """Pinned requirements of what is installed: MLflow would otherwise infer them by loading
    the model in a subprocess (several seconds per logged model)."""
    found = [(n, _version(n)) for n in names]
    return [f"{n}=={v}" if v else n for n, v in found if v or n == "sparktrain"]


def log_fitted_model(model: Any, dataset: Any,
                     registered_model_name: Optional[str] = None) -> Dict[str, str]:
    """Log ``model`` (fitted on ``dataset``) into the active run: the pyfunc (registered as
    ``registered_model_name``) and the framework's flavor, each with a signature and an input
    example from a few real rows; returns their model URIs (``pyfunc``, ``pytorch``/``keras``)."""
    from mlflow.models import infer_signature

    flavor, module = _FLAVORS.get(type(model).__name__, (None, None))
    pyfunc = SparktrainPyfunc(model)
    sample = dataset.select(*[feature_expr(s).alias(s.name) for s in pyfunc.specs]) \
        .limit(EXAMPLE_ROWS).toPandas()
    example = _jsonable(sample)
    outputs = pyfunc.predict(None, sample)
    common = ["sparktrain", "pyspark", "pandas", "numpy", "cloudpickle"]
    framework = ["torch"] if flavor == "pytorch" else ["tensorflow-cpu", "tensorflow", "keras"]
    info = mlflow.pyfunc.log_model(
        name="sparktrain_model", python_model=pyfunc,
        signature=infer_signature(example, _jsonable(outputs)), input_example=example,
        registered_model_name=registered_model_name,
        pip_requirements=_requirements(*common, *(framework if flavor else [])))
    uris = {"pyfunc": info.model_uri}
    if flavor is None:
        return uris
    signature = example_input = None
    if len(pyfunc.specs) == 1 and pyfunc.transform_bytes is None:  # one tensor in, as trained
        spec = pyfunc.specs[0]
        example_input = as_model_input(series_values(sample[spec.name], spec)).astype("float32")
        assert pyfunc._predict is not None  # pyfunc.predict above built it
        raw = pyfunc._predict([example_input])
        signature = infer_signature(example_input, raw[0] if len(raw) == 1 else None)
    if flavor == "keras":
        # mlflow.keras.save_model writes the input example before it creates the model's
        # directory (mlflow/keras/save.py, 3.17: FileNotFoundError): the signature only
        example_input = None
    log_flavor = getattr(mlflow, flavor).log_model
    info = log_flavor(model.getModel(), name=f"{module}_model", signature=signature,
                      input_example=example_input,
                      pip_requirements=_requirements(*framework, "cloudpickle"))
    uris[flavor] = info.model_uri
    return uris
