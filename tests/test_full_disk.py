"""A store that runs out of space, on a real full disk (a small tmpfs mounted by the test, as
root): one clear error naming the store path and the size, nothing half-written kept, the
earlier checkpoint intact, and a fit that works once room is made."""
from __future__ import annotations

import errno
import os
import re

import pytest

from sparktrain import StoreFullError, TrainingError
from sparktrain.data.store import Store
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import linear_estimator


def _estimator(store: str, model, **params):
    import torch

    return linear_estimator(store, model=model, lr=0.05, **dict(
        params, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)))


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, files in os.walk(folder) for f in files)


def test_a_checkpoint_without_room_fails_clearly_and_keeps_the_previous(tmpfs):
    disk = tmpfs("1m")
    ckpts = Checkpoints(str(disk / "run"))
    ckpts.write(1, b"w" * 1000, {"history": {}})
    with pytest.raises(StoreFullError) as info:
        ckpts.write(2, b"w" * (2 << 20), {"history": {}})
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    message = str(error)
    assert "out of space" in message and "the checkpoint after epoch 2" in message
    assert str(disk / "run" / "checkpoints") in message and "needed 2.0 MiB" in message
    assert "MiB free there now" in message
    # the previous checkpoint is whole, nothing of the failed one (not even a temporary file)
    assert _files(disk / "run") == ["checkpoints/epoch-000001.ckpt",
                                    "checkpoints/epoch-000001.json"]
    assert ckpts.latest_intact()[0].epochs_done == 1
    ckpts.write(2, b"w" * 1000, {"history": {}})  # room enough for a small one
    assert ckpts.latest_intact()[0].epochs_done == 2


def test_a_dataset_without_room_fails_before_training_and_works_after(spark, tmpfs):
    import torch
    from pyspark.sql import functions as F

    disk = tmpfs("2m")
    # 100,000 rows of 16 random floats: about 7 MB of Parquet
    df = spark.range(100_000, numPartitions=2).select(
        F.array(*[F.rand(i) for i in range(16)]).alias("features"), F.rand(99).alias("label"))

    est = _estimator(str(disk / "store"), torch.nn.Linear(16, 1), epochs=1, batch_size=500)
    with pytest.raises(StoreFullError) as info:
        est.fit(df)
    message = str(info.value)
    assert "out of space" in message and "the dataset to " in message
    assert str(disk / "store" / "datasets") in message
    assert re.search(r"a row takes \d+ bytes", message)
    assert "Py4JJavaError" not in message and len(message) < 1500
    assert not [f for f in _files(disk) if f.endswith(".parquet")]  # no half dataset kept
    tmpfs.resize(disk, "64m")  # the user makes room
    assert len(est.fit(df).getHistory()["loss"]) == 1


def test_a_fit_whose_checkpoint_finds_no_room_stops_and_resumes_after(spark, regression_df,
                                                                      tmpfs):
    import torch

    class Wide(torch.nn.Module):  # 2.5 MB of weights: each checkpoint is that big
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)
            self.unused = torch.nn.Parameter(torch.zeros(640_000))

        def forward(self, x):
            return self.linear(x) + 0 * self.unused[:1]

    disk = tmpfs("6m")
    store = str(disk / "store")
    df = regression_df.select("features", "label")
    est = _estimator(store, Wide(), epochs=4, batch_size=200, run_id="full")
    with pytest.raises(TrainingError) as info:
        est.fit(df)
    error = info.value
    assert error.attempts == 1, "a full store is not retried"
    assert "out of space" in str(error) and "the checkpoint after epoch" in str(error)
    assert "needed 2.4 MiB" in str(error)
    checkpoints = Checkpoints(Store.create(store).run_path("full"))
    kept = checkpoints.latest_intact()[0]
    assert kept is not None and 1 <= kept.epochs_done < 4
    tmpfs.resize(disk, "64m")
    model = _estimator(store, Wide(), epochs=4, batch_size=200, run_id="full").fit(df)
    assert len(model.getHistory()["loss"]) == 4
    attempts = checkpoints.latest().meta["attempts"]
    assert attempts[-1]["start_epoch"] == kept.epochs_done
