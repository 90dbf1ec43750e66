"""Sharding: every rank runs the same steps, rows are read once, nothing hangs on odd layouts."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparktrain.data.reader import ShardReader, shard_pieces, shard_range, steps_per_epoch
from sparktrain.data.schema import ARRAY, SCALAR, ColumnSpec

COLUMNS = [ColumnSpec("x", ARRAY, "float32", 3), ColumnSpec("id", SCALAR, "int64", 1)]


def write_dataset(root, sizes, row_group_size=7):
    """Files of ``sizes`` rows (ids 0..N-1 in order, x = [id, id, id]); returns the layout."""
    layout, start = [], 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n, dtype=np.int64)
        x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3)
        table = pa.table({"x": pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)), x.flatten()),
                          "id": ids})
        name = f"part-{i}.parquet"
        pq.write_table(table, root / name, row_group_size=row_group_size)
        groups = [pq.ParquetFile(root / name).metadata.row_group(g).num_rows
                  for g in range(pq.ParquetFile(root / name).metadata.num_row_groups)]
        layout.append([name, groups if n else []])
        start += n
    return layout


def read_all(root, layout, world, batch, shuffle=False, epoch=0):
    per_rank = []
    for rank in range(world):
        reader = ShardReader(str(root), layout, COLUMNS, rank, world, batch, shuffle, seed=3)
        batches = list(reader.epoch(epoch))
        assert len(batches) == len(reader)
        for b in batches:
            assert b["x"].shape == (len(b["id"]), 3)
            np.testing.assert_array_equal(b["x"][:, 0], b["id"].astype(np.float32))
        per_rank.append(batches)
    return per_rank


@pytest.mark.parametrize("sizes,world,batch", [
    ([100], 2, 16),                 # one file, even split
    ([37, 0, 5, 61], 3, 8),         # uneven files and an empty one
    ([3], 4, 2),                    # more ranks than rows
    ([10, 10], 7, 4),               # more ranks than row groups
    ([1000], 1, 1000),              # one batch is the whole shard
])
def test_every_rank_same_steps_and_every_row_once(tmp_path, sizes, world, batch):
    layout = write_dataset(tmp_path, sizes)
    total = sum(sizes)
    per_rank = read_all(tmp_path, layout, world, batch)
    steps = {len(batches) for batches in per_rank}
    assert steps == {steps_per_epoch(total, world, batch)}
    # same batch sizes step by step on every rank (collectives see equal shapes)
    for step in range(len(per_rank[0])):
        assert len({len(batches[step]["id"]) for batches in per_rank}) == 1
    ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
    assert set(ids.tolist()) == set(range(total))
    # at most one repeated row per rank (a rank one row short of the largest shard)
    assert len(ids) - total <= world


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
    assert [(p.file, p.group, p.lo, p.hi) for p in pieces] == [(0, 0, 3, 4), (0, 1, 0, 4), (1, 0, 0, 1)]
    assert steps_per_epoch(10, 3, 2) == 2


def test_reader_error_in_background_thread_surfaces(tmp_path):
    layout = write_dataset(tmp_path, [20])
    (tmp_path / "part-0.parquet").unlink()
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 4)
    with pytest.raises(FileNotFoundError):
        list(reader.epoch(0))
