"""A rank's streamed rows as they arrive from the feeding tasks (``input_mode="stream"``).

Every rank knows from the driver's plan (each input partition's row count per split) how many
rows it will get and where each partition's rows go in its shard (:mod:`.fed_wire` deals them),
so all ranks run the same steps without counting or talking: ``ceil(most rows of any rank /
batch_size)``, a rank short of the most repeating some of its rows.

Two ways to hold the rows, chosen per split:

* **cached** (fixed-shape numeric columns, and the shard fits ``cache_limit`` and the local
  disk): arriving rows are written straight into the rank-local cache
  (:class:`~sparktrain.data.rank_cache.RankCache`) at their place in the shard. The first
  epoch trains on them as they arrive, shuffled within a window of :data:`WINDOW_BYTES`; every
  later epoch is a permutation of the whole shard (exact and repeatable: a resumed epoch skips
  exactly the batches it had trained). One decoded copy on the local disk, nothing else.
* **re-read** (anything else): rows are kept only in a bounded in-memory window, and every
  epoch asks the driver to feed the DataFrame again (read again from its source), as
  TensorFlowOnSpark's InputMode.SPARK and Ray Data's ``streaming_split`` do. A resumed epoch
  skips as many rows as it had trained (the same count, not necessarily the same rows).

Example (on a rank)::

    rows = FedRows(spec, rank=0, world_size=2, all_gather=ctx.all_gather)   # spec.rows: "fed"
    for batch in rows.readers["train"].epoch(0):
        batch["features"].shape      # (batch_size, 32)
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparktrain.data.batch import arrow_to_numpy
from sparktrain.data.columns import ColumnSpec
from sparktrain.data.rank_cache import RankCache, cache_root, cacheable, disk_full, row_bytes
from sparktrain.data.shuffle_window import ShuffleWindow, joined_rows, row_count, taken_rows
from sparktrain.data.sources.fed_wire import FeedFolder, Receiver, share
from sparktrain.data.sources.trained_rows import EpochTrack, TrainedRows
from sparktrain.faults import mark_user_error
from sparktrain.options.spec import LoopSpec

log = logging.getLogger("sparktrain")

Batch = Dict[str, np.ndarray]

#: memory a rank's shuffle window of arrived rows may take
WINDOW_BYTES = 16 << 20
#: decoded chunks a re-read split's queue holds before the feeders wait
QUEUE_CHUNKS = 64
_NOTHING_YET = object()  # no row has arrived yet (a reader that does not wait)
ROW_ID = "__sparktrain_row__"  # a fed chunk's global row numbers, beside its columns
WAIT_SECONDS = 1.0  # how often a rank waiting for rows looks for a failed feed


class FeedFailed(RuntimeError):
    """The driver could not feed the rows (the DataFrame's computation failed)."""


class FedRows:
    """This rank's receiver and its readers (``readers[split]``, each a :class:`FedShard`):
    rows dealt to it by the feeding tasks, planned from the counts in ``spec.rows``.
    :class:`~.own_partition.OwnRows` is the same with the task's own partition instead."""

    def __init__(self, spec: LoopSpec, rank: int, world_size: int,
                 all_gather: Optional[Callable[[str], List[str]]],
                 say: Optional[Callable[[str], None]] = None) -> None:
        plan = spec.rows
        self.rank, self.world_size, self.chunk = rank, world_size, plan.chunk
        self.folder = FeedFolder(plan.feed_dir, spec.storage_options) if plan.feed_dir else None
        columns = [ColumnSpec.from_json(c) for c in spec.columns]
        self.error: Optional[BaseException] = None
        options = {"train": (spec.batch_size, spec.shuffle), "val": (spec.val_batch_size, False)}
        self.readers: Dict[str, FedShard] = {}
        for split, counts in plan.counts.items():
            shares = self._shares(counts, rank, plan.chunk)
            most = max(sum(self._shares(counts, r, plan.chunk)) for r in range(world_size))
            if not most:
                continue
            if not sum(shares):
                raise ValueError(
                    f"input_mode='stream': rank {rank} of {world_size} gets no "
                    f"{'training' if split == 'train' else 'validation'} rows: the DataFrame "
                    f"has too few rows for num_proc={world_size}; use fewer ranks or "
                    f"input_mode='store'")
            size, shuffle = options[split]
            self.readers[split] = FedShard(self, split, columns, counts, shares, most, size,
                                           shuffle, spec.seed, plan.cache_limit)
        if "train" not in self.readers:
            raise ValueError("input_mode='stream': the DataFrame reached the ranks without rows")
        for reader in self.readers.values():
            if say is not None and (rank == 0 or not reader.cached):
                held = "kept in the local cache" if reader.cached else (
                    "no room in the local cache (or over cache_limit): read again from the "
                    "DataFrame every epoch")
                say(f"{reader.split} rows: {reader.rows} on this rank "
                    f"({reader.rows * row_bytes(columns) / 2**20:.1f} MiB decoded), {held}")
        self.requested: set = set()
        self._start(all_gather)

    def _start(self, all_gather: Optional[Callable[[str], List[str]]]) -> None:
        """Listen for the feeders and agree with the other ranks on where each listens."""
        if all_gather is None:
            raise RuntimeError("rows fed beside the ranks need the ranks' all_gather")
        self.receiver = Receiver(self._on_batch, self._on_error)
        mine = {"address": self.receiver.address, "token": uuid.uuid4().hex[:12],
                "re_read": any(not r.cached for r in self.readers.values())}
        everyone = [json.loads(text) for text in all_gather(json.dumps(mine))]
        self.addresses = [e["address"] for e in everyone]
        self.token = everyone[0]["token"]
        self.re_read = any(e["re_read"] for e in everyone)

    def _shares(self, counts: List[int], rank: int, chunk: int) -> List[int]:
        """Rank ``rank``'s rows of each partition, as they are dealt (:func:`.fed_wire.share`)."""
        return [share(c, p, self.world_size, rank, chunk) for p, c in enumerate(counts)]

    def offsets(self, partition: int, index: np.ndarray) -> np.ndarray:
        """The offsets in ``partition`` of this rank's rows ``index`` of it (dealt in turns of
        ``chunk`` rows: :func:`.fed_wire.dealt`)."""
        turn, within = np.divmod(index, self.chunk)
        first = (self.rank - partition) % self.world_size
        return (first + turn * self.world_size) * self.chunk + within

    def owners(self, partition: int, offsets: np.ndarray, world_size: int) -> np.ndarray:
        """The rank each of ``partition``'s rows at ``offsets`` is dealt to."""
        return (offsets // self.chunk + partition) % world_size

    def _on_batch(self, header: Dict[str, Any], start: int, batch: Any) -> None:
        reader = self.readers.get(header.get("split", "train"))
        if reader is not None:
            reader.put(int(header["epoch"]), int(header["partition"]), start, batch)

    def _on_error(self, exc: BaseException) -> None:
        self.error = exc

    def request(self, epoch: int) -> None:
        """Ask the driver to feed ``epoch`` (rank 0 asks for all; once per epoch, and only
        the first unless a rank re-reads its rows every epoch)."""
        if epoch in self.requested or (self.requested and not self.re_read):
            return
        self.requested.add(epoch)
        if self.rank == 0 and self.folder is not None:
            self.folder.ask(self.token, epoch, self.addresses)

    def fed_all(self, epoch: int) -> bool:
        """Whether every row of ``epoch`` was sent."""
        return self.folder is not None and self.folder.done(self.token, epoch)

    def check(self) -> None:
        """Raise what went wrong with the feed, if anything did."""
        if self.error is not None:
            raise self.error
        text = self.folder.failure() if self.folder is not None else None
        if text is None:
            return
        # the DataFrame's own computation, or no slot to feed from: a new attempt of the
        # ranks would fail the same way
        raise mark_user_error(FeedFailed(
            f"input_mode='stream': feeding the rows failed on the driver's side (not "
            f"retried):\n{text}"), "the feeding job (on the driver's side)")

    def close(self) -> None:
        self.receiver.close()
        for reader in self.readers.values():
            reader.drop()


class FedShard:
    """One split of one rank's fed rows; ``epoch(epoch, skip)`` yields ``len(self)`` batches
    as :class:`~sparktrain.data.reader.ShardReader` does (see the module docstring)."""

    def __init__(self, rows_of: FedRows, split: str, columns: Sequence[ColumnSpec],
                 counts: List[int], shares: List[int], most: int, batch_size: int,
                 shuffle: bool, seed: Optional[int], cache_limit: Optional[float]) -> None:
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
