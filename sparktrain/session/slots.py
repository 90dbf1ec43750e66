"""Task slots: how many tasks the cluster runs at once, and which of them running fits hold.

Counted here only, for both kinds of session (Spark's own ``maxNumConcurrentTasks`` on a
classic one, the settings on a Spark Connect one: :func:`task_slots`). A fit that streams its
rows (``input_mode="stream"``) feeds its ranks from ordinary jobs beside the training stage
only where slots are left for them once the ranks *and every other fit and job running now*
hold theirs (:func:`claim_slots`): two fits that each took the cluster's last free slot for
their ranks would otherwise wait for feeders that can never start (``CrossValidator(
parallelism=2)`` on ``local[2]``). Claims are this driver's; jobs of other drivers on the same
application (a shared Spark Connect server) show as the tasks they run now.

Example::

    task_slots(spark)                                  # 2 on local[2]; None where unknown
    with claim_slots(spark, ranks=1, feeders=True) as claim:
        claim.spare                                    # True: one slot is left to feed
"""
from __future__ import annotations

import itertools
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from pyspark.sql import SparkSession

from sparktrain.session.spark_api import conf_value, is_remote, master

log = logging.getLogger(__name__)


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
        threads_count = 1 if threads is None else \
            _server_cpu_count(spark) if threads == "*" else int(threads)
        return threads_count // task_cpus
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


def promised_slots(spark: SparkSession) -> Optional[int]:
    """Task slots the settings ask the cluster manager for (:func:`promised_by`), of which
    some may belong to executors that have not registered yet."""
    keys = ("spark.dynamicAllocation.enabled", "spark.cores.max", "spark.executor.instances",
            "spark.executor.cores", "spark.task.cpus")
    return promised_by(master(spark), {key: value for key in keys
                                       if (value := conf_value(spark, key)) is not None})


def promised_by(manager: str, conf: Dict[str, str]) -> Optional[int]:
    """Task slots a cluster manager starts executors for by itself with these settings
    (static allocation): on YARN and Kubernetes ``spark.executor.instances`` (default 2) x
    ``spark.executor.cores`` (default 1) / ``spark.task.cpus``; on standalone
    ``spark.cores.max`` in executors of ``spark.executor.cores``. ``None`` for local masters,
    dynamic allocation (executors come for pending tasks, which a barrier stage never leaves)
    and standalone without ``spark.cores.max`` (every free core: nothing is promised).

    Example: ``promised_by("yarn", {"spark.executor.instances": "3"}) == 3``
    """
    if manager.startswith("local") or \
            conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        return None
    task_cpus = max(1, int(conf.get("spark.task.cpus", "1")))
    if manager.startswith("spark://"):
        if "spark.cores.max" not in conf:
            return None
        total = int(conf["spark.cores.max"])
        if "spark.executor.cores" not in conf:
            return total // task_cpus
        cores = int(conf["spark.executor.cores"])
        return (total // cores) * (cores // task_cpus)
    if manager.startswith(("yarn", "k8s://")):
        executors = int(conf.get("spark.executor.instances", "2"))
        return executors * (int(conf.get("spark.executor.cores", "1")) // task_cpus)
    return None


def task_slots(spark: SparkSession, profile: Any = None) -> Optional[int]:
    """Barrier tasks (of ``profile``, a ResourceProfile; default: the application's) the
    cluster can run at once now: Spark's own count on a classic session (what its barrier
    check uses), :func:`slots_from_conf` on a Connect one."""
    if is_remote(spark):
        return slots_from_conf(spark) if profile is None else _gpu_slots_from_conf(spark, profile)
    from sparktrain.session.spark_jvm import max_concurrent_tasks

    return max_concurrent_tasks(spark.sparkContext, profile)


def rank_slots(spark: SparkSession, profile: Any = None, ranks_per_task: int = 1
               ) -> Optional[int]:
    """Ranks the cluster can run at once: its task slots (of ``profile``) times the ranks each
    task runs (one per GPU of a task holding several); ``None`` where it cannot say."""
    slots = task_slots(spark, profile)
    return None if slots is None else slots * ranks_per_task


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


# -- what running fits and jobs hold -------------------------------------------------------------
@dataclass(frozen=True)
class SlotClaim:
    """The slots a fit holds while it trains: ``ranks`` (its training stage's tasks) and one
    for feeding them when ``spare`` (its rows can be fed by jobs beside the ranks)."""

    ranks: int
    spare: bool
    slots: Optional[int]  # the cluster's, when the fit started
    busy: int  # held by other fits and jobs then

    @property
    def held(self) -> int:
        return self.ranks + (1 if self.spare else 0)


_LOCK = threading.Lock()
_CLAIMS: Dict[str, Dict[int, SlotClaim]] = {}  # application -> claim id -> claim
_IDS = itertools.count()


def _application(spark: SparkSession) -> str:
    return conf_value(spark, "spark.app.id") or master(spark)


@contextmanager
def claim_slots(spark: SparkSession, ranks: int, feeders: bool) -> Iterator[SlotClaim]:
    """Hold ``ranks`` task slots for a fit's training stage, plus one to feed its ranks
    beside it when ``feeders`` and the cluster has one left over every other claim of this
    driver and every task running now (``claim.spare``); released when the block ends."""
    key = _application(spark)
    with _LOCK:
        slots = task_slots(spark)
        claimed = sum(c.held for c in _CLAIMS.get(key, {}).values())
        busy = max(claimed, running_tasks(spark) or 0)
        # a cluster that cannot say its size (dynamic allocation without a bound): one fit of
        # the driver at a time may feed beside its ranks, as the first fit finds it
        spare = feeders and (slots - busy > ranks if slots is not None else not claimed)
        claim = SlotClaim(ranks, spare, slots, busy)
        number = next(_IDS)
        _CLAIMS.setdefault(key, {})[number] = claim
    try:
        yield claim
    finally:
        with _LOCK:
            _CLAIMS[key].pop(number, None)


def fits_holding_slots(spark: SparkSession) -> int:
    """How many fits of this driver hold slot claims now (their slots come back when they
    end)."""
    with _LOCK:
        return len(_CLAIMS.get(_application(spark), {}))


def running_tasks(spark: SparkSession) -> Optional[int]:
    """Tasks running now in this application (``None`` over Spark Connect: it cannot say)."""
    if is_remote(spark):
        return None
    tracker = spark.sparkContext.statusTracker()
    stages = (tracker.getStageInfo(s) for s in tracker.getActiveStageIds())
    return sum(s.numActiveTasks for s in stages if s is not None)


def busy_stages(spark: SparkSession, exclude: Optional[List[int]] = None) -> List[str]:
    """The stages running tasks now, for an error that says what holds the slots
    (``'stage 12 "mapInArrow at ..." (1 task)'``); none over Spark Connect."""
    if is_remote(spark):
        return []
    tracker = spark.sparkContext.statusTracker()
    found = []
    for stage_id in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage_id)
        if info is None or not info.numActiveTasks or stage_id in (exclude or []):
            continue
        tasks = info.numActiveTasks
        found.append(f"stage {stage_id} \"{info.name}\" ({tasks} task{'s' * (tasks > 1)})")
    return found


def job_tasks(spark: SparkSession, tag: str) -> Optional[Tuple[int, int]]:
    """``(tasks running, tasks ended)`` of the jobs tagged ``tag`` (``None`` over Spark
    Connect, or where this Spark cannot list jobs by tag)."""
    if is_remote(spark):
        return None
    from sparktrain.session.spark_jvm import job_progress

    return job_progress(spark.sparkContext, tag)
