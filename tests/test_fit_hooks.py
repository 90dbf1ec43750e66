"""Fit hooks (no Spark): MLflow is registered by name, hooks wrap the fit and hear its events."""
from __future__ import annotations

import subprocess
import sys
import types
from contextlib import contextmanager

import pytest

from sparktrain import fit_hooks
from sparktrain.fit_hooks import FIT_HOOKS, FitListener, register_fit_hook


@pytest.fixture
def hooks(monkeypatch):
    """FIT_HOOKS as it was, after the test."""
    monkeypatch.setattr(fit_hooks, "FIT_HOOKS", dict(FIT_HOOKS))
    return fit_hooks.FIT_HOOKS


def recording(log, name):
    class Listener(FitListener):
        def started(self, run_id, store, spark):
            log.append((name, "started", run_id))

        def fitted(self, model, dataset):
            log.append((name, "fitted", model))

    @contextmanager
    def hook(estimator):
        log.append((name, "enter", estimator))
        try:
            yield Listener()
        except BaseException as error:
            log.append((name, "error", type(error).__name__))
            raise
        log.append((name, "exit", estimator))
    return hook


def test_mlflow_is_the_default_hook_without_importing_it():
    # a fit with mlflow_logging=True (or after mlflow.autolog()) reaches sparktrain.mlflow
    # through this entry, though the user never imported it
    code = ("import sys\n"
            "import sparktrain.estimators.base\n"
            "from sparktrain.fit_hooks import FIT_HOOKS\n"
            "from sparktrain.plugins import load\n"
            "assert 'sparktrain.mlflow' not in sys.modules, 'imported before a fit'\n"
            "hook = load(FIT_HOOKS['mlflow'])\n"
            "from sparktrain.mlflow.tracking import track_fit\n"
            "assert hook is track_fit\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_unlogged_fit_gets_a_listener_that_does_nothing(hooks):
    class Estimator:
        def getMlflowLogging(self):
            return False  # mlflow_logging=False: never logged, MLflow never imported

    with fit_hooks.fit_hooks(Estimator()) as listener:
        assert type(listener) is FitListener
        listener.started("r", None, None)
        listener.on_progress({"event": "epoch"})
        listener.trained({})
        listener.fitted(None, None)


def test_hooks_wrap_the_fit_in_order_and_hear_its_events(hooks):
    log = []
    hooks.clear()
    register_fit_hook("a", recording(log, "a"))
    register_fit_hook("b", recording(log, "b"))
    with fit_hooks.fit_hooks("est") as listener:
        listener.started("run-1", None, None)
        listener.on_progress({"event": "epoch"})  # neither overrides it: no-op
        listener.fitted("model", None)
    assert log == [("a", "enter", "est"), ("b", "enter", "est"),
                   ("a", "started", "run-1"), ("b", "started", "run-1"),
                   ("a", "fitted", "model"), ("b", "fitted", "model"),
                   ("b", "exit", "est"), ("a", "exit", "est")]


def test_a_failed_fit_reaches_every_hook_and_is_raised(hooks):
    log = []
    hooks.clear()
    register_fit_hook("a", recording(log, "a"))
    register_fit_hook("a", recording(log, "a2"))  # same name: replaced
    register_fit_hook("b", recording(log, "b"))
    with pytest.raises(KeyError):
        with fit_hooks.fit_hooks("est"):
            raise KeyError("x")
    assert [entry for entry in log if entry[1] == "error"] == [("b", "error", "KeyError"),
                                                               ("a2", "error", "KeyError")]


def test_hooks_by_string_are_imported_at_the_fit(hooks, monkeypatch):
    log = []
    module = types.ModuleType("my_fit_hooks")
    monkeypatch.setitem(sys.modules, "my_fit_hooks", module)
    hooks.clear()
    register_fit_hook("mine", "my_fit_hooks:hook")  # nothing looked up yet
    module.hook = recording(log, "mine")
    with fit_hooks.fit_hooks("est"):
        pass
    assert log == [("mine", "enter", "est"), ("mine", "exit", "est")]
    with pytest.raises(ValueError, match="non-empty"):
        register_fit_hook("", "x:y")
    with pytest.raises(TypeError, match="module:function"):
        register_fit_hook("n", 3)
