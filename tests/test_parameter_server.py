"""KerasEstimator(strategy="parameter_server"): real Spark barrier tasks (1 ps, 1 coordinator,
1 worker), real TensorFlow servers, on digits; the only tests of TensorFlow's parameter-server
training (its processes stopping after a fit and a failure, a killed worker resumed). The fits
run in the slot host (tests/support/slot_host.py: a local[4] session in a process of its own,
shared with other files; both scenarios of tests/support/ps_scenarios.py in one call) because
they need three task slots and the test session is local[2]; the configuration checks run here
and launch nothing."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("sklearn")
pytest.importorskip("psutil")

from sparktrain import KerasEstimator, TorchEstimator  # noqa: E402 - after the importorskip above


@pytest.fixture(scope="module")
def ps_runs(slot_host, tmp_path_factory) -> dict:
    """Both scenarios of tests/support/ps_scenarios.py, one after the other in the slot host
    (its local[4] session, one TensorFlow import): ``{"fit": findings, "kill": findings}``."""
    return slot_host.call("support.ps_scenarios:run", "fit,kill",
                          str(tmp_path_factory.mktemp("ps")), timeout=570)


@pytest.fixture
def ps_fit(ps_runs):
    return ps_runs["fit"]


@pytest.mark.full  # the shared slot-host run: ~1-3 min with TF start-up
def test_parameter_server_fit_reaches_accuracy_transforms_saves_loads(ps_fit):
    assert ps_fit["test_accuracy"] >= 0.9
    assert ps_fit["loaded_accuracy"] == ps_fit["test_accuracy"]


@pytest.mark.full  # the shared slot-host run: ~1-3 min with TF start-up
def test_parameter_server_validation_metrics_callbacks_history(ps_fit):
    history = ps_fit["history"]
    assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert all(len(values) == 6 for values in history.values())
    assert history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] >= 0.85
    assert [e["epoch"] for e in ps_fit["callback_epochs"]] == list(range(6))
    assert ps_fit["callback_epochs"][0]["keys"] == sorted(history)
    assert ps_fit["tensorboard"] == ["train", "validation"]


@pytest.mark.full  # the shared slot-host run: ~1-3 min with TF start-up
def test_parameter_server_processes_stop_after_fit_and_failure(ps_fit):
    assert ps_fit["left_after_fit"] == []
    assert "transformation_fn failed on the worker" in ps_fit["failure"]
    assert "not retried" in ps_fit["failure"]
    assert ps_fit["left_after_failure"] == []
    assert ps_fit["session_usable"]


@pytest.mark.full
def test_parameter_server_killed_worker_resumes(ps_runs):
    result = ps_runs["kill"]
    assert result["killed"]
    assert result["epochs"] == 3
    assert result["attempts"] == [[0, 0], [1, 1]]
    assert result["test_accuracy"] >= 0.85
    assert result["left_after_fit"] == []


def _estimator(**kwargs):
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    params = dict(num_proc=3, model=net, optimizer="sgd", loss="mse",
                  feature_cols=["features"], label_cols=["label"], epochs=1)
    params.update(kwargs)
    return KerasEstimator(**params)


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="parameter_server", num_ps=1, num_proc=2), "at most 0 parameter server"),
    (dict(strategy="parameter_server", num_ps=2, num_proc=3), "raise num_proc to at least 4"),
    (dict(num_ps=1), "num_ps=1 needs strategy='parameter_server'"),
    (dict(strategy="parameter_server", backend="tfos"), "needs backend='tensorflow'"),
])
def test_bad_parameter_server_configs_fail_before_launch(spark, regression_df, store, kwargs,
                                                         message):
    df = regression_df.select("features", "label")
    with pytest.raises(ValueError, match=message):
        _estimator(store=store, **kwargs).fit(df)


def test_strategy_param_values():
    with pytest.raises(ValueError, match="multi_worker_mirrored"):
        KerasEstimator(strategy="ddp")
    with pytest.raises(ValueError, match="num_ps must be None or an integer >= 1, got 0"):
        KerasEstimator(num_ps=0)
    assert KerasEstimator().getStrategy() == "multi_worker_mirrored"


def test_torch_parameter_server_points_to_keras():
    with pytest.raises(ValueError, match="KerasEstimator strategy"):
        TorchEstimator(strategy="parameter_server")
