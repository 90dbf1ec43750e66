"""Whether a fit is logged to MLflow, and how: :func:`autolog`'s settings, MLflow's own
``pyspark.ml`` autologging, the estimator's ``mlflow_logging`` param. Imports no MLflow unless
the user's program already did.

Example::

    autolog(log_models=False)                   # metrics, params and tags only
    settings(estimator.getMlflowLogging())      # -> Settings(log_models=False, ...)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

SUPPORTED = ">=3.1,<4"  # the mlflow-skinny range of the `mlflow` extra (setup.py)


@dataclass(frozen=True)
class Settings:
    """What a logged fit sends besides params, metrics and tags."""

    log_models: bool = True  # the torch/Keras model and the pyfunc predicting like transform
    registered_model_name: Optional[str] = None  # register the pyfunc under this name
    log_artifacts: bool = True  # the history plot and the run's TensorBoard directory


_DISABLED = "disabled"
_state: Union[None, str, Settings] = None  # None: autolog() was never called


def autolog(log_models: bool = True, registered_model_name: Optional[str] = None,
            disable: bool = False, log_artifacts: bool = True) -> None:
    """Log every later sparktrain fit to MLflow (driver side only): the estimator's params,
    each epoch's metrics as it ends (``step`` = epoch), tags, the history plot and TensorBoard
    directory, the outcome; with ``log_models`` the fitted model (its framework's flavor and a
    pyfunc), registered as ``registered_model_name`` when given. Inside ``CrossValidator`` and
    ``TrainValidationSplit`` each fit is a nested run of the tuning run. ``disable=True`` turns
    it off, ``mlflow.autolog()`` included.

    Example: ``sparktrain.mlflow.autolog(registered_model_name="digits")``.
    """
    global _state
    if disable:
        _state = _DISABLED
        return
    _check_mlflow()
    _state = Settings(log_models, registered_model_name, log_artifacts)
    from sparktrain.mlflow.tuning import install

    install(_logged)  # nested runs: CrossValidator fits in pool threads (docs/mlflow.md)


def _check_mlflow() -> None:
    try:
        import mlflow  # noqa: F401 - only whether it imports
    except ImportError:
        raise ImportError("sparktrain.mlflow needs MLflow: pip install 'sparktrain[mlflow]' "
                          f"(mlflow-skinny {SUPPORTED}, or mlflow)") from None


def _from_mlflow_autolog() -> Optional[Settings]:
    """Settings from ``mlflow.autolog()`` / ``mlflow.pyspark.ml.autolog()``, or ``None``.

    MLflow has no plugin point for a third-party library in ``mlflow.autolog()`` (it calls the
    integrations it knows, ``mlflow/tracking/fluent.py`` ``LIBRARY_TO_AUTOLOG_MODULE``); for Spark
    ML it enables the ``pyspark.ml`` integration, whose config any library can read through
    ``mlflow.utils.autologging_utils``. A program that never imported MLflow never called it.
    """
    if "mlflow" not in sys.modules:
        return None
    try:
        from mlflow.utils.autologging_utils import autologging_is_disabled, get_autologging_config
    except ImportError:
        return None
    if autologging_is_disabled("pyspark.ml"):
        return None
    return Settings(log_models=bool(get_autologging_config("pyspark.ml", "log_models", True)),
                    registered_model_name=get_autologging_config("pyspark.ml",
                                                                 "registered_model_name", None))


def _logged() -> bool:
    return settings() is not None


def settings(flag: Optional[bool] = None) -> Optional[Settings]:
    """How a fit with ``mlflow_logging=flag`` is logged; ``None``: it is not."""
    if flag is False or (_state == _DISABLED and flag is None):
        return None
    if isinstance(_state, Settings):
        return _state
    found = _from_mlflow_autolog() if _state is None else None
    if found is not None:
        from sparktrain.mlflow.tuning import install

        install(_logged)  # later tuning fits get nested runs too
        return found
    if flag:
        _check_mlflow()
        return Settings()
    return None
