"""Column kinds in numpy form and the model-input checks, without Spark."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest

from sparktrain.data.batch import (
    arrow_to_numpy,
    decode_image,
    heavy_decoding,
    model_ready,
    values_to_numpy,
)
from sparktrain.data.columns import ARRAY, BINARY, IMAGE, SCALAR, STRING, VARLEN, ColumnSpec


def test_arrow_columns_in_numpy_form():
    images = pa.array([{"height": 1, "width": 2, "nChannels": 3, "mode": 16,
                        "data": bytes([1, 2, 3, 4, 5, 6])}])
    cases = [
        (pa.array([1.5, 2.5]), ColumnSpec("x", SCALAR, "float32", 1), (2,)),
        (pa.array([[1.0] * 6, [2.0] * 6]), ColumnSpec("m", ARRAY, "float32", 6, [2, 3]),
         (2, 2, 3)),
        (pa.array([b"\x89PNG", b"\xff\xd8"]), ColumnSpec("b", BINARY, "bytes", 1), (2,)),
        (pa.array(["a b", "c"]), ColumnSpec("s", STRING, "str", 1), (2,)),
    ]
    for array, spec, shape in cases:
        assert arrow_to_numpy(array, spec).shape == shape, spec
    tokens = arrow_to_numpy(pa.array([[1, 2, 3], [4], []]).slice(1, 2),
                            ColumnSpec("t", VARLEN, "int64"))
    assert tokens.dtype == object and [list(t) for t in tokens] == [[4], []]
    pixels = arrow_to_numpy(images, ColumnSpec("i", IMAGE, "uint8", 1))[0]
    assert pixels.shape == (1, 2, 3) and pixels.dtype == np.uint8
    assert pixels[0, 0].tolist() == [3, 2, 1]  # Spark's BGR as RGB


def test_python_values_in_numpy_form():
    assert values_to_numpy([bytearray(b"ab")], ColumnSpec("b", BINARY, "bytes", 1))[0] == b"ab"
    grid = values_to_numpy([list(range(4))] * 3, ColumnSpec("g", ARRAY, "float32", 4, [2, 2]))
    assert grid.shape == (3, 2, 2) and grid.dtype == np.float32
    same_length = values_to_numpy([[1, 2], [3, 4]], ColumnSpec("v", VARLEN, "int64"))
    assert same_length.shape == (2,) and same_length[1].tolist() == [3, 4]
    with pytest.raises(ValueError, match="not an 8-bit"):
        decode_image(1, 1, 3, 21, bytes(12))


def test_model_ready_stacks_equal_arrays_and_names_bad_columns():
    rows = np.empty(2, dtype=object)
    rows[0], rows[1] = np.zeros(3), np.ones(3)
    ok = model_ready({"x": rows,
                      "y": [1, 2], "extra": "left alone"}, ["x", "y"], True)
    assert ok["x"].shape == (2, 3) and ok["y"].dtype.kind == "i" and ok["extra"] == "left alone"
    png = io.BytesIO(b"\x89PNG....")
    bad = [
        ({"c": np.array([png.getvalue()], dtype=object)}, "column 'c' reaches the model after "
         "transformation_fn as 1 values of type bytes; .* decode the bytes"),
        ({"c": np.array(["some text"], dtype=object)}, "values of type str; .*token ids"),
        ({"c": np.array(["some text"])}, "array of shape .*token ids"),
        ({"c": np.array([np.zeros(2), np.zeros(3)], dtype=object)},
         r"with shapes \(2,\), \(3,\); .*pad or truncate"),
        ({"d": np.zeros(2)}, r"column 'c' is not in the batch after transformation_fn; its "
                             r"columns are \['d'\]"),
    ]
    for batch, message in bad:
        with pytest.raises(ValueError, match=message):
            model_ready(batch, ["c"], True)
    with pytest.raises(TypeError, match="must return a dict"):
        model_ready([1, 2], ["c"], True)


def test_decode_workers_by_default_only_for_heavy_columns():
    """Bytes, images and sequences get decode worker processes by default; text alone is
    tokenized in the training thread (bench_hf.py: faster end to end)."""
    from sparktrain import TorchEstimator
    from sparktrain.options.horovod import reader_options

    text, label = ColumnSpec("text", STRING, "str", 1), ColumnSpec("y", SCALAR, "int64", 1)
    assert not heavy_decoding([text, label])
    for kind in (BINARY, IMAGE, VARLEN):
        assert heavy_decoding([text, ColumnSpec("c", kind, "bytes", 1)]), kind
    est = TorchEstimator(transformation_fn=lambda batch: batch)
    assert reader_options(est, raw=heavy_decoding([text, label]))["reader_pool"] == "thread"
    assert reader_options(est, raw=True)["reader_pool"] == "process"
    chosen = TorchEstimator(transformation_fn=lambda batch: batch, reader_pool_type="process")
    assert reader_options(chosen, raw=False)["reader_pool"] == "process"
