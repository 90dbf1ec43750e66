"""``strategy="multi_worker_mirrored"`` (the default):
``tf.distribute.MultiWorkerMirroredStrategy``.

Every barrier task is a TensorFlow ``worker`` holding a replica of the model; each trains on its
own shard, the Keras optimizer all-reduces the gradients and applies them (TensorFlow's
documented pattern for custom training with ``tf.distribute``,
tensorflow.org/tutorials/distribute/multi_worker_with_ctl). Keras 3's ``model.fit`` fails under
this strategy (keras-team/keras#20585), hence a train step of sparktrain's own.

Example (what ``keras_loop.train`` does with it)::

    strategy = MultiWorkerMirrored(spec)
    with strategy.distribute(tf).scope():
        model = keras.saving.load_model(path)
    strategy.compile(tf, forward, model, optimizer)
    totals = strategy.train_epoch(loop, epoch=0, report=True)
"""
from __future__ import annotations

from typing import Any, Callable

from sparktrain.strategies.keras_strategy import KerasStrategy, RankLoop, stacked_steps


class MultiWorkerMirrored(KerasStrategy):
    """Synchronous data parallel training, a model replica per barrier task."""

    def distribute(self, tf: Any) -> Any:
        self.tf = tf
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        return self.strategy

    def compile(self, tf: Any, forward: Callable, model: Any, optimizer: Any) -> None:
        strategy, world = self.strategy, self.spec.world_size

        def train_step(x: Any, y: Any, w: Any) -> Any:
            def replica(x: Any, y: Any, w: Any) -> Any:
                with tf.GradientTape() as tape:
                    per_row, stats, _ = forward(x, y, w, True)
                    loss = tf.reduce_sum(per_row) / (tf.cast(tf.shape(per_row)[0], tf.float32)
                                                     * world)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return stats
            # this worker's statistics only: they are summed over workers once per epoch, not
            # per step (an all-reduce per step cost as much as the gradients' own)
            return strategy.experimental_local_results(strategy.run(replica, args=(x, y, w)))[0]

        def eval_step(x: Any, y: Any, w: Any) -> Any:
            def replica(x: Any, y: Any, w: Any) -> Any:
                return forward(x, y, w, False)[1]
            return strategy.experimental_local_results(strategy.run(replica, args=(x, y, w)))[0]

        @tf.function
        def sum_over_workers(local: Any) -> Any:
            return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                   strategy.run(tf.identity, args=(local,)), axis=None)

        self._train_step, self._eval_step = stacked_steps(tf, train_step), \
            stacked_steps(tf, eval_step)
        self._sum = sum_over_workers

    def train_epoch(self, loop: RankLoop, epoch: int, report: bool) -> Any:
        return loop.run_epoch(self._train_step, epoch, report, self.spec.train_steps)

    def eval_step(self, xs: Any, ys: Any, ws: Any, total: Any) -> Any:
        return self._eval_step(xs, ys, ws, total)

    def sum_over_workers(self, local: Any) -> Any:
        return self._sum(local)

    def describe(self) -> str:
        spec = self.spec
        return f"{spec.world_size} worker(s), backend {spec.backend!r} " \
               f"(MultiWorkerMirroredStrategy): {self.train_steps} steps/epoch of " \
               f"{spec.batch_size} rows per worker"
