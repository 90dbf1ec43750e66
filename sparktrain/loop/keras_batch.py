"""One batch through a Keras model: the tensors, the per-row loss and the metric sums.

Shared by the rank loop (:mod:`.keras_loop`), the parameter-server workers' shards
(:mod:`sparktrain.strategies.keras_ps`) and the driver's preflight (``KerasEstimator``): a leaf
module that imports TensorFlow and Keras only through its callers' arguments.

Conventions as for torch: one input per feature column (``(batch, 1)`` for scalars; a dict
keyed by column for a model whose inputs are named as the columns, :mod:`.keras_inputs`), labels
reshaped to the output when they hold as many values, class indices for ``(batch, classes)``
outputs; sample weights multiply per-row losses (Keras' own convention).

Example::

    x, y, w = batch_tensors(tf, batch, ["features"], ["label"], None)
    per_row, stats, outputs = forward_stats(tf, model, per_row_loss(keras, "mse"), [], x, y, w,
                                            training=False, feature_cols=["features"])
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from sparktrain.loop.keras_inputs import keras_inputs


def resolve_metrics(keras: Any, metrics: List[Any], custom_objects: Dict[str, Any]
                     ) -> List[Tuple[str, Any]]:
    """``[(name, fn(y_true, y_pred))]`` from names, functions or ``(name, fn)`` pairs."""
    resolved = []
    for item in metrics or []:
        name, fn = item if isinstance(item, tuple) else (getattr(item, "__name__", item), item)
        if isinstance(fn, str):
            fn = _accuracy if fn in ("acc", "accuracy") else _metric_function(keras, fn)
        if isinstance(fn, type) or hasattr(fn, "update_state"):
            raise TypeError(f"metric {name!r} is a stateful Keras Metric; pass a function "
                            f"(y_true, y_pred) -> values or its name instead")
        resolved.append((str(name), fn))
    return resolved


def _metric_function(keras: Any, name: str) -> Any:
    """A per-row function for a metric name: ``keras.metrics.<name>`` when that is a function
    (``binary_accuracy``...), else the loss function of that name (``mae``, ``mse``...)."""
    candidate = getattr(keras.metrics, name, None)
    if callable(candidate) and not isinstance(candidate, type):
        return candidate
    candidate = keras.losses.get(name)
    if hasattr(candidate, "reduction"):
        candidate.reduction = None
    return candidate


def _accuracy(y_true: Any, y_pred: Any) -> Any:
    """Keras' ``"accuracy"``: for (batch, classes) outputs categorical with one-hot labels,
    sparse categorical with class indices; else binary."""
    import tensorflow as tf

    if y_pred.shape[-1] is not None and y_pred.shape[-1] > 1:
        if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == y_pred.shape[-1]:
            return tf.cast(tf.equal(tf.argmax(y_pred, axis=-1), tf.argmax(y_true, axis=-1)),
                           tf.float32)
        labels = tf.cast(tf.reshape(y_true, [-1]), tf.int64)
        return tf.cast(tf.equal(tf.argmax(y_pred, axis=-1), labels), tf.float32)
    return tf.cast(tf.equal(tf.cast(y_pred > 0.5, tf.float32),
                            tf.cast(tf.reshape(y_true, tf.shape(y_pred)), tf.float32)), tf.float32)


def _row_sum(tf: Any, value: Any, rows: Any) -> Any:
    """Sum over rows of a metric given per row (``(batch, ...)``) or as a batch mean (scalar)."""
    value = tf.cast(value, tf.float32)
    if len(value.shape) == 0:
        return value * rows
    return tf.reduce_sum(tf.reduce_mean(tf.reshape(value, [tf.shape(value)[0], -1]), axis=1))


def _match_label(tf: Any, output: Any, label: Any, reshape: bool = True) -> Any:
    """``reshape=False`` (``label_shapes`` given): keep the label's shape."""
    if len(output.shape) >= 2 and output.shape[-1] is not None and output.shape[-1] > 1 \
            and len(label.shape) == 1:
        return tf.cast(label, tf.int64)
    if reshape and label.shape.num_elements() == output.shape.num_elements() \
            and label.shape != output.shape:
        label = tf.reshape(label, tf.shape(output))
    if output.dtype.is_floating and not label.dtype.is_floating:
        label = tf.cast(label, output.dtype)
    return label


def per_row_loss(keras: Any, loss: Any) -> Any:
    """The loss (name, function or serialized Loss) as a function giving per-row values: the
    train step divides their sum by the global batch itself."""
    loss_fn = keras.losses.get(loss)
    if hasattr(loss_fn, "reduction"):
        loss_fn.reduction = None
    return loss_fn


def batch_tensors(tf: Any, batch: Dict[str, Any], features: List[str], labels: List[str],
                  weight_col: Any, input_shapes: Any = None,
                  label_shapes: Any = None) -> Tuple[List[Any], List[Any], Any]:
    """A reader batch as ``(features, labels, sample weights)`` tensors: features in the
    model's input shapes (``input_shapes``, as Horovod feeds them) when known, else scalar
    features as ``(batch, 1)``; labels in ``label_shapes`` when given."""
    def col(name: str) -> Any:
        value = batch[name]
        return tf.constant(value.reshape(-1, 1) if value.ndim == 1 and name in features else value)
    def shaped(what: str, name: str, shape: List[int]) -> Any:
        value = batch[name]
        try:
            return tf.constant(value.reshape(shape))
        except ValueError:
            per_row = int(value[0].size) if len(value) else 0
            raise ValueError(f"{what}: column {name!r} has {per_row} value(s) per row (a batch "
                             f"of {value.shape}), which do not fit the shape {list(shape)}") \
                from None
    x = [shaped("the model's input shape", c, s)
         for c, s in zip(features, input_shapes, strict=True)] \
        if input_shapes else [col(c) for c in features]
    y = [shaped("label_shapes", c, s) for c, s in zip(labels, label_shapes, strict=True)] \
        if label_shapes else [col(c) for c in labels]
    w = tf.constant(batch[weight_col], tf.float32) if weight_col else None
    return x, y, w


def forward_stats(tf: Any, model: Any, loss_fn: Any, metrics: List[Tuple[str, Any]], x: List[Any],
                  y: List[Any], w: Any, training: bool, loss_weights: Any = None,
                  keep_label_shapes: bool = False,
                  feature_cols: Sequence[str] = ()) -> Tuple[Any, Any, List[Any]]:
    """The model on one batch: per-row losses, ``[rows, loss sum, metric sums...]`` and the
    outputs (what the train and eval steps and the driver's preflight compute).
    ``loss_weights``: one factor per output's loss (Horovod's param); ``feature_cols``: the
    columns of ``x``, fed by name to a model whose inputs bear their names
    (:func:`~.keras_inputs.keras_inputs`), by position otherwise."""
    outputs = model(keras_inputs(model, feature_cols, x), training=training)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    y = [_match_label(tf, o, label, not keep_label_shapes)
         for o, label in zip(outputs, y, strict=True)]
    per_row: Any = 0.0  # a tensor once the first loss is added
    for i, (o, label) in enumerate(zip(outputs, y, strict=True)):
        value = loss_fn(label, o)
        if loss_weights:
            value = value * loss_weights[i]
        per_row += tf.reshape(value, [tf.shape(o)[0], -1]) if len(value.shape) > 1 else value
    per_row = tf.reduce_mean(per_row, axis=-1) if len(per_row.shape) > 1 else per_row
    if w is not None:
        per_row = per_row * w
    stats = [tf.cast(tf.shape(per_row)[0], tf.float32), tf.reduce_sum(per_row)]
    for o, label in zip(outputs, y, strict=True):
        stats += [_row_sum(tf, fn(label, o), stats[0]) for _, fn in metrics]
    return per_row, tf.stack(stats), outputs
