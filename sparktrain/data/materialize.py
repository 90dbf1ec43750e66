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
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from pyspark.ml.functions import vector_to_array
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sparktrain.data.batch import values_to_numpy
from sparktrain.data.columns import (
    ARRAY,
    BINARY,
    IMAGE,
    IMAGE_FIELDS,
    SCALAR,
    SPLIT_COL,
    STRING,
    VARLEN,
    VECTOR,
    ColumnSpec,
)
from sparktrain.data.commit import ATTEMPTS, Commit, DatasetDirectory
from sparktrain.data.lease import DEFAULT_TTL_SECONDS, Lease, live_leases
from sparktrain.data.store import Store
from sparktrain.fs import out_of_space, store_full
from sparktrain.session.spark_api import conf_value, plan_fingerprint

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: attempts + commit files (sparktrain.data.commit)
ROW_GROUP_BYTES = 32 * 1024 * 1024
_ERROR_TAG = "sparktrain-data-error: "


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
    # input_mode="stream": nothing in the store; the training stage reads this DataFrame's rows
    # (its columns in their stored form, and the split column) and each rank spools its own
    stream: Any = field(default=None, repr=False)

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


def _fail_if(condition: Column, message: Column) -> Column:
    return F.when(condition, F.raise_error(F.concat(F.lit(_ERROR_TAG), message)))


# Two values no real feature array holds both of (see _has_null_element).
_SENTINELS = {"float": (1.2345678e-37, -9.8765432e36), "bigint": (-(2 ** 63) + 7, 2 ** 63 - 11)}


def _has_null_element(value: Column, element: str) -> Column:
    """True when a (non-null) array holds a null element.

    ``array_contains(a, x)`` is NULL exactly when ``a`` holds a null and not ``x`` (SQL's
    three-valued logic), and unlike ``exists(a, x -> x IS NULL)`` it keeps the write inside
    whole-stage code generation (measured: ``exists`` cost 0.3-0.4 s per 1M rows x 32). Two
    unlikely sentinels make a miss need an array holding a null *and* both of them.
    """
    first, second = (F.lit(v).cast(element) for v in _SENTINELS[element])
    return F.array_contains(value, first).isNull() | F.array_contains(value, second).isNull()


def _flat(col: Column, depth: int) -> Column:
    """A nested array column flattened to 1-D (stored flat; its shape is in the ColumnSpec)."""
    for _ in range(depth - 1):
        col = F.flatten(col)
    return col


def stored_value(spec: ColumnSpec) -> Column:
    """A column in the form it is stored and fed with: numbers in their element type (vectors
    and nested arrays as flat float32/int64 arrays), bytes and strings as they are, Spark's
    image struct reduced to its size, mode and bytes."""
    col = F.col(f"`{spec.name}`")
    if spec.kind in (BINARY, STRING):
        return col
    if spec.kind == IMAGE:
        return F.struct(*[col.getField(name).alias(name) for name in IMAGE_FIELDS])
    element = "float" if spec.dtype == "float32" else "bigint"
    if spec.kind == SCALAR:
        return col.cast(element)
    if spec.kind == VECTOR:
        return vector_to_array(col, "float32")
    return _flat(col, spec.depth).cast(f"array<{element}>")


def sample_batch(df: DataFrame, columns: Sequence[ColumnSpec], rows: int,
                 partial: bool = False) -> Optional[Dict[str, Any]]:
    """Up to ``rows`` rows of ``columns`` as a batch in the form training reads them
    (:mod:`sparktrain.data.batch`), from one small job (``limit``). ``None`` when the first
    rows cannot form a batch (empty, nulls, ragged or shapeless arrays): materialization's
    checks then report the data problem precisely. ``partial=True`` leaves such a column out
    of the batch instead (``None`` only for no rows)."""
    # collect, not toPandas: a few rows need no Arrow set-up (measured: 0.23 vs 0.27 s warm)
    found = df.select(*[stored_value(c).alias(c.name) for c in columns]).limit(rows).collect()
    if not found:
        return None
    batch = {}
    for i, spec in enumerate(columns):
        value = _sampled(df, spec, [row[i] for row in found])
        if value is None and not partial:
            return None
        if value is not None:
            batch[spec.name] = value
    return batch


def _sampled(df: DataFrame, spec: ColumnSpec, values: List[Any]) -> Optional[Any]:
    """One sampled column in its training form, or ``None`` (nulls, ragged arrays)."""
    if any(v is None or (spec.kind in (ARRAY, VECTOR, VARLEN) and None in v) for v in values):
        return None
    try:
        if spec.kind == ARRAY and spec.shape and None in spec.shape:
            spec = _shaped(spec, _nested_shape(df, spec))
        return values_to_numpy(values, spec)
    except (ValueError, TypeError):  # ragged arrays
        return None


def _nested_shape(df: DataFrame, spec: ColumnSpec) -> List[int]:
    """The per-level sizes of the first row of a nested array column (one tiny job)."""
    col, probes = F.col(f"`{spec.name}`"), []
    for _ in range(spec.depth):
        probes.append(F.size(col))
        col = col.getItem(0)
    first = df.select(*probes).first()
    return [int(v) for v in first] if first is not None else []


def _shaped(spec: ColumnSpec, shape: List[int]) -> ColumnSpec:
    size = 1
    for dim in shape:
        size *= dim
    return ColumnSpec(spec.name, spec.kind, spec.dtype, size, shape)


def _shape_ok(col: Column, dims: Sequence[int]) -> Column:
    """True when a nested array has exactly the shape ``dims`` at every level."""
    if len(dims) == 1:
        return F.size(col) == F.lit(dims[0])
    return (F.size(col) == F.lit(dims[0])) & F.forall(col, lambda x: _shape_ok(x, dims[1:]))


def _row_shape_text(col: Column, depth: int) -> Column:
    """The sizes along a row's first elements, as text ("3, 2"), for error messages."""
    parts = []
    for _ in range(depth):
        parts.append(F.coalesce(F.size(col).cast("string"), F.lit("?")))
        col = col.getItem(0)
    return F.concat_ws(", ", *parts)


def prepared_column(spec: ColumnSpec, nullable_elements: bool) -> List[Column]:
    """The stored form of one column, and checks that abort the write on a bad row."""
    name = spec.name
    col = F.col(f"`{name}`")
    nulls = (f"column {name!r} contains nulls; expected no nulls (drop or fill them, e.g. "
             f"df.na.drop(subset=[{name!r}]))")
    checks = [_fail_if(col.isNull(), F.lit(nulls))]
    value = stored_value(spec)
    if spec.kind == IMAGE:
        checks.append(_fail_if(col.getField("data").isNull(),
                               F.lit(f"image column {name!r} has rows without data (images "
                                     f"Spark could not decode: read with dropInvalid=true)")))
    if spec.kind in (ARRAY, VECTOR, VARLEN):
        element = "float" if spec.dtype == "float32" else "bigint"
        if spec.kind == ARRAY and spec.shape:
            expected = ", ".join(str(d) for d in spec.shape)
            checks.append(_fail_if(
                ~_shape_ok(col, spec.shape),
                F.concat(F.lit(f"column {name!r} has a row of shape ("),
                         _row_shape_text(col, spec.depth),
                         F.lit(f", ...); expected every row to have the shape ({expected}) of "
                               f"the first row"))))
        elif spec.kind != VARLEN:
            checks.append(_fail_if(
                F.size(value) != F.lit(spec.size),
                F.concat(F.lit(f"column {name!r} has rows of different lengths; expected every "
                               f"row to have {spec.size} elements like the first row, found "),
                         F.size(value).cast("string"))))
        if spec.kind != VECTOR and nullable_elements:
            checks.append(_fail_if(_has_null_element(value, element),
                                   F.lit(f"column {name!r} has arrays containing nulls; "
                                         f"expected numbers only")))
    guarded = F.coalesce(*checks, value) if checks else value
    return [guarded.alias(name)]


def _codec(store: Store, columns: Sequence[ColumnSpec]) -> str:
    """No compression on local disks: decoding, not disk bandwidth, bounds reading there
    (measured at 1M x 32 floats: 5.6M rows/s uncompressed vs 3.2M with snappy, and a faster
    write), nor for bytes (encoded JPEG/PNG do not compress further: snappy would only cost
    time). Snappy where numbers cross a network (HDFS, object stores)."""
    if store.is_local or any(c.kind in (BINARY, IMAGE) for c in columns):
        return "none"
    return "snappy"


def sized_columns(df: DataFrame, columns: Sequence[ColumnSpec], variable_length: bool
           ) -> List[ColumnSpec]:
    """``columns`` with sizes and shapes from the first row (one tiny job); 1-D arrays whose
    lengths vary become ``varlen`` when ``variable_length`` (one more job over those columns).
    Raises ``ValueError`` for an empty DataFrame."""
    probe = [F.lit(1).alias("__row")]
    for c in columns:
        col = F.col(f"`{c.name}`")
        if c.kind == VECTOR:
            probe.append(F.size(vector_to_array(col)).alias(c.name))
        elif c.kind == ARRAY:
            probe.append(_row_shape_text(col, c.depth).alias(c.name))
    first = df.select(*probe).first()
    if first is None:
        raise ValueError("the DataFrame is empty; expected at least one row to train on")
    sized = []
    for c in columns:
        if c.kind == VECTOR:
            c = ColumnSpec(c.name, c.kind, c.dtype, first[c.name])
        elif c.kind == ARRAY:
            dims = [int(d) if d.isdigit() else 0 for d in (first[c.name] or "").split(", ")]
            c = _shaped(c, dims) if c.shape else ColumnSpec(c.name, c.kind, c.dtype, dims[0])
        sized.append(c)
    flat = [c for c in sized if c.kind == ARRAY and not c.shape]
    if variable_length and flat:
        ranges = length_ranges(df, [c.name for c in flat])
        sized = [ColumnSpec(c.name, VARLEN, c.dtype, None)
                 if c in flat and ranges[c.name][0] != ranges[c.name][1] else c for c in sized]
    return sized


def length_ranges(df: DataFrame, names: Sequence[str]) -> Dict[str, Tuple[int, int]]:
    """``{column: (shortest, longest)}`` array lengths of ``names`` (one aggregation job)."""
    aggs = []
    for name in names:
        aggs += [F.min(F.size(F.col(f"`{name}`"))), F.max(F.size(F.col(f"`{name}`")))]
    row = df.agg(*aggs).first()
    return {name: (int(row[2 * i] or 0), int(row[2 * i + 1] or 0))
            for i, name in enumerate(names)}


def nullable_elements(dtype: Any) -> bool:
    """True when a (nested) array type may hold null numbers."""
    nullable = False
    while hasattr(dtype, "elementType"):
        nullable, dtype = nullable or dtype.containsNull, dtype.elementType
    return nullable


def _explained(df: DataFrame, specs: Sequence[ColumnSpec], message: str) -> str:
    """A ragged-array error with the column's length range and the ways out."""
    match = re.match(r"column '(.+?)' has rows of different lengths", message)
    if not match:
        return message
    name = match.group(1)
    low, high = length_ranges(df, [name])[name]
    return (f"column {name!r} holds arrays of {low} to {high} elements; a model needs one "
            f"length per column. Pass a transformation_fn that pads or truncates them (it gets "
            f"the column as an object array of 1-D numpy arrays, see docs/data.md, 'Images, "
            f"text and sequences'), or make the arrays one length in the DataFrame")


def _data_error(exc: Exception) -> Optional[str]:
    match = re.search(re.escape(_ERROR_TAG) + r"(.+?)(?:\n|$)", str(exc))
    return match.group(1).strip().rstrip(".") if match else None


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


def streamed(df: DataFrame, columns: Sequence[ColumnSpec],
             validation: Union[None, float, str] = None, seed: Optional[int] = None,
             variable_length: bool = False) -> MaterializedDataset:
    """``input_mode="stream"``: ``columns`` sized and checked as :func:`materialize` does, and
    nothing written: the training stage reads the returned dataset's ``stream``, ``df``'s rows
    in their stored form with their split (:mod:`sparktrain.data.stream`)."""
    start = time.perf_counter()
    specs = sized_columns(df, columns, variable_length)
    nullable = {f.name: nullable_elements(f.dataType) for f in df.schema.fields}
    selected = [expr for spec in specs for expr in prepared_column(spec, nullable[spec.name])]
    split = split_column(df, validation, seed) or [F.lit("train").alias(SPLIT_COL)]
    return MaterializedDataset("", specs, {}, "stream", seconds=time.perf_counter() - start,
                               stream=df.select(*selected, *split))


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
        message = _data_error(exc)
        if message:
            raise ValueError(_explained(df, specs, message)) from None
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
        flag = F.coalesce(_fail_if(flag.isNull(), F.lit(
            f"validation column {validation!r} contains nulls; expected True/False on every row")),
            flag)
    else:
        if not 0.0 < validation < 1.0:
            raise ValueError(f"validation must be a fraction in (0, 1), got {validation!r}")
        flag = F.rand(seed if seed is not None else 0) < F.lit(validation)
    return [F.when(flag, F.lit("val")).otherwise(F.lit("train")).alias(SPLIT_COL)]
