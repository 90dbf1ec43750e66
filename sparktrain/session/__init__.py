"""Spark sessions and what makes them start fast.

* :mod:`.local`: ``local_spark``, ``remote_spark`` and ``ConnectServer`` (embedded and remote
  sessions, as the jobs, tests and notebooks use them);
* :mod:`.spark_api`: the one place classic and Spark Connect sessions differ;
  :mod:`.spark_jvm`: the only py4j calls into Spark's JVM (classic sessions only);
* :mod:`.jvm_archive`: the class-data sharing archive local Spark JVMs start from;
  :mod:`.worker_daemon`: the Python worker daemon that preloads torch, pandas and pyarrow.

Example::

    from sparktrain.session import local_spark
    spark = local_spark("local[2]")
"""
from __future__ import annotations

from typing import Any

_LOCAL = ("local_spark", "remote_spark", "ConnectServer")


def __getattr__(name: str) -> Any:
    # lazily: executors import spark_api and worker_daemon without the session helpers
    if name in _LOCAL:
        from sparktrain.session import local

        return getattr(local, name)
    raise AttributeError(f"module 'sparktrain.session' has no attribute {name!r}")
