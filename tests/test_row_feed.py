"""Streamed rows without Spark: how rows are dealt to ranks, the TCP feed (real sockets on
loopback, real Arrow streams) and a rank's fed shard (its cache, its window, re-read epochs,
mid-epoch skips, a failed feed)."""
from __future__ import annotations

import collections
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from sparktrain.data.columns import SPLIT_COL, ColumnSpec
from sparktrain.data.sources.fed_rank import FedRows, FeedFailed
from sparktrain.data.sources.fed_wire import Receiver, dealt, host_targets, send_partition, share
from sparktrain.options.spec import RowsPlan


@pytest.mark.parametrize("rows,chunk,world", [(0, 4, 2), (10, 4, 2), (4097, 1024, 3),
                                              (7, 1, 4), (100, 128, 2)])
def test_each_ranks_share_is_what_the_dealing_gives_it(rows, chunk, world):
    for partition in range(5):
        ranks = dealt(0, rows, partition, world, chunk)
        for rank in range(world):
            assert share(rows, partition, world, rank, chunk) == int(np.sum(ranks == rank))
        # dealing in pieces gives the same ranks as dealing at once
        pieces = np.concatenate([dealt(s, min(3, rows - s), partition, world, chunk)
                                 for s in range(0, rows, 3)]) if rows else ranks
        assert pieces.tolist() == ranks.tolist()


def _batches(partition, rows, per_batch=250, val_every=0):
    """Record batches of ``rows`` rows: ``id`` (partition * 10**6 + row), ``x``, the split."""
    out = []
    for start in range(0, rows, per_batch):
        ids = np.arange(start, min(rows, start + per_batch)) + partition * 10**6
        split = ["val" if val_every and i % val_every == 0 else "train" for i in ids]
        out.append(pa.RecordBatch.from_pydict(
            {"id": ids.astype(np.int64), "x": ids.astype(np.float32), SPLIT_COL: split}))
    return out


SECRET = "f" * 64  # the fit's key (RowsPlan.secret), as the driver draws it


def test_a_partition_reaches_each_rank_in_order_split_by_split():
    got = collections.defaultdict(list)
    lock = threading.Lock()

    def receive(rank):
        def on_batch(header, start, batch):
            with lock:
                got[(rank, header["split"], header["partition"])].append(
                    (start, batch.column("id").to_pylist()))
        return on_batch

    receivers = [Receiver(receive(r), host="127.0.0.1", secret=SECRET) for r in range(2)]
    try:
        sent = send_partition(_batches(1, 3000, val_every=4), {"epoch": 0, "partition": 1},
                              [r.address for r in receivers], ["id", "x"], SPLIT_COL, chunk=500,
                              secret=SECRET)
        deadline = time.monotonic() + 30  # the receivers' threads may still be reading
        while sum(len(p) for parts in list(got.values()) for _, p in parts) < 3000:
            assert time.monotonic() < deadline, "the receivers did not get every row"
            time.sleep(0.01)
    finally:
        for r in receivers:
            r.close()
    assert sent == {"train": 2250, "val": 750}
    for split, total in sent.items():
        ids = [i for b in _batches(1, 3000, val_every=4) for i, s in zip(
            b.column("id").to_pylist(), b.column(SPLIT_COL).to_pylist(), strict=True)
            if s == split]
        ranks = dealt(0, total, 1, 2, 500)
        for rank in range(2):
            parts = got[(rank, split, 1)]
            assert [start for start, _ in parts] == list(np.cumsum([0] + [len(p) for _, p
                                                                        in parts])[:-1])
            mine = [i for i, r in zip(ids, ranks, strict=True) if r == rank]
            assert [i for _, p in parts for i in p] == mine


def test_the_feed_listens_on_its_host_and_reads_nothing_without_the_fits_secret(caplog):
    """A rank's receiver binds the address it publishes (not every interface) and reads no
    byte from a connection that does not first prove the fit's secret: a stranger's rows sent
    straight away, or a feeder of another fit, are dropped (logged once per peer); the real
    feeder's rows then arrive whole."""
    import socket

    caplog.set_level("WARNING", logger="sparktrain")
    got = []
    receiver = Receiver(lambda header, start, batch: got.extend(batch.column("id").to_pylist()),
                        host="127.0.0.1", secret=SECRET)
    try:
        host, port = receiver.sock.getsockname()[:2]
        assert host == "127.0.0.1" and receiver.address == f"127.0.0.1:{port}"
        with pytest.raises(ConnectionRefusedError):  # loopback, but not the address it bound
            socket.create_connection(("127.0.0.2", port), timeout=5)
        stranger = socket.create_connection(("127.0.0.1", port), timeout=5)
        rows = pa.RecordBatch.from_pydict({"id": [666], "x": [6.0]})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_batch(rows)
        header = json.dumps({"epoch": 0, "partition": 0, "split": "train"}).encode() + b"\n"
        stranger.sendall(b"\0" * 32 + header + sink.getvalue().to_pybytes())  # no proof
        stranger.settimeout(10)
        stranger.recv(64)  # the receiver's challenge
        try:  # then it hangs up (a reset: what the stranger sent was never read)
            assert stranger.recv(64) == b""
        except ConnectionResetError:
            pass
        stranger.close()
        with pytest.raises(OSError):  # a feeder with another fit's key is hung up on
            send_partition(_batches(0, 5000), {"epoch": 0, "partition": 0},
                           [receiver.address], ["id", "x"], SPLIT_COL, secret="0" * 64)
        sent = send_partition(_batches(0, 300), {"epoch": 0, "partition": 0},
                              [receiver.address], ["id", "x"], SPLIT_COL, secret=SECRET)
        deadline = time.monotonic() + 30
        while len(got) < 300:
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
    finally:
        receiver.close()
    assert sent == {"train": 300} and sorted(got) == list(range(300))  # no 666, no repeats
    refused = [r.getMessage() for r in caplog.records if "did not prove" in r.getMessage()]
    assert len(refused) == 1 and "127.0.0.1" in refused[0], refused


def _spec(tmp_path, counts, **extra):
    columns = [ColumnSpec("id", "scalar", "int64").to_json(),
               ColumnSpec("x", "scalar", "float32").to_json()]
    plan = RowsPlan("fed", counts=counts, chunk=100, feed_dir=str(tmp_path / "feed"),
                    cache_limit=extra.pop("cache_limit", None), secret=SECRET)
    return SimpleNamespace(rows=plan, storage_options={}, columns=columns, batch_size=64,
                           val_batch_size=64, shuffle=True, seed=3, **extra)


def _feed(rows, epoch, partitions):
    for p, n in enumerate(partitions):
        send_partition(_batches(p, n), {"epoch": epoch, "partition": p}, rows.addresses,
                       ["id", "x"], SPLIT_COL, chunk=100, secret=SECRET,
                       targets=rows.targets[p] if rows.targets else None)


def _ids(batches):
    return [int(i) for b in batches for i in b["id"]]


@pytest.mark.parametrize("cache_limit", [None, 16.0], ids=["cached", "re_read"])
def test_a_fed_shard_trains_every_row_once_an_epoch_and_skips_exactly(tmp_path, cache_limit):
    partitions = [700, 0, 1234]
    rows = FedRows(_spec(tmp_path, {"train": partitions}, cache_limit=cache_limit), 0, 1,
                   lambda text: [text])
    shard = rows.readers["train"]
    assert shard.cached == (cache_limit is None) and len(shard) == -(-1934 // 64)
    expected = sorted(p * 10**6 + i for p, n in enumerate(partitions) for i in range(n))
    try:
        feeder = threading.Thread(target=_feed, args=(rows, 0, partitions))
        feeder.start()
        first = list(shard.epoch(0))  # trained while the rows arrive
        feeder.join()
        assert sorted(_ids(first)) == expected and len(first) == len(shard)
        assert json.loads((tmp_path / "feed" / f"{rows.token}-e0.json").read_text())[
            "addresses"] == rows.addresses
        if cache_limit is None:  # later epochs: a permutation of the cache, repeatable
            second = list(shard.epoch(1))
            assert sorted(_ids(second)) == expected and _ids(second) != _ids(first)
            assert _ids(shard.epoch(1, skip=5)) == _ids(second[5:])
            assert not (tmp_path / "feed" / f"{rows.token}-e1.json").exists()
        else:  # no room: epoch 2 asks for the rows again and gets them
            feeder = threading.Thread(target=_feed, args=(rows, 1, partitions))
            feeder.start()
            resumed = list(shard.epoch(1, skip=5))
            feeder.join()
            assert (tmp_path / "feed" / f"{rows.token}-e1.json").exists()
            assert len(resumed) == len(shard) - 5 and len(set(_ids(resumed))) == 1934 - 5 * 64
    finally:
        shard.close()


def test_a_rank_with_fewer_rows_repeats_some_so_that_every_rank_steps_alike(tmp_path):
    # 2 ranks, chunk 100: rank 0 gets 300 of partition 0's 500 rows, rank 1 gets 200
    rows = FedRows(_spec(tmp_path, {"train": [500]}), 1, 2, lambda text: [text, text])
    shard = rows.readers["train"]
    try:
        assert shard.rows == 200 and shard.most == 300 and len(shard) == 5
        rank0 = Receiver(lambda header, start, batch: None, host="127.0.0.1", secret=SECRET)
        rows.addresses = [rank0.address, rows.addresses[1]]
        feeder = threading.Thread(target=_feed, args=(rows, 0, [500]))
        feeder.start()
        batches = list(shard.epoch(0))
        feeder.join()
        ids = _ids(batches)
        assert len(batches) == 5 and len(ids) == 300
        assert set(ids) == set(range(100, 200)) | set(range(300, 400))
    finally:
        rank0.close()
        shard.close()


def test_a_failed_feed_stops_the_waiting_rank_with_its_message(tmp_path):
    rows = FedRows(_spec(tmp_path, {"train": [300]}), 0, 1, lambda text: [text])
    shard = rows.readers["train"]
    (tmp_path / "feed").mkdir(exist_ok=True)
    (tmp_path / "feed" / "failed").write_text("ZeroDivisionError: in the user's UDF")
    try:
        with pytest.raises(FeedFailed, match="ZeroDivisionError: in the user's UDF"):
            list(shard.epoch(0))
    finally:
        shard.close()


@pytest.mark.parametrize("as_columns", [False, True], ids=["positions", "columns"])
def test_a_shuffle_window_gives_every_row_once_in_a_new_order(as_columns):
    from sparktrain.data.shuffle_window import ShuffleWindow

    window, rng, drawn = ShuffleWindow(capacity=300), np.random.default_rng(0), []
    for start in range(0, 1000, 100):  # rows arrive in chunks; batches of 64 leave
        rows = np.arange(start, start + 100)
        window.add({"id": rows, "x": rows * 2.0} if as_columns else rows)
        while window.size >= 200 or (start == 900 and window.size):
            batch = window.draw(min(64, window.size), rng)
            if as_columns:
                assert (batch["x"] == batch["id"] * 2.0).all()
                batch = batch["id"]
            drawn.extend(batch.tolist())
    assert sorted(drawn) == list(range(1000)) and drawn != sorted(drawn)


class _Gather:
    """The ranks' all_gather for ranks in threads of this process (rank order)."""

    def __init__(self, ranks):
        self.barrier, self.texts, self.lock = threading.Barrier(ranks), {}, threading.Lock()

    def of(self, rank):
        def gather(text):
            with self.lock:
                self.texts[rank] = text
            self.barrier.wait(30)
            return [self.texts[r] for r in sorted(self.texts)]
        return gather


def _ranks(tmp_path, partitions, world, cache_limit, hosts=()):
    """``world`` FedRows of one fit (in threads: they gather their addresses); ``hosts``:
    each rank's address (loopback ones stand for hosts)."""
    gather, made = _Gather(world), {}
    spec = _spec(tmp_path, {"train": partitions}, cache_limit=cache_limit)
    threads = [threading.Thread(target=lambda r=r: made.__setitem__(
        r, FedRows(spec, r, world, gather.of(r), hosts=hosts))) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [made[r] for r in range(world)]


def _read(shards, **epoch):
    """Each shard's batches of epoch 0 (``take`` of them when given), read at once."""
    take = epoch.pop("take", None)
    out = {}

    def read(rank, shard):
        batches = shard.epoch(0, **epoch)
        out[rank] = [next(batches) for _ in range(take)] if take else list(batches)

    threads = [threading.Thread(target=read, args=(r, s)) for r, s in enumerate(shards)]
    for thread in threads:
        thread.start()
    return threads, out


def _first_batches(ranks, partitions, take):
    """Each of ``ranks``' first ``take`` batches of epoch 0 as its rows are fed, and each one's
    position after them (its shards closed)."""
    shards = [rows.readers["train"] for rows in ranks]
    try:
        threads, batches = _read(shards, take=take)
        _feed(ranks[0], 0, partitions)
        for thread in threads:
            thread.join(30)
        return batches, [shard.position(take) for shard in shards]
    finally:
        for shard in shards:
            shard.close()


@pytest.mark.parametrize("cache_limit", [None, 16.0], ids=["cached", "re_read"])
def test_an_epoch_resumed_with_fewer_ranks_trains_exactly_the_rows_left(tmp_path, cache_limit):
    """3 ranks train 4 batches of an epoch and write their positions; 2 ranks resume it from
    them: every row of the epoch trained exactly once over the two (as a set: a rank short of
    the most repeats a few of its own), whoever had it."""
    from sparktrain.data.sources.trained_rows import TrainedRows

    partitions = [700, 0, 1234]
    expected = {p * 10**6 + i for p, n in enumerate(partitions) for i in range(n)}
    three = _ranks(tmp_path / "a", partitions, 3, cache_limit)
    before, positions = _first_batches(three, partitions, 4)
    trained = TrainedRows.union(positions)
    first = [i for rank in before.values() for i in _ids(rank)]
    assert trained.count() == len(set(first)) == 3 * 4 * 64
    two = _ranks(tmp_path / "b", partitions, 2, cache_limit)
    shards = [rows.readers["train"] for rows in two]
    blob = trained.to_bytes()
    try:
        steps = shards[0].resumed_steps(blob)
        assert steps == shards[1].resumed_steps(blob)
        assert (1934 - 768) / 2 <= steps * 64 < (1934 - 768) / 2 + 2 * 100  # chunks of 100
        threads, after = _read(shards, skip=4, trained=blob)
        _feed(two[0], 0, partitions)
        for thread in threads:
            thread.join(30)
    finally:
        for shard in shards:
            shard.close()
    assert [len(after[r]) for r in (0, 1)] == [steps, steps]  # every rank steps alike
    rest = {i for rank in after.values() for i in _ids(rank)}
    assert not rest & set(first) and rest | set(first) == expected


def test_host_targets_keep_a_partition_on_one_host_and_the_hosts_even():
    assert host_targets(["h"] * 4, [5000] * 8) is None  # one host: every rank, as before
    assert host_targets(["a", "a", "b", "b"], [4000, 4000]) == [[0, 1], [2, 3]]
    hosts = ["a", "b", "c", "b", "a", "c", "a", "b"]
    rows = [900, 1200, 0, 3000, 800, 1500, 2200, 700, 1000, 1300, 600, 2400]
    targets = host_targets(hosts, rows, chunk=100)
    assert targets is not None
    for ranks in targets:  # every partition to the ranks of one host
        assert len({hosts[r] for r in ranks}) == 1 and ranks == sorted(ranks)
    per_rank = [sum(n / len(t) for n, t in zip(rows, targets, strict=True) if r in t)
                for r in range(len(hosts))]
    assert max(per_rank) <= 1.1 * sum(rows) / len(hosts) + 100
    # where Spark computed a partition ("homes"), its host's ranks get it while they stay even
    homes = ["b", "a", "a", "c", "b", "c", "a", "b", "", "c", "a", "b"]
    at_home = host_targets(hosts, rows, chunk=100, homes=homes)
    assert sum(hosts[t[0]] == h for t, h in zip(at_home, homes, strict=True)) >= 9, at_home
    per_rank = [sum(n / len(t) for n, t in zip(rows, at_home, strict=True) if r in t)
                for r in range(len(hosts))]
    assert max(per_rank) <= 1.1 * sum(rows) / len(hosts) + 100
    # homes all on one host: as many as fit there, the rest spread
    assert host_targets(["a", "b"], [4000] * 4, homes=["b"] * 4) == [[1], [1], [0], [0]]
    # a few large partitions cannot be spread over the hosts, or leave one without rows:
    # every partition to every rank, as on one host
    assert host_targets(["a", "b"], [100_000]) is None
    assert host_targets(["a", "b", "c", "d"], [1000, 1000, 1000]) is None


@pytest.mark.parametrize("cache_limit", [None, 16.0], ids=["cached", "re_read"])
def test_ranks_on_two_hosts_get_each_partition_from_one_and_resume_exactly(tmp_path,
                                                                           cache_limit):
    """3 ranks on two hosts (loopback addresses stand for them): each partition's rows reach
    the ranks of one host only; 2 ranks (one a host) resume the epoch from their positions,
    and every row is trained exactly once over the two."""
    from sparktrain.data.sources.trained_rows import TrainedRows

    partitions = [300, 0, 450, 500, 350, 400, 250, 600]
    expected = {p * 10**6 + i for p, n in enumerate(partitions) for i in range(n)}
    three = _ranks(tmp_path / "a", partitions, 3, cache_limit,
                   hosts=["127.0.0.1", "127.0.0.2", "127.0.0.2"])
    targets = three[0].targets
    assert targets is not None and all(rows.targets == targets for rows in three)
    before, positions = _first_batches(three, partitions, 4)
    for rank, batches in before.items():
        for row in _ids(batches):
            assert rank in targets[row // 10**6], (rank, row)
    first = {i for rank in before.values() for i in _ids(rank)}
    trained = TrainedRows.union(positions)
    two = _ranks(tmp_path / "b", partitions, 2, cache_limit, hosts=["127.0.0.2", "127.0.0.1"])
    shards = [rows.readers["train"] for rows in two]
    blob = trained.to_bytes()
    try:
        steps = shards[0].resumed_steps(blob)
        assert steps == shards[1].resumed_steps(blob)
        threads, after = _read(shards, skip=4, trained=blob)
        _feed(two[0], 0, partitions)
        for thread in threads:
            thread.join(30)
    finally:
        for shard in shards:
            shard.close()
    assert [len(after[r]) for r in (0, 1)] == [steps, steps]
    rest = {i for rank in after.values() for i in _ids(rank)}
    assert not rest & first and rest | first == expected


def test_an_own_partition_epoch_resumes_with_exactly_the_rows_left(tmp_path):
    """Each rank its own partition (cached as it is read): 2 ranks train 3 batches, and the
    resumed epoch, from the positions both wrote, trains every other row once."""
    from sparktrain.data.sources.own_partition import OwnRows
    from sparktrain.data.sources.trained_rows import TrainedRows

    partitions = [500, 430]
    expected = {p * 10**6 + i for p, n in enumerate(partitions) for i in range(n)}
    spec = _spec(tmp_path, {"train": partitions})
    spec.rows.way, spec.rows.feed_dir = "own", ""

    def ranks():
        return [OwnRows(spec, r, 2, iter(_batches(r, partitions[r], 97))) for r in (0, 1)]

    first, positions = [], []
    for rows in ranks():
        shard = rows.readers["train"]
        batches = shard.epoch(0)
        first += _ids([next(batches) for _ in range(3)])
        positions.append(shard.position(3))
        shard.close()
    blob = TrainedRows.union(positions).to_bytes()
    rest, steps = [], set()
    for rows in ranks():
        shard = rows.readers["train"]
        steps.add(shard.resumed_steps(blob))
        got = list(shard.epoch(0, skip=3, trained=blob))
        assert len(got) == shard.resumed_steps(blob)
        rest += _ids(got)
        shard.close()
    assert steps == {-(-(500 - 3 * 64) // 64)}  # the rank with the most rows left decides
    assert not set(rest) & set(first) and set(rest) | set(first) == expected


def _shuffled_ranks(tmp_path, partitions, world, seed):
    """``world`` ranks' readers of rows shuffled into the training stage: every row of
    ``partitions`` with its ``monotonically_increasing_id`` (partition << 33 | offset), dealt
    to the ranks at random (as a shuffle would), spooled in threads that gather."""
    from sparktrain.data.sources.shuffled import ShuffledRows
    from sparktrain.data.sources.trained_rows import ROW_ID

    rng = np.random.default_rng(seed)
    dealt_to = {r: [] for r in range(world)}
    for p, n in enumerate(partitions):
        for batch in _batches(p, n, per_batch=97):
            offsets = batch.column("id").to_numpy() - p * 10**6
            batch = batch.append_column(ROW_ID, pa.array((p << 33) + offsets))
            owners = rng.integers(0, world, batch.num_rows)
            for r in range(world):
                dealt_to[r].append(batch.filter(pa.array(owners == r)))
    spec = _spec(tmp_path, {})
    spec.rows.way = "shuffled"
    gather, made = _Gather(world), {}

    def spool(rank):
        made[rank] = ShuffledRows(iter(dealt_to[rank])).readers(spec, rank, world,
                                                                gather.of(rank))["train"]
    _in_threads(spool, range(world))
    return [made[r] for r in range(world)], gather


def _in_threads(work, items):
    threads = [threading.Thread(target=work, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def test_a_shuffled_epoch_resumed_with_fewer_ranks_trains_exactly_the_rows_left(tmp_path):
    """Rows shuffled into the training stage know where they came from: 3 ranks train 4
    batches and write their positions; 2 ranks, dealt the rows otherwise, resume the epoch and
    train exactly the rows none of the 3 had, in as many steps each."""
    from sparktrain.data.sources.trained_rows import TrainedRows

    partitions = [700, 0, 1234]
    expected = {p * 10**6 + i for p, n in enumerate(partitions) for i in range(n)}
    three, _ = _shuffled_ranks(tmp_path / "a", partitions, 3, seed=1)
    first, positions = [], []
    for shard in three:
        batches = shard.epoch(0)
        first += _ids([next(batches) for _ in range(4)])
        positions.append(shard.position(4))
        shard.close()
    assert len(first) == len(set(first)) == 3 * 4 * 64
    blob = TrainedRows.union(positions).to_bytes()
    two, _ = _shuffled_ranks(tmp_path / "b", partitions, 2, seed=2)
    _in_threads(lambda shard: shard.resume_at(0, blob), two)  # one gather, every rank
    steps = {shard.resumed_steps(blob) for shard in two}
    rest = []
    for shard in two:
        got = list(shard.epoch(0, skip=4, trained=blob))
        assert len(got) == shard.resumed_steps(blob)
        rest += _ids(got)
        # a checkpoint of the resumed epoch holds the rows trained before it too
        assert TrainedRows.from_bytes(shard.position(4 + len(got))).count() >= len(first)
        shard.close()
    assert len(steps) == 1 and steps.pop() * 64 >= (1934 - len(first)) / 2
    assert not set(rest) & set(first) and set(rest) | set(first) == expected


def test_a_shuffled_resume_over_other_rows_fails_naming_the_change(tmp_path):
    from sparktrain.data.sources.trained_rows import TrainedRows

    ranks, _ = _shuffled_ranks(tmp_path, [300, 200], 2, seed=0)
    other = TrainedRows(400).to_bytes()  # a checkpoint of a DataFrame with 400 rows
    errors = []

    def resume(shard):
        try:
            shard.resume_at(0, other)
        except ValueError as exc:
            errors.append(str(exc))
    _in_threads(resume, ranks)
    for shard in ranks:
        shard.close()
    assert len(errors) == 2 and "covers 400 rows and the DataFrame now has 500" in errors[0]
