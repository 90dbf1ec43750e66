"""Batches as training and prediction see them: one numpy array per column, by kind.

What each column kind becomes (the ``transformation_fn`` contract, docs/data.md "Images, text and
sequences"):

========== ==================================================================================
kind       numpy form (``rows`` = rows in the batch)
========== ==================================================================================
scalar     ``(rows,)`` float32 / int64
vector     ``(rows, size)`` float32
array      ``(rows, d1, d2, ...)`` float32 / int64 (nested arrays keep their shape)
varlen     ``(rows,)`` object array of 1-D float32 / int64 arrays (their lengths vary)
binary     ``(rows,)`` object array of ``bytes`` (e.g. an encoded JPEG each)
string     ``(rows,)`` object array of ``str``
image      ``(rows,)`` object array of uint8 ``(H, W, C)`` RGB(A) arrays (Spark's BGR turned)
========== ==================================================================================

Whatever reaches the model must be numeric with one shape per column: :func:`model_ready`
checks that (stacking an object array of equal-shaped arrays) and names the column otherwise.
Spark-free and framework-free: the shard reader, decode workers and prediction UDFs use it.

Example::

    batch = {"content": np.array([png_bytes], dtype=object), "label": np.array([3])}
    model_ready(transformation_fn(batch), ["image", "label"], transformed=True)
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from sparktrain.data.columns import BINARY, IMAGE, RAW_KINDS, SCALAR, STRING, VARLEN, ColumnSpec

Batch = Dict[str, np.ndarray]

# OpenCV type codes Spark's image source writes (ImageSchema.ocvTypes): 8-bit, 1/3/4 channels.
_OCV_8U = {0: 1, 16: 3, 24: 4}


def object_array(items: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding ``items`` as they are (``np.array`` would try to stack
    equal-length arrays into a 2-D array)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def decode_image(height: int, width: int, channels: int, mode: int, data: bytes) -> np.ndarray:
    """One row of Spark's image struct as a uint8 ``(H, W, C)`` RGB(A) array (Spark stores
    OpenCV's BGR(A) order, ``pyspark.ml.image.ImageSchema``)."""
    if mode not in _OCV_8U:
        raise ValueError(f"image mode {mode} is not an 8-bit OpenCV type (0, 16, 24); "
                         f"decode such images in transformation_fn from the struct's data")
    pixels = np.frombuffer(data, dtype=np.uint8).reshape(height, width, channels)
    if channels >= 3:
        order = [2, 1, 0] + list(range(3, channels))
        pixels = pixels[..., order]
    return np.ascontiguousarray(pixels)


def _image_rows(rows: Sequence[Any]) -> np.ndarray:
    return object_array([decode_image(int(r["height"]), int(r["width"]), int(r["nChannels"]),
                                      int(r["mode"]), bytes(r["data"])) for r in rows])


def arrow_to_numpy(column: Any, spec: ColumnSpec) -> np.ndarray:
    """A pyarrow (chunked) column of a materialized dataset in its numpy form (see the module
    docstring); zero copy for fixed-size numeric data in one chunk."""
    if hasattr(column, "num_chunks"):  # combine_chunks() copies even a single chunk
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        array = column
    if spec.kind == SCALAR:
        return array.to_numpy(zero_copy_only=False)
    if spec.kind in (BINARY, STRING):
        return array.to_numpy(zero_copy_only=False)
    if spec.kind == IMAGE:
        return _image_rows(array.to_pylist())
    values = array.flatten().to_numpy(zero_copy_only=False)
    if spec.kind == VARLEN:
        import pyarrow.compute as pc

        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        return object_array(np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else [])
    return values.reshape((len(array),) + spec.row_shape)


def values_to_numpy(values: Sequence[Any], spec: ColumnSpec) -> np.ndarray:
    """Python values of one column (collected rows, a pandas column's items) in numpy form;
    arrays arrive flattened, as they are stored."""
    if spec.kind == SCALAR:
        return np.asarray(values, dtype=spec.dtype)
    if spec.kind == BINARY:
        return object_array([bytes(v) for v in values])
    if spec.kind == STRING:
        return object_array([str(v) for v in values])
    if spec.kind == IMAGE:
        return _image_rows(values)
    if spec.kind == VARLEN:
        return object_array([np.asarray(v, dtype=spec.dtype) for v in values])
    if len(values) == 0:
        return np.zeros((0,) + spec.row_shape, dtype=spec.dtype)
    stacked = np.stack([np.asarray(v, dtype=spec.dtype) for v in values])
    if not (spec.shape or spec.size):  # a model trained elsewhere: sizes found on first use
        return stacked
    return stacked.reshape((len(values),) + spec.row_shape)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray) and value.dtype != object:
        return f"a {value.dtype} array of shape {value.shape}"
    items = list(value) if isinstance(value, (np.ndarray, list, tuple)) else [value]
    kinds = sorted({type(v).__name__ for v in items})
    shapes = sorted({tuple(np.shape(v)) for v in items if isinstance(v, np.ndarray)})
    what = f"{len(items)} values of type {'/'.join(kinds) or 'nothing'}"
    if shapes:
        what += f" with shapes {', '.join(map(str, shapes[:4]))}{' ...' if len(shapes) > 4 else ''}"
    return what


def _hint(value: Any) -> str:
    first = next(iter(value), None) if isinstance(value, (np.ndarray, list, tuple)) else value
    if isinstance(first, (bytes, bytearray, memoryview)):
        return ("decode the bytes in transformation_fn, e.g. np.asarray(PIL.Image.open("
                "io.BytesIO(b))) for each image, and stack them")
    if isinstance(first, str):
        return ("turn the text into token ids in transformation_fn (a tokenizer), padded to one "
                "length")
    if isinstance(first, np.ndarray):
        return ("pad or truncate the arrays to one shape in transformation_fn, e.g. "
                "np.stack([np.pad(a[:n], (0, n - len(a[:n]))) for a in batch[column]])")
    return "return numeric numpy arrays from transformation_fn"


def _stacked(value: np.ndarray) -> Optional[np.ndarray]:
    """An object array as a numeric array: one array per row of one shape, or plain numbers;
    ``None`` when it holds anything else."""
    items = list(value.reshape(-1))
    if not items:
        return None
    if value.ndim == 1 and all(isinstance(v, np.ndarray) and v.dtype.kind in "biuf"
                               and v.shape == items[0].shape for v in items):
        return np.stack(items)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
           for v in items):
        return np.asarray(value.tolist())
    return None


def model_ready(batch: Batch, names: Sequence[str], transformed: bool) -> Batch:
    """``batch`` with the columns ``names`` checked (and stacked) for the model: numeric numpy
    arrays of one shape per column. Raises ``ValueError`` naming the column, what it holds and
    how to fix it; other columns pass through untouched."""
    where = "after transformation_fn" if transformed else "(no transformation_fn given)"
    if not isinstance(batch, dict):
        raise TypeError(f"transformation_fn must return a dict of numpy arrays by column name, "
                        f"returned {type(batch).__name__}")
    out = dict(batch)
    for name in names:
        if name not in batch:
            raise ValueError(f"column {name!r} is not in the batch {where}; its columns are "
                             f"{sorted(batch)}")
        value = batch[name]
        if not isinstance(value, np.ndarray):
            if hasattr(value, "numpy"):  # a CPU tensor: fine
                value = np.asarray(value.numpy())
            else:
                try:
                    value = np.asarray(value)
                except (ValueError, TypeError):  # a ragged list
                    value = object_array(list(value))
        if value.dtype == object:
            stacked = _stacked(value)
            if stacked is None:
                raise ValueError(f"column {name!r} reaches the model {where} as "
                                 f"{_describe(value)}; expected numeric arrays of one shape "
                                 f"per column: {_hint(value)}")
            value = stacked
        if value.dtype.kind not in "biuf":
            raise ValueError(f"column {name!r} reaches the model {where} as {_describe(value)}; "
                             f"expected numbers: {_hint(value.reshape(-1)[:1])}")
        out[name] = value
    return out


def heavy_decoding(columns: Sequence[ColumnSpec]) -> bool:
    """Whether decoding ``columns`` is worth worker processes: bytes, images, variable-length
    arrays. Text alone is not: a fast tokenizer costs a rank less than the workers' start and
    their share of the cores (bench/HISTORY.md, ``bench_hf.py``: 1.43x vs 1.12x end to end)."""
    return any(c.kind in RAW_KINDS and c.kind != STRING for c in columns)

