"""Sharding: every rank runs the same steps, rows are read once, nothing hangs on odd layouts."""
from __future__ import annotations

import mmap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparktrain.data.reader import ShardReader, shard_pieces, shard_range, steps_per_epoch
from sparktrain.data.schema import ARRAY, SCALAR, ColumnSpec

COLUMNS = [ColumnSpec("x", ARRAY, "float32", 3), ColumnSpec("id", SCALAR, "int64", 1)]


def write_dataset(root, sizes, row_group_size=7, empty_group=False):
    """Files of ``sizes`` rows (ids 0..N-1 in order, x = [id, id, id]); returns the layout.
    ``empty_group``: every file starts with a row group of zero rows."""
    layout, start = [], 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n, dtype=np.int64)
        x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3)
        offsets = pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32))
        table = pa.table({"x": pa.ListArray.from_arrays(offsets, x.flatten()), "id": ids})
        name = f"part-{i}.parquet"
        with pq.ParquetWriter(root / name, table.schema) as writer:
            if empty_group:
                writer.write_table(table.slice(0, 0))
            writer.write_table(table, row_group_size=row_group_size)
        meta = pq.ParquetFile(root / name).metadata
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        if empty_group:
            assert groups[0] == 0
        layout.append([name, groups if n else []])
        start += n
    return layout


def read_all(root, layout, world, batch, shuffle=False, epoch=0, columns=COLUMNS, **options):
    per_rank = []
    for rank in range(world):
        reader = ShardReader(str(root), layout, columns, rank, world, batch, shuffle, seed=3,
                             **options)
        batches = list(reader.epoch(epoch))
        assert len(batches) == len(reader)
        for b in batches:
            assert b["x"].shape == (len(b["id"]), 3)
            np.testing.assert_array_equal(b["x"][:, 0], b["id"].astype(np.float32))
        reader.close()
        per_rank.append(batches)
    return per_rank


def check_shards(per_rank, total, world, batch):
    """What keeps collectives from hanging and training honest: every rank yields the same
    number of batches, step by step of the same size (full batches, then one last batch), every
    row is seen, and at most ``world - 1`` rows are seen twice (one per rank short of a row)."""
    assert {len(batches) for batches in per_rank} == {steps_per_epoch(total, world, batch)}
    for step in range(len(per_rank[0])):
        sizes = {len(batches[step]["id"]) for batches in per_rank}
        assert len(sizes) == 1, f"step {step}: batch sizes differ between ranks: {sizes}"
        if step < len(per_rank[0]) - 1:
            assert sizes == {batch}
    ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
    assert set(ids.tolist()) == set(range(total))
    assert len(ids) - total <= world - 1
    for batches in per_rank:  # no row twice within one rank's epoch
        mine = np.concatenate([b["id"] for b in batches])
        assert len(set(mine.tolist())) == len(mine)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("sizes,world,batch,empty_group", [
    ([100], 2, 16, False),                # one file, even split
    ([37, 0, 5, 61], 3, 8, False),        # uneven files and an empty one
    ([3], 4, 2, False),                   # more ranks than rows: one rank's range is empty
    ([3], 8, 1, False),                   # more than twice as many ranks as rows
    ([1], 3, 4, False),                   # a single row for everyone
    ([10, 10], 7, 4, False),              # more ranks than row groups
    ([1, 500, 2], 4, 32, False),          # very uneven files
    ([20, 9], 3, 4, True),                # files starting with a zero-row row group
    ([1000], 1, 1000, False),             # one batch is the whole shard
])
def test_every_rank_same_steps_and_every_row_once(tmp_path, sizes, world, batch, empty_group,
                                                   shuffle):
    layout = write_dataset(tmp_path, sizes, empty_group=empty_group)
    per_rank = read_all(tmp_path, layout, world, batch, shuffle)
    check_shards(per_rank, sum(sizes), world, batch)


def test_shuffle_is_a_permutation_that_changes_per_epoch(tmp_path):
    layout = write_dataset(tmp_path, [50, 50], row_group_size=10)
    first = np.concatenate([b["id"] for b in read_all(tmp_path, layout, 1, 8, True, 0)[0]])
    second = np.concatenate([b["id"] for b in read_all(tmp_path, layout, 1, 8, True, 1)[0]])
    again = np.concatenate([b["id"] for b in read_all(tmp_path, layout, 1, 8, True, 0)[0]])
    assert sorted(first.tolist()) == list(range(100)) == sorted(second.tolist())
    assert first.tolist() != list(range(100))
    assert first.tolist() != second.tolist()
    assert first.tolist() == again.tolist()  # same seed and epoch: same order


def test_shard_arithmetic():
    assert [shard_range(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    pieces = shard_pieces([["a", [4, 4]], ["b", [4]]], 3, 9)
    assert [(p.file, p.group, p.lo, p.hi) for p in pieces] == [
        (0, 0, 3, 4), (0, 1, 0, 4), (1, 0, 0, 1)]
    assert steps_per_epoch(10, 3, 2) == 2


def test_reader_error_in_background_thread_surfaces(tmp_path):
    layout = write_dataset(tmp_path, [20])
    (tmp_path / "part-0.parquet").unlink()
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 4)
    with pytest.raises(FileNotFoundError):
        list(reader.epoch(0))


# -- datasets materialized by Spark ---------------------------------------------------------------
@pytest.fixture(scope="module")
def skewed(spark, tmp_path_factory):
    """Real materialized datasets with awkward layouts: ``{name: (dataset, split)}``; ids are
    0..N-1 in file order, ``x = [id, 2 id, -id]`` (a vector column)."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from sparktrain.data.materialize import materialize
    from sparktrain.data.schema import training_columns
    from sparktrain.data.store import Store

    store = Store.create(str(tmp_path_factory.mktemp("skewed-store")))

    def frame(df):
        x = F.array(F.col("id").cast("double"), (2 * F.col("id")).cast("double"),
                    (-F.col("id")).cast("double"))
        return df.select(array_to_vector(x).alias("x"), "id", *[c for c in df.columns if c != "id"])

    # one partition of 1 row beside two of 1000
    union = frame(spark.range(0, 2000, numPartitions=2)
                  .union(spark.range(2000, 2001, numPartitions=1)))
    # 8 partitions by a skewed key: one holds 1990 rows, a few hold 1-10, the rest are empty
    hot = spark.range(0, 2001).withColumn(
        "key", F.when(F.col("id") < 1990, 0).otherwise(F.col("id") % 3 + 1))
    repartitioned = frame(hot.repartition(8, "key")).drop("key")
    tiny = frame(spark.range(0, 3, numPartitions=3))  # 3 rows in 3 files
    # validation: 1 row of 301, so the val split has fewer rows than ranks
    flagged = frame(spark.range(0, 301, numPartitions=3).withColumn("is_val", F.col("id") == 150))

    out = {}
    for name, df, validation in [("union", union, None), ("repartitioned", repartitioned, None),
                                 ("tiny", tiny, None), ("val", flagged, "is_val")]:
        columns = training_columns(df, ["x"], ["id"])
        out[name] = materialize(df, store, columns, validation=validation)
    return out


def renumbered(per_rank, dataset, split):
    """Replace ids by their position in the split's global row order (file order), so that
    rows are 0..N-1 whatever ids the split holds; checks x = [id, 2 id, -id] on the way."""
    everything = ShardReader(dataset.root, dataset.files[split], dataset.columns, 0, 1, 1 << 20)
    ids = next(everything.epoch(0))["id"]
    position = {v: i for i, v in enumerate(ids.tolist())}
    assert len(position) == len(ids) == dataset.rows[split]
    for batches in per_rank:
        for b in batches:
            np.testing.assert_array_equal(b["x"], np.stack([b["id"], 2 * b["id"], -b["id"]], 1))
            b["id"] = np.array([position[v] for v in b["id"].tolist()], dtype=np.int64)
    return per_rank


@pytest.mark.parametrize("name,split,worlds,batch", [
    ("union", "train", [1, 2, 3, 5], 64),
    ("repartitioned", "train", [2, 3, 7], 100),
    ("tiny", "train", [2, 3, 4, 5], 2),       # more ranks than rows (and than row groups)
    ("tiny", "train", [4], 1),
    ("val", "val", [2, 3], 8),                # 1 row: every rank but one has an empty range
    ("val", "train", [2, 4], 16),
])
def test_materialized_skewed_layouts(skewed, name, split, worlds, batch):
    dataset = skewed[name]
    layout = dataset.files[split]
    if name == "repartitioned":
        file_rows = sorted(sum(groups) for _, groups in layout)
        assert file_rows[-1] >= 1990 and file_rows[0] <= 10, file_rows  # the skew is real
    total = dataset.rows[split]
    for world in worlds:
        if world > total:
            assert any(shard_range(total, r, world)[0] == shard_range(total, r, world)[1]
                       for r in range(world))
        for shuffle in (False, True):
            per_rank = []
            for rank in range(world):
                reader = ShardReader(dataset.root, layout, dataset.columns, rank, world, batch,
                                     shuffle, seed=11)
                per_rank.append(list(reader.epoch(1)))
                assert len(per_rank[-1]) == len(reader)
                reader.close()
            check_shards(renumbered(per_rank, dataset, split), total, world, batch)


# -- inmemory_cache_all ---------------------------------------------------------------------------
def owner(array):
    """What holds ``array``'s memory: the numpy array that owns it, or a mapping."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    base = array.base.obj if isinstance(array.base, memoryview) else array.base
    return array if base is None else base


def owner_bytes(array):
    """Size of the memory that ``array`` keeps alive."""
    root = owner(array)
    return root.nbytes if isinstance(root, np.ndarray) else len(root)


def epochs_of(reader, epochs):
    return [[{k: v.copy() for k, v in b.items()} for b in reader.epoch(e)] for e in range(epochs)]


def count_reads(reader, monkeypatch):
    reads = []
    original = reader._read

    def read(piece):
        reads.append(piece)
        return original(piece)

    monkeypatch.setattr(reader, "_read", read)
    return reads


@pytest.mark.parametrize("shuffle", [False, True])
def test_inmemory_cache_all_yields_the_same_batches_and_reads_files_once(tmp_path, monkeypatch,
                                                                         shuffle):
    layout = write_dataset(tmp_path, [37, 0, 23, 41], row_group_size=10)
    plain = ShardReader(str(tmp_path), layout, COLUMNS, 1, 3, 8, shuffle, seed=5)
    cached = ShardReader(str(tmp_path), layout, COLUMNS, 1, 3, 8, shuffle, seed=5,
                         inmemory_cache_all=True)
    plain_reads, cached_reads = count_reads(plain, monkeypatch), count_reads(cached, monkeypatch)
    expected = epochs_of(plain, 3)
    assert len(plain_reads) == 3 * len(plain.pieces)  # without the cache: every epoch reads

    first = next(iter(cached.epoch(0)))  # an abandoned epoch fills the cache only partly
    np.testing.assert_array_equal(first["id"], expected[0][0]["id"])
    got = epochs_of(cached, 1)
    assert len(cached_reads) == len(cached.pieces)  # the abandoned epoch's reads were kept
    for path in tmp_path.glob("*.parquet"):  # later epochs must not touch the files
        path.unlink()
    got += epochs_of(cached, 3)[1:]
    assert len(cached_reads) == len(cached.pieces)
    assert not cached._handles  # nothing left to read: the files were closed

    assert len(got) == len(expected) == 3
    for mine, theirs in zip(got, expected, strict=True):
        assert [b["id"].tolist() for b in mine] == [b["id"].tolist() for b in theirs]
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a["x"], b["x"])
    if shuffle:
        assert got[0][0]["id"].tolist() != got[1][0]["id"].tolist()
    # the cache holds the shard, not whole row groups around its ends (compact arrays)
    assert sum(len(chunk["id"]) for chunk in cached._cache.values()) == cached.rows_per_epoch
    assert all(owner_bytes(v) == v.nbytes
               for chunk in cached._cache.values() for v in chunk.values())
    cached.close()
    assert not cached._cache
    with pytest.raises(FileNotFoundError):  # after close() the files are needed again
        list(cached.epoch(0))


@pytest.mark.parametrize("shuffle", [False, True])
def test_writing_to_a_batch_does_not_change_the_cache(tmp_path, shuffle):
    layout = write_dataset(tmp_path, [30], row_group_size=30)
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 8, shuffle, inmemory_cache_all=True)
    for b in reader.epoch(0):
        b["x"][:] = -1  # e.g. a model whose first layer is ReLU(inplace=True)
    for b in reader.epoch(1):
        np.testing.assert_array_equal(b["x"][:, 0], b["id"].astype(np.float32))


def test_large_row_groups_live_in_their_own_mappings(tmp_path):
    layout = write_dataset(tmp_path, [150_000], row_group_size=100_000)
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 4096, shuffle=True,
                         inmemory_cache_all=True)
    ids = np.concatenate([b["id"] for b in reader.epoch(0)])
    assert sorted(ids.tolist()) == list(range(150_000))
    big, small = sorted(reader._cache.values(), key=lambda chunk: -len(chunk["id"]))
    assert isinstance(owner(big["x"]), mmap.mmap)  # 1.2 MB: a mapping of its own
    assert owner_bytes(big["x"]) == 100_000 * 12
    assert isinstance(owner(small["x"]), np.ndarray)  # 600 KB: an ordinary array
    assert owner_bytes(small["x"]) == 50_000 * 12
    np.testing.assert_array_equal(big["x"][:, 0], big["id"].astype(np.float32))
    assert sum(len(b["id"]) for b in reader.epoch(1)) == 150_000


# -- open files -----------------------------------------------------------------------------------
def open_fds(under):
    """Descriptors of this process open on files under `under` (other fds come and go with
    the rest of the suite: Spark's sockets, a previous test's objects being collected)."""
    import os

    root = str(under)
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith(root)
        except OSError:  # closed between listdir and readlink
            pass
    return found


def test_open_files_are_bounded_and_closed(tmp_path):
    layout = write_dataset(tmp_path, [9] * 12, row_group_size=4)
    assert open_fds(tmp_path) == 0
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 5, shuffle=True, seed=1,
                         open_files=3)
    for epoch in range(3):
        ids = np.concatenate([b["id"] for b in reader.epoch(epoch)])
        assert sorted(ids.tolist()) == list(range(108))
        assert len(reader._handles) <= 3
        assert 0 < open_fds(tmp_path) <= 3  # the handles kept are real open files
    assert len(reader._footers) == 12  # footers are kept (small), handles are not
    reader.close()
    assert not reader._handles and open_fds(tmp_path) == 0


def test_a_row_group_with_fewer_rows_than_the_layout_says_is_an_error(tmp_path):
    layout = write_dataset(tmp_path, [20], row_group_size=10)
    layout[0][1] = [10, 12]
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 4, prefetch=0)
    with pytest.raises(ValueError, match="row group 1 has 10 rows, expected at least 12"):
        list(reader.epoch(0))


# -- end to end -----------------------------------------------------------------------------------
@pytest.mark.timeout(180)  # a rank waiting for a collective its peer never joins fails here
def test_two_rank_fit_on_a_skewed_frame_finishes(spark, tmp_path):
    """1 row in one partition, 250 in another, 0 in the rest, and a validation split of one
    row: both ranks run the same steps (a hang would time the test out)."""
    import torch
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from sparktrain import TorchEstimator

    slices = [[], list(range(250)), [1000], []]  # one list per partition
    base = spark.sparkContext.parallelize(slices, len(slices)).flatMap(
        lambda ids: [(i,) for i in ids])
    df = (spark.createDataFrame(base, "id long")
          .select(array_to_vector(F.array((F.col("id") % 7).cast("double"),
                                          (F.col("id") % 3).cast("double"))).alias("features"),
                  (F.col("id") % 7 - F.col("id") % 3).cast("double").alias("label"),
                  (F.col("id") == 1000).alias("is_val")))
    sizes = sorted(df.rdd.glom().map(len).collect())
    assert sizes == [0, 0, 1, 250], sizes
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                         batch_size=32, epochs=2, validation="is_val", shuffle=True,
                         random_seed=1, store=str(tmp_path), verbose=0)
    history = est.fit(df).getHistory()
    assert len(history["loss"]) == len(history["val_loss"]) == 2
    assert all(np.isfinite(v) for values in history.values() for v in values)
