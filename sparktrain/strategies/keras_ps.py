"""``strategy="parameter_server"``: ``tf.distribute.ParameterServerStrategy`` (``num_ps``).

TensorFlow's ``ParameterServerStrategy`` splits the tasks into roles: ``num_ps`` parameter
servers hold the variables, one coordinator (the ``chief``) runs the Python training loop and
schedules train steps, the other tasks are workers that run the scheduled steps asynchronously,
each applying its own gradients to the variables on the parameter servers. sparktrain's loop
(:func:`sparktrain.loop.keras_loop.train`) stays the same; only these pieces change:

- roles (:meth:`ParameterServer.roles`): barrier task 0 is the chief, tasks ``1..num_ps`` are
  parameter servers, the rest are workers; each task's launch (servers, shard hand-over,
  shutdown) is :mod:`sparktrain.launch.tf_parameter_server`'s.
- ps and worker tasks run :func:`serve`: a ``tf.distribute.Server`` that joins forever (the
  Spark task SIGTERMs it when the coordinator is done,
  :mod:`sparktrain.launch.tf_parameter_server`).
  A worker first writes its shard of the materialized training data into local files
  (:func:`write_shard`), one serialized tensor per model input, label and weight. Python
  generators or ``tf.py_function`` in a ``dataset_fn`` would run in the coordinator's process,
  not on the worker (TensorFlow pins Python functions to the process that created them,
  tensorflow.org/tutorials/distribute/parameter_server_training "Known limitations"), so the
  worker's data reaches TensorFlow as files only its own TF ops read.
- the coordinator builds the strategy and a ``ClusterCoordinator`` (:func:`make_strategy`),
  a per-worker dataset over those files (:func:`per_worker_dataset`), and schedules an
  epoch's steps (:func:`scheduled_epoch`). Without a ``variable_partitioner`` TensorFlow places
  whole variables on the parameter servers round-robin: that is how they are spread over
  ``num_ps > 1`` servers. A partitioner (splitting single variables) is not offered: Keras 3
  layers read ``variable.handle``, which TF's ``ShardedVariable`` does not have.

Example (coordinator side, what ``ParameterServer`` does inside ``keras_loop.train``)::

    strategy, coordinator = make_strategy(tf)
    iterator = iter(per_worker_dataset(tf, coordinator, spec.launch_info["shards"], 64, True, 0))
    totals = scheduled_epoch(coordinator, step, iterator, steps=100, on_step=print)
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from sparktrain.launch.tf_protocol import READY, SHARD_INFO
from sparktrain.options.payload import KerasPayload
from sparktrain.options.spec import KerasTrainSpec
from sparktrain.strategies.keras_strategy import KerasStrategy, RankLoop, stacked_steps


def task_role(rank: int, num_ps: int) -> Tuple[str, int]:
    """``(TF job, index)`` of barrier task ``rank``: 0 the chief, then ps, then workers."""
    if rank == 0:
        return "chief", 0
    if rank <= num_ps:
        return "ps", rank - 1
    return "worker", rank - 1 - num_ps


class ParameterServer(KerasStrategy):
    """Asynchronous training: variables on ``num_ps`` servers, steps scheduled on workers."""

    engine_needs = ("runs_strategy_roles",)  # chief, ps and worker tasks
    engine_note = ("TensorFlowOnSpark runs its ps nodes in a forked process stopped through "
                   "its driver-side shutdown, which sparktrain replaces (see the README)")
    trains_on_own_rows = False  # ps tasks hold variables; workers get scheduled steps
    params = {"num_ps": "parameter servers"}
    elastic = False
    not_elastic_note = ("its tasks' roles (chief, workers, num_ps parameter servers holding the "
                        "variables) are fixed for the fit; a lost parameter server takes its "
                        "variables with it. Use strategy='multi_worker_mirrored'")

    @classmethod
    def check(cls, name: str, backend: str, num_proc: int,
              params: Dict[str, Any]) -> Dict[str, Any]:
        super().check(name, backend, num_proc, params)
        num_ps = params.get("num_ps") or 1
        if num_ps >= num_proc - 1:
            raise ValueError(f"strategy={name!r} with num_proc={num_proc} tasks has "
                             f"room for at most {max(num_proc - 2, 0)} parameter server(s) "
                             f"(one task coordinates, at least one trains), got "
                             f"num_ps={num_ps}; raise num_proc to at least {num_ps + 2}")
        return {"num_ps": num_ps}

    @property
    def num_ps(self) -> int:
        return int(self.spec.strategy_options.get("num_ps", 1))

    # -- Spark task ---------------------------------------------------------------------------
    def roles(self, world_size: int) -> List[Tuple[str, int]]:
        return [task_role(rank, self.num_ps) for rank in range(world_size)]

    def run_task(self, task: Any) -> Any:
        from sparktrain.launch.tf_parameter_server import run_ps_task

        return run_ps_task(task)

    def serve(self, payload: KerasPayload, workdir: str, batch_tensors: Callable) -> None:
        serve(self.spec, payload, workdir, batch_tensors)

    # -- the coordinator's training process ---------------------------------------------------
    def distribute(self, tf: Any) -> Any:
        self.strategy, self.coordinator = make_strategy(tf)
        return self.strategy

    def prepare_optimizer(self, model: Any, optimizer: Any) -> None:
        if not optimizer.built:  # its variables on the parameter servers too
            optimizer.build(model.trainable_variables)

    def steps_per_epoch(self, reader_steps: int) -> int:
        # steps scheduled per epoch, over all workers: as many rows as the other strategy
        spec, shards = self.spec, self.spec.launch_info["shards"]
        rows = sum(s["rows"] for s in shards)
        self.train_steps = spec.train_steps * len(shards) if spec.train_steps else \
            -(-rows // spec.batch_size)
        return self.train_steps

    def compile(self, tf: Any, forward: Callable, model: Any, optimizer: Any) -> None:
        spec, strategy = self.spec, self.strategy
        self.per_worker = iter(per_worker_dataset(tf, self.coordinator, spec.launch_info["shards"],
                                                  spec.batch_size, spec.shuffle, spec.seed))

        @tf.function
        def train_step(iterator: Any) -> Any:
            def replica(batch: Any) -> Any:
                x, y = list(batch[0]), list(batch[1])
                with tf.GradientTape() as tape:
                    per_row, stats, _ = forward(x, y, batch[2] if len(batch) > 2 else None,
                                                True)
                    # each worker applies its own gradients: the mean over its batch
                    loss = tf.reduce_sum(per_row) / tf.cast(tf.shape(per_row)[0], tf.float32)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return stats
            return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                   strategy.run(replica, args=(next(iterator),)), axis=None)

        self._train_step = train_step
        # validation runs in the coordinator, reading the variables from the parameter servers
        self._eval_step = stacked_steps(tf, lambda x, y, w: forward(x, y, w, False)[1])

    def train_epoch(self, loop: RankLoop, epoch: int, report: bool) -> Any:
        from sparktrain.faults import user_code

        with user_code("the training step (the model, the loss or the metrics)"):
            return scheduled_epoch(self.coordinator, self._train_step, self.per_worker,
                                   self.train_steps, loop.step_reporter(epoch, report))

    def eval_step(self, xs: Any, ys: Any, ws: Any, total: Any) -> Any:
        return self._eval_step(xs, ys, ws, total)

    def sum_over_workers(self, local: Any) -> Any:  # one coordinator: its sums are the totals
        return local

    def describe(self) -> str:
        return f"ParameterServerStrategy: {self.num_ps} parameter server(s), " \
               f"{len(self.spec.launch_info['shards'])} worker(s), {self.train_steps} " \
               f"steps/epoch of {self.spec.batch_size} rows scheduled on the workers"


def make_strategy(tf: Any) -> Tuple[Any, Any]:
    """``(ParameterServerStrategy, ClusterCoordinator)`` for the cluster in ``TF_CONFIG``."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def write_shard(spec: KerasTrainSpec, payload: KerasPayload, workdir: str, index: int,
                count: int, batch_tensors: Callable) -> Dict[str, Any]:
    """Worker ``index`` of ``count``: read its shard of the training data, apply
    ``transformation_fn`` (once per row, here), shape the columns as the train step takes them
    and write each as a serialized tensor file; return where they are and their shapes.
    ``batch_tensors``: the rank loop's (:func:`sparktrain.loop.keras_batch.batch_tensors`),
    passed in: strategies sit below the loop."""
    import numpy as np
    import tensorflow as tf

    from sparktrain.data.columns import ColumnSpec
    from sparktrain.data.reader import ShardReader
    from sparktrain.faults import user_code

    columns = [ColumnSpec.from_json(c) for c in spec.columns]
    reader = ShardReader(spec.rows.root, spec.rows.layouts["train"], columns, index, count,
                         spec.batch_size, False, spec.seed, spec.storage_options)
    transform = payload.transformation_fn
    parts: Dict[str, List[Any]] = {}
    for batch in reader.epoch(0):
        if transform is not None:
            with user_code("transformation_fn"):
                batch = transform(batch)
        for name, values in batch.items():
            parts.setdefault(name, []).append(np.asarray(values))
    if not parts:
        raise ValueError(f"parameter server worker {index} got no training rows: the data "
                         f"has fewer row groups than the {count} workers; use a smaller "
                         f"num_proc")
    whole = {name: np.concatenate(values) for name, values in parts.items()}
    x, y, w = batch_tensors(tf, whole, spec.feature_cols, spec.label_cols,
                            spec.sample_weight_col, spec.input_shapes, spec.label_shapes)
    folder = os.path.join(workdir, "shard")
    os.makedirs(folder, exist_ok=True)

    def saved(kind: str, i: int, tensor: Any) -> List[Any]:
        path = os.path.join(folder, f"{kind}{i}.tensor")
        tf.io.write_file(path, tf.io.serialize_tensor(tensor))
        return [path, tensor.dtype.name, [int(d) for d in tensor.shape[1:]]]

    return {"rows": int(x[0].shape[0]), "x": [saved("x", i, t) for i, t in enumerate(x)],
            "y": [saved("y", i, t) for i, t in enumerate(y)],
            "w": saved("w", 0, w) if w is not None else None}


def serve(spec: KerasTrainSpec, payload: KerasPayload, workdir: str,
          batch_tensors: Callable) -> None:
    """A ps or worker task: (worker) write the shard, start the server, join forever."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type == "worker":
        info = write_shard(spec, payload, workdir, resolver.task_id,
                           len(resolver.cluster_spec().as_dict()["worker"]), batch_tensors)
        with open(os.path.join(workdir, SHARD_INFO + ".tmp"), "w") as f:
            json.dump(info, f)
        os.replace(os.path.join(workdir, SHARD_INFO + ".tmp"), os.path.join(workdir, SHARD_INFO))
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc", start=True)
    open(os.path.join(workdir, READY), "w").close()
    print(f"{resolver.task_type}:{resolver.task_id} serving at {server.target}", flush=True)
    server.join()


def per_worker_dataset(tf: Any, coordinator: Any, shards: List[Dict[str, Any]],
                       batch_size: int, shuffle: bool, seed: Optional[int]) -> Any:
    """Each worker's endless, batched dataset over its own shard files (``shards``: what
    :func:`write_shard` returned, by worker index)."""
    def column(key: str, i: Optional[int]) -> Any:
        entries = [s[key] if i is None else s[key][i] for s in shards]
        dtype, shape = tf.as_dtype(entries[0][1]), entries[0][2]
        paths = tf.constant([e[0] for e in entries])
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        tensor = tf.io.parse_tensor(tf.io.read_file(tf.gather(paths, index)), dtype)
        return tf.ensure_shape(tensor, [None] + shape)

    weighted = shards[0]["w"] is not None
    biggest = max(s["rows"] for s in shards)

    def dataset_fn() -> Any:
        x = tuple(column("x", i) for i in range(len(shards[0]["x"])))
        y = tuple(column("y", i) for i in range(len(shards[0]["y"])))
        rows = (x, y, column("w", None)) if weighted else (x, y)
        data = tf.data.Dataset.from_tensor_slices(rows)
        if shuffle:
            data = data.shuffle(biggest, seed=seed, reshuffle_each_iteration=True)
        # endless: an epoch is a number of scheduled steps, and a fast worker takes more
        return data.repeat().batch(batch_size).prefetch(2)

    return coordinator.create_per_worker_dataset(dataset_fn)


def scheduled_epoch(coordinator: Any, step: Callable, iterator: Any, steps: int,
                    on_step: Callable[[int, Any], None]) -> Any:
    """Schedule ``steps`` runs of ``step(iterator)`` on the workers; return the sum of what
    they returned; ``on_step(i, values)`` sees each step's values as they arrive (in order)."""
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    total = None
    for i, result in enumerate(results):
        values = result.fetch()
        total = values if total is None else total + values
        on_step(i, values)
    coordinator.join()
    return total
