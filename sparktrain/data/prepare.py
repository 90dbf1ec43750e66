"""How each column a fit needs is checked and stored, as Spark column expressions.

The materialization's write job (:mod:`sparktrain.data.materialize`) and the stream path run
these checks inside their own scan (``raise_error``), so a bad row costs no extra job: nulls,
arrays of the wrong shape or of varying length, each named by column with the way out. Here
too: what each column is stored as (:func:`stored_value`), the preflight's sample of rows
(:func:`sample_batch`) and the fixed lengths learned from the data (:func:`sized_columns`).

Example::

    checked = df.select(*prepared_column(spec, nullable_elements(df.schema[spec.name].dataType)))
    batch = sample_batch(df, specs, rows=8)
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
    STRING,
    VARLEN,
    VECTOR,
    ColumnSpec,
)

#: the prefix of the messages the checks raise inside Spark, found again in the job's error
ERROR_TAG = "sparktrain-data-error: "


def fail_if(condition: Column, message: Column) -> Column:
    return F.when(condition, F.raise_error(F.concat(F.lit(ERROR_TAG), message)))


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
    dims: List[Optional[int]] = list(shape)
    return ColumnSpec(spec.name, spec.kind, spec.dtype, size, dims)


def _shape_ok(col: Column, dims: Sequence[Optional[int]]) -> Column:
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
    checks = [fail_if(col.isNull(), F.lit(nulls))]
    value = stored_value(spec)
    if spec.kind == IMAGE:
        checks.append(fail_if(col.getField("data").isNull(),
                               F.lit(f"image column {name!r} has rows without data (images "
                                     f"Spark could not decode: read with dropInvalid=true)")))
    if spec.kind in (ARRAY, VECTOR, VARLEN):
        element = "float" if spec.dtype == "float32" else "bigint"
        if spec.kind == ARRAY and spec.shape:
            expected = ", ".join(str(d) for d in spec.shape)
            checks.append(fail_if(
                ~_shape_ok(col, spec.shape),
                F.concat(F.lit(f"column {name!r} has a row of shape ("),
                         _row_shape_text(col, spec.depth),
                         F.lit(f", ...); expected every row to have the shape ({expected}) of "
                               f"the first row"))))
        elif spec.kind != VARLEN:
            checks.append(fail_if(
                F.size(value) != F.lit(spec.size),
                F.concat(F.lit(f"column {name!r} has rows of different lengths; expected every "
                               f"row to have {spec.size} elements like the first row, found "),
                         F.size(value).cast("string"))))
        if spec.kind != VECTOR and nullable_elements:
            checks.append(fail_if(_has_null_element(value, element),
                                   F.lit(f"column {name!r} has arrays containing nulls; "
                                         f"expected numbers only")))
    guarded = F.coalesce(*checks, value) if checks else value
    return [guarded.alias(name)]


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
    assert row is not None  # an aggregation without groupBy has exactly one row
    return {name: (int(row[2 * i] or 0), int(row[2 * i + 1] or 0))
            for i, name in enumerate(names)}


def nullable_elements(dtype: Any) -> bool:
    """True when a (nested) array type may hold null numbers."""
    nullable = False
    while hasattr(dtype, "elementType"):
        nullable, dtype = nullable or dtype.containsNull, dtype.elementType
    return nullable


def ragged_array_message(df: DataFrame, specs: Sequence[ColumnSpec], message: str) -> str:
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


def data_error_message(exc: Exception) -> Optional[str]:
    match = re.search(re.escape(ERROR_TAG) + r"(.+?)(?:\n|$)", str(exc))
    return match.group(1).strip().rstrip(".") if match else None
