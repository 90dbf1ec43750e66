"""Rank logs, progress and failures carried through the store: executors never connect back.

With Spark Connect the client (a laptop, a notebook server) is often outside the cluster's
network, so nothing may depend on executors reaching it. Both sides reach the store, so each
rank writes what it has to say as small files in the launch's events directory, and the
client polls that directory::

    r00001-a000-000004.jsonl   a segment: the JSON lines rank 1 wrote in one flush of attempt 0
    starts/r00001-000          one empty marker per start of rank 1: their count is its attempt
    stop                       written with an error that retrying cannot fix (a bug in the
                               user's code): a re-run attempt's ranks see it and stop at once

A segment is written under a temporary name and renamed, so the client never reads half of
one; it handles new segments in name order (per rank: attempt, then sequence) and deletes
them. Ranks flush at most every :data:`FLUSH_SECONDS`, at once for an error and at the end.
Lines are ``{"rank", "attempt", "kind": "log" | "progress" | "error", "text", "t"}``, errors
with ``"fatal"`` (true: not worth retrying).

Example::

    with EventWatcher(url, on_progress=bar.update) as watcher:   # client
        ...                          # in a task: RankEvents(url, rank=1).start(); .log("hi")
    watcher.first_error()            # (rank, traceback) of the earliest failure, or None
"""
from __future__ import annotations

import json
import logging
import posixpath
import re
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from sparktrain.faults import is_fault_text
from sparktrain.fs import filesystem

log = logging.getLogger("sparktrain.rank")
CAUSE_SECONDS = 2.0  # a rank's death this soon after a peer's fault is taken as its cause
WARNING = "warning: "  # a rank's line starting so is logged on the client as a warning

FLUSH_SECONDS = 0.5  # a rank's buffered lines reach the store at most this late
POLL_SECONDS = 0.5  # the client looks for new segments this often
_SEGMENT = re.compile(r"r(\d+)-a(\d+)-(\d+)\.jsonl$")
_MAX_BUFFER = 10_000  # lines a rank keeps while the store cannot be written


class RankEvents:
    """Executor end: buffers a rank's lines and writes them as segments; never raises
    (training must not fail because a log line could not be delivered)."""

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None,
                 rank: int = 0) -> None:
        self.url = url.rstrip("/")
        self.rank = rank
        self.attempt = 0
        self._options = storage_options
        self._fs: Any = None
        self._buffer: List[str] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> int:
        """Count this start of the rank in the store; returns its attempt number (0 first)."""
        try:
            self._fs = filesystem(self.url, self._options)[0]
            starts = f"{self.url}/starts"
            self._fs.makedirs(starts, exist_ok=True)
            prefix = f"r{self.rank:05d}-"
            earlier = [p for p in self._fs.ls(starts, detail=False)
                       if posixpath.basename(p).startswith(prefix)]
            self.attempt = len(earlier)
            self._fs.pipe_file(f"{starts}/{prefix}{self.attempt:03d}", b"")
        except Exception:  # noqa: BLE001 - no store, no live events; training still runs
            self._fs = None
        self._thread = threading.Thread(target=self._flush_loop, name="sparktrain-events",
                                         daemon=True)
        self._thread.start()
        return self.attempt

    def send(self, kind: str, text: str, **extra: Any) -> None:
        line = json.dumps({"rank": self.rank, "attempt": self.attempt, "kind": kind,
                           "text": text, "t": time.time(), **extra})
        with self._lock:
            if len(self._buffer) < _MAX_BUFFER:
                self._buffer.append(line)
        if kind == "error":
            self.flush()

    def log(self, text: str) -> None:
        self.send("log", text)

    def error(self, text: str, fatal: bool = False, **extra: Any) -> None:
        """Report this rank's failure; ``fatal``: retrying cannot help, so later attempts'
        ranks are told to stop (see :meth:`stopped`)."""
        if fatal and self._fs is not None:
            try:
                self._fs.pipe_file(f"{self.url}/stop", b"")
            except Exception:  # noqa: BLE001 - the client still cancels the job
                pass
        self.send("error", text, fatal=fatal, **extra)

    def stopped(self) -> bool:
        """True when an earlier attempt failed in a way retrying cannot fix."""
        try:
            return self._fs is not None and self._fs.exists(f"{self.url}/stop")
        except Exception:  # noqa: BLE001
            return False

    def progress(self, event: Dict[str, Any]) -> None:
        self.send("progress", json.dumps(event))

    def flush(self) -> None:
        if self._fs is None:
            return
        with self._write_lock:
            with self._lock:
                lines, self._buffer = self._buffer, []
            if not lines:
                return
            name = f"r{self.rank:05d}-a{self.attempt:03d}-{self._seq:06d}.jsonl"
            temporary = f"{self.url}/.{name}.{uuid.uuid4().hex[:6]}.tmp"
            try:
                self._fs.pipe_file(temporary, ("\n".join(lines) + "\n").encode())
                self._fs.mv(temporary, f"{self.url}/{name}")
                self._seq += 1
            except Exception:  # noqa: BLE001 - keep the lines for the next try
                with self._lock:
                    self._buffer[:0] = lines[: max(0, _MAX_BUFFER - len(self._buffer))]

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()


class EventWatcher:
    """Client end: polls the events directory on a thread; re-logs ``[rank N]`` lines, feeds
    progress events to ``on_progress`` and failures to ``on_error(rank, attempt, traceback,
    fatal)``."""

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None,
                 echo: bool = True,
                 on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                 on_error: Optional[Callable[[int, int, str, bool], None]] = None) -> None:
        self.url = url.rstrip("/")
        self.echo = echo
        self.on_progress = on_progress
        self.on_error = on_error
        # (time, attempt, rank, traceback, fatal)
        self.errors: List[Tuple[float, int, int, str, bool]] = []
        self.lost: set = set()  # (attempt, rank): ranks whose process died without a word
        self.lines: Deque[Tuple[int, str]] = deque(maxlen=1000)  # the latest, for inspection
        self._attempts_failed = 0
        self._fs = filesystem(self.url, storage_options)[0]
        self._fs.makedirs(self.url, exist_ok=True)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="sparktrain-watcher",
                                        daemon=True)

    def poll(self) -> None:
        """Handle every segment written so far (in name order), then delete it."""
        with self._lock:
            try:
                self._fs.invalidate_cache(self.url)
                names = sorted(p for p in self._fs.ls(self.url, detail=False)
                               if _SEGMENT.search(p) and not posixpath.basename(p).startswith("."))
            except FileNotFoundError:
                return
            for name in names:
                try:
                    data = self._fs.cat_file(name)
                    self._fs.rm(name)
                except FileNotFoundError:
                    continue
                for raw in data.decode("utf-8", "replace").splitlines():
                    try:
                        self._receive(json.loads(raw))
                    except (ValueError, KeyError, TypeError):
                        continue

    def _receive(self, message: Dict[str, Any]) -> None:
        rank, attempt, kind = int(message["rank"]), int(message["attempt"]), message["kind"]
        text = str(message["text"])
        if kind == "progress":
            if self.on_progress is not None:
                self.on_progress(json.loads(text))
        elif kind == "error":
            fatal = bool(message.get("fatal", False))
            if "lost" in message:  # a rank reporting another's death (rank_gather)
                rank = int(message["lost"])
                self.lost.add((attempt, rank))
            self.errors.append((float(message.get("t", 0.0)), attempt, rank, text, fatal))
            self._attempts_failed = max(self._attempts_failed,
                                        int(message.get("attempts_failed", 0)))
            if self.on_error is not None:
                self.on_error(rank, attempt, text, fatal)
        else:
            self.lines.append((rank, text))
            if self.echo:
                for line in text.rstrip("\n").splitlines():
                    level = logging.WARNING if line.startswith(WARNING) else logging.INFO
                    log.log(level, "[rank %d] %s", rank, line)

    def first_error(self) -> Optional[Tuple[int, str]]:
        """``(rank, traceback)`` of the earliest failure of the earliest failed attempt; when
        that failure is a fault (a peer gone) and a rank of that attempt died without a word,
        that rank's death, which caused it."""
        if not self.errors:
            return None
        first, attempt, rank, text, _ = min(self.errors, key=lambda e: (e[1], e[0]))
        if (attempt, rank) not in self.lost and is_fault_text(text):
            # a death seconds later is Spark killing the others' tasks, not the cause
            deaths = [e for e in self.errors if (e[1], e[2]) in self.lost and e[1] == attempt
                      and e[0] <= first + CAUSE_SECONDS]
            if deaths:
                _, _, rank, text, _ = min(deaths)
        return rank, text

    def last_lines(self, rank: int, count: int = 20) -> List[str]:
        """The last ``count`` lines rank ``rank`` sent (those it flushed before it ended)."""
        lines = [line for r, text in self.lines if r == rank for line in text.splitlines()]
        return lines[-count:]

    def user_error(self) -> bool:
        """Whether a rank reported an error in the user's code (``fatal``: never retried)."""
        return any(error[4] for error in self.errors)

    def failed_attempts(self) -> int:
        """How many attempts failed: had a rank report an error, or ended silently before
        ranks gave up (``attempts_failed`` in their report)."""
        return max(len({error[1] for error in self.errors}), self._attempts_failed)

    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a flaky store must not end the fit
                log.debug("polling %s failed: %s", self.url, exc)

    def __enter__(self) -> "EventWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.poll()  # what the ranks wrote last (they flush before they return or fail)
        except Exception as error:  # noqa: BLE001
            log.debug("last poll of %s failed: %s", self.url, error)
