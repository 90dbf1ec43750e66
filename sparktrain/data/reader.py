"""Read one rank's shard of a materialized dataset as numpy batches, fast and in bounded memory.

Sharding is by contiguous row ranges, not by files: rank ``r`` of ``W`` reads global rows
``[r*N//W, (r+1)*N//W)`` whatever the number of files or row groups, so shards differ by at most
one row. Every rank yields the same number of batches of the same sizes, which is what keeps
collective ops from hanging: a rank one row short of the largest shard (or, with more ranks than
rows, with an empty range) also reads the row just after its range (wrapping to row 0), so at
most ``W - 1`` rows are read twice per epoch, never twice by the same rank.

Batches are column-major numpy arrays sliced from whole row groups: a row group is decoded in
record batches of a few MB into one array per column (list columns flattened and reshaped, no
per-row loop), so a batch costs a slice (with ``shuffle``, a gather of the batch's rows).
Memory is bounded by row groups, not by the dataset: ``prefetch`` decoded row groups wait in a
queue while one is being read and one consumed; rows left over between row groups (fewer than a
batch) are copied out so the group can be freed. ``inmemory_cache_all=True`` instead keeps the
whole decoded shard after its first read (Horovod's parameter of that name); ``local_cache=True``
keeps it on the local disk instead (:mod:`sparktrain.data.rank_cache`): later epochs read
neither the store nor Parquet, and shuffle over all the shard's rows.

Example::

    reader = ShardReader(ds.root, ds.files["train"], ds.columns, rank=0, world_size=2,
                         batch_size=256, shuffle=True, seed=7)
    for epoch in range(3):
        for batch in reader.epoch(epoch):
            batch["features"].shape   # (256, 32)
"""
from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparktrain.data.background import in_background
from sparktrain.data.batch import arrow_to_numpy
from sparktrain.data.columns import ColumnSpec
from sparktrain.data.rank_cache import RankCache
from sparktrain.fs import filesystem
from sparktrain.options.spec import LoopSpec

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
    """Batches of one rank's shard of one split; see the module docstring.

    ``inmemory_cache_all=True`` keeps the decoded shard in memory once an epoch has read it, so
    later epochs read no files (memory then grows with the shard: about its uncompressed size).
    Otherwise memory is bounded by ``prefetch + 2`` row groups, whatever the dataset size.
    At most ``open_files`` Parquet files stay open (least recently used are closed; their
    footers are kept, so reopening one reads no footer).
    """

    def __init__(self, root: str, layout: Sequence[Sequence], columns: Sequence[ColumnSpec],
                 rank: int, world_size: int, batch_size: int, shuffle: bool = False,
                 seed: Optional[int] = None, storage_options: Optional[Dict[str, Any]] = None,
                 prefetch: int = 2, inmemory_cache_all: bool = False,
                 open_files: int = 4, local_cache: bool = False,
                 cache_root: Optional[str] = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}; expected 0 <= rank < "
                             f"world_size")
        self.root = root.rstrip("/")
        self.layout = [list(item) for item in layout]
        self.columns = list(columns)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = 0 if seed is None else seed
        self.rank = rank
        self.prefetch = prefetch
        self.inmemory_cache_all = inmemory_cache_all
        self.open_files = max(1, open_files)
        self._storage_options = storage_options
        self._handles: "OrderedDict[int, Tuple[Any, Any]]" = OrderedDict()  # file -> (pq, source)
        self._footers: Dict[int, Any] = {}  # file -> FileMetaData (a few KB each)
        self._cache: Dict[int, Batch] = {}  # piece index -> decoded rows (inmemory_cache_all)
        # the shard on the local disk (local_cache): made at the first read, complete once every
        # piece is in it
        self._local: Optional[RankCache] = None
        self._local_wanted = local_cache and not inmemory_cache_all
        self._cache_root = cache_root
        self._in_local: set = set()  # pieces written to the local cache
        self.order: Optional[str] = None  # the last epoch's: "cache" or "files" (see epoch)

        total = sum(sum(groups) for _, groups in self.layout)
        if total == 0:
            raise ValueError(f"dataset {root} has no rows")
        start, end = shard_range(total, rank, world_size)
        self.rows_per_epoch = math.ceil(total / world_size)
        self.steps = steps_per_epoch(total, world_size, batch_size)
        self.pieces = shard_pieces(self.layout, start, end)
        if end - start < self.rows_per_epoch:  # one row short (or empty): borrow one row,
            extra = end % total  # the next range's first, so no rank sees a row twice
            self.pieces += shard_pieces(self.layout, extra, extra + 1)
        sizes = [p.hi - p.lo for p in self.pieces]
        self._offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]  # piece -> shard row
        self.shard_rows = sum(sizes)

    @property
    def local_cache_complete(self) -> bool:
        """True once later epochs read the local cache only."""
        return self._local is not None and len(self._in_local) == len(self.pieces)

    def __len__(self) -> int:
        return self.steps

    def epoch(self, epoch: int = 0, skip: int = 0, order: Optional[str] = None,
              trained: Optional[bytes] = None) -> Iterator[Batch]:
        """The ``self.steps`` batches of ``epoch`` (shuffled per epoch when ``shuffle``):
        ``steps - 1`` batches of ``batch_size`` rows, then the rest of the shard.

        ``skip``: leave out the first ``skip`` batches (an epoch resumed after them); the
        others are exactly those of the whole epoch. Row groups wholly inside the skipped
        batches are not read. ``order``: how the epoch being resumed ordered its rows
        (``ShardReader.order`` when it was written): ``"cache"`` (a shuffle over the whole
        shard, once the local cache is complete) fills the local cache first when it is not
        complete yet; ``"files"`` reads the files even when it is. Sets ``ShardReader.order``.

        Example::

            rest = list(reader.epoch(2, skip=40, order="files"))   # batches 40.. of epoch 2
        """
        rng = np.random.default_rng([self.seed, epoch, self.rank]) if self.shuffle else None
        if skip and order == "cache" and not self.local_cache_complete:
            self._fill_local_cache()
        if self.local_cache_complete and order != "files":
            self.order = "cache"
            yield from self._cached_epoch(rng, skip)
            return
        self.order = "files"
        if self._local_wanted and self._local is None:
            self._local_wanted = False  # one try per reader
            self._local = RankCache.create(self.columns, self.shard_rows, self._cache_root,
                                           label=f"rank {self.rank}'s shard")
        order_ = list(range(len(self.pieces)))
        if rng is not None:
            order_ = [order_[i] for i in rng.permutation(len(order_))]
        size = self.batch_size
        # the skipped rows: whole pieces left unread (their permutations drawn all the same,
        # so that the rest are shuffled as in the whole epoch), then `start` rows of the next
        skipped, start = skip * size, 0
        while skipped and order_:
            rows = self.pieces[order_[0]].hi - self.pieces[order_[0]].lo
            if rows > skipped:
                start = skipped
                break
            if rng is not None:
                rng.permutation(rows)
            skipped -= rows
            order_.pop(0)
        carry: List[Batch] = []  # rows left over from earlier chunks (fewer than a batch)
        carry_rows = 0
        chunks = self._chunks(order_)
        batch: Optional[Batch]  # dropped once yielded
        while True:
            chunk = None  # let the previous row group go before waiting for the next one
            chunk = next(chunks, None)
            if chunk is None:
                break
            rows = _rows(chunk)
            index = rng.permutation(rows) if rng is not None else None
            offset, start = start, 0
            if carry_rows:
                offset = min(size - carry_rows, rows)
                carry.append(_part(chunk, index, 0, offset))
                carry_rows += offset
                if carry_rows < size:
                    continue
                yield _concat(carry)
                carry, carry_rows = [], 0
            while rows - offset >= size:
                batch = _part(chunk, index, offset, offset + size)
                # Views are copied where they would outlive their use: views of the cache (a
                # model may write to its input), and the chunk's last batch, which the caller
                # holds while the next chunk is awaited (so the group can go before that).
                if index is None and (self.inmemory_cache_all or rows - offset < 2 * size):
                    batch = {k: v.copy() for k, v in batch.items()}
                yield batch
                batch = None
                offset += size
            if offset < rows:  # a copy, so that the chunk's buffers can go
                carry = [{k: v.copy() for k, v in _part(chunk, index, offset, rows).items()}]
                carry_rows = rows - offset
        if carry_rows:  # the last, short batch
            yield _concat(carry)

    def _cached_epoch(self, rng: Optional[np.random.Generator], skip: int = 0
                      ) -> Iterator[Batch]:
        """An epoch from the local cache: batches of rows drawn over the whole shard, gathered
        ``GATHER_BATCHES`` at a time in a background thread (``np.take`` and copies release the
        GIL), so that the gathers overlap the caller's steps; the first ``skip`` left out."""
        self._close_files()  # no file is read again
        size, rows = self.batch_size, self.shard_rows
        order = rng.permutation(rows) if rng is not None else None
        group = size * GATHER_BATCHES

        def groups() -> Iterator[List[Batch]]:
            for start in range(min(skip * size, rows), rows, group):
                stop = min(start + group, rows)
                local = self._local
                if local is None:
                    raise RuntimeError("ShardReader: closed during an epoch read from its local "
                                       "cache")
                if order is None:
                    batch = local.slice(start, stop)
                else:  # each batch's rows sorted (file order touches fewer pages; a batch is a
                    # set anyway), gathered in one call
                    batch = local.batch(np.concatenate(
                        [np.sort(order[i:min(i + size, stop)]) for i in range(start, stop, size)]))
                yield [_part(batch, None, i, min(i + size, stop - start))
                       for i in range(0, stop - start, size)]

        for batches in in_background(groups(), self.prefetch):
            yield from batches

    def _fill_local_cache(self) -> None:
        """Read every piece not yet in the local cache into it (made here if need be): a
        resumed epoch that shuffled over the cached shard shuffles alike. Without room for the
        cache, the epoch reads the files (in their order: not the same rows)."""
        if self._local is None and self._local_wanted:
            self._local_wanted = False
            self._local = RankCache.create(self.columns, self.shard_rows, self._cache_root,
                                           label=f"rank {self.rank}'s shard")
        if self._local is None:
            return
        missing = [i for i in range(len(self.pieces)) if i not in self._in_local]
        for _ in in_background((self._load(i) for i in missing), self.prefetch):
            pass

    def _chunks(self, order: List[int]) -> Iterator[Batch]:
        if self.inmemory_cache_all and len(self._cache) == len(self.pieces):
            self._close_files()  # the whole shard is in memory: no file is read again
            return (self._cache[i] for i in order)
        return self._prefetched(order)

    def _prefetched(self, order: List[int]) -> Iterator[Batch]:
        """Read pieces in a background thread (pyarrow releases the GIL) ``prefetch`` ahead."""
        return in_background((self._load(i) for i in order), self.prefetch)

    def _load(self, index: int) -> Batch:
        """Piece ``index`` decoded: from the in-memory cache, or read (and then cached when
        ``inmemory_cache_all``)."""
        chunk = self._cache.get(index)
        if chunk is None:
            chunk = self._read(self.pieces[index])
            if self.inmemory_cache_all:
                self._cache[index] = chunk
            local = self._local
            if local is not None and index not in self._in_local:
                if local.write(self._offsets[index], chunk):
                    self._in_local.add(index)
                else:
                    self._local, self._in_local = None, set()
        return chunk

    def _read(self, piece: Piece) -> Batch:
        """Rows ``[lo, hi)`` of one row group as one numpy array per column.

        The group is decoded in record batches of about ``READ_BYTES`` and copied into arrays
        allocated once: decoding a whole row group at once would hold its raw column chunks,
        repetition/definition levels and growing value buffers besides the result (measured:
        about 3x the group's size at its peak, against 1.1x this way, at the same speed).
        """
        rows = piece.hi - piece.lo
        out: Batch = {}
        offset = filled = 0  # row of the group where `batch` starts; rows written to `out`
        # use_threads=False: decoding columns on Arrow's thread pool gains nothing here (one
        # wide column dominates) and costs a jemalloc arena per thread (measured: +20-30 MiB RSS)
        handle = self._handle(piece.file)
        # rows per record batch from the group's decoded size: bytes and strings vary a lot
        meta = handle.metadata.row_group(piece.group)
        row_bytes = max(1, meta.total_byte_size // max(1, meta.num_rows))
        batches = handle.iter_batches(
            batch_size=max(16, READ_BYTES // row_bytes), row_groups=[piece.group],
            columns=[c.name for c in self.columns], use_threads=False)
        for batch in batches:
            lo, hi = max(piece.lo - offset, 0), min(piece.hi - offset, batch.num_rows)
            offset += batch.num_rows
            if lo < hi:
                if lo or hi < batch.num_rows:
                    batch = batch.slice(lo, hi - lo)
                for spec in self.columns:
                    values = column_to_numpy(batch.column(spec.name), spec)
                    if spec.name not in out:
                        out[spec.name] = _empty((rows,) + values.shape[1:], values.dtype)
                    out[spec.name][filled:filled + len(values)] = values
                filled += hi - lo
            if offset >= piece.hi:
                break
        if filled != rows:
            raise ValueError(f"{self.layout[piece.file][0]}: row group {piece.group} has "
                             f"{offset} rows, expected at least {piece.hi} (the dataset changed "
                             f"after it was materialized?)")
        return out

    def _handle(self, file: int) -> Any:
        """An open ``ParquetFile`` for file number ``file``; at most ``open_files`` stay open.

        Local files are opened by pyarrow itself (reads land in Arrow's memory pool); others
        through fsspec. Column chunks are read in ``READ_BUFFER`` pieces, not whole.
        """
        import pyarrow.parquet as pq

        entry = self._handles.get(file)
        if entry is not None:
            self._handles.move_to_end(file)
            return entry[0]
        fs, inner = filesystem(f"{self.root}/{self.layout[file][0]}", self._storage_options)
        source = inner if _is_local(fs) else fs.open(inner, "rb")
        try:
            handle = pq.ParquetFile(source, metadata=self._footers.get(file),
                                    buffer_size=READ_BUFFER)
        except BaseException:
            if not isinstance(source, str):
                source.close()
            raise
        self._footers[file] = handle.metadata
        self._handles[file] = (handle, source)
        while len(self._handles) > self.open_files:
            _close(*self._handles.popitem(last=False)[1])
        return handle

    def position(self, batches_done: int) -> Optional[bytes]:
        """None: a shard's order is a pure function of the seed, the epoch and the rank, so
        ``skip`` and ``order`` resume it exactly with as many ranks."""
        return None

    def resume_at(self, epoch: int, trained: bytes) -> None:
        """Nothing to know ahead: resumed by its skip."""

    def resumed_steps(self, trained: bytes) -> int:
        raise ValueError("a store shard resumes by its skip and order, not by rows")

    def close(self) -> None:
        """Close open files, drop the in-memory cache and remove the local one."""
        self._close_files()
        self._cache.clear()
        if self._local is not None:
            self._local.close()
            self._local, self._in_local = None, set()

    def _close_files(self) -> None:
        while self._handles:
            _close(*self._handles.popitem()[1])


READ_BUFFER = 1 << 20  # bytes per read while decoding a column chunk
READ_BYTES = 4 << 20  # decoded bytes per record batch while reading a row group
GATHER_BATCHES = 8  # batches gathered from the local cache per call of the background thread
# (one call per batch costs a queue hand-off per batch; 1, 8 and 32 measured alike on 2 cores)


MMAP_BYTES = 1 << 20  # arrays at least this large get pages of their own


def _empty(shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.empty``, but a large array is an anonymous mapping of its own, unmapped (given back
    to the OS) as soon as the array is dropped.

    Row groups are about 32 MB (``materialize.ROW_GROUP_BYTES``): just under glibc's largest
    mmap threshold, so after the first one is freed ``malloc`` serves them from its heap, which
    keeps up to 2x that threshold of freed memory untrimmed and fragments as group sizes vary
    (measured: the reader's peak RSS grew from +146 MiB at 1M rows to +160-190 MiB at 4M; with
    this, +136 and +145, and RSS falls back after the epoch).
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < MMAP_BYTES or np.dtype(dtype).hasobject:  # object pointers live on the heap
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _close(handle: Any, source: Any) -> None:
    handle.close(force=True)
    if not isinstance(source, str):
        source.close()


def shard_readers(spec: LoopSpec, rank: int, world_size: int) -> Dict[str, ShardReader]:
    """This rank's shard of each split of ``spec``'s dataset, as every rank loop reads it:
    ``"train"``, and ``"val"`` when the fit has validation data (never shuffled); kept in a
    local cache when the fit reads it more than once. Close them when done."""
    columns = [ColumnSpec.from_json(c) for c in spec.columns]
    splits = [("train", spec.batch_size, spec.shuffle, spec.train_prefetch)]
    if spec.rows.layouts.get("val"):
        splits.append(("val", spec.val_batch_size, False, spec.val_prefetch))
    plan = spec.rows
    return {split: ShardReader(plan.root, plan.layouts[split], columns, rank, world_size,
                               batch_size, shuffle, spec.seed, spec.storage_options,
                               prefetch=prefetch, inmemory_cache_all=spec.inmemory_cache_all,
                               local_cache=spec.epochs > 1)
            for split, batch_size, shuffle, prefetch in splits}


def column_to_numpy(column: Any, spec: ColumnSpec) -> np.ndarray:
    """A pyarrow (chunked) column in its numpy form (:func:`sparktrain.data.batch.
    arrow_to_numpy`): ``(rows,)`` for scalars, ``(rows, d1, ...)`` for fixed-shape arrays,
    object arrays for bytes, strings, images and variable-length arrays."""
    return arrow_to_numpy(column, spec)


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _part(batch: Batch, index: Optional[np.ndarray], start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of ``batch`` (a view), or of its permutation ``index`` (a copy)."""
    if index is None:
        return {k: v[start:stop] for k, v in batch.items()}
    rows = index[start:stop]
    return {k: v[rows] for k, v in batch.items()}


def _concat(parts: List[Batch]) -> Batch:
    parts = [p for p in parts if _rows(p)]
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
