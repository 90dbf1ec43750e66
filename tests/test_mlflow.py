"""MLflow tracking against a real tracking server (``.venv-mlflow``'s ``mlflow server``, sqlite
backend, artifacts in a temp dir), checked through ``MlflowClient``: real 2-rank fits, live
metrics, the pyfunc, nested CrossValidator runs, a PipelineModel through ``mlflow.spark``, a
stopped server, Spark Connect."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, ".venv-mlflow", "bin", "mlflow")

mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra (mlflow-skinny): the "
                             "primary stack installs it, the classic spark35 stack cannot")
if not os.path.exists(SERVER):
    pytest.skip("needs .venv-mlflow (scripts/setup.sh creates it on the primary stack)",
                allow_module_level=True)

from helpers import linear_estimator  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    server = subprocess.Popen(
        [SERVER, "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
         "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, \
                (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("sparktrain-tests")
    yield uri
    server.terminate()
    server.wait(30)


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
    assert type(torch_model).__name__ == "Linear"


def sparktrain_warning():
    from sparktrain.mlflow.tracking import MlflowLoggingWarning

    return MlflowLoggingWarning
