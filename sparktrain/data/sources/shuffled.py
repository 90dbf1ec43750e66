"""Rows shuffled into the training stage (``input_mode="stream"`` where no slot is left to
feed the ranks beside it and each rank cannot take its own partition: ``KerasEstimator``,
other partition counts, elastic fits, Spark Connect).

No dataset goes to the store. The barrier stage runs on the DataFrame's rows (its columns in
their stored form and a split column, :func:`sparktrain.data.sources.choose.rows_to_ranks`),
repartitioned into one partition per task (:class:`ShuffledStage`). Each rank writes the
Arrow record batches it receives into one local Arrow IPC file per split (:func:`spool`, in
the folder the rank-local cache uses, removed when done or orphaned), the ranks agree on the
most rows any of them got,
and every epoch reads that memory-mapped file (:class:`StreamShard`): shuffled over all the
rank's rows, every row once per epoch, a rank with fewer rows than the most repeating some of
its own so that every rank runs the same steps. A retried or regrouped stage streams the rows
again.

Each row carries Spark's ``monotonically_increasing_id`` of the frame before the shuffle (its
partition and offset: :data:`~.trained_rows.ROW_ID`), and the ranks agree on every partition's
extent when they spool, so a rank knows its rows by where they came from
(:class:`~.trained_rows.RowNumbering`): a checkpoint inside an epoch records the rows each rank
trained, and a resumed epoch, with the same ranks or others (an elastic generation, another
``num_proc``), trains exactly the rows none of them had (:meth:`StreamShard.resume_at`). A Keras
child reads without the ranks' gather and resumes by its skip.

Example (on a rank)::

    readers = ctx.task_input.readers(spec, rank, world_size, ctx.all_gather)   # ShuffledRows
    for batch in readers["train"].epoch(0):
        batch["features"].shape      # (batch_size, 32)
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import weakref
from dataclasses import replace
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    cast,
)

import numpy as np

from sparktrain.data.batch import arrow_to_numpy
from sparktrain.data.columns import SPLIT_COL, ColumnSpec
from sparktrain.data.rank_cache import RankCache, cache_root, disk_full, owned_folder
from sparktrain.data.sources.trained_rows import (
    ROW_ID,
    EpochTrack,
    RowNumbering,
    TrainedRows,
    id_extents,
    merged_extents,
)
from sparktrain.options.spec import LoopSpec

Batch = Dict[str, np.ndarray]
S = TypeVar("S")
SPLITS = ("train", "val")
Gather = Callable[[str], List[str]]


def spool(batches: Iterable[Any], columns: Sequence[ColumnSpec], folder: str
          ) -> Tuple[Dict[str, Tuple[str, int]], Dict[int, int]]:
    """Write the Arrow record ``batches`` into ``folder``, one IPC file per split:
    ``({split: (path, rows)} for the splits that got rows, the row ids' extents)``."""
    writer = _SpoolWriter(folder, [c.name for c in columns])
    try:
        for batch in batches:
            writer.write(batch)
    finally:
        files = writer.close()
    return files, writer.extents


class _SpoolWriter:
    """Record batches in (with their split column), one Arrow IPC file per split out; the
    rows' ids (:data:`~.trained_rows.ROW_ID`) are kept beside ``names`` and their extents
    counted."""

    def __init__(self, folder: str, names: Optional[Sequence[str]] = None) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.names = folder, names  # None: every column but the split
        self.counts = {split: 0 for split in SPLITS}
        self.writers: Dict[str, Any] = {}
        self.extents: Dict[int, int] = {}  # partition -> most offset + 1 (row ids seen)

    def write(self, batch: Any) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if not batch.num_rows:
            return
        split_of = batch.column(SPLIT_COL)
        names = list(self.names or [n for n in batch.schema.names if n != SPLIT_COL])
        if ROW_ID in batch.schema.names:
            self.extents = merged_extents([self.extents, id_extents(
                batch.column(ROW_ID).to_numpy())])
            names += [ROW_ID] if ROW_ID not in names else []
        for split in SPLITS:
            part = batch.filter(pc.equal(split_of, split))
            if not part.num_rows:
                continue
            part = pa.RecordBatch.from_arrays([part.column(n) for n in names], names=names)
            if split not in self.writers:
                self.writers[split] = pa.ipc.new_file(
                    os.path.join(self.folder, f"{split}.arrow"), part.schema)
            self.writers[split].write_batch(part)
            self.counts[split] += part.num_rows

    def close(self) -> Dict[str, Tuple[str, int]]:
        """Close the files: ``{split: (path, rows)}`` for the splits that got rows."""
        for writer in self.writers.values():
            writer.close()
        return {split: (os.path.join(self.folder, f"{split}.arrow"), self.counts[split])
                for split in self.writers}


class StreamShard:
    """One split of one rank's streamed rows, from its spooled file; ``epoch`` yields
    ``len(self)`` batches as :class:`~sparktrain.data.reader.ShardReader` does. Numeric
    columns are moved once into the rank-local cache's memory-mapped arrays (a batch is then a
    slice or a gather of them); other columns are taken from the Arrow table."""

    def __init__(self, path: str, columns: Sequence[ColumnSpec], rows_per_epoch: int,
                 batch_size: int, shuffle: bool, seed: Optional[int], rank: int,
                 extents: Optional[Dict[Any, int]] = None,
                 all_gather: Optional[Gather] = None) -> None:
        import pyarrow as pa

        self.columns = list(columns)
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()  # zero copy
        self.rows = table.num_rows
        # the rows' global numbers, where they came with ids and the ranks can agree on a
        # resume (``extents``: every partition's, agreed when spooling)
        self.numbering: Optional[RowNumbering] = None
        self.numbers: Optional[np.ndarray] = None
        if extents and all_gather is not None and ROW_ID in table.schema.names:
            self.numbering = RowNumbering.from_extents(merged_extents([extents]))
            self.numbers = self.numbering.numbers(table.column(ROW_ID).to_numpy())
        self.all_gather = all_gather
        self.resumed: Optional[Tuple[int, TrainedRows, int]] = None  # epoch, done, most left
        self.track: Optional[EpochTrack] = None
        self.rows_per_epoch = rows_per_epoch
        self.batch_size = batch_size
        self.shuffle, self.seed, self.rank = shuffle, 0 if seed is None else seed, rank
        self.steps = max(1, math.ceil(rows_per_epoch / batch_size))
        self.spooled: Any = None  # the rank's spool folder (removed once no reader holds it)
        self.cache = RankCache.create(self.columns, self.rows, label=f"rank {rank}'s rows")
        self.table: Any = None  # the rows where the cache has no room for them
        offset = 0
        for batch in table.to_batches() if self.cache is not None else ():
            chunk = {c.name: arrow_to_numpy(batch.column(c.name), c) for c in self.columns}
            if self.cache is None or not self.cache.write(offset, chunk):
                self.cache = None
                break
            offset += batch.num_rows
        if self.cache is not None:  # the rows are on the disk once, in the cache
            del table
            os.remove(path)
            self.table = None
        else:  # one chunk: ``take`` over many record batches is slow
            self.table = table.combine_chunks()

    def __len__(self) -> int:
        return self.steps

    order: Optional[str] = None  # one order only: a pure function of seed, epoch and rank

    def epoch(self, epoch: int = 0, skip: int = 0, order: Optional[str] = None,
              trained: Optional[bytes] = None) -> Iterator[Batch]:
        """Every row of the shard once (shuffled when ``shuffle``), then as many of them again
        as this rank is short of the most rows a rank has; from batch ``skip`` on (the ones
        before it trained before a mid-epoch checkpoint: the same order, so exactly). With
        ``trained`` (every rank's position at a checkpoint inside the epoch): exactly the rows
        none of them had trained, in :meth:`resumed_steps` batches, whoever had them."""
        rng = np.random.default_rng([self.seed, epoch, self.rank]) if self.shuffle else None
        done = None
        if trained is not None:
            if self.resumed is None or self.resumed[0] != epoch:
                self.resume_at(epoch, trained)
            assert self.resumed is not None and self.numbers is not None
            _, done, most = self.resumed
            left = np.flatnonzero(~done.mask[self.numbers])
            if not len(left):  # this rank's rows all trained: it repeats some, in step
                left = np.arange(self.rows)
            shard = rng.permutation(left) if rng is not None else left
            shard, start = np.resize(shard, most), 0
        else:
            shard = rng.permutation(self.rows) if rng is not None else np.arange(self.rows)
            shard = np.resize(shard, self.rows_per_epoch)  # repeats from the start when short
            start = skip * self.batch_size
        exact = self.numbers is not None and self.all_gather is not None
        self.track = EpochTrack(self.numbering.rows, skip, done) \
            if exact and self.numbering is not None else None
        for first in range(start, len(shard), self.batch_size):
            rows = shard[first:first + self.batch_size]
            if rng is not None:
                rows = np.sort(rows)  # nearby rows together: fewer pages; a batch is a set
            if self.track is not None and self.numbers is not None:
                self.track.handed_out(self.numbers[rows])
            yield self._rows(rows)

    def _rows(self, rows: np.ndarray) -> Batch:
        if self.cache is not None:
            contiguous = len(rows) and rows[-1] - rows[0] == len(rows) - 1
            return self.cache.slice(int(rows[0]), int(rows[-1]) + 1) if contiguous \
                else self.cache.batch(rows)
        part = self.table.take(rows)
        return {c.name: arrow_to_numpy(part.column(c.name), c) for c in self.columns}

    def position(self, batches_done: int) -> Optional[bytes]:
        """The rows of this epoch's first ``batches_done`` batches on this rank, with those a
        resumed epoch had trained (:class:`~.trained_rows.TrainedRows` bytes); ``None`` where
        the rows came without ids (a Keras child: resumed by its skip, in the same order)."""
        return self.track.position(batches_done) if self.track is not None else None

    def resume_at(self, epoch: int, trained: bytes) -> None:
        """Resume ``epoch`` at ``trained`` (every rank's position joined): the ranks agree on
        the most rows any of them has left (one gather: every rank calls this)."""
        if self.numbers is None or self.numbering is None or self.all_gather is None:
            raise ValueError("these streamed rows came without their ids: the epoch resumes "
                             "by its skip, not by rows")
        done = TrainedRows.from_bytes(trained)
        fits = done.rows == self.numbering.rows
        mine = int((~done.mask[self.numbers]).sum()) if fits else -1
        left = [int(n) for n in self.all_gather(str(mine))]
        if min(left) < 0:
            raise ValueError(f"input_mode='stream': the checkpoint's position covers {done.rows}"
                             f" rows and the DataFrame now has {self.numbering.rows} on some "
                             f"rank: its rows changed since the checkpoint, so the epoch cannot "
                             f"resume exactly (a deterministic DataFrame, e.g. cached, resumes "
                             f"exactly)")
        self.resumed = (epoch, done, max(left))

    def resumed_steps(self, trained: bytes) -> int:
        """The batches of the epoch :meth:`resume_at` resumed: the most rows a rank has left."""
        if self.resumed is None:
            raise RuntimeError("resume_at() comes before resumed_steps() on a spooled shard")
        return math.ceil(self.resumed[2] / self.batch_size)

    def close(self) -> None:
        """Let the files go; the spooled folder is removed once no reader holds it."""
        self.table = None
        if self.cache is not None:
            self.cache.close()
        self.__dict__.pop("spooled", None)


class _Spooled:
    """The folder of a rank's spooled files: removed with the readers (or with the process,
    or by the next fit on the machine if the process was killed)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.remove = weakref.finalize(self, shutil.rmtree, folder, True)


def spool_shard(spec: LoopSpec, world_size: int, rows: Iterable[Any],
                all_gather: Callable[[str], List[str]]) -> Tuple[Any, Dict[str, List[Any]]]:
    """Spool this rank's ``rows`` and agree with the other ranks on the rows an epoch has:
    ``(the spool folder's owner, {split: [file, rows per epoch]})``. The folder goes when the
    owner object does (keep it while the files are read)."""
    columns = [ColumnSpec.from_json(c) for c in spec.columns]
    spooled = _Spooled(owned_folder(cache_root()))
    try:
        files, extents = spool(rows, columns, spooled.folder)
    except OSError as exc:
        spooled.remove()
        if exc.errno != errno.ENOSPC:
            raise
        raise disk_full(spooled.folder, "spooling the rank's streamed rows", exc) from None
    counts = [json.loads(text) for text in all_gather(json.dumps(
        {**{split: n for split, (_, n) in files.items()}, "extents": extents}))]
    try:
        most = _agreed_rows(counts)
    except ValueError:
        spooled.remove()
        raise
    return spooled, _plan(files, most, counts)


def _plan(files: Dict[str, Tuple[str, int]], most: Dict[str, int],
          counts: List[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """``{split: [file, rows per epoch, every partition's extent]}`` (JSON-able)."""
    extents = merged_extents(c.get("extents", {}) for c in counts)
    return {split: [files[split][0], most[split], extents] for split in SPLITS
            if most[split] and split in files}


def _agreed_rows(counts: List[Dict[str, int]]) -> Dict[str, int]:
    """The rows an epoch of each split has on every rank (the most any rank got), from every
    rank's ``{split: rows}`` in rank order; ``ValueError`` when a rank got none."""
    most = {split: max(c.get(split, 0) for c in counts) for split in SPLITS}
    if not most["train"]:
        raise ValueError("input_mode='stream': the DataFrame reached the ranks without rows")
    for split in (s for s in SPLITS if most[s]):
        empty = [r for r, c in enumerate(counts) if not c.get(split)]
        if empty:
            raise ValueError(
                f"input_mode='stream': rank(s) {empty} of {len(counts)} received no "
                f"{'training' if split == 'train' else 'validation'} rows (rows per rank: "
                f"{[c.get(split, 0) for c in counts]}); the DataFrame has too few rows for "
                f"num_proc={len(counts)}: use fewer ranks or input_mode='store'")
    return most


class ShuffledStage:
    """The stage input (:class:`~sparktrain.data.sources.contract.StageInput`): the rows in one
    partition per task, as they are when they already are (no shuffle, as XGBoost's PySpark
    estimators do), else repartitioned (a shuffle, which a barrier stage may follow;
    ``coalesce`` may not, SPARK-24820)."""

    def __init__(self, frame: Any) -> None:
        self.rows = frame

    def frame(self, tasks: int) -> Any:
        from sparktrain.session.spark_api import num_partitions

        if num_partitions(self.rows) == tasks:
            return self.rows
        return self.rows.repartition(tasks)

    def taker(self) -> Callable[[Iterator[Any]], "ShuffledRows"]:
        return ShuffledRows


class ShuffledRows:
    """The rows one training task took, as Arrow record batches (a
    :class:`~sparktrain.data.sources.contract.TaskInput`): spooled by the rank that reads them,
    dealt to the task's local ranks, or spooled for a child process."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches

    def readers(self, spec: LoopSpec, rank: int, world_size: int,
                all_gather: Callable[[str], List[str]],
                say: Optional[Callable[[str], None]] = None) -> Dict[str, StreamShard]:
        spooled, files = spool_shard(spec, world_size, self.batches, all_gather)
        return streamed_readers(spec, files, rank, spooled, all_gather)

    def for_local_ranks(self, folder: str, ranks: int,
                        all_gather: Callable[[str], List[str]]) -> Sequence["SpooledRows"]:
        """Spooled into ``folder``, each record batch dealt in equal slices to the task's
        ``ranks`` ranks; the tasks agree on the rows per epoch through ``all_gather``
        (Spark's, between the tasks)."""
        writers = [_SpoolWriter(os.path.join(folder, f"rows-{local}")) for local in range(ranks)]
        try:
            try:
                for batch in self.batches:  # equal slices, zero copy, each to its rank's files
                    for local, writer in enumerate(writers):
                        start = local * batch.num_rows // ranks
                        end = (local + 1) * batch.num_rows // ranks
                        writer.write(batch.slice(start, end - start))
            finally:
                files = [writer.close() for writer in writers]
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise disk_full(folder, "spooling the task's streamed rows", exc) from None
        extents = merged_extents(writer.extents for writer in writers)
        counts = [c for text in all_gather(json.dumps(
            [{**{split: n for split, (_, n) in f.items()}, "extents": extents}
             for f in files])) for c in json.loads(text)]
        most = _agreed_rows(counts)
        return [SpooledRows(_plan(f, most, counts)) for f in files]

    def for_child(self, spec: S, world_size: int,
                  all_gather: Callable[[str], List[str]]) -> Tuple[Any, S]:
        """Spooled for a child process (Keras) that reads them: ``(the spool folder's owner:
        keep it alive while the child reads, the spec that tells the child where)``."""
        spooled, files = spool_shard(cast(LoopSpec, spec), world_size, self.batches,
                                     all_gather)
        plan = replace(cast(LoopSpec, spec).rows, spooled=files)
        return spooled, cast(S, replace(cast(Any, spec), rows=plan))


class SpooledRows:
    """A local rank's part of its task's rows, spooled by the task: ``{split: [file, rows per
    epoch]}``."""

    def __init__(self, files: Dict[str, List[Any]]) -> None:
        self.files = files

    def readers(self, spec: LoopSpec, rank: int, world_size: int,
                all_gather: Callable[[str], List[str]],
                say: Optional[Callable[[str], None]] = None) -> Dict[str, StreamShard]:
        return streamed_readers(spec, self.files, rank, all_gather=all_gather)

    def for_local_ranks(self, folder: str, ranks: int,
                        all_gather: Callable[[str], List[str]]) -> List[Any]:
        raise RuntimeError("these rows were already dealt to a local rank")

    def for_child(self, spec: S, world_size: int,
                  all_gather: Callable[[str], List[str]]) -> Tuple[Any, S]:
        raise RuntimeError("these rows were already dealt to a local rank")


def streamed_readers(spec: LoopSpec, files: Dict[str, List[Any]], rank: int,
                     spooled: Any = None, all_gather: Optional[Gather] = None
                     ) -> Dict[str, StreamShard]:
    """The readers of spooled ``files`` (:func:`spool_shard`'s); ``spooled`` stays alive with
    them; ``all_gather``: the ranks', for an exact resume of the training split."""
    columns = [ColumnSpec.from_json(c) for c in spec.columns]
    options = {"train": (spec.batch_size, spec.shuffle), "val": (spec.val_batch_size, False)}
    readers = {}
    for split, (path, rows_per_epoch, *extents) in files.items():
        size, shuffle = options[split]
        exact = split == "train" and extents
        readers[split] = StreamShard(path, columns, rows_per_epoch, size, shuffle, spec.seed,
                                     rank, extents[0] if exact else None,
                                     all_gather if exact else None)
        readers[split].spooled = spooled
    return readers
