"""Which DataFrame columns can feed a model, and how each one is stored for training.

Checks here look only at the schema (no Spark job): a missing column or an unsupported type is
reported before anything runs. Data checks (nulls, ragged arrays, empty frames) run inside the
materialization job, see :mod:`sparktrain.data.materialize`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from sparktrain.data.columns import (
    ARRAY,
    BINARY,
    IMAGE,
    IMAGE_FIELDS,
    SCALAR,
    STRING,
    VECTOR,
    ColumnSpec,
)


def _numeric_dtype(dtype: T.DataType) -> Optional[str]:
    if isinstance(dtype, (T.FloatType, T.DoubleType, T.DecimalType)):
        return "float32"
    if isinstance(dtype, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)):
        return "int64"
    if isinstance(dtype, T.BooleanType):
        return "float32"
    return None


def _array_element(dtype: T.DataType) -> Tuple[int, T.DataType]:
    """``(depth, innermost element type)`` of a (nested) array type."""
    depth = 0
    while isinstance(dtype, T.ArrayType):
        depth, dtype = depth + 1, dtype.elementType
    return depth, dtype


def is_image_struct(dtype: T.DataType) -> bool:
    return isinstance(dtype, T.StructType) and set(IMAGE_FIELDS) <= set(dtype.fieldNames())


def column_spec(df: DataFrame, name: str, role: str) -> ColumnSpec:
    """The :class:`ColumnSpec` of ``df[name]``, or a ``ValueError`` naming column and role.

    Floating point (and boolean) values are stored as float32, integers as int64 (class
    indices, embedding ids); vectors and numeric arrays (nested to any depth) as float32/int64
    arrays; binary and string columns as they are; Spark's image struct as its bytes and size.
    Whether a 1-D array column is of fixed or variable length is found at materialization.
    """
    fields = {f.name: f for f in df.schema.fields}
    if name not in fields:
        raise ValueError(f"{role} column {name!r} is not in the DataFrame; its columns are "
                         f"{sorted(fields)} (a column that transformation_fn creates needs "
                         f"the transformation_fn)")
    dtype = fields[name].dataType
    if isinstance(dtype, VectorUDT):
        return ColumnSpec(name, VECTOR, "float32")
    if isinstance(dtype, T.BinaryType):
        return ColumnSpec(name, BINARY, "bytes", 1)
    if isinstance(dtype, T.StringType):
        return ColumnSpec(name, STRING, "str", 1)
    if is_image_struct(dtype):
        return ColumnSpec(name, IMAGE, "uint8", 1)
    if isinstance(dtype, T.ArrayType):
        depth, inner = _array_element(dtype)
        element = _numeric_dtype(inner)
        if element is not None and not isinstance(inner, T.BooleanType):
            return ColumnSpec(name, ARRAY, element, shape=[None] * depth if depth > 1 else None)
    else:
        scalar = _numeric_dtype(dtype)
        if scalar is not None:
            return ColumnSpec(name, SCALAR, scalar, 1)
    raise ValueError(
        f"{role} column {name!r} has type {dtype.simpleString()}; expected a numeric scalar, "
        f"a pyspark.ml.linalg vector, an array of numbers (nested to any depth), binary "
        f"(e.g. binaryFile's content), string, or Spark's image struct (index category "
        f"strings first, e.g. with pyspark.ml.feature.StringIndexer)")


def check_validation_column(df: DataFrame, name: str) -> None:
    """A validation column must be boolean: True marks the rows held out for validation."""
    fields = {f.name: f for f in df.schema.fields}
    if name not in fields:
        raise ValueError(f"validation column {name!r} is not in the DataFrame; "
                         f"its columns are {sorted(fields)}")
    if not isinstance(fields[name].dataType, T.BooleanType):
        raise ValueError(f"validation column {name!r} has type "
                         f"{fields[name].dataType.simpleString()}; expected boolean "
                         f"(True for validation rows), or pass validation=<fraction in [0, 1)>")


def training_columns(df: DataFrame, feature_cols: Sequence[str], label_cols: Sequence[str],
                     sample_weight_col: Optional[str] = None,
                     created: Sequence[str] = ()) -> List[ColumnSpec]:
    """Specs of every column training reads, in order: features, labels, sample weight; the
    ``created`` ones (made by ``transformation_fn``) are not in the DataFrame and have none."""
    if not feature_cols:
        raise ValueError("feature_cols is empty; name at least one feature column")
    if not label_cols:
        raise ValueError("label_cols is empty; name at least one label column")
    names = list(feature_cols) + list(label_cols) + \
        ([sample_weight_col] if sample_weight_col else [])
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"columns {duplicates} appear more than once in "
                         f"feature_cols/label_cols/sample_weight_col")
    specs = [column_spec(df, c, "feature") for c in feature_cols if c not in created]
    specs += [column_spec(df, c, "label") for c in label_cols if c not in created]
    if sample_weight_col and sample_weight_col not in created:
        spec = column_spec(df, sample_weight_col, "sample weight")
        if spec.kind != SCALAR:
            raise ValueError(f"sample weight column {sample_weight_col!r} must be a numeric "
                             f"scalar, found {spec.kind}")
        specs.append(ColumnSpec(spec.name, SCALAR, "float32", 1))
    return specs
