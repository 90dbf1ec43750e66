"""What sparktrain asks of a SparkSession, classic or Spark Connect: the one place they differ.

A classic session has a driver-side ``SparkContext`` in this process (py4j, job groups, the
JVM's scheduler); a Spark Connect session (``SparkSession.builder.remote("sc://...")``,
Databricks serverless and standard compute) has the DataFrame API only. Everything else in
sparktrain (launch, data, persistence) runs the same code on both and calls these functions
for the few facts and actions that need one or the other.

Example::

    is_remote(spark)                 # False for local_spark(), True for builder.remote(...)
    with job_tag(spark, "fit-1", "sparktrain fit"):
        df.collect()                 # cancel_tag(spark, "fit-1") from another thread stops it
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, cast

from pyspark.sql import DataFrame, SparkSession

if TYPE_CHECKING:
    from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame

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


# -- the store ----------------------------------------------------------------------------------
_SHARED_STORES: set = set()  # (session, local store path) already seen from the executors

# What a store URL's HDFS client needs from the driver's Hadoop configuration: the default
# filesystem (``hdfs:///p``) and a nameservice's namenodes (HA).
_HDFS_KEYS = r"^(fs\.defaultFS|dfs\.nameservices|dfs\.ha\.namenodes\..*|" \
             r"dfs\.namenode\.rpc-address\..*|dfs\.client\.failover\.proxy\.provider\..*)$"


def hdfs_settings(spark: SparkSession) -> Dict[str, str]:
    """The driver's Hadoop settings an ``hdfs://`` store URL may need (``fs.defaultFS``, HA
    nameservices): from Spark's Hadoop configuration on a classic session (``core-site.xml``
    and ``hdfs-site.xml`` of ``HADOOP_CONF_DIR``, ``spark.hadoop.*``); over Spark Connect from
    the ``spark.hadoop.*`` settings the client can read."""
    if not is_remote(spark):
        from sparktrain.session.spark_jvm import hadoop_conf_matching

        return hadoop_conf_matching(spark.sparkContext, _HDFS_KEYS)
    prefix = "spark.hadoop."
    return {key[len(prefix):]: value for key, value in all_conf(spark).items()
            if key.startswith(prefix) and re.match(_HDFS_KEYS, key[len(prefix):])}


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
        # pyspark types value as str; its docs: None unsets the property
        sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]


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
    # a Connect DataFrame here (typed as the classic one, whose __getattr__ gives a Column)
    text = cast("ConnectDataFrame", df)._explain_string(extended=True)
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
