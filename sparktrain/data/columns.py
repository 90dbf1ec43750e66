"""Column kinds and :class:`ColumnSpec`: how one column is stored and read for training.

A leaf module (numpy-free, Spark-free): the driver's schema checks, the shard reader, the
decode worker processes and the prediction UDF all share it.

Example::

    spec = ColumnSpec("pixels", ARRAY, "float32", 64, [8, 8])
    spec.row_shape     # (8, 8)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

SCALAR, VECTOR, ARRAY = "scalar", "vector", "array"
#: the column (and partition) naming each row's split, "train" or "val"
SPLIT_COL = "split"
#: variable-length 1-D numeric arrays (token ids, events): need a transformation_fn
VARLEN = "varlen"
#: raw bytes (binaryFile's ``content``: encoded JPEG/PNG/audio), stored verbatim
BINARY = "binary"
#: UTF-8 text
STRING = "string"
#: Spark's image struct (``spark.read.format("image")``): BGR bytes + height/width/nChannels
IMAGE = "image"
#: kinds a model cannot take as they are: a transformation_fn must turn them into numbers
RAW_KINDS = (VARLEN, BINARY, STRING, IMAGE)
IMAGE_FIELDS = ("height", "width", "nChannels", "mode", "data")


@dataclass(frozen=True)
class ColumnSpec:
    """How one column is materialized: ``kind`` of source column, stored ``dtype``, ``size``
    (elements per row; 1 for scalars, filled in after materialization for vectors/arrays) and
    ``shape`` (per-row shape of nested arrays, e.g. ``[8, 8]``; ``None`` for 1-D values).

    Kinds: ``scalar``, ``vector``, ``array`` (fixed shape, any depth), ``varlen`` (1-D arrays
    of varying length), ``binary`` (bytes), ``string``, ``image`` (Spark's image struct).
    """

    name: str
    kind: str
    dtype: str  # "float32" | "int64" | "bytes" | "str" | "uint8"
    size: Optional[int] = None
    shape: Optional[List[Optional[int]]] = None

    @property
    def depth(self) -> int:
        """Nesting depth of an array column (1 for ``array<float>``)."""
        return len(self.shape) if self.shape else 1

    @property
    def row_shape(self) -> Tuple[int, ...]:
        """The shape of one row as training reads it (``()`` for scalars)."""
        if self.kind == SCALAR:
            return ()
        if self.shape:
            dims = [d for d in self.shape if d is not None]
            if len(dims) != len(self.shape):  # what int(None) raised before: a TypeError
                raise TypeError(f"column {self.name!r} has an unknown size in its shape "
                                f"{self.shape}; expected it sized from the first row")
            return tuple(int(d) for d in dims)
        return (int(self.size),) if self.size else ()

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict) -> "ColumnSpec":
        return cls(**data)
