"""Run a function as ``num_proc`` Spark barrier tasks, one per training rank.

The launcher checks up front that the cluster has enough concurrent task slots (Spark's own
barrier check retries for minutes before failing), opens the driver's :class:`RankChannel` for
live rank logs and failures, and turns a failed stage into a :class:`TrainingError` carrying the
traceback of the rank that failed first.

Retries: Spark never retries a failed barrier *result* stage ("Could not recover from a failed
barrier ResultStage"), but it re-runs a failed barrier *shuffle map* stage as a whole, up to
``spark.stage.maxConsecutiveAttempts`` times (default 4), whether a task raised, its Python
worker was killed or its executor was lost. So the barrier tasks' results go through a one-
partition shuffle, every rank learns its attempt number (``RankContext.attempt``) and a training
loop can resume from its last checkpoint. ``max_attempts`` caps the attempts below Spark's limit:
the driver cancels the job once that many attempts have failed.

Example::

    def task(rank: RankContext) -> int:
        rank.log(f"hello from {rank.rank} of {rank.world_size}")
        return rank.rank

    run_barrier(spark, 2, task)   # [0, 1]
"""
from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pyspark import BarrierTaskContext, SparkContext
from pyspark.sql import SparkSession

from sparktrain.launch.channel import RankChannel, RankClient
from sparktrain.spark_jvm import max_concurrent_tasks

log = logging.getLogger(__name__)

SLOT_WAIT_CONF = "spark.sparktrain.slotWaitSeconds"
DEFAULT_SLOT_WAIT_SECONDS = 10.0
_FAILURE_TAG = "sparktrain-rank-failure"


class TrainingError(RuntimeError):
    """A training rank failed; ``rank`` and ``remote_traceback`` say where and how."""

    def __init__(self, message: str, rank: Optional[int] = None, remote_traceback: str = "",
                 attempts: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.attempts = attempts  # attempts of the training stage that failed


@dataclass
class RankContext:
    """What a training function learns about its place in the job (executor side)."""

    rank: int
    world_size: int
    hosts: List[str]
    cpus: int
    resources: Dict[str, List[str]]
    barrier: Any = field(repr=False)  # the pyspark BarrierTaskContext
    client: Optional[RankClient] = field(default=None, repr=False)
    attempt: int = 0  # 0 on the first run of the stage, n on Spark's n-th retry

    def log(self, text: str) -> None:
        """Send ``text`` to the driver's log as ``[rank N] text``."""
        if self.client is not None:
            self.client.log(text)

    def progress(self, **event: Any) -> None:
        """Send a progress event (plain JSON values) to the driver's progress display."""
        if self.client is not None:
            self.client.progress(event)

    def all_gather(self, message: str) -> List[str]:
        return list(self.barrier.allGather(message))


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------

def _slot_hint(sc: SparkContext, num_proc: int) -> str:
    master = sc.master
    if master.startswith("local-cluster"):
        return f"start Spark with master local-cluster[N,C,M] where N*C >= {num_proc}"
    if master.startswith("local"):
        return f"start Spark with master local[{num_proc}] (or more, e.g. local[*])"
    conf = sc.getConf()
    return (f"give the cluster more task slots: spark.executor.instances "
            f"(now {conf.get('spark.executor.instances', 'unset')}) x spark.executor.cores "
            f"(now {conf.get('spark.executor.cores', 'unset')}) / spark.task.cpus "
            f"(now {conf.get('spark.task.cpus', '1')}) must be >= {num_proc}; with dynamic "
            f"allocation set spark.dynamicAllocation.minExecutors high enough")


def check_slots(sc: SparkContext, num_proc: int, wait_seconds: Optional[float] = None) -> int:
    """Wait briefly for executors to register, then fail if fewer than ``num_proc`` barrier
    tasks can run at once. Returns the slot count."""
    if wait_seconds is None:
        wait_seconds = float(sc.getConf().get(SLOT_WAIT_CONF, str(DEFAULT_SLOT_WAIT_SECONDS)))
    deadline = time.monotonic() + wait_seconds
    slots = max_concurrent_tasks(sc)
    while slots < num_proc and time.monotonic() < deadline:
        time.sleep(0.25)
        slots = max_concurrent_tasks(sc)
    if slots < num_proc:
        raise RuntimeError(
            f"num_proc={num_proc} needs {num_proc} task slots running at the same time (Spark "
            f"barrier mode), but the cluster has {slots} (master {sc.master}, waited "
            f"{wait_seconds:g}s for executors). Lower num_proc to {max(slots, 1)} or {_slot_hint(sc, num_proc)}. "
            f"({SLOT_WAIT_CONF} sets how long to wait for executors.)")
    return slots


def driver_host(sc: SparkContext) -> str:
    return sc.getConf().get("spark.driver.host", None) or "127.0.0.1"


def stage_attempts(sc: SparkContext) -> int:
    """How many times Spark runs a failing stage (``spark.stage.maxConsecutiveAttempts``)."""
    return int(sc.getConf().get("spark.stage.maxConsecutiveAttempts", "4"))


def run_barrier(spark: SparkSession, num_proc: int, task: Callable[[RankContext], Any],
                description: str = "sparktrain", echo_logs: bool = True,
                on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                max_attempts: Optional[int] = None) -> List[Any]:
    """Run ``task(RankContext)`` in ``num_proc`` barrier tasks; results in rank order.

    ``task`` must be picklable with plain values only (no SparkSession, no ``self``). A failed
    attempt is retried as a whole (see the module docstring) up to ``max_attempts`` times
    (default and upper bound: ``spark.stage.maxConsecutiveAttempts``). Raises
    :class:`TrainingError` with the first failing rank's traceback.
    """
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    sc = spark.sparkContext
    check_slots(sc, num_proc)
    spark_limit = stage_attempts(sc)
    attempts = min(max_attempts or spark_limit, spark_limit)
    group = f"sparktrain-{uuid.uuid4().hex[:12]}"
    gave_up = threading.Event()
    reported: set = set()  # attempts already logged: one line per failed attempt

    def on_error(rank: int, attempt: int, remote: str) -> None:
        if gave_up.is_set() or attempt in reported:
            return
        reported.add(attempt)
        last = remote.strip().splitlines()[-1] if remote.strip() else "unknown error"
        if attempt + 1 >= attempts:
            gave_up.set()
            log.error("rank %d failed on attempt %d of %d: %s; giving up", rank, attempt + 1,
                      attempts, last)
            sc.cancelJobGroup(group)
        else:
            log.warning("rank %d failed on attempt %d of %d: %s; Spark re-runs all ranks, "
                        "which resume from the last checkpoint", rank, attempt + 1, attempts,
                        last)

    with RankChannel(driver_host(sc), echo=echo_logs, on_progress=on_progress,
                     on_error=on_error) as channel:
        address = (*channel.address, sc.master.startswith("local"))

        def partition(_: Iterator[int]) -> Iterator[Tuple[int, Any]]:
            yield run_rank(task, address)

        # partitionBy(1) makes the barrier stage a shuffle map stage: Spark retries those.
        rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(partition) \
            .partitionBy(1)
        sc.setJobGroup(group, description, interruptOnCancel=True)
        try:
            pairs = rdd.collect()
        except BaseException as exc:
            sc.cancelJobGroup(group)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise _training_error(channel.first_error(), exc,
                                  max(1, channel.failed_attempts())) from None
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setLocalProperty("spark.job.description", None)
    return [result for _, result in sorted(pairs, key=lambda pair: pair[0])]


def _training_error(reported: Optional[Tuple[int, str]], exc: BaseException,
                    attempts: int = 1) -> TrainingError:
    if reported is None:  # the rank could not report (killed, lost executor): use Spark's text
        match = re.search(_FAILURE_TAG + r" rank=(\d+)\n(.*?)\n" + _FAILURE_TAG + " end",
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
    summary = _spark_summary(str(exc))
    return TrainingError(f"training failed in Spark before a rank could report: {summary}",
                         attempts=attempts)


def _spark_summary(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("An error occurred while calling", "at ", "Traceback")):
            return line[:500]
    return text[:500]


# ---------------------------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------------------------

class _LineTee(io.TextIOBase):
    """Write-through stream that also sends complete lines to the driver."""

    def __init__(self, original: Optional[Any], client: RankClient) -> None:
        self._original = original
        self._client = client
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if self._original is not None:
            try:
                self._original.write(text)
            except (OSError, ValueError, AttributeError):
                pass
        with self._lock:
            self._buffer += text
            if "\n" in self._buffer:
                lines, self._buffer = self._buffer.rsplit("\n", 1)
                self._client.log(lines)
        return len(text)

    def flush(self) -> None:
        if self._original is not None:
            try:
                self._original.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def drain(self) -> None:
        with self._lock:
            if self._buffer:
                self._client.log(self._buffer)
                self._buffer = ""


@contextmanager
def _captured_output(client: RankClient, mirror: bool) -> Iterator[None]:
    """Send the rank's stdout/stderr lines to the driver; ``mirror`` also keeps them in the
    executor's own log (off in local mode, where that log is the driver's console)."""
    out, err = sys.stdout, sys.stderr
    tees = [_LineTee(out if mirror else None, client), _LineTee(err if mirror else None, client)]
    sys.stdout, sys.stderr = tees
    try:
        yield
    finally:
        for tee in tees:
            tee.drain()
        sys.stdout, sys.stderr = out, err


def rank_context(barrier: Any, client: Optional[RankClient] = None) -> RankContext:
    infos = barrier.getTaskInfos()
    hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    resources = {name: list(info.addresses) for name, info in barrier.resources().items()}
    return RankContext(rank=barrier.partitionId(), world_size=len(infos), hosts=hosts,
                       cpus=int(barrier.cpus()), resources=resources, barrier=barrier,
                       client=client)


def run_rank(task: Callable[[RankContext], Any], address: Sequence) -> Tuple[int, Any]:
    """Executor entry point: build the :class:`RankContext`, run ``task``, report failures.
    ``address`` is ``(host, port, token, local_mode)`` of the driver's channel."""
    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    client = RankClient(address[0], int(address[1]), address[2], rank)
    try:
        with _captured_output(client, mirror=not address[3]):
            context = rank_context(barrier, client)
            context.attempt = client.attempt
            return rank, task(context)
    except BaseException as exc:
        remote = traceback.format_exc()
        if isinstance(exc, ModuleNotFoundError):
            remote += (f"\nThe executors' Python ({sys.executable}) cannot import {exc.name!r}: "
                       f"install it there, or point PYSPARK_PYTHON / spark.pyspark.python at a "
                       f"Python that has it.\n")
        client.error(remote)
        # Spark shows only the task's exception text: carry the traceback inside it, tagged.
        raise RuntimeError(f"{_FAILURE_TAG} rank={rank}\n{remote}\n{_FAILURE_TAG} end") from None
    finally:
        client.close()
