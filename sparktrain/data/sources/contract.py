"""The contracts of the row sources (:mod:`sparktrain.data.sources`), in one place: what a
rank loop reads through (:class:`RowReader`), the driver's half of a source
(:class:`RowSource`), and what the launch hands over without seeing a row: a
:class:`StageInput` (driver: the DataFrame a barrier stage reads, one partition per task, and a
picklable function making each task's :class:`TaskInput` of its record batches) and the
:class:`TaskInput` (executor: ``RankContext.task_input``), which a task dealing its rows to
several local ranks (one process per GPU) or to a Keras worker's child process hands on
(:meth:`TaskInput.for_local_ranks`, :meth:`TaskInput.for_child`).

Example::

    def train(reader: RowReader) -> None:
        for batch in reader.epoch(0):          # len(reader) batches, the same on every rank
            ...
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
)

import numpy as np

from sparktrain.data.columns import ColumnSpec
from sparktrain.options.spec import LoopSpec, RowsPlan

Batch = Dict[str, np.ndarray]
S = TypeVar("S")


class RowReader(Protocol):
    """What a rank loop reads one split of its rows through, whatever the source.

    ``len(reader)`` is the batches of an epoch (the same on every rank); ``epoch(n, skip,
    order, trained)`` yields epoch ``n``'s batches from batch ``skip`` on (the ones before it
    trained before a mid-epoch checkpoint), ``order`` being how the resumed epoch ordered its
    rows (the reader's ``order`` when the checkpoint was written; ``None`` where the source
    has one order only). The position a checkpoint records: ``order`` and ``skip``, and where
    the reader knows rows by where they came from (streamed rows: partition and offset),
    ``position(batches_done)``, the rows this rank trained (``None`` elsewhere); every rank's,
    joined, is ``trained``: the resumed epoch is exactly the rows left, in
    ``resumed_steps(trained)`` batches, whatever ranks had them before. ``close()`` lets its
    files and connections go.
    """

    order: Optional[str]

    def __len__(self) -> int: ...

    def epoch(self, epoch: int = 0, skip: int = 0, order: Optional[str] = None,
              trained: Optional[bytes] = None) -> Iterator[Batch]: ...

    def position(self, batches_done: int) -> Optional[bytes]: ...

    def resumed_steps(self, trained: bytes) -> int: ...

    def resume_at(self, epoch: int, trained: bytes) -> None: ...

    def close(self) -> None: ...


class TakenRows(Protocol):
    """The rows a training task took (a :class:`~sparktrain.data.sources.contract.TaskInput`),
    as the rank half of ``"own"`` and ``"shuffled"`` reads them."""

    def readers(self, spec: LoopSpec, rank: int, world_size: int,
                all_gather: Callable[[str], List[str]],
                say: Optional[Callable[[str], None]] = None) -> Dict[str, RowReader]: ...


@dataclass
class RowSource:
    """The driver's half of a fit's row source: the plan its ranks get, the columns in their
    stored form, and what runs while the ranks train (:meth:`reaching_ranks`)."""

    plan: RowsPlan
    columns: List[ColumnSpec]
    rows: Dict[str, int] = field(default_factory=dict)  # per split, where counted
    seconds: float = 0.0  # materializing or counting
    reused: bool = False  # a dataset an earlier fit wrote
    frame: Any = field(default=None, repr=False)  # stream: the rows in their stored form

    @contextmanager
    def reaching_ranks(self, spark: Any, storage_options: Dict[str, Any]
                       ) -> Iterator[Optional[StageInput]]:
        """For the block's duration (the training stage's): the jobs feeding the ranks
        (``"fed"``), and the rows the training stage takes itself (``"own"``,
        ``"shuffled"``: the stage input :func:`~sparktrain.launch.barrier.run_barrier`
        takes); ``None`` where the stage takes none."""
        if self.plan.way == "fed":
            from sparktrain.data.sources.fed_driver import Feeding

            with Feeding(spark, self.frame, self.plan.feed_dir, storage_options,
                         self.plan.secret):
                yield None
        elif self.plan.way == "own":
            from sparktrain.data.sources.own_partition import OwnPartitionStage

            yield OwnPartitionStage(self.frame)
        elif self.plan.way == "shuffled":
            from sparktrain.data.sources.shuffled import ShuffledStage

            yield ShuffledStage(self.frame)
        else:
            yield None


class TaskInput(Protocol):
    """The rows one barrier task took (executor side)."""

    def for_local_ranks(self, folder: str, ranks: int,
                        all_gather: Callable[[str], List[str]]) -> Sequence["TaskInput"]:
        """Dealt to the task's ``ranks`` local ranks (files under ``folder``), agreeing with
        the other tasks through ``all_gather``: one input per local rank, picklable."""
        ...

    def for_child(self, spec: S, world_size: int,
                  all_gather: Callable[[str], List[str]]) -> Tuple[Any, S]:
        """Kept for a child process that reads them: ``(what to keep alive while it reads,
        the spec that tells it where)``."""
        ...


class StageInput(Protocol):
    """Rows a barrier stage takes itself (driver side)."""

    def frame(self, tasks: int) -> Any:
        """The DataFrame the stage reads, in ``tasks`` partitions."""
        ...

    def taker(self) -> Callable[[Iterator[Any]], TaskInput]:
        """A picklable function making a task's :class:`TaskInput` of its record batches."""
        ...
