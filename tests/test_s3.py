"""Stores on S3 (s3:// and s3a:// URLs): a real S3 endpoint (moto's server on 127.0.0.1,
tests/support/s3.py), reached over HTTP by s3fs from the driver and from the ranks in Spark's
Python workers. Spark's own s3a:// (a table, a materialized dataset, a saved model's metadata)
needs hadoop-aws on Spark's classpath: the shared session has none (its fits stream, where only
sparktrain writes to the store, or fail saying what to add); tests/support/s3a_fit.py runs a
session of its own with the jars ``./scripts/setup.sh --hadoop`` fetched.

Full tier: test_a_streamed_fit_checkpoints_on_s3_resumes_from_it_and_predicts and
test_an_s3a_table_trains_into_an_s3_store_with_credentials_from_the_environment. Only they train
with a store on S3, so only they catch ranks that cannot write or read checkpoints through s3fs
over HTTP, s3:// and s3a:// URLs not naming one store, a resume that misses the checkpoint
there, Spark's s3a:// dataset the ranks cannot read, or environment credentials leaking. The
quick tier's S3 test stops before training (no hadoop-aws), and test_store.py maps URLs without
an endpoint."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

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


@pytest.mark.full
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


S3A_JARS = os.path.join(os.path.expanduser("~"), ".cache", "sparktrain", "hadoop", "s3a")


@pytest.mark.full
def test_an_s3a_table_trains_into_an_s3_store_with_credentials_from_the_environment(s3):
    """tests/support/s3a_fit.py: Spark writes and reads a Parquet table on s3a://, a
    materialized fit writes its dataset there and checkpoints on s3://, and the secret key,
    given only in the environment, is nowhere in the store, the logs or the store's repr."""
    import pyspark

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    if not glob.glob(os.path.join(jars, "hadoop-client-api-3.5.*.jar")):
        pytest.skip("the s3a jars (scripts/hadoop/s3a/pom.xml) match Hadoop 3.5, pyspark 4's")
    if not glob.glob(os.path.join(S3A_JARS, "hadoop-aws-*.jar")):
        pytest.skip("Spark's s3a jars are not set up: run ./scripts/setup.sh --hadoop")
    secret = "sparktrain-test-secret-4c1f9e"
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT")}
    env.update(AWS_ACCESS_KEY_ID="AKIASPARKTRAINTEST", AWS_SECRET_ACCESS_KEY=secret)
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, os.path.join(here, "support", "s3a_fit.py"),
                           s3.endpoint, S3A_JARS], capture_output=True, text=True,
                          timeout=540, cwd=os.path.dirname(here), env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-6000:]
    found = json.loads(lines[0][len("RESULT "):])
    print(found)
    assert found["table_rows"] == 2000 and found["mse"] < 1.0, found
    loss = found["history"]
    assert len(loss) == 4 and loss[-1] < loss[0] / 4, found
    assert any(p.startswith("datasets/") and p.endswith(".parquet") for p in found["store"])
    assert any(p.endswith(".ckpt") for p in found["store"]), found["store"]
    assert any(p.endswith(".parquet") for p in found["table"]), found["table"]
    assert not found["secret_in"] and not found["secret_in_repr"], found
    assert secret not in done.stdout + done.stderr
