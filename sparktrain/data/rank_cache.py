"""A rank's shard kept decoded on the local disk: epochs after the first read no Parquet.

The first pass of a :class:`~sparktrain.data.reader.ShardReader` writes each row group it
decodes into one memory-mapped ``.npy`` file per column, at the rows' place in the shard; once
every row group is in, later epochs slice (or, shuffled, gather) batches from those files: no
store I/O, no decoding, and a shuffle over all the rank's rows, not only within row groups.
The page cache holds what fits in memory; the process's own memory stays bounded.

Where: the first of Spark's local directories (``SPARK_LOCAL_DIRS``, which Spark sets for its
Python workers; the temp directory elsewhere), under ``sparktrain-cache/``. Bounded: a cache
that would leave less than :data:`HEADROOM_BYTES` free on that disk, or a write that fails, is
dropped with a warning and the reader goes on reading the store, as without a cache. Removed
by :meth:`RankCache.close` (the rank loops close their readers when a fit ends or fails); a
crashed rank's cache is removed by the next cache made on that machine (its owner process is
gone).

Only fixed-shape numeric columns are cached; bytes, text, images and variable-length arrays are
read from the store every epoch.

Example::

    cache = RankCache.create(columns, rows=shard_rows)     # None: not cacheable here
    cache.write(offset, decoded_row_group)                 # first pass, every row group
    cache.batch(np.arange(0, 256))                         # later passes
    cache.close()
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
import weakref
from typing import Dict, Optional, Sequence

import numpy as np

from sparktrain.data.columns import ARRAY, SCALAR, VECTOR, ColumnSpec

log = logging.getLogger("sparktrain")

Batch = Dict[str, np.ndarray]

#: free space the cache leaves on its disk at least
HEADROOM_BYTES = 256 << 20
_OWNER = "owner"  # the pid (and its start time) of the process a cache belongs to


def cache_root() -> str:
    """``sparktrain-cache`` in the first of Spark's local directories (or the temp dir)."""
    local = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0].strip()
    return os.path.join(local or tempfile.gettempdir(), "sparktrain-cache")


def cacheable(columns: Sequence[ColumnSpec]) -> bool:
    """Every column fixed-shape and numeric (what ``.npy`` files hold without pickling)."""
    return bool(columns) and all(
        c.kind in (SCALAR, ARRAY, VECTOR) and c.dtype not in ("bytes", "str")
        and (c.kind == SCALAR or bool(c.row_shape)) for c in columns)


def row_bytes(columns: Sequence[ColumnSpec]) -> int:
    """Bytes one row of fixed-shape ``columns`` takes decoded (variable ones count as 8)."""
    total = 0
    for c in columns:
        size = np.dtype(c.dtype).itemsize if c.dtype not in ("bytes", "str") else 8
        total += int(np.prod(c.row_shape or (), dtype=np.int64)) * size
    return total


_CREATING_SECONDS = 3600.0  # a hidden folder this old was left by a process that died making it


def _start_time(pid: int) -> str:
    """The process's start time (Linux), so that a reused pid is not taken for its owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(owner: str) -> bool:
    try:
        pid, started = owner.split(":", 1)
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        return True
    return _start_time(int(pid)) == started


def remove_orphans(root: str) -> int:
    """Remove the caches under ``root`` whose process is gone; how many were removed."""
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        folder = os.path.join(root, name)
        if name.startswith("."):  # being created (owned_folder): only a stale one goes
            try:
                if time.time() - os.path.getmtime(folder) > _CREATING_SECONDS:
                    shutil.rmtree(folder, ignore_errors=True)
            except OSError:
                pass
            continue
        try:
            with open(os.path.join(folder, _OWNER)) as f:
                owner = f.read()
        except OSError:
            owner = ""  # not a cache: left alone unless clearly dead
            if not os.path.isdir(folder) or os.listdir(folder):
                continue
        if not _alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def _allocated(path: str, column: ColumnSpec, rows: int) -> np.ndarray:
    """A ``.npy`` file for ``rows`` rows of ``column``, its blocks allocated now: a write into
    a memory-mapped hole on a full disk would kill the process with SIGBUS, an allocation that
    does not fit raises ``OSError`` (ENOSPC) here instead."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(column.dtype),
                                      shape=(rows,) + tuple(column.row_shape))
    with open(path, "r+b") as f:
        os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    return array


def owned_folder(root: str) -> str:
    """A new folder under ``root`` marked as this process's (so that :func:`remove_orphans`
    removes it once the process is gone), after removing the orphans already there."""
    os.makedirs(root, exist_ok=True)
    remove_orphans(root)
    name = uuid.uuid4().hex
    # made under a hidden name and renamed once its owner is written: another process's
    # remove_orphans never sees it without an owner (it would take it for a dead one's)
    creating = os.path.join(root, f".{name}")
    os.makedirs(creating)
    with open(os.path.join(creating, _OWNER), "w") as f:
        f.write(f"{os.getpid()}:{_start_time(os.getpid())}")
    folder = os.path.join(root, name)
    os.rename(creating, folder)
    return folder


class RankCache:
    """One split's shard of one rank on the local disk; see the module docstring."""

    def __init__(self, folder: str, arrays: Dict[str, np.ndarray], rows: int) -> None:
        self.folder = folder
        self.arrays = arrays
        self.rows = rows
        self._finalizer = weakref.finalize(self, shutil.rmtree, folder, True)

    @classmethod
    def create(cls, columns: Sequence[ColumnSpec], rows: int, root: Optional[str] = None,
               label: str = "", quiet: bool = False) -> Optional["RankCache"]:
        """A cache of ``rows`` rows of ``columns``, or ``None`` (with a warning where the disk
        lacks room, an info line when ``quiet``) when there is none to make."""
        if rows < 1 or not cacheable(columns):
            return None
        root = root or cache_root()
        need = rows * row_bytes(columns)
        try:
            os.makedirs(root, exist_ok=True)
            free = shutil.disk_usage(root).free
        except OSError as exc:
            log.warning("no local cache for %s (%s): every epoch reads the store", label, exc)
            return None
        if free - need < HEADROOM_BYTES:
            say = log.info if quiet else log.warning
            say("no local cache for %s: it needs %.1f MiB and %s has %.1f MiB free (%d MiB "
                "kept free); every epoch reads the rows again", label, need / 2**20, root,
                free / 2**20, HEADROOM_BYTES >> 20)
            return None
        folder = None
        try:
            folder = owned_folder(root)
            arrays = {c.name: _allocated(os.path.join(folder, f"{i}.npy"), c, rows)
                      for i, c in enumerate(columns)}
        except OSError as exc:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            log.warning("no local cache for %s (%s): every epoch reads the store", label, exc)
            return None
        return cls(folder, arrays, rows)

    def write(self, offset: int, chunk: Batch) -> bool:
        """Store ``chunk`` at shard rows ``offset:``; ``False`` (cache dropped, with a warning)
        when the disk refuses it."""
        rows = len(next(iter(chunk.values())))
        try:
            for name, array in self.arrays.items():
                array[offset:offset + rows] = chunk[name]
        except OSError as exc:  # e.g. ENOSPC on a sparse file's first touch
            log.warning("local cache dropped (%s): every epoch reads the store", exc)
            self.close()
            return False
        return True

    def batch(self, rows: np.ndarray) -> Batch:
        """The shard rows ``rows`` (sorted for the page cache's sake) as fresh arrays."""
        return {name: np.take(array, rows, axis=0) for name, array in self.arrays.items()}

    def slice(self, start: int, stop: int) -> Batch:
        return {name: np.array(array[start:stop]) for name, array in self.arrays.items()}

    def close(self) -> None:
        """Remove the cache's files."""
        self.arrays = {}
        self._finalizer()


def disk_full(folder: str, doing: str, exc: OSError) -> BaseException:
    """The named, not-retried error for a full local disk while ``doing``."""
    from sparktrain.errors import LocalDiskFullError
    from sparktrain.faults import mark_user_error

    disk = os.path.dirname(os.path.dirname(folder))
    try:
        free = f"{shutil.disk_usage(disk).free / 2**20:.0f} MiB free now"
    except OSError:
        free = "its free space unknown"
    return mark_user_error(LocalDiskFullError(
        f"input_mode='stream': the local disk {disk} (Spark's local directory, "
        f"SPARK_LOCAL_DIRS / spark.local.dir) ran out of space {doing} ({exc.strerror or exc}; "
        f"{free}). Where every task slot trains a rank, each rank keeps its whole shard there "
        f"before its first step. Leave task slots free beside the ranks (more executor cores "
        f"than num_proc: later epochs then read the DataFrame again instead of keeping it), "
        f"point SPARK_LOCAL_DIRS at a bigger disk, or use input_mode='store'.", disk),
        "the local disk")
