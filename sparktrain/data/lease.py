"""Leases in the store: "I am writing this" markers that expire when their writer dies.

Two fits (threads of one driver, or two drivers) can share a store. A lease is a small JSON
file ``<directory>/<name>.json`` naming its holder (host, pid, uuid) and when it expires; a
thread of the holder renews it while the work goes on. A lease counts as *live* while it has
not expired and, when its holder runs on this host, while the holder's process exists (so a
killed driver on this machine frees its leases at once instead of after ``ttl`` seconds).

Writes go through :func:`sparktrain.fs.put_file` (a hidden temporary name, then moved into
place): readers never see half a file.

"The earliest live lease" (:meth:`Lease.first`) is one well-defined holder even when two fits
take their leases at the same moment. A lease is ordered by a *ticket*, not by the time in its
name: a file's name is chosen before the file can be seen, and a writer delayed between the
two (a loaded machine, a slow store) would show up late with an earlier name than a lease
whose holder already checked that it was first and started work (two writers of one dataset).
So a lease is taken the way Lamport's bakery algorithm takes a number: its file is written
first *choosing* (no ticket), then the holder lists the directory and takes a ticket later
than every ticket it saw (and not earlier than its clock), and writes it. :meth:`Lease.first`
waits while another live lease is still choosing, then compares tickets (ties by owner).
Whoever checks first therefore either sees the other's file (choosing: it waits; ticketed:
it compares) or the other has not written it yet and will see this ticket when it takes its
own. That needs no agreement between clocks; a lease still counts as dead once its
``expires`` has passed on the reader's clock, so a holder stalled for longer than ``ttl`` (or
clocks that disagree by that much) can leave two holders, which is why every user of a lease
(dataset commits, run locks) is also safe without it (see :mod:`sparktrain.data.commit`).

Example::

    lease = Lease.acquire(fs, f"{root}/_leases", ttl=60)
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
from typing import Any, Dict, List, Optional, Tuple

from sparktrain.fs import list_json, put_file, read_json

log = logging.getLogger(__name__)

# A dead holder on another host frees its leases after this long (renewed every ttl / 4 = 15 s,
# so a driver busy for a few seconds never loses one); on this host at once (its pid is gone).
DEFAULT_TTL_SECONDS = 60.0
_HOST = socket.gethostname()
_CHOOSING_POLL_SECONDS = 0.02  # how often first() looks again while another lease is choosing


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
    ticket: Optional[int] = None  # None while its holder is still choosing one

    @property
    def choosing(self) -> bool:
        return self.ticket is None

    def order(self) -> Tuple[int, int, str]:
        """Sort key: ticketed leases by (ticket, owner), then the choosing ones."""
        if self.ticket is None:
            return (1, 0, self.owner)
        return (0, self.ticket, self.owner)

    def live(self, now: Optional[float] = None) -> bool:
        if (now or time.time()) >= self.expires:
            return False
        if self.host == _HOST and self.pid != os.getpid():
            return process_alive(self.pid)
        return True

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.created))
        return f"{self.note or 'a fit'} on host {self.host}, pid {self.pid}, since {since}"


def _parse(path: str, data: Optional[Dict[str, Any]]) -> Optional[LeaseInfo]:
    if data is None:
        return None
    try:
        created = float(data["created"])
        if data.get("choosing"):
            ticket: Optional[int] = None
        else:  # a lease written before tickets existed is ordered by its creation time
            ticket = int(data.get("ticket", int(created * 1e6)))
        return LeaseInfo(path, str(data["owner"]), str(data["host"]), int(data["pid"]),
                         created, float(data["expires"]), str(data.get("note", "")), ticket)
    except (KeyError, TypeError, ValueError):
        return None


def _read_leases(fs: Any, directory: str) -> List[Tuple[str, Optional[LeaseInfo]]]:
    """Every lease file of one listing of ``directory`` with what it says (``None``: gone
    since the listing, or not a lease)."""
    return [(path, _parse(path, read_json(fs, path))) for path in list_json(fs, directory)]


def live_leases(fs: Any, directory: str) -> List[LeaseInfo]:
    """The live leases in ``directory``, earliest first (those still choosing a ticket last)."""
    now = time.time()
    found = [info for _, info in _read_leases(fs, directory)
             if info is not None and info.live(now)]
    return sorted(found, key=LeaseInfo.order)


def remove_dead_leases(fs: Any, directory: str) -> List[str]:
    """Remove the lease files of ``directory`` that are dead (expired, their local process
    gone) or not leases at all; returns their paths. Only files this call read and found
    dead are removed: a lease written meanwhile is not touched."""
    now = time.time()
    removed = []
    for path, info in _read_leases(fs, directory):
        if info is not None and info.live(now):
            continue
        try:
            fs.rm(path)
            removed.append(path)
        except (FileNotFoundError, OSError):
            pass
    return removed


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
        # the creation time first, for people reading the directory; the order is the ticket's
        self.path = f"{self.directory}/{int(self.created * 1e6):017d}-{self.owner}.json"
        self.ticket: Optional[int] = None  # taken by acquire()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, fs: Any, directory: str, ttl: float = DEFAULT_TTL_SECONDS,
                note: str = "") -> "Lease":
        """Write a new lease, take its ticket (see the module's docstring) and start renewing
        it (every ``ttl / 4`` seconds)."""
        lease = cls(fs, directory, ttl, note)
        lease._write()  # choosing: visible before the ticket is chosen
        try:
            seen = [info.ticket for info in live_leases(fs, lease.directory)
                    if info.ticket is not None and info.owner != lease.owner]
            lease.ticket = max([int(time.time() * 1e6)] + [t + 1 for t in seen])
            lease._write()
        except BaseException:
            lease._remove()  # a lease left choosing would hold up others' first() for ttl
            raise
        lease._thread = threading.Thread(target=lease._renew_loop, daemon=True,
                                         name="sparktrain-lease")
        lease._thread.start()
        return lease

    def _write(self) -> None:
        data: Dict[str, Any] = {"owner": self.owner, "host": _HOST, "pid": os.getpid(),
                                "created": self.created, "expires": time.time() + self.ttl,
                                "note": self.note}
        if self.ticket is None:
            data["choosing"] = True
        else:
            data["ticket"] = self.ticket
        put_file(self.fs, self.path, json.dumps(data).encode())

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
        """True when this is the earliest live lease of its directory (by ticket, once no
        other live lease is still choosing one: that takes a moment, or ends when it
        expires)."""
        while True:
            leases = live_leases(self.fs, self.directory)
            if not any(info.owner == self.owner for info in leases):
                return False  # removed (as expired) by someone else
            if any(info.choosing and info.owner != self.owner for info in leases):
                time.sleep(_CHOOSING_POLL_SECONDS)
                continue
            return leases[0].owner == self.owner

    def others(self) -> List[LeaseInfo]:
        """The other live leases of this lease's directory, earliest first."""
        return [lease for lease in live_leases(self.fs, self.directory)
                if lease.owner != self.owner]

    def release(self) -> None:
        """Stop renewing and remove the lease file, even when an exception (a Ctrl-C) cuts
        the wait for the renewing thread short."""
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout=5)
        finally:
            self._remove()

    def _remove(self) -> None:
        try:
            self.fs.rm(self.path)
        except (FileNotFoundError, OSError):
            pass

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
