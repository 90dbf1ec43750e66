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
import select
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set

from sparktrain.sockets import listen, receive_exactly

_HEADER = struct.Struct("!I")  # a frame: its length, then that many bytes of UTF-8
CONNECT_SECONDS = 60.0  # how long a rank tries to reach rank 0's server
HANDSHAKE_SECONDS = 10.0  # how long the server waits for a new connection to say who it is
WATCH_SECONDS = 0.2  # how often an idle rank looks at its connection to rank 0
CLOSE_WAIT_SECONDS = 1.0  # how long close() waits for a gather of another thread to end
BYE = "\x00bye"  # a rank (or the server) ending normally
LOST = "\x00lost "  # the server to the others: this rank died


def _send(sock: socket.socket, text: str) -> None:
    data = text.encode("utf-8")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> str:
    header = receive_exactly(sock, _HEADER.size)
    return receive_exactly(sock, _HEADER.unpack(header)[0]).decode("utf-8")


class GatherServer:
    """Rank 0's side: accepts the ``world_size`` ranks (each proves the secret and says its
    rank), then answers gathers until every rank said goodbye or :meth:`close`. ``address``
    is what the ranks need (``host port secret``), published through the launch folder.

    A rank whose connection ends without a goodbye died without a Python error (killed by a
    signal, or crashed): ``on_lost(rank)`` is called once, every other rank is told (their
    gathers and watchers see ``LOST``), and the server stops."""

    def __init__(self, world_size: int, host: str,
                 on_lost: Callable[[int], None] = lambda rank: None) -> None:
        self.world_size = world_size
        self.on_lost = on_lost
        self.lost = threading.Event()  # a rank died without a goodbye
        self._secret = secrets.token_hex(16)
        self._listener, host = listen(host, world_size)  # rank 0's executor address only
        self.address = f"{host} {self._listener.getsockname()[1]} {self._secret}"
        self._closed = threading.Event()
        self._wake, self._waker = socket.socketpair()  # close() -> the serving thread
        self._ranks: List[Optional[socket.socket]] = [None] * world_size
        self._thread = threading.Thread(target=self._serve, name="sparktrain-rank-gather",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        ranks = self._ranks
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

    def _serve(self) -> None:
        ranks = self._ranks
        pending: Dict[int, str] = {}
        gone: Set[int] = set()
        try:
            self._accept()
            joined = self._joined()
            with selectors.DefaultSelector() as selector:
                for rank, sock in enumerate(joined):
                    selector.register(sock, selectors.EVENT_READ, rank)
                selector.register(self._wake, selectors.EVENT_READ, None)
                while len(gone) < self.world_size:
                    for key, _ in selector.select():
                        rank = key.data
                        if rank is None:  # close(): goodbye to the ranks, from this thread
                            self._goodbye()
                            return
                        try:
                            text = _receive(joined[rank])
                        except OSError:  # ConnectionError: no goodbye
                            if not self._closed.is_set():
                                self._lost(rank)
                            return
                        if text == BYE or gone:  # a gather after a goodbye cannot complete
                            gone.add(rank)
                            selector.unregister(joined[rank])
                            continue
                        pending[rank] = text
                    if len(pending) == self.world_size:
                        answer = json.dumps([pending[r] for r in range(self.world_size)])
                        pending.clear()
                        for sock in joined[1:] + joined[:1]:  # rank 0 (this process) last
                            _send(sock, answer)
        except OSError:  # close(), or a rank gone while it was answered
            pass
        finally:
            self._listener.close()
            self._wake.close()
            for end in ranks:  # those that joined
                if end is not None:
                    end.close()

    def _joined(self) -> List[socket.socket]:
        """The ranks' sockets, once :meth:`_accept` has returned."""
        joined = [sock for sock in self._ranks if sock is not None]
        assert len(joined) == self.world_size  # _accept() returns once every rank joined
        return joined

    def _goodbye(self) -> None:
        for sock in self._joined():
            try:
                _send(sock, BYE)
            except OSError:
                pass

    def _lost(self, rank: int) -> None:
        """``rank`` died: report it, tell the others (best effort)."""
        self.lost.set()
        try:
            self.on_lost(rank)
        finally:
            for other, sock in enumerate(self._ranks):
                if other != rank and sock is not None:
                    try:
                        _send(sock, f"{LOST}{rank}")
                    except OSError:
                        pass

    def close(self, settle: float = 0.0) -> None:
        """Stop serving; the ranks get a goodbye. ``settle``: seconds to first wait for a
        rank's death to be seen (rank 0 failing on a fault: the death is most often its
        cause, and a closed server no longer reports it)."""
        if settle > 0 and self._thread.is_alive():
            self.lost.wait(settle)
        self._closed.set()
        try:
            self._waker.send(b"x")  # the serving thread says goodbye and ends
        except OSError:
            pass
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a thread still in accept()
        except OSError:
            pass
        self._thread.join(5)
        self._waker.close()


NO_SERVER = "spark"  # what rank 0 publishes when it has no server: every rank uses Spark's
WAIT_SECONDS = 600.0  # how long a rank waits for rank 0 to publish (its worker may start late)


def publish(fs: Any, path: str, address: str) -> None:
    """Rank 0: write its server's ``address`` (or :data:`NO_SERVER`) at ``path`` (fsspec
    ``fs``); a reader takes it only once the closing newline is there."""
    fs.pipe_file(path, f"{address}\n".encode("utf-8"))


def connect(fs: Any, path: str, rank: int, wait: float = WAIT_SECONDS,
            on_lost: Callable[[int], None] = lambda rank: None) -> Optional["RankGather"]:
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
                return RankGather(text.strip(), rank, on_lost)
            except ConnectionRefusedError:  # an earlier attempt's server, gone
                refused.add(text)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0 gave no gather address at {path} in "
                               f"{wait:.0f}s (its task did not start, or cannot write there)")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class RankGather:
    """A rank's side: ``gather(message)`` returns every rank's message in rank order.

    Between gathers a thread watches the connection: when it ends without the server's
    goodbye, rank 0 died without a Python error and ``on_lost(0)`` is called."""

    def __init__(self, address: str, rank: int,
                 on_lost: Callable[[int], None] = lambda rank: None) -> None:
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
        self.rank, self.on_lost = rank, on_lost
        self._lock = threading.Lock()
        self._done = threading.Event()  # the server's goodbye or a LOST seen, or close()
        _send(self._sock, f"{secret} {rank}")
        if rank != 0:  # rank 0's server is in this very process
            threading.Thread(target=self._watch, name="sparktrain-rank-watch",
                             daemon=True).start()

    def __call__(self, message: str) -> List[str]:
        with self._lock:
            try:
                _send(self._sock, message)
                answer = _receive(self._sock)
            except OSError as exc:
                raise ConnectionError(f"a rank left the launch while the others gathered "
                                      f"({exc}); Spark re-runs the stage") from exc
            if answer.startswith(LOST):
                self._done.set()
                raise ConnectionError(f"rank {answer[len(LOST):]}'s process ended while the "
                                      f"others gathered; Spark re-runs the stage")
            if answer == BYE:
                self._done.set()
                raise ConnectionError("rank 0 left the launch while the others gathered")
            return json.loads(answer)

    def _watch(self) -> None:
        """Look at the connection while no gather uses it (every ``WATCH_SECONDS``)."""
        while not self._done.wait(WATCH_SECONDS):
            if not self._lock.acquire(timeout=WATCH_SECONDS):
                continue  # a gather is waiting on the server: it sees what happens
            try:
                if self._done.is_set() or not select.select([self._sock], [], [], 0)[0]:
                    continue
                try:
                    text = _receive(self._sock)
                except OSError:  # ended without a word from rank 0: its process died
                    self._done.set()
                    self.on_lost(0)
                    return
                if text == BYE or text.startswith(LOST):
                    self._done.set()  # rank 0 ended, or told of another rank's loss
            finally:
                self._lock.release()

    def close(self) -> None:
        """Say goodbye (this rank ends normally, even on an error it reported) and close.
        Never waits for a gather: one that another thread of this rank still waits on (a
        rank ending on an error while its helper thread waits for the others) has sent its
        message, so the goodbye goes without the lock, and closing ends that wait."""
        self._done.set()
        locked = self._lock.acquire(timeout=CLOSE_WAIT_SECONDS)
        try:
            _send(self._sock, BYE)
        except OSError:
            pass
        finally:
            if locked:
                self._lock.release()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        except OSError:
            pass
        self._sock.close()
