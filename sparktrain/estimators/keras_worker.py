"""Keras training in one process of a ``MultiWorkerMirroredStrategy`` cluster (``TF_CONFIG``).

Runs as ``python -m sparktrain.estimators.keras_worker DIR`` (see
:mod:`sparktrain.launch.tf_multiworker`). Keras 3's ``model.fit`` fails under
MultiWorkerMirroredStrategy (keras-team/keras#20585), so the loop is a distributed train step
of its own, the pattern TensorFlow documents for custom training with ``tf.distribute``: the
user's model is re-loaded from its ``.keras`` file inside ``strategy.scope()`` (so its variables
are mirrored), ``strategy.run`` computes per-row losses and gradients, the Keras optimizer
all-reduces and applies them, and ``strategy.reduce`` sums the epoch's statistics over workers.
The user's model needs no change. With ``strategy="parameter_server"`` this process is the
coordinator of a ``ParameterServerStrategy`` cluster instead, and the pieces that differ (the
strategy, the workers' data, scheduled steps) come from :mod:`sparktrain.estimators.keras_ps`;
ps and worker processes run :func:`~sparktrain.estimators.keras_ps.serve`.

Conventions as for torch: one input per feature column (``(batch, 1)`` for scalars), labels
reshaped to the output when they hold as many values, class indices for ``(batch, classes)``
outputs; per-row losses summed and divided by the global batch size; sample weights multiply
per-row losses (Keras' own convention).
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

from sparktrain.launch.faults import user_code, user_error_source

PROGRESS_PREFIX = "\x1esparktrain-progress "
USER_ERROR_FILE = "user_error.txt"  # where the user's code raised the error, if it did


def _progress(**event: Any) -> None:
    print(PROGRESS_PREFIX + json.dumps(event), flush=True)


def _resolve_metrics(keras: Any, metrics: List[Any], custom_objects: Dict[str, Any]
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
    x = [shaped("the model's input shape", c, s) for c, s in zip(features, input_shapes)] \
        if input_shapes else [col(c) for c in features]
    y = [shaped("label_shapes", c, s) for c, s in zip(labels, label_shapes)] \
        if label_shapes else [col(c) for c in labels]
    w = tf.constant(batch[weight_col], tf.float32) if weight_col else None
    return x, y, w


def forward_stats(tf: Any, model: Any, loss_fn: Any, metrics: List[Tuple[str, Any]], x: List[Any],
                  y: List[Any], w: Any, training: bool, loss_weights: Any = None,
                  keep_label_shapes: bool = False) -> Tuple[Any, Any, List[Any]]:
    """The model on one batch: per-row losses, ``[rows, loss sum, metric sums...]`` and the
    outputs (what the train and eval steps and the driver's preflight compute).
    ``loss_weights``: one factor per output's loss (Horovod's param)."""
    outputs = model(x if len(x) > 1 else x[0], training=training)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    y = [_match_label(tf, o, l, not keep_label_shapes) for o, l in zip(outputs, y)]
    per_row = 0.0
    for i, (o, l) in enumerate(zip(outputs, y)):
        value = loss_fn(l, o)
        if loss_weights:
            value = value * loss_weights[i]
        per_row += tf.reshape(value, [tf.shape(o)[0], -1]) if len(value.shape) > 1 else value
    per_row = tf.reduce_mean(per_row, axis=-1) if len(per_row.shape) > 1 else per_row
    if w is not None:
        per_row = per_row * w
    stats = [tf.cast(tf.shape(per_row)[0], tf.float32), tf.reduce_sum(per_row)]
    for o, l in zip(outputs, y):
        stats += [_row_sum(tf, fn(l, o), stats[0]) for _, fn in metrics]
    return per_row, tf.stack(stats), outputs


class _TensorBoard:
    """Rank 0's event files under ``<run>/tensorboard/{train,validation}`` (tf.summary), written
    locally and copied to the store after every epoch when the store is remote."""

    def __init__(self, tf: Any, run_path: str, storage_options: Dict[str, Any]) -> None:
        import tempfile

        from sparktrain.data.store import filesystem

        self.tf = tf
        self.fs, remote = filesystem(run_path + "/tensorboard", storage_options)
        self.remote = remote if "://" in run_path else None
        self.local = tempfile.mkdtemp(prefix="sparktrain-tb-") if self.remote else remote
        self.writers = {s: tf.summary.create_file_writer(f"{self.local}/{s}")
                        for s in ("train", "validation")}

    def write(self, epoch: int, logs: Dict[str, float]) -> None:
        for key, value in logs.items():
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            with self.writers[split].as_default():
                self.tf.summary.scalar(f"epoch/{name}", value, step=epoch + 1)
        for writer in self.writers.values():
            writer.flush()
        if self.remote:
            self.fs.put(self.local + "/", self.remote, recursive=True)


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


def train(spec: Dict[str, Any], payload: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    import keras

    from sparktrain.checkpoint import Checkpoints
    from sparktrain.data.columns import ColumnSpec
    from sparktrain.data.feed import BatchFeed
    from sparktrain.data.reader import ShardReader, take_steps

    rank, world = spec["rank"], spec["world_size"]
    if spec.get("seed") is not None:
        keras.utils.set_random_seed(spec["seed"])
    from sparktrain.estimators.keras import loading_objects

    custom = loading_objects(keras, payload["custom_objects"])
    ps = spec.get("strategy") == "parameter_server"  # this process is the coordinator
    if ps:
        from sparktrain.estimators import keras_ps

        strategy, coordinator = keras_ps.make_strategy(tf)
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    run_path = spec.get("run_path")
    checkpoints = Checkpoints(run_path, spec["storage_options"]) if run_path else None
    resume = checkpoints.latest() if checkpoints is not None else None
    meta: Dict[str, Any] = resume.meta if resume is not None else {}
    model_bytes, optimizer_state = payload["model"], None
    if resume is not None:
        model_bytes, optimizer_state = _read_checkpoint(checkpoints.read(resume))
    model_path = os.path.join(workdir, "model.keras")
    with open(model_path, "wb") as f:
        f.write(model_bytes)
    with strategy.scope(), user_code("loading the model and optimizer (custom_objects?)"):
        model = keras.saving.load_model(model_path, custom_objects=custom, compile=False)
        optimizer = keras.optimizers.get(payload["optimizer"])
        if optimizer_state is not None:
            optimizer.build(model.trainable_variables)
            if len(optimizer.variables) != len(optimizer_state):
                raise RuntimeError("the run's checkpoint does not fit this optimizer; pass a new "
                                   "run_id to start a fresh run")
            for variable, value in zip(optimizer.variables, optimizer_state):
                variable.assign(value)
        elif spec.get("scale_learning_rate"):
            if not isinstance(optimizer.learning_rate, (float, int)) and \
                    not hasattr(optimizer.learning_rate, "assign"):
                raise TypeError("scale_learning_rate needs a constant learning rate, not a "
                                "schedule; scale the schedule yourself")
            optimizer.learning_rate = float(optimizer.learning_rate) * world
        if ps and not optimizer.built:  # its variables on the parameter servers too
            optimizer.build(model.trainable_variables)
        with user_code("the loss"):
            loss_fn = per_row_loss(keras, payload["loss"])
    with user_code("the metrics"):
        metrics = _resolve_metrics(keras, payload["metrics"], custom)
    features, labels = spec["feature_cols"], spec["label_cols"]
    weight_col = spec["sample_weight_col"]
    columns = [ColumnSpec.from_json(c) for c in spec["columns"]]

    def reader(split: str, batch: int, shuffle: bool) -> ShardReader:
        return ShardReader(spec["dataset_root"], spec["layouts"][split], columns, rank, world,
                           batch, shuffle, spec["seed"], spec["storage_options"],
                           inmemory_cache_all=bool(spec.get("inmemory_cache_all")),
                           prefetch=spec.get(f"{split}_prefetch", 2))

    train_reader = reader("train", spec["batch_size"], spec["shuffle"])
    val_reader = reader("val", spec["val_batch_size"], False) if spec["layouts"].get("val") else None
    train_steps = spec.get("train_steps") or len(train_reader)
    if ps:  # steps scheduled per epoch, over all workers: as many rows as the other strategy
        workers = len(spec["ps_shards"])
        rows = sum(s["rows"] for s in spec["ps_shards"])
        train_steps = spec["train_steps"] * workers if spec.get("train_steps") else \
            -(-rows // spec["batch_size"])
        per_worker = iter(keras_ps.per_worker_dataset(tf, coordinator, spec["ps_shards"],
                                                      spec["batch_size"], spec["shuffle"],
                                                      spec.get("seed")))
    transform = payload.get("transformation_fn")
    model_names = list(features) + list(labels) + ([weight_col] if weight_col else [])
    feed = BatchFeed(transform, model_names, spec.get("reader_pool", "thread"),
                     {"train": spec.get("train_decode_workers", 2),
                      "val": spec.get("val_decode_workers", 2)},
                     spec.get("seed"), spec.get("mp_start_method"))
    atexit.register(feed.close)  # this worker process ends with the fit, whichever way
    n_stats = 2 + len(metrics) * len(labels)

    def forward(x: Any, y: Any, w: Any, training: bool) -> Tuple[Any, Any, List[Any]]:
        return forward_stats(tf, model, loss_fn, metrics, x, y, w, training,
                             spec.get("loss_weights"), bool(spec.get("label_shapes")))

    @tf.function(reduce_retracing=True)
    def train_step(x: Any, y: Any, w: Any) -> Any:
        def replica(x: Any, y: Any, w: Any) -> Any:
            with tf.GradientTape() as tape:
                per_row, stats, _ = forward(x, y, w, True)
                loss = tf.reduce_sum(per_row) / (tf.cast(tf.shape(per_row)[0], tf.float32) * world)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return stats
        # this worker's statistics only: they are summed over workers once per epoch, not per
        # step (an all-reduce per step cost as much as the gradients' own)
        return strategy.experimental_local_results(strategy.run(replica, args=(x, y, w)))[0]

    @tf.function(reduce_retracing=True)
    def eval_step(x: Any, y: Any, w: Any) -> Any:
        def replica(x: Any, y: Any, w: Any) -> Any:
            return forward(x, y, w, False)[1]
        return strategy.experimental_local_results(strategy.run(replica, args=(x, y, w)))[0]

    @tf.function
    def sum_over_workers(local: Any) -> Any:
        return strategy.reduce(tf.distribute.ReduceOp.SUM,
                               strategy.run(tf.identity, args=(local,)), axis=None)

    if ps:
        @tf.function
        def ps_train_step(iterator: Any) -> Any:
            def replica(batch: Any) -> Any:
                x, y = list(batch[0]), list(batch[1])
                with tf.GradientTape() as tape:
                    per_row, stats, _ = forward(x, y, batch[2] if len(batch) > 2 else None,
                                                True)
                    # each worker applies its own gradients: the mean over its batch
                    loss = tf.reduce_sum(per_row) / tf.cast(tf.shape(per_row)[0], tf.float32)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return stats
            return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                   strategy.run(replica, args=(next(iterator),)), axis=None)

        # validation runs in the coordinator, reading the variables from the parameter servers
        eval_step = tf.function(reduce_retracing=True)(
            lambda x, y, w: forward(x, y, w, False)[1])

        def sum_over_workers(local: Any) -> Any:  # one coordinator: its sums are the totals
            return local

    def tensors(batch: Dict[str, np.ndarray]) -> Tuple[List[Any], List[Any], Any]:
        return batch_tensors(tf, batch, features, labels, weight_col, spec.get("input_shapes"),
                             spec.get("label_shapes"))

    names = [n if len(labels) == 1 else f"{l}_{n}" for l in labels for n, _ in metrics]

    def epoch_logs(totals: Any) -> Dict[str, float]:
        totals = np.asarray(totals).astype(np.float64)
        rows = max(totals[0], 1.0)
        return {"loss": totals[1] / rows, **{n: v / rows for n, v in zip(names, totals[2:])}}

    def scheduled_epoch(epoch: int, report: bool) -> Dict[str, float]:
        last = [0.0]

        def on_step(i: int, values: Any) -> None:
            if report and (time.monotonic() - last[0] > 0.25 or i + 1 == train_steps):
                last[0] = time.monotonic()
                _progress(event="step", epoch=epoch, step=i + 1,
                          loss=float(values[1] / max(values[0], 1)))
        with user_code("the training step (the model, the loss or the metrics)"):
            return epoch_logs(keras_ps.scheduled_epoch(coordinator, ps_train_step, per_worker,
                                                       train_steps, on_step))

    def run_epoch(step_fn: Callable, source: ShardReader, epoch: int, report: bool,
                  steps: Any) -> Dict[str, float]:
        local = tf.zeros([n_stats], tf.float32)
        last = 0.0
        total = steps or len(source)
        split = "train" if source is train_reader else "val"
        for i, batch in enumerate(feed(take_steps(source, epoch, steps), split, epoch)):
            x, y, w = tensors(batch)
            # the model's forward, the loss, the metrics and the gradient all-reduce in one
            # tf.function: a worker lost underneath surfaces as a TF status error (a fault)
            with user_code("the training step (the model, the loss or the metrics)"):
                stats = step_fn(x, y, w)
            local += stats
            if report and (time.monotonic() - last > 0.25 or i + 1 == total):
                last = time.monotonic()
                values = stats.numpy()
                _progress(event="step", epoch=epoch, step=i + 1,
                          loss=float(values[1] / max(values[0], 1)))
        return epoch_logs(np.asarray(sum_over_workers(local)))

    lead = rank == 0 and spec["verbose"] >= 1
    first = meta.get("epochs_done", 0)
    # every worker must resume from the same epoch (a checkpoint could appear meanwhile)
    agreed = np.asarray(sum_over_workers(tf.constant([float(first)])))[0]
    if agreed != first * world:
        raise RuntimeError("workers found different latest checkpoints; the attempt is retried")
    attempts = meta.get("attempts", []) + [{"attempt": spec.get("attempt", 0),
                                            "start_epoch": first}]
    if lead:
        if ps:
            print(f"ParameterServerStrategy: {spec['num_ps']} parameter server(s), "
                  f"{workers} worker(s), {train_steps} steps/epoch of {spec['batch_size']} "
                  f"rows scheduled on the workers", flush=True)
        else:
            print(f"{world} worker(s), backend {spec['backend']!r} (MultiWorkerMirroredStrategy): "
                  f"{train_steps} steps/epoch of {spec['batch_size']} rows per worker", flush=True)
        if resume is not None:
            print(f"resuming from the checkpoint after epoch {first}", flush=True)
        _progress(event="start", epochs=spec["epochs"], steps=train_steps, first=first)
    history: Dict[str, List[float]] = {k: list(v) for k, v in meta.get("history", {}).items()}
    board = _TensorBoard(tf, spec["run_path"], spec["storage_options"]) \
        if rank == 0 and spec.get("run_path") else None
    callbacks = list(payload.get("callbacks") or [])
    model.stop_training = False
    for callback in callbacks:
        with user_code(f"callback {type(callback).__name__}.on_train_begin"):
            callback.set_model(model)
            callback.on_train_begin({k: v[-1] for k, v in history.items()})
    stop_reason = None
    checkpoint_file = os.path.join(workdir, "checkpoint.keras")
    best = None  # checkpoint_callback with save_best_only: rank 0 keeps the best epoch's model
    if rank == 0 and spec.get("best_model") and run_path:
        from sparktrain.estimators.keras_checkpoint import BestModel

        best = BestModel(spec["best_model"], run_path, spec["storage_options"], history)
    for epoch in range(first, spec["epochs"]):
        started = time.perf_counter()
        for callback in callbacks:
            with user_code(f"callback {type(callback).__name__}.on_epoch_begin"):
                callback.on_epoch_begin(epoch)
        logs = scheduled_epoch(epoch, lead) if ps else \
            run_epoch(train_step, train_reader, epoch, lead, spec.get("train_steps"))
        if val_reader is not None:
            logs.update({f"val_{k}": v for k, v in
                         run_epoch(eval_step, val_reader, 0, False, spec.get("val_steps")).items()})
        for key, value in logs.items():
            history.setdefault(key, []).append(float(value))
        if board is not None:
            board.write(epoch, logs)
        if lead:
            _progress(event="epoch", epoch=epoch, logs=logs)
            values = "  ".join(f"{k}={v:.4g}" for k, v in logs.items())
            print(f"epoch {epoch + 1}/{spec['epochs']}  {values}  "
                  f"({time.perf_counter() - started:.1f}s)", flush=True)
        for callback in callbacks:
            with user_code(f"callback {type(callback).__name__}.on_epoch_end"):
                callback.on_epoch_end(epoch, dict(logs))
        if rank == 0 and checkpoints is not None:
            model.save(checkpoint_file)
            if best is not None:  # before the checkpoint: a resumed run then finds it
                best.epoch_end(epoch, logs, checkpoint_file)
            checkpoints.write(epoch + 1, _checkpoint_bytes(checkpoint_file, optimizer),
                              {"history": history, "attempts": attempts, "framework": "keras"})
        late = spec.get("deadline") is not None and time.time() >= spec["deadline"]
        asked = bool(getattr(model, "stop_training", False))
        if epoch + 1 < spec["epochs"]:
            votes = np.asarray(sum_over_workers(tf.constant([1.0 if asked or late else 0.0])))[0]
            if votes > 0:
                stop_reason = "callback" if asked else "max_time"
                if rank == 0:
                    print(f"training stopped after epoch {epoch + 1}: "
                          + ("a callback asked to stop" if asked else "max_time reached"),
                          flush=True)
                break
    for callback in callbacks:
        with user_code(f"callback {type(callback).__name__}.on_train_end"):
            callback.on_train_end({k: v[-1] for k, v in history.items()})
    feed.close()
    sample = next(iter(train_reader.epoch(0)))
    sample = next(BatchFeed(transform, model_names)([{k: v[:1] for k, v in sample.items()}]))
    x, _, _ = tensors(sample)
    outputs = model(x if len(features) > 1 else x[0])
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if rank != 0:
        return {}
    weights = best.model_bytes() if best is not None else None
    if weights is not None:
        print(f"the model of the best epoch by {best.monitor} ({best.best:.4g}) is the fitted "
              f"model (checkpoint_callback)", flush=True)
    else:
        trained = os.path.join(workdir, "trained.keras")
        model.save(trained)
        with open(trained, "rb") as f:
            weights = f.read()
    return {"model": weights, "history": history, "stop_reason": stop_reason,
            "attempts": attempts, "output_shapes": [list(o.shape[1:]) for o in outputs]}


def main(workdir: str) -> int:
    try:
        import cloudpickle

        with open(os.path.join(workdir, "spec.json")) as f:
            spec = json.load(f)
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            payload = cloudpickle.load(f)
        if spec.get("ps_role") in ("ps", "worker"):  # joins until its task kills it
            from sparktrain.estimators.keras_ps import serve

            serve(spec, payload, workdir)
            return 0
        result = train(spec, payload, workdir)
        with open(os.path.join(workdir, "result.pkl"), "wb") as f:
            pickle.dump(result, f)
        return 0
    except BaseException as exc:
        text = traceback.format_exc()
        with open(os.path.join(workdir, "error.txt"), "w") as f:
            f.write(text)
        source = user_error_source(exc)
        if source is not None:  # tells the task not to have Spark retry it
            with open(os.path.join(workdir, USER_ERROR_FILE), "w") as f:
                f.write(source)
        print(text, file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
