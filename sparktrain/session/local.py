"""A SparkSession set up the way sparktrain's jobs, tests and notebooks use embedded Spark.

Example::

    spark = local_spark("local[2]")      # executors run this Python, traffic stays on loopback
    spark = remote_spark("sc://host:15002")   # Spark Connect (Databricks, a Connect server)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

from pyspark.sql import SparkSession

from sparktrain.session.jvm_archive import driver_conf
from sparktrain.session.worker_daemon import DAEMON_CONF


def local_spark(master: Optional[str] = "local[*]", app_name: str = "sparktrain",
                conf: Optional[Dict[str, str]] = None) -> SparkSession:
    """Get or create a SparkSession for ``master`` with the executors on this Python
    (``master=None``: keep the one spark-submit set).

    Sets ``PYSPARK_PYTHON`` to this interpreter (unless set) so tasks can import torch and
    sparktrain, keeps local-mode traffic on 127.0.0.1, enables Arrow, and quiets Spark's logs.
    Local masters' Python workers fork from a daemon that has torch, pandas and pyarrow
    imported (:mod:`sparktrain.session.worker_daemon`), and their JVM maps the class archive
    where one was built (:mod:`sparktrain.session.jvm_archive`).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = (master or "").startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master(master) if master else SparkSession.builder
    builder = (builder.appName(app_name)
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "8")
               .config("spark.sql.debug.maxToStringFields", "1000"))
    if local:
        builder = builder.config("spark.driver.host", "127.0.0.1") \
                         .config("spark.driver.bindAddress", "127.0.0.1")
    if local and _executors_run_this_python(conf or {}):  # it has sparktrain: preloaded workers
        for key, value in DAEMON_CONF.items():
            builder = builder.config(key, value)
    for key, value in (driver_conf(conf or {}) if local else conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("SPARKTRAIN_SPARK_LOG_LEVEL", "WARN"))
    return spark


def _executors_run_this_python(conf: Dict[str, str]) -> bool:
    """Whether the executors' Python is this one (the preloading daemon needs sparktrain
    there; another Python may lack it, and sparktrain's check of it must run first)."""
    python = conf.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON", "")
    return os.path.abspath(python) == os.path.abspath(sys.executable)


def remote_spark(url: str, app_name: str = "sparktrain",
                 conf: Optional[Dict[str, str]] = None) -> SparkSession:
    """A Spark Connect session on ``url`` (``sc://host:15002``, optionally with
    ``/;token=...`` parameters, or ``local[2]`` for a server in this process).

    Example: ``spark = remote_spark("sc://localhost:15002")``; then use sparktrain as on any
    session. The cluster's Python needs sparktrain and the ML framework installed.
    """
    if not url.startswith("sc://"):  # a server in this process: its tasks run this Python
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.remote(url).appName(app_name)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


class ConnectServer:
    """A Spark Connect server in its own JVM (``spark-submit --class ...SparkConnectServer``)
    on 127.0.0.1, for trying or testing Spark Connect on one machine; executors run this
    Python. A context manager: the server stops (its process tree is killed) on exit.

    Example::

        with ConnectServer("local[2]") as server:
            spark = remote_spark(server.url)      # sc://127.0.0.1:<port>
    """

    def __init__(self, master: str = "local[2]", conf: Optional[Dict[str, str]] = None,
                 port: Optional[int] = None, start_timeout: float = 120.0) -> None:
        self.master = master
        self.conf = dict(conf or {})
        self.port = port or _free_port()
        self.start_timeout = start_timeout
        self.process: Optional["subprocess.Popen"] = None
        self.log_path = ""

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self) -> "ConnectServer":
        import pyspark

        spark_home = os.path.dirname(pyspark.__file__)
        conf = {"spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(self.port),
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.sql.execution.arrow.pyspark.enabled": "true",
                **(DAEMON_CONF if self.master.startswith("local") else {}), **self.conf}
        if self.master.startswith("local"):
            conf = driver_conf(conf)
        command = [os.path.join(spark_home, "bin", "spark-submit"), "--master", self.master,
                   "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
        for key, value in conf.items():
            command += ["--conf", f"{key}={value}"]
        command.append("spark-internal")
        env = dict(os.environ, SPARK_HOME=spark_home, PYSPARK_PYTHON=sys.executable,
                   SPARK_LOCAL_IP="127.0.0.1")
        env.pop("SPARK_REMOTE", None)
        env.pop("SPARK_CONNECT_MODE_ENABLED", None)
        log_file = tempfile.NamedTemporaryFile(prefix="sparktrain-connect-", suffix=".log",
                                               delete=False)
        self.log_path = log_file.name
        self.process = subprocess.Popen(command, env=env, stdout=log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Spark Connect server exited with code "
                                   f"{self.process.returncode}; see {self.log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Spark Connect server did not listen on port {self.port} "
                           f"within {self.start_timeout:g}s; see {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process = None

    def __enter__(self) -> "ConnectServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
