"""sparktrain: train PyTorch and Keras models on Spark DataFrames with Spark ML estimators.

Example::

    from sparktrain import TorchEstimator
    model = TorchEstimator(num_proc=2, model=net, optimizer=opt, loss=loss_fn,
                           feature_cols=["features"], label_cols=["label"]).fit(df)

Everything a user writes is importable from here (``__all__``; docs/usage.md, "What to
import"). Importing sparktrain imports neither torch nor TensorFlow: each name is imported from
its module when first used, and each framework loads only with its estimator.
"""
from __future__ import annotations

import importlib
from typing import Any, List

__version__ = "0.4.0"

#: public name -> the module that defines it
_EXPORTS = {
    "TorchEstimator": "sparktrain.estimators.torch",
    "TorchModel": "sparktrain.estimators.torch_model",
    "KerasEstimator": "sparktrain.estimators.keras",
    "KerasModel": "sparktrain.estimators.keras",
    "Callback": "sparktrain.loop.callbacks",
    "EarlyStopping": "sparktrain.loop.callbacks",
    "Store": "sparktrain.data.store",
    "TrainingError": "sparktrain.errors",
    "RunInUseError": "sparktrain.errors",
    "CheckpointError": "sparktrain.errors",
    "StoreFullError": "sparktrain.errors",
    "LocalDiskFullError": "sparktrain.errors",
    "PreflightError": "sparktrain.errors",
    "ExecutorEnvironmentError": "sparktrain.errors",
    "IgnoredParamWarning": "sparktrain.errors",
    "MlflowLoggingWarning": "sparktrain.mlflow.tracking",
    "local_spark": "sparktrain.session.local",
    "remote_spark": "sparktrain.session.local",
    "ConnectServer": "sparktrain.session.local",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'sparktrain' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
