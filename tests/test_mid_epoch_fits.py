"""Checkpoints inside an epoch through Spark: a Ctrl-C at about 40% of epoch 2 and a fit with
the same ``run_id`` (torch and Keras), and a rank killed mid-epoch (a retried attempt), resume
inside the epoch, training only the batches after the checkpoint. The unit tests (reader skip,
trigger, names, exact resume of the rank loops): tests/test_mid_epoch_checkpoints.py.

Full tier: the whole file (each test is marked full). Only these take a mid-epoch resume
through Spark: a real Ctrl-C of the fit (torch and Keras, rows from the store and fed beside
the ranks), a SIGKILLed rank whose retried barrier attempt resumes inside the epoch, and fed
rows read again each epoch resumed by id. The quick tier (test_mid_epoch_checkpoints.py,
test_epochs.py, test_row_feed.py) resumes the loops, positions and readers without Spark, after
an exception raised in the process."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sparktrain.data.store import Store
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import id_net, linear_estimator

# 2000 rows on 2 ranks, 25 a batch: 40 steps an epoch; a checkpoint every 4 (a tenth)
STEPS, EVERY, BATCH = 40, 4, 25
MODES = ["store", "stream"]


class Beats:
    """transformation_fn: a line per batch a rank trains in ``path`` (not the driver's
    preflight), a little sleep so that an epoch lasts; once ``path + ".stop"`` exists the
    ranks train no further batch (they wait until the fit's interrupt stops them); with
    ``kill_at``, rank 1 SIGKILLs its process at that batch of the fit, once (``path +
    ".killed"`` marks it)."""

    def __init__(self, path: str, seconds: float = 0.0, kill_at: int = 0) -> None:
        self.path, self.seconds, self.kill_at, self.seen = path, seconds, kill_at, 0

    def __call__(self, batch):
        if not _in_rank():
            return batch
        while os.path.exists(self.path + ".stop"):
            time.sleep(0.5)
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        self.seen += 1
        if self.kill_at and self.seen == self.kill_at and not os.path.exists(self.path + ".killed"):
            from pyspark import BarrierTaskContext

            if BarrierTaskContext.get().partitionId() == 1:
                open(self.path + ".killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.seconds)
        return batch


def _in_rank() -> bool:
    """Whether this runs in a rank (a barrier task, or a Keras rank's TensorFlow process)."""
    try:
        from pyspark import BarrierTaskContext

        BarrierTaskContext.get().partitionId()
        return True
    except Exception:  # noqa: BLE001 - the driver's preflight, or a Keras rank's TF process
        return "TF_CONFIG" in os.environ


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def _latest(store: str, run_id: str):
    return Checkpoints(Store.create(store).run_path(run_id)).latest()


def _keras(store: str, **params):
    import keras

    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    return KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.05),
                          loss="mse", feature_cols=["features"], label_cols=["label"],
                          store=store, random_seed=0, steps_per_execution=2, **params)


def _estimator(framework: str, store: str, **params):
    params = dict(batch_size=BATCH, checkpoint_steps=EVERY, verbose=1, **params)
    return linear_estimator(store, **params) if framework == "torch" else _keras(store, **params)


def _interrupt_when(path: str, lines: int) -> None:
    """Ctrl-C (SIGINT to this process) once ``path`` holds ``lines`` lines; the ranks' next
    batches wait (``Beats``), so that they stop where the interrupt came, however long the
    cancellation takes."""
    def watch() -> None:
        deadline = time.time() + 120
        while _lines(path) < lines and time.time() < deadline:
            time.sleep(0.02)
        open(path + ".stop", "w").close()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def _quiet(path: str, seconds: float = 3.0) -> None:
    """Wait until no rank has written to ``path`` for ``seconds``."""
    deadline = time.time() + 60
    while time.time() < deadline and time.time() - os.path.getmtime(path) < seconds:
        time.sleep(0.2)


@pytest.mark.full
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["torch", "keras"])
@pytest.mark.parametrize("input_mode", MODES)
def test_a_ctrl_c_inside_an_epoch_resumes_there(spark, regression_df, store, tmp_path,
                                                framework, input_mode):
    if framework == "keras":
        pytest.importorskip("tensorflow")
    df = regression_df.select("features", "label")
    run_id = f"mid-epoch-ctrl-c-{framework}-{input_mode}"
    beats = str(tmp_path / "beats")
    _interrupt_when(beats, 2 * (STEPS + 18))  # each rank 45% into epoch 2
    with pytest.raises(KeyboardInterrupt):
        _estimator(framework, store, epochs=3, run_id=run_id, input_mode=input_mode,
                   transformation_fn=Beats(beats, 0.05)).fit(df)
    _quiet(beats)  # (the stop file stays: a rank process not yet gone trains no further)
    latest = _latest(store, run_id)
    assert latest.epochs_done == 1 and latest.step % EVERY == 0, (latest.epochs_done,
                                                                  latest.step)

    after = str(tmp_path / "after")
    model = _estimator(framework, store, epochs=2, run_id=run_id, input_mode=input_mode,
                       transformation_fn=Beats(after)).fit(df)
    attempts = _latest(store, run_id).meta["attempts"]
    start = attempts[-1].get("start_step", 0)  # the newest checkpoint when it resumed
    assert attempts[-1]["start_epoch"] == 1 and start >= latest.step
    # each rank trains the rest of epoch 2 only (a Keras rank reads one more row after
    # training, for the output shapes): at most 70% of an epoch
    extra = 2 if framework == "keras" else 0
    steps = latest.meta["steps"]  # stream: 1001 rows for a rank after the shuffle: 41
    assert _lines(after) - extra == 2 * (steps - start)
    assert steps - start <= 0.7 * steps
    assert len(model.getHistory()["loss"]) == 2


@pytest.mark.full
@pytest.mark.timeout(300)
@pytest.mark.parametrize("input_mode", MODES)
def test_a_rank_killed_inside_an_epoch_resumes_there(spark, regression_df, store, tmp_path,
                                                     input_mode):
    df = regression_df.select("features", "label")
    run_id = f"mid-epoch-kill-{input_mode}"
    beats = str(tmp_path / "beats")
    # rank 1's batch 56: 40% into epoch 2
    model = _estimator("torch", store, epochs=2, run_id=run_id, input_mode=input_mode,
                       transformation_fn=Beats(beats, kill_at=STEPS + 16)).fit(df)
    assert os.path.exists(beats + ".killed"), "the fault was not injected"
    attempts = _latest(store, run_id).meta["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    resumed = attempts[-1]
    assert resumed["start_epoch"] == 1 and 0 < resumed.get("start_step", 0) <= 16
    # trained: 2 ranks x (56 batches of attempt 1, minus the killed one on rank 1, about)
    # then 2 x (40 - start_step): the retry trained only the rest of epoch 2
    assert _lines(beats) <= 2 * (STEPS + 16) + 2 * (STEPS - resumed["start_step"]) + 4
    assert len(model.getHistory()["loss"]) == 2


class RecordIds(Beats):
    """``Beats`` that writes each batch's ``id`` column (one line a batch, in training
    order: the rank's batches are transformed in its training thread, just before each
    trains)."""

    def __call__(self, batch):
        if _in_rank():
            while os.path.exists(self.path + ".stop"):
                time.sleep(0.5)
            with open(self.path, "a") as f:
                f.write(" ".join(str(int(i)) for i in batch["id"].ravel()) + "\n")
            time.sleep(self.seconds)
        return batch


def _id_lines(path: str):
    with open(path) as f:
        return [[int(v) for v in line.split()] for line in f if line.strip()]


@pytest.mark.full
@pytest.mark.timeout(300)
def test_a_ctrl_c_inside_a_reread_epoch_resumes_with_exactly_the_rows_left(
        spark, regression_df, store, tmp_path):
    """Rows fed beside the rank and read again every epoch (a cache_limit below the shard):
    the resumed epoch trains exactly the rows the interrupted one had not, by id (the rows
    arrive in another order each time they are fed, so a count of batches would not say
    which). The first epoch is read the same way as later ones here (nothing is cached)."""
    import torch
    from pyspark.sql import functions as F

    from sparktrain import TorchEstimator

    df = regression_df.select("features", "label").withColumn(
        "id", F.monotonically_increasing_id())
    ids = {r["id"] for r in df.select("id").collect()}

    def estimator(path, epochs, seconds=0.0):
        net = id_net()
        return TorchEstimator(
            num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.01),
            loss=torch.nn.MSELoss(), feature_cols=["id", "features"], label_cols=["label"],
            batch_size=BATCH, epochs=epochs, input_mode="stream", cache_limit=4096,
            checkpoint_steps=EVERY, run_id="mid-epoch-reread", store=store, random_seed=1,
            verbose=1, transformation_fn=RecordIds(path, seconds))

    beats = str(tmp_path / "beats")
    _interrupt_when(beats, 30)  # about 40% into the first epoch (80 batches on one rank)
    with pytest.raises(KeyboardInterrupt):
        estimator(beats, 1, 0.03).fit(df)
    _quiet(beats)
    latest = _latest(store, "mid-epoch-reread")
    assert latest.epochs_done == 0 and latest.step and latest.meta["positions"], latest.meta
    before = _id_lines(beats)[:latest.step]  # the batches up to the checkpoint
    after = str(tmp_path / "after")
    estimator(after, 1).fit(df)
    rest = _id_lines(after)
    trained = [i for line in before + rest for i in line]
    assert len(trained) == len(set(trained)) and set(trained) == ids  # each row once
