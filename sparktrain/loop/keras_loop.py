"""Keras training in one process of a TensorFlow cluster (``TF_CONFIG``).

Runs as ``python -m sparktrain.loop.keras_loop DIR`` (see
:mod:`sparktrain.launch.tf_multiworker`; the files in ``DIR``:
:mod:`sparktrain.launch.tf_protocol`).
Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585), so the
loop is a distributed train step of its own, the pattern TensorFlow documents for custom
training with ``tf.distribute``: the user's model is re-loaded from its ``.keras`` file inside
``strategy.scope()`` (so its variables are distributed), the strategy's steps compute per-row
losses and gradients, the Keras optimizer applies them, and the epoch's statistics are summed
over workers. The user's model needs no change.

What differs between strategies (the ``tf.distribute`` strategy, the data of an epoch, the
steps, how statistics are summed) comes from the payload's
(:class:`~sparktrain.options.payload.KerasPayload`)
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
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from sparktrain.faults import mark_user_error, user_code, user_error_source
from sparktrain.launch.elastic import REGROUP, Regroup, scaling_ranks
from sparktrain.launch.tf_protocol import (
    ERROR_FILE,
    PAYLOAD_FILE,
    RESULT_FILE,
    USER_ERROR_FILE,
    progress,
    read_spec,
)
from sparktrain.loop.epochs import EpochBoard, EpochDriver, StepReporter
from sparktrain.loop.keras_batch import batch_tensors, forward_stats, per_row_loss, resolve_metrics
from sparktrain.loop.keras_inputs import keras_inputs
from sparktrain.loop.keras_saving import loading_objects
from sparktrain.model_files import ModelFile
from sparktrain.options.payload import KerasPayload
from sparktrain.options.spec import KerasTrainSpec
from sparktrain.strategies.keras_strategy import KerasStrategy, RankLoop, stack_batches

if TYPE_CHECKING:
    from sparktrain.data.sources.contract import RowReader

_progress = progress


def _print(text: str) -> None:
    """A log line: this process's stdout goes to the task, which echoes it to the driver."""
    print(text, flush=True)


#: ``steps_per_execution`` by default: at most this many steps a call, their batches within
#: :data:`STACKED_BYTES` (a step function's call costs more than a small model's step on CPU;
#: measured: 2 workers, a 32->64->64->2 MLP, 256 rows a step, 2.1-2.7 ms a step stacked by
#: 8-16 against 4.3-5.2 ms one a call)
MAX_STEPS_PER_EXECUTION = 16
STACKED_BYTES = 64 << 20


def auto_steps_per_execution(tensors: Tuple[List[Any], List[Any], Any]) -> int:
    """Steps per call for batches like ``tensors`` (one batch's ``(x, y, w)``)."""
    x, y, w = tensors
    flat = x + y + ([] if w is None else [w])
    size = sum(int(t.shape.num_elements() or 0) * t.dtype.size for t in flat)
    return max(1, min(MAX_STEPS_PER_EXECUTION, STACKED_BYTES // max(size, 1)))


def _shapes(tensors: Tuple[List[Any], List[Any], Any]) -> List[Any]:
    """The shapes of one batch's ``(x, y, w)`` tensors."""
    x, y, w = tensors
    return [t.shape for t in x + y] + [None if w is None else w.shape]


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
        # Any: savez's stub would match an ndarray **kwarg against its allow_pickle: bool
        arrays: Dict[str, Any] = {"model_keras": np.frombuffer(f.read(), dtype=np.uint8)}
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


def _load(keras: Any, spec: KerasTrainSpec, payload: KerasPayload, custom: Dict[str, Any],
          model_path: str, optimizer_state: Any) -> Tuple[Any, Any]:
    """The model and optimizer (called inside the strategy's scope: their variables are
    distributed); ``optimizer_state``: a checkpoint's optimizer variables, or ``None``."""
    model = keras.saving.load_model(model_path, custom_objects=custom, compile=False)
    optimizer = keras.optimizers.get(payload.optimizer)
    if optimizer_state is not None:
        optimizer.build(model.trainable_variables)
        if len(optimizer.variables) != len(optimizer_state):
            raise RuntimeError("the run's checkpoint does not fit this optimizer; pass a new "
                               "run_id to start a fresh run")
        for variable, value in zip(optimizer.variables, optimizer_state, strict=True):
            variable.assign(value)
    elif spec.scale_learning_rate:
        if not isinstance(optimizer.learning_rate, (float, int)) and \
                not hasattr(optimizer.learning_rate, "assign"):
            raise TypeError("scale_learning_rate needs a constant learning rate, not a "
                            "schedule; scale the schedule yourself")
        optimizer.learning_rate = float(optimizer.learning_rate) * \
            scaling_ranks(spec, spec.world_size)
    return model, optimizer


class _KerasEpochs:
    """This process's part of the epoch protocol (:class:`sparktrain.loop.epochs.EpochTraining`)
    and the fit around it: the model and optimizer loaded in the strategy's scope, the
    strategy's steps over this rank's shards, the user's callbacks."""

    def __init__(self, tf: Any, keras: Any, spec: KerasTrainSpec, payload: KerasPayload,
                 workdir: str, custom: Dict[str, Any], strategy: KerasStrategy, distributed: Any,
                 driver: EpochDriver) -> None:
        from sparktrain.data.sources import rank_readers
        from sparktrain.data.transform_stage import BatchFeed

        self.tf, self.spec, self.workdir, self.strategy = tf, spec, workdir, strategy
        self.driver, self.payload = driver, payload
        self.model, self.optimizer, self.loss_fn = self._load_model(keras, custom, distributed)
        with user_code("the metrics"):
            self.metrics = resolve_metrics(keras, payload.metrics, custom)
        readers = rank_readers(spec, spec.rank, spec.world_size)
        self.train_reader, self.val_reader = readers["train"], readers.get("val")
        self.train_steps = strategy.steps_per_epoch(spec.train_steps or len(self.train_reader))
        self.transform = payload.transformation_fn
        self.feed = BatchFeed.for_spec(spec, self.transform)
        atexit.register(self.feed.close)  # this worker process ends with the fit, whichever way
        strategy.compile(tf, self.forward, self.model, self.optimizer)
        labels = spec.label_cols  # the metrics' names, per label when there are several
        self.names = [n if len(labels) == 1 else f"{label}_{n}"
                      for label in labels for n, _ in self.metrics]
        self.loop = RankLoop(run_epoch=lambda step_fn, epoch, report, steps:
                             self.run_epoch(step_fn, self.train_reader, epoch, report, steps),
                             step_reporter=self.step_reporter)
        self.reporter: Optional[StepReporter] = None  # the driver's, for the current epoch
        self.callbacks = list(payload.callbacks or [])
        self.checkpoint_file = os.path.join(workdir, "checkpoint.keras")
        self.best: Any = None  # checkpoint_callback's save_best_only: rank 0's BestModel

    def _load_model(self, keras: Any, custom: Dict[str, Any], distributed: Any
                    ) -> Tuple[Any, Any, Any]:
        """The model, optimizer and per-row loss, from the run's checkpoint when it has one."""
        model_bytes, optimizer_state = self.payload.model, None
        resumed = self.driver.resume_bytes()
        if resumed is not None:
            assert self.driver.resume is not None  # resume_bytes() read driver.resume's bytes
            try:
                model_bytes, optimizer_state = _read_checkpoint(resumed)
            except Exception as exc:  # a damaged file written before fingerprints
                raise mark_user_error(RuntimeError(
                    f"{self.driver.resume.payload_path} cannot be loaded ({exc}): the file is "
                    f"damaged; remove it to resume from the checkpoint before it, or fit with a "
                    f"new run_id"), "resuming from the run's checkpoint") from None
        model_path = os.path.join(self.workdir, "model.keras")
        with open(model_path, "wb") as f:
            f.write(model_bytes)
        with distributed.scope(), user_code("loading the model and optimizer (custom_objects?)"):
            model, optimizer = _load(keras, self.spec, self.payload, custom, model_path,
                                     optimizer_state)
            self.strategy.prepare_optimizer(model, optimizer)
            with user_code("the loss"):
                loss_fn = per_row_loss(keras, self.payload.loss)
        return model, optimizer, loss_fn

    def forward(self, x: Any, y: Any, w: Any, training: bool) -> Tuple[Any, Any, List[Any]]:
        """The per-row loss, the statistics and the outputs of one batch (the strategy's steps
        call it in their ``tf.function``)."""
        spec = self.spec
        return forward_stats(self.tf, self.model, self.loss_fn, self.metrics, x, y, w, training,
                             spec.loss_weights, bool(spec.label_shapes), spec.feature_cols)

    def tensors(self, batch: Dict[str, np.ndarray]) -> Tuple[List[Any], List[Any], Any]:
        spec = self.spec
        return batch_tensors(self.tf, batch, spec.feature_cols, spec.label_cols,
                             spec.sample_weight_col, spec.input_shapes, spec.label_shapes)

    def epoch_logs(self, totals: Any) -> Dict[str, float]:
        """Summed ``[rows, loss, metrics...]`` as per-row means."""
        totals = np.asarray(totals).astype(np.float64)
        rows = max(totals[0], 1.0)
        return {"loss": totals[1] / rows,
                **{n: v / rows for n, v in zip(self.names, totals[2:], strict=True)}}

    def step_reporter(self, epoch: int, report: bool, total: Any = None
                      ) -> Callable[[int, Any], None]:
        """``on_step(i, values)``: step progress through the driver's reporter (throttled)."""
        reporter = self.reporter if report else None

        def on_step(i: int, values: Any) -> None:
            if reporter is not None and reporter.due(i):
                values = np.asarray(values)
                reporter.send(i, float(values[1] / max(values[0], 1)))
        return on_step

    def run_epoch(self, step_fn: Callable, source: "RowReader", epoch: int, report: bool,
                  steps: Any) -> Any:
        """``step_fn`` over ``source``'s batches, up to ``steps_per_execution`` of them stacked
        per call (batches of one shape: every worker stacks alike, so their traced collectives
        match); the statistics summed over workers. Training resumes inside the epoch after
        the batches already trained (the driver's ``within``) and checkpoints between calls
        when one is due."""
        from sparktrain.data.epoch_steps import take_steps

        tf = self.tf
        split = "train" if source is self.train_reader else "val"
        within = self.driver.within if split == "train" else None
        skip, order = (within.skip, within.order) if within is not None else (0, None)
        width = 2 + len(self.names)
        total = tf.constant(within.partial, tf.float32) \
            if within is not None and within.partial and len(within.partial) == width \
            else tf.zeros([width], tf.float32)
        last = steps or len(source)
        on_step = self.step_reporter(epoch, report, last)
        per_call = self.spec.steps_per_execution  # None: from the first batch's bytes
        group: List[Tuple[List[Any], List[Any], Any]] = []
        group_shapes: List[Any] = []
        done = skip

        def call() -> None:
            nonlocal total, done
            # the model's forward, the loss, the metrics and the gradient all-reduce in one
            # tf.function: a worker lost underneath surfaces as a TF status error (a fault)
            with user_code("the training step (the model, the loss or the metrics)"):
                total = step_fn(*stack_batches(tf, group), total)
            ran = len(group)
            done += ran
            group.clear()
            on_step(done - 1, total)  # the epoch's running sums: their mean loss is shown
            if within is not None and done < last:  # every worker calls alike: same steps
                within.after_steps(done, ran, lambda: np.asarray(total).tolist(),
                                   getattr(source, "order", None))

        for batch in self.feed(take_steps(source, epoch, steps, skip, order), split, epoch):
            tensors = self.tensors(batch)
            if per_call is None:
                per_call = auto_steps_per_execution(tensors)
            shapes = _shapes(tensors)
            if group and shapes != group_shapes:
                call()
            if not group:
                group_shapes = shapes
            group.append(tensors)
            if len(group) == per_call:
                call()
        if group:
            call()
        return np.asarray(self.strategy.sum_over_workers(total))

    def all_reduce_sum(self, values: Sequence[float]) -> List[float]:
        return np.asarray(self.strategy.sum_over_workers(self.tf.constant(list(values)))).tolist()

    def train_begin(self) -> None:
        """The callbacks' ``on_train_begin``; rank 0's best-model keeper."""
        self.model.stop_training = False
        for callback in self.callbacks:
            with user_code(f"callback {type(callback).__name__}.on_train_begin"):
                callback.set_model(self.model)
                callback.on_train_begin({k: v[-1] for k, v in self.driver.history.items()})
        spec = self.spec
        if spec.rank == 0 and spec.best_model and spec.run_path:
            from sparktrain.loop.keras_checkpoint import BestModel

            self.best = BestModel(spec.best_model, spec.run_path, spec.storage_options,
                                  self.driver.history)

    def train_epoch(self, epoch: int, reporter: Optional[StepReporter]) -> Dict[str, float]:
        for callback in self.callbacks:
            with user_code(f"callback {type(callback).__name__}.on_epoch_begin"):
                callback.on_epoch_begin(epoch)
        self.reporter = reporter
        return self.epoch_logs(self.strategy.train_epoch(self.loop, epoch, reporter is not None))

    def evaluate(self, epoch: int) -> Dict[str, float]:
        if self.val_reader is None:
            return {}
        totals = self.run_epoch(self.strategy.eval_step, self.val_reader, 0, False,
                                self.spec.val_steps)
        return {f"val_{k}": v for k, v in self.epoch_logs(totals).items()}

    def epoch_end(self, epoch: int, logs: Dict[str, float]) -> bool:
        for callback in self.callbacks:
            with user_code(f"callback {type(callback).__name__}.on_epoch_end"):
                callback.on_epoch_end(epoch, dict(logs))
        return bool(getattr(self.model, "stop_training", False))

    def position(self, batches_done: int) -> Optional[bytes]:
        return self.train_reader.position(batches_done)

    def checkpoint(self, epoch: int, logs: Dict[str, float], mid_epoch: bool = False
                   ) -> Optional[Tuple[bytes, Dict]]:
        if self.spec.rank != 0:
            return None
        self.model.save(self.checkpoint_file)
        if self.best is not None and not mid_epoch:  # before the checkpoint: a resumed run
            # then finds it
            self.best.epoch_end(epoch, logs, self.checkpoint_file)
        return _checkpoint_bytes(self.checkpoint_file, self.optimizer), {}

    def train_end(self) -> None:
        """The callbacks' ``on_train_end``; the feed's workers stop."""
        for callback in self.callbacks:
            with user_code(f"callback {type(callback).__name__}.on_train_end"):
                callback.on_train_end({k: v[-1] for k, v in self.driver.history.items()})
        self.feed.close()

    def close_readers(self) -> None:
        for reader in (self.train_reader, self.val_reader):
            if reader is not None:
                reader.close()

    def output_shapes(self) -> List[List[int]]:
        """The model's output shapes (without the batch), from one row of the training data."""
        from sparktrain.data.transform_stage import BatchFeed

        sample = next(iter(self.train_reader.epoch(0)))
        first_row = {k: v[:1] for k, v in sample.items()}
        sample = next(BatchFeed(self.transform, self.spec.model_columns())([first_row]))
        x, _, _ = self.tensors(sample)
        outputs = self.model(keras_inputs(self.model, self.spec.feature_cols, x))
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        return [list(o.shape[1:]) for o in outputs]

    def fitted_model(self) -> ModelFile:
        """Rank 0: the fitted model (the best epoch's under ``save_best_only``) in the store."""
        trained = os.path.join(self.workdir, "trained.keras")
        best = self.best
        weights = best.model_bytes() if best is not None else None
        if weights is not None:
            print(f"the model of the best epoch by {best.monitor} ({best.best:.4g}) is the "
                  f"fitted model (checkpoint_callback)", flush=True)
            with open(trained, "wb") as f:
                f.write(weights)
            del weights
        else:
            self.model.save(trained)
        # to the store, not through the task's result and the driver's heap
        spec = self.spec
        url = f"{spec.run_path}/model/model-{uuid.uuid4().hex[:12]}.keras"
        with open(trained, "rb") as source, ModelFile.writing(url, spec.storage_options) as out:
            shutil.copyfileobj(source, out, 16 << 20)
        return ModelFile.of(url, spec.storage_options)


def _check_gpus(tf: Any) -> None:
    """A worker given GPUs (``CUDA_VISIBLE_DEVICES``: all of its task's) trains on all of them:
    MultiWorkerMirroredStrategy keeps a replica on each GPU of each worker. GPUs TensorFlow
    cannot use fail the fit at once (not retried); GPUs announced by tests
    (``SPARKTRAIN_FAKE_GPUS``) leave the worker on the CPU."""
    from sparktrain.faults import mark_user_error
    from sparktrain.launch.gpus import GpuUnavailableError, fake_gpus

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        return
    if fake_gpus():
        tf.config.set_visible_devices([], "GPU")
        _print(f"GPUs {visible} (CUDA_VISIBLE_DEVICES={visible}; SPARKTRAIN_FAKE_GPUS: "
               f"training on the CPU)")
        return
    found = tf.config.list_physical_devices("GPU")
    if not found:
        raise mark_user_error(GpuUnavailableError(
            f"Spark assigned GPU(s) {visible} to this worker, but TensorFlow "
            f"{tf.__version__} finds no GPU here (a CPU build, or no CUDA driver); install a "
            f"GPU build of TensorFlow on the executors or pass use_gpu=False"),
            "the executors' environment (the same on every attempt)")
    _print(f"GPUs {visible} (CUDA_VISIBLE_DEVICES={visible}): {len(found)} replica(s) in "
           f"this worker")


def train(spec: KerasTrainSpec, payload: KerasPayload, workdir: str) -> Dict[str, Any]:
    """Train this process's part of the fit; rank 0 returns the fitted model (a file in the
    store), the history, why training stopped and the output shapes, the others ``{}``."""
    import keras
    import tensorflow as tf

    _check_gpus(tf)
    if spec.seed is not None:
        keras.utils.set_random_seed(spec.seed)
    custom = loading_objects(keras, payload.custom_objects)
    assert payload.strategy is not None  # KerasEstimator._payload always sets it
    strategy = payload.strategy(spec)
    distributed = strategy.distribute(tf)
    driver = EpochDriver.for_spec(
        spec, rank=spec.rank, world_size=spec.world_size, attempt=spec.attempt, log=_print,
        progress=_progress, meta={"framework": "keras"},
        board=lambda: _TensorBoard(tf, spec.run_path, spec.storage_options))
    epochs = _KerasEpochs(tf, keras, spec, payload, workdir, custom, strategy, distributed, driver)
    try:
        driver.agree(epochs.all_reduce_sum)
        driver.start(epochs.train_steps, strategy.describe())
        epochs.train_begin()
        stop_reason = driver.run(epochs)
        epochs.train_end()
        output_shapes = epochs.output_shapes()
    finally:
        epochs.close_readers()  # removes the local caches
    if spec.rank != 0:
        return {}
    return {"model": epochs.fitted_model(), "history": driver.history,
            "stop_reason": stop_reason, "attempts": driver.attempts,
            "output_shapes": output_shapes}


def main(workdir: str) -> int:
    try:
        spec = read_spec(workdir)
        with open(os.path.join(workdir, PAYLOAD_FILE), "rb") as f:
            payload = KerasPayload.loads(f.read())
        if spec.role:  # serves the strategy's cluster until its task kills it
            assert payload.strategy is not None  # KerasEstimator._payload always sets it
            payload.strategy(spec).serve(payload, workdir, batch_tensors)
            return 0
        try:
            result: Union[Dict[str, Any], str] = train(spec, payload, workdir)
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
    from sparktrain.launch.zygote import die_with_starter

    die_with_starter()
    sys.exit(main(sys.argv[1]))
