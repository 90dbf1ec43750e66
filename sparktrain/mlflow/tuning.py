"""Nested runs inside ``CrossValidator`` / ``TrainValidationSplit``.

pyspark's tuning estimators fit each param map in a ``ThreadPool`` thread, even with
``parallelism=1`` (``pyspark/ml/tuning.py``), and MLflow's active run is thread-local
(``mlflow.active_run()`` is ``None`` there). So the tuning estimators' ``_fit`` is wrapped: in
the caller's thread it takes the active run (or starts one, as MLflow's ``pyspark.ml``
autologging does) and records it as the parent of the estimator's uid; a sparktrain fit of that
uid (a param-map copy keeps its uid) in any thread then starts a nested run under it.

Example::

    install(lambda: True)        # once; sparktrain.mlflow.autolog() calls it
    CrossValidator(estimator=est, ...).fit(df)   # one child run per fit under the tuning run
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, cast

log = logging.getLogger(__name__)

_parents: Dict[str, str] = {}  # estimator uid -> the tuning run's id
_lock = threading.Lock()
_installed = False


def parent_run_id(estimator: Any) -> Optional[str]:
    """The tuning run a fit of ``estimator`` nests under, or ``None``."""
    with _lock:
        return _parents.get(estimator.uid)


def _uids(estimator: Any) -> List[str]:
    """The uid of the tuned estimator and, for a ``Pipeline``, of its stages."""
    uids = [estimator.uid]
    stages = estimator.getStages() if hasattr(estimator, "getStages") else []
    return uids + [u for stage in stages for u in _uids(stage)]


def _wrap(original: Callable[..., Any], logged: Callable[[], bool]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _fit(self, dataset):
        if not logged():
            return original(self, dataset)
        import mlflow

        own = False
        try:
            run = mlflow.active_run()
            if run is None:
                run = mlflow.start_run(run_name=f"{type(self).__name__}-{self.uid}",
                                       tags={"sparktrain.tuning": type(self).__name__})
                own = True
            uids = _uids(self.getEstimator())
        except Exception as error:  # noqa: BLE001 - tracking never fails the tuning
            log.warning("MLflow: no tuning run for %s (%s); its fits are logged on their own",
                        type(self).__name__, error)
            return original(self, dataset)
        with _lock:
            for uid in uids:
                _parents[uid] = run.info.run_id
        status = "FAILED"
        try:
            result = original(self, dataset)
            status = "FINISHED"
            return result
        finally:
            with _lock:
                for uid in uids:
                    _parents.pop(uid, None)
            if own:
                try:
                    mlflow.end_run(status)
                except Exception as error:  # noqa: BLE001
                    log.warning("MLflow: could not end the tuning run (%s)", error)

    cast(Any, _fit).__sparktrain_mlflow__ = True  # a mark on the function: wrapped once
    return _fit


def install(logged: Callable[[], bool]) -> None:
    """Wrap ``CrossValidator._fit`` and ``TrainValidationSplit._fit`` (once per process);
    ``logged()`` says whether fits are being logged now."""
    global _installed
    with _lock:
        if _installed:
            return
        from pyspark.ml.tuning import CrossValidator, TrainValidationSplit

        for cls in (CrossValidator, TrainValidationSplit):
            if not getattr(cls._fit, "__sparktrain_mlflow__", False):
                cast(Any, cls)._fit = _wrap(cls._fit, logged)  # patches pyspark's method
        _installed = True
