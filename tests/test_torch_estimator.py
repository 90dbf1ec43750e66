"""TorchEstimator end to end on real Spark barrier tasks and real torch.distributed (gloo)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.feature import StandardScaler
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F

from sparktrain import TorchEstimator, TorchModel, TrainingError


def linear_estimator(store, seed=7, **overrides):
    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  batch_size=32, epochs=3, random_seed=seed, store=store, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


def mae(output, label):
    return (output - label).abs().mean()


@pytest.mark.stack
@pytest.mark.parametrize("backend", ["torch", "horovod"])
def test_fit_transform_save_load(spark, store, regression_df, tmp_path, backend):
    est = linear_estimator(store, validation="is_val", metrics=[mae], epochs=4, backend=backend)
    user_weights = est.getModel().weight.detach().clone()
    model = est.fit(regression_df)

    history = model.getHistory()
    assert set(history) == {"loss", "mae", "val_loss", "val_mae"}
    assert all(len(v) == 4 for v in history.values())
    assert history["loss"][-1] < history["loss"][0] / 10
    assert history["val_loss"][-1] < 0.05  # noise variance is 0.01
    # the user's model object is not trained in place
    assert torch.equal(est.getModel().weight, user_weights)
    assert isinstance(model.getModel(), torch.nn.Module)

    out = model.transform(regression_df)
    assert out.columns == regression_df.columns + ["label__output"]
    assert dict(out.dtypes)["label__output"] == "double"
    rmse = RegressionEvaluator(predictionCol="label__output").evaluate(out)
    assert rmse < 0.2

    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    assert loaded.getHistory() == history
    assert loaded.uid == model.uid
    before = out.select("label__output").toPandas()["label__output"].to_numpy()
    after = loaded.transform(regression_df).select("label__output").toPandas()["label__output"]
    np.testing.assert_allclose(before, after.to_numpy(), rtol=1e-6)


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def test_classification_with_array_features(spark, store, classification_df):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    est = TorchEstimator(num_proc=2, model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
                         loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy],
                         feature_cols=["features"], label_cols=["label"], batch_size=32,
                         epochs=5, validation=0.2, random_seed=3, store=store, verbose=0)
    model = est.fit(classification_df)
    assert model.getHistory()["val_accuracy"][-1] > 0.95
    model.setOutputCols(["logits"])
    out = model.transform(classification_df)
    assert dict(out.dtypes)["logits"] == "array<double>"
    predicted = F.expr("array_position(logits, array_max(logits)) - 1")
    acc = out.select(F.avg((predicted == F.col("label")).cast("double"))).first()[0]
    assert acc > 0.95


@pytest.mark.stack
def test_pipeline_model_saves_loads_and_predicts_identically(spark, store, regression_df, tmp_path):
    pipeline = Pipeline(stages=[
        StandardScaler(inputCol="features", outputCol="scaled", withMean=True),
        linear_estimator(store, feature_cols=["scaled"], epochs=2)])
    fitted = pipeline.fit(regression_df)
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], TorchModel)
    a = fitted.transform(regression_df).select("label__output").toPandas()
    b = loaded.transform(regression_df).select("label__output").toPandas()
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-6)


def test_cross_validator_over_epochs(spark, store, regression_df):
    est = linear_estimator(store, epochs=1, batch_size=64)
    grid = ParamGridBuilder().addGrid(est.epochs, [1, 4]).addGrid(est.batch_size, [64]).build()
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=5,
                        evaluator=RegressionEvaluator(predictionCol="label__output"))
    cv_model = cv.fit(regression_df)
    assert cv_model.avgMetrics[1] < cv_model.avgMetrics[0]  # more epochs, lower RMSE
    best = cv_model.bestModel
    assert isinstance(best, TorchModel) and len(best.getHistory()["loss"]) == 4
    assert est.getEpochs() == 1  # copies with extra params left the original alone


def test_estimator_save_and_load(spark, store, regression_df, tmp_path):
    est = linear_estimator(store, metrics=[mae], epochs=1)
    path = str(tmp_path / "estimator")
    est.write().overwrite().save(path)
    loaded = TorchEstimator.load(path)
    assert loaded.uid == est.uid and loaded.getBatchSize() == 32 and loaded.getEpochs() == 1
    assert torch.equal(loaded.getModel().weight, est.getModel().weight)
    assert loaded.fit(regression_df).getHistory()["mae"]


def test_two_ranks_reach_the_same_loss_as_one(spark, store, regression_df):
    """Linear least squares is convex with one minimum; 1 rank with batch 64 and 2 ranks with
    batch 32 each (the same global batch) both converge to it, so their final training MSE
    must agree with each other and with the noise floor (0.01) to within SGD jitter: 10%."""
    finals = []
    for num_proc, batch in ((1, 64), (2, 32)):
        est = linear_estimator(store, num_proc=num_proc, batch_size=batch, epochs=12,
                               shuffle=False, seed=11)
        finals.append(est.fit(regression_df).getHistory()["loss"][-1])
    one, two = finals
    assert abs(one - two) / one < 0.10, finals
    assert 0.008 < one < 0.012 and 0.008 < two < 0.012, finals


def test_sample_weights_weight_the_loss(spark, store):
    """A bias-only model converges to the weighted mean of the labels: (3*1 + 1*5) / 4 = 2."""
    rows = [(0.0, 1.0, 3.0)] * 64 + [(0.0, 5.0, 1.0)] * 64
    df = spark.createDataFrame(rows, "x double, y double, w double")
    net = torch.nn.Linear(1, 1)
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
                         loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                         sample_weight_col="w", batch_size=32, epochs=30, store=store, verbose=0)
    model = est.fit(df)
    bias = model.getModel().bias.item()
    assert abs(bias - 2.0) < 0.05, bias


class FailsOnRankOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        if torch.distributed.get_rank() == 1:
            raise ValueError("synthetic failure inside forward on rank one")
        return self.linear(x)


def _listening_ports():
    import os

    import psutil

    me = psutil.Process(os.getpid())
    procs = [me] + me.children(recursive=True)
    ports = set()
    for proc in procs:
        try:
            ports |= {c.laddr.port for c in proc.net_connections(kind="tcp")
                      if c.status == "LISTEN"}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ports


def test_failing_rank_raises_its_traceback_and_cleans_up(spark, store, regression_df):
    linear_estimator(store, epochs=1).fit(regression_df)  # warm workers: their ports exist now
    before = _listening_ports()
    net = FailsOnRankOne()
    est = linear_estimator(store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TrainingError) as info:
        est.fit(regression_df)
    error = info.value
    assert error.rank == 1
    assert "ValueError: synthetic failure inside forward on rank one" in str(error)
    assert "in forward" in error.remote_traceback
    deadline = time.time() + 20
    while time.time() < deadline and _listening_ports() - before:
        time.sleep(0.5)
    assert not _listening_ports() - before, "a failed fit left ports open"
    # the session is still usable
    assert linear_estimator(store, epochs=1).fit(regression_df).getHistory()["loss"]


@pytest.mark.stack
def test_too_few_slots_fails_fast(spark, store, regression_df):
    """num_proc=5 on local[2]: a clear error at once, before any Spark job. A local master has
    all its slots from the start, so the wait for executors (set long here) is skipped."""
    sc = spark.sparkContext
    group = f"slots-{time.time_ns()}"
    spark.conf.set("spark.sparktrain.slotWaitSeconds", "30")
    sc.setJobGroup(group, "slot check")
    started = time.time()
    try:
        with pytest.raises(RuntimeError) as raised:
            linear_estimator(store, num_proc=5).fit(regression_df)
        seconds = time.time() - started
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        spark.conf.set("spark.sparktrain.slotWaitSeconds", "1")  # the session fixture's value
    message = str(raised.value)
    assert "num_proc=5 needs 5 task slots" in message and "the cluster has 2" in message
    assert "(master local[2])" in message and "waited" not in message
    assert "Lower num_proc to 2 or start Spark with master local[5]" in message
    assert sc.statusTracker().getJobIdsForGroup(group) == []  # no Spark job ran
    assert seconds < 5, seconds  # was 12 s: it waited 10 s for executors local[2] never adds


def test_materialization_is_reused(spark, tmp_path, regression_df):
    from sparktrain.data.materialize import materialize
    from sparktrain.data.schema import training_columns
    from sparktrain.data.store import Store

    store = Store.create(str(tmp_path))
    columns = training_columns(regression_df, ["features"], ["label"])
    first = materialize(regression_df, store, columns, validation="is_val")
    again = materialize(regression_df, store, columns, validation="is_val")
    assert not first.reused and again.reused and again.key == first.key
    assert first.train_rows + first.val_rows == 2000 and first.val_rows == 400
    assert again.seconds < 1.0
    other = materialize(regression_df.limit(100), store, columns)
    assert other.key != first.key and other.train_rows == 100
