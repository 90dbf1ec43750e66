"""A driver-side channel that carries rank log lines and failures while a fit runs.

The driver listens on its own address (``spark.driver.host``) on a free port; each barrier task
connects, proves it belongs to this fit with a per-fit secret token and names its rank, gets
back its attempt number (how many times that rank started before: Spark retries a failed barrier
stage as a whole), and sends JSON lines ``{"rank": r, "kind": "log" | "error" | "progress",
"text": ...}``. Log lines are re-logged on
the driver as ``[rank N] ...`` as they arrive; progress events (JSON) go to ``on_progress``; the
first error is kept so ``fit`` can raise the root cause (other ranks usually fail after it,
with connection errors).

Example::

    with RankChannel("127.0.0.1") as channel:
        address = channel.address            # (host, port, token): plain values for executors
        ...                                  # in a task: RankClient(*address, rank=1).log("hi")
    channel.first_error()                    # (rank, traceback) or None
    channel.failed_attempts()                # attempts in which some rank reported an error
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import socketserver
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

log = logging.getLogger("sparktrain.rank")
_MAX_LINE = 1 << 20


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        channel: RankChannel = self.server.channel  # type: ignore[attr-defined]
        hello = self.rfile.readline(256).strip().decode("ascii", "replace").split(" ")
        if not hmac.compare_digest(hello[0], channel.token) or len(hello) != 2 \
                or not hello[1].isdigit():
            return  # not one of this fit's tasks: drop the connection without a word
        attempt = channel.started(int(hello[1]))
        self.wfile.write(f"{attempt}\n".encode())
        for raw in self.rfile:
            try:
                message = json.loads(raw[:_MAX_LINE])
                channel.receive(int(message["rank"]), message["kind"], str(message["text"]),
                                attempt)
            except (ValueError, KeyError, TypeError):
                continue


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class RankChannel:
    """Driver end: a small threaded TCP server bound to ``host``; see the module docstring."""

    def __init__(self, host: str, echo: bool = True,
                 on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                 on_error: Optional[Callable[[int, int, str], None]] = None) -> None:
        self.token = secrets.token_hex(16)
        self.echo = echo
        self.on_progress = on_progress
        self.on_error = on_error  # (rank, attempt, traceback), called on the channel's thread
        self.errors: List[Tuple[int, str, int]] = []  # (rank, traceback, attempt)
        self._starts: Dict[int, int] = {}
        self.lines: Deque[Tuple[int, str]] = deque(maxlen=1000)  # the latest, for inspection
        self._lock = threading.Lock()
        self._server = _Server((host, 0), _Handler)
        self._server.channel = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="sparktrain-channel", daemon=True)

    @property
    def address(self) -> Tuple[str, int, str]:
        host, port = self._server.server_address[:2]
        return host, port, self.token

    def started(self, rank: int) -> int:
        """Count a start of ``rank``; returns its attempt number (0 the first time)."""
        with self._lock:
            attempt = self._starts.get(rank, 0)
            self._starts[rank] = attempt + 1
            return attempt

    def receive(self, rank: int, kind: str, text: str, attempt: int = 0) -> None:
        if kind == "progress":
            if self.on_progress is not None:
                self.on_progress(json.loads(text))
            return
        with self._lock:
            if kind == "error":
                self.errors.append((rank, text, attempt))
            else:
                self.lines.append((rank, text))
        if kind == "error":
            if self.on_error is not None:
                self.on_error(rank, attempt, text)
        elif self.echo:
            for line in text.rstrip("\n").splitlines():
                log.info("[rank %d] %s", rank, line)

    def first_error(self) -> Optional[Tuple[int, str]]:
        with self._lock:
            return self.errors[0][:2] if self.errors else None

    def failed_attempts(self) -> int:
        """How many attempts had a rank report an error."""
        with self._lock:
            return len({attempt for _, _, attempt in self.errors})

    def __enter__(self) -> "RankChannel":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class RankClient:
    """Executor end: sends log lines and a failure to the driver; never raises on a lost link
    (training must not fail because a log line could not be delivered)."""

    def __init__(self, host: str, port: int, token: str, rank: int) -> None:
        self.rank = rank
        self.attempt = 0  # this rank's attempt number, as counted by the driver
        self._lock = threading.Lock()
        try:
            self._sock: Optional[socket.socket] = socket.create_connection((host, port), timeout=10)
            self._sock.sendall(f"{token} {rank}\n".encode("ascii"))
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = self._sock.recv(32)
                if not chunk:
                    raise OSError("the driver closed the channel")
                reply += chunk
            self.attempt = int(reply)
            self._sock.settimeout(None)
        except (OSError, ValueError):
            self._sock = None

    def send(self, kind: str, text: str) -> None:
        if self._sock is None:
            return
        data = json.dumps({"rank": self.rank, "kind": kind, "text": text}).encode() + b"\n"
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError:
                self._sock = None

    def log(self, text: str) -> None:
        self.send("log", text)

    def error(self, text: str) -> None:
        self.send("error", text)

    def progress(self, event: Dict[str, Any]) -> None:
        self.send("progress", json.dumps(event))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()
                self._sock = None
