"""A notebook on an edge node: a Python session on YARN in client mode
(``SparkSession.builder.master("yarn")``), run by tests/test_yarn.py in a process of its own with
the mini clusters' HADOOP_CONF_DIR; prints ``RESULT {json}``.

    python tests/support/yarn_client.py HADOOP_WORKDIR HDFS_URL CONF_JSON [PREDICT_JSON]
    python tests/support/yarn_client.py HADOOP_WORKDIR HDFS_URL CONF_JSON --no-faults

(``--no-faults``: the stream fit alone, on any master ``CONF_JSON`` names: bench/bench_yarn.py)

tests/test_yarn.py runs it with ``spark-submit --deploy-mode client --archives
env.tar.gz#environment`` (the driver here, the executors' Python the shipped environment's) and
PREDICT_JSON, so that one application holds what would otherwise take two:

* ``predict`` (with PREDICT_JSON, the arguments of jobs/predict.py): the client-mode job that
  scores with the model the cluster-mode job saved on HDFS, its ``main`` run in this session
  (its ``exit``: the status it would give spark-submit; its ``report``: the JSON line it
  printed). It runs first, while both NodeManagers are up.
* ``stream``: ``input_mode="stream"`` (the rows straight into the ranks, nothing written as a
  dataset), its store on HDFS; predicts after. A fit of more ranks than the executors have
  slots fails first, in preflight (``too_many``: its message).
* then, in the same session, the faults of tests/support/yarn_faults.py (``faults``): the last
  one stops a NodeManager for good.

The predict job or the faults, raising, leave ``{"error": traceback}`` in their place and the
rest runs: each is a test of its own.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support, and jobs (for the predict job)


def main(workdir: str, hdfs: str, conf: dict, predict_args=None, faults: bool = True) -> dict:
    from pyspark.sql import SparkSession

    from support import yarn_faults

    started = time.time()
    builder = SparkSession.builder.master("yarn").appName("sparktrain-notebook")
    for key, value in {**conf, **(yarn_faults.CONF if faults else {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.range(0, 2, 1, 2).count()  # the executors ran a first job: the session is ready
    found: dict = {"session_seconds": round(time.time() - started, 1)}
    if predict_args is not None:
        found["predict"] = _part(predict, predict_args)
    found.update(notebook(spark, hdfs))
    if faults:
        found["faults"] = _part(yarn_faults.main, spark, workdir, hdfs)
    spark.stop()
    return found


def _part(function, *args) -> dict:
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 - reported to the test, which names the part that failed
        return {"error": traceback.format_exc()[-6000:]}


def predict(args) -> dict:
    """jobs/predict.py's ``main`` in this session (its ``get_spark`` finds it): what it
    printed and its exit status."""
    from jobs import predict as job

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = job.main(list(args))
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("{")]
    return {"exit": status, "report": json.loads(lines[-1]) if lines else None}


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
    given = [arg for arg in sys.argv[1:] if arg != "--no-faults"]
    result = main(given[0], given[1], json.loads(given[2]),
                  json.loads(given[3]) if len(given) > 3 else None,
                  faults="--no-faults" not in sys.argv)
    print("RESULT " + json.dumps(result), flush=True)
