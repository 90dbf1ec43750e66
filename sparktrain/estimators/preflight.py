"""Preflight: the model, loss and metrics on a few real rows, on the driver, before training.

A shape, dtype or label mistake otherwise shows up on every rank after materialization and the
launch, and Spark used to retry it. ``fit`` therefore takes a few rows of the DataFrame (one
``limit`` job), turns them into the tensors training feeds the model (``transformation_fn``,
``input_shapes`` included) and runs the forward pass, the loss and the metrics once, on the CPU,
without gradients, on a copy of the model (unpickled from the training payload) or, for Keras,
the user's model called in inference mode: neither the model's weights nor the optimizer's state
change. A failure raises :class:`PreflightError` naming the columns, their shapes and what the
model expects. Code that needs a training rank (a ``transformation_fn`` reading the task's
context, a model asking ``torch.distributed`` for its rank) or a network error only skips the
preflight, with a warning.

Set ``spark.sparktrain.preflight=false`` to skip it (say, a model that only runs on a GPU).

Example::

    est.fit(df)   # ValueError (PreflightError): ... feature column 'features': (8, 7) float32;
                  # the model's first layer Linear(in_features=64) expects 64 values per row
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyspark.sql import DataFrame

from sparktrain.data.columns import ColumnSpec
from sparktrain.data.prepare import sample_batch
from sparktrain.data.transform_inputs import learn_inputs
from sparktrain.errors import PreflightError
from sparktrain.faults import is_fault, user_error_source
from sparktrain.loop.keras_inputs import input_names
from sparktrain.session.spark_api import conf_value

log = logging.getLogger("sparktrain")

PREFLIGHT_CONF = "spark.sparktrain.preflight"
PREFLIGHT_ROWS = 8


def enabled(df: DataFrame) -> bool:
    return str(conf_value(df.sparkSession, PREFLIGHT_CONF, "true")).lower() != "false"


def run_preflight(estimator: Any, df: DataFrame, specs: Sequence[ColumnSpec]) -> None:
    """Sample a batch of ``df`` and have ``estimator._check_on_batch`` run it; logs the cost."""
    if not enabled(df):
        return
    started = time.perf_counter()
    batch = sample_batch(df, specs, min(estimator.getBatchSize(), PREFLIGHT_ROWS))
    if batch is None:  # empty, nulls, ragged: materialization reports it precisely
        return
    sampled = time.perf_counter()
    try:
        estimator._check_on_batch(batch)
    except PreflightError as error:
        cause = error.__cause__
        # A transformation_fn may need a task (TaskContext) or the executors' files, the model
        # may ask torch.distributed for its rank, and the network may fail under the user's
        # code here: none of that says the model is wrong.
        if cause is None or not (is_fault(cause) or _needs_a_rank(cause) or
                                 user_error_source(cause) == "transformation_fn"):
            raise
        log.warning("preflight skipped: %s: %s (on the driver; training goes on)",
                    type(cause).__name__, cause)
        return
    log.info("preflight: the model, loss and metrics ran on %d rows (sampled in %.2fs, run in "
             "%.2fs)", len(next(iter(batch.values()))), sampled - started,
             time.perf_counter() - sampled)


def transformation_columns(df: DataFrame, fn: Callable, wanted: Sequence[str],
                           keep: Sequence[str]) -> Optional[List[ColumnSpec]]:
    """Specs of the DataFrame columns ``fn`` needs to produce ``wanted`` (see the module),
    learned on :data:`PREFLIGHT_ROWS` rows (even with the preflight off: training needs it);
    ``None`` when it cannot be learned here (no rows, or ``fn`` needs a training task): then
    every column a model could read is materialized.

    Raises ``ValueError`` when ``fn`` fails on the rows or does not produce a wanted column.
    """
    from sparktrain.data.schema import column_spec

    specs: Dict[str, ColumnSpec] = {}
    for name in df.columns:
        try:
            specs[name] = column_spec(df, name, "input")
        except ValueError:
            continue  # a type no model reads (maps, structs): the transformation cannot get it
    sample = sample_batch(df, list(specs.values()), PREFLIGHT_ROWS, partial=True)
    if sample is None:
        log.warning("transformation_fn: the DataFrame has no rows to learn which columns it "
                    "reads from; all %d readable columns are materialized", len(specs))
        return list(specs.values())
    try:
        inputs, _ = learn_inputs(detached(fn), sample, wanted, keep)
    except ValueError as exc:
        if "neither in the DataFrame" in str(exc):
            raise
        raise _failed(exc, sample) from exc
    except Exception as exc:  # noqa: BLE001 - the user's function: reported with the rows
        if _needs_a_rank(exc):
            log.warning("transformation_fn needs a training task (%s: %s): all %d readable "
                        "columns are materialized", type(exc).__name__, exc, len(specs))
            return list(specs.values())
        raise _failed(exc, sample) from exc
    log.info("transformation_fn reads %s to make %s", inputs, list(wanted))
    return [specs[name] for name in inputs]


def _failed(exc: BaseException, sample: Dict[str, Any]) -> ValueError:
    rows = len(next(iter(sample.values()), []))
    return ValueError(f"transformation_fn failed on {rows} rows of the DataFrame (columns "
                      f"{list(sample)}), run on the driver to learn which columns it reads "
                      f"before any training job: {type(exc).__name__}: {exc}")


def _needs_a_rank(exc: BaseException) -> bool:
    """True when ``exc`` was raised inside torch.distributed, Horovod or pyspark's task
    context: the user's code needs a training rank, which the driver is not."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    return any(part in name for name in frames[-3:]
               for part in ("/torch/distributed/", "/horovod/", "/pyspark/"))


def detached(obj: Any) -> Any:
    """A copy of the user's object (a stateful ``transformation_fn``, say) for the preflight to
    call, so the one shipped to the ranks is left as it was."""
    import cloudpickle

    from sparktrain.pickling import dumps

    return obj if obj is None else cloudpickle.loads(dumps(obj))


def describe_columns(batch: Dict[str, Any], feature_cols: Sequence[str],
                     label_cols: Sequence[str]) -> str:
    """``feature column 'x': (8, 7) float32; label column 'y': (8,) int64`` for the batch."""
    parts = []
    for role, names in (("feature", feature_cols), ("label", label_cols)):
        for name in names:
            value = batch.get(name)
            if value is not None:
                parts.append(f"{role} column {name!r}: {tuple(value.shape)} {value.dtype}")
    return "; ".join(parts)


def failure(exc: BaseException, what_ran: str, columns: str, tensors: str,
            expectation: Optional[str]) -> PreflightError:
    """The error for ``exc`` raised while the preflight ran the user's objects."""
    where = user_error_source(exc) or "preparing the batch"
    lines = [f"preflight failed in {where}: {type(exc).__name__}: {exc}",
             f"It ran {what_ran} on a few rows of the DataFrame on the driver, before any "
             f"training job.",
             f"The rows: {columns}."]
    if tensors:
        lines.append(f"The model was called with {tensors}.")
    if expectation:
        lines.append(f"The model expects {expectation}.")
    lines.append("Check feature_cols/label_cols (and input_shapes/label_shapes), the model's "
                 f"input size and the loss. ({PREFLIGHT_CONF}=false skips this check.)")
    return PreflightError("\n".join(lines))


# -- torch ----------------------------------------------------------------------------------------
def torch_expectation(model: Any) -> Optional[str]:
    """What the first layer with weights takes (``in_features``, ``in_channels``...)."""
    for module in model.modules():
        name = type(module).__name__
        if hasattr(module, "in_features"):
            return f"{module.in_features} values per row in its first layer {name}"
        if hasattr(module, "in_channels"):
            return f"{module.in_channels} channels (dimension 1) in its first layer {name}"
        if hasattr(module, "num_embeddings"):
            return (f"integer indices below {module.num_embeddings} in its first layer "
                    f"{name}")
        if hasattr(module, "normalized_shape"):
            return f"a last dimension of {tuple(module.normalized_shape)} in its first layer {name}"
        if hasattr(module, "input_size"):  # recurrent layers
            return f"{module.input_size} features per step in its first layer {name}"
    return None


def tensor_shapes(tensors: List[Any]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


# -- keras ----------------------------------------------------------------------------------------
def keras_expectation(model: Any) -> Optional[str]:
    """The model's declared input shapes, when it has them, and for several inputs their names
    (fed by name when they are the feature columns, :mod:`sparktrain.loop.keras_inputs`)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    shapes = ", ".join(str(tuple(i.shape)) for i in inputs)
    names = input_names(model)
    if names is None or len(names) < 2:
        return f"inputs of shape {shapes}"
    named = ", ".join(f"{n!r} {tuple(i.shape)}" for n, i in zip(names, inputs, strict=True))
    return (f"inputs {named} (fed by name when feature_cols are these names, else in this "
            f"order)")
