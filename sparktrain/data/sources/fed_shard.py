"""One split of one rank's fed rows (:class:`FedShard`): what arrives from the feeding
tasks (or the task's own partition) written into the rank cache or queued in a bounded window,
and the epoch's batches drawn from it; the rows it hands out tracked by where they came from,
for an exact resume (:mod:`.trained_rows`). Its rank's receiver and plan: :mod:`.fed_rank`.

Example (on a rank)::

    shard = FedRows(spec, rank=0, world_size=2, all_gather=ctx.all_gather).readers["train"]
    for batch in shard.epoch(0):
        batch["features"].shape      # (batch_size, 32)
"""
from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparktrain.data.batch import arrow_to_numpy
from sparktrain.data.columns import ColumnSpec
from sparktrain.data.rank_cache import RankCache, cache_root, cacheable, disk_full, row_bytes
from sparktrain.data.shuffle_window import ShuffleWindow, joined_rows, row_count, taken_rows
from sparktrain.data.sources.trained_rows import ROW_ID, EpochTrack, TrainedRows

log = logging.getLogger("sparktrain")

Batch = Dict[str, np.ndarray]

#: memory a rank's shuffle window of arrived rows may take
WINDOW_BYTES = 16 << 20
#: decoded chunks a re-read split's queue holds before the feeders wait
QUEUE_CHUNKS = 64
_NOTHING_YET = object()  # no row has arrived yet (a reader that does not wait)
WAIT_SECONDS = 1.0  # how often a rank waiting for rows looks for a failed feed


class FedShard:
    """One split of one rank's fed rows; ``epoch(epoch, skip)`` yields ``len(self)`` batches
    as :class:`~sparktrain.data.reader.ShardReader` does (see the module docstring)."""

    def __init__(self, rows_of: Any, split: str, columns: Sequence[ColumnSpec],
                 counts: List[int], shares: List[int], most: int, batch_size: int,
                 shuffle: bool, seed: Optional[int], cache_limit: Optional[float]) -> None:
        # rows_of: its rank's FedRows (the receiver, the plan's dealing, the feed's errors)
        self.parent, self.split, self.columns = rows_of, split, list(columns)
        self.shares, self.bases = shares, np.concatenate([[0], np.cumsum(shares)[:-1]])
        # every partition's rows (all ranks'), and the global number of each one's first row
        self.counts = list(counts)
        self.firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.all_rows = int(sum(counts))
        self.track: Optional[EpochTrack] = None  # the epoch being handed out
        self.resumed: Optional[Tuple[int, TrainedRows]] = None  # (epoch, rows it had trained)
        self.rows, self.most = int(sum(shares)), most
        self.batch_size, self.shuffle = batch_size, shuffle
        self.seed, self.rank = 0 if seed is None else seed, rows_of.rank
        self.steps = max(1, math.ceil(most / batch_size))
        self.window = max(4 * batch_size, WINDOW_BYTES // max(1, row_bytes(self.columns)))
        self.cache = _cache(self.columns, self.rows, cache_limit, f"rank {self.rank}'s "
                            f"{split} rows") if cacheable(self.columns) else None
        self.cached = self.cache is not None
        self.lock = threading.Condition()
        self.received: Dict[Any, int] = {}  # (epoch or None when cached, partition) -> rows
        # cached: [first, stop) ranges of shard rows arrived and not yet handed out
        self.arrived: Deque[List[int]] = collections.deque()
        self.total: Dict[Any, int] = {}  # epoch or None -> rows received
        self.chunks: Dict[int, "queue.Queue[Batch]"] = {}
        self.valid: Optional[np.ndarray] = None  # the cached rows, where fewer came than counted
        self.dropped = 0  # rows beyond the count of their partition (not trained)

    def __len__(self) -> int:
        return self.steps

    # -- the receiving side (feed connection threads) ----------------------------------------
    def put(self, epoch: int, partition: int, start: int, batch: Any) -> None:
        key = None if self.cached else epoch
        limit = self.shares[partition] if partition < len(self.shares) else 0
        with self.lock:
            have = self.received.get((key, partition), 0)
        skip, stop = max(have - start, 0), min(batch.num_rows, limit - start)
        if batch.num_rows > max(stop, 0) and start + batch.num_rows > have:
            self._overflow(batch.num_rows - max(stop, skip, 0))
        if stop <= skip:  # sent before (a feeder's retry) or more than the plan counted
            return
        part = batch.slice(skip, stop - skip)
        chunk = {c.name: arrow_to_numpy(part.column(c.name), c) for c in self.columns}
        if self.cached:
            first = int(self.bases[partition]) + start + skip
            self._write(first, chunk)
        else:
            numbers = self.firsts[partition] + self.parent.offsets(
                partition, np.arange(start + skip, start + stop))
            chunk[ROW_ID] = numbers
            resumed = self.resumed
            if resumed is not None and resumed[0] == epoch:  # trained before the resume
                keep = ~resumed[1].mask[numbers]
                chunk = {name: array[keep] for name, array in chunk.items()}
            if len(chunk[ROW_ID]):
                self._queue(epoch).put(chunk)  # blocks while the window is full: flow control
        with self.lock:
            self.received[(key, partition)] = start + stop
            self.total[key] = self.total.get(key, 0) + stop - skip
            if self.cached:
                self.arrived.append([first, first + stop - skip])
            self.lock.notify_all()

    def _overflow(self, rows: int) -> None:
        with self.lock:
            if not self.dropped:
                log.warning("input_mode='stream': rank %d got more %s rows from a partition "
                            "than were counted before: the DataFrame's partitions hold other "
                            "rows each time it is computed (e.g. a repartition(n) without "
                            "columns); the extra rows are not trained. cache() the DataFrame "
                            "or repartition it by a column", self.rank, self.split)
            self.dropped += rows

    def _cached_rows(self) -> RankCache:
        """The rank cache of a cached split (closed only when the fit is over)."""
        if self.cache is None:
            raise RuntimeError(f"rank {self.rank}'s {self.split} rows: the cache is closed")
        return self.cache

    def _write(self, first: int, chunk: Batch) -> None:
        cache = self._cached_rows()
        try:
            for name, array in cache.arrays.items():
                array[first:first + len(chunk[name])] = chunk[name]
        except OSError as exc:  # the disk filled up after the cache was allocated
            self.parent.error = disk_full(cache.folder, "caching the rank's rows", exc)
            raise self.parent.error from None

    def _queue(self, epoch: int) -> "queue.Queue[Batch]":
        with self.lock:
            if epoch not in self.chunks:  # validation rows wait for the epoch's end: unbounded
                self.chunks[epoch] = queue.Queue(QUEUE_CHUNKS if self.split == "train" else 0)
            return self.chunks[epoch]

    # -- the training side ------------------------------------------------------------------
    def complete(self, key: Any = None) -> bool:
        with self.lock:
            return self.total.get(key, 0) >= self.rows

    order: Optional[str] = None  # one order per epoch (RowReader's ``order``: not needed)

    def epoch(self, epoch: int = 0, skip: int = 0, order: Optional[str] = None,
              trained: Optional[bytes] = None) -> Iterator[Batch]:
        """The epoch's batches from step ``skip`` on (the first ``skip`` already trained);
        with ``trained`` (the position of a checkpoint inside the epoch, every rank's: see
        :meth:`position`), exactly the rows none of them had trained, in
        :meth:`resumed_steps` batches, whatever ranks dealt them then."""
        if trained is not None and (self.resumed is None or self.resumed[0] != epoch):
            self.resume_at(epoch, trained)
        elif self.resumed is not None and self.resumed[0] != epoch:
            self.resumed = None
        if self.split == "train":
            self.parent.request(epoch)
        rng = np.random.default_rng([self.seed, epoch, self.rank]) if self.shuffle else None
        done = self.resumed[1] if self.resumed is not None else None
        self.track = EpochTrack(self.all_rows, skip, done) if self.split == "train" else None
        if done is not None:
            if self.cached:
                self._settle()
                return self._permuted(rng, 0, done)
            return self._windowed(epoch, rng, 0, done)
        if self.cached and (self.complete() or skip or self.split != "train"):
            self._settle()
            return self._permuted(rng, skip)
        return self._windowed(epoch, rng, skip)

    def resume_at(self, epoch: int, trained: bytes) -> None:
        """Know before any row of ``epoch`` arrives which ones were trained before the
        resume (rank 0 asks for the rows for every rank: a rank whose ``epoch`` has not begun
        yet must already drop them)."""
        self.resumed = (epoch, TrainedRows.from_bytes(trained))

    def resumed_steps(self, trained: bytes) -> int:
        """The batches of an epoch resumed at position ``trained``: its untrained rows on
        the rank with the most of them, in batches (the same on every rank)."""
        return math.ceil(self._untrained(TrainedRows.from_bytes(trained))[1] / self.batch_size)

    def _untrained(self, done: TrainedRows) -> Tuple[int, int]:
        """``(this rank's untrained rows, the most any rank has)`` after ``done``."""
        per_rank = np.zeros(self.parent.world_size, np.int64)
        for partition, count in enumerate(self.counts):
            first = int(self.firsts[partition])
            offsets = np.flatnonzero(~done.mask[first:first + count])
            owners = self.parent.owners(partition, offsets, self.parent.world_size)
            per_rank += np.bincount(owners, minlength=self.parent.world_size)
        return int(per_rank[self.rank]), int(per_rank.max())

    def position(self, batches_done: int) -> Optional[bytes]:
        """The rows of this epoch's first ``batches_done`` batches on this rank, with those
        an epoch it resumed had trained (bytes for a checkpoint: :class:`.trained_rows.
        TrainedRows`)."""
        return self.track.position(batches_done) if self.track is not None else None

    def _numbers(self, positions: np.ndarray) -> np.ndarray:
        """The global numbers of the rows at ``positions`` of this rank's shard."""
        partitions = np.searchsorted(self.bases, positions, side="right") - 1
        numbers = np.empty(len(positions), np.int64)
        for partition in np.unique(partitions):
            here = partitions == partition
            index = positions[here] - self.bases[partition]
            numbers[here] = self.firsts[partition] + self.parent.offsets(int(partition), index)
        return numbers

    def _handed_out(self, numbers: np.ndarray) -> None:
        if self.track is not None:
            self.track.handed_out(numbers)

    def _permuted(self, rng: Optional[np.random.Generator], skip: int,
                  done: Optional[TrainedRows] = None) -> Iterator[Batch]:
        kind = np.int32 if self.rows < 2**31 else np.int64  # 4 bytes a row: big shards
        order = np.arange(self.rows, dtype=kind)
        most = self.most
        if done is not None:  # the rows not trained yet, by any rank before the resume
            order = order[~done.mask[self._numbers(order)]]
            most = self._untrained(done)[1]
        if rng is not None:
            rng.shuffle(order)
        if self.valid is not None:  # fewer rows came than counted: the ones that did
            order = order[np.isin(order, self.valid)] if done is not None else self.valid[order]
        if most != len(order) and len(order):  # a rank short of the most repeats some
            order = np.resize(order, most)
        for start in range(skip * self.batch_size, most if len(order) else 0, self.batch_size):
            rows = order[start:start + self.batch_size]
            if rng is not None:
                rows = np.sort(rows)  # nearby rows together: fewer pages; a batch is a set
            self._handed_out(self._numbers(rows))
            yield self._cached_rows().batch(rows)

    def _windowed(self, epoch: int, rng: Optional[np.random.Generator], skip: int,
                  done: Optional[TrainedRows] = None) -> Iterator[Batch]:
        """Batches drawn from a window of arrived rows (shuffled) until this rank's rows are
        all in and drawn; then, if it is short of the most, rows drawn again. ``done``: rows
        trained before a resume, dropped as they arrive (read again: not cached)."""
        window = ShuffleWindow(self.window + self.batch_size)
        taken, last = 0, None
        key = None if self.cached else epoch
        minimum = min(self.window, 4 * self.batch_size)  # waited for; more only if already in
        mine, most = (self.rows, self.most) if done is None else self._untrained(done)
        for step in range(math.ceil(most / self.batch_size)):
            size = min(self.batch_size, most - step * self.batch_size)
            while window.size < self.window and taken < mine:
                got = self._next_arrivals(key, self.window - window.size, window.size < minimum)
                if got is None or got is _NOTHING_YET:
                    break
                window.add(got)
                taken += row_count(got)
            rows = window.draw(min(size, window.size), rng) if window.size else None
            short = size - (row_count(rows) if rows is not None else 0)
            if short:  # this rank's rows are all drawn: repeat some (every rank steps alike)
                pool = rows if last is None else last
                if pool is None:
                    raise RuntimeError(f"input_mode='stream': rank {self.rank} received no "
                                       f"rows")
                pick = (rng or np.random.default_rng(step)).integers(0, row_count(pool), short)
                rows = joined_rows(rows, taken_rows(pool, pick))
            last = rows
            if step < skip:
                continue
            assert rows is not None  # drawn, or repeated from the last batch's (else raised)
            if self.cached:
                rows = np.sort(rows)
                self._handed_out(self._numbers(rows))
                yield self._cached_rows().batch(rows)
            else:
                self._handed_out(rows[ROW_ID])
                yield {name: array for name, array in rows.items() if name != ROW_ID}
        with self.lock:
            self.chunks.pop(epoch, None)

    def _next_arrivals(self, key: Any, most: int, block: bool) -> Any:
        """The next arrived rows (at most ``most``): shard positions (cached) or a decoded
        chunk; ``None`` once every row of this epoch is in and handed out; without ``block``,
        :data:`_NOTHING_YET` where none is in yet."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            if self.cached:
                with self.lock:
                    if self.arrived:
                        return self._pop_arrived(most)
                    if self.total.get(None, 0) >= self.rows:
                        return None
                    if not block:
                        return _NOTHING_YET
                    self.lock.wait(WAIT_SECONDS)
            else:
                try:
                    return self._queue(key).get(timeout=WAIT_SECONDS) if block \
                        else self._queue(key).get_nowait()
                except queue.Empty:
                    if self.complete(key) and self._queue(key).empty():
                        return None
                    if not block:
                        return _NOTHING_YET
            if time.monotonic() >= deadline:
                self.parent.check()
                if self._short(key):
                    return None
                deadline = time.monotonic() + WAIT_SECONDS

    def _short(self, key: Any) -> bool:
        """Whether the epoch's rows all came and were fewer than the plan counted (a
        DataFrame that gives other rows each time it is computed): the rank goes on with
        what it has (a cache: those rows only)."""
        epoch = 0 if key is None else key
        if not self.parent.fed_all(epoch) or not self._queue_drained(key):
            return False
        with self.lock:
            got = self.total.get(key, 0)
            if key is None and got < self.rows:
                log.warning("input_mode='stream': rank %d got %d %s rows of the %d counted "
                            "before: the DataFrame's partitions hold other rows each time it "
                            "is computed (e.g. a repartition(n) without columns, or a "
                            "non-deterministic source); it trains on the rows that came. "
                            "cache() the DataFrame or repartition it by a column", self.rank,
                            got, self.split, self.rows)
                self.valid = np.concatenate(
                    [np.arange(base, base + self.received.get((None, p), 0))
                     for p, base in enumerate(self.bases)] + [np.zeros(0, np.int64)])
                self.rows = len(self.valid)
            return True

    def _queue_drained(self, key: Any) -> bool:
        return self.cached or self._queue(key).empty()

    def _pop_arrived(self, most: int) -> np.ndarray:
        """Up to ``most`` arrived shard rows (the caller holds the lock): a window's worth,
        however far the feed has run ahead of training."""
        parts: List[np.ndarray] = []
        while self.arrived and most > 0:
            first, stop = self.arrived[0]
            take = min(most, stop - first)
            parts.append(np.arange(first, first + take))
            most -= take
            if first + take == stop:
                self.arrived.popleft()
            else:
                self.arrived[0][0] = first + take
        return np.concatenate(parts)

    def _settle(self) -> None:
        """Wait until the cache holds every row (or every row that came)."""
        while not self.complete():
            with self.lock:
                self.lock.wait(WAIT_SECONDS)
            self.parent.check()
            if not self.complete() and self._short(None):
                return

    def close(self) -> None:
        """Let the rows go (the fit is over); the receiver closes with the train split's."""
        if self.split == "train":
            self.parent.close()
        else:
            self.drop()

    def drop(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def _cache(columns: Sequence[ColumnSpec], rows: int, limit: Optional[float], label: str
           ) -> Optional[RankCache]:
    """The rank cache for ``rows`` rows, within ``limit`` (bytes, or a fraction of the local
    disk's free space); ``None`` (the split is read again every epoch) where it does not fit."""
    need = rows * row_bytes(columns)
    if limit is not None:
        root = cache_root()
        try:
            os.makedirs(root, exist_ok=True)
            allowed = limit * _free(root) if limit <= 1 else limit
        except OSError:
            allowed = 0
        if need > allowed:
            log.info("%s take %.1f MiB, over cache_limit (%.1f MiB): every epoch reads them "
                     "again", label, need / 2**20, allowed / 2**20)
            return None
    return RankCache.create(columns, rows, label=label, quiet=True)


def _free(root: str) -> int:
    import shutil

    return shutil.disk_usage(root).free
