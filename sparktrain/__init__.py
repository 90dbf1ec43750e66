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
from typing import TYPE_CHECKING, Any, List

__version__ = "0.4.0"

if TYPE_CHECKING:
    # What type checkers and IDEs see (`X as X`: an explicit re-export); at run time
    # __getattr__ below imports each name when first used.
    from sparktrain.data.store import Store as Store
    from sparktrain.errors import CheckpointError as CheckpointError
    from sparktrain.errors import ExecutorEnvironmentError as ExecutorEnvironmentError
    from sparktrain.errors import IgnoredParamWarning as IgnoredParamWarning
    from sparktrain.errors import LocalDiskFullError as LocalDiskFullError
    from sparktrain.errors import PreflightError as PreflightError
    from sparktrain.errors import RunInUseError as RunInUseError
    from sparktrain.errors import StoreFullError as StoreFullError
    from sparktrain.errors import TrainingError as TrainingError
    from sparktrain.estimators.keras import KerasEstimator as KerasEstimator
    from sparktrain.estimators.keras import KerasModel as KerasModel
    from sparktrain.estimators.torch import TorchEstimator as TorchEstimator
    from sparktrain.estimators.torch_model import TorchModel as TorchModel
    from sparktrain.generation.engines import (
        register_generation_engine as register_generation_engine,
    )
    from sparktrain.generation.generator import TextGenerator as TextGenerator
    from sparktrain.loop.callbacks import Callback as Callback
    from sparktrain.loop.callbacks import EarlyStopping as EarlyStopping
    from sparktrain.mlflow.tracking import MlflowLoggingWarning as MlflowLoggingWarning
    from sparktrain.session.local import ConnectServer as ConnectServer
    from sparktrain.session.local import local_spark as local_spark
    from sparktrain.session.local import remote_spark as remote_spark

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
    "TextGenerator": "sparktrain.generation.generator",
    "register_generation_engine": "sparktrain.generation.engines",
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
