"""What sparktrain asks of a SparkSession, classic or Spark Connect: the one place they differ.

A classic session has a driver-side ``SparkContext`` in this process (py4j, job groups, the
JVM's scheduler); a Spark Connect session (``SparkSession.builder.remote("sc://...")``,
Databricks serverless and standard compute) has the DataFrame API only. Everything else in
sparktrain (launch, data, persistence) runs the same code on both and calls these functions
for the few facts and actions that need one or the other.

Example::

    is_remote(spark)                 # False for local_spark(), True for builder.remote(...)
    task_slots(spark)                # 2 on local[2]; None where the cluster cannot say
    with job_tag(spark, "fit-1", "sparktrain fit"):
        df.collect()                 # cancel_tag(spark, "fit-1") from another thread stops it
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


def is_remote(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def conf_value(spark: SparkSession, key: str, default: Optional[str] = None) -> Optional[str]:
    """A Spark setting as the session sees it (the session conf starts from the SparkConf, so
    ``spark-submit --conf`` and builder settings are both visible)."""
    return spark.conf.get(key, default)


def all_conf(spark: SparkSession) -> Dict[str, str]:
    """Every setting of the session (``spark.conf.getAll`` is Spark 4 and Connect; Spark 3.5's
    classic session only has the SparkConf's list)."""
    if is_remote(spark):
        return dict(spark.conf.getAll)
    return dict(spark.sparkContext.getConf().getAll())


def master(spark: SparkSession) -> str:
    """``spark.master``: ``local[2]``, ``yarn``, ``spark://host:7077``... (empty if unknown)."""
    return conf_value(spark, "spark.master", "") or ""


def is_local_master(spark: SparkSession) -> bool:
    """One-process masters (``local``, ``local[N]``, ``local[*]``), where every slot exists as
    soon as the session does; not ``local-cluster`` (executors register over time)."""
    value = master(spark)
    return value.startswith("local") and not value.startswith("local-cluster")


# -- task slots ---------------------------------------------------------------------------------
def _cpus_of_a_task(spark: SparkSession) -> int:
    return max(1, int(conf_value(spark, "spark.task.cpus", "1") or 1))


_SERVER_CPUS: Dict[int, int] = {}  # id(session) -> CPUs of its local master's machine


def _server_cpu_count(spark: SparkSession) -> int:
    """CPUs of the machine a local master runs on (the Connect server's, not this client's);
    one tiny job per session."""
    if id(spark) in _SERVER_CPUS:
        return _SERVER_CPUS[id(spark)]
    import pandas as pd

    def count(batches: Iterator[Any]) -> Iterator[pd.DataFrame]:
        import os

        for _ in batches:
            pass
        yield pd.DataFrame({"cpus": [os.cpu_count() or 1]})

    cpus = int(spark.range(0, 1, 1, 1).mapInPandas(count, "cpus int").collect()[0][0])
    _SERVER_CPUS[id(spark)] = cpus
    return cpus


def slots_from_conf(spark: SparkSession) -> Optional[int]:
    """Concurrent tasks the cluster's settings promise, or ``None`` when they do not say (a
    cluster manager's own default executor count, unbounded dynamic allocation).

    Spark Connect has no ``SparkContext.maxNumConcurrentTasks``; this reads what sizes the
    cluster: ``local[N]``, ``local-cluster[N,C,M]``, or executors x cores / ``spark.task.cpus``.
    """
    value, task_cpus = master(spark), _cpus_of_a_task(spark)
    local = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", value)
    if local:
        threads = local.group(1)
        cores = 1 if threads is None else \
            _server_cpu_count(spark) if threads == "*" else int(threads)
        return cores // task_cpus
    cluster = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", value)
    if cluster:
        return int(cluster.group(1)) * int(cluster.group(2)) // task_cpus
    cores = conf_value(spark, "spark.executor.cores")
    allocation = conf_value(spark, "spark.dynamicAllocation.enabled", "false") or ""
    dynamic = allocation.lower() == "true"
    executors = conf_value(spark, "spark.dynamicAllocation.maxExecutors" if dynamic
                           else "spark.executor.instances")
    if cores is None or executors is None or int(executors) >= 2 ** 31 - 1:
        return None
    return int(executors) * int(cores) // task_cpus


def task_slots(spark: SparkSession, profile: Any = None) -> Optional[int]:
    """Barrier tasks (of ``profile``, a ResourceProfile; default: the application's) the
    cluster can run at once now: Spark's own count on a classic session (what its barrier
    check uses), :func:`slots_from_conf` on a Connect one."""
    if is_remote(spark):
        return slots_from_conf(spark) if profile is None else _gpu_slots_from_conf(spark, profile)
    from sparktrain.session.spark_jvm import max_concurrent_tasks

    return max_concurrent_tasks(spark.sparkContext, profile)


def _gpu_slots_from_conf(spark: SparkSession, profile: Any) -> Optional[int]:
    """Tasks of ``profile`` the settings promise on a Connect session: per executor, as many
    as its GPUs and its cores allow (``None`` when the settings do not say)."""
    tasks = profile.taskResources
    gpus = tasks["gpu"].amount if "gpu" in tasks else 0
    cpus = int(tasks["cpus"].amount) if "cpus" in tasks else _cpus_of_a_task(spark)
    cluster = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),.*", master(spark))
    executors = cluster.group(1) if cluster else conf_value(spark, "spark.executor.instances")
    cores = cluster.group(2) if cluster else conf_value(spark, "spark.executor.cores")
    each = conf_value(spark, "spark.executor.resource.gpu.amount")
    if executors is None or (cores is None and (not gpus or each is None)):
        return None
    per_executor = [int(cores) // max(1, cpus)] if cores is not None else []
    if gpus:
        if each is None:
            return 0
        per_executor.append(int(float(each) // gpus))
    return int(executors) * min(per_executor)


# -- the store ----------------------------------------------------------------------------------
_SHARED_STORES: set = set()  # (session, local store path) already seen from the executors


def check_store_shared(spark: SparkSession, store: Any) -> None:
    """Fail before any training job if the executors cannot see a local-path store.

    A local path is shared only when Spark runs on this machine (a local master on a classic
    session). Otherwise (a cluster, or a Spark Connect server that may be elsewhere) one tiny
    job looks for a file written here; without it the data would be written to disks the
    client never reads.
    """
    if not store.is_local or (is_local_master(spark) and not is_remote(spark)):
        return
    key = (id(spark), store.prefix)
    if key in _SHARED_STORES:
        return
    import os
    import uuid

    import pandas as pd

    marker = os.path.join(store.prefix, "_probe", uuid.uuid4().hex)
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    open(marker, "w").close()

    def look(batches: Iterator[Any]) -> Iterator[pd.DataFrame]:
        for _ in batches:
            pass
        yield pd.DataFrame({"seen": [os.path.exists(marker)]})

    try:
        seen = spark.range(0, 1, 1, 1).mapInPandas(look, "seen boolean").collect()[0][0]
    finally:
        os.remove(marker)
    if seen:
        _SHARED_STORES.add(key)
        return
    where = "the Spark Connect server's executors" if is_remote(spark) else "the executors"
    raise ValueError(f"store={store.prefix!r} is a local path that {where} cannot see; give "
                     f"a store both sides reach (s3://, abfss://, gs://, hdfs://, or a shared "
                     f"mount), with storage_options for its credentials")


# -- jobs ---------------------------------------------------------------------------------------
@contextmanager
def job_tag(spark: SparkSession, tag: str, description: str = "") -> Iterator[None]:
    """Tag the Spark jobs this thread starts inside the block, so :func:`cancel_tag` can stop
    them from any thread (job tags work on both kinds of session; job groups are classic only).
    """
    if is_remote(spark):
        spark.addTag(tag)
        try:
            yield
        finally:
            spark.removeTag(tag)
        return
    sc = spark.sparkContext
    sc.addJobTag(tag)
    sc.setInterruptOnCancel(True)
    if description:
        sc.setJobDescription(description)
    try:
        yield
    finally:
        sc.removeJobTag(tag)
        sc.setInterruptOnCancel(False)
        sc.setLocalProperty("spark.job.description", None)


def cancel_tag(spark: SparkSession, tag: str) -> None:
    """Cancel every running job tagged ``tag`` (see :func:`job_tag`); never raises."""
    try:
        if is_remote(spark):
            spark.interruptTag(tag)
        else:
            spark.sparkContext.cancelJobsWithTag(tag)
    except Exception as exc:  # noqa: BLE001 - a failed cancel must not hide the fit's error
        log.warning("could not cancel Spark jobs tagged %s: %s", tag, exc)


# -- plans --------------------------------------------------------------------------------------
def plan_fingerprint(df: DataFrame) -> str:
    """The analyzed plan as text without expression ids, plus its semantic hash (see
    :func:`sparktrain.session.spark_jvm.plan_fingerprint`); over Connect the text is the server's
    ``explain(extended=True)`` analyzed section."""
    if not is_remote(df.sparkSession):
        from sparktrain.session import spark_jvm

        return spark_jvm.plan_fingerprint(df)
    text = df._explain_string(extended=True)
    match = re.search(r"== Analyzed Logical Plan ==\n(.*?)\n== ", text, re.S)
    analyzed = match.group(1) if match else text
    return f"{re.sub(r'#[0-9]+L?', '', analyzed)}|{df.semanticHash()}"


def local_dirs(spark: SparkSession) -> str:
    """Where the executors keep shuffle and block files, as this driver can tell:
    ``SPARK_LOCAL_DIRS`` (which wins in Spark too), ``spark.local.dir``, else ``/tmp``."""
    return os.environ.get("SPARK_LOCAL_DIRS") or conf_value(spark, "spark.local.dir", None) \
        or "/tmp"


def num_partitions(df: DataFrame) -> Optional[int]:
    """``df``'s number of partitions where the session can tell without running it (classic
    sessions); ``None`` over Spark Connect, whose DataFrames have no RDD."""
    if is_remote(df.sparkSession):
        return None
    return df.rdd.getNumPartitions()


def classic_only(spark: SparkSession, what: str, instead: str) -> None:
    """Raise before any job when ``what`` needs a driver-side SparkContext and ``spark`` is a
    Spark Connect session; ``instead`` says what to use."""
    if is_remote(spark):
        raise ValueError(f"{what} needs a classic SparkSession (a SparkContext in this "
                         f"process); this is a Spark Connect session. {instead}")
