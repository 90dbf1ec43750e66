"""The epoch protocol every rank loop follows, whatever the framework.

Both rank loops (:mod:`sparktrain.loop.torch_loop`, :mod:`sparktrain.loop.keras_loop`) hand this
driver the parts that are theirs, as an :class:`EpochTraining`: one epoch of training, the
validation pass, the end-of-epoch callbacks, the checkpoint bytes and a sum over ranks. The
driver owns the rest, identical for every framework and strategy:

* resuming: the run's latest checkpoint, and the ranks' agreement on it (one could appear
  meanwhile, written by a rank 0 of an attempt being torn down: the attempt is then retried);
* progress: the ``start`` event, ``step`` events at most 4 a second, the ``epoch`` event and
  the epoch's log line (rank 0 with ``verbose >= 1``);
* the history, the TensorBoard writer (rank 0 of a run with a run directory);
* checkpoints after every epoch, with the metadata a resumed attempt and the driver read, and
  inside epochs (``checkpoint_steps``, ``checkpoint_seconds``: :class:`CheckpointTrigger`); a
  resumed attempt continues inside the epoch, after the batches already trained
  (:class:`InEpoch`: the rank loop asks its reader for the epoch without them);
* stopping early: a callback's request or the ``max_time`` deadline, voted over the ranks so
  that all stop after the same epoch. The stop is written into that epoch's checkpoint, so a
  retried attempt of the same fit (``fit_id``) stops there too instead of training on; a new
  fit with the run's ``run_id`` continues (what ``max_time``'s warning tells users to do);
* an elastic fit's generations (:mod:`sparktrain.launch.elastic`): the driver's request to
  regroup joins the same vote and ends the generation after the epoch's checkpoint
  (:class:`~sparktrain.launch.elastic.Regroup`); ``num_proc`` goes into every epoch's logs.

Example (rank side)::

    driver = EpochDriver.for_spec(spec, rank=0, world_size=2, log=print)   # spec: a LoopSpec
    state = driver.resume_bytes()             # None on a fresh run
    ...                                       # build the model from it
    driver.agree(training.all_reduce_sum)
    driver.start(steps=100, description="2 rank(s) ...")
    stop_reason = driver.run(training)        # driver.history, driver.attempts

    # inside training.train_epoch(epoch, reporter): where the epoch starts, and after each
    # optimizer step the hook that writes a checkpoint when one is due
    within = driver.within                    # InEpoch: within.skip batches already trained
    within.after_steps(batches_done, 1, lambda: local_sums)
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from sparktrain.errors import CheckpointError
from sparktrain.faults import mark_user_error
from sparktrain.fs import filesystem
from sparktrain.launch.elastic import Generation, Regroup
from sparktrain.launch.events import WARNING
from sparktrain.loop.checkpoint import Checkpoint, Checkpoints
from sparktrain.options.spec import LoopSpec

Logs = Dict[str, float]

#: optimizer steps timed before ``checkpoint_seconds`` becomes a step interval (the first step
#: of an attempt, which compiles and warms up, is not timed)
PROBE_STEPS = 10


class CheckpointTrigger:
    """When the ranks write a checkpoint inside an epoch: every ``steps`` optimizer steps, and
    every ``seconds`` of training, counted since the last checkpoint of either kind.

    Every rank must decide alike (FSDP and Keras multi-worker write collectively), without a
    collective per step. Steps are the same on every rank; seconds are not, so they become a
    step interval: after :data:`PROBE_STEPS` timed steps the ranks agree on the slowest rank's
    seconds per step (one :meth:`agree` all-reduce, a vector with each rank's time at its
    index) and write every ``seconds / that`` steps; each checkpoint inside an epoch agrees
    again from the steps since the last one (the collective the checkpoint makes anyway).

    Example::

        trigger = CheckpointTrigger(steps=500, seconds=1800.0, rank=0, world_size=2)
        if trigger.advance(1, all_reduce_sum):      # after each optimizer step, every rank
            ...                                     # write the checkpoint (every rank)
            trigger.saved(trigger.agree_values(all_reduce_sum([...] + trigger.timing())))
    """

    def __init__(self, steps: Optional[int], seconds: Optional[float], rank: int,
                 world_size: int, clock: Callable[[], float] = time.monotonic,
                 probe: int = PROBE_STEPS) -> None:
        self.steps, self.seconds, self.rank, self.world_size = steps, seconds, rank, world_size
        self.clock, self.probe = clock, max(1, probe)
        self.every: Optional[int] = None  # checkpoint_seconds as optimizer steps, once agreed
        self.since = 0  # optimizer steps since the last checkpoint
        self.timed_from: Optional[Tuple[float, int]] = None  # (clock, since) where timing began

    @property
    def active(self) -> bool:
        return bool(self.steps or self.seconds)

    def advance(self, steps: int, all_reduce_sum: Callable[[Sequence[float]], List[float]]
                ) -> bool:
        """Count ``steps`` optimizer steps just done; ``True`` when a checkpoint is due now.
        Every rank calls it at the same steps (it may make the probe's collective)."""
        if not self.active:
            return False
        self.since += steps
        if self.timed_from is None:  # the first step since a (re)start is not timed
            self.timed_from = (self.clock(), self.since)
        if self.seconds and self.every is None and self.since - self.timed_from[1] >= self.probe:
            self.every = self._interval(self.agree_values(all_reduce_sum(self.timing())))
        due = bool(self.steps and self.since >= self.steps)
        return due or bool(self.every is not None and self.since >= self.every)

    def timing(self) -> List[float]:
        """This rank's seconds per step since timing began, at its index of a vector of
        ``world_size`` (summed over ranks: every rank's time)."""
        values = [0.0] * self.world_size
        if self.timed_from is not None:
            started, at = self.timed_from
            values[self.rank] = (self.clock() - started) / max(self.since - at, 1)
        return values

    def agree_values(self, summed: Sequence[float]) -> float:
        """The slowest rank's seconds per step from the summed :meth:`timing` vector (the last
        ``world_size`` values of ``summed``)."""
        return max(summed[-self.world_size:])

    def _interval(self, per_step: float) -> Optional[int]:
        if not self.seconds:
            return None
        return max(1, round(self.seconds / per_step)) if per_step > 0 else None

    def saved(self, per_step: Optional[float] = None) -> None:
        """A checkpoint was written (``per_step``: the agreed seconds per step since the last
        one, inside an epoch): count again from here."""
        if per_step is not None and self.timed_from is not None and self.since > self.timed_from[1]:
            self.every = self._interval(per_step)
        self.since = 0
        self.timed_from = (self.clock(), 0) if per_step is not None else None


class InEpoch:
    """The epoch being trained, as the rank loop sees it (``EpochDriver.within``):

    * ``skip``: batches of it trained before the checkpoint this attempt resumed from (read
      the epoch without them: ``take_steps(reader, epoch, steps, skip=within.skip)``) and
      ``partial``: the statistics' sums over all ranks of those batches (rank 0 starts from
      them, the others from zeros) or ``None``; ``trained``: the rows every rank had trained
      then, where its reader knows rows by where they came from (streamed rows: a reader
      given it trains exactly the others, ``RowReader.epoch`` of
      :mod:`sparktrain.data.sources.contract`), else ``None``;
    * :meth:`after_steps`: call it on every rank after each optimizer step inside the epoch
      (not after the last batch: the epoch's end checkpoints anyway); it writes a checkpoint
      when one is due."""

    def __init__(self, driver: "EpochDriver", training: "EpochTraining", epoch: int, skip: int,
                 partial: Optional[List[float]], order: Optional[str] = None,
                 trained: Optional[bytes] = None) -> None:
        self.driver, self.training, self.epoch = driver, training, epoch
        self.skip, self.partial, self.order = skip, partial, order
        self.trained = trained  # every rank's rows trained before the checkpoint, where known

    def after_steps(self, batches_done: int, steps: int, sums: Callable[[], Sequence[float]],
                    order: Optional[str] = None) -> None:
        """``batches_done``: the epoch's batches trained so far (the skipped ones included);
        ``steps``: optimizer steps since the last call; ``sums``: this rank's statistics sums
        of the epoch so far (called only when a checkpoint is written); ``order``: how the
        reader ordered the epoch's rows (``ShardReader.order``), kept for the resume."""
        self.driver._after_steps(self, batches_done, steps, sums, order)


class StepReporter:
    """Rank 0's ``step`` progress events, at most ``per_second`` a second (and the last)."""

    def __init__(self, progress: Callable[..., None], epoch: int, steps: int,
                 per_second: float = 4.0) -> None:
        self.progress, self.epoch, self.steps = progress, epoch, steps
        self.interval, self.last = 1.0 / per_second, 0.0

    def due(self, step: int) -> bool:
        """Whether ``step`` (0-based) should be reported: then call :meth:`send`."""
        return time.monotonic() - self.last >= self.interval or step + 1 == self.steps

    def send(self, step: int, loss: float) -> None:
        self.last = time.monotonic()
        self.progress(event="step", epoch=self.epoch, step=step + 1, loss=float(loss))


class EpochBoard:
    """Rank 0's TensorBoard event files under ``<run>/tensorboard/{train,validation}``: every
    metric of an epoch as the scalar ``epoch/<name>`` (``val_`` keys under ``validation``).

    Written locally (straight into the store when it is a local directory, else into a temp
    directory copied to the store after every epoch); ``tensorboard --logdir <run>/tensorboard``.
    A framework's subclass supplies the event writer: :meth:`_open` and :meth:`_scalar`.
    """

    def __init__(self, run_path: str, storage_options: Dict[str, Any]) -> None:
        import tempfile

        self.fs, remote = filesystem(run_path + "/tensorboard", storage_options)
        self.remote = remote if "://" in run_path else None
        self.local = tempfile.mkdtemp(prefix="sparktrain-tb-") if self.remote else remote
        self.writers = {split: self._open(f"{self.local}/{split}")
                        for split in ("train", "validation")}

    def _open(self, directory: str) -> Any:
        """The framework's event writer into ``directory`` (it has ``flush()``, ``close()``)."""
        raise NotImplementedError

    def _scalar(self, writer: Any, tag: str, value: float, step: int) -> None:
        """Write one scalar with ``writer``."""
        raise NotImplementedError

    def write(self, epoch: int, logs: Logs) -> None:
        for key, value in logs.items():
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._scalar(self.writers[split], f"epoch/{name}", value, epoch + 1)
        for writer in self.writers.values():
            writer.flush()
        if self.remote:
            self.fs.put(self.local + "/", self.remote, recursive=True)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


class EpochTraining(Protocol):
    """What a framework's rank loop supplies to :meth:`EpochDriver.run`."""

    def all_reduce_sum(self, values: Sequence[float]) -> List[float]:
        """Element-wise sums over the ranks (a collective)."""

    def train_epoch(self, epoch: int, reporter: Optional[StepReporter]) -> Logs:
        """One epoch of training; the logs averaged over every rank's rows."""

    def evaluate(self, epoch: int) -> Logs:
        """The validation pass's logs, keys prefixed ``val_`` (``{}`` without validation)."""

    def epoch_end(self, epoch: int, logs: Logs) -> bool:
        """The user's end-of-epoch callbacks; ``True`` when one asks to stop."""

    def checkpoint(self, epoch: int, logs: Logs, mid_epoch: bool = False
                   ) -> Optional[Tuple[bytes, Dict[str, Any]]]:
        """Called on every rank (it may be a collective): rank 0's checkpoint bytes and extra
        metadata, ``None`` on the other ranks. Inside an epoch it is called as
        ``checkpoint(epoch, {}, mid_epoch=True)`` (the model as it is; no epoch-end work)."""

    def position(self, batches_done: int) -> Optional[bytes]:
        """This rank's position in the epoch after ``batches_done`` batches: the rows it
        trained, where its reader knows them (``RowReader.position`` of
        :mod:`sparktrain.data.sources.contract`), else ``None``."""


class EpochDriver:
    """Runs the epochs of one rank; see the module docstring for what it owns."""

    def __init__(self, *, rank: int, world_size: int, epochs: int, verbose: int = 1,
                 run_path: str = "", storage_options: Optional[Dict[str, Any]] = None,
                 deadline: Optional[float] = None, attempt: int = 0, fit_id: str = "",
                 log: Callable[[str], None] = print,
                 progress: Callable[..., None] = lambda **event: None,
                 board: Optional[Callable[[], Any]] = None, require_finite: bool = False,
                 meta: Optional[Dict[str, Any]] = None,
                 generation: Optional[Generation] = None,
                 checkpoint_steps: Optional[int] = None,
                 checkpoint_seconds: Optional[float] = None) -> None:
        """``board`` makes rank 0's TensorBoard writer (``write(epoch, logs)``, ``close()``);
        ``require_finite`` fails the fit on a non-finite metric (the user's bug, not retried);
        ``meta`` goes into every checkpoint's metadata (e.g. the framework's name);
        ``generation``: an elastic fit's; ``checkpoint_steps``/``checkpoint_seconds``: the
        checkpoints inside epochs (:class:`CheckpointTrigger`)."""
        self.rank, self.world_size, self.epochs, self.verbose = rank, world_size, epochs, verbose
        self.deadline, self.log, self.progress = deadline, log, progress
        self.require_finite, self.extra_meta = require_finite, dict(meta or {})
        self.checkpoints = Checkpoints(run_path, storage_options or {}) if run_path else None
        self.resume, self._resume_bytes = self._intact_checkpoint(rank, log)
        self.meta: Dict[str, Any] = self.resume.meta if self.resume is not None else {}
        self.first: int = self.meta.get("epochs_done", 0)
        # resumed inside epoch `first`: the batches of it trained before the checkpoint
        self.resume_step: int = self.resume.step if self.resume is not None else 0
        self.skip = self.resume_step  # in this attempt's batches (start() may rescale it)
        # every rank's rows trained before the checkpoint inside the epoch, where written
        self.resume_rows: Optional[bytes] = self._resume_rows()
        self.history: Dict[str, List[float]] = {
            k: list(v) for k, v in self.meta.get("history", {}).items()}
        self.generation = generation
        started = {"attempt": attempt, "start_epoch": self.first}
        if self.resume_step:
            started["start_step"] = self.resume_step
        if generation is not None:
            started.update(generation=generation.index, ranks=world_size)
        self.attempts = self.meta.get("attempts", []) + [started]
        self.attempt, self.fit_id = attempt, fit_id
        stopped = self.meta.get("stopped") or {}
        # this fit already stopped early at the checkpoint (a retry after the stop): stay stopped
        self.stopped: Optional[str] = stopped.get("reason") \
            if fit_id and stopped.get("fit_id") == fit_id else None
        self.lead = rank == 0 and verbose >= 1
        self.steps = 0  # training steps per epoch, set by start()
        self.stop_reason: Optional[str] = None
        self._make_board = board if rank == 0 and run_path else None
        self.trigger = CheckpointTrigger(checkpoint_steps, checkpoint_seconds, rank, world_size) \
            if self.checkpoints is not None else None
        self.within: Optional[InEpoch] = None  # the epoch being trained

    @classmethod
    def for_spec(cls, spec: LoopSpec, *, rank: int, world_size: int, attempt: int = 0,
                 **hooks: Any) -> "EpochDriver":
        """The driver of ``spec``'s fit on this rank (its epochs, verbosity, run directory,
        deadline and fit id); ``hooks``: the other keywords of ``__init__`` (``log``...)."""
        return cls(rank=rank, world_size=world_size, epochs=spec.epochs, verbose=spec.verbose,
                   run_path=spec.run_path, storage_options=spec.storage_options,
                   deadline=spec.deadline, attempt=attempt, fit_id=spec.fit_id,
                   generation=Generation.from_json(spec.generation),
                   checkpoint_steps=getattr(spec, "checkpoint_steps", None),
                   checkpoint_seconds=getattr(spec, "checkpoint_seconds", None), **hooks)

    def _intact_checkpoint(self, rank: int, log: Callable[[str], None]
                           ) -> Tuple[Optional[Checkpoint], Optional[bytes]]:
        """The newest intact checkpoint and its bytes (rank 0 warns about damaged ones); no
        intact one at all fails the fit, not retried (it would find the same files)."""
        if self.checkpoints is None:
            return None, None
        try:
            return self.checkpoints.latest_intact(
                warn=(lambda text: log(WARNING + text)) if rank == 0 else lambda text: None)
        except CheckpointError as exc:
            raise mark_user_error(exc, "the run's checkpoints (damaged)") from None

    def _resume_rows(self) -> Optional[bytes]:
        """The union of the positions the checkpoint's ranks wrote inside its epoch."""
        if self.resume is None or self.checkpoints is None or not self.resume_step \
                or not self.meta.get("positions"):
            return None
        from sparktrain.data.sources.trained_rows import TrainedRows

        try:
            blobs = self.checkpoints.read_rows(self.resume, int(self.meta["world_size"]))
            return TrainedRows.union(blobs).to_bytes()
        except (FileNotFoundError, ValueError) as exc:
            self.log(f"{WARNING}the positions of the checkpoint inside epoch "
                     f"{self.first + 1} cannot be read ({exc}): resuming after as many steps")
            return None

    def resume_bytes(self) -> Optional[bytes]:
        """The checkpoint this attempt resumes from (the framework's bytes, read once), or
        ``None``."""
        data, self._resume_bytes = self._resume_bytes, None
        if data is None and self.resume is not None and self.checkpoints is not None:
            data = self.checkpoints.read(self.resume)
        return data

    def agree(self, all_reduce_sum: Callable[[Sequence[float]], List[float]]) -> None:
        """Fail the attempt (Spark retries it) unless every rank found the same latest
        checkpoint. One small all-reduce, not a Spark ``allGather`` (about 0.5 s each here)."""
        total = all_reduce_sum([float(self.first), float(self.resume_step)])
        if total != [self.first * self.world_size, self.resume_step * self.world_size]:
            raise RuntimeError("ranks found different latest checkpoints of the run; the "
                               "attempt is retried")

    def start(self, steps: int, description: str) -> None:
        """Log what trains (rank 0, or every rank with ``verbose >= 2``) and send ``start``."""
        if self.lead or self.verbose >= 2:
            self.log(description)
        self.steps = steps
        if self.resume_step:
            self.skip = self._rescaled_skip(steps)
        if self.rank == 0 and self.resume is not None:
            within = f" and step {self.skip} of epoch {self.first + 1}" if self.skip else ""
            self.log(f"resuming from the checkpoint after epoch {self.first}{within} (attempt "
                     f"{self.attempt + 1})")
        if self.rank == 0:  # whatever the verbosity: driver listeners (MLflow) follow epochs
            self.progress(event="start", epochs=self.epochs, steps=steps, first=self.first)

    def _rescaled_skip(self, steps: int) -> int:
        """The batches to skip in this attempt: the checkpoint's step when the epoch has as
        many steps on as many ranks as when it was written; else (an elastic generation of
        another size) the same share of the epoch, which then holds other rows."""
        written, ranks = self.meta.get("steps"), self.meta.get("world_size")
        if self.resume_rows is not None:  # the reader trains exactly the rows left
            return self.resume_step
        if written == steps and ranks == self.world_size:
            return min(self.resume_step, steps)
        share = self.resume_step / max(int(written or steps), 1)
        if self.rank == 0:
            self.log(f"the checkpoint inside epoch {self.first + 1} was written by "
                     f"{ranks} rank(s) at {written} steps/epoch: resuming after the same share "
                     f"of the epoch ({share:.0%}), not exactly after its rows")
        return min(int(share * steps), steps)

    def run(self, training: EpochTraining) -> Optional[str]:
        """Train the remaining epochs; returns why training stopped early (``"callback"``,
        ``"max_time"``) or ``None``."""
        if self.stopped is not None:
            if self.rank == 0:
                self.log(f"this fit stopped after epoch {self.first} ({self.stopped}) before "
                         f"its attempt was retried: nothing left to train")
            return self.stopped
        board = self._make_board() if self._make_board is not None else None
        try:
            for epoch in range(self.first, self.epochs):
                if self._epoch(training, epoch, board):
                    return self.stop_reason
            return None
        finally:
            if board is not None:
                board.close()

    def _epoch(self, training: EpochTraining, epoch: int, board: Any) -> bool:
        started = time.perf_counter()
        reporter = StepReporter(self.progress, epoch, self.steps) if self.lead else None
        resumed = epoch == self.first and self.skip > 0
        partial = self.meta.get("partial") if resumed and self.rank == 0 else None
        self.within = InEpoch(self, training, epoch, self.skip if resumed else 0, partial,
                              self.meta.get("order") if resumed else None,
                              self.resume_rows if resumed else None)
        logs = dict(training.train_epoch(epoch, reporter))
        logs.update(training.evaluate(epoch))
        if self.generation is not None:
            logs["num_proc"] = float(self.world_size)
        if self.require_finite and not all(math.isfinite(v) for v in logs.values()):
            raise mark_user_error(FloatingPointError(
                f"non-finite metrics at epoch {epoch + 1}: {logs}; lower the learning rate or "
                f"check the data"), "the loss or metrics")
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))
        if board is not None:
            board.write(epoch, logs)
        if self.rank == 0:
            self.progress(event="epoch", epoch=epoch, logs=logs)
        if self.lead:
            values = "  ".join(f"{k}={v:.4g}" for k, v in logs.items())
            self.log(f"epoch {epoch + 1}/{self.epochs}  {values}  "
                     f"({time.perf_counter() - started:.1f}s)")
        asked = bool(training.epoch_end(epoch, dict(logs)))
        late = self.deadline is not None and time.time() >= self.deadline
        vote = 1.0 if asked or late else 0.0
        regroup = float(self.rank == 0 and self.generation is not None
                        and self.generation.regroup_asked())
        stop = None
        if epoch + 1 < self.epochs:
            votes = training.all_reduce_sum([vote, regroup])
            if votes[0] > 0:
                stop = "callback" if asked else "max_time"
            elif votes[1] > 0:
                stop = "regroup"
        if self.checkpoints is not None:
            saved = training.checkpoint(epoch, logs)
            if self.rank == 0 and saved is not None:
                payload, meta = saved
                stopped = {"stopped": {"reason": stop, "fit_id": self.fit_id}} \
                    if stop in ("callback", "max_time") else {}
                self.checkpoints.write(epoch + 1, payload, {
                    "history": self.history, "attempts": self.attempts, **self.extra_meta,
                    **stopped, **meta})
            del saved
            if self.trigger is not None:
                self.trigger.saved()
        if stop is None:
            return False
        if stop == "regroup":
            if self.rank == 0:
                self.log(f"regrouping after epoch {epoch + 1}: more task slots are free")
            raise Regroup()
        self.stop_reason = stop
        if self.rank == 0:
            self.log(f"training stopped after epoch {epoch + 1}: "
                     + ("a callback asked to stop" if stop == "callback" else "max_time reached"))
        return True

    def _after_steps(self, within: InEpoch, batches_done: int, steps: int,
                     sums: Callable[[], Sequence[float]], order: Optional[str]) -> None:
        """:meth:`InEpoch.after_steps`: a checkpoint inside the epoch when one is due. One
        all-reduce (the epoch's statistics so far and the step times), then the framework's
        checkpoint (a collective under FSDP); rank 0 writes it."""
        trigger, checkpoints = self.trigger, self.checkpoints
        if trigger is None or checkpoints is None \
                or not trigger.advance(steps, within.training.all_reduce_sum):
            return
        started = time.perf_counter()
        local = [float(v) for v in sums()]
        position = within.training.position(batches_done)
        if position is not None:  # every rank's, before the collective: then rank 0's marker
            checkpoints.write_rows(within.epoch, batches_done, self.rank, position)
        summed = within.training.all_reduce_sum(local + trigger.timing())
        saved = within.training.checkpoint(within.epoch, {}, mid_epoch=True)
        if self.rank == 0 and saved is not None:
            payload, meta = saved
            checkpoints.write(within.epoch, payload, {
                "history": self.history, "attempts": self.attempts, **self.extra_meta, **meta,
                "partial": summed[:len(local)], "steps": self.steps,
                "world_size": self.world_size, "order": order,
                "positions": position is not None}, step=batches_done)
            if self.verbose >= 2 or self.lead:
                self.log(f"checkpoint at step {batches_done}/{self.steps} of epoch "
                         f"{within.epoch + 1} ({len(payload) / 2**20:.1f} MiB, "
                         f"{time.perf_counter() - started:.2f}s)")
        del saved
        trigger.saved(trigger.agree_values(summed))
