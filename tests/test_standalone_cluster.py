"""A real Spark standalone cluster on loopback: a master and two workers with (fake) GPUs,
started from the pyspark install; the spark-submit of docs/clusters-and-gpus.md of
jobs/train_torch.py runs against it, and the saved model predicts here.

A fit whose settings ask for more executors than have registered yet (``spark.cores.max``)
waits for the one still starting, saying so, and trains once its Worker joins.

Full tier: only test_spark_submit_to_standalone_cluster runs a job through spark-submit with the
documented cluster flags (GPU discovery, the worker daemon module, the executors' Python), so
only it catches a job that cannot start or learn under spark-submit on a cluster, or a model it
saves that another session cannot load; only test_a_fit_waits_for_an_executor_still_starting
has an executor register after the slot wait (the YARN container localizing a large archive
of issue #62). The rule of that wait is checked in the quick tier
(test_executors_promised_by_the_settings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from sparktrain.session.slots import promised_by

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.full
def test_spark_submit_to_standalone_cluster(standalone_cluster, tmp_path, spark):
    """The worker's shared cluster (tests/support/servers.py): two Workers, one fake GPU each."""
    master, spark_home = standalone_cluster.url, standalone_cluster.spark_home
    output = tmp_path / "model"
    discovery = os.path.join(ROOT, "conf", "getGpusResources.sh")
    command = [
        os.path.join(spark_home, "bin", "spark-submit"), "--master", master,
        "--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=1g",
        "--conf", "spark.executor.resource.gpu.amount=1",
        "--conf", f"spark.executor.resource.gpu.discoveryScript={discovery}",
        "--conf", "spark.worker.resource.gpu.amount=1",
        "--conf", "spark.task.resource.gpu.amount=1",
        "--conf", f"spark.pyspark.python={sys.executable}",
        "--conf", "spark.python.daemon.module=sparktrain.session.worker_daemon",
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.sparktrain.slotWaitSeconds=60",
        "--driver-java-options", f"-Dlog4j.configurationFile={ROOT}/conf/log4j2.properties",
        # 20 epochs: the fewest at which the demo passes its 0.95 (tests/test_jobs.py)
        os.path.join(ROOT, "jobs", "train_torch.py"), "--demo", "--num-proc", "2", "--epochs", "20",
        "--use-gpu", "no", "--store", str(tmp_path / "store"), "--output", str(output),
    ]
    env = dict(os.environ, SPARK_HOME=spark_home, SPARK_LOCAL_IP="127.0.0.1",
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "test accuracy" in result.stdout

    from pyspark.ml import PipelineModel

    from jobs.common import digits_frame

    model = PipelineModel.load(str(output))
    predictions = model.transform(digits_frame(spark).limit(50)).select("label__output").collect()
    assert len(predictions) == 50 and len(predictions[0][0]) == 10


# A driver on the shared cluster asking for 3 one-core executors (spark.cores.max) where the
# two Workers have room for 2; a fit of 3 ranks; prints RESULT {json}.
LATE_EXECUTOR = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/tests"]
    import numpy as np
    from pyspark.sql import SparkSession
    from support.helpers import linear_estimator

    spark = (SparkSession.builder.master(sys.argv[1]).appName("late-executor")
             .config("spark.cores.max", "3").config("spark.executor.cores", "1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.sparktrain.slotWaitSeconds", "2").getOrCreate())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y)],
                               "features array<double>, label double").repartition(3)
    started = time.time()
    model = linear_estimator(sys.argv[2], num_proc=3, epochs=2, batch_size=50,
                             verbose=1).fit(df)
    print("RESULT " + json.dumps({"seconds": round(time.time() - started, 1),
                                  "loss": model.getHistory()["loss"]}), flush=True)
    spark.stop()
""")


@pytest.mark.full
def test_a_fit_waits_for_an_executor_still_starting(standalone_cluster, tmp_path):
    """The third Worker starts only once the fit says it is waiting for executors (after the
    2 s slot wait, which alone would have failed the fit): the fit waits, trains 3 ranks."""
    errors = tmp_path / "driver.err"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    with open(errors, "w") as stderr:
        driver = subprocess.Popen(
            [sys.executable, "-c", LATE_EXECUTOR, standalone_cluster.url,
             str(tmp_path / "store"), ROOT], stdout=subprocess.PIPE, stderr=stderr, text=True,
            cwd=str(tmp_path), env=env)
    try:
        deadline = time.monotonic() + 240
        while "waiting for executors still starting" not in errors.read_text(errors="replace"):
            assert driver.poll() is None and time.monotonic() < deadline, \
                errors.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        standalone_cluster.add_worker(wait=0)
        out, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    log = errors.read_text(errors="replace")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert driver.returncode == 0 and lines, out[-2000:] + log[-4000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert "2 of the 3 task slots num_proc=3 needs are up (the settings ask master spark://" \
           in log and "for 3)" in log, log[-4000:]
    assert "executors up after" in log and "[rank 0] 3 rank(s)" in log, log[-4000:]
    assert len(result["loss"]) == 2 and result["loss"][-1] < result["loss"][0], result


def test_executors_promised_by_the_settings():
    """What a fit waits for (launch/barrier.check_slots): slots the settings ask the cluster
    manager for; nothing where executors come for pending tasks or every free core is taken."""
    assert promised_by("yarn", {}) == 2  # YARN's defaults: 2 executors of 1 core
    assert promised_by("yarn", {"spark.executor.instances": "3",
                                "spark.executor.cores": "4", "spark.task.cpus": "2"}) == 6
    assert promised_by("k8s://https://api:443", {"spark.executor.instances": "5"}) == 5
    assert promised_by("spark://h:7077", {"spark.cores.max": "6"}) == 6
    assert promised_by("spark://h:7077", {"spark.cores.max": "7",
                                          "spark.executor.cores": "2"}) == 6  # 3 executors
    assert promised_by("spark://h:7077", {}) is None  # every free core: nothing promised
    assert promised_by("yarn", {"spark.dynamicAllocation.enabled": "true"}) is None
    assert promised_by("local[4]", {"spark.executor.instances": "9"}) is None
