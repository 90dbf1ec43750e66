"""A real Spark standalone cluster on loopback: a master and two workers with (fake) GPUs,
started from the pyspark install; the spark-submit of docs/clusters-and-gpus.md of
jobs/train_torch.py runs against it, and the saved model predicts here.

Full tier: only this test runs a job through spark-submit with the documented cluster flags
(GPU discovery, the worker daemon module, the executors' Python), so only it catches a job
that cannot start or learn under spark-submit on a cluster, or a model it saves that another
session cannot load."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
