"""sparktrain: train PyTorch and Keras models on Spark DataFrames with Spark ML estimators.

Example::

    from sparktrain import TorchEstimator
    model = TorchEstimator(num_proc=2, model=net, optimizer=opt, loss=loss_fn,
                           feature_cols=["features"], label_cols=["label"]).fit(df)

Importing sparktrain imports neither torch nor TensorFlow: each framework loads when used.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.4.0"

_EXPORTS = {
    "TorchEstimator": "sparktrain.estimators.torch",
    "TorchModel": "sparktrain.estimators.torch_model",
    "KerasEstimator": "sparktrain.estimators.keras",
    "KerasModel": "sparktrain.estimators.keras",
    "Store": "sparktrain.data.store",
    "TrainingError": "sparktrain.errors",
    "RunInUseError": "sparktrain.data.run_lock",
    "PreflightError": "sparktrain.errors",
    "ExecutorEnvironmentError": "sparktrain.launch.executor_env",
    "local_spark": "sparktrain.session",
    "remote_spark": "sparktrain.session",
    "ConnectServer": "sparktrain.session",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparktrain' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
