"""Every call sparktrain makes into Spark's JVM through py4j, in one place.

These are internals (``df._jdf``, ``sc._jsc``, ``sc._jvm``), not PySpark's public API, so they
can change between Spark versions; each function here is exercised by the tests on both tested
stacks (Spark 3.5 and Spark 4). They exist only on a classic session (a driver-side
SparkContext), never on a Spark Connect one.

Example::

    plan_fingerprint(df)                    # 'Project [x, y]\\n+- LogicalRDD ...|-1093785321'
    max_concurrent_tasks(spark.sparkContext)   # 2 on local[2]

sparktrain.session.spark_api chooses between these and their Spark Connect counterparts.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

_ALL_FIELDS = 2 ** 31 - 1

# TreeNode.treeString's full overload: Spark 3.5 has (verbose, addSuffix, maxFields,
# printOperatorId); Spark 4 adds a fifth flag (printOutputColumns), and the 4-argument form is
# gone. Py4J cannot use Scala's default arguments, so each form is named in full.
_TREE_STRING_ARGS = ((False, False, _ALL_FIELDS, False, False), (False, False, _ALL_FIELDS, False))


def plan_fingerprint(df: DataFrame) -> str:
    """The analyzed plan as untruncated text without expression ids, plus its semantic hash.

    The semantic hash covers local data (``LocalRelation``) and RDD identity; the text covers
    what the hash leaves out of file sources (paths, options, pushed filters).
    """
    plan = df._jdf.queryExecution().analyzed()
    for args in _TREE_STRING_ARGS:
        try:
            text = plan.treeString(*args)
            break
        except Py4JError:
            continue
    else:
        raise RuntimeError("this Spark version has no TreeNode.treeString overload sparktrain "
                           "knows (tested: Spark 3.5 and 4.x)")
    return f"{re.sub(r'#[0-9]+L?', '', text)}|{plan.semanticHash()}"


def remove_path(spark: SparkSession, path: str) -> None:
    """Delete ``path`` the way Spark ML's ``write().overwrite()`` does (refusing to delete the
    working directory or a parent of it)."""
    assert spark._jvm is not None  # a classic session's driver
    overwrite = spark._jvm.org.apache.spark.ml.util.FileSystemOverwrite()
    overwrite.handleOverwrite(path, True, spark._jsparkSession)


def hadoop_conf(sc: SparkContext, key: str) -> str | None:
    """One value of the Hadoop configuration Spark uses (e.g. ``fs.defaultFS``)."""
    return sc._jsc.hadoopConfiguration().get(key)


def hadoop_conf_matching(sc: SparkContext, pattern: str) -> Dict[str, str]:
    """The Hadoop configuration's entries whose keys match the regular expression ``pattern``
    (``Configuration.getValByRegex``: values with variables expanded)."""
    return {str(k): str(v) for k, v in
            sc._jsc.hadoopConfiguration().getValByRegex(pattern).items()}


def max_concurrent_tasks(sc: SparkContext, profile: Any = None) -> int:
    """Tasks of ``profile`` (a ``pyspark.resource.ResourceProfile``; default: the default
    profile) the cluster can run at once right now (what Spark's own barrier check uses:
    ``SparkContext.maxNumConcurrentTasks``). A profile is registered first, as
    ``RDD.withResources`` does: Spark counts slots of registered profiles only."""
    jsc = sc._jsc.sc()
    manager = jsc.resourceProfileManager()
    if profile is None or profile._java_resource_profile is None:
        java_profile = manager.defaultResourceProfile()
    else:
        java_profile = profile._java_resource_profile
        manager.addResourceProfile(java_profile)
    return int(jsc.maxNumConcurrentTasks(java_profile))


def job_progress(sc: SparkContext, tag: str) -> Optional[Tuple[int, int]]:
    """``(tasks running, tasks ended)`` over every stage of the jobs tagged ``tag`` (``None``
    where this Spark cannot list jobs by tag)."""
    try:
        ids = list(sc._jsc.sc().statusTracker().getJobIdsForTag(tag))
    except Py4JError:  # no such method on this Spark
        return None
    tracker = sc.statusTracker()
    running = ended = 0
    for job_id in ids:
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job is not None else ():
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                running += stage.numActiveTasks
                ended += stage.numCompletedTasks + stage.numFailedTasks
    return running, ended
