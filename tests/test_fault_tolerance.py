"""Checkpoints, resume and retries with real failures: a SIGKILLed Python worker, an exception
on every attempt, a time limit, a second fit of the same run.

Full tier: test_killed_rank_resumes_from_last_checkpoint. Only it has a fit survive a dead
rank: rank 1's Python worker SIGKILLed once mid-epoch, Spark's retry of the barrier stage, and
the second attempt resuming in the same fit from the checkpoint after epoch 2 to a model that
predicts. The quick tier's kills recur on every attempt (the fit gives up, naming the rank), and
its resumes are second fits after a clean end or (test_epochs.py) driven without Spark."""
from __future__ import annotations

import os

import pytest

from sparktrain import CheckpointError, TrainingError
from sparktrain.data.store import Store
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import KillRankOnce, linear_estimator


def _estimator(store, run_id, **kwargs):
    params = dict(batch_size=100, epochs=4, random_seed=1, run_id=run_id, verbose=1)
    return linear_estimator(store, **dict(params, **kwargs))


def _checkpoint(store, run_id):
    return Checkpoints(Store.create(store).run_path(run_id)).latest()


@pytest.mark.full
def test_killed_rank_resumes_from_last_checkpoint(spark, regression_df, store, tmp_path):
    # 1000 rows per rank, batch 100: 10 steps per epoch; batch 24 is the 4th of epoch 3.
    est = _estimator(store, "kill-run", transformation_fn=KillRankOnce(str(tmp_path / "m"), 24))
    model = est.fit(regression_df.select("features", "label"))
    assert os.path.exists(tmp_path / "m"), "the fault was not injected"
    history = model.getHistory()["loss"]
    assert len(history) == 4 and history[-1] < history[0]
    latest = _checkpoint(store, "kill-run")
    assert latest.epochs_done == 4
    # attempt 2 started at epoch 3 (index 2): only the killed part of epoch 3 was repeated
    assert [(a["attempt"], a["start_epoch"]) for a in latest.meta["attempts"]] == [(0, 0), (1, 2)]
    predictions = model.transform(regression_df).select("label", "label__output").toPandas()
    mse = ((predictions["label"] - predictions["label__output"]) ** 2).mean()
    assert mse < 1.0


class _KilledEveryAttempt:
    """transformation_fn: rank 1 prints a line, waits for it to reach the driver, then
    SIGKILLs its own process (what the out-of-memory killer does), on every attempt."""

    def __call__(self, batch):
        import signal
        import time

        from pyspark import BarrierTaskContext

        if BarrierTaskContext.get().partitionId() == 1:
            print("rank 1 about to allocate 80 GiB", flush=True)
            time.sleep(1.5)  # > the events' flush interval
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def test_a_rank_killed_by_a_signal_is_named_with_its_last_lines(spark, regression_df, store):
    est = _estimator(store, "oom-run", transformation_fn=_KilledEveryAttempt(), max_attempts=2)
    with pytest.raises(TrainingError) as info:
        est.fit(regression_df.select("features", "label"))
    error = info.value
    assert error.rank == 1 and error.attempts == 2, (error.rank, error.attempts, str(error))
    summary = str(error).splitlines()[0]
    assert "rank 1's process" in summary and "ended without a Python error" in summary
    assert "killed by a signal" in summary and "out-of-memory" in summary
    assert "rank 1 about to allocate 80 GiB" in error.remote_traceback
    assert "gloo" not in summary  # not the survivor's view of it


def _peer_always_lost(batch):
    raise ConnectionResetError("Connection reset by peer")  # what a collective says


def test_repeating_fault_gives_up_after_max_attempts(spark, regression_df, store):
    est = _estimator(store, "fail-run", transformation_fn=_peer_always_lost, max_attempts=2)
    with pytest.raises(TrainingError, match="Connection reset by peer") as info:
        est.fit(regression_df.select("features", "label"))
    assert info.value.attempts == 2
    assert "ConnectionResetError: Connection reset by peer" in info.value.remote_traceback
    spark.range(3).count()  # the session still works


def test_max_time_stops_at_epoch_end_with_checkpoint(spark, regression_df, store):
    est = _estimator(store, "timed-run", epochs=50, max_time=0.01)
    with pytest.warns(RuntimeWarning, match="max_time=0.01s reached"):
        model = est.fit(regression_df.select("features", "label"))
    assert len(model.getHistory()["loss"]) == 1
    assert _checkpoint(store, "timed-run").epochs_done == 1
    assert model.transform(regression_df).count() == 2000


def test_fit_with_existing_run_id_resumes(spark, regression_df, store):
    df = regression_df.select("features", "label")
    first = _estimator(store, "resumed-run", epochs=2).fit(df)
    assert _checkpoint(store, "resumed-run").epochs_done == 2
    second = _estimator(store, "resumed-run", epochs=3).fit(df)
    assert second.getHistory()["loss"][:2] == first.getHistory()["loss"]
    assert len(second.getHistory()["loss"]) == 3
    attempts = _checkpoint(store, "resumed-run").meta["attempts"]
    assert [a["start_epoch"] for a in attempts] == [0, 2]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    ckpts = Checkpoints(str(tmp_path / "run"), keep=2)
    assert ckpts.latest() is None
    for epoch in (1, 2, 3):
        ckpts.write(epoch, f"weights {epoch}".encode(), {"history": {"loss": [1.0] * epoch}})
    # a crash while writing epoch 4: payload written, marker never renamed into place
    root = tmp_path / "run" / "checkpoints"
    (root / "epoch-000004.ckpt").write_bytes(b"half")
    (root / "epoch-000004.json.tmp-dead").write_bytes(b"{")
    latest = ckpts.latest()
    assert latest.epochs_done == 3 and ckpts.read(latest) == b"weights 3"
    assert sorted(p.name for p in root.glob("*.json")) == ["epoch-000002.json",
                                                             "epoch-000003.json"]


def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path):
    ckpts = Checkpoints(str(tmp_path / "run"), keep=2)
    assert ckpts.latest_intact() == (None, None)
    for epoch in (1, 2):
        ckpts.write(epoch, f"weights {epoch}".encode() * 100, {"history": {}})
    root = tmp_path / "run" / "checkpoints"
    newest = root / "epoch-000002.ckpt"
    newest.write_bytes(newest.read_bytes()[:-7])  # truncated after it was written
    warnings = []
    latest, data = ckpts.latest_intact(warn=warnings.append)
    assert latest.epochs_done == 1 and data == b"weights 1" * 100
    assert len(warnings) == 1 and str(newest) in warnings[0] and "truncated" in warnings[0]
    older = root / "epoch-000001.ckpt"
    older.write_bytes(b"X" + older.read_bytes()[1:])  # same size, other bytes
    with pytest.raises(CheckpointError) as info:
        ckpts.latest_intact()
    message = str(info.value)
    assert str(newest) in message and str(older) in message and "SHA-256" in message
    (root / "epoch-000002.json").write_bytes(b"\xff{not json")
    with pytest.raises(CheckpointError, match="epoch-000002.json \\(unreadable"):
        ckpts.latest_intact()


def test_a_fit_resumes_from_the_newest_intact_checkpoint(spark, regression_df, store, caplog):
    df = regression_df.select("features", "label")
    first = _estimator(store, "damaged-run", epochs=3).fit(df)
    checkpoints = Checkpoints(Store.create(store).run_path("damaged-run"))
    newest = checkpoints.latest()
    assert newest.epochs_done == 3
    with open(newest.payload_path, "r+b") as f:  # the disk lost its tail
        f.truncate(os.path.getsize(newest.payload_path) // 2)
    with caplog.at_level("WARNING"):
        second = _estimator(store, "damaged-run", epochs=4).fit(df)
    # epoch 3 is trained again from the checkpoint after epoch 2: one epoch lost, not the run
    assert second.getHistory()["loss"][:2] == first.getHistory()["loss"][:2]
    assert len(second.getHistory()["loss"]) == 4
    assert any(newest.payload_path in r.getMessage() and "truncated" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    attempts = checkpoints.latest().meta["attempts"]
    assert [a["start_epoch"] for a in attempts] == [0, 2]
    for epochs_done in (3, 4):  # nothing intact left: the fit fails at once, naming the files
        with open(checkpoints.at(epochs_done).payload_path, "wb") as f:
            f.write(b"garbage")
    with pytest.raises(TrainingError, match="no intact checkpoint") as info:
        _estimator(store, "damaged-run", epochs=6).fit(df)
    assert info.value.attempts == 1 and "epoch-000004.ckpt" in str(info.value)


def test_run_of_another_framework_is_refused_before_training(spark, regression_df, store):
    Checkpoints(Store.create(store).run_path("keras-made")).write(
        1, b"npz", {"history": {}, "framework": "keras"})
    with pytest.raises(ValueError, match="holds a keras run's checkpoints; TorchEstimator "
                                         "cannot resume it"):
        _estimator(store, "keras-made").fit(regression_df.select("features", "label"))
