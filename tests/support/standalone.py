"""A real Spark standalone cluster on loopback for tests: a Master and 1-core Workers started
from the pyspark install with ``spark-class`` (as Horovod's own Spark tests do). Workers can be
added and SIGKILLed while an application runs, as a cluster gains and loses machines; only the
processes started here are stopped.

Example::

    with StandaloneCluster(tmp_path) as cluster:
        cluster.add_worker(); cluster.add_worker()
        spark = SparkSession.builder.master(cluster.url).getOrCreate()
        ...
        cluster.kill_worker(1)     # the Worker JVM, its executors and their Python workers

On several hosts (``tests/support/host_net.py``), the Master and each Worker run in a network
namespace of their own, bound to its address::

    cluster = StandaloneCluster(tmp_path, host=(net.address(0), net.enter(0)))
    cluster.add_worker(host=(net.address(1), net.enter(1)))

The tests share one per pytest worker (the ``standalone`` fixture of conftest.py); a script in
a process of its own adds and kills Workers on it through ``StandaloneCluster(workdir,
url=cluster.url, name="elastic")``, which starts no Master and stops only its own Workers.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

#: where a process runs: its address, and the command prefix that puts it there
Host = Tuple[str, Sequence[str]]
LOOPBACK: Host = ("127.0.0.1", ())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    """See the module docstring; ``worker_env``: environment added to every Worker's;
    ``host``: the Master's."""

    def __init__(self, workdir, worker_env: Optional[Dict[str, str]] = None,
                 url: Optional[str] = None, name: str = "worker", host: Host = LOOPBACK) -> None:
        import pyspark

        self.workdir = Path(workdir)
        self.spark_home = os.path.dirname(pyspark.__file__)
        self.attached = url is not None  # another process's Master: start none, stop none
        self.port = int(url.rsplit(":", 1)[1]) if url else free_port()
        self.host = host
        self.url = url or f"spark://{host[0]}:{self.port}"
        self.name = name
        self.env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP=host[0],
                        SPARK_LOG_DIR=str(self.workdir / "logs"), SPARK_NO_DAEMONIZE="1",
                        **(worker_env or {}))
        self.master: Optional[subprocess.Popen] = None
        self.workers: List[Optional[subprocess.Popen]] = []

    def _start(self, name: str, args: List[str], env: Dict[str, str],
               host: Host = LOOPBACK) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        # a session of its own: killpg reaches the Worker's executors and their Python workers
        return subprocess.Popen([*host[1], os.path.join(self.spark_home, "bin", "spark-class"),
                                 args[0], "--host", host[0], *args[1:]],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start(self) -> "StandaloneCluster":
        if self.attached:
            return self
        self.webui_port = free_port()
        self.master = self._start("master", [
            "org.apache.spark.deploy.master.Master", "--port",
            str(self.port), "--webui-port", str(self.webui_port)], self.env, self.host)
        return self

    def state(self) -> dict:
        """The Master's own view (its web UI's ``/json``: ``aliveworkers``, ``coresused``,
        ``activeapps``, ...); a Master started here only."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://{self.host[0]}:{self.webui_port}/json/",
                                    timeout=5) as r:
            return json.load(r)

    def wait_idle(self, workers: int, timeout: float = 90.0) -> None:
        """Until the Master has ``workers`` alive Workers and no application: what a test
        sharing the cluster must leave behind for the next one."""
        deadline, state = time.time() + timeout, {}
        while time.time() < deadline:
            try:
                state = self.state()
            except OSError:
                state = {}
            if state.get("aliveworkers") == workers and not state.get("activeapps") \
                    and state.get("coresused") == 0:
                return
            time.sleep(0.3)
        raise AssertionError(f"the shared cluster is not idle with {workers} Workers "
                             f"after {timeout:g}s: {state}")

    def registered(self) -> int:
        """Workers the Master has registered so far (its log's count)."""
        path = self.workdir / "master.log"
        return path.read_text(errors="replace").count("Registering worker") if path.exists() else 0

    def add_worker(self, env: Optional[Dict[str, str]] = None, wait: float = 90.0,
                   cores: int = 1, host: Host = LOOPBACK, memory: str = "1g") -> int:
        """Start a Worker of ``cores`` cores on ``host``; with ``wait`` > 0, until the Master
        registered it. Its index."""
        index, before = len(self.workers), self.registered()
        self.workers.append(self._start(f"{self.name}{index}", [
            "org.apache.spark.deploy.worker.Worker", self.url,
            "--cores", str(cores), "--memory", memory, "--webui-port", str(free_port())],
            dict(self.env, SPARK_WORKER_DIR=str(self.workdir / f"{self.name}-work{index}"),
                 SPARK_LOCAL_IP=host[0], **(env or {})), host))
        deadline = time.time() + wait
        while wait > 0 and self.registered() <= before:
            if time.time() > deadline:
                raise AssertionError((self.workdir / "master.log").read_text()[-3000:])
            time.sleep(0.3)
        return index

    def alive(self) -> List[int]:
        """Indexes of the Workers started here that still run."""
        return [i for i, p in enumerate(self.workers) if p is not None and p.poll() is None]

    def kill_worker(self, index: int) -> None:
        """SIGKILL Worker ``index`` with its executors: a machine lost for good."""
        proc = self.workers[index]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.workers[index] = None

    def stop(self) -> None:
        started = [p for p in [*self.workers, self.master] if p is not None]
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> "StandaloneCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
