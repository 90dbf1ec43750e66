"""KerasEstimator with backend="tfos": a TensorFlowOnSpark cluster (chief + worker) over 2 real
barrier tasks, training with the same Keras worker as backend="tensorflow".

Full tier: only these tests start TFoS clusters, so only they catch TFoS's node start-up, its
reservation server or its shutdown (sc.stop(), sys.exit) breaking a fit, a retry or the driver's
session, and the demo job failing to learn on backend="tfos"."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflowonspark")

from sparktrain import KerasEstimator, TrainingError  # noqa: E402 - after the importorskip above
from sparktrain.launch import (  # noqa: E402 - after the importorskip above
    KERAS_BACKENDS,
    check_backend,
    tfos,  # noqa: E402 - after the importorskip above
)
from support.helpers import check_keras_classifier, check_keras_pipeline  # noqa: E402 - after the importorskip above

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- no Spark job ------------------------------------------------------------------------------

def test_cluster_layout_matches_tfcluster_run():
    """TFCluster.run(num_executors=n, num_ps=0, master_node="chief") places chief on node 0 and
    workers on the rest; the TF_CONFIG and rank follow from TFoS's node context."""
    assert tfos.cluster_template(1) == {"chief": [0]}
    assert tfos.cluster_template(3) == {"chief": [0], "worker": [1, 2]}
    ranks = [tfos.node_rank("chief", 0), tfos.node_rank("worker", 0), tfos.node_rank("worker", 1)]
    assert ranks == [0, 1, 2]
    spec = {"chief": ["h:1"], "worker": ["h:2", "h:3"]}
    assert json.loads(tfos.node_tf_config(spec, "worker", 1)) == {
        "cluster": spec, "task": {"type": "worker", "index": 1}}


def test_import_leaves_root_logger_and_reservations_stop(spark):
    """tensorflowonspark's import runs logging.basicConfig(INFO): import_quietly undoes it.
    The reservation server's listener closes at once when stopped (not at its 60 s select)."""
    code = ("import logging\nfrom sparktrain.launch import import_quietly\n"
            "import_quietly('tensorflowonspark')\n"
            "print(len(logging.getLogger().handlers), logging.getLogger().level)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["0", str(logging.WARNING)], result.stderr

    server, meta = tfos.start_reservations(spark.sparkContext, 2)
    assert meta["server_addr"][0] == "127.0.0.1"  # spark.driver.host, not TFoS's 8.8.8.8 probe
    socket.create_connection(meta["server_addr"], timeout=2).close()
    tfos.stop_reservations(server, meta["server_addr"])
    for _ in range(50):
        try:
            socket.create_connection(meta["server_addr"], timeout=1).close()
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the reservation server still accepts connections after stop")


def test_missing_tensorflowonspark_fails_with_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflowonspark.TFSparkNode", None)
    with pytest.raises(ValueError, match=r"backend='tfos' needs 'tensorflowonspark.TFSparkNode'"
                                         r".*pip install 'sparktrain\[tfos\]'"):
        check_backend(KERAS_BACKENDS, "tfos")


# -- end to end ----------------------------------------------------------------------------------

def failing_loss(y_true, y_pred):
    if "TF_CONFIG" in os.environ:  # on the nodes only: the driver's preflight passes
        raise ValueError("this tfos loss always fails")
    return keras.losses.mean_squared_error(y_true, y_pred)


@pytest.mark.full
def test_failing_worker_raises_training_error_and_session_survives(spark, store, regression_df):
    """TFCluster.shutdown would sc.stop() and sys.exit(1) here: the fit raises TrainingError
    with the node's traceback, the session runs jobs, and the next tfos fit (in the test below)
    starts a fresh cluster."""
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=net, optimizer="sgd", loss=failing_loss,
                         feature_cols=["features"], label_cols=["label"], epochs=1,
                         store=store, verbose=0, backend="tfos", max_attempts=1)
    with pytest.raises(TrainingError, match="this tfos loss always fails") as info:
        est.fit(regression_df)
    assert "failing_loss" in info.value.remote_traceback
    assert "TFSparkNode" in info.value.remote_traceback  # it failed inside TFoS's node start-up
    assert spark.sparkContext._jsc is not None
    assert spark.range(100).selectExpr("sum(id)").first()[0] == 4950


class FailWorkerOnce:
    """A transformation_fn that fails in the TFoS ``worker`` node (rank 1) at its ``at``-th
    batch, once per marker file, so the retried attempt runs through. It raises what a lost
    peer looks like (a fault, retried); a bug of the user's would not be retried."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at, self.seen = marker, at, 0

    def __call__(self, batch):
        self.seen += 1
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        if task["type"] == "worker" and self.seen == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise ConnectionResetError("Connection reset by peer (injected once)")
        return batch


@pytest.mark.full
def test_retried_attempt_gets_a_fresh_cluster_and_resumes(spark, store, regression_df, tmp_path,
                                                          caplog):
    """Spark re-runs the failed stage; the second attempt forms a new TFoS cluster (new
    reservation server, new ports) and resumes from the checkpoint of epoch 1."""
    from sparktrain.data.store import Store
    from sparktrain.loop.checkpoint import Checkpoints

    keras.utils.set_random_seed(2)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    # 1600 training rows: 800 per worker, batch 200: 4 steps/epoch; batch 6 is in epoch 2
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                         feature_cols=["features"], label_cols=["label"], batch_size=200,
                         epochs=3, validation="is_val", random_seed=1, store=store, verbose=1,
                         run_id="tfos-retry", backend="tfos", max_attempts=2,
                         transformation_fn=FailWorkerOnce(str(tmp_path / "marker"), 6))
    with caplog.at_level(logging.INFO, logger="sparktrain.rank"):
        model = est.fit(regression_df)
    assert os.path.exists(tmp_path / "marker"), "the fault was not injected"
    assert len(model.getHistory()["loss"]) == 3
    clusters = [r.getMessage() for r in caplog.records
                if "TensorFlowOnSpark cluster:" in r.getMessage()]
    assert len(clusters) == 2 and clusters[0] != clusters[1], clusters
    attempts = Checkpoints(Store.create(store).run_path("tfos-retry")).latest().meta["attempts"]
    assert [(a["attempt"], a["start_epoch"]) for a in attempts] == [(0, 0), (1, 1)]


@pytest.mark.full
@pytest.mark.stack
def test_fit_transform_save_load(spark, store, classification_df, tmp_path):
    root = logging.getLogger()
    logging_before = (list(root.handlers), root.level)
    check_keras_classifier(classification_df, str(tmp_path / "tfos-model"), epochs=5,
                           store=store, backend="tfos")
    # what TFoS would leave behind in this process or its cwd, it did not
    assert (list(root.handlers), root.level) == logging_before
    assert not os.path.exists("executor_id")


@pytest.mark.full
def test_pipeline_with_vector_assembler(spark, store, regression_df, tmp_path):
    check_keras_pipeline(regression_df, str(tmp_path / "pipeline"), store=store, backend="tfos")


@pytest.mark.full
def test_demo_job_on_tfos(tmp_path):
    result = subprocess.run(
        [sys.executable, "jobs/train_keras.py", "--demo", "--backend", "tfos",
         "--output", str(tmp_path / "digits-model"), "--store", str(tmp_path / "store"),
         "--epochs", "25"],  # the fewest that pass the 0.95 with margin (tests/test_jobs.py)
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["test_accuracy"] >= 0.95
    assert summary["reloaded_test_accuracy"] == summary["test_accuracy"]
    assert "[rank 0] TensorFlowOnSpark cluster: " in result.stderr
    assert "[rank 0] epoch 25/25" in result.stderr
