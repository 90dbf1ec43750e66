"""A notebook on an edge node: a Python session on YARN in client mode
(``SparkSession.builder.master("yarn")``), run by tests/test_yarn.py in a process of its own with
the mini clusters' HADOOP_CONF_DIR; prints ``RESULT {json}``.

    python tests/support/yarn_client.py HADOOP_WORKDIR HDFS_URL CONF_JSON

* ``stream``: ``input_mode="stream"`` (the rows straight into the ranks, nothing written as a
  dataset), its store on HDFS; predicts after. A fit of more ranks than the executors have
  slots fails first, in preflight (``too_many``: its message).
* then, in the same session, the faults of tests/support/yarn_faults.py (``faults``): the last
  one stops a NodeManager for good.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def main(workdir: str, hdfs: str, conf: dict) -> dict:
    from pyspark.sql import SparkSession

    from support import yarn_faults

    started = time.time()
    builder = SparkSession.builder.master("yarn").appName("sparktrain-notebook")
    for key, value in {**conf, **yarn_faults.CONF}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    found = {"session_seconds": round(time.time() - started, 1), **notebook(spark, hdfs)}
    found["faults"] = yarn_faults.main(spark, workdir, hdfs)
    spark.stop()
    return found


def notebook(spark, hdfs: str) -> dict:
    """The stream fit and preflight's answer to too many ranks."""
    import numpy as np

    from support.helpers import linear_estimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double").repartition(3).cache()
    df.count()
    store = f"{hdfs}/user/sparktrain/notebook-store"
    wait = spark.conf.get("spark.sparktrain.slotWaitSeconds", None)
    spark.conf.set("spark.sparktrain.slotWaitSeconds", "1")  # the executors ran df.count()
    try:  # more ranks than the 2 executors' slots: preflight says so, naming YARN's settings
        linear_estimator(store, input_mode="stream", num_proc=5).fit(df)
        too_many = "fitted"
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        too_many = f"{type(exc).__name__}: {exc}"
    if wait is None:  # the session's own setting again (unset would drop the builder's too)
        spark.conf.unset("spark.sparktrain.slotWaitSeconds")
    else:
        spark.conf.set("spark.sparktrain.slotWaitSeconds", wait)
    started = time.time()
    model = linear_estimator(store, input_mode="stream", epochs=4, batch_size=50,
                             lr=0.05).fit(df)
    return {"fit_seconds": round(time.time() - started, 1),
            "history": model.getHistory()["loss"],
            "predicted": model.transform(df).count(), "too_many": too_many}


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
