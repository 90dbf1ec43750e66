"""Run a function as ``num_proc`` Spark barrier tasks, one per training rank.

One code path for classic and Spark Connect sessions: the tasks are a barrier
``DataFrame.mapInArrow`` (Spark >= 3.5), cancelled through job tags, and everything a rank
says (``[rank N]`` log lines, progress, its traceback) travels through the store
(:mod:`.events`), so executors never open a connection to the client. The launcher checks up
front that the cluster has enough concurrent task slots (Spark's own barrier check retries for
minutes before failing) and turns a failed stage into a
:class:`~sparktrain.errors.TrainingError` carrying the traceback of the rank that failed first.

Retries: Spark never retries a failed barrier *result* stage ("Could not recover from a failed
barrier ResultStage"), but it re-runs a failed barrier *shuffle map* stage as a whole, up to
``spark.stage.maxConsecutiveAttempts`` times (default 4), whether a task raised, its Python
worker was killed or its executor was lost. So the barrier tasks' results go through a one-
partition shuffle (``repartition(1)``), every rank learns its attempt number
(``RankContext.attempt``) and a training loop can resume from its last checkpoint.
``max_attempts`` caps the attempts below Spark's limit: the client cancels the job once that
many attempts have failed. Only faults are retried: a rank whose error came out of the user's
code (:mod:`.faults`) reports it as fatal, the client cancels the job at once, and ranks of a
re-run Spark started meanwhile stop before training.

Example::

    def task(rank: RankContext) -> int:
        rank.log(f"hello from {rank.rank} of {rank.world_size}")
        return rank.rank

    run_barrier(spark, 2, task)   # [0, 1]
"""
from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import cloudpickle
from pyspark.sql import DataFrame, SparkSession

from sparktrain.data.sources.contract import StageInput
from sparktrain.errors import TrainingError, spark_disk_full
from sparktrain.fs import DEFAULT_LAUNCH_DIR, filesystem
from sparktrain.launch.events import EventWatcher
from sparktrain.launch.rank_context import LaunchSite, RankContext
from sparktrain.launch.rank_run import FAILURE_TAG, run_rank
from sparktrain.session.interrupts import raise_if_interrupted
from sparktrain.session.slots import promised_slots, rank_slots
from sparktrain.session.spark_api import (
    cancel_tag,
    conf_value,
    is_local_master,
    is_remote,
    job_tag,
    local_dirs,
    master,
)

log = logging.getLogger(__name__)

SLOT_WAIT_CONF = "spark.sparktrain.slotWaitSeconds"
DEFAULT_SLOT_WAIT_SECONDS = 10.0
# How long a fit waits for executors the cluster manager was asked for and is still starting
# (a YARN container localizing a multi-GB environment archive took ~6 minutes: issue #62).
EXECUTOR_WAIT_CONF = "spark.sparktrain.executorWaitSeconds"
DEFAULT_EXECUTOR_WAIT_SECONDS = 600.0
_WAIT_LOG_EVERY_S = 15.0
# Results larger than this go through the store, not the result rows (Spark Connect's gRPC
# messages are capped at 128 MiB by default).
INLINE_RESULT_BYTES = 16 * 1024 * 1024
_RESULT_SCHEMA = "rank int, result binary, stored string"


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------

def _slot_hint(spark: SparkSession, num_proc: int, gpus: bool = False) -> str:
    value = master(spark)
    if gpus:
        return (f"give the cluster more GPUs: spark.executor.instances (now "
                f"{conf_value(spark, 'spark.executor.instances', 'unset')}) x "
                f"spark.executor.resource.gpu.amount (now "
                f"{conf_value(spark, 'spark.executor.resource.gpu.amount', 'unset')}) must be "
                f">= {num_proc} GPUs, with spark.executor.cores enough for a task per GPU")
    if value.startswith("local-cluster"):
        return f"start Spark with master local-cluster[N,C,M] where N*C >= {num_proc}"
    if value.startswith("local"):
        return f"start Spark with master local[{num_proc}] (or more, e.g. local[*])"
    hint = (f"give the cluster more task slots: spark.executor.instances "
            f"(now {conf_value(spark, 'spark.executor.instances', 'unset')}) x "
            f"spark.executor.cores (now {conf_value(spark, 'spark.executor.cores', 'unset')}) / "
            f"spark.task.cpus (now {conf_value(spark, 'spark.task.cpus', '1')}) must be >= "
            f"{num_proc}; with dynamic allocation set spark.dynamicAllocation.minExecutors high "
            f"enough")
    if value == "yarn":  # the executors asked for may be containers YARN has no room for
        hint += (f"; on YARN each executor is a container of spark.executor.memory (now "
                 f"{conf_value(spark, 'spark.executor.memory', '1g')}) + "
                 f"spark.executor.memoryOverhead and spark.executor.cores vcores, which the "
                 f"queue (spark.yarn.queue, now {conf_value(spark, 'spark.yarn.queue', 'default')}"
                 f") and yarn.scheduler.maximum-allocation-mb must have room for: executors YARN "
                 f"cannot place stay pending (`yarn application -status <id>`)")
    return hint


def check_slots(spark: SparkSession, num_proc: int, wait_seconds: Optional[float] = None,
                name: str = "num_proc", profile: Any = None, ranks_per_task: int = 1
                ) -> Optional[int]:
    """Fail if the ``num_proc`` ranks' barrier tasks (``ranks_per_task`` ranks each, tasks of
    ``profile`` when given) cannot run at once; returns the slot count in ranks (``None``
    where the cluster cannot say: then Spark's own barrier check decides). ``name``: the param
    the error names (an elastic fit checks ``min_num_proc``).

    On a classic session with a cluster master, waits up to ``wait_seconds`` for executors to
    register first; local masters have all their slots from the start and are not waited for.
    Where the settings ask the cluster manager for enough executors (:func:`promised_slots`:
    YARN's and Kubernetes' ``spark.executor.instances``, standalone's ``spark.cores.max``) the
    ones still starting are waited for up to ``spark.sparktrain.executorWaitSeconds`` (600),
    with a log line every 15 s; where they are not enough it fails after ``wait_seconds``.
    """
    if wait_seconds is None:
        wait_seconds = float(conf_value(spark, SLOT_WAIT_CONF, None)
                             or DEFAULT_SLOT_WAIT_SECONDS)
    if is_local_master(spark) or is_remote(spark):
        wait_seconds = 0.0  # nothing to wait for (Connect: the count comes from the conf)
    started = time.monotonic()
    tasks = -(-num_proc // ranks_per_task)

    def count() -> Optional[int]:
        return rank_slots(spark, profile, ranks_per_task)

    slots = count()
    if slots is None:
        log.info("the cluster's settings do not say how many tasks it can run at once; "
                 "Spark's barrier check will tell if num_proc=%d is too many", num_proc)
        return None
    slots, wait_seconds = _wait_for_slots(spark, num_proc, slots, count, started, wait_seconds,
                                          plain=ranks_per_task == 1 and profile is None)
    if slots < num_proc:
        waited = f", waited {wait_seconds:.0f}s for executors" if wait_seconds else ""
        plain = ranks_per_task == 1 and profile is None
        needs = f"{num_proc} task slots" if plain else \
            _gpu_slots_text(tasks, ranks_per_task, profile)
        has = str(slots) if plain else f"room for {slots} rank(s)"
        raise RuntimeError(
            f"{name}={num_proc} needs {needs} running at the same time (Spark barrier mode), "
            f"but the cluster has {has} (master {master(spark)}{waited}). "
            f"Lower {name} to {max(slots, ranks_per_task)} or "
            f"{_slot_hint(spark, num_proc, profile is not None or ranks_per_task > 1)}."
            + ("" if is_local_master(spark) or is_remote(spark) else
               f" ({SLOT_WAIT_CONF} sets how long to wait for executors, {EXECUTOR_WAIT_CONF} "
               f"how long for those the settings ask the cluster manager for.)"))
    return slots


def _wait_for_slots(spark: SparkSession, num_proc: int, slots: int,
                    count: Callable[[], Optional[int]], started: float, wait_seconds: float,
                    plain: bool) -> Tuple[int, float]:
    """Count the slots again until ``num_proc`` are up: for ``wait_seconds``, or, while the
    executors the settings ask for would be enough, for the executor wait (logging). Returns
    the last count and the seconds waited."""
    promised = promised_slots(spark) if plain and wait_seconds > 0 else None
    coming = promised is not None and promised >= num_proc
    patience = max(wait_seconds, float(conf_value(spark, EXECUTOR_WAIT_CONF, None) or
                                       DEFAULT_EXECUTOR_WAIT_SECONDS)) if coming else wait_seconds
    next_line = started + min(wait_seconds, _WAIT_LOG_EVERY_S)
    said = False  # a waiting line was logged: the end of the wait is logged too
    while slots < num_proc and time.monotonic() - started < patience:
        now = time.monotonic()
        if coming and now >= next_line:
            said = True
            log.info("waiting for executors still starting: %d of the %d task slots num_proc=%d "
                     "needs are up (the settings ask master %s for %d), %.0fs so far, up to "
                     "%.0fs (%s)", slots, num_proc, num_proc, master(spark), promised,
                     now - started, patience, EXECUTOR_WAIT_CONF)
            next_line = now + _WAIT_LOG_EVERY_S
        time.sleep(0.25)
        slots = count() or 0
    waited = time.monotonic() - started
    if said and slots >= num_proc:
        log.info("executors up after %.0fs: %d task slots", waited, slots)
    return slots, (waited if wait_seconds > 0 and slots < num_proc else 0.0)


def _gpu_slots_text(tasks: int, ranks_per_task: int, profile: Any) -> str:
    gpus = profile.taskResources["gpu"].amount if profile is not None and \
        "gpu" in profile.taskResources else ranks_per_task
    return (f"{tasks} task(s) of {gpus:g} GPU(s) each"
            + (" (the training stage's task profile: sparktrain's or resource_profile)"
               if profile is not None else ""))


def stage_attempts(spark: SparkSession) -> int:
    """How many times Spark runs a failing stage (``spark.stage.maxConsecutiveAttempts``)."""
    return int(conf_value(spark, "spark.stage.maxConsecutiveAttempts", "4") or 4)


def run_barrier(spark: SparkSession, num_proc: int, task: Callable[[RankContext], Any],
                description: str = "sparktrain", echo_logs: bool = True,
                on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                max_attempts: Optional[int] = None, workdir: Optional[str] = None,
                storage_options: Optional[Dict[str, Any]] = None,
                tag: Optional[str] = None, when_exhausted: str = "giving up",
                stage_input: Optional[StageInput] = None, profile: Any = None,
                ranks_per_task: int = 1) -> List[Any]:
    """Run ``task(RankContext)`` as ``num_proc`` ranks in barrier tasks; results in rank order.

    ``task`` must be picklable with plain values only (no SparkSession, no ``self``). A failed
    attempt is retried as a whole (see the module docstring) up to ``max_attempts`` times
    (default and upper bound: ``spark.stage.maxConsecutiveAttempts``). ``workdir`` is a
    directory in the store that the client and the executors both reach (default: under the
    default local store, which suits local masters); the launch's events and large results
    pass through it and are deleted after. ``tag``: the Spark job tag (default: a new one),
    for a caller that cancels the job itself (:mod:`.elastic`); ``when_exhausted``: what the
    log line of the last attempt's failure says happens next. ``stage_input``: rows the
    barrier stage itself takes, one partition per task (a ``StageInput`` of
    :mod:`sparktrain.data.sources.contract`, opaque here; each task's ``TaskInput`` is
    ``RankContext.task_input``).
    ``profile``: the stage's ResourceProfile (stage-level scheduling); ``ranks_per_task``:
    ranks each task runs, one process per GPU (:mod:`.local_ranks`).
    Raises :class:`~sparktrain.errors.TrainingError` with the first failing rank's traceback.
    """
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    if num_proc % ranks_per_task:
        raise ValueError(f"num_proc={num_proc} ranks do not fill tasks of {ranks_per_task}")
    check_slots(spark, num_proc, profile=profile, ranks_per_task=ranks_per_task)
    spark_limit = stage_attempts(spark)
    attempts = min(max_attempts or spark_limit, spark_limit)
    tag = tag or f"sparktrain-{uuid.uuid4().hex[:12]}"
    launch_dir = f"{(workdir or DEFAULT_LAUNCH_DIR).rstrip('/')}/{tag}"
    failures = _FailureLog(spark, tag, attempts, when_exhausted)
    where = LaunchSite(launch_dir, storage_options, not is_local_master(spark), attempts)
    fs = filesystem(launch_dir, storage_options)[0]
    try:
        with EventWatcher(f"{launch_dir}/events", storage_options, echo=echo_logs,
                          on_progress=on_progress, on_error=failures.on_error) as watcher:
            frame = _barrier_frame(spark, num_proc, task, where, stage_input, profile,
                                   ranks_per_task)
            raise_if_interrupted()  # an interrupt lost before this job: do not start it
            rows = _collect(spark, frame, tag, description, watcher)
            results = {row["rank"]: _load_result(row, fs) for row in rows}
    finally:
        try:
            fs.rm(launch_dir, recursive=True)
        except (FileNotFoundError, OSError):
            pass
    return [results[rank] for rank in sorted(results)]


class _FailureLog:
    """What the client does when a rank reports an error: one log line per failed attempt,
    and the job cancelled (tag ``tag``) once the error is the user's or the last attempt's."""

    def __init__(self, spark: SparkSession, tag: str, attempts: int,
                 when_exhausted: str) -> None:
        self.spark, self.tag, self.attempts, self.when_exhausted = \
            spark, tag, attempts, when_exhausted
        self.gave_up = threading.Event()
        self.reported: set = set()  # attempts already logged

    def on_error(self, rank: int, attempt: int, remote: str, fatal: bool) -> None:
        if self.gave_up.is_set() or attempt in self.reported:
            return
        self.reported.add(attempt)
        last = remote.strip().splitlines()[-1] if remote.strip() else "unknown error"
        if fatal:
            self.gave_up.set()
            log.error("rank %d failed on attempt %d: %s; not retried (an error in the user's "
                      "code fails the same way again)", rank, attempt + 1, last)
            cancel_tag(self.spark, self.tag)
        elif attempt + 1 >= self.attempts:
            self.gave_up.set()
            log.error("rank %d failed on attempt %d of %d: %s; %s", rank, attempt + 1,
                      self.attempts, last, self.when_exhausted)
            cancel_tag(self.spark, self.tag)
        else:
            log.warning("rank %d failed on attempt %d of %d: %s; Spark re-runs all ranks, "
                        "which resume from the last checkpoint", rank, attempt + 1,
                        self.attempts, last)


def _collect(spark: SparkSession, frame: DataFrame, tag: str, description: str,
             watcher: EventWatcher) -> List[Any]:
    """Run the barrier job (tagged ``tag``): the ranks' result rows, or the failure as the
    error that says most (a full local disk, the first rank's traceback, Spark's text)."""
    with job_tag(spark, tag, description):
        try:
            return frame.collect()
        except BaseException as exc:
            cancel_tag(spark, tag)
            if isinstance(exc, KeyboardInterrupt):
                raise
            watcher.poll()
            full = spark_disk_full(str(exc), local_dirs(spark))
            if full is not None and watcher.first_error() is None:
                raise full from None
            error = _training_error(_with_last_lines(watcher), exc,
                                    max(1, watcher.failed_attempts()))
            error.user_error = watcher.user_error()
            raise error from None


def _barrier_frame(spark: SparkSession, num_proc: int, task: Callable[[RankContext], Any],
                   where: LaunchSite, stage_input: Optional[StageInput], profile: Any = None,
                   ranks_per_task: int = 1) -> DataFrame:
    """The barrier stage as a DataFrame of the ranks' results (one row each)."""
    tasks = num_proc // ranks_per_task
    take = stage_input.taker() if stage_input is not None else None

    def partition(batches: Iterator[Any]) -> Iterator[Any]:
        task_input = None
        if take is None:
            for _ in batches:  # the input rows only number the tasks
                pass
        else:
            task_input = take(batches)
        if ranks_per_task == 1:
            yield _rank_result_batch(*run_rank(task, where, task_input), where.folder,
                                     where.storage_options)
            return
        from sparktrain.launch.local_ranks import run_local_ranks

        for rank, result in run_local_ranks(task, where, ranks_per_task, task_input):
            yield _rank_result_batch(rank, result, where.folder, where.storage_options)

    # One partition a task: the rows the stage takes, or just the tasks' numbers.
    source = stage_input.frame(tasks) if stage_input is not None \
        else spark.range(0, tasks, 1, tasks)
    stage = {"profile": profile} if profile is not None else {}
    # repartition(1) makes the barrier stage a shuffle map stage: Spark retries those.
    return source.mapInArrow(partition, _RESULT_SCHEMA, barrier=True, **stage).repartition(1)


def _rank_result_batch(rank: int, result: Any, launch_dir: str,
                       storage_options: Optional[Dict[str, Any]]) -> Any:
    """The one-row Arrow batch a rank returns: its pickled result, or where it stored it."""
    import pyarrow as pa

    data, stored = cloudpickle.dumps(result), None
    if len(data) > INLINE_RESULT_BYTES:
        fs, root = filesystem(launch_dir, storage_options)
        stored = f"{root}/results/rank-{rank}.pkl"
        fs.makedirs(f"{root}/results", exist_ok=True)
        fs.pipe_file(stored, data)
        data = b""
    return pa.RecordBatch.from_pydict(
        {"rank": pa.array([rank], pa.int32()), "result": pa.array([data], pa.binary()),
         "stored": pa.array([stored], pa.string())})


def _load_result(row: Any, fs: Any) -> Any:
    return cloudpickle.loads(fs.cat_file(row["stored"]) if row["stored"] else row["result"])


def _with_last_lines(watcher: EventWatcher) -> Optional[Tuple[int, str]]:
    """The first error to report; a rank that died without a word gets its last lines."""
    reported = watcher.first_error()
    if reported is None or not any(rank == reported[0] for _, rank in watcher.lost):
        return reported
    lines = watcher.last_lines(reported[0])
    shown = "\n".join(f"  {line}" for line in lines) if lines else "  (none reached the driver)"
    # the report stays the last line: the error's summary
    return reported[0], f"Its last lines:\n{shown}\n{reported[1]}"


def _training_error(reported: Optional[Tuple[int, str]], exc: BaseException,
                    attempts: int = 1) -> TrainingError:
    if reported is None:  # the rank could not report (killed, lost executor): use Spark's text
        match = re.search(FAILURE_TAG + r" rank=(\d+)\n(.*?)\n" + FAILURE_TAG + " end",
                          str(exc), re.S)
        if match:
            reported = int(match.group(1)), match.group(2)
    if reported is not None:
        rank, remote = reported
        last = remote.strip().splitlines()[-1] if remote.strip() else "unknown error"
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        return TrainingError(f"training failed on rank {rank}{tries}: {last}\n\n"
                             f"Traceback from rank {rank} (first failure):\n{remote}", rank,
                             remote, attempts)
    # a Python worker that could not start or import what it needs: say which and how to fix
    from sparktrain.launch.executor_env import environment_error

    unfit = environment_error(str(exc), attempts=attempts)
    if unfit is not None:
        return unfit
    summary = _spark_summary(str(exc))
    return TrainingError(f"training failed in Spark before a rank could report: {summary}",
                         attempts=attempts)


def _spark_summary(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("An error occurred while calling", "at ", "Traceback")):
            return line[:500]
    return text[:500]
