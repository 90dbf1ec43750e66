"""MLflow tracking against a real tracking server (``.venv-mlflow``'s ``mlflow server``, sqlite
backend, artifacts in a temp dir), checked through ``MlflowClient``: real 2-rank fits, live
metrics, the pyfunc, nested CrossValidator runs, a PipelineModel through ``mlflow.spark``, a
stopped server, Spark Connect.

Full tier: every test but test_unreachable_server_gives_one_warning_and_the_fit_succeeds. Only
they log to a live server, so only they catch what reaches it wrong: metrics during the fit,
params (backend_env's values left out), tags, artifacts, pyfunc, pytorch and keras models that
predict as transform does, nested CrossValidator runs, mlflow.spark's round trip, runs logged
unasked, and the same over Spark Connect. The quick tier has the unreachable server only (and
test_fit_hooks.py's loading of the hook)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra (mlflow-skinny): the "
                             "primary stack's setup installs it, the classic spark35 stack's "
                             "does not")

from support.helpers import linear_estimator  # noqa: E402 - after the importorskip above
from support.standalone import free_port  # noqa: E402 - after the importorskip above


@pytest.fixture(scope="module")
def tracking_uri(mlflow_server):
    """The worker's tracking server (tests/support/servers.py), this module's experiment."""
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("sparktrain-tests")
    return mlflow_server


@pytest.fixture
def autologged(tracking_uri):
    import sparktrain.mlflow

    sparktrain.mlflow.autolog()
    yield mlflow.MlflowClient(tracking_uri)
    sparktrain.mlflow.autolog(disable=True)


def _history(client, run_id, key):
    return [m.value for m in sorted(client.get_metric_history(run_id, key),
                                    key=lambda m: m.step)], \
        sorted(m.step for m in client.get_metric_history(run_id, key))


def _artifacts(client, run_id, path=None):
    found = []
    for item in client.list_artifacts(run_id, path):
        found += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return found


@pytest.mark.full  # needs the worker's MLflow tracking server
def test_torch_fit_is_tracked_live_with_its_model(autologged, regression_df, store):
    client = autologged
    seen_live = []
    done = threading.Event()

    def poll():  # a driver-side thread: the metric is on the server while the fit runs
        while not done.is_set():
            runs = client.search_runs([mlflow.get_experiment_by_name("sparktrain-tests")
                                      .experiment_id], "tags.`sparktrain.run_id` = 'live-torch'")
            if runs and "loss" in runs[0].data.metrics and \
                    runs[0].info.status == "RUNNING":
                seen_live.append(runs[0].data.metrics["loss"])
                return
            time.sleep(0.3)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    est = linear_estimator(store, epochs=3, batch_size=64, validation=0.2, run_id="live-torch",
                           backend_env={"SECRET_TOKEN": "hunter2"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", sparktrain_warning())
        model = est.fit(regression_df)
    done.set()
    watcher.join(5)
    assert seen_live, "no metric reached the server while the fit was running"
    run = client.search_runs([mlflow.get_experiment_by_name("sparktrain-tests").experiment_id],
                             "tags.`sparktrain.run_id` = 'live-torch'")[0]
    rid = run.info.run_id
    assert run.info.status == "FINISHED"
    history = model.getHistory()
    for key in ("loss", "val_loss"):
        values, steps = _history(client, rid, key)
        assert steps == [0, 1, 2] and values == pytest.approx(history[key])
    params = run.data.params
    assert params["epochs"] == "3" and params["num_proc"] == "2"
    assert params["model"] == "Linear" and params["optimizer"] == "SGD"
    assert params["backend_env"] == "SECRET_TOKEN"
    assert "hunter2" not in json.dumps(params) + json.dumps(run.data.tags)
    tags = run.data.tags
    assert tags["sparktrain.engine"] == "torch" and tags["sparktrain.strategy"] == "ddp"
    assert tags["sparktrain.num_proc"] == "2" and tags["sparktrain.outcome"] == "finished"
    assert tags["sparktrain.store_run_path"].endswith("live-torch")
    assert tags["sparktrain.version.pyspark"] and tags["sparktrain.attempts"] == "1"
    files = _artifacts(client, rid)
    assert "sparktrain/history.png" in files and "sparktrain/attempts.json" in files
    assert any(f.startswith("tensorboard/") for f in files), files
    # the pyfunc predicts what transform predicts, from a pandas frame of the feature column
    test = regression_df.limit(50)
    expected = model.transform(test).select("label__output").toPandas()["label__output"]
    frame = test.select("features").toPandas()
    frame["features"] = frame["features"].map(lambda v: v.toArray().tolist())
    pyfunc = mlflow.pyfunc.load_model(tags["sparktrain.model_uri.pyfunc"])
    got = pyfunc.predict(frame)["label__output"]
    assert got.to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-6)
    torch_model = mlflow.pytorch.load_model(tags["sparktrain.model_uri.pytorch"])
    import torch

    assert torch.equal(torch_model.state_dict()["weight"], model.getModel().state_dict()["weight"])


def sparktrain_warning():
    from sparktrain.mlflow.tracking import MlflowLoggingWarning

    return MlflowLoggingWarning


def _runs(client, query):
    experiment = mlflow.get_experiment_by_name("sparktrain-tests").experiment_id
    return client.search_runs([experiment], query)


@pytest.mark.full
def test_keras_fit_is_tracked(autologged, classification_df, store):
    import keras

    from sparktrain import KerasEstimator

    client = autologged
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(0.05),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         feature_cols=["features"], label_cols=["label"], batch_size=32,
                         epochs=2, store=store, run_id="keras-tracked", verbose=0)
    model = est.fit(classification_df)
    run = _runs(client, "tags.`sparktrain.run_id` = 'keras-tracked'")[0]
    values, steps = _history(client, run.info.run_id, "loss")
    assert steps == [0, 1] and values == pytest.approx(model.getHistory()["loss"])
    assert run.data.params["model"] == "Sequential"
    assert run.data.tags["sparktrain.engine"] == "tensorflow"
    assert "sparktrain/history.png" in _artifacts(client, run.info.run_id)
    expected = model.transform(classification_df.limit(20)).toPandas()["label__output"]
    frame = classification_df.limit(20).select("features").toPandas()
    got = mlflow.pyfunc.load_model(run.data.tags["sparktrain.model_uri.pyfunc"]).predict(frame)
    import numpy as np

    assert np.allclose(np.stack(got["label__output"].to_numpy()),
                       np.stack(expected.to_numpy()), rtol=1e-5)
    assert run.data.tags["sparktrain.model_uri.keras"].startswith("models:/")


@pytest.mark.full
def test_cross_validator_gives_nested_runs(autologged, regression_df, store):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    client = autologged
    sparktrain_autolog = __import__("sparktrain.mlflow", fromlist=["autolog"]).autolog
    sparktrain_autolog(log_models=False)
    est = linear_estimator(store, epochs=1, batch_size=100)
    grid = ParamGridBuilder().addGrid(est.epochs, [1, 2]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                        evaluator=RegressionEvaluator(predictionCol="label__output"))
    with mlflow.start_run(run_name="tuning") as parent:
        cv.fit(regression_df.limit(400))
    children = _runs(client, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 5  # 2 folds x 2 param maps + the best model refit
    assert sorted(int(c.data.params["epochs"]) for c in children) == [1, 1, 2, 2, 2]
    assert all(c.info.status == "FINISHED" for c in children)


@pytest.mark.full
def test_pipeline_model_round_trips_through_mlflow_spark(tracking_uri, regression_df, store,
                                                        tmp_path):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler

    scaler = StandardScaler(inputCol="features", outputCol="scaled")
    est = linear_estimator(store, epochs=1, batch_size=100, feature_cols=["scaled"])
    fitted = Pipeline(stages=[scaler, est]).fit(regression_df)
    with mlflow.start_run():
        info = mlflow.spark.log_model(fitted, "pipeline", dfs_tmpdir=str(tmp_path / "dfs"))
    loaded = mlflow.spark.load_model(info.model_uri, dfs_tmpdir=str(tmp_path / "load"))
    test = regression_df.limit(30)
    expected = fitted.transform(test).select("label__output").toPandas()
    got = loaded.transform(test).select("label__output").toPandas()
    assert got["label__output"].to_numpy() == pytest.approx(
        expected["label__output"].to_numpy(), rel=1e-6)
    assert type(loaded.stages[-1]).__name__ == "TorchModel"


def test_unreachable_server_gives_one_warning_and_the_fit_succeeds(regression_df, store,
                                                                     monkeypatch):
    import sparktrain.mlflow
    from sparktrain.mlflow import tracking

    monkeypatch.setattr(tracking, "GRACE_SECONDS", 2.0)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    sparktrain.mlflow.autolog()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.time()
            model = linear_estimator(store, epochs=2, batch_size=100).fit(regression_df)
            seconds = time.time() - started
    finally:
        sparktrain.mlflow.autolog(disable=True)
        mlflow.set_tracking_uri(previous)
    ours = [w for w in caught if issubclass(w.category, tracking.MlflowLoggingWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert len(model.getHistory()["loss"]) == 2
    assert seconds < 120


@pytest.mark.full  # needs the worker's MLflow tracking server
def test_nothing_is_logged_unless_asked(tracking_uri, regression_df, store):
    from sparktrain.mlflow.config import settings

    assert settings() is None and settings(False) is None and settings(True) is not None
    client = mlflow.MlflowClient(tracking_uri)
    linear_estimator(store, epochs=1, batch_size=100, run_id="not-logged").fit(regression_df)
    assert not _runs(client, "tags.`sparktrain.run_id` = 'not-logged'")
    linear_estimator(store, epochs=1, batch_size=100, run_id="logged-by-param",
                     mlflow_logging=True).fit(regression_df)
    assert _runs(client, "tags.`sparktrain.run_id` = 'logged-by-param'")


@pytest.mark.full
def test_the_same_over_spark_connect(tracking_uri, connect_server, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    env.update(MLFLOW_TRACKING_URI=tracking_uri, MLFLOW_EXPERIMENT_NAME="sparktrain-tests")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support",
                                                          "connect_client.py"),
                             "mlflow", connect_server.url, str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["session"] == "connect" and found["status"] == "FINISHED"
    assert found["logged"] == pytest.approx(found["history"]) and len(found["logged"]) == 2
    assert found["pyfunc"] == pytest.approx(found["expected"], rel=1e-6)
