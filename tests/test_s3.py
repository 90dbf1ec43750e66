"""Stores on S3 (s3:// and s3a:// URLs): a real S3 endpoint (moto's server on 127.0.0.1,
tests/support/s3.py), reached over HTTP by s3fs from the driver and from the ranks in Spark's
Python workers. Spark's own s3a:// (a materialized dataset, a saved model's metadata) needs the
cluster's hadoop-aws jars, which these tests do not have: they use input_mode="stream", where
only sparktrain writes to the store."""
from __future__ import annotations

import pytest

from sparktrain.data.store import Store
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import linear_estimator

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3():
    from support.s3 import S3Server

    with S3Server() as server:
        server.filesystem().mkdir("sparktrain")
        yield server


def _estimator(store, epochs):
    return linear_estimator(store, input_mode="stream", batch_size=100, epochs=epochs,
                            random_seed=1, run_id="on-s3", verbose=0)


@pytest.mark.slow
def test_a_streamed_fit_checkpoints_on_s3_resumes_from_it_and_predicts(spark, regression_df, s3):
    """Both URL forms name the same store; the second fit resumes from the first's checkpoint
    on S3; the credentials are never part of what the store shows."""
    df = regression_df.select("features", "label")
    first = _estimator(Store.create("s3a://sparktrain/st", storage_options=s3.storage_options),
                       epochs=2).fit(df)
    store = Store.create("s3://sparktrain/st", storage_options=s3.storage_options)
    latest = Checkpoints(store.run_path("on-s3"), store.storage_options).latest()
    assert latest is not None and latest.epochs_done == 2
    second = _estimator(store, epochs=3).fit(df)
    history = second.getHistory()["loss"]
    assert history[:2] == first.getHistory()["loss"] and len(history) == 3
    latest = Checkpoints(store.run_path("on-s3"), store.storage_options).latest()
    assert [a["start_epoch"] for a in latest.meta["attempts"]] == [0, 2]
    names = s3.filesystem().find("sparktrain/st")
    assert any(n.endswith(".ckpt") for n in names), names
    assert not any("/datasets/" in n for n in names), names  # streamed: no dataset written
    predictions = second.transform(regression_df).select("label", "label__output").toPandas()
    assert ((predictions["label"] - predictions["label__output"]) ** 2).mean() < 1.0
    assert "testing" not in repr(store)


def test_a_dataset_spark_cannot_write_to_s3_fails_naming_hadoop_aws(spark, regression_df, s3):
    """input_mode="materialize" has Spark write the dataset to the store's s3a:// URL: without
    hadoop-aws in Spark's jars that fails before any training, saying what to add."""
    store = Store.create("s3://sparktrain/materialized", storage_options=s3.storage_options)
    with pytest.raises(RuntimeError) as info:
        linear_estimator(store, epochs=1, run_id="no-s3a").fit(
            regression_df.select("features", "label"))
    message = str(info.value)
    assert message.startswith("cannot write the dataset to s3a://sparktrain/materialized/")
    assert "no filesystem for s3a://" in message and "org.apache.hadoop:hadoop-aws" in message
    assert 'input_mode="stream"' in message and "testing" not in message
    assert not s3.filesystem().find("sparktrain/materialized/datasets")  # nothing left behind
