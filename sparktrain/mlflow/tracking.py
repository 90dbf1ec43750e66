"""One fit's MLflow run: the fit hook (:mod:`sparktrain.fit_hooks`, registered there as
``"sparktrain.mlflow.tracking:track_fit"``) that ``EstimatorBase._fit`` enters.

Everything goes from the driver: params and tags when the fit starts, each epoch's metrics when
rank 0's ``epoch`` progress event reaches the driver (``step`` = epoch), then the outcome,
attempts, the history plot, the TensorBoard directory and the model. The calls run in a
background thread (:mod:`sparktrain.mlflow.sender`); any MLflow error becomes one
``MlflowLoggingWarning`` and the fit goes on. Nothing imports MLflow unless the fit is logged.

Example::

    with track_fit(estimator) as tracker:
        tracker.started(run_id, store, spark)
        progress = FitProgress(listeners=[tracker.on_progress])
        ...
        tracker.trained(result)
        tracker.fitted(model, dataset)
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from importlib import metadata
from typing import Any, Dict, Iterator, Optional

from sparktrain.fit_hooks import FitListener
from sparktrain.mlflow.config import Settings, settings
from sparktrain.mlflow.fit_params import fit_params

log = logging.getLogger(__name__)

GRACE_SECONDS = 10.0  # how long a fit's end waits for a tracking server that never answered
_STACK = ("sparktrain", "pyspark", "numpy", "pyarrow", "pandas", "torch", "tensorflow",
          "tensorflow-cpu", "keras")


class MlflowLoggingWarning(UserWarning):
    """MLflow could not log (part of) a fit; the fit itself succeeded or failed on its own."""


# frames between a warning here and the fit (EstimatorBase._fit) it is about
_HOOK_MODULES = (__name__, "sparktrain.fit_hooks", "contextlib")


def _warn(message: str) -> None:
    """Warn as from ``EstimatorBase._fit``'s line, however many context managers lie between
    (the fit hooks enter this one through an ``ExitStack``)."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_globals.get("__name__") in _HOOK_MODULES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, MlflowLoggingWarning, stacklevel=level)


class FitTracker(FitListener):
    """Logs one fit (see the module docstring)."""

    def __init__(self, estimator: Any, config: Settings) -> None:
        import mlflow

        from sparktrain.mlflow.sender import Sender
        from sparktrain.mlflow.tuning import parent_run_id

        self.estimator, self.config = estimator, config
        self.client = mlflow.MlflowClient()
        active = mlflow.active_run()  # thread-local: None in CrossValidator's pool threads
        self.parent = parent_run_id(estimator)  # a fit inside CrossValidator & co.
        if active is not None and active.info.run_id != self.parent:
            self.run_id: Optional[str] = active.info.run_id  # the caller's run
        else:  # a run of our own, nested under the tuning run if any; we end it
            self.run_id = None
        self.own = self.run_id is None
        self.sender = Sender()
        self.result: Dict[str, Any] = {}
        self.model: Any = None
        self.dataset: Any = None
        self._store: Any = None
        self._run_path = ""

    @property
    def _started_id(self) -> str:
        """The run's id, once ``_start`` (the first call the sender makes) has set it."""
        if self.run_id is None:
            raise RuntimeError("the MLflow run has not started")
        return self.run_id

    # -- hooks called by EstimatorBase._fit -------------------------------------------------
    def started(self, run_id: str, store: Any, spark: Any) -> None:
        self._store, self._run_path = store, store.run_path(run_id)
        tags = self._tags(run_id, spark)
        params = fit_params(self.estimator)
        self.sender.submit(lambda: self._start(tags, params))

    def on_progress(self, event: Dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "epoch":
            step, stamp = int(event["epoch"]), int(time.time() * 1000)
            logs = dict(event.get("logs") or {})
            self.sender.submit(lambda: self._metrics(logs, step, stamp))
        elif kind == "membership" and int(event.get("generation", 0)):
            # an elastic fit's generation change: when, why, from how many ranks to how many
            key = f"sparktrain.elastic.generation_{int(event['generation'])}"
            text = (f"{event.get('from')} -> {event.get('to')} ranks at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(event.get('time')))}: "
                    f"{event.get('reason')}")
            self.sender.submit(lambda: self.client.set_tag(self._started_id, key, text[:5000]))
        elif kind == "start" and int(event.get("first", 0)):
            first = int(event["first"])
            self.sender.submit(lambda: self.client.set_tag(
                self._started_id, "sparktrain.resumed_from_epoch", str(first)))

    def trained(self, result: Dict[str, Any]) -> None:
        self.result = result

    def fitted(self, model: Any, dataset: Any) -> None:
        self.model, self.dataset = model, dataset

    # -- MLflow calls (in the sender's thread, except the models) ----------------------------
    def _start(self, tags: Dict[str, str], params: Dict[str, str]) -> None:
        from mlflow.entities import Param

        if self.run_id is None:
            import mlflow

            run = mlflow.start_run(run_name=self._run_path.rstrip("/").rsplit("/", 1)[-1],
                                   nested=self.parent is not None,
                                   parent_run_id=self.parent)
            self.run_id = run.info.run_id  # active in this thread only; _finish ends it
        existing = self.client.get_run(self.run_id).data.params
        # MLflow refuses to change a logged param (e.g. logged by mlflow.pyspark.ml autolog)
        fresh = [Param(k, v) for k, v in params.items() if k not in existing]
        for start in range(0, len(fresh), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=fresh[start:start + 100])
        self._tag(tags)

    def _tag(self, tags: Dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self._started_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _metrics(self, logs: Dict[str, Any], step: int, stamp: int) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self._started_id, metrics=[
            Metric(key, float(value), stamp, step) for key, value in logs.items()])

    def _tags(self, run_id: str, spark: Any) -> Dict[str, str]:
        est = self.estimator
        tags = {"sparktrain.run_id": run_id, "sparktrain.store_run_path": self._run_path,
                "sparktrain.estimator": type(est).__name__,
                "sparktrain.engine": str(est.getBackend()),
                "sparktrain.num_proc": str(est.getNumProc()),
                "sparktrain.session": "connect" if "connect" in type(spark).__module__
                else "classic"}
        if est.hasParam("strategy") and est.isDefined("strategy"):
            tags["sparktrain.strategy"] = str(est.getOrDefault("strategy"))
        for name in _STACK:
            try:
                tags[f"sparktrain.version.{name}"] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return tags

    def _outcome(self, error: Optional[BaseException]) -> Dict[str, str]:
        if error is not None:
            kind = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            return {"sparktrain.outcome": kind,
                    "sparktrain.error": f"{type(error).__name__}: {error}"[:5000]}
        stop = self.result.get("stop_reason")
        return {"sparktrain.outcome": f"stopped ({stop})" if stop else "finished"}

    def _artifacts(self) -> None:
        attempts = self.result.get("attempts")
        if attempts:
            self.client.set_tag(self._started_id, "sparktrain.attempts", str(len(attempts)))
            self.client.log_dict(self._started_id, attempts, "sparktrain/attempts.json")
        if not self.config.log_artifacts:
            return
        with tempfile.TemporaryDirectory() as tmp:
            if self.model is not None and self.model.getHistory():
                try:
                    figure = self.model.plot_history()
                except ImportError:  # matplotlib is the `plot` extra
                    figure = None
                if figure is not None:
                    figure.savefig(os.path.join(tmp, "history.png"))
                    self.client.log_artifact(self._started_id, os.path.join(tmp, "history.png"),
                                             "sparktrain")
            board = f"{self._run_path}/tensorboard"
            fs = self._store.fs
            if fs.exists(board):
                local = os.path.join(tmp, "tensorboard")
                fs.get(board, local, recursive=True)
                self.client.log_artifacts(self._started_id, local, "tensorboard")

    def close(self, error: Optional[BaseException]) -> None:
        """The end of the fit: outcome, artifacts, models, the run's status; one warning for
        whatever failed."""
        if not self._run_path:  # the fit failed before it started (params, schema): no run
            self.sender.drain(0.0)  # ends its thread
            return
        outcome = self._outcome(error)
        self.sender.submit(lambda: self._tag(outcome))
        self.sender.submit(self._artifacts)
        problem = None if self.sender.drain(GRACE_SECONDS) else self.sender.error
        status = "FAILED" if error is not None else "FINISHED"
        if isinstance(error, KeyboardInterrupt):
            status = "KILLED"
        if problem is None:
            problem = self._finish(status)
        if problem is not None:
            _warn(f"MLflow could not log this fit ({type(problem).__name__}: {problem}); the "
                  f"fit itself is not affected. docs/mlflow.md")

    def _finish(self, status: str) -> Optional[BaseException]:
        """Models (in this thread: MLflow's model logging uses the thread's active run) and
        the end of a run of our own."""
        import mlflow

        try:
            if self.model is not None and self.config.log_models:
                from sparktrain.mlflow.models import log_fitted_model

                active = mlflow.active_run()
                started = active is None or active.info.run_id != self.run_id
                if started:
                    mlflow.start_run(run_id=self.run_id, nested=active is not None)
                try:
                    uris = log_fitted_model(self.model, self.dataset,
                                            self.config.registered_model_name)
                    mlflow.set_tags({f"sparktrain.model_uri.{k}": v for k, v in uris.items()})
                finally:
                    if started:
                        mlflow.end_run(status)
            if self.own:
                self.client.set_terminated(self._started_id, status)
        except Exception as problem:  # noqa: BLE001 - logging never fails the fit
            if self.own:
                try:
                    self.client.set_terminated(self._started_id, status)
                except Exception:  # noqa: BLE001
                    pass
            return problem
        return None


@contextmanager
def track_fit(estimator: Any) -> Iterator[FitListener]:
    """The tracker of one fit of ``estimator``: a :class:`FitTracker` when it is logged
    (:func:`sparktrain.mlflow.config.settings`), else one that does nothing."""
    config = settings(estimator.getMlflowLogging())
    if config is None:
        yield FitListener()
        return
    try:
        tracker = FitTracker(estimator, config)
    except Exception as problem:  # noqa: BLE001
        _warn(f"MLflow could not log this fit ({type(problem).__name__}: {problem})")
        yield FitListener()
        return
    try:
        yield tracker
    except BaseException as error:
        tracker.close(error)
        raise
    tracker.close(None)
