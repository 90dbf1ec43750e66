"""The rank-local cache (sparktrain.data.rank_cache) behind ShardReader(local_cache=True),
without Spark: later epochs read no file, shuffle over the whole shard, every row once per
epoch; a disk without room gives a warning and today's path; caches are removed when done and
when their process died."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from test_reader import COLUMNS, count_reads, epochs_of, write_dataset

from sparktrain.data import rank_cache
from sparktrain.data.rank_cache import RankCache, remove_orphans
from sparktrain.data.reader import ShardReader
from sparktrain.data.schema import BINARY, SCALAR, ColumnSpec


def _reader(root, layout, rank, world, cache_root, shuffle=True, columns=COLUMNS, **options):
    return ShardReader(str(root), layout, columns, rank, world, 8, shuffle, seed=5,
                       local_cache=True, cache_root=str(cache_root), **options)


def _ids(epoch):
    return [i for batch in epoch for i in batch["id"].tolist()]


@pytest.mark.stack  # memory-mapped .npy files under NumPy 1.26 and 2
@pytest.mark.parametrize("shuffle", [False, True])
def test_later_epochs_read_only_the_cache_and_every_row_once(tmp_path, monkeypatch, shuffle):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    layout = write_dataset(data, [37, 0, 23, 41], row_group_size=10)
    world, total = 3, 101
    readers = [_reader(data, layout, rank, world, cache, shuffle) for rank in range(world)]
    plain = [ShardReader(str(data), layout, COLUMNS, rank, world, 8, shuffle, seed=5)
             for rank in range(world)]
    reads = [count_reads(r, monkeypatch) for r in readers]
    first = [epochs_of(r, 1)[0] for r in readers]
    # the first pass is today's, batch for batch
    for mine, theirs in zip(first, [epochs_of(p, 1)[0] for p in plain], strict=True):
        assert [b["id"].tolist() for b in mine] == [b["id"].tolist() for b in theirs]
    assert all(r.local_cache_complete for r in readers)
    assert len(os.listdir(cache)) == world  # one folder a rank
    for path in data.glob("*.parquet"):  # later epochs must not touch the store
        path.unlink()
    for epoch in (1, 2):
        per_rank = [list(r.epoch(epoch)) for r in readers]
        assert {len(batches) for batches in per_rank} == {len(readers[0])}  # same steps
        for batches in per_rank:
            for batch in batches:
                np.testing.assert_array_equal(batch["x"][:, 0], batch["id"].astype(np.float32))
        seen = [i for batches in per_rank for i in _ids(batches)]
        assert set(seen) == set(range(total)) and len(seen) - total <= world - 1
        for rank, batches in enumerate(per_rank):  # each rank: its own shard, once
            assert sorted(_ids(batches)) == sorted(_ids(first[rank]))
    assert [len(r) for r in reads] == [len(reader.pieces) for reader in readers]
    if shuffle:  # over the whole shard: a batch mixes rows of different row groups
        batch = next(iter(readers[2].epoch(3)))["id"]
        assert len({int(i) // 10 for i in batch}) > 1
        assert _ids(readers[2].epoch(3)) != _ids(readers[2].epoch(4))
    for reader in readers:
        folder = reader._local.folder
        reader.close()
        assert not os.path.exists(folder)


def test_an_abandoned_first_pass_is_completed_by_the_next(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    layout = write_dataset(data, [50], row_group_size=10)
    reader = _reader(data, layout, 0, 1, tmp_path / "cache", prefetch=0)
    reads = count_reads(reader, monkeypatch)
    next(iter(reader.epoch(0)))  # train_steps_per_epoch shorter than a pass
    assert not reader.local_cache_complete
    assert sorted(_ids(reader.epoch(1))) == list(range(50))
    assert reader.local_cache_complete and len(reads) == 1 + len(reader.pieces)
    assert sorted(_ids(reader.epoch(2))) == list(range(50)) and len(reads) == 1 + 5
    reader.close()


def test_columns_it_cannot_map_are_read_from_the_store(tmp_path):
    columns = [ColumnSpec("id", SCALAR, "int64", 1), ColumnSpec("raw", BINARY, "bytes")]
    assert not rank_cache.cacheable(columns) and rank_cache.cacheable(COLUMNS)
    assert RankCache.create(columns, 10, str(tmp_path)) is None and not os.listdir(tmp_path)


@pytest.fixture
def small_disk(tmpfs):
    """A real full disk: an 8 MiB tmpfs (needs root, as CI runs)."""
    return tmpfs("8m")


@pytest.mark.parametrize("headroom", [rank_cache.HEADROOM_BYTES, 0])
def test_a_disk_without_room_gives_a_warning_and_todays_path(tmp_path, small_disk, caplog,
                                                               monkeypatch, headroom):
    # headroom 0: the free-space check passes, the allocation itself fails (ENOSPC)
    monkeypatch.setattr(rank_cache, "HEADROOM_BYTES", headroom)
    data = tmp_path / "data"
    data.mkdir()
    layout = write_dataset(data, [500_000], row_group_size=100_000)  # 10 MB: x and ids
    reader = _reader(data, layout, 0, 1, small_disk)
    with caplog.at_level(logging.WARNING, logger="sparktrain"):
        epochs = [sorted(_ids(reader.epoch(e))) for e in range(2)]
    assert epochs == [list(range(500_000))] * 2
    assert "no local cache for rank 0's shard" in caplog.text
    assert not reader.local_cache_complete and not os.listdir(small_disk)
    reader.close()


def test_a_dead_process_cache_is_removed_by_the_next_one(tmp_path):
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "owner").write_text("2147483646:1")  # no such process
    (orphan / "0.npy").write_bytes(b"x" * 10)
    live = tmp_path / "live"
    live.mkdir()
    (live / "owner").write_text(f"{os.getpid()}:{rank_cache._start_time(os.getpid())}")
    reused = tmp_path / "reused"  # a live pid that started at another time: a reused pid
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()}:0")
    assert remove_orphans(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["live"]
    cache = RankCache.create(COLUMNS, 5, str(tmp_path))
    assert cache is not None and len(os.listdir(tmp_path)) == 2
    folder = cache.folder
    del cache  # dropped without close(): removed all the same
    assert not os.path.exists(folder)


class _CacheWatch:
    """A transformation_fn recording, on the ranks, the caches that exist at each batch; with
    ``fail_at``, rank 0 raises at that batch (a bug in user code: the fit fails at once); with
    ``hide``, rank 0 moves that folder (the store's datasets) away at batch ``hide_at``, so any
    later read from the store would fail."""

    def __init__(self, folder: str, fail_at: int = 0, hide: str = "", hide_at: int = 0) -> None:
        self.folder, self.fail_at, self.seen = folder, fail_at, 0
        self.hide, self.hide_at = hide, hide_at

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        from sparktrain.data.rank_cache import cache_root

        self.seen += 1
        rank = BarrierTaskContext.get().partitionId()
        root = cache_root()
        caches = os.listdir(root) if os.path.isdir(root) else []
        with open(os.path.join(self.folder, f"{rank}-{self.seen}"), "w") as f:
            f.write("\n".join([root] + caches))
        if self.fail_at and rank == 0 and self.seen == self.fail_at:
            raise RuntimeError("user bug in epoch 2")
        if self.hide and rank == 0 and self.seen == self.hide_at:
            os.rename(self.hide, self.hide + "-hidden")
        return batch


@pytest.mark.parametrize("fail", [False, True], ids=["fit", "failed_fit"])
def test_a_fit_trains_from_its_caches_and_removes_them(spark, regression_df, tmp_path, fail):
    """From the second epoch on the ranks read nothing from the store: their dataset is moved
    away at the second epoch's first batch and the fit trains on to its end."""
    from sparktrain.errors import TrainingError
    from support.helpers import linear_estimator

    watched, store = tmp_path / "watch", tmp_path / "store"
    watched.mkdir()
    # 1600 training rows, 800 a rank, batch 100: 8 batches an epoch and rank, then 2 of
    # validation (400 rows): batches 11 and on are the second epoch, which starts once every
    # rank has validated the first (its metrics are averaged over the ranks)
    watch = _CacheWatch(str(watched), fail_at=12 if fail else 0,
                        hide="" if fail else str(store / "datasets"), hide_at=11)
    est = linear_estimator(str(store), epochs=3, batch_size=100, validation="is_val",
                           transformation_fn=watch)
    if fail:
        with pytest.raises(TrainingError, match="user bug in epoch 2"):
            est.fit(regression_df)
    else:
        assert len(est.fit(regression_df).getHistory()["loss"]) == 3
    records = {p.name: p.read_text().split("\n") for p in watched.iterdir()}
    roots = {lines[0] for lines in records.values()}
    assert len(roots) == 1
    # from the second epoch on, each rank trains from its cache (train and validation splits)
    later = [lines[1:] for name, lines in records.items() if int(name.split("-")[1]) > 10]
    assert later and all(len(caches) >= 2 for caches in later)
    root = roots.pop()
    assert not (os.path.isdir(root) and os.listdir(root)), "caches left after the fit"
    if not fail:  # the ranks trained two epochs without their dataset in the store
        assert (store / "datasets-hidden").is_dir() and not (store / "datasets").exists()
