"""The driver's side of ``input_mode="stream"``: count each input partition's rows, then feed
the ranks from ordinary Spark jobs that run beside the training stage.

The barrier stage only starts the ranks (one task each, no input); each rank listens for rows
(:mod:`.fed_rank`) and rank 0 asks for an epoch's rows in the feed folder
(:class:`~.fed_wire.FeedFolder`). :class:`Feeding` watches that folder and answers each
request with a job over the DataFrame as it is partitioned (no shuffle: every task deals its
partition's rows to the partition's ranks, every rank or one host's,
:func:`~.fed_wire.send_partition`), on the task slots the ranks leave free. A new attempt or
elastic generation asks under a new token: the jobs feeding the old one are cancelled. A feeding job
that fails (the DataFrame's own computation, after Spark's task retries) writes ``failed``,
and the ranks stop with its message, not retried.

Where the ranks take every slot there is none left to feed them: the estimator then uses the
training stage's own input instead (:mod:`.own_partition`, :mod:`.shuffled`). Where
a slot was left when the fit started and a job the driver cannot see took it since (another
application on a shared cluster), the feeding job gets no task: after
``spark.sparktrain.feedWaitSeconds`` (45) without a running task it is cancelled and the fit
fails once, naming the stages that hold the slots, instead of waiting for ever.

Example (driver)::

    counts = partition_counts(stream_df)              # rows per partition and split
    with Feeding(spark, stream_df, folder):           # while the barrier stage runs
        run_barrier(...)
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sparktrain.data.columns import SPLIT_COL
from sparktrain.data.sources.fed_wire import FeedFolder, Targets, send_partition
from sparktrain.session.slots import busy_stages, fits_holding_slots, job_tasks
from sparktrain.session.spark_api import cancel_tag, conf_value, is_remote, job_tag

log = logging.getLogger("sparktrain")

POLL_SECONDS = 0.05  # how often the driver looks for a rank 0's request (local store)
#: how long a feeding job may go without a running task before the fit fails (the conf key
#: below overrides it): its ranks wait for rows that no slot is free to send
FEED_WAIT_CONF = "spark.sparktrain.feedWaitSeconds"
DEFAULT_FEED_WAIT_SECONDS = 45.0
REMOTE_POLL_SECONDS = 0.5  # ... in an object store
_GONE = ("Connection refused", "Connection reset", "Broken pipe", "ConnectionRefusedError",
         "BrokenPipeError", "ConnectionResetError", "timed out")


#: the job tag of the counting jobs, which :func:`counted_where` finds in Spark's status API
COUNT_TAG = "sparktrain-count"
#: how long :func:`counted_where` waits for the status store to show the counting job's tasks
WHERE_WAIT_SECONDS = 1.0


def partition_counts(df: DataFrame) -> Dict[str, List[int]]:
    """Rows per input partition of ``df`` (its stored form with the split column), by split,
    counted by a job that reads no column it does not need (Parquet footers, or nothing for
    ``spark.range``): what every rank plans its share and its steps from."""
    # tagged (classic sessions) so that counted_where finds it; nothing else of the thread's
    # job properties changes
    sc = None if is_remote(df.sparkSession) else df.sparkSession.sparkContext
    if sc is not None:
        sc.addJobTag(COUNT_TAG)
    try:
        counted = (df.select(F.spark_partition_id().alias("p"), F.col(SPLIT_COL))
                   .groupBy("p", SPLIT_COL).count().collect())
    finally:
        if sc is not None:
            sc.removeJobTag(COUNT_TAG)
    partitions = 1 + max((row["p"] for row in counted), default=0)
    counts: Dict[str, List[int]] = {}
    for row in counted:
        counts.setdefault(row[SPLIT_COL], [0] * partitions)[row["p"]] = int(row["count"])
    return counts


def counted_where(df: DataFrame, counts: Dict[str, List[int]]) -> List[str]:
    """The host where Spark computed each of ``df``'s partitions in the latest counting job
    (:func:`partition_counts`; "" where unknown), from the driver's status REST API. The
    feeding tasks of a cached DataFrame run where its blocks are, which is where its count
    ran, so dealing a partition to that host's ranks keeps its rows there
    (:func:`.fed_wire.host_targets`). ``[]`` where it cannot tell: over Spark Connect, in local
    mode (one host) or without Spark's UI."""
    spark, partitions = df.sparkSession, len(next(iter(counts.values()), []))
    if is_remote(spark) or not partitions:
        return []
    sc = spark.sparkContext
    if (sc.master or "").startswith("local") or not sc.uiWebUrl:
        return []
    base = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}"
    deadline = time.monotonic() + WHERE_WAIT_SECONDS
    while True:
        try:
            found = _count_hosts(base, partitions)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("where the partitions were counted is unknown: %s", exc)
            return []
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _count_hosts(base: str, partitions: int) -> List[str]:
    """Each partition's host in the newest complete stage of ``partitions`` tasks among the
    counting jobs (with adaptive execution the map stage is a job of its own)."""
    import json
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the driver itself

    def get(path: str) -> Any:
        with opener.open(f"{base}{path}", timeout=5) as answer:
            return json.load(answer)

    jobs = [j for j in get("/jobs") if COUNT_TAG in (j.get("jobTags") or [])]
    if not jobs:
        return []
    newest = max(j["jobId"] for j in jobs)
    stages = sorted({s for j in jobs if j["jobId"] >= newest - 1 for s in j["stageIds"]},
                    reverse=True)
    for stage in stages:
        for attempt in get(f"/stages/{stage}"):
            if attempt.get("status") != "COMPLETE" or attempt.get("numTasks") != partitions:
                continue
            tasks = get(f"/stages/{stage}/{attempt['attemptId']}/taskList"
                        f"?length={4 * partitions}")
            hosts = {t["index"]: t["host"] for t in tasks if t.get("status") == "SUCCESS"}
            if len(hosts) == partitions:
                return [hosts[p] for p in range(partitions)]
    return []


class Feeding:
    """Answers the ranks' requests for rows while the training stage runs (a context
    manager; see the module docstring)."""

    def __init__(self, spark: SparkSession, df: DataFrame, folder: str,
                 storage_options: Optional[Dict[str, Any]] = None, secret: str = "") -> None:
        self.spark, self.df, self.secret = spark, df, secret
        self.folder = FeedFolder(folder, storage_options)
        self.names = [c for c in df.columns if c != SPLIT_COL]
        self.stop = threading.Event()
        self.tags: Dict[str, List[str]] = {}  # token -> its jobs' tags
        self.lock = threading.Lock()
        self.jobs: List[threading.Thread] = []
        self.wait = float(conf_value(spark, FEED_WAIT_CONF, None) or DEFAULT_FEED_WAIT_SECONDS)
        self.watched: Dict[str, List[Any]] = {}  # tag -> [epoch, last progress, its time]
        self.stalled: Dict[str, str] = {}  # tag -> why it was cancelled
        self.thread = threading.Thread(target=self._watch, name="sparktrain-feeding",
                                       daemon=True)
        # over Spark Connect the driver cannot see a job's tasks: they mark their start and end
        self.marked = is_remote(spark)

    def __enter__(self) -> "Feeding":
        self.folder.open()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        with self.lock:
            tags = [tag for tags in self.tags.values() for tag in tags]
        for tag in tags:
            cancel_tag(self.spark, tag)
        for job in self.jobs:
            job.join(timeout=30)
        self.folder.remove()

    def _watch(self) -> None:
        interval = REMOTE_POLL_SECONDS if self.folder.remote else POLL_SECONDS
        while not self.stop.wait(interval):
            self._check_stalls()
            for token, epoch, addresses, targets in self.folder.requests():
                self._feed(token, epoch, addresses, targets)

    def _feed(self, token: str, epoch: int, addresses: List[str],
              targets: Optional[Targets]) -> None:
        """Start the job feeding ``epoch`` to the ranks at ``addresses`` (each partition to
        its ``targets``); cancel the jobs of earlier tokens (their ranks are gone)."""
        tag = f"sparktrain-feed-{uuid.uuid4().hex[:10]}"
        with self.lock:
            old = [t for other, tags in self.tags.items() if other != token for t in tags]
            self.tags = {token: self.tags.get(token, []) + [tag]}
        for stale in old:
            cancel_tag(self.spark, stale)
        job = threading.Thread(target=self._run, args=(token, tag, epoch, addresses, targets),
                               name=f"sparktrain-feed-e{epoch}", daemon=True)
        self.jobs.append(job)
        job.start()

    def _check_stalls(self) -> None:
        """Cancel a feeding job that has had no running task for :data:`FEED_WAIT_CONF`
        seconds (no slot is free for it: the ranks would wait for ever) and tell the ranks
        why, naming the stages that hold the slots."""
        now = time.monotonic()
        with self.lock:
            watched = list(self.watched.items())
        for tag, (epoch, last, since) in watched:
            progress = self.folder.task_progress(tag) if self.marked else \
                job_tasks(self.spark, tag)
            if progress is None:  # a Spark that cannot tell
                continue
            # a running task, progress, or slots held by other fits of this driver (they give
            # them back when they end): the feed is on its way
            if progress[0] or progress != last or fits_holding_slots(self.spark) > 1:
                with self.lock:
                    if tag in self.watched:
                        self.watched[tag] = [epoch, progress, now]
                continue
            if now - since < self.wait:
                continue
            holders = "; ".join(busy_stages(self.spark)) or (
                "a Spark Connect client cannot see them" if self.marked else "none seen")
            why = (f"input_mode='stream': the job feeding epoch {epoch + 1}'s rows to the "
                   f"ranks got no task slot in {self.wait:g}s: the training stage's ranks and "
                   f"other jobs hold every slot (running now: {holders}). Free slots (fewer "
                   f"fits at once, a smaller num_proc), use input_mode='store', or raise "
                   f"{FEED_WAIT_CONF} "
                   f"where the cluster is only slow to give slots (executors starting)")
            log.error("%s", why)
            with self.lock:
                self.watched.pop(tag, None)
                self.stalled[tag] = why
            cancel_tag(self.spark, tag)

    def _run(self, token: str, tag: str, epoch: int, addresses: List[str],
             targets: Optional[Targets]) -> None:
        started = time.perf_counter()
        with self.lock:
            self.watched[tag] = [epoch, None, time.monotonic()]
        marks = self.folder if self.marked else None
        names = self.names
        partition_fn = _feeder(names, epoch, addresses, targets, tag, marks, self.secret)
        try:
            with job_tag(self.spark, tag, f"sparktrain: rows for epoch {epoch + 1}"):
                rows = self.df.mapInArrow(partition_fn, "rows long").collect()
            log.info("fed epoch %d: %d rows of %d columns in %.1fs", epoch + 1,
                     sum(r["rows"] for r in rows), len(names), time.perf_counter() - started)
            self.folder.answer_done(token, epoch)
            with self.lock:
                self.watched.pop(tag, None)
        except BaseException as exc:  # noqa: BLE001 - reported to the ranks through the store
            with self.lock:
                current = token in self.tags and tag in self.tags[token]
                stalled = self.stalled.get(tag)
            text = stalled or str(exc)
            if not stalled and (self.stop.is_set() or not current
                                or any(g in text for g in _GONE)):
                log.debug("feeding epoch %d ended: %s", epoch + 1, text[:300])
                return
            if not stalled:
                log.error("feeding epoch %d failed: %s", epoch + 1, text[:2000])
            self.folder.answer_failed(text)


def _feeder(names: List[str], epoch: int, addresses: List[str], targets: Optional[Targets],
            tag: str, marks: Optional[FeedFolder], secret: str) -> Any:
    """The function each feeding task runs over its partition's Arrow batches (to the
    partition's ranks in ``targets``, all when ``None``); ``marks``: the
    feed folder where tasks mark their start and end (Spark Connect); ``secret``: the fit's
    key for the ranks' receivers (in the function's closure: the job's payload only)."""
    folder, options = (marks.folder, marks.storage_options) if marks is not None else ("", {})

    def feed(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is None:
            raise RuntimeError("the feeding function runs in a Spark task only")
        partition = context.partitionId()
        wire = FeedFolder(folder, options) if folder else None
        if wire is not None:
            wire.task_mark(tag, partition, "started")
        try:
            sent = send_partition(batches, {"epoch": epoch, "partition": partition},
                                  addresses, names, split_col=SPLIT_COL, secret=secret,
                                  targets=targets[partition] if targets else None)
        finally:
            if wire is not None:
                wire.task_mark(tag, partition, "ended")
        yield pa.RecordBatch.from_pydict({"rows": [sum(sent.values())]})

    return feed

