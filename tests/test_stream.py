"""input_mode="stream" (real Spark, real barrier tasks): rows fed by jobs beside the ranks where
task slots are free (``num_proc=1`` on the local[2] test session), else taken by the training
stage itself (``num_proc=2``): as they come when the DataFrame has a partition a rank, else
after a shuffle. Every row trains once per epoch, nothing is written to the store."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from support.helpers import id_net


class _RecordIds:
    """A transformation_fn appending, on the ranks, the ids of every batch it sees."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        rank = BarrierTaskContext.get().partitionId()
        with open(os.path.join(self.folder, f"rank-{rank}"), "a") as f:
            f.write(" ".join(str(int(i)) for i in batch["id"].ravel()) + "\n")
        return batch


@pytest.fixture(scope="module")
def id_frame(spark):
    """1000 rows: ``id``, ``features`` (4 floats), ``label``, ``is_val`` (every 5th row)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0])
    rows = [(i, a.tolist(), float(b), i % 5 == 0)
            for i, (a, b) in enumerate(zip(x, y, strict=True))]
    return spark.createDataFrame(rows, "id long, features array<double>, label double, "
                                       "is_val boolean").repartition(3).cache()


def _seen(folder):
    return [[int(v) for v in line.split()] for name in sorted(os.listdir(folder))
            for line in open(os.path.join(folder, name)) if line.strip()]


@pytest.mark.parametrize("validation", [None, "is_val"], ids=["no_validation", "val_column"])
@pytest.mark.parametrize("num_proc,partitions", [(1, 3), (2, 2), (2, 3)],
                         ids=["fed", "own_partitions", "shuffled"])
def test_a_stream_fit_trains_every_row_once_an_epoch_and_writes_no_dataset(
        spark, id_frame, tmp_path, validation, num_proc, partitions):
    import torch

    from sparktrain import TorchEstimator

    seen = tmp_path / "seen"
    seen.mkdir()
    store = tmp_path / "store"
    net = id_net()
    est = TorchEstimator(num_proc=num_proc, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), 0.01),
                         loss=torch.nn.MSELoss(), feature_cols=["id", "features"],
                         label_cols=["label"], batch_size=64, epochs=3, validation=validation,
                         input_mode="stream", store=str(store), verbose=0, random_seed=1,
                         transformation_fn=_RecordIds(str(seen)))
    model = est.fit(id_frame if partitions == 3 else id_frame.repartition(partitions, "id"))
    history = model.getHistory()
    assert len(history["loss"]) == 3 and ("val_loss" in history) == bool(validation)
    counts = collections.Counter(i for batch in _seen(seen) for i in batch)
    val_ids = set(range(0, 1000, 5)) if validation else set()
    train_ids = set(range(1000)) - val_ids
    # every training row 3 times (one a epoch), a few repeated by a rank that got fewer rows
    assert {i for i in counts if counts[i] >= 3} >= train_ids
    trained = sum(counts[i] for i in train_ids)
    # a rank short of the most rows repeats some: few where rows are fed in chunks dealt in
    # turns; where each rank takes a partition (hashed by id: uneven), up to the partitions'
    # difference; after a shuffle, up to a split's difference between the ranks (Spark deals
    # the rows in turns whatever their split, in the order its sortBeforeRepartition gives)
    slack = 2 * 3 if num_proc == 1 else len(train_ids) // 10
    assert 3 * len(train_ids) <= trained <= 3 * (len(train_ids) + slack)
    assert not (store / "datasets").exists() or not os.listdir(store / "datasets")
    predictions = model.transform(id_frame.limit(10)).collect()
    assert len(predictions) == 10 and all(np.isfinite(r["label__output"]) for r in predictions)


def test_stream_input_errors_come_before_training(spark, id_frame, tmp_path):
    import torch

    from sparktrain import TorchEstimator

    with pytest.raises(ValueError, match=r"input_mode must be one of \['store', 'stream'\], "
                                         r"got 'files'"):
        TorchEstimator(input_mode="files")
    net = id_net()
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.01),
                         loss=torch.nn.MSELoss(), feature_cols=["id", "features"],
                         label_cols=["label"], input_mode="stream", store=str(tmp_path),
                         verbose=0)
    with pytest.raises(ValueError, match="fewer rows than that"):
        est.fit(id_frame.limit(1))


def test_a_keras_stream_fit_trains_and_predicts(spark, regression_df, tmp_path):
    import keras

    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.05),
                         loss="mse", feature_cols=["features"], label_cols=["label"],
                         batch_size=64, epochs=4, validation=0.2, input_mode="stream",
                         store=str(tmp_path), verbose=0, random_seed=3)
    fitted = est.fit(regression_df)
    history = fitted.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 4
    assert history["loss"][-1] < history["loss"][0]
    assert not (tmp_path / "datasets").exists() or not os.listdir(tmp_path / "datasets")
    out = fitted.transform(regression_df.limit(20)).collect()
    assert len(out) == 20 and all(np.isfinite(r["label__output"]) for r in out)
    with pytest.raises(ValueError, match="input_mode='stream' is not available with backend="
                                         "'tfos'"):
        KerasEstimator(num_proc=2, model=model, optimizer="adam", loss="mse",
                       feature_cols=["features"], backend="tfos", input_mode="stream",
                       store=str(tmp_path)).fit(regression_df)


def _double(batch):
    """A transformation_fn for decode worker processes."""
    return dict(batch, features=batch["features"] * 2.0)


@pytest.mark.parametrize("params", [{"backend": "horovod"}, {"strategy": "fsdp"},
                                    {"transformation_fn": _double,
                                     "reader_pool_type": "process"}],
                         ids=["horovod", "fsdp", "process_decoding"])
def test_stream_fits_with_every_torch_engine_and_decoding(spark, regression_df, tmp_path, params):
    from support.helpers import linear_estimator

    if params.get("backend") == "horovod":
        pytest.importorskip("horovod.torch")
    est = linear_estimator(str(tmp_path), input_mode="stream", validation="is_val", epochs=3,
                           batch_size=50, **params)
    history = est.fit(regression_df).getHistory()
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert not (tmp_path / "datasets").exists() or not os.listdir(tmp_path / "datasets")
