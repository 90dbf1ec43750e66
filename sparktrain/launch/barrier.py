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

import cloudpickle
from pyspark import BarrierTaskContext
from pyspark.sql import DataFrame, SparkSession

from sparktrain.errors import TrainingError, spark_disk_full
from sparktrain.faults import lost_rank_text, user_error_source
from sparktrain.fs import DEFAULT_LAUNCH_DIR, filesystem
from sparktrain.launch.events import EventWatcher, RankEvents
from sparktrain.launch.rank_gather import NO_SERVER, GatherServer, RankGather, connect, publish
from sparktrain.session.interrupts import raise_if_interrupted
from sparktrain.session.spark_api import (
    cancel_tag,
    conf_value,
    is_local_master,
    is_remote,
    job_tag,
    local_dirs,
    master,
    num_partitions,
    task_slots,
)

log = logging.getLogger(__name__)

SLOT_WAIT_CONF = "spark.sparktrain.slotWaitSeconds"
DEFAULT_SLOT_WAIT_SECONDS = 10.0
_FAILURE_TAG = "sparktrain-rank-failure"
# Results larger than this go through the store, not the result rows (Spark Connect's gRPC
# messages are capped at 128 MiB by default).
INLINE_RESULT_BYTES = 16 * 1024 * 1024
_RESULT_SCHEMA = "rank int, result binary, stored string"


@dataclass
class RankContext:
    """What a training function learns about its place in the job (executor side)."""

    rank: int
    world_size: int
    hosts: List[str]
    cpus: int
    resources: Dict[str, List[str]]
    barrier: Any = field(repr=False)  # the pyspark BarrierTaskContext
    client: Optional[RankEvents] = field(default=None, repr=False)
    attempt: int = 0  # 0 on the first run of the stage, n on Spark's n-th retry
    generation: Any = None  # an elastic fit's generation (sparktrain.launch.elastic)
    # input_mode="stream": this rank's rows, Arrow record batches (run_barrier's ``rows``)
    rows: Any = field(default=None, repr=False)
    # the ranks' own gather (rank_gather.RankGather); None: Spark's allGather
    gather: Any = field(default=None, repr=False)

    def log(self, text: str) -> None:
        """Send ``text`` to the client's log as ``[rank N] text``."""
        if self.client is not None:
            self.client.log(text)

    def progress(self, **event: Any) -> None:
        """Send a progress event (plain JSON values) to the client's progress display."""
        if self.client is not None:
            self.client.progress(event)

    def all_gather(self, message: str) -> List[str]:
        """Every rank's ``message``, in rank order: through rank 0's gather server (a few ms),
        or Spark's ``allGather`` (about 1 s: :mod:`.rank_gather`) where there is none."""
        if self.gather is not None:
            return self.gather(message)
        return list(self.barrier.allGather(message))


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------

def _slot_hint(spark: SparkSession, num_proc: int) -> str:
    value = master(spark)
    if value.startswith("local-cluster"):
        return f"start Spark with master local-cluster[N,C,M] where N*C >= {num_proc}"
    if value.startswith("local"):
        return f"start Spark with master local[{num_proc}] (or more, e.g. local[*])"
    return (f"give the cluster more task slots: spark.executor.instances "
            f"(now {conf_value(spark, 'spark.executor.instances', 'unset')}) x "
            f"spark.executor.cores (now {conf_value(spark, 'spark.executor.cores', 'unset')}) / "
            f"spark.task.cpus (now {conf_value(spark, 'spark.task.cpus', '1')}) must be >= "
            f"{num_proc}; with dynamic allocation set spark.dynamicAllocation.minExecutors high "
            f"enough")


def check_slots(spark: SparkSession, num_proc: int, wait_seconds: Optional[float] = None,
                name: str = "num_proc") -> Optional[int]:
    """Fail if fewer than ``num_proc`` barrier tasks can run at once; returns the slot count
    (``None`` where the cluster cannot say: then Spark's own barrier check decides). ``name``:
    the param the error names (an elastic fit checks ``min_num_proc``).

    On a classic session with a cluster master, waits up to ``wait_seconds`` for executors to
    register first; local masters have all their slots from the start and are not waited for.
    """
    if wait_seconds is None:
        wait_seconds = float(conf_value(spark, SLOT_WAIT_CONF, None)
                             or DEFAULT_SLOT_WAIT_SECONDS)
    if is_local_master(spark) or is_remote(spark):
        wait_seconds = 0.0  # nothing to wait for (Connect: the count comes from the conf)
    deadline = time.monotonic() + wait_seconds
    slots = task_slots(spark)
    if slots is None:
        log.info("the cluster's settings do not say how many tasks it can run at once; "
                 "Spark's barrier check will tell if num_proc=%d is too many", num_proc)
        return None
    while slots < num_proc and time.monotonic() < deadline:
        time.sleep(0.25)
        slots = task_slots(spark) or 0
    if slots < num_proc:
        waited = f", waited {wait_seconds:g}s for executors" if wait_seconds else ""
        raise RuntimeError(
            f"{name}={num_proc} needs {num_proc} task slots running at the same time (Spark "
            f"barrier mode), but the cluster has {slots} (master {master(spark)}{waited}). "
            f"Lower {name} to {max(slots, 1)} or {_slot_hint(spark, num_proc)}."
            + ("" if is_local_master(spark) or is_remote(spark) else
               f" ({SLOT_WAIT_CONF} sets how long to wait for executors.)"))
    return slots


def stage_attempts(spark: SparkSession) -> int:
    """How many times Spark runs a failing stage (``spark.stage.maxConsecutiveAttempts``)."""
    return int(conf_value(spark, "spark.stage.maxConsecutiveAttempts", "4") or 4)


def run_barrier(spark: SparkSession, num_proc: int, task: Callable[[RankContext], Any],
                description: str = "sparktrain", echo_logs: bool = True,
                on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                max_attempts: Optional[int] = None, workdir: Optional[str] = None,
                storage_options: Optional[Dict[str, Any]] = None,
                tag: Optional[str] = None, when_exhausted: str = "giving up",
                rows: Optional[DataFrame] = None) -> List[Any]:
    """Run ``task(RankContext)`` in ``num_proc`` barrier tasks; results in rank order.

    ``task`` must be picklable with plain values only (no SparkSession, no ``self``). A failed
    attempt is retried as a whole (see the module docstring) up to ``max_attempts`` times
    (default and upper bound: ``spark.stage.maxConsecutiveAttempts``). ``workdir`` is a
    directory in the store that the client and the executors both reach (default: under the
    default local store, which suits local masters); the launch's events and large results
    pass through it and are deleted after. ``tag``: the Spark job tag (default: a new one),
    for a caller that cancels the job itself (:mod:`.elastic`); ``when_exhausted``: what the
    log line of the last attempt's failure says happens next. ``rows``: a DataFrame whose rows
    the barrier stage itself takes, one partition per rank (``RankContext.rows``: input_mode=
    "stream"). Raises :class:`~sparktrain.errors.TrainingError` with the first failing rank's
    traceback.
    """
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    check_slots(spark, num_proc)
    spark_limit = stage_attempts(spark)
    attempts = min(max_attempts or spark_limit, spark_limit)
    tag = tag or f"sparktrain-{uuid.uuid4().hex[:12]}"
    launch_dir = f"{(workdir or DEFAULT_LAUNCH_DIR).rstrip('/')}/{tag}"
    gave_up = threading.Event()
    reported: set = set()  # attempts already logged: one line per failed attempt

    def on_error(rank: int, attempt: int, remote: str, fatal: bool) -> None:
        if gave_up.is_set() or attempt in reported:
            return
        reported.add(attempt)
        last = remote.strip().splitlines()[-1] if remote.strip() else "unknown error"
        if fatal:
            gave_up.set()
            log.error("rank %d failed on attempt %d: %s; not retried (an error in the user's "
                      "code fails the same way again)", rank, attempt + 1, last)
            cancel_tag(spark, tag)
        elif attempt + 1 >= attempts:
            gave_up.set()
            log.error("rank %d failed on attempt %d of %d: %s; %s", rank, attempt + 1,
                      attempts, last, when_exhausted)
            cancel_tag(spark, tag)
        else:
            log.warning("rank %d failed on attempt %d of %d: %s; Spark re-runs all ranks, "
                        "which resume from the last checkpoint", rank, attempt + 1, attempts,
                        last)

    where = (launch_dir, storage_options, not is_local_master(spark), attempts)
    fs = filesystem(launch_dir, storage_options)[0]
    try:
        with EventWatcher(f"{launch_dir}/events", storage_options, echo=echo_logs,
                          on_progress=on_progress, on_error=on_error) as watcher:
            frame = _barrier_frame(spark, num_proc, task, where, rows)
            raise_if_interrupted()  # an interrupt lost before this job: do not start it
            with job_tag(spark, tag, description):
                try:
                    rows = frame.collect()
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
            results = {row["rank"]: _load_result(row, fs) for row in rows}
    finally:
        try:
            fs.rm(launch_dir, recursive=True)
        except (FileNotFoundError, OSError):
            pass
    return [results[rank] for rank in sorted(results)]


def _barrier_frame(spark: SparkSession, num_proc: int, task: Callable[[RankContext], Any],
                   where: Sequence, rows: Optional[DataFrame]) -> DataFrame:
    """The barrier stage as a DataFrame of the ranks' results (one row each)."""
    streamed = rows is not None

    def partition(batches: Iterator[Any]) -> Iterator[Any]:
        if not streamed:
            for _ in batches:  # the input rows only number the tasks
                pass
            batches = None
        yield _rank_result_batch(*run_rank(task, where, batches), where[0], where[1])

    # One partition a rank: the rows to stream, or just the ranks' numbers.
    source = _partition_a_rank(rows, num_proc) if streamed else \
        spark.range(0, num_proc, 1, num_proc)
    # repartition(1) makes the barrier stage a shuffle map stage: Spark retries those.
    return source.mapInArrow(partition, _RESULT_SCHEMA, barrier=True).repartition(1)


def _partition_a_rank(rows: DataFrame, num_proc: int) -> DataFrame:
    """``rows`` in ``num_proc`` partitions: as they are when they already are (no shuffle, as
    XGBoost's PySpark estimators do), else repartitioned (a shuffle, which a barrier stage may
    follow; ``coalesce`` may not, SPARK-24820)."""
    if num_partitions(rows) == num_proc:
        return rows
    return rows.repartition(num_proc)


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


# ---------------------------------------------------------------------------------------------
# Executor side
# ---------------------------------------------------------------------------------------------

class _LineTee(io.TextIOBase):
    """Write-through stream that also sends complete lines to the client."""

    def __init__(self, original: Optional[Any], client: RankEvents) -> None:
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
def _captured_output(client: RankEvents, mirror: bool) -> Iterator[None]:
    """Send the rank's stdout/stderr lines to the client; ``mirror`` also keeps them in the
    executor's own log (off in local mode, where that log is the console of Spark's driver)."""
    out, err = sys.stdout, sys.stderr
    tees = [_LineTee(out if mirror else None, client), _LineTee(err if mirror else None, client)]
    sys.stdout, sys.stderr = tees
    try:
        yield
    finally:
        for tee in tees:
            tee.drain()
        sys.stdout, sys.stderr = out, err


class _GaveUp(RuntimeError):
    """Spark started more attempts than ``max_attempts`` allows."""


def _give_up(client: RankEvents, rank: int, limit: int) -> None:
    """Stop a re-run beyond ``max_attempts``. The starts of every attempt are counted in the
    store (:meth:`RankEvents.start`), so this also bounds attempts that ended without any rank
    reporting an error: a rank SIGKILLed (the OOM killer), a lost executor."""
    text = (f"gave up after max_attempts={limit} attempt(s): none of them reported a Python "
            f"error, so a rank's process or executor was killed (SIGKILL, the OOM killer, a "
            f"lost node: see the executors' logs) or failed before it could report")
    client.error(text, fatal=True, attempts_failed=limit)
    raise _GaveUp(f"{_FAILURE_TAG} rank={rank}\n{text}\n{_FAILURE_TAG} end")


def rank_context(barrier: Any, client: Optional[RankEvents] = None) -> RankContext:
    infos = barrier.getTaskInfos()
    hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    resources = {name: list(info.addresses) for name, info in barrier.resources().items()}
    return RankContext(rank=barrier.partitionId(), world_size=len(infos), hosts=hosts,
                       cpus=int(barrier.cpus()), resources=resources, barrier=barrier,
                       client=client)


def run_rank(task: Callable[[RankContext], Any], where: Sequence,
             rows: Optional[Iterator[Any]] = None) -> Tuple[int, Any]:
    """Executor entry point: build the :class:`RankContext`, run ``task``, report failures.
    ``where`` is ``(launch directory, storage_options, mirror output to the executor log,
    the most attempts to start)``; ``rows``: the rank's streamed rows, if any."""
    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    client = RankEvents(f"{where[0]}/events", where[1], rank)
    started = client.start()
    if client.stopped():  # an earlier attempt failed in user code: Spark's re-run is moot
        client.close()
        raise RuntimeError(f"{_FAILURE_TAG} rank={rank}\nnot retried: an earlier attempt "
                           f"failed in the user's code\n{_FAILURE_TAG} end")
    server = gather = None
    try:
        with _captured_output(client, mirror=where[2]):
            context = rank_context(barrier, client)
            context.rows = rows
            server, gather = _rank_gather(barrier, context, where)
            context.gather = gather
            # every rank counted its own starts; agree on one number (the largest)
            context.attempt = max(int(a) for a in context.all_gather(str(started)))
            client.attempt = context.attempt
            if len(where) > 3 and context.attempt >= where[3]:
                _give_up(client, rank, where[3])
            return rank, task(context)
    except _GaveUp:
        raise
    except BaseException as exc:
        remote = traceback.format_exc()
        source = user_error_source(exc)
        if source is not None:  # first: the traceback's last line stays the error's summary
            label = source if source.endswith(")") else f"{source} (user code)"
            remote = f"Raised by {label}: not retried.\n{remote}"
        if isinstance(exc, ModuleNotFoundError):
            remote += (f"\nThe executors' Python ({sys.executable}) cannot import {exc.name!r}: "
                       f"install it there, or point PYSPARK_PYTHON / spark.pyspark.python at a "
                       f"Python that has it.\n")
        client.error(remote, fatal=source is not None)
        # Spark shows only the task's exception text: carry the traceback inside it, tagged.
        raise RuntimeError(f"{_FAILURE_TAG} rank={rank}\n{remote}\n{_FAILURE_TAG} end") from None
    finally:
        if gather is not None:
            gather.close()
        if server is not None:
            server.close()
        client.close()


def _rank_gather(barrier: Any, context: RankContext, where: Sequence
                 ) -> Tuple[Optional[GatherServer], Optional[RankGather]]:
    """Rank 0's gather server (on rank 0) and this rank's connection to it, found through the
    launch folder (:mod:`.rank_gather`); no connection where rank 0 could not start a server
    (the ranks then use Spark's allGather)."""
    fs = filesystem(where[0], where[1])[0]
    path = f"{where[0]}/gather-{barrier.stageId()}"

    def on_lost(rank: int) -> None:  # a rank's process died without a word: say so
        if context.client is not None:
            context.client.error(lost_rank_text(rank, context.hosts[rank]), lost=rank)

    if context.rank != 0:
        return None, connect(fs, path, context.rank, on_lost=on_lost)
    try:
        server = GatherServer(context.world_size, context.hosts[0], on_lost=on_lost)
    except OSError as exc:
        context.log(f"no gather server ({exc}): the ranks exchange messages through Spark's "
                    f"allGather (about 1 s each)")
        publish(fs, path, NO_SERVER)
        return None, None
    publish(fs, path, server.address)
    return server, RankGather(server.address, 0)
