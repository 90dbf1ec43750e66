"""The ranks' ``all_gather`` over one TCP connection each to rank 0, instead of Spark's.

``BarrierTaskContext.allGather`` (and ``barrier``) cost about a second each, whatever the
cluster: the executor polls the driver's answer with ``Thread.sleep(1000)`` between looks
(``BarrierTaskContext.runBarrier`` in Spark's core, every version so far), so even the last
rank to arrive waits a full second. A launch that exchanged three messages spent three seconds
before its first step. Here rank 0 starts a small server in its task and writes its address
and a secret into the launch's folder in the store (which only the driver and this fit's
executors reach, as they reach its checkpoints); the other ranks read it (polling every few
ms) and connect, and every gather then takes milliseconds. Where the store cannot be used the
ranks keep Spark's ``allGather``.

The server reads one message from every rank, in rank order, then sends each rank the list: a
rank that leaves (its process died, its connection closed) ends the server, and every other
rank's ``all_gather`` raises :class:`ConnectionError` at once, failing the stage as a failed
Spark barrier would (Spark then re-runs it). An address left by an earlier attempt of the same
stage (whose rank 0 is gone) refuses the connection and is polled again.

Example (what ``run_rank`` does)::

    server = GatherServer(world_size, host) if rank == 0 else None
    if server: publish(fs, path, server.address)
    gather = connect(fs, path, rank)
    gather("my message")  # -> every rank's message, in rank order
"""
from __future__ import annotations

import hmac
import json
import secrets
import socket
import struct
import threading
import time
from typing import Any, List, Optional

_HEADER = struct.Struct("!I")  # a frame: its length, then that many bytes of UTF-8
CONNECT_SECONDS = 60.0  # how long a rank tries to reach rank 0's server
HANDSHAKE_SECONDS = 10.0  # how long the server waits for a new connection to say who it is


def _send(sock: socket.socket, text: str) -> None:
    data = text.encode("utf-8")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> str:
    header = _exactly(sock, _HEADER.size)
    return _exactly(sock, _HEADER.unpack(header)[0]).decode("utf-8")


def _exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("the connection closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class GatherServer:
    """Rank 0's side: accepts the ``world_size`` ranks (each proves the secret and says its
    rank), then answers gathers until a rank leaves or :meth:`close`. ``address`` is what the
    ranks need (``host port secret``), to send through Spark's one ``allGather``."""

    def __init__(self, world_size: int, host: str) -> None:
        self.world_size = world_size
        self._secret = secrets.token_hex(16)
        if socket.has_dualstack_ipv6():
            self._listener = socket.create_server(("", 0), family=socket.AF_INET6,
                                                  dualstack_ipv6=True)
        else:
            self._listener = socket.create_server(("", 0))
        self._listener.listen(world_size)
        self.address = f"{host} {self._listener.getsockname()[1]} {self._secret}"
        self._closed = threading.Event()
        self._ranks: List[Optional[socket.socket]] = [None] * world_size
        self._thread = threading.Thread(target=self._serve, name="sparktrain-rank-gather",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        ranks = self._ranks
        try:
            while any(s is None for s in ranks):
                sock, _ = self._listener.accept()
                try:
                    sock.settimeout(HANDSHAKE_SECONDS)  # a silent stranger cannot stall it
                    secret, rank = _receive(sock).split()
                    sock.settimeout(None)
                    if not hmac.compare_digest(secret, self._secret) or \
                            not 0 <= int(rank) < self.world_size or ranks[int(rank)]:
                        raise ValueError("not a rank of this launch")
                except (ValueError, OSError):
                    sock.close()  # a stranger, or a rank that gave up: not counted
                    continue
                ranks[int(rank)] = sock
            self._listener.close()
            while not self._closed.is_set():
                messages = [_receive(s) for s in ranks]
                answer = json.dumps(messages)
                for s in ranks:
                    _send(s, answer)
        except OSError:  # a rank left (or close()): every other rank's gather fails at once
            pass
        finally:
            self._listener.close()
            for s in ranks:
                if s is not None:
                    s.close()

    def close(self) -> None:
        """Stop serving (a thread blocked in ``accept`` or ``recv`` wakes up: shutdown)."""
        self._closed.set()
        for sock in [self._listener] + [s for s in self._ranks if s is not None]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)


NO_SERVER = "spark"  # what rank 0 publishes when it has no server: every rank uses Spark's
WAIT_SECONDS = 600.0  # how long a rank waits for rank 0 to publish (its worker may start late)


def publish(fs: Any, path: str, address: str) -> None:
    """Rank 0: write its server's ``address`` (or :data:`NO_SERVER`) at ``path`` (fsspec
    ``fs``); a reader takes it only once the closing newline is there."""
    fs.pipe_file(path, f"{address}\n".encode("utf-8"))


def connect(fs: Any, path: str, rank: int, wait: float = WAIT_SECONDS) -> Optional["RankGather"]:
    """Rank ``rank``'s connection to the server whose address is (or will be) at ``path``;
    ``None`` when rank 0 has none. Only rank 0 decides: a read that fails here is tried again
    (a rank that chose Spark's allGather alone would wait forever on the others)."""
    delay, refused, deadline = 0.002, set(), time.monotonic() + wait
    while True:
        try:
            text = fs.cat_file(path).decode("utf-8")
        except OSError:  # not there yet (or the store hiccuped): look again
            text = ""
        if text == f"{NO_SERVER}\n":
            return None
        if text.endswith("\n") and text not in refused:
            try:
                return RankGather(text.strip(), rank)
            except ConnectionRefusedError:  # an earlier attempt's server, gone
                refused.add(text)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0 gave no gather address at {path} in "
                               f"{wait:.0f}s (its task did not start, or cannot write there)")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class RankGather:
    """A rank's side: ``gather(message)`` returns every rank's message in rank order."""

    def __init__(self, address: str, rank: int) -> None:
        host, port, secret = address.split()
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
        except ConnectionRefusedError:
            raise
        except OSError as exc:
            raise ConnectionError(f"rank {rank} cannot reach rank 0's gather server at "
                                  f"{host}:{port} ({exc}); the executors must reach each "
                                  f"other on any port, as torch.distributed's store and NCCL "
                                  f"also need") from exc
        self._sock.settimeout(None)  # a gather waits for the slowest rank, as Spark's does
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        _send(self._sock, f"{secret} {rank}")

    def __call__(self, message: str) -> List[str]:
        with self._lock:
            try:
                _send(self._sock, message)
                return json.loads(_receive(self._sock))
            except OSError as exc:
                raise ConnectionError(f"a rank left the launch while the others gathered "
                                      f"({exc}); Spark re-runs the stage") from exc

    def close(self) -> None:
        self._sock.close()
