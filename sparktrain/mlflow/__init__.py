"""MLflow tracking for sparktrain fits (the ``mlflow`` extra: ``pip install 'sparktrain[mlflow]'``).

Example::

    import sparktrain.mlflow
    sparktrain.mlflow.autolog()               # every later fit: params, live metrics, model
    model = TorchEstimator(...).fit(df)       # into the active run, or a new one

``TorchEstimator(..., mlflow_logging=True/False)`` logs (or never logs) one estimator's fits
whatever ``autolog`` says. ``mlflow.autolog()`` (or ``mlflow.pyspark.ml.autolog()``) is
honoured too. Nothing here imports MLflow until a fit is to be logged. docs/mlflow.md.
"""
from sparktrain.mlflow.config import autolog

__all__ = ["autolog"]
