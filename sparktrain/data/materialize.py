"""Turn the columns a fit needs into a Parquet dataset in the store, once per DataFrame plan.

The dataset is plain Parquet written by Spark (what Petastorm's ``make_batch_reader`` and its
Spark converter read) with fixed-size float32/int64 columns, split into ``split=train`` and
``split=val`` directories of one attempt directory, published by a commit file (columns, row
counts, row groups) written last: a dataset without one is never read, so concurrent or
crashed writers never leave a half-written dataset behind (:mod:`sparktrain.data.commit`).

Data checks run inside the same write job (``raise_error``), so a bad row costs no extra scan.

Example::

    ds = materialize(df, Store.create("/tmp/st"), training_columns(df, ["x"], ["y"]))
    ds.train_rows, ds.path("train")
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sparktrain.data.columns import (
    BINARY,
    IMAGE,
    SPLIT_COL,
    ColumnSpec,
)
from sparktrain.data.commit import ATTEMPTS, Commit, DatasetDirectory
from sparktrain.data.lease import DEFAULT_TTL_SECONDS, Lease, live_leases
from sparktrain.data.prepare import (
    data_error_message,
    fail_if,
    nullable_elements,
    prepared_column,
    ragged_array_message,
    sized_columns,
)
from sparktrain.data.store import Store
from sparktrain.fs import out_of_space, spark_filesystem_missing, store_full
from sparktrain.session.spark_api import conf_value, plan_fingerprint

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: attempts + commit files (sparktrain.data.commit)
ROW_GROUP_BYTES = 32 * 1024 * 1024


@dataclass
class MaterializedDataset:
    """A materialized dataset: where it is, its columns, its row counts per split."""

    root: str
    columns: List[ColumnSpec]
    rows: Dict[str, int]
    key: str
    reused: bool = False
    seconds: float = 0.0
    files: Dict[str, List[List]] = field(default_factory=dict)  # split -> [[file, [rg rows]]]

    @property
    def train_rows(self) -> int:
        return self.rows.get("train", 0)

    @property
    def val_rows(self) -> int:
        return self.rows.get("val", 0)

    def path(self, split: str) -> str:
        return f"{self.root}/{SPLIT_COL}={split}"


def plan_key(df: DataFrame, columns: Sequence[ColumnSpec], validation: Union[None, float, str],
             seed: Optional[int], variable_length: bool = False) -> str:
    """A key that is equal for the same DataFrame plan, columns and split.

    The analyzed plan's semantic hash covers local data (``LocalRelation``) and RDD identity;
    the plan text without expression ids and the input file list cover file sources. The hash
    is per JVM for some plans (local data; a chain of three or more additions, whose operands
    canonicalization reorders): those datasets are reused within one driver only.
    """
    parts = [str(FORMAT_VERSION), plan_fingerprint(df), "\n".join(sorted(df.inputFiles())),
             json.dumps([c.to_json() for c in columns]), repr(validation), repr(seed)]
    if variable_length:  # keys of earlier datasets stay as they were
        parts.append("variable_length")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def _codec(store: Store, columns: Sequence[ColumnSpec]) -> str:
    """No compression on local disks: decoding, not disk bandwidth, bounds reading there
    (measured at 1M x 32 floats: 5.6M rows/s uncompressed vs 3.2M with snappy, and a faster
    write), nor for bytes (encoded JPEG/PNG do not compress further: snappy would only cost
    time). Snappy where numbers cross a network (HDFS, object stores)."""
    if store.is_local or any(c.kind in (BINARY, IMAGE) for c in columns):
        return "none"
    return "snappy"


def _row_groups(store: Store, root: str) -> Dict[str, List[List]]:
    """``{split: [[file relative to root, [rows per row group]], ...]}`` from Parquet footers."""
    import pyarrow.parquet as pq

    fs = store.fs
    base = fs._strip_protocol(root).rstrip("/")  # fs.find() answers without the protocol
    layout: Dict[str, List[List]] = {}
    for split in ("train", "val"):
        directory = f"{base}/{SPLIT_COL}={split}"
        files = sorted(p for p in (fs.find(directory) if fs.exists(directory) else [])
                       if p.endswith(".parquet"))
        layout[split] = []
        for path in files:
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            if sum(groups):
                layout[split].append([path[len(base) + 1:], groups])
    return layout


LEASE_CONF = "spark.sparktrain.leaseSeconds"
_WAIT_POLL_SECONDS = 0.5


def lease_seconds(spark: Any) -> float:
    """How long a lease outlives its writer's last sign of life (``spark.sparktrain.
    leaseSeconds``, default 60): a waiter takes over a crashed writer's dataset or run after
    that long (at once when the writer was a process on this host that is gone)."""
    return float(conf_value(spark, LEASE_CONF, None) or DEFAULT_TTL_SECONDS)


def materialize(df: DataFrame, store: Store, columns: Sequence[ColumnSpec],
                validation: Union[None, float, str] = None, seed: Optional[int] = None,
                variable_length: bool = False) -> MaterializedDataset:
    """Write ``columns`` of ``df`` to ``store`` (or reuse an earlier write of the same plan).

    ``variable_length``: 1-D array columns whose lengths vary are stored as ``varlen`` (a
    ``transformation_fn`` will make them one length) instead of failing the write.

    Safe with concurrent fits (threads or drivers) on one store: see
    :mod:`sparktrain.data.commit`. A second writer of the same key waits for the first
    (logging who it waits for) and reuses its commit.
    """
    start = time.perf_counter()
    key = plan_key(df, columns, validation, seed, variable_length)
    fs = store.fs
    directory = DatasetDirectory(fs, fs._strip_protocol(store.dataset_path(key)))
    ttl = lease_seconds(df.sparkSession)
    waiting_for = None
    while True:
        found = directory.committed()
        if found is not None:
            directory.collect_garbage()
            return _reused(store, key, found, start)
        holders = live_leases(fs, directory.leases)
        if holders:
            if waiting_for != holders[0].owner:
                waiting_for = holders[0].owner
                log.info("waiting for %s, which is writing the same dataset to %s",
                         holders[0].describe(), store.dataset_path(key))
            time.sleep(_WAIT_POLL_SECONDS)
            continue
        lease = Lease.acquire(fs, directory.leases, ttl, note="a materialization")
        try:
            if not lease.first():  # another writer took its lease at the same moment
                continue
            found = directory.committed()  # committed between our look and our lease
            if found is not None:
                return _reused(store, key, found, start)
            directory.collect_garbage()
            return _write(df, store, columns, validation, seed, variable_length, key,
                          directory, lease, start)
        except BaseException:
            lease.release()
            directory.remove_empty()  # a failed first write leaves no trace
            raise
        finally:
            lease.release()


def _reused(store: Store, key: str, found: Commit, start: float) -> MaterializedDataset:
    meta = found.meta
    root = f"{store.dataset_path(key)}/{ATTEMPTS}/{found.attempt}"
    log.info("reusing materialized dataset %s (%s train rows)", root, meta["rows"].get("train"))
    return MaterializedDataset(root, [ColumnSpec.from_json(c) for c in meta["columns"]],
                               meta["rows"], key, True, time.perf_counter() - start,
                               meta.get("files", {}))


def _write(df: DataFrame, store: Store, columns: Sequence[ColumnSpec],
           validation: Union[None, float, str], seed: Optional[int], variable_length: bool,
           key: str,
           directory: DatasetDirectory, lease: Lease, start: float) -> MaterializedDataset:
    """Write one attempt of the dataset and commit it (the caller holds ``lease``)."""
    attempt = lease.owner
    root = f"{store.dataset_path(key)}/{ATTEMPTS}/{attempt}"
    specs = sized_columns(df, columns, variable_length)
    nullable = {f.name: nullable_elements(f.dataType) for f in df.schema.fields}
    selected = [expr for spec in specs
                for expr in prepared_column(spec, nullable[spec.name])]
    writer_df = df.select(*selected, *split_column(df, validation, seed))
    writer = (writer_df.write.mode("overwrite")
              .option("parquet.block.size", ROW_GROUP_BYTES)
              .option("compression", _codec(store, specs)))
    target = store.spark_path("datasets", key, ATTEMPTS, attempt)
    try:
        if validation:
            writer.partitionBy(SPLIT_COL).parquet(target)
        else:
            writer.parquet(f"{target}/{SPLIT_COL}=train")
        files = _row_groups(store, root)
        rows = {split: sum(sum(groups) for _, groups in layout) for split, layout in files.items()}
        if rows["train"] == 0:
            raise ValueError(f"validation={validation!r} left no rows for training")
        if validation and rows["val"] == 0:
            raise ValueError(f"validation={validation!r} selected no rows; use a larger "
                             f"fraction or mark some rows True in the validation column")
        if not lease.held():
            raise RuntimeError(f"the lease on {root} expired while Spark wrote it (the store "
                               f"was unreachable for over {lease.ttl:g}s?); fit again")
    except Exception as exc:  # a failed check inside the job, or a genuine write error
        written = _bytes_under(store.fs, root) if out_of_space(exc) else 0
        directory.remove_attempt(attempt)  # the space goes back; nothing half-written is kept
        if out_of_space(exc):
            row = sum(_row_bytes(spec) for spec in specs)
            raise store_full(store.fs, root, None, exc, what=f"the dataset to {root}", note=(
                f" (the write stopped after {written / 2**20:.1f} MiB; a row takes {row} "
                f"bytes before compression)")) from None
        message = data_error_message(exc)
        if message:
            raise ValueError(ragged_array_message(df, specs, message)) from None
        missing = spark_filesystem_missing(exc, target)
        if missing:
            raise RuntimeError(f"cannot write the dataset to {target}: {missing}") from None
        raise
    directory.commit(attempt, {"format": FORMAT_VERSION, "columns": [c.to_json() for c in specs],
                               "rows": rows, "files": files, "created": time.time()})
    seconds = time.perf_counter() - start
    log.info("materialized %d train / %d validation rows to %s in %.1fs",
             rows["train"], rows["val"], root, seconds)
    return MaterializedDataset(root, specs, rows, key, False, seconds, files)


def _bytes_under(fs: Any, path: str) -> int:
    try:
        return int(fs.du(path))
    except (OSError, ValueError):
        return 0


def _row_bytes(spec: ColumnSpec) -> int:
    """A row's bytes of ``spec`` before compression (fixed-size columns; 0 for the others)."""
    try:
        return int(np.prod(spec.row_shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    except (TypeError, ValueError):
        return 0


def split_column(df: DataFrame, validation: Union[None, float, str], seed: Optional[int]
                  ) -> List[Column]:
    if not validation:
        return []
    if isinstance(validation, str):
        flag = F.col(f"`{validation}`")
        flag = F.coalesce(fail_if(flag.isNull(), F.lit(
            f"validation column {validation!r} contains nulls; expected True/False on every row")),
            flag)
    else:
        if not 0.0 < validation < 1.0:
            raise ValueError(f"validation must be a fraction in (0, 1), got {validation!r}")
        flag = F.rand(seed if seed is not None else 0) < F.lit(validation)
    return [F.when(flag, F.lit("val")).otherwise(F.lit("train")).alias(SPLIT_COL)]
