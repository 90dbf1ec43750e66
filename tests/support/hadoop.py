"""Hadoop's mini clusters for the tests, as Spark's own YARN tests get them: a MiniDFSCluster
(a NameNode and a DataNode) and a MiniYARNCluster (a ResourceManager and NodeManagers) in one
JVM of their own (scripts/hadoop/MiniHadoop.java, compiled by ``./scripts/setup.sh --hadoop``
against the jars it fetched with Maven into ~/.cache/sparktrain/hadoop). Nothing is mocked:
Spark talks to the ResourceManager and the NameNode over their RPC ports on this machine, and
YARN runs the executors in containers (processes under its NodeManagers' folders).

Example::

    with MiniHadoop(workdir, node_managers=2) as hadoop:
        hadoop.hdfs              # "hdfs://localhost:PORT"
        hadoop.conf_dir          # HADOOP_CONF_DIR for clients (pyspark, spark-submit)
        spark = yarn_session(hadoop, "my-app")
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from typing import Any, Dict, Optional

HOME = os.path.join(os.path.expanduser("~"), ".cache", "sparktrain", "hadoop")
START_SECONDS = 240.0  # under a loaded 2-core machine it has taken up to ~60 s


def available() -> Optional[str]:
    """``None`` when the mini clusters can start here, else why not."""
    if not os.path.exists(os.path.join(HOME, "classes", "MiniHadoop.class")):
        return "Hadoop's mini clusters are not set up: run ./scripts/setup.sh --hadoop"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java"
    return None


class MiniHadoop:
    """The two mini clusters, started on ``__enter__`` and stopped on ``__exit__`` (their
    JVM ends when its standard input closes, so also when this process dies)."""

    def __init__(self, workdir: str, node_managers: int = 2, memory_mb: int = 4096,
                 vcores: int = 4, gpus: int = 0) -> None:
        self.workdir = os.path.abspath(workdir)
        self.node_managers, self.memory_mb, self.vcores = node_managers, memory_mb, vcores
        self.gpus = gpus  # per NodeManager, as the resource type yarn.io/gpu (counted only)
        self.conf_dir = os.path.join(self.workdir, "conf")
        self.log_path = os.path.join(self.workdir, "mini-hadoop.log")
        self.hdfs = ""
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "MiniHadoop":
        why = available()
        if why:
            raise RuntimeError(why)
        os.makedirs(self.workdir, exist_ok=True)
        java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") \
            if os.environ.get("JAVA_HOME") else "java"
        classpath = os.pathsep.join([os.path.join(HOME, "jars", "*"),
                                     os.path.join(HOME, "classes")])
        env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [java, "-Xmx768m", "-XX:TieredStopAtLevel=1", "-cp", classpath, "MiniHadoop",
                 self.workdir, str(self.node_managers), str(self.memory_mb), str(self.vcores),
                 str(self.gpus)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.workdir)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            ready = [line for line in self._log().splitlines() if line.startswith("READY ")]
            if ready:
                self.hdfs = ready[0].split()[1]
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the mini clusters did not start; their log:\n{self._log()[-6000:]}")

    def __exit__(self, *exc: Any) -> None:
        if self.process is None:
            return
        try:  # a clean stop takes ~40 s (YARN's services one by one): their data is a test's
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def _log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def env(self) -> Dict[str, str]:
        """What a Hadoop client (spark-submit, pyspark, hdfs-native) reads its cluster from."""
        return {"HADOOP_CONF_DIR": self.conf_dir, "YARN_CONF_DIR": self.conf_dir}

    def spark_jars_archive(self) -> str:
        """pyspark's jars as one archive on HDFS (``spark.yarn.archive``), uploaded once: else
        every application uploads the ~200 jars again to its staging folder."""
        import fsspec
        import pyspark

        url = f"{self.hdfs}/sparktrain-test/spark-jars-{pyspark.__version__}.zip"
        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            local = os.path.join(self.workdir, "spark-jars.zip")
            jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
            with zipfile.ZipFile(local, "w", zipfile.ZIP_STORED) as archive:
                for name in sorted(os.listdir(jars)):
                    archive.write(os.path.join(jars, name), name)
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            fs.put_file(local, path)
            os.remove(local)
        return url


C1_ONLY = "-XX:TieredStopAtLevel=1"


def yarn_conf(hadoop: MiniHadoop, executors: int = 2, cores: int = 1,
              python: str = sys.executable) -> Dict[str, str]:
    """Spark settings of an application on the mini YARN cluster: ``executors`` executors of
    ``cores`` cores and 640 MiB, the driver on 127.0.0.1, the executors' Python ``python``
    (this machine's: the NodeManagers' containers run here)."""
    return {
        "spark.executor.instances": str(executors), "spark.executor.cores": str(cores),
        "spark.executor.memory": "640m", "spark.executor.memoryOverhead": "384m",
        "spark.yarn.am.memory": "256m", "spark.driver.host": "127.0.0.1",
        "spark.yarn.archive": hadoop.spark_jars_archive(),
        "spark.pyspark.python": python,
        "spark.executorEnv.PYSPARK_PYTHON": python,
        "spark.ui.enabled": "false",
        # C1 only, as every other JVM of the tests (tests/conftest.py): the containers' JVMs
        # (ApplicationMaster, executors; the driver in cluster mode) do not get the tests'
        # JAVA_TOOL_OPTIONS, since YARN gives a container its own environment
        **{f"spark.{role}.extraJavaOptions": C1_ONLY
           for role in ("driver", "executor", "yarn.am")},
    }


def stop_node_manager(workdir: str, index: int, timeout: float = 120.0) -> None:
    """Stop the mini YARN cluster's NodeManager ``index`` for good (scripts/hadoop/
    MiniHadoop.java watches ``workdir/control``): its containers die with it."""
    control = os.path.join(workdir, "control")
    open(os.path.join(control, f"stop-nm-{index}"), "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(control, f"stop-nm-{index}.done")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"NodeManager {index} did not stop in {timeout:.0f} s")
        time.sleep(0.2)


def yarn_containers(workdir: str, app_id: str) -> list:
    """The running JVMs of application ``app_id``'s containers on the mini YARN cluster whose
    folder is ``workdir``: ``[{"pid", "role" ("am" or "executor"), "node_manager"}]``, read
    from /proc (a container's folder lies under its NodeManager's ``...-localDir-nm-I_J``)."""
    import re

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
            folder = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue  # gone, or not ours to read
        node = re.search(r"-localDir-nm-(\d+)_\d+/", folder)
        if app_id not in folder or node is None or not command.split("\0")[0].endswith("java"):
            continue  # not a container of the app, or its launch shell rather than its JVM
        if "YarnCoarseGrainedExecutorBackend" in command:
            role = "executor"
        elif "ExecutorLauncher" in command or "ApplicationMaster" in command:
            role = "am"
        else:
            continue
        found.append({"pid": int(pid), "role": role, "node_manager": int(node.group(1))})
    return found


def container_log(workdir: str, app_id: str, container: int = 1, name: str = "stdout") -> str:
    """A container's log file as ``yarn logs -applicationId APP_ID`` shows it (the mini
    cluster keeps them under its NodeManagers' log folders): container 1 is the
    ApplicationMaster, which in cluster mode is the driver."""
    import glob

    suffix = f"_{container:06d}"
    for path in glob.glob(os.path.join(workdir, "**", app_id, "container_*", name),
                          recursive=True):
        if os.path.basename(os.path.dirname(path)).endswith(suffix):
            with open(path, errors="replace") as f:
                return f.read()
    raise FileNotFoundError(f"no {name} of container {container} of {app_id} in {workdir}")
