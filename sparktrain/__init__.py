"""sparktrain: train PyTorch and Keras models on Spark DataFrames with Spark ML estimators.

Example::

    from sparktrain import TorchEstimator
    model = TorchEstimator(num_proc=2, model=net, optimizer=opt, loss=loss_fn,
                           feature_cols=["features"], label_cols=["label"]).fit(df)

Importing sparktrain imports neither torch nor TensorFlow: each framework loads when used.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Optional, Sequence

__version__ = "0.4.0"

_EXPORTS = {
    "TorchEstimator": "sparktrain.estimators.torch",
    "TorchModel": "sparktrain.estimators.torch_model",
    "KerasEstimator": "sparktrain.estimators.keras",
    "KerasModel": "sparktrain.estimators.keras",
    "Store": "sparktrain.data.store",
    "TrainingError": "sparktrain.errors",
    "RunInUseError": "sparktrain.errors",
    "CheckpointError": "sparktrain.errors",
    "StoreFullError": "sparktrain.errors",
    "PreflightError": "sparktrain.errors",
    "ExecutorEnvironmentError": "sparktrain.errors",
    "local_spark": "sparktrain.session.local",
    "remote_spark": "sparktrain.session.local",
    "ConnectServer": "sparktrain.session.local",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparktrain' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)


#: modules that moved when the package was laid out by side (issue #36): old name -> new name.
#: Code, pickles (saved models, estimators) and ``python -m`` entries (Spark's
#: ``spark.python.daemon.module``) that name an old path get the new module.
MOVED = {
    "sparktrain.callbacks": "sparktrain.loop.callbacks",
    "sparktrain.checkpoint": "sparktrain.loop.checkpoint",
    "sparktrain.epochs": "sparktrain.loop.epochs",
    "sparktrain.loop_spec": "sparktrain.loop.spec",
    "sparktrain.compat": "sparktrain.options.horovod",
    "sparktrain.params": "sparktrain.options.params",
    "sparktrain.param_accessors": "sparktrain.options.params",
    "sparktrain.param_converters": "sparktrain.options.converters",
    "sparktrain.elastic_params": "sparktrain.options.params",
    "sparktrain.fine_tuning_params": "sparktrain.options.params",
    "sparktrain.persistence": "sparktrain.estimators.persistence",
    "sparktrain.progress": "sparktrain.estimators.progress",
    "sparktrain.spark_api": "sparktrain.session.spark_api",
    "sparktrain.spark_jvm": "sparktrain.session.spark_jvm",
    "sparktrain.launch.jvm_archive": "sparktrain.session.jvm_archive",
    "sparktrain.launch.worker_daemon": "sparktrain.session.worker_daemon",
    "sparktrain.launch.faults": "sparktrain.faults",
    "sparktrain.estimators.torch_worker": "sparktrain.loop.torch_loop",
    "sparktrain.estimators.torch_forward": "sparktrain.loop.torch_forward",
    "sparktrain.estimators.torch_losses": "sparktrain.loop.torch_losses",
    "sparktrain.estimators.torch_schedule": "sparktrain.loop.torch_schedule",
    "sparktrain.estimators.torch_checkpoint": "sparktrain.loop.torch_checkpoint",
    "sparktrain.estimators.torch_files": "sparktrain.loop.torch_files",
    "sparktrain.estimators.keras_worker": "sparktrain.loop.keras_loop",
    "sparktrain.estimators.keras_batch": "sparktrain.loop.keras_batch",
    "sparktrain.estimators.keras_inputs": "sparktrain.loop.keras_inputs",
    "sparktrain.estimators.keras_checkpoint": "sparktrain.loop.keras_checkpoint",
    "sparktrain.estimators.keras_saving": "sparktrain.loop.keras_saving",
    "sparktrain.estimators.keywords": "sparktrain.options.keywords",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as its new module (the same object, not a copy)."""

    def find_spec(self, name: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the new module ran when it was imported."""

    def get_code(self, name: str) -> Any:
        """``python -m <old name>`` runs the new module's code (``runpy`` asks for it)."""
        new = MOVED[name]
        return importlib.util.find_spec(new).loader.get_code(new)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
