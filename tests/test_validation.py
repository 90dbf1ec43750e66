"""Bad input fails with an error naming the column/param, before any training is launched."""
from __future__ import annotations

import uuid

import pytest
import torch
from pyspark.sql import functions as F

from sparktrain import TorchEstimator


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a barrier (training) job would be launched."""
    def refuse(*args, **kwargs):
        raise AssertionError("a training job was launched for invalid input")
    monkeypatch.setattr("sparktrain.estimators.fit_run.run_elastic", refuse)


@pytest.fixture
def spark_jobs(spark):
    """Run a block under a fresh job group; ``.count()`` says how many Spark jobs it ran."""
    sc = spark.sparkContext

    class Probe:
        def __enter__(self):
            self.group = f"probe-{uuid.uuid4().hex}"
            sc.setJobGroup(self.group, "validation probe")
            return self

        def __exit__(self, *exc):
            sc.setLocalProperty("spark.jobGroup.id", None)

        def count(self):
            return len(sc.statusTracker().getJobIdsForGroup(self.group))

    return Probe()


def estimator(store, **overrides):
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  batch_size=16, epochs=1, store=store, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


SCHEMA_CASES = [
    (dict(feature_cols=["nope"]), "feature column 'nope' is not in the DataFrame"),
    (dict(label_cols=["missing"]), "label column 'missing' is not in the DataFrame"),
    (dict(feature_cols=["name"]),
     "feature column 'name' is a string column; a model takes numbers: pass transformation_fn"),
    (dict(num_proc=0), "num_proc must be an integer >= 1, got 0"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(epochs=0), "epochs must be an integer >= 1"),
    (dict(backend="mpi"), r"backend must be one of \[.*\] for TorchEstimator, got 'mpi'"),
    (dict(validation=1.5), r"validation must be a fraction in \[0, 1\) or the name of a boolean "
                           r"column, got 1.5"),
    (dict(validation="label"), "validation column 'label' has type double; expected boolean"),
    (dict(feature_cols=["label"], label_cols=["label2"], sample_weight_col="features"),
     "sample weight column .features. must be a numeric scalar"),
    (dict(feature_cols=["features"], label_cols=["features"]), "appear more than once"),
    (dict(use_gpu=True), "use_gpu=True but the executors have no GPUs: set "
                         "spark.executor.resource.gpu.amount"),
    (dict(min_num_proc=3), "min_num_proc must be between 1 and num_proc=2, got 3"),
    (dict(num_proc=4, min_num_proc=3), r"min_num_proc=3 needs 3 task slots .* the cluster has "
                                       r"2 \(master local\[2\]\)"),
]


@pytest.mark.parametrize("overrides,message", SCHEMA_CASES)
def test_schema_and_param_errors_run_no_spark_job(spark, store, regression_df, no_training,
                                                  spark_jobs, overrides, message):
    df = regression_df.withColumn("name", F.lit("a")).withColumn("label2", F.col("label"))
    with spark_jobs:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
            estimator(store, **overrides).fit(df)
    assert spark_jobs.count() == 0


def test_optimizer_must_be_bound_to_the_model(store, regression_df, no_training, spark_jobs):
    other = torch.nn.Linear(4, 1)
    with spark_jobs:
        with pytest.raises(ValueError, match="optimizer is not bound to this model's parameters"):
            est = estimator(store, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
            est.fit(regression_df)
    assert spark_jobs.count() == 0


def test_model_type_is_checked(store, regression_df, no_training):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        estimator(store, model=lambda x: x).fit(regression_df)


@pytest.mark.stack
def test_nulls_are_rejected_with_the_column_name(spark, store, no_training):
    df = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0], 1.0), ([1.0, 2.0, 3.0, 4.0], None)],
                               "features array<double>, label double")
    with pytest.raises(ValueError, match="column 'label' contains nulls"):
        estimator(store).fit(df)


@pytest.mark.stack
def test_ragged_arrays_are_rejected(spark, store, no_training):
    df = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0], 1.0), ([1.0, 2.0], 2.0)],
                               "features array<double>, label double")
    with pytest.raises(ValueError, match="column 'features' holds arrays of 2 to 4 elements; "
                                         "a model needs one length per column. "
                                         "Pass a transformation_fn"):
        estimator(store).fit(df)


@pytest.mark.stack
def test_null_inside_an_array_is_rejected(spark, store, no_training):
    df = spark.createDataFrame([([1.0, None, 3.0, 4.0], 1.0)],
                               "features array<double>, label double")
    with pytest.raises(ValueError, match="column 'features' has arrays containing nulls"):
        estimator(store).fit(df)


def test_empty_dataframe_is_rejected(spark, store, regression_df, no_training):
    with pytest.raises(ValueError, match="the DataFrame is empty"):
        estimator(store).fit(regression_df.limit(0))


@pytest.mark.stack
def test_failed_check_leaves_no_partial_dataset(spark, tmp_path, no_training):
    df = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0], 1.0), ([1.0], 2.0)],
                               "features array<double>, label double")
    with pytest.raises(ValueError):
        estimator(str(tmp_path)).fit(df)
    datasets = tmp_path / "datasets"
    assert not datasets.exists() or not any(datasets.iterdir())
