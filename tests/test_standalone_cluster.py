"""A real Spark standalone cluster on loopback: a master and two workers with (fake) GPUs,
started from the pyspark install; the spark-submit of docs/clusters-and-gpus.md of jobs/train_torch.py runs against
it, and the saved model predicts here. Only the processes this test started are stopped."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(path, text, count, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if path.exists() and path.read_text(errors="replace").count(text) >= count:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture
def standalone_cluster(tmp_path):
    import pyspark

    spark_home = os.path.dirname(pyspark.__file__)
    spark_class = os.path.join(spark_home, "bin", "spark-class")
    discovery = os.path.join(ROOT, "conf", "getGpusResources.sh")
    port = _free_port()
    base_env = dict(os.environ, SPARK_HOME=spark_home, SPARK_LOCAL_IP="127.0.0.1",
                    SPARK_LOG_DIR=str(tmp_path / "logs"), SPARK_NO_DAEMONIZE="1")
    started = []

    def start(name, args, env):
        log = open(tmp_path / f"{name}.log", "w")
        started.append(subprocess.Popen([spark_class, *args], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True))
        return tmp_path / f"{name}.log"

    try:
        master_log = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                      "--port", str(port), "--webui-port", str(_free_port())],
                           base_env)
        for i, gpu in enumerate(["0", "1"]):
            env = dict(base_env, SPARKTRAIN_FAKE_GPUS=gpu,
                       SPARK_WORKER_DIR=str(tmp_path / f"work{i}"),
                       SPARK_WORKER_OPTS="-Dspark.worker.resource.gpu.amount=1 "
                                         f"-Dspark.worker.resource.gpu.discoveryScript={discovery}")
            start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                                 "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                                 "--webui-port", str(_free_port())], env)
        assert _wait_for_line(master_log, "Registering worker", 2, 90), master_log.read_text()[-3000:]
        yield f"spark://127.0.0.1:{port}", spark_home
    finally:
        for proc in started:  # exactly what we started: each in its own process group
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_spark_submit_to_standalone_cluster(standalone_cluster, tmp_path, spark):
    master, spark_home = standalone_cluster
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
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.sparktrain.slotWaitSeconds=60",
        "--driver-java-options", f"-Dlog4j.configurationFile={ROOT}/conf/log4j2.properties",
        os.path.join(ROOT, "jobs", "train_torch.py"), "--demo", "--num-proc", "2",
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
