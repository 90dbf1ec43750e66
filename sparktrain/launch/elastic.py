"""Elastic training: a fit as *generations* of barrier jobs, each with the ranks that can run.

``num_proc`` is the most ranks, ``min_num_proc`` the fewest (docs/long-runs-and-faults.md,
"Elastic training"). A Spark barrier stage runs a fixed number of tasks and fails as a whole,
so membership cannot change inside one: a change ends the generation and the next one starts
from the run's last checkpoint (an epoch boundary) with the ranks that can run now::

    generation 0   3 ranks   epochs 1-4 ─── a machine is lost in epoch 5
    generation 1   2 ranks   epochs 5-6     (epoch 5 again, from epoch 4's checkpoint)
                             ─── a slot is free for growAfterSeconds: regroup at epoch 6's end
    generation 2   3 ranks   epochs 7-10

* **Start**: ``min(num_proc, slots)`` ranks when that is at least ``min_num_proc``, at once;
  fewer slots fail fast with the counts (Spark's own barrier check would retry for ~10 min).
* **Shrink**: a failed generation (a rank, executor or machine lost) is not re-run by Spark
  with the same ranks: the job is cancelled (at once when the cluster's slot count drops below
  the generation's ranks, else when a rank reports the fault) and the next generation starts.
  An error in the user's code is never retried. Where the loss left fewer slots than
  ``min_num_proc`` (every executor of the fit was on the lost machine), the next generation
  waits up to ``spark.sparktrain.slotWaitSeconds`` for the cluster manager's replacements
  (YARN starts new containers in tens of seconds) before failing with the counts.
* **Grow**: a watcher polls the slot count; when slots beyond the generation's ranks stay free
  for ``spark.sparktrain.elastic.growAfterSeconds`` (default 20; a flapping node does not
  restart the fit every epoch), it asks the ranks to regroup. They stop at the next epoch end,
  after its checkpoint, and the next generation starts with more ranks.
* **Batch**: every generation reads the whole dataset once per epoch, re-sharded over its
  ranks (row ranges, :mod:`sparktrain.data.reader`). ``elastic_batch="global"`` (default)
  keeps the global batch ``batch_size * num_proc``: each of ``n`` ranks takes
  ``ceil(batch_size * num_proc / n)`` rows, so steps per epoch, the learning rate and its
  schedule mean the same whatever ``n``. ``"rank"`` keeps ``batch_size`` per rank (the global
  batch shrinks with the ranks; the learning rate is left alone).

The slot count is Spark's own (``maxNumConcurrentTasks``) on a classic session. A Spark Connect
client has none: it starts with what the cluster's settings promise, and after a failed
generation the next has one rank fewer (it cannot tell whether the slot came back); it does not
grow.

Example::

    plan = ElasticPlan(num_proc=4, min_num_proc=2)
    results = run_elastic(spark, plan, task, workdir=run_path + "/_launch")
"""
from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional

from sparktrain.errors import TrainingError
from sparktrain.fs import DEFAULT_LAUNCH_DIR, filesystem
from sparktrain.options.converters import BATCH_RULES  # the elastic_batch option's values

log = logging.getLogger(__name__)

GROW_CONF = "spark.sparktrain.elastic.growAfterSeconds"
DEFAULT_GROW_SECONDS = 20.0
POLL_SECONDS = 1.0
#: failed generations an elastic fit survives when ``max_attempts`` is not set
DEFAULT_FAILED_GENERATIONS = 8
#: what a rank returns when its generation ended for the fit to grow
REGROUP = "sparktrain-regroup"


class Regroup(Exception):
    """Raised on every rank at an epoch end (after its checkpoint) when the driver asked the
    ranks to regroup: the generation ends and the next one starts with more ranks."""


@dataclass(frozen=True)
class Generation:
    """What a rank of one generation knows of it (plain values: it travels in the spec)."""

    index: int
    num_proc: int  # the fit's most ranks
    world_size: int  # this generation's ranks
    batch: str  # "global" | "rank"
    flag: str = ""  # a file that, once it exists, asks the ranks to regroup
    storage_options: Optional[Dict[str, Any]] = None

    def batch_size(self, batch_size: int) -> int:
        """Rows per rank per step in this generation (see the module docstring)."""
        if self.batch == "rank":
            return batch_size
        return math.ceil(batch_size * self.num_proc / self.world_size)

    def regroup_asked(self) -> bool:
        """Whether the driver asked the ranks to regroup (cheap: one ``exists``)."""
        if not self.flag:
            return False
        fs, path = filesystem(self.flag, self.storage_options)
        return bool(fs.exists(path))

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Optional[Dict[str, Any]]) -> Optional["Generation"]:
        return None if not value else cls(**value)


def for_rank(spec: Any, ctx: Any) -> Any:
    """``spec`` (a :class:`~sparktrain.options.spec.LoopSpec`) as a rank of an elastic fit's
    generation trains it: its batch size and the generation; unchanged outside elastic fits."""
    generation = getattr(ctx, "generation", None)
    if generation is None:
        return spec
    return replace(spec, batch_size=generation.batch_size(spec.batch_size),
                   generation=generation.to_json())


def scaling_ranks(spec: Any, world_size: int) -> int:
    """The ranks ``scale_learning_rate`` multiplies the learning rate by: ``num_proc`` in an
    elastic fit that keeps the global batch (the rate then fits every generation), else the
    ranks training now."""
    generation = Generation.from_json(getattr(spec, "generation", None))
    if generation is not None and generation.batch == "global":
        return generation.num_proc
    return world_size


@dataclass(frozen=True)
class ElasticPlan:
    """The driver's rules: ``num_proc`` ranks at most, ``min_num_proc`` at least."""

    num_proc: int
    min_num_proc: int
    batch: str = "global"
    max_failures: int = DEFAULT_FAILED_GENERATIONS
    grow_after: float = DEFAULT_GROW_SECONDS

    def __post_init__(self) -> None:
        if not 1 <= self.min_num_proc <= self.num_proc:
            raise ValueError(f"min_num_proc must be between 1 and num_proc={self.num_proc}, "
                             f"got {self.min_num_proc}")
        if self.batch not in BATCH_RULES:
            raise ValueError(f"elastic_batch must be one of {list(BATCH_RULES)}, got "
                             f"{self.batch!r}")

    @property
    def elastic(self) -> bool:
        return self.min_num_proc < self.num_proc

    def ranks(self, slots: Optional[int], per_task: int = 1) -> int:
        """The ranks of the next generation when ``slots`` ranks can run (``None``: the
        cluster cannot say, so ``num_proc``), whole tasks of ``per_task`` ranks (one per GPU);
        fewer than ``min_num_proc`` fail now."""
        ranks = self.num_proc if slots is None else \
            min(self.num_proc, slots - slots % per_task)
        if ranks < self.min_num_proc:
            raise RuntimeError(
                f"min_num_proc={self.min_num_proc} needs {self.min_num_proc} task slots running "
                f"at the same time (Spark barrier mode), but the cluster has {slots} "
                f"(num_proc={self.num_proc}): not waiting for more. Lower min_num_proc or give "
                f"the cluster more executors.")
        return ranks


def _in_generation(task: Callable[[Any], Any], generation: Generation, ctx: Any) -> Any:
    """A rank of ``generation``: ``task`` with the generation in its context."""
    ctx.generation = replace(generation, world_size=ctx.world_size)
    try:
        return task(ctx)
    except Regroup:
        return REGROUP


class _SlotCount:
    """The task slots a generation may use: Spark's live count on a classic session; over
    Spark Connect (no live count) what the cluster's settings promise, less one rank for each
    failed generation, since the client cannot see whether the lost slot came back."""

    def __init__(self, spark: Any, plan: ElasticPlan, profile: Any = None,
                 per_task: int = 1) -> None:
        from sparktrain.session.spark_api import is_remote

        self.spark, self.plan, self.remote = spark, plan, is_remote(spark)
        self.profile, self.per_task = profile, per_task
        self.most = plan.num_proc

    def now(self) -> Optional[int]:
        """The ranks the cluster can run at once: its task slots (of the training stage's
        profile) times the ranks each task runs."""
        from sparktrain.session.slots import rank_slots

        slots = rank_slots(self.spark, self.profile, self.per_task)
        if not self.remote:
            return slots
        return min(self.plan.num_proc if slots is None else slots, self.most)

    def live(self) -> Optional[int]:
        """The count a watcher can follow while a generation runs (``None``: none)."""
        return None if self.remote else self.now()

    def failed(self, ranks: int) -> None:
        if self.remote:
            self.most = max(self.plan.min_num_proc, ranks - self.per_task)


class _SlotWatch:
    """Polls the cluster's slot count while a generation runs (classic sessions): cancels the
    generation when slots drop below its ranks (a lost executor: the barrier stage cannot
    finish, and Spark would wait ~10 min for the slot), asks for a regroup when more slots
    than ranks stay free for ``grow_after`` seconds."""

    def __init__(self, spark: Any, plan: ElasticPlan, generation: Generation, tag: str,
                 slots: Callable[[], Optional[int]], per_task: int = 1) -> None:
        self.spark, self.plan, self.generation, self.tag = spark, plan, generation, tag
        self.slots, self.per_task = slots, per_task
        self.lost: Optional[str] = None  # why the generation was cancelled
        self.grow_to: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sparktrain-elastic", daemon=True)

    def __enter__(self) -> "_SlotWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        from sparktrain.session.spark_api import cancel_tag

        ranks, free_since = self.generation.world_size, None
        while not self._stop.wait(POLL_SECONDS):
            try:
                slots = self.slots()
            except Exception as exc:  # noqa: BLE001 - a failed probe must not end the fit
                log.debug("slot count failed: %s", exc)
                continue
            if slots is None:
                continue
            if slots < ranks:
                self.lost = (f"the cluster's task slots dropped to {slots} (an executor or "
                             f"machine was lost)")
                cancel_tag(self.spark, self.tag)
                return
            if slots >= ranks + self.per_task and ranks < self.plan.num_proc \
                    and self.grow_to is None:
                free_since = free_since or time.monotonic()
                if time.monotonic() - free_since >= self.plan.grow_after:
                    self.grow_to = min(slots - slots % self.per_task, self.plan.num_proc)
                    fs, path = filesystem(self.generation.flag, self.generation.storage_options)
                    fs.pipe_file(path, b"regroup")
                    log.info("%d task slot(s) free for %gs: the ranks regroup at the next "
                             "epoch end, from %d to %d", slots - ranks, self.plan.grow_after,
                             ranks, self.grow_to)
            elif slots <= ranks:
                free_since = None


def run_elastic(spark: Any, plan: ElasticPlan, task: Callable[[Any], Any],
                on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                max_attempts: Optional[int] = None, workdir: Optional[str] = None,
                storage_options: Optional[Dict[str, Any]] = None, **options: Any) -> List[Any]:
    """Run ``task`` as :func:`~sparktrain.launch.barrier.run_barrier` does, in generations
    when ``plan`` is elastic (see the module docstring); results of the last generation.

    ``max_attempts`` caps the failed generations (default 8); ``options``: the other keywords
    of ``run_barrier``.
    """
    from sparktrain.launch.barrier import run_barrier
    from sparktrain.session.spark_api import conf_value

    def launch(ranks: int, work: Callable[[Any], Any], **more: Any) -> List[Any]:
        return run_barrier(spark, ranks, work, on_progress=on_progress, workdir=workdir,
                           storage_options=storage_options, **options, **more)

    if not plan.elastic:
        return launch(plan.num_proc, task, max_attempts=max_attempts)
    plan = replace(plan, grow_after=float(conf_value(spark, GROW_CONF, None) or plan.grow_after))
    root = f"{(workdir or DEFAULT_LAUNCH_DIR).rstrip('/')}" \
           f"/elastic-{uuid.uuid4().hex[:8]}"
    fs, local_root = filesystem(root, storage_options)
    fs.makedirs(local_root, exist_ok=True)
    max_failures = max_attempts or plan.max_failures
    failures, before, why, index = 0, 0, "start", 0
    per_task = options.get("ranks_per_task", 1)
    slots = _SlotCount(spark, plan, options.get("profile"), per_task)
    try:
        while True:
            ranks = plan.ranks(slots.now() if not index else _after_loss(spark, slots, plan),
                               per_task)
            generation = Generation(index, plan.num_proc, ranks, plan.batch,
                                    f"{root}/regroup-{index}", storage_options)
            _announce(generation, before, why, on_progress)
            tag = f"sparktrain-{uuid.uuid4().hex[:12]}"
            watch = _SlotWatch(spark, plan, generation, tag, slots.live, per_task)
            try:
                with watch:
                    results = launch(ranks, functools.partial(_in_generation, task, generation),
                                     max_attempts=1, tag=tag,
                                     when_exhausted="its generation of the elastic fit ends")
            except TrainingError as error:
                if error.user_error:
                    raise
                failures += 1
                why = watch.lost or _last_line(error)
                if failures >= max_failures:
                    raise TrainingError(f"elastic fit gave up after {failures} failed "
                                        f"generation(s) (max_attempts={max_failures}); the last: "
                                        f"{why}\n\n{error}", error.rank, error.remote_traceback,
                                        failures) from None
                log.warning("generation %d (%d ranks) failed: %s; the next starts from the last "
                            "checkpoint with the ranks that can run now", index, ranks, why)
                slots.failed(ranks)
            else:
                if not results or results[0] != REGROUP:
                    return results
                why = f"{(watch.grow_to or ranks) - ranks} task slot(s) became free"
            before, index = ranks, index + 1
    finally:
        try:
            fs.rm(local_root, recursive=True)
        except (FileNotFoundError, OSError):
            pass


def _after_loss(spark: Any, slots: "_SlotCount", plan: ElasticPlan) -> Optional[int]:
    """The slots for the generation after a change: at once where at least ``min_num_proc``
    are there, else after waiting up to the slot wait for replacements (a cluster manager
    starting new executors) to bring them back."""
    from sparktrain.launch.barrier import DEFAULT_SLOT_WAIT_SECONDS, SLOT_WAIT_CONF
    from sparktrain.session.spark_api import conf_value

    count = slots.now()
    if count is None or count >= plan.min_num_proc:
        return count
    wait = float(conf_value(spark, SLOT_WAIT_CONF, None) or DEFAULT_SLOT_WAIT_SECONDS)
    log.info("the cluster has %d task slot(s) for min_num_proc=%d: waiting up to %gs for "
             "replacement executors (%s)", count, plan.min_num_proc, wait, SLOT_WAIT_CONF)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        count = slots.now()
        if count is None or count >= plan.min_num_proc:
            return count
    return count


def _last_line(error: TrainingError) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _announce(generation: Generation, before: int, why: str,
              on_progress: Optional[Callable[[Dict[str, Any]], None]]) -> None:
    """Log a membership change and send it as a ``membership`` progress event (the MLflow
    plug-in tags the run with it)."""
    if generation.index == 0:
        if generation.world_size < generation.num_proc:
            log.warning("elastic fit starts with %d of num_proc=%d ranks (the free task "
                        "slots); it grows when more become free", generation.world_size,
                        generation.num_proc)
    else:
        log.warning("elastic generation %d: %d -> %d ranks (%s)", generation.index, before,
                    generation.world_size, why)
    if on_progress is not None:
        on_progress({"event": "membership", "generation": generation.index, "from": before,
                     "to": generation.world_size, "reason": why, "time": time.time()})
