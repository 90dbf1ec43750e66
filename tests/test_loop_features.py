"""The training loop's everyday knobs, each checked against an equivalent run or a count."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sparktrain.loop.callbacks import EarlyStopping
from support.helpers import linear_estimator


def _fit(df, store, lr=0.02, **kwargs):
    params = dict(batch_size=100, epochs=3, shuffle=False, random_seed=3)
    return linear_estimator(store, lr=lr, **dict(params, **kwargs)).fit(df)


@pytest.fixture(scope="module")
def df(regression_df):
    return regression_df.select("features", "label", "is_val")


@pytest.mark.parametrize("backend", ["torch", "horovod"])
def test_gradient_accumulation_equals_a_larger_batch(df, store, backend):
    # same rows per optimizer step: 2 passes of 50 rows == 1 pass of 100 rows (mean gradients)
    accumulated = _fit(df, store, batch_size=50, backward_passes_per_step=2,
                       backend=backend).getHistory()
    large = _fit(df, store, batch_size=100, backend=backend).getHistory()
    np.testing.assert_allclose(accumulated["loss"], large["loss"], rtol=1e-5)


def test_learning_rate_scaling_is_opt_in(df, store):
    scaled = _fit(df, store, lr=0.01, scale_learning_rate=True).getHistory()
    doubled = _fit(df, store, lr=0.02).getHistory()  # 2 ranks x 1 pass
    plain = _fit(df, store, lr=0.01).getHistory()
    np.testing.assert_allclose(scaled["loss"], doubled["loss"], rtol=1e-6)
    assert plain["loss"][-1] > doubled["loss"][-1]


def test_early_stopping_on_validation_loss(df, store):
    # lr=0: val_loss never improves after the first epoch -> stops after patience epochs
    history = _fit(df, store, lr=0.0, epochs=10, validation="is_val",
                   callbacks=[EarlyStopping(monitor="val_loss", patience=2)]).getHistory()
    assert len(history["val_loss"]) == 3


def test_early_stopping_restores_best_weights():
    net = torch.nn.Linear(2, 1)
    stopper = EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    stopper.on_train_begin(net, {})
    best = {k: v.clone() for k, v in net.state_dict().items()}
    assert not stopper.on_epoch_end(0, {"loss": 1.0})
    with torch.no_grad():
        net.weight.add_(5.0)
    assert stopper.on_epoch_end(1, {"loss": 2.0}) is True
    stopper.on_train_end(net)
    assert torch.equal(net.weight, best["weight"])
    # resumed with a history: the count goes on from it
    stopper.on_train_begin(net, {"loss": [1.0, 2.0]})
    assert stopper.wait == 1 and stopper.best == 1.0


class CountBatches:
    """transformation_fn that logs each batch's size per rank to a file and zeroes the label's
    noise: label := 2 (so the model can learn it exactly)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        with open(f"{self.path}.{BarrierTaskContext.get().partitionId()}", "a") as f:
            f.write(f"{len(batch['label'])}\n")
        return dict(batch, label=np.full_like(batch["label"], 2.0))


def test_steps_per_epoch_and_transformation_fn(df, store, tmp_path):
    path = str(tmp_path / "batches")
    model = _fit(df, store, lr=0.1, epochs=4, batch_size=64, validation="is_val",
                 train_steps_per_epoch=20, validation_steps_per_epoch=1,
                 transformation_fn=CountBatches(path))
    for rank in (0, 1):
        sizes = open(f"{path}.{rank}").read().split()
        # 800 training rows per rank = 13 batches of 64; 20 steps run into a second pass
        assert len(sizes) == 4 * (20 + 1), (rank, len(sizes))
    assert model.getHistory()["val_loss"][-1] < 0.05  # the transformed label was learned
    assert os.path.exists(path + ".0")


def test_bf16_autocast_on_cpu(df, store):
    history = _fit(df, store, mixed_precision="bf16", epochs=4, lr=0.05).getHistory()
    assert history["loss"][-1] < history["loss"][0]


def test_fp16_without_gpus_fails_before_training(df, store):
    with pytest.raises(ValueError, match="mixed_precision='fp16' needs GPU ranks"):
        _fit(df, store, mixed_precision="fp16")


def test_bad_loop_params_fail_before_training(df, store):
    with pytest.raises(ValueError, match="backward_passes_per_step must be an integer >= 1"):
        _fit(df, store, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="max_time must be None or a number of seconds > 0"):
        _fit(df, store, max_time=-1)
    with pytest.raises(TypeError, match="transformation_fn must be a function"):
        _fit(df, store, transformation_fn="not callable")
    with pytest.raises(ValueError,
                       match="mixed_precision must be None, 'bf16' or 'fp16', got 'fp8'"):
        _fit(df, store, mixed_precision="fp8")
