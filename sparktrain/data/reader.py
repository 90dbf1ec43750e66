"""Read one rank's shard of a materialized dataset as numpy batches, fast and in bounded memory.

Sharding is by contiguous row ranges, not by files: rank ``r`` of ``W`` reads global rows
``[r*N//W, (r+1)*N//W)`` whatever the number of files or row groups, so shards differ by at most
one row. Every rank yields the same number of batches of the same sizes (a rank one row short
repeats the first row of its range), which is what keeps collective ops from hanging.

Batches are column-major numpy arrays sliced from whole row groups: list columns are flattened
once per row group (zero copy) and reshaped, so a batch costs a slice, not a per-row loop.
At most ``prefetch`` row groups are in memory beside the one being consumed.

Example::

    reader = ShardReader(ds.root, ds.files["train"], ds.columns, rank=0, world_size=2,
                         batch_size=256, shuffle=True, seed=7)
    for epoch in range(3):
        for batch in reader.epoch(epoch):
            batch["features"].shape   # (256, 32)
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparktrain.data.schema import SCALAR, ColumnSpec
from sparktrain.data.store import filesystem

Batch = Dict[str, np.ndarray]


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of row group ``group`` of file number ``file``."""

    file: int
    group: int
    lo: int
    hi: int


def shard_range(total_rows: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Global row range ``[start, end)`` of ``rank``: balanced to within one row."""
    return rank * total_rows // world_size, (rank + 1) * total_rows // world_size


def steps_per_epoch(total_rows: int, world_size: int, batch_size: int) -> int:
    """Batches every rank yields per epoch (the largest shard, rounded up)."""
    return max(1, math.ceil(math.ceil(total_rows / world_size) / batch_size))


def shard_pieces(layout: Sequence[Sequence], start: int, end: int) -> List[Piece]:
    """The row-group slices covering global rows ``[start, end)`` of ``layout``
    (``[[file, [rows per row group]], ...]``)."""
    pieces, offset = [], 0
    for file_index, (_, groups) in enumerate(layout):
        for group_index, rows in enumerate(groups):
            lo, hi = max(start, offset), min(end, offset + rows)
            if lo < hi:
                pieces.append(Piece(file_index, group_index, lo - offset, hi - offset))
            offset += rows
    return pieces


class ShardReader:
    """Batches of one rank's shard of one split; see the module docstring."""

    def __init__(self, root: str, layout: Sequence[Sequence], columns: Sequence[ColumnSpec],
                 rank: int, world_size: int, batch_size: int, shuffle: bool = False,
                 seed: Optional[int] = None, storage_options: Optional[Dict[str, Any]] = None,
                 prefetch: int = 2) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.root = root.rstrip("/")
        self.layout = [list(item) for item in layout]
        self.columns = list(columns)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = 0 if seed is None else seed
        self.rank = rank
        self.prefetch = prefetch
        self._storage_options = storage_options
        self._files: Dict[int, Any] = {}

        total = sum(sum(groups) for _, groups in self.layout)
        if total == 0:
            raise ValueError(f"dataset {root} has no rows")
        start, end = shard_range(total, rank, world_size)
        self.rows_per_epoch = math.ceil(total / world_size)
        self.steps = steps_per_epoch(total, world_size, batch_size)
        self.pieces = shard_pieces(self.layout, start, end)
        if end - start < self.rows_per_epoch:  # one row short: repeat the range's first row
            first = start % total
            self.pieces += shard_pieces(self.layout, first, first + 1)

    def __len__(self) -> int:
        return self.steps

    def epoch(self, epoch: int = 0) -> Iterator[Batch]:
        """The ``self.steps`` batches of ``epoch`` (shuffled per epoch when ``shuffle``)."""
        rng = np.random.default_rng([self.seed, epoch, self.rank]) if self.shuffle else None
        order = list(self.pieces)
        if rng is not None:
            order = [order[i] for i in rng.permutation(len(order))]
        pending: List[Batch] = []
        pending_rows = 0
        emitted = 0
        for chunk in self._prefetched(order):
            if rng is not None:
                chunk = _take(chunk, rng.permutation(_rows(chunk)))
            pending.append(chunk)
            pending_rows += _rows(chunk)
            if pending_rows < self.batch_size:
                continue
            data = _concat(pending)
            offset = 0
            while pending_rows - offset >= self.batch_size and emitted < self.steps - 1:
                yield {k: v[offset:offset + self.batch_size] for k, v in data.items()}
                offset += self.batch_size
                emitted += 1
            pending = [{k: v[offset:] for k, v in data.items()}]
            pending_rows -= offset
        if emitted < self.steps:  # the last (possibly short) batch
            yield _concat(pending)

    def _prefetched(self, order: List[Piece]) -> Iterator[Batch]:
        """Read pieces in a background thread (pyarrow releases the GIL) ``prefetch`` ahead."""
        if self.prefetch <= 0:
            yield from (self._read(p) for p in order)
            return
        slots: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for piece in order:
                    if stop.is_set():
                        return
                    slots.put(self._read(piece))
                slots.put(None)
            except BaseException as exc:  # handed to the consumer, raised there
                slots.put(exc)

        thread = threading.Thread(target=produce, name="sparktrain-reader", daemon=True)
        thread.start()
        try:
            while True:
                item = slots.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    slots.get_nowait()
                except queue.Empty:
                    thread.join(0.01)

    def _read(self, piece: Piece) -> Batch:
        import pyarrow.parquet as pq

        handle = self._files.get(piece.file)
        if handle is None:
            path = f"{self.root}/{self.layout[piece.file][0]}"
            fs, inner = filesystem(path, self._storage_options)
            handle = self._files[piece.file] = pq.ParquetFile(fs.open(inner, "rb"))
        table = handle.read_row_group(piece.group, columns=[c.name for c in self.columns])
        table = table.slice(piece.lo, piece.hi - piece.lo)
        return {c.name: column_to_numpy(table.column(c.name), c) for c in self.columns}

    def close(self) -> None:
        self._files.clear()


def column_to_numpy(column: Any, spec: ColumnSpec) -> np.ndarray:
    """A pyarrow (chunked) column as a numpy array: ``(rows,)`` for scalars, ``(rows, size)``
    for fixed-length lists; zero copy when the data is in one chunk."""
    array = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if spec.kind == SCALAR:
        return array.to_numpy(zero_copy_only=False)
    values = array.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(array), spec.size)


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _take(batch: Batch, index: np.ndarray) -> Batch:
    return {k: v[index] for k, v in batch.items()}


def _concat(parts: List[Batch]) -> Batch:
    parts = [p for p in parts if _rows(p)]
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
