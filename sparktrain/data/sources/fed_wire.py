"""The wire of rows fed beside the ranks, both ends of each channel and their layout: the
feed folder (rank 0 asks the driver for an epoch; the driver answers done or failed) and the
rows themselves over TCP (how rows are dealt, the sending side, a feeding task, and the
receiving side, a rank). Agreement between the ranks goes over :mod:`sparktrain.launch.
rank_gather`, as for every fit.

**The feed folder** (``<run>/_feed/<id>`` in the store, :class:`FeedFolder`): a request is
``<token>-e<epoch>.json`` (``{"epoch", "addresses", "targets"}``: the ranks' receivers and
each partition's ranks, or ``null`` for all), written by rank
0 under a token fresh for each attempt or elastic generation; the driver answers with
``<token>-e<epoch>.done`` once every row of the epoch was sent, or one ``failed`` file (the
text of why) that stops every rank. Over Spark Connect, where the driver cannot see a job's
tasks, each feeding task also marks its start and end (``<job tag>.p<partition>.started`` and
``.ended``): the driver tells a feed that got no task slot from a slow one by them.

**The rows**:
Each feeding task sends its partition's rows to the partition's ranks (its *targets*), dealt in
chunks of :data:`CHUNK_ROWS` rows in turn (row ``i`` of partition ``p`` goes to
``targets[(i // chunk + p) % len(targets)]``), and every rank's share of a partition is known
from the partition's row count alone (:func:`share`). On one host every partition's targets are
all the ranks: every running feeder feeds every rank, so ranks that train in step never wait
on a feeder stuck behind another rank. Where the ranks span hosts, each partition goes to the
ranks of one host (:func:`host_targets`, balanced by rows), so a feeder opens as many
connections as a host has ranks, not as the fit has. One connection per (rank, split) carries
a JSON header line, then an Arrow IPC stream of the rank's rows in order.

**The lock**: a rank's receiver listens on its executor's address only (the one it publishes,
never every interface) and reads nothing from a connection before it proved the fit's secret
(``RowsPlan.secret``, drawn by the driver, travelling only inside the fit's payload to the ranks
and the feeding tasks): it sends a fresh random challenge, the feeder answers with its HMAC
(SHA-256) under the secret and waits for the receiver's word; a wrong or late answer closes
the connection (the feeder raises ``ConnectionError``), logged once per peer. A stranger
cannot put rows into a rank's training data; the receiver closes with the rank.

Example::

    receiver = Receiver(on_batch, host="10.0.0.5", secret=plan.secret)  # on a rank
    receiver.address                         # "10.0.0.5:port", published for the feeders
    send_partition(batches, {"epoch": 0, "partition": 3}, ["h:1", "h:2"], ["x", "y"],
                   secret=plan.secret)
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from sparktrain.sockets import listen, receive_exactly

log = logging.getLogger("sparktrain")

FAILED = "failed"
CHALLENGE_BYTES = 32  # the receiver's random challenge; the answer is an HMAC-SHA256 (32 bytes)
HANDSHAKE_SECONDS = 10.0  # how long a receiver waits for a new connection's answer
ACCEPTED = b"\x01"  # the receiver's word that the answer was right: rows may follow


def new_secret() -> str:
    """A fit's key for its row feed (``RowsPlan.secret``)."""
    return secrets.token_hex(32)


def _proof(secret: str, challenge: bytes) -> bytes:
    return hmac.new(secret.encode(), b"sparktrain-feed:" + challenge, hashlib.sha256).digest()



class FeedFolder:
    """Both ends of the feed folder (see the module docstring): :meth:`ask`, :meth:`done` and
    :meth:`failure` on rank 0 and the ranks, :meth:`requests`, :meth:`answer_done` and
    :meth:`answer_failed` on the driver."""

    def __init__(self, folder: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        from sparktrain.fs import filesystem

        self.folder, self.storage_options = folder, dict(storage_options or {})
        self.fs = filesystem(folder, self.storage_options)[0]
        self.remote = "://" in folder and not folder.startswith("file://")
        self.seen: set = set()

    # -- the ranks' side --------------------------------------------------------------------
    def ask(self, token: str, epoch: int, addresses: Sequence[str],
            targets: Optional[Targets] = None) -> None:
        """Ask for ``epoch``'s rows, sent to the receivers at ``addresses`` (rank order), each
        partition's to its ``targets`` (:func:`host_targets`; ``None``: to every rank)."""
        self.fs.makedirs(self.folder, exist_ok=True)
        self.fs.pipe_file(f"{self.folder}/{token}-e{epoch}.json", json.dumps(
            {"epoch": epoch, "addresses": list(addresses), "targets": targets}).encode())

    def done(self, token: str, epoch: int) -> bool:
        """Whether every row of ``epoch`` was sent."""
        try:
            return bool(self.fs.exists(f"{self.folder}/{token}-e{epoch}.done"))
        except OSError:
            return False

    def failure(self) -> Optional[str]:
        """Why the driver could not feed the rows, if it could not."""
        try:
            return self.fs.cat_file(f"{self.folder}/{FAILED}").decode("utf-8", "replace")
        except (FileNotFoundError, OSError):
            return None

    # -- a feeding task's side ----------------------------------------------------------------
    def task_mark(self, tag: str, partition: int, what: str) -> None:
        """Mark feeding task ``partition`` of the job ``tag`` as ``"started"`` or
        ``"ended"``."""
        try:
            self.fs.pipe_file(f"{self.folder}/{tag}.p{partition}.{what}", b"")
        except OSError as exc:  # only the stall watch reads them
            log.debug("feed task mark not written: %s", exc)

    # -- the driver's side ------------------------------------------------------------------
    def task_progress(self, tag: str) -> Optional[Tuple[int, int]]:
        """``(tasks running, tasks ended)`` of the feeding job ``tag`` by its tasks' marks."""
        try:
            self.fs.invalidate_cache(self.folder)
            names = [n.rsplit("/", 1)[-1] for n in self.fs.ls(self.folder, detail=False)]
        except (FileNotFoundError, OSError):
            return None
        started = sum(1 for n in names if n.startswith(f"{tag}.p") and n.endswith(".started"))
        ended = sum(1 for n in names if n.startswith(f"{tag}.p") and n.endswith(".ended"))
        return started - ended, ended

    def open(self) -> None:
        self.fs.makedirs(self.folder, exist_ok=True)

    def requests(self) -> List[Tuple[str, int, List[str], Optional[Targets]]]:
        """The requests not seen before: ``[(token, epoch, addresses, targets)]``."""
        try:
            self.fs.invalidate_cache(self.folder)
            names = sorted(n for n in self.fs.ls(self.folder, detail=False)
                           if n.endswith(".json"))
        except (FileNotFoundError, OSError):
            return []
        found = []
        for name in names:
            if name in self.seen:
                continue
            self.seen.add(name)
            try:
                request = json.loads(self.fs.cat_file(name))
            except (FileNotFoundError, OSError, ValueError):
                continue
            token = name.rsplit("/", 1)[-1].split("-e", 1)[0]
            found.append((token, int(request["epoch"]), list(request["addresses"]),
                          request.get("targets")))
        return found

    def answer_done(self, token: str, epoch: int) -> None:
        self.fs.pipe_file(f"{self.folder}/{token}-e{epoch}.done", b"")

    def answer_failed(self, text: str) -> None:
        try:
            self.fs.pipe_file(f"{self.folder}/{FAILED}", text[-20000:].encode())
        except OSError:
            pass

    def remove(self) -> None:
        try:
            self.fs.rm(self.folder, recursive=True)
        except (FileNotFoundError, OSError):
            pass


#: rows dealt to one rank at a time
CHUNK_ROWS = 1024
CONNECT_SECONDS = 60.0  # a rank not accepting for this long is gone


#: each partition's ranks, in partition order (``None`` where every partition goes to all)
Targets = List[List[int]]
#: how much more than an even share host-grouped dealing may give a rank (else all-to-all)
HOST_SLACK = 1.1


def host_targets(hosts: Sequence[str], rows: Sequence[int], chunk: int = CHUNK_ROWS,
                 homes: Sequence[str] = ()) -> Optional[Targets]:
    """The ranks each partition's rows go to where the ranks (``hosts``: each rank's host)
    span several hosts: the ranks of one host, chosen partition by partition, largest first:
    the partition's own host (``homes``: where Spark computed it, "" unknown) while its ranks
    stay within :data:`HOST_SLACK` of an even share, else the host whose ranks have the fewest
    rows so far (``rows``: each partition's). ``None`` (every partition to every rank) on one
    host, or where whole partitions cannot be spread within that slack or leave a host without
    rows (a few large partitions).

    >>> host_targets(["a", "a", "b", "b"], [4000, 4000])
    [[0, 1], [2, 3]]
    >>> host_targets(["a", "b"], [4000, 4000], homes=["b", "a"])
    [[1], [0]]
    """
    groups: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    if len(groups) < 2:
        return None
    known = len(homes) == len(rows) and any(homes)
    # at home where it keeps the ranks even, else by rows alone
    return (known and _place(groups, rows, chunk, homes)) or _place(groups, rows, chunk, ())


def _place(groups: Dict[str, List[int]], rows: Sequence[int], chunk: int,
           homes: Sequence[str]) -> Optional[Targets]:
    """:func:`host_targets`' placement, with (``homes``) or without the partitions' hosts."""
    names, ranks = list(groups), list(groups.values())
    even = sum(rows) / sum(len(r) for r in ranks)  # rows per rank
    limit = HOST_SLACK * even + chunk
    load = [0.0] * len(ranks)  # rows per rank so far, per host
    targets: Targets = [[] for _ in rows]
    # the largest partitions first (longest processing time first: within 4/3 of the best)
    for partition in sorted(range(len(rows)), key=lambda p: (-rows[p], p)):
        count = rows[partition]
        pick = min(range(len(ranks)), key=lambda h: (load[h] + count / len(ranks[h]), h))
        home = names.index(homes[partition]) if homes and homes[partition] in groups else None
        if home is not None and load[home] + count / len(ranks[home]) <= limit:
            pick = home
        load[pick] += count / len(ranks[pick])
        targets[partition] = ranks[pick]
    return targets if max(load) <= limit and min(load) > 0 else None


def share(rows: int, partition: int, world_size: int, rank: int,
          chunk: int = CHUNK_ROWS) -> int:
    """How many of a partition's ``rows`` the ``rank``-th of its ``world_size`` targets gets
    (with every rank a target: rank ``rank`` of ``world_size``).

    >>> [share(2500, 0, 2, r, chunk=1000) for r in (0, 1)]
    [1500, 1000]
    """
    full, rest = divmod(rows, chunk)
    first = (rank - partition) % world_size  # the first chunk index that is this rank's
    count = 0 if first >= full else ((full - 1 - first) // world_size + 1) * chunk
    if rest and (full + partition) % world_size == rank:
        count += rest
    return count


def dealt(start: int, rows: int, partition: int, world_size: int, chunk: int = CHUNK_ROWS
          ) -> np.ndarray:
    """The rank of each of ``rows`` rows that start at row ``start`` of ``partition``."""
    return ((np.arange(start, start + rows) // chunk + partition) % world_size).astype(np.int32)


class _Connection:
    """One Arrow IPC stream to one rank (opened on the first rows it gets)."""

    def __init__(self, address: str, header: Dict[str, Any], secret: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
        self.sock.sendall(_proof(secret, receive_exactly(self.sock, CHALLENGE_BYTES)))
        if receive_exactly(self.sock, len(ACCEPTED)) != ACCEPTED:  # ConnectionError if refused
            raise ConnectionError(f"the row feed at {address} refused this feeder")
        self.sock.settimeout(None)  # a full receiver holds us back: that is the flow control
        self.file = self.sock.makefile("wb", buffering=1 << 20)
        self.file.write(json.dumps(header).encode() + b"\n")
        self.writer: Any = None

    def write(self, batch: Any) -> None:
        import pyarrow as pa

        if self.writer is None:
            self.writer = pa.ipc.new_stream(self.file, batch.schema)
        self.writer.write_batch(batch)

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
            self.file.close()
        finally:
            self.sock.close()


def send_partition(batches: Iterable[Any], header: Dict[str, Any], addresses: Sequence[str],
                   names: Sequence[str], split_col: Optional[str] = None,
                   chunk: int = CHUNK_ROWS, *, secret: str,
                   targets: Optional[Sequence[int]] = None) -> Dict[str, int]:
    """Send the Arrow record ``batches`` of partition ``header["partition"]`` to its
    ``targets`` (ranks; all when ``None``) at ``addresses``, dealt as the module docstring
    says, per split when ``split_col`` names the split of each row (else all rows are
    ``"train"``), proving the fit's ``secret`` to each; rows sent per split."""
    import pyarrow as pa
    import pyarrow.compute as pc

    partition = int(header["partition"])
    ranks = np.asarray(list(targets) if targets is not None else range(len(addresses)))
    world_size = len(ranks)
    connections: Dict[Tuple[str, int], _Connection] = {}
    sent: Dict[str, int] = {}
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            splits = pc.unique(batch.column(split_col)).to_pylist() if split_col else ["train"]
            for split in splits:
                part = batch if not split_col else batch.filter(
                    pc.equal(batch.column(split_col), split))
                part = pa.RecordBatch.from_arrays([part.column(n) for n in names], names=names)
                dest = ranks[dealt(sent.get(split, 0), part.num_rows, partition, world_size,
                                   chunk)]
                for rank in np.unique(dest):
                    key = (split, int(rank))
                    if key not in connections:
                        connections[key] = _Connection(addresses[rank],
                                                       dict(header, split=split), secret)
                    connections[key].write(part.take(pa.array(np.flatnonzero(dest == rank))))
                sent[split] = sent.get(split, 0) + part.num_rows
    finally:
        for connection in connections.values():
            connection.close()
    return sent


class Receiver:
    """A rank's end: accepts feeders' connections and hands every record batch to
    ``on_batch(header, start, batch)`` (``start``: the batch's first row among the rows this
    connection carried; from the connection's thread, in the order it was sent; a slow
    ``on_batch`` holds the feeder back). A broken connection (a feeder task that
    failed: Spark runs it again) is dropped; ``on_error(exc)`` hears of other errors.

    It listens on ``host`` (this executor's address as Spark knows it; this machine's when
    empty) and serves only connections that prove ``secret`` (the module docstring)."""

    def __init__(self, on_batch: Callable[[Dict[str, Any], int, Any], None],
                 on_error: Optional[Callable[[BaseException], None]] = None,
                 host: str = "", *, secret: str) -> None:
        if not secret:
            raise ValueError("a row feed's receiver needs the fit's secret")
        self.on_batch, self.on_error, self.secret = on_batch, on_error, secret
        self.sock, host = listen(host or _host_address())
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.refused: set = set()  # peers already logged
        self.served: Dict[str, List[int]] = {}  # peer address -> [connections, rows]
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, name="sparktrain-feed", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="sparktrain-feed-conn",
                             daemon=True).start()

    def _proven(self, conn: socket.socket) -> bool:
        """Whether the peer proved the fit's secret; logs a peer that did not, once."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            conn.settimeout(HANDSHAKE_SECONDS)  # a silent stranger cannot hold a thread long
            conn.sendall(challenge)
            answer = receive_exactly(conn, len(_proof(self.secret, challenge)))
            conn.settimeout(None)
        except OSError:
            answer = b""
        if hmac.compare_digest(answer, _proof(self.secret, challenge)):
            try:
                conn.sendall(ACCEPTED)
                return True
            except OSError:
                return False
        try:
            peer = conn.getpeername()[0]
        except OSError:
            peer = "an unknown address"
        if peer not in self.refused:
            self.refused.add(peer)
            log.warning("the row feed on %s closed a connection from %s that did not prove "
                        "the fit's secret (nothing was read from it; further ones from there "
                        "are not logged)", self.address, peer)
        return False

    def _serve(self, conn: socket.socket) -> None:
        import pyarrow as pa

        if not self._proven(conn):
            conn.close()
            return
        try:
            peer = conn.getpeername()[0]
        except OSError:
            peer = "?"
        with self.lock:
            self.served.setdefault(peer, [0, 0])[0] += 1
        try:
            with conn, conn.makefile("rb", buffering=1 << 20) as stream:
                line = stream.readline()
                if not line:
                    return
                header = json.loads(line)
                try:
                    reader = pa.ipc.open_stream(stream)
                except (pa.ArrowInvalid, OSError):  # closed before any row: nothing to read
                    return
                start = 0
                for batch in reader:
                    if self.closed:
                        return
                    self.on_batch(header, start, batch)
                    start += batch.num_rows
                    with self.lock:
                        self.served[peer][1] += batch.num_rows
        except (OSError, pa.ArrowInvalid) as exc:  # the feeder went away: its retry resends
            log.debug("feed connection dropped: %s", exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the rank, which raises it
            if self.on_error is not None:
                self.on_error(exc)

    def traffic(self) -> str:
        """What was served so far, for the rank's log: connections, the hosts they came
        from, and the rows that crossed from another host."""
        own = self.address.rsplit(":", 1)[0]
        with self.lock:
            served = dict(self.served)
        rows = sum(r for _, r in served.values())
        crossed = sum(r for peer, (_, r) in served.items() if peer != own)
        return (f"{sum(c for c, _ in served.values())} feeder connection(s) from "
                f"{len(served)} host(s); {rows} rows, {crossed} of them from another host")

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _host_address() -> str:
    """An address of this host the feeders can reach (Spark's own for this executor where
    there is one)."""
    import os

    local = os.environ.get("SPARK_LOCAL_IP")
    if local:
        return local
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
