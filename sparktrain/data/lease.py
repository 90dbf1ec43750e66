"""Leases in the store: "I am writing this" markers that expire when their writer dies.

Two fits (threads of one driver, or two drivers) can share a store. A lease is a small JSON
file ``<directory>/<name>.json`` naming its holder (host, pid, uuid) and when it expires; a
thread of the holder renews it while the work goes on. A lease counts as *live* while it has
not expired and, when its holder runs on this host, while the holder's process exists (so a
killed driver on this machine frees its leases at once instead of after ``ttl`` seconds).

Writes go through :func:`sparktrain.fs.put_file` (a hidden temporary name, then moved into
place): readers never see half a file. Names sort by creation time, so "the earliest live
lease" is one well-defined holder; on stores whose clocks disagree two holders may both think
they are first, which is why every user of a lease (dataset commits, run locks) is also safe
without it (see :mod:`sparktrain.data.commit`).

Example::

    lease = Lease.acquire(fs, f"{root}/_leases", ttl=120)
    try:
        ...  # lease.renew() happens on a thread while the block runs
    finally:
        lease.release()
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional

from sparktrain.fs import list_json, put_file, read_json

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 120.0
_HOST = socket.gethostname()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass
class LeaseInfo:
    """What a lease file says about its holder."""

    path: str
    owner: str
    host: str
    pid: int
    created: float
    expires: float
    note: str = ""

    def live(self, now: Optional[float] = None) -> bool:
        if (now or time.time()) >= self.expires:
            return False
        if self.host == _HOST and self.pid != os.getpid():
            return process_alive(self.pid)
        return True

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.created))
        return f"{self.note or 'a fit'} on host {self.host}, pid {self.pid}, since {since}"


def live_leases(fs: Any, directory: str) -> List[LeaseInfo]:
    """The live leases in ``directory``, earliest first."""
    found = []
    now = time.time()
    for path in list_json(fs, directory):
        data = read_json(fs, path)
        if data is None:
            continue
        try:
            info = LeaseInfo(path, str(data["owner"]), str(data["host"]), int(data["pid"]),
                             float(data["created"]), float(data["expires"]),
                             str(data.get("note", "")))
        except (KeyError, TypeError, ValueError):
            continue
        if info.live(now):
            found.append(info)
    return found


class Lease:
    """A lease this process holds; renewed on a daemon thread until :meth:`release`."""

    def __init__(self, fs: Any, directory: str, ttl: float = DEFAULT_TTL_SECONDS,
                 note: str = "") -> None:
        self.fs = fs
        self.directory = directory.rstrip("/")
        self.ttl = float(ttl)
        self.note = note
        self.created = time.time()
        self.owner = uuid.uuid4().hex[:12]
        # the creation time first: names sort in the order leases were taken
        self.path = f"{self.directory}/{int(self.created * 1e6):017d}-{self.owner}.json"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, fs: Any, directory: str, ttl: float = DEFAULT_TTL_SECONDS,
                note: str = "") -> "Lease":
        """Write a new lease and start renewing it (every ``ttl / 4`` seconds)."""
        lease = cls(fs, directory, ttl, note)
        lease._write()
        lease._thread = threading.Thread(target=lease._renew_loop, daemon=True,
                                         name="sparktrain-lease")
        lease._thread.start()
        return lease

    def _write(self) -> None:
        put_file(self.fs, self.path, json.dumps({
            "owner": self.owner, "host": _HOST, "pid": os.getpid(), "created": self.created,
            "expires": time.time() + self.ttl, "note": self.note}).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self._write()
            except Exception as exc:  # noqa: BLE001 - retried at the next tick
                log.debug("renewing lease %s failed: %s", self.path, exc)

    def held(self) -> bool:
        """True while the lease file is still there (nobody removed it as expired)."""
        try:
            return self.fs.exists(self.path)
        except Exception:  # noqa: BLE001
            return False

    def first(self) -> bool:
        """True when this is the earliest live lease of its directory."""
        leases = live_leases(self.fs, self.directory)
        return bool(leases) and leases[0].owner == self.owner

    def others(self) -> List[LeaseInfo]:
        """The other live leases of this lease's directory, earliest first."""
        return [lease for lease in live_leases(self.fs, self.directory)
                if lease.owner != self.owner]

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.fs.rm(self.path)
        except (FileNotFoundError, OSError):
            pass

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
