"""The commit protocol of a materialized dataset: readers only ever see complete datasets.

Layout of one dataset (``<store>/datasets/<key>``)::

    _leases/<time>-<id>.json    a writer at work (see :mod:`sparktrain.data.lease`)
    attempts/<id>/split=.../    one writer's Parquet files (Spark's output)
    _commits/<time>-<id>.json   written last: names attempt <id>, its columns, rows and files

Why this protocol: object stores (S3, GCS, ABFS, DBFS) have no atomic rename and no
"create if absent" that fsspec exposes everywhere, so the dataset cannot be published by
renaming a directory, and two writers cannot agree through one shared file. Instead every
writer writes into its **own attempt directory** and publishes it with a **commit file of
its own** (a new name: nothing is ever overwritten, and one small PUT is atomic on every
store). A reader follows the earliest commit whose attempt directory exists and never looks
at uncommitted attempts, so a half-written dataset is never read, whoever crashed.

Chosen over "first writer wins, others write anyway": a **lease** makes a second writer of
the same key (``CrossValidator(parallelism=2)`` fitting one fold twice, two notebooks) wait
for the first and reuse its commit instead of writing the data again. The lease expires
when its writer dies (``ttl`` seconds without renewal, or at once when the writer was a
process on this host that no longer exists), and the waiter then writes its own attempt.
Two writers taking their leases at the same moment agree on which one is first (tickets,
see :mod:`sparktrain.data.lease`). Correctness does not rest on the lease: if two writers
both believe they hold it (a writer stalled for longer than ``ttl``, clocks that disagree by
more than that across drivers), both commit complete attempts and readers agree on the
earliest commit; a committed attempt is never deleted (a reader may be using it).

Garbage: attempts with neither a commit nor a live lease (a killed driver's, a failed
write's) are removed by the next writer or reader of the same key.
"""
from __future__ import annotations

import json
import logging
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

from sparktrain.data.lease import live_leases, remove_dead_leases
from sparktrain.fs import list_json, put_file, read_json

log = logging.getLogger(__name__)

ATTEMPTS = "attempts"
COMMITS = "_commits"
LEASES = "_leases"


@dataclass
class Commit:
    """A committed attempt: its id and the metadata its writer recorded."""

    attempt: str
    meta: Dict[str, Any]


class DatasetDirectory:
    """One dataset key's directory in the store, seen through the commit protocol.

    ``fs`` is the store's fsspec filesystem, ``base`` the directory as ``fs`` names it
    (without protocol).

    Example::

        directory = DatasetDirectory(fs, "/tmp/st/datasets/ab12")
        found = directory.committed()      # None, or Commit(attempt, meta)
        directory.commit("f00d", {"rows": {"train": 10}})
    """

    def __init__(self, fs: Any, base: str) -> None:
        self.fs = fs
        self.base = base.rstrip("/")

    @property
    def leases(self) -> str:
        return f"{self.base}/{LEASES}"

    def attempt_path(self, attempt: str) -> str:
        return f"{self.base}/{ATTEMPTS}/{attempt}"

    def _commits(self) -> List[Commit]:
        found = []
        for path in list_json(self.fs, f"{self.base}/{COMMITS}"):
            data = read_json(self.fs, path)
            if data is not None and isinstance(data.get("attempt"), str) and \
                    isinstance(data.get("meta"), dict):
                found.append(Commit(data["attempt"], data["meta"]))
        return found

    def committed(self) -> Optional[Commit]:
        """The earliest commit whose attempt is still there, or ``None``."""
        for commit in self._commits():
            if self.fs.exists(self.attempt_path(commit.attempt)):
                return commit
        return None

    def commit(self, attempt: str, meta: Dict[str, Any]) -> None:
        """Publish ``attempt`` (complete, its files listed in ``meta``): the last write."""
        name = f"{int(time.time() * 1e6):017d}-{attempt}.json"
        put_file(self.fs, f"{self.base}/{COMMITS}/{name}",
                 json.dumps({"attempt": attempt, "meta": meta}).encode())

    def remove_attempt(self, attempt: str) -> None:
        try:
            self.fs.rm(self.attempt_path(attempt), recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def collect_garbage(self) -> List[str]:
        """Remove attempts that are neither committed nor being written; returns their ids."""
        try:
            self.fs.invalidate_cache(f"{self.base}/{ATTEMPTS}")
            attempts = [posixpath.basename(p.rstrip("/"))
                        for p in self.fs.ls(f"{self.base}/{ATTEMPTS}", detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        # leases before commits: a writer commits, then releases its lease, so an attempt
        # whose lease is gone by the first listing has its commit in the second
        keep: Set[str] = {lease.owner for lease in live_leases(self.fs, self.leases)}
        keep |= {c.attempt for c in self._commits()}
        removed = [a for a in attempts if a not in keep]
        for attempt in removed:
            log.info("removing the unfinished dataset attempt %s (its writer stopped before "
                     "committing it)", self.attempt_path(attempt))
            self.remove_attempt(attempt)
        self._remove_dead_leases()
        return removed

    def remove_empty(self) -> None:
        """Remove this key's directories that are empty (after a failed write); a directory
        someone writes into meanwhile is not empty and stays."""
        for path in (f"{self.base}/{ATTEMPTS}", self.leases, f"{self.base}/{COMMITS}",
                     self.base):
            try:
                if not self.fs.ls(path, detail=False):
                    self.fs.rmdir(path)
            except (FileNotFoundError, NotADirectoryError, OSError):
                pass

    def _remove_dead_leases(self) -> None:
        # what one listing showed dead: not a lease some writer took after a first listing
        remove_dead_leases(self.fs, self.leases)
