"""PySpark's Python worker daemon, with the libraries sparktrain's tasks use imported once.

Spark starts one daemon per executor (``python -m pyspark.daemon``) and forks a Python worker
from it whenever a task finds no idle one; each new worker then imports pyspark's worker,
pandas, pyarrow, torch and sparktrain on its own: ~3.7 CPU-s per worker on a 2-core machine
(``/usr/bin/time python -c "import ..."``), paid again after every idle timeout, lost executor
or failed barrier stage. With ``spark.python.daemon.module=sparktrain.session.worker_daemon``
(what :func:`sparktrain.local_spark` and :class:`sparktrain.ConnectServer` set for local
masters) the daemon imports them before it forks, so every worker starts with them imported.
Set it in a cluster's Spark conf where the executors' Python has sparktrain installed.

PySpark's own daemon imports nothing before forking because "pandas and pyarrow start some
threads when they are imported" (``pyspark/daemon.py``). Those threads are OpenBLAS's and
Arrow's jemalloc background thread: ``fork`` copies neither, and both libraries re-initialize
in the child through ``pthread_atfork`` handlers (why PyTorch's DataLoader forks workers from
processes with them imported). The daemon runs nothing of them before forking: no tensor op
(no OpenMP pool), no CUDA. TensorFlow is not preloaded (Keras ranks fork from a template of
their own, :mod:`sparktrain.launch.zygote`).

``SPARKTRAIN_DAEMON_PRELOAD`` (comma-separated module names, in the executors' environment)
replaces the list; modules that are not installed are skipped.

Example::

    spark = SparkSession.builder.config("spark.python.daemon.module",
                                        "sparktrain.session.worker_daemon").getOrCreate()
"""
from __future__ import annotations

import importlib
import os
import runpy
from typing import Sequence

DAEMON_CONF = {"spark.python.daemon.module": "sparktrain.session.worker_daemon"}
PRELOAD = ("pyspark.worker", "pandas", "pyarrow", "torch", "sparktrain.loop.torch_loop")


def preload(names: Sequence[str]) -> None:
    """Import ``names``, skipping those that are not installed."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


if __name__ == "__main__":
    listed = os.environ.get("SPARKTRAIN_DAEMON_PRELOAD")
    preload([n.strip() for n in listed.split(",") if n.strip()] if listed is not None
            else PRELOAD)
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
