"""Which rows of an epoch were trained, by where they came from, for an exact resume.

A row of a streamed split is identified by its input partition and its offset there: its
global number is the partition's first (the counts of the partitions before it) plus the
offset, whatever the world size that dealt it. Rows fed beside the ranks are numbered so by
the feeders (the partitions counted first); rows shuffled into the training stage carry
Spark's ``monotonically_increasing_id`` (partition and offset in one ``long``) through the
shuffle, and the ranks agree on every partition's extent (:class:`RowNumbering`).

An epoch's position is the set of rows it has trained, a bitmap over those numbers (one bit
a row: 2 MiB at 16M rows); each rank writes its own at a checkpoint inside an epoch, and a
resumed epoch, with the same ranks or others, trains exactly the rows that none of them had
(Mosaic Streaming keeps its position by sample the same way, as one state with the seed and
epoch).

Example::

    done = TrainedRows(1000)
    done.add(np.array([3, 4, 5]))
    TrainedRows.union([done.to_bytes()]).count()      # 3
"""
from __future__ import annotations

import struct
import threading
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

_HEADER = struct.Struct("<Q")  # the rows the bitmap covers
#: a streamed row's identity beside its columns: fed chunks' global row numbers; shuffled
#: rows' ``monotonically_increasing_id``
ROW_ID = "__sparktrain_row__"


class TrainedRows:
    """A set of global row numbers below ``rows``, as a bitmap."""

    def __init__(self, rows: int, mask: Optional[np.ndarray] = None) -> None:
        self.rows = rows
        self.mask = np.zeros(rows, bool) if mask is None else mask

    def add(self, numbers: np.ndarray) -> None:
        self.mask[numbers] = True

    def count(self) -> int:
        return int(self.mask.sum())

    def copy(self) -> "TrainedRows":
        return TrainedRows(self.rows, self.mask.copy())

    def to_bytes(self) -> bytes:
        return _HEADER.pack(self.rows) + np.packbits(self.mask).tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "TrainedRows":
        (rows,) = _HEADER.unpack_from(blob)
        bits = np.frombuffer(blob, np.uint8, offset=_HEADER.size)
        return cls(rows, np.unpackbits(bits, count=rows).astype(bool))

    @classmethod
    def union(cls, blobs: Iterable[bytes]) -> "TrainedRows":
        """The rows any of the bitmaps ``blobs`` holds (every rank's, at one checkpoint)."""
        found: Optional[TrainedRows] = None
        for blob in blobs:
            one = cls.from_bytes(blob)
            if found is None:
                found = one
            elif one.rows != found.rows:
                raise ValueError(f"positions over {found.rows} and {one.rows} rows: the rows "
                                 f"of the DataFrame changed since the checkpoint")
            else:
                found.mask |= one.mask
        if found is None:
            raise ValueError("no position to join")
        return found


#: ``monotonically_increasing_id``: the partition in the upper 31 bits, the offset in the lower
#: 33 (Spark's documented layout)
OFFSET_BITS = 33


class RowNumbering:
    """Global row numbers from Spark's ``monotonically_increasing_id`` values, given every
    input partition's extent (the most offset seen there, plus one, across the ranks).

    Example::

        numbering = RowNumbering.from_extents({0: 10, 2: 5})
        numbering.rows                                   # 15
        numbering.numbers(np.array([(2 << 33) + 1]))     # array([11])
    """

    def __init__(self, partitions: np.ndarray, firsts: np.ndarray, rows: int) -> None:
        self.partitions, self.firsts, self.rows = partitions, firsts, rows

    @classmethod
    def from_extents(cls, extents: Dict[int, int]) -> "RowNumbering":
        partitions = np.array(sorted(extents), np.int64)
        sizes = np.array([extents[p] for p in partitions.tolist()], np.int64)
        firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return cls(partitions, firsts, int(sizes.sum()))

    def numbers(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        where = np.searchsorted(self.partitions, ids >> OFFSET_BITS)
        return self.firsts[where] + (ids & ((1 << OFFSET_BITS) - 1))


def id_extents(ids: np.ndarray) -> Dict[int, int]:
    """``{partition: most offset + 1}`` of ``monotonically_increasing_id`` values."""
    ids = np.asarray(ids, np.int64)
    if not len(ids):
        return {}
    partitions = ids >> OFFSET_BITS
    offsets = ids & ((1 << OFFSET_BITS) - 1)
    found: Dict[int, int] = {}
    for partition in np.unique(partitions).tolist():
        found[int(partition)] = int(offsets[partitions == partition].max()) + 1
    return found


def merged_extents(many: Iterable[Dict[Any, int]]) -> Dict[int, int]:
    """The extents of several sources (JSON keys are strings) joined: the largest each."""
    joined: Dict[int, int] = {}
    for extents in many:
        for partition, extent in extents.items():
            joined[int(partition)] = max(joined.get(int(partition), 0), int(extent))
    return joined


class EpochTrack:
    """The rows one rank's reader hands out in an epoch, batch by batch, and its position at
    a checkpoint (:meth:`position`): the resumed set plus the batches trained since, folded
    into one bitmap as checkpoints are written (batches read ahead are kept apart)."""

    def __init__(self, rows: int, first: int, done: Optional[TrainedRows]) -> None:
        self.done = done.copy() if done is not None else TrainedRows(rows)
        self.first = first  # the batch number of the first batch handed out
        self.pending: List[np.ndarray] = []
        self.lock = threading.Lock()  # handed out on the reader's thread, read on the loop's

    def handed_out(self, numbers: np.ndarray) -> None:
        with self.lock:
            self.pending.append(np.asarray(numbers, np.int64))

    def position(self, batches_done: int) -> bytes:
        """The rows of the epoch's first ``batches_done`` batches, as bytes."""
        with self.lock:
            take = max(0, min(batches_done - self.first, len(self.pending)))
            for numbers in self.pending[:take]:
                self.done.add(numbers)
            del self.pending[:take]
            self.first += take
            return self.done.to_bytes()
