"""Preflight: shape, dtype and loss mistakes fail in seconds, before any training job, with the
column, its shape and what the model expects named; the user's model and optimizer are left as
they were."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch

from sparktrain import TorchEstimator
from sparktrain.estimators.preflight import PREFLIGHT_CONF, PreflightError, run_preflight


@pytest.fixture(scope="module")
def seven_wide(spark):
    """200 rows: a 7-wide vector feature, a class label and a 2-value array label."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    rows = [(Vectors.dense(rng.normal(size=7).tolist()), int(i % 3),
             rng.normal(size=2).tolist()) for i in range(200)]
    df = spark.createDataFrame(rows, ["features", "label", "pair"]).cache()
    df.count()
    return df


def _mlp(inputs: int = 64, outputs: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, outputs))


def _estimator(store, net, **kwargs):
    params = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters()),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                  label_cols=["label"], store=store, verbose=0)
    params.update(kwargs)
    return TorchEstimator(**params)


def _datasets(store):
    return os.listdir(os.path.join(store, "datasets")) if os.path.isdir(
        os.path.join(store, "datasets")) else []


def test_input_width_mismatch_fails_before_any_training_job(spark, seven_wide, tmp_path):
    store = str(tmp_path / "store")
    started = time.perf_counter()
    with pytest.raises(PreflightError) as info:
        _estimator(store, _mlp(64)).fit(seven_wide)
    seconds = time.perf_counter() - started
    message = str(info.value)
    assert "preflight failed in the model's forward pass" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    assert "feature column 'features': (8, 7) float32" in message
    assert "The model was called with (8, 7) float32" in message
    assert "64 values per row in its first layer Linear" in message
    assert _datasets(store) == []  # nothing was materialized, nothing launched
    assert seconds < 10, f"took {seconds:.1f}s"  # 33 s and 4 attempts before
    print(f"width mismatch reported in {seconds:.2f}s")


def test_loss_and_label_mismatch_names_the_label(spark, seven_wide, tmp_path):
    est = _estimator(str(tmp_path / "store"), _mlp(7, 3), label_cols=["pair"],
                     loss=torch.nn.MSELoss())
    with pytest.warns(UserWarning, match="different to the input size"), \
            pytest.raises(PreflightError) as info:
        est.fit(seven_wide)
    message = str(info.value)
    assert "preflight failed in the loss" in message
    assert "label column 'pair': (8, 2) float32" in message


def test_preflight_leaves_model_and_optimizer_as_they_were(spark, seven_wide, tmp_path, caplog):
    net = _mlp(7, 3)
    est = _estimator(str(tmp_path / "store"), net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.train()
    specs = est._check_params(seven_wide)
    with caplog.at_level(logging.INFO, logger="sparktrain"):
        run_preflight(est, seven_wide, specs)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm stats included
    assert net.training and est.getOptimizer().state == {}
    assert all(p.grad is None for p in net.parameters())
    line = [r.getMessage() for r in caplog.records if "preflight" in r.getMessage()]
    assert line and "ran on 8 rows" in line[0], line
    print(line[0])  # the preflight's cost, reported in the closing note


def test_preflight_applies_transformation_fn_and_can_be_switched_off(spark, seven_wide, tmp_path):
    def widen(batch):  # the user's fix-up: pad 7 features to 64
        batch = dict(batch)
        batch["features"] = np.pad(batch["features"], ((0, 0), (0, 57)))
        return batch

    est = _estimator(str(tmp_path / "store"), _mlp(64), transformation_fn=widen)
    run_preflight(est, seven_wide, est._check_params(seven_wide))  # passes: fn applied first
    broken = _estimator(str(tmp_path / "store"), _mlp(64))
    spark.conf.set(PREFLIGHT_CONF, "false")
    try:
        run_preflight(broken, seven_wide, broken._check_params(seven_wide))  # skipped
    finally:
        spark.conf.unset(PREFLIGHT_CONF)


def test_keras_input_width_mismatch(spark, seven_wide, tmp_path):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    from sparktrain import KerasEstimator

    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(3)])
    est = KerasEstimator(num_proc=2, model=net, optimizer="adam",
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         feature_cols=["features"], label_cols=["label"],
                         store=str(tmp_path / "store"), verbose=0)
    started = time.perf_counter()
    with pytest.raises(PreflightError) as info:
        est.fit(seven_wide)
    message = str(info.value)
    assert "feature column 'features': (8, 7) float32" in message
    assert "inputs of shape (None, 64)" in message
    assert time.perf_counter() - started < 10


def test_transformation_fn_needing_a_task_only_skips_the_preflight(spark, seven_wide, tmp_path,
                                                                   caplog):
    def needs_a_task(batch):
        from pyspark import TaskContext

        TaskContext.get().partitionId()  # None on the driver: AttributeError
        return batch

    est = _estimator(str(tmp_path / "store"), _mlp(64), transformation_fn=needs_a_task)
    with caplog.at_level(logging.WARNING, logger="sparktrain"):
        run_preflight(est, seven_wide, est._check_params(seven_wide))
    assert any("preflight skipped: AttributeError" in r.getMessage() for r in caplog.records)
