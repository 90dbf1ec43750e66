"""Horovod's Spark-estimator params: checks before launch, and what the Petastorm ones map to.

sparktrain takes every param of Horovod 0.28.1's ``TorchEstimator``/``KerasEstimator``. Most
mean the same here; the ones that describe Petastorm's reader are mapped onto sparktrain's
:class:`~sparktrain.data.reader.ShardReader` where it has the same knob, and otherwise accepted
and named in ONE :class:`IgnoredParamWarning` per fit that says what sparktrain does instead.

Example::

    options = reader_options(estimator)   # {"train_prefetch": 2, "val_prefetch": 2}
    warn_ignored(estimator)                # once per fit
    check_shapes_fit("input_shapes", [[-1, 1, 8, 8]], [("features", 64)])   # ok
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

# in the leaf errors module so that the store (a lower layer) can warn with it too
from sparktrain.errors import IgnoredParamWarning

DEFAULT_PREFETCH = 2  # ShardReader's read-ahead, and Horovod's default reader worker count


def compression_name(value: Any) -> Optional[str]:
    """``'fp16'`` or ``None`` from Horovod's ``Compression.fp16``/``Compression.none`` (torch or
    TensorFlow flavour, recognised by class name so Horovod need not be installed), the strings
    ``'fp16'``/``'none'``, or ``None``; anything else is a ``TypeError`` naming the param."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.lower() in ("fp16", "none"):
            return None if value.lower() == "none" else "fp16"
    else:
        name = value.__name__ if isinstance(value, type) else type(value).__name__
        known = {"NoneCompressor": None, "FP16Compressor": "fp16"}
        if name in known:
            return known[name]
    raise TypeError(f"gradient_compression must be horovod.torch.Compression.fp16, "
                    f"Compression.none, 'fp16', 'none' or None, got {value!r}")


def check_shapes(name: str, shapes: Optional[Sequence], columns: Sequence[str],
                 what: str) -> None:
    """One shape per column (the values themselves were checked when the param was set)."""
    if shapes is not None and len(shapes) != len(columns):
        raise ValueError(f"{name} has {len(shapes)} shape(s) for {len(columns)} {what} "
                         f"column(s) {list(columns)}; give one shape per column, in order")


def check_shapes_fit(name: str, shapes: Optional[Sequence[Sequence[int]]],
                     sizes: Sequence[Tuple[str, Optional[int]]]) -> None:
    """Each ``(-1, d1, d2, ...)`` shape must hold exactly the column's values per row
    (``d1 * d2 * ... == size``); checked on the driver once the data is materialized."""
    if not shapes:
        return
    for shape, (column, size) in zip(shapes, sizes, strict=True):
        if shape[0] == -1 and -1 not in shape[1:] and size is not None:
            per_row = math.prod(shape[1:])
            if per_row != size:
                raise ValueError(f"{name}: column {column!r} has {size} value(s) per row, but "
                                 f"the shape {list(shape)} needs {per_row} per row; change "
                                 f"{name} or the column")


def check_data_shapes(est: Any, columns: Sequence[Any], input_shapes: Optional[Sequence],
                      input_name: str = "input_shapes") -> None:
    """``input_shapes`` (``input_name`` in errors) and ``label_shapes`` fit the materialized
    ``columns`` (their ``ColumnSpec``); not checked with a ``transformation_fn``: it may change
    every column's shape (the first batch tells then)."""
    if est.getTransformationFn() is not None:
        return
    sizes = {c.name: c.size for c in columns}
    for name, shapes, cols in ((input_name, input_shapes, est.getFeatureCols()),
                               ("label_shapes", est.getLabelShapes(), est.getLabelCols())):
        check_shapes_fit(name, shapes, [(c, sizes.get(c)) for c in cols])


def check_loss_weights(weights: Optional[Sequence[float]], label_cols: Sequence[str]) -> None:
    if weights is not None and len(weights) != len(label_cols):
        raise ValueError(f"loss_weights has {len(weights)} weight(s) for {len(label_cols)} "
                         f"label column(s) {list(label_cols)}; give one per label column")


def check_common(est: Any) -> None:
    """Checks of the Horovod params every estimator has that span several options (each value
    alone was checked when it was set); run before launch."""
    check_shapes("label_shapes", est.getLabelShapes(), est.getLabelCols(), "label")
    check_loss_weights(est.getLossWeights(), est.getLabelCols())


def _ignored(est: Any) -> List[str]:
    """One line per set Horovod param that has no equivalent here: what sparktrain does."""
    get = est.getOrDefault
    lines = []
    if get("reader_pool_type") == "process" and get("transformation_fn") is None:
        lines.append("reader_pool_type='process' without a transformation_fn: worker processes "
                     "run transformation_fn, and there is none; Parquet is decoded in the "
                     "reader's thread (pyarrow releases the GIL), as with 'thread'")
    if get("shuffle_buffer_size") is not None:
        lines.append("shuffle_buffer_size (deprecated and unused in Horovod 0.28): every epoch "
                     "the reader shuffles the order of each rank's row groups and the rows "
                     "within them; turn shuffling off with shuffle=False")
    if get("partitions_per_process") is not None:
        lines.append("partitions_per_process: ranks read contiguous row ranges of the "
                     "materialized dataset, not whole files, so every rank gets an equal share "
                     "(to within one row) whatever the number of files")
    if get("mp_start_method") == "fork":
        lines.append("mp_start_method='fork': decode workers start with 'forkserver' instead "
                     "(forking a process that holds Spark's and torch's threads can deadlock)")
    elif get("mp_start_method") is not None and get("transformation_fn") is None:
        lines.append(f"mp_start_method={get('mp_start_method')!r} without a transformation_fn: "
                     f"it starts the decode worker processes that run transformation_fn, and "
                     f"there is none")
    if get("data_module") is not None:
        lines.append("data_module: sparktrain reads the materialized Parquet dataset with its own "
                     "shard reader (sparktrain.data.reader.ShardReader); use transformation_fn "
                     "to change batches")
    for name in ("continuous_cols", "categorical_cols"):
        if get(name):
            lines.append(f"{name}: used only by Horovod's NVTabular data module; sparktrain "
                         f"feeds feature_cols as they are")
    if get("compress_sparse_cols"):
        lines.append("compress_sparse_cols=True: vector columns are stored dense (float32) in "
                     "the materialized dataset, Parquet compresses the zeros")
    for name in ("transformation_edit_fields", "transformation_removed_fields"):
        if get(name) is not None:
            lines.append(f"{name}: transformation_fn may add, change or drop columns of the "
                         f"batch dict freely; there is no Petastorm schema to declare")
    return lines


def reader_options(est: Any, raw: bool = False) -> Dict[str, Any]:
    """How each rank reads and decodes, from Horovod's reader params.

    ``train_reader_num_workers``/``val_reader_num_workers`` = N (default 2, Horovod's default
    worker count): the reader decodes up to N row groups ahead of training in its background
    thread (0: on demand), and with ``reader_pool_type='process'`` N worker processes run
    ``transformation_fn``. ``'process'`` is the default when ``raw`` (a column holds bytes,
    images or variable-length arrays: decoding them is the bottleneck) and a
    ``transformation_fn`` is given; text alone (a tokenizer) runs in the training thread.
    ``'dummy'`` (Petastorm: read in the calling thread) reads on demand.
    """
    get = est.getOrDefault
    train = get("train_reader_num_workers")
    val = get("val_reader_num_workers")
    options: Dict[str, Any] = {"train_prefetch": DEFAULT_PREFETCH if train is None else train,
                               "val_prefetch": DEFAULT_PREFETCH if val is None else val}
    pool = get("reader_pool_type")
    if not est.isSet("reader_pool_type") and raw:
        pool = "process"
    if get("transformation_fn") is None and pool == "process":
        pool = "thread"
    if pool == "dummy":
        options = {k: 0 for k in options}
    method = get("mp_start_method")
    options.update(reader_pool=pool,
                   train_decode_workers=max(1, options["train_prefetch"]),
                   val_decode_workers=max(1, options["val_prefetch"]),
                   mp_start_method=None if method == "fork" else method)
    return options


def warn_ignored(est: Any, also_ignored: Sequence[str] = ()) -> None:
    """ONE :class:`IgnoredParamWarning` naming every set Horovod param without an equivalent
    here and what sparktrain does instead (``also_ignored``: the framework's own lines); call
    once per fit."""
    lines = _ignored(est) + list(also_ignored)
    if lines:
        warnings.warn(f"{type(est).__name__}: Horovod param(s) accepted but without effect "
                      f"here:\n  - " + "\n  - ".join(lines), IgnoredParamWarning, stacklevel=4)
