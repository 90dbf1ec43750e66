"""Which DataFrame columns can feed a model, and how each one is stored for training.

Checks here look only at the schema (no Spark job): a missing column or an unsupported type is
reported before anything runs. Data checks (nulls, ragged arrays, empty frames) run inside the
materialization job, see :mod:`sparktrain.data.materialize`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import types as T

SCALAR, VECTOR, ARRAY = "scalar", "vector", "array"


@dataclass(frozen=True)
class ColumnSpec:
    """How one column is materialized: ``kind`` of source column, stored ``dtype``, ``size``
    (elements per row; 1 for scalars, filled in after materialization for vectors/arrays)."""

    name: str
    kind: str
    dtype: str  # "float32" | "int64" | "bool"
    size: Optional[int] = None

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict) -> "ColumnSpec":
        return cls(**data)


def _numeric_dtype(dtype: T.DataType) -> Optional[str]:
    if isinstance(dtype, (T.FloatType, T.DoubleType, T.DecimalType)):
        return "float32"
    if isinstance(dtype, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)):
        return "int64"
    if isinstance(dtype, T.BooleanType):
        return "float32"
    return None


def column_spec(df: DataFrame, name: str, role: str) -> ColumnSpec:
    """The :class:`ColumnSpec` of ``df[name]``, or a ``ValueError`` naming column and role.

    Floating point (and boolean) values are stored as float32, integers as int64 (class
    indices, embedding ids); vectors and numeric arrays as fixed-length float32/int64 arrays.
    """
    fields = {f.name: f for f in df.schema.fields}
    if name not in fields:
        raise ValueError(f"{role} column {name!r} is not in the DataFrame; "
                         f"its columns are {sorted(fields)}")
    dtype = fields[name].dataType
    if isinstance(dtype, VectorUDT):
        return ColumnSpec(name, VECTOR, "float32")
    if isinstance(dtype, T.ArrayType):
        element = _numeric_dtype(dtype.elementType)
        if element is not None and not isinstance(dtype.elementType, T.BooleanType):
            return ColumnSpec(name, ARRAY, element)
    else:
        scalar = _numeric_dtype(dtype)
        if scalar is not None:
            return ColumnSpec(name, SCALAR, scalar, 1)
    raise ValueError(
        f"{role} column {name!r} has type {dtype.simpleString()}; expected a numeric scalar, "
        f"a pyspark.ml.linalg vector or a fixed-length array of numbers "
        f"(index strings first, e.g. with pyspark.ml.feature.StringIndexer)")


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
                     sample_weight_col: Optional[str] = None) -> List[ColumnSpec]:
    """Specs of every column training reads, in order: features, labels, sample weight."""
    if not feature_cols:
        raise ValueError("feature_cols is empty; name at least one feature column")
    if not label_cols:
        raise ValueError("label_cols is empty; name at least one label column")
    names = list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col else [])
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"columns {duplicates} appear more than once in "
                         f"feature_cols/label_cols/sample_weight_col")
    specs = [column_spec(df, c, "feature") for c in feature_cols]
    specs += [column_spec(df, c, "label") for c in label_cols]
    if sample_weight_col:
        spec = column_spec(df, sample_weight_col, "sample weight")
        if spec.kind != SCALAR:
            raise ValueError(f"sample weight column {sample_weight_col!r} must be a numeric "
                             f"scalar, found {spec.kind}")
        specs.append(ColumnSpec(spec.name, SCALAR, "float32", 1))
    return specs
