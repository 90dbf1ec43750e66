"""A SparkSession set up the way sparktrain's jobs, tests and notebooks use embedded Spark.

Example::

    spark = local_spark("local[2]")      # executors run this Python, traffic stays on loopback
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Optional

from pyspark.sql import SparkSession


def local_spark(master: Optional[str] = "local[*]", app_name: str = "sparktrain",
                conf: Optional[Dict[str, str]] = None) -> SparkSession:
    """Get or create a SparkSession for ``master`` with the executors on this Python
    (``master=None``: keep the one spark-submit set).

    Sets ``PYSPARK_PYTHON`` to this interpreter (unless set) so tasks can import torch and
    sparktrain, keeps local-mode traffic on 127.0.0.1, enables Arrow, and quiets Spark's logs.
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
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("SPARKTRAIN_SPARK_LOG_LEVEL", "WARN"))
    return spark
