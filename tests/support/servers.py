"""The servers tests share: one Spark standalone cluster, one Spark Connect server and one
MLflow tracking server per pytest worker, each started by the first test that asks for it and
stopped when the worker ends (pytest fixtures of session scope, made fixtures of every test
file by conftest.py). A test that changes one leaves it as it found it.

Example::

    def test_submit(standalone_cluster):          # the Master's URL: standalone_cluster.url
        ...

    def test_remote(connect_server):               # sc://127.0.0.1:PORT: connect_server.url
        ...
"""
from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from typing import Iterator

import pytest

from support.standalone import StandaloneCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLFLOW = os.path.join(ROOT, ".venv-mlflow", "bin", "mlflow")
#: Workers of the shared cluster: two, one core and one (fake) GPU each
BASE_WORKERS = 2


def gpu_worker_env(gpu: str) -> dict:
    """A Worker announcing the fake GPUs ``gpu`` ("0", or "4,5,6,7": conf/getGpusResources.sh
    reads them); its ranks train on the CPU (``SPARKTRAIN_FAKE_GPUS``, launch.gpus)."""
    discovery = os.path.join(ROOT, "conf", "getGpusResources.sh")
    amount = len(gpu.split(","))
    return {"SPARKTRAIN_FAKE_GPUS": gpu,
            "SPARK_WORKER_OPTS": f"-Dspark.worker.resource.gpu.amount={amount} "
                                 f"-Dspark.worker.resource.gpu.discoveryScript={discovery}"}


@pytest.fixture(scope="session")
def standalone(tmp_path_factory) -> Iterator[StandaloneCluster]:
    """The worker's standalone cluster: a Master and ``BASE_WORKERS`` 1-core Workers, each with
    one fake GPU ("0", "1"). Ask for ``standalone_cluster`` instead (it restores the cluster)."""
    with StandaloneCluster(tmp_path_factory.mktemp("standalone")) as cluster:
        for gpu in range(BASE_WORKERS):
            cluster.add_worker(gpu_worker_env(str(gpu)))
        yield cluster


@pytest.fixture
def standalone_cluster(standalone) -> Iterator[StandaloneCluster]:
    """The shared standalone cluster for one test, which may add and kill Workers (or have a
    script of its own do so, attached by ``standalone.url``): afterwards the Workers it started
    stop, lost base Workers are started again, and the next test finds the Master idle."""
    yield standalone
    restore(standalone)


def restore(cluster: StandaloneCluster) -> None:
    """Leave the shared ``cluster`` as ``standalone`` made it: Workers beyond the base ones
    stopped, a lost base Worker started again, no application left on the Master."""
    for index in range(BASE_WORKERS, len(cluster.workers)):
        cluster.kill_worker(index)
    del cluster.workers[BASE_WORKERS:]
    for index in range(BASE_WORKERS):
        if index not in cluster.alive():
            fresh = cluster.add_worker(gpu_worker_env(str(index)))
            cluster.workers[index] = cluster.workers.pop(fresh)
    cluster.wait_idle(BASE_WORKERS)


@pytest.fixture(scope="session")
def connect_server():
    """The worker's Spark Connect server (its own JVM, local[2]): ``.url``, ``.log_path``."""
    pytest.importorskip("pyspark.sql.connect.client", reason="needs pyspark[connect] (Spark 4)")
    pytest.importorskip("grpc_status", reason="needs pyspark[connect]: grpcio-status")
    from sparktrain import ConnectServer

    with ConnectServer("local[2]", conf={"spark.stage.maxConsecutiveAttempts": "3",
                                         "spark.sql.shuffle.partitions": "4"}) as server:
        yield server


def connect_log_tail(server, chars: int = 6000) -> str:
    """The end of the Connect server's log, for a failed client's message."""
    if not server.log_path or not os.path.exists(server.log_path):
        return ""
    with open(server.log_path, errors="replace") as f:
        return "\n--- Connect server log (tail) ---\n" + f.read()[-chars:]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """The worker's MLflow tracking server (``.venv-mlflow``'s ``mlflow server``, sqlite, its
    artifacts in a temporary folder): its URI, ``http://127.0.0.1:PORT``."""
    if not os.path.exists(MLFLOW):
        pytest.skip("needs .venv-mlflow (scripts/setup.sh --tests creates it on the primary "
                    "stack)")
    from support.standalone import free_port

    tmp = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen(
        [MLFLOW, "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
         "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT,
        # MLflow 3's server also starts a job runner with seven huey consumer processes
        # (prompt optimisation, trace roll-ups), which poll all the time: together about half
        # a core here. Tracking needs none of them.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, \
                (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    yield uri
    server.terminate()
    server.wait(30)
