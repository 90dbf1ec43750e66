"""KerasEstimator: per-epoch checkpoints, resume after a killed worker, Keras callbacks,
max_time and a resumed run_id, on real TensorFlow worker processes.

Full tier: every test but test_unsupported_keras_loop_params_fail_before_training. No quick test
resumes, stops early or fails a Keras fit once it trains, so only these catch a SIGKILLed
TensorFlow worker process left unnamed or not resumed from its checkpoint by the retried
attempt, EarlyStopping, max_time or a resumed run_id not honoured by the Keras loop, and a Keras
callback's bug retried. Their torch counterparts, except the kill, run in the quick tier
(test_fault_tolerance.py, test_retries.py)."""
from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")

from sparktrain import KerasEstimator, TrainingError  # noqa: E402 - after the importorskip above
from sparktrain.data.store import Store  # noqa: E402 - after the importorskip above
from sparktrain.loop.checkpoint import Checkpoints  # noqa: E402 - after the importorskip above


def _estimator(store, run_id, **kwargs):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    params = dict(num_proc=2, model=net, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  feature_cols=["features"], label_cols=["label"], batch_size=100, epochs=3,
                  random_seed=1, store=store, run_id=run_id, verbose=1)
    params.update(kwargs)
    return KerasEstimator(**params)


def _attempts(store, run_id):
    latest = Checkpoints(Store.create(store).run_path(run_id)).latest()
    return latest.epochs_done, [(a["attempt"], a["start_epoch"]) for a in latest.meta["attempts"]]


class KillWorkerOnce:
    """transformation_fn: the TensorFlow worker process of rank 1 SIGKILLs itself at its
    ``at``-th batch, once (a marker file records it)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at, self.seen = marker, at, 0

    def __call__(self, batch):
        self.seen += 1
        if os.environ.get("TF_CONFIG", "").endswith('"index": 1}}') and self.seen == self.at \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


@pytest.mark.full
def test_killed_worker_resumes_from_checkpoint(spark, regression_df, store, tmp_path, caplog):
    df = regression_df.select("features", "label")
    # 10 batches per epoch and worker: batch 15 is the 5th of epoch 2
    est = _estimator(store, "keras-kill", transformation_fn=KillWorkerOnce(str(tmp_path / "m"), 15))
    with caplog.at_level("WARNING", logger="sparktrain"):
        model = est.fit(df)
    assert os.path.exists(tmp_path / "m")
    # the attempt's failure says which process, which signal, and that memory is the usual cause
    assert any("the TensorFlow worker process of rank 1 was killed by SIGKILL" in r.getMessage()
               and "out-of-memory" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert len(model.getHistory()["loss"]) == 3
    assert _attempts(store, "keras-kill") == (3, [(0, 0), (1, 1)])
    assert model.transform(df).count() == 2000


@pytest.mark.full
def test_keras_callbacks_max_time_and_resumed_run(spark, regression_df, store):
    df = regression_df.select("features", "label", "is_val")
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)
    est = _estimator(store, "keras-stop", optimizer=keras.optimizers.SGD(0.0), epochs=8,
                     validation="is_val", callbacks=[stopper])
    assert len(est.fit(df).getHistory()["val_loss"]) == 2  # lr 0: no improvement after epoch 1

    with pytest.warns(RuntimeWarning, match="max_time"):
        timed = _estimator(store, "keras-resume", epochs=5, max_time=0.01).fit(df)
    assert len(timed.getHistory()["loss"]) == 1
    resumed = _estimator(store, "keras-resume", epochs=2).fit(df)
    assert resumed.getHistory()["loss"][0] == timed.getHistory()["loss"][0]
    assert _attempts(store, "keras-resume") == (2, [(0, 0), (0, 1)])


def test_unsupported_keras_loop_params_fail_before_training(spark, regression_df, store):
    df = regression_df.select("features", "label")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        _estimator(store, "x", backward_passes_per_step=2).fit(df)
    with pytest.raises(ValueError, match="carries its dtype policy"):
        _estimator(store, "x", mixed_precision="bf16").fit(df)
    with pytest.raises(TypeError, match="keras.callbacks.Callback"):
        _estimator(store, "x", callbacks=[object()]).fit(df)


class FailingCallback(keras.callbacks.Callback):
    """A Keras callback with a bug that shows at the end of epoch 2."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise ValueError("callback bug at epoch 2")


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_keras_callback_error_fails_on_first_attempt(spark, regression_df, store):
    est = _estimator(store, "keras-callback-bug", callbacks=[FailingCallback()])
    with pytest.raises(TrainingError, match="callback bug at epoch 2") as info:
        est.fit(regression_df.select("features", "label"))
    assert info.value.attempts == 1
    assert "callback FailingCallback.on_epoch_end (user code): not retried" in str(info.value)
    assert _attempts(store, "keras-callback-bug") == (1, [(0, 0)])
