"""Keras training in one process of a TensorFlow cluster (``TF_CONFIG``).

Runs as ``python -m sparktrain.loop.keras_loop DIR`` (see
:mod:`sparktrain.launch.tf_multiworker`; the files in ``DIR``: :mod:`sparktrain.launch.tf_protocol`).
Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585), so the
loop is a distributed train step of its own, the pattern TensorFlow documents for custom
training with ``tf.distribute``: the user's model is re-loaded from its ``.keras`` file inside
``strategy.scope()`` (so its variables are distributed), the strategy's steps compute per-row
losses and gradients, the Keras optimizer applies them, and the epoch's statistics are summed
over workers. The user's model needs no change.

What differs between strategies (the ``tf.distribute`` strategy, the data of an epoch, the
steps, how statistics are summed) comes from the payload's
:class:`~sparktrain.strategies.keras_strategy.KerasStrategy`; this loop never asks which one it
is. A process whose spec names a ``role`` serves the strategy's cluster
(``KerasStrategy.serve``) instead of training.

Conventions (the batch math, :mod:`.keras_batch`): one input per feature column (``(batch, 1)``
for scalars; a dict keyed by column for a model whose inputs bear the columns' names,
:mod:`.keras_inputs`), labels reshaped to the output when they hold as many values, class
indices for ``(batch, classes)`` outputs; per-row losses summed and divided by the global batch
size; sample weights multiply per-row losses (Keras' own convention).
"""
from __future__ import annotations

import atexit
import os
import pickle
import shutil
import sys
import traceback
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from sparktrain.loop.epochs import EpochBoard, EpochDriver, StepReporter
from sparktrain.loop.keras_batch import batch_tensors, forward_stats, per_row_loss, \
    resolve_metrics
from sparktrain.loop.keras_inputs import keras_inputs
from sparktrain.loop.keras_saving import loading_objects
from sparktrain.launch.elastic import REGROUP, Regroup, scaling_ranks
from sparktrain.faults import user_code, user_error_source
from sparktrain.model_files import ModelFile
from sparktrain.launch.tf_protocol import ERROR_FILE, PAYLOAD_FILE, \
    RESULT_FILE, USER_ERROR_FILE, progress, read_spec
from sparktrain.loop.spec import KerasTrainSpec
from sparktrain.strategies.keras_strategy import RankLoop

_progress = progress


def _print(text: str) -> None:
    """A log line: this process's stdout goes to the task, which echoes it to the driver."""
    print(text, flush=True)
_resolve_metrics = resolve_metrics  # the names this module had before keras_batch


class _TensorBoard(EpochBoard):
    """:class:`~sparktrain.loop.epochs.EpochBoard` written by ``tf.summary``."""

    def __init__(self, tf: Any, run_path: str, storage_options: Dict[str, Any]) -> None:
        self.tf = tf
        super().__init__(run_path, storage_options)

    def _open(self, directory: str) -> Any:
        return self.tf.summary.create_file_writer(directory)

    def _scalar(self, writer: Any, tag: str, value: float, step: int) -> None:
        with writer.as_default():
            self.tf.summary.scalar(tag, value, step=step)


def _checkpoint_bytes(model_file: str, optimizer: Any) -> bytes:
    """The model's ``.keras`` file and the optimizer's variables in one ``.npz`` (read back
    with ``allow_pickle=False``: a checkpoint cannot run code)."""
    import io

    import numpy as np

    with open(model_file, "rb") as f:
        arrays = {"model_keras": np.frombuffer(f.read(), dtype=np.uint8)}
    for i, variable in enumerate(optimizer.variables):
        arrays[f"optimizer_{i:05d}"] = np.asarray(variable.numpy())
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _read_checkpoint(data: bytes) -> Tuple[bytes, List[Any]]:
    import io

    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        names = sorted(n for n in arrays.files if n.startswith("optimizer_"))
        return arrays["model_keras"].tobytes(), [arrays[n] for n in names]


def _load(keras: Any, spec: KerasTrainSpec, payload: Dict[str, Any], custom: Dict[str, Any],
          model_path: str, optimizer_state: Any) -> Tuple[Any, Any]:
    """The model and optimizer (called inside the strategy's scope: their variables are
    distributed); ``optimizer_state``: a checkpoint's optimizer variables, or ``None``."""
    model = keras.saving.load_model(model_path, custom_objects=custom, compile=False)
    optimizer = keras.optimizers.get(payload["optimizer"])
    if optimizer_state is not None:
        optimizer.build(model.trainable_variables)
        if len(optimizer.variables) != len(optimizer_state):
            raise RuntimeError("the run's checkpoint does not fit this optimizer; pass a new "
                               "run_id to start a fresh run")
        for variable, value in zip(optimizer.variables, optimizer_state):
            variable.assign(value)
    elif spec.scale_learning_rate:
        if not isinstance(optimizer.learning_rate, (float, int)) and \
                not hasattr(optimizer.learning_rate, "assign"):
            raise TypeError("scale_learning_rate needs a constant learning rate, not a "
                            "schedule; scale the schedule yourself")
        optimizer.learning_rate = float(optimizer.learning_rate) * \
            scaling_ranks(spec, spec.world_size)
    return model, optimizer


def train(spec: KerasTrainSpec, payload: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    import keras

    from sparktrain.data.feed import BatchFeed
    from sparktrain.data.reader import ShardReader, shard_readers, take_steps

    rank, world = spec.rank, spec.world_size
    if spec.seed is not None:
        keras.utils.set_random_seed(spec.seed)
    custom = loading_objects(keras, payload["custom_objects"])
    strategy = payload["strategy"](spec)
    distributed = strategy.distribute(tf)
    run_path = spec.run_path
    driver = EpochDriver.for_spec(
        spec, rank=rank, world_size=world, attempt=spec.attempt, log=_print, progress=_progress,
        meta={"framework": "keras"},
        board=lambda: _TensorBoard(tf, run_path, spec.storage_options))
    model_bytes, optimizer_state = payload["model"], None
    resumed = driver.resume_bytes()
    if resumed is not None:
        model_bytes, optimizer_state = _read_checkpoint(resumed)
    model_path = os.path.join(workdir, "model.keras")
    with open(model_path, "wb") as f:
        f.write(model_bytes)
    with distributed.scope(), user_code("loading the model and optimizer (custom_objects?)"):
        model, optimizer = _load(keras, spec, payload, custom, model_path, optimizer_state)
        strategy.prepare_optimizer(model, optimizer)
        with user_code("the loss"):
            loss_fn = per_row_loss(keras, payload["loss"])
    with user_code("the metrics"):
        metrics = resolve_metrics(keras, payload["metrics"], custom)
    features, labels = spec.feature_cols, spec.label_cols
    weight_col = spec.sample_weight_col
    readers = shard_readers(spec, rank, world)
    train_reader, val_reader = readers["train"], readers.get("val")
    train_steps = strategy.steps_per_epoch(spec.train_steps or len(train_reader))
    transform = payload.get("transformation_fn")
    feed = BatchFeed.for_spec(spec, transform)
    atexit.register(feed.close)  # this worker process ends with the fit, whichever way
    n_stats = 2 + len(metrics) * len(labels)

    def forward(x: Any, y: Any, w: Any, training: bool) -> Tuple[Any, Any, List[Any]]:
        return forward_stats(tf, model, loss_fn, metrics, x, y, w, training,
                             spec.loss_weights, bool(spec.label_shapes), features)

    strategy.compile(tf, forward, model, optimizer)

    def tensors(batch: Dict[str, np.ndarray]) -> Tuple[List[Any], List[Any], Any]:
        return batch_tensors(tf, batch, features, labels, weight_col, spec.input_shapes,
                             spec.label_shapes)

    names = [n if len(labels) == 1 else f"{l}_{n}" for l in labels for n, _ in metrics]

    def epoch_logs(totals: Any) -> Dict[str, float]:
        totals = np.asarray(totals).astype(np.float64)
        rows = max(totals[0], 1.0)
        return {"loss": totals[1] / rows, **{n: v / rows for n, v in zip(names, totals[2:])}}

    reporting: List[Optional[StepReporter]] = [None]  # the driver's, for the current epoch

    def step_reporter(epoch: int, report: bool, total: Any = None) -> Callable[[int, Any], None]:
        """``on_step(i, values)``: step progress through the driver's reporter (throttled)."""
        reporter = reporting[0] if report else None

        def on_step(i: int, values: Any) -> None:
            if reporter is not None and reporter.due(i):
                values = np.asarray(values)
                reporter.send(i, float(values[1] / max(values[0], 1)))
        return on_step

    def run_epoch(step_fn: Callable, source: ShardReader, epoch: int, report: bool,
                  steps: Any) -> Any:
        local = tf.zeros([n_stats], tf.float32)
        on_step = step_reporter(epoch, report, steps or len(source))
        split = "train" if source is train_reader else "val"
        for i, batch in enumerate(feed(take_steps(source, epoch, steps), split, epoch)):
            x, y, w = tensors(batch)
            # the model's forward, the loss, the metrics and the gradient all-reduce in one
            # tf.function: a worker lost underneath surfaces as a TF status error (a fault)
            with user_code("the training step (the model, the loss or the metrics)"):
                stats = step_fn(x, y, w)
            local += stats
            on_step(i, stats)
        return np.asarray(strategy.sum_over_workers(local))

    loop = RankLoop(run_epoch=lambda step_fn, epoch, report, steps:
                    run_epoch(step_fn, train_reader, epoch, report, steps),
                    step_reporter=step_reporter)
    def sum_over_ranks(values: Any) -> List[float]:
        return np.asarray(strategy.sum_over_workers(tf.constant(list(values)))).tolist()

    driver.agree(sum_over_ranks)
    driver.start(train_steps, strategy.describe())
    callbacks = list(payload.get("callbacks") or [])
    model.stop_training = False
    for callback in callbacks:
        with user_code(f"callback {type(callback).__name__}.on_train_begin"):
            callback.set_model(model)
            callback.on_train_begin({k: v[-1] for k, v in driver.history.items()})
    checkpoint_file = os.path.join(workdir, "checkpoint.keras")
    best = None  # checkpoint_callback with save_best_only: rank 0 keeps the best epoch's model
    if rank == 0 and spec.best_model and run_path:
        from sparktrain.loop.keras_checkpoint import BestModel

        best = BestModel(spec.best_model, run_path, spec.storage_options, driver.history)

    class Epochs:
        """This process's part of the epoch protocol (:class:`sparktrain.loop.epochs.EpochTraining`)."""

        all_reduce_sum = staticmethod(sum_over_ranks)

        @staticmethod
        def train_epoch(epoch: int, reporter: Optional[StepReporter]) -> Dict[str, float]:
            for callback in callbacks:
                with user_code(f"callback {type(callback).__name__}.on_epoch_begin"):
                    callback.on_epoch_begin(epoch)
            reporting[0] = reporter
            return epoch_logs(strategy.train_epoch(loop, epoch, reporter is not None))

        @staticmethod
        def evaluate(epoch: int) -> Dict[str, float]:
            if val_reader is None:
                return {}
            totals = run_epoch(strategy.eval_step, val_reader, 0, False, spec.val_steps)
            return {f"val_{k}": v for k, v in epoch_logs(totals).items()}

        @staticmethod
        def epoch_end(epoch: int, logs: Dict[str, float]) -> bool:
            for callback in callbacks:
                with user_code(f"callback {type(callback).__name__}.on_epoch_end"):
                    callback.on_epoch_end(epoch, dict(logs))
            return bool(getattr(model, "stop_training", False))

        @staticmethod
        def checkpoint(epoch: int, logs: Dict[str, float]) -> Optional[Tuple[bytes, Dict]]:
            if rank != 0:
                return None
            model.save(checkpoint_file)
            if best is not None:  # before the checkpoint: a resumed run then finds it
                best.epoch_end(epoch, logs, checkpoint_file)
            return _checkpoint_bytes(checkpoint_file, optimizer), {}

    stop_reason = driver.run(Epochs())
    history = driver.history
    for callback in callbacks:
        with user_code(f"callback {type(callback).__name__}.on_train_end"):
            callback.on_train_end({k: v[-1] for k, v in history.items()})
    feed.close()
    sample = next(iter(train_reader.epoch(0)))
    first_row = {k: v[:1] for k, v in sample.items()}
    sample = next(BatchFeed(transform, spec.model_columns())([first_row]))
    x, _, _ = tensors(sample)
    outputs = model(keras_inputs(model, features, x))
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if rank != 0:
        return {}
    trained = os.path.join(workdir, "trained.keras")
    weights = best.model_bytes() if best is not None else None
    if weights is not None:
        print(f"the model of the best epoch by {best.monitor} ({best.best:.4g}) is the fitted "
              f"model (checkpoint_callback)", flush=True)
        with open(trained, "wb") as f:
            f.write(weights)
        del weights
    else:
        model.save(trained)
    # to the store, not through the task's result and the driver's heap
    url = f"{spec.run_path}/model/model-{uuid.uuid4().hex[:12]}.keras"
    with open(trained, "rb") as source, ModelFile.writing(url, spec.storage_options) as out:
        shutil.copyfileobj(source, out, 16 << 20)
    return {"model": ModelFile.of(url, spec.storage_options), "history": history,
            "stop_reason": stop_reason,
            "attempts": driver.attempts, "output_shapes": [list(o.shape[1:]) for o in outputs]}


def main(workdir: str) -> int:
    try:
        import cloudpickle

        spec = read_spec(workdir)
        with open(os.path.join(workdir, PAYLOAD_FILE), "rb") as f:
            payload = cloudpickle.load(f)
        if spec.role:  # serves the strategy's cluster until its task kills it
            payload["strategy"](spec).serve(payload, workdir)
            return 0
        try:
            result = train(spec, payload, workdir)
        except Regroup:  # an elastic fit's generation ends after this epoch's checkpoint
            result = REGROUP
        with open(os.path.join(workdir, RESULT_FILE), "wb") as f:
            pickle.dump(result, f)
        return 0
    except BaseException as exc:
        text = traceback.format_exc()
        with open(os.path.join(workdir, ERROR_FILE), "w") as f:
            f.write(text)
        source = user_error_source(exc)
        if source is not None:  # tells the task not to have Spark retry it
            with open(os.path.join(workdir, USER_ERROR_FILE), "w") as f:
                f.write(source)
        print(text, file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
