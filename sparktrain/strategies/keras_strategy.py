"""``KerasStrategy``: how ``KerasEstimator``'s ranks hold the model and apply gradients.

One class per strategy, registered by name in :data:`sparktrain.strategies.KERAS_STRATEGIES`.
It is asked in three places, and nobody else compares strategy names:

- the driver (``KerasEstimator``): :meth:`KerasStrategy.check` validates ``backend``,
  ``num_proc`` and the strategy's own params, and returns the plain options the ranks get
  (``KerasTrainSpec.strategy_options``);
- each Spark task of the ``tensorflow`` backend (:mod:`sparktrain.launch.tf_multiworker`):
  :meth:`~KerasStrategy.roles` gives every barrier task its TensorFlow job (which becomes
  ``TF_CONFIG``) and :meth:`~KerasStrategy.run_task` runs the task in it (by default: train);
  a task that only serves the cluster runs :meth:`~KerasStrategy.serve` in its child process;
- the training process (:func:`sparktrain.loop.keras_loop.train`): it builds the
  ``tf.distribute`` strategy (:meth:`~KerasStrategy.distribute`), the steps
  (:meth:`~KerasStrategy.compile`) and asks for each epoch (:meth:`~KerasStrategy.train_epoch`).

The class travels to the executors pickled (by value when it is defined in your own code).
TensorFlow is imported inside the methods only: ``import sparktrain`` must not import it.

Example (mirrored training that also prints each epoch's step count)::

    from sparktrain.strategies import register_keras_strategy
    from sparktrain.strategies.keras_mirrored import MultiWorkerMirrored

    class Chatty(MultiWorkerMirrored):
        def train_epoch(self, loop, epoch, report):
            print(f"epoch {epoch}: {self.train_steps} steps")
            return super().train_epoch(loop, epoch, report)

    register_keras_strategy("chatty", Chatty)
    KerasEstimator(..., strategy="chatty").fit(df)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, cast

from sparktrain.launch import KERAS_BACKENDS
from sparktrain.options.payload import KerasPayload
from sparktrain.options.spec import KerasTrainSpec
from sparktrain.strategies import check_engine


@dataclass
class RankLoop:
    """What the training loop lends a strategy for an epoch (see ``keras_loop.train``).

    ``run_epoch(step_fn, epoch, report, steps)``: ``total = step_fn(xs, ys, ws, total)`` over
    this rank's training batches, ``steps_per_execution`` of them stacked per call (see
    :func:`stacked_steps`), the totals summed over workers; ``step_reporter(epoch, report)``:
    an ``on_step(i, values)`` that sends step progress (of ``train_steps``) when ``report``."""

    run_epoch: Callable[[Callable, int, bool, Optional[int]], Any]
    step_reporter: Callable[..., Callable[[int, Any], None]]


class KerasStrategy:
    """Base class of Keras strategies; subclasses implement the rank-side methods."""

    #: the capabilities its engine must have (class attributes of
    #: :class:`sparktrain.launch.engine.KerasEngine`, e.g. ``"runs_strategy_roles"``)
    engine_needs: Tuple[str, ...] = ()
    #: why it does not train on the other engines (the error message's end)
    engine_note: str = ""
    #: whether every task trains on the rows it is given (``input_mode='stream'`` hands each
    #: task its own rows)
    trains_on_own_rows: bool = True
    #: KerasEstimator params of its own -> what they set up ("parameter servers")
    params: Dict[str, str] = {}
    #: whether it trains with any number of ranks from one generation to the next
    #: (``min_num_proc < num_proc``, :mod:`sparktrain.launch.elastic`); else why not
    elastic: bool = True
    not_elastic_note: str = ""

    def __init__(self, spec: KerasTrainSpec) -> None:
        self.spec = spec
        self.train_steps = 0  # per epoch, set by steps_per_epoch

    # -- driver ---------------------------------------------------------------------------------
    @classmethod
    def check(cls, name: str, backend: str, num_proc: int,
              params: Dict[str, Any]) -> Dict[str, Any]:
        """Raise ``ValueError`` when the engine registered as ``backend`` (its capabilities,
        ``engine_needs``), ``num_proc`` or the strategy-specific ``params`` (name -> value,
        ``None`` when not set) do not fit this strategy; return the options the ranks get
        (plain values)."""
        check_engine(cls, name, KERAS_BACKENDS, backend)
        for key, value in params.items():
            if value is not None and key not in cls.params:
                takers, what = _strategies_taking(key)
                raise ValueError(f"{key}={value} needs strategy={' or '.join(takers)} (got "
                                 f"strategy={name!r}, which has no {what})")
        return {}

    # -- Spark task (tensorflow backend) ----------------------------------------------------------
    def roles(self, world_size: int) -> List[Tuple[str, int]]:
        """The TensorFlow ``(job, index)`` of each barrier task, in rank order."""
        return [("worker", rank) for rank in range(world_size)]

    def run_task(self, task: Any) -> Any:
        """Run this barrier task (a :class:`sparktrain.launch.tf_multiworker.TFTask`); return
        its result (rank 0's is the fit's). By default: train in a child process."""
        return task.train()

    def serve(self, payload: KerasPayload, workdir: str, batch_tensors: Callable) -> None:
        """A child process of role ``spec.role``: serve until the task stops it.
        ``batch_tensors``: the rank loop's :func:`~sparktrain.loop.keras_batch.batch_tensors`
        (a reader batch as the train step's tensors), lent as :class:`RankLoop` lends its
        epochs."""
        raise NotImplementedError(f"{type(self).__name__} has no serving role "
                                  f"{self.spec.role!r}")

    # -- training process -------------------------------------------------------------------------
    def distribute(self, tf: Any) -> Any:
        """The ``tf.distribute.Strategy`` whose ``scope()`` the model is loaded in."""
        raise NotImplementedError

    def prepare_optimizer(self, model: Any, optimizer: Any) -> None:
        """Inside the scope, after the model and optimizer are loaded."""

    def steps_per_epoch(self, reader_steps: int) -> int:
        """Training steps per epoch (shown in progress); ``reader_steps``: this rank's batches."""
        self.train_steps = self.spec.train_steps or reader_steps
        return self.train_steps

    def compile(self, tf: Any, forward: Callable, model: Any, optimizer: Any) -> None:
        """Build the steps: ``forward(x, y, w, training) -> (per_row, stats, outputs)``; a
        train step that :meth:`train_epoch` gives to ``RankLoop.run_epoch`` is made by
        :func:`stacked_steps`."""
        raise NotImplementedError

    def train_epoch(self, loop: RankLoop, epoch: int, report: bool) -> Any:
        """One epoch of training; the statistics' totals over all workers."""
        raise NotImplementedError

    def eval_step(self, xs: Any, ys: Any, ws: Any, total: Any) -> Any:
        """``total`` plus the statistics of stacked validation batches (this rank's; see
        :func:`stacked_steps`)."""
        raise NotImplementedError

    def sum_over_workers(self, local: Any) -> Any:
        """``local`` summed over the workers that train."""
        raise NotImplementedError

    def describe(self) -> str:
        """The first line rank 0 prints."""
        return f"{self.spec.world_size} worker(s), backend {self.spec.backend!r} " \
               f"({type(self).__name__}): {self.train_steps} steps/epoch"


def stacked_steps(tf: Any, one_step: Callable[[Any, Any, Any], Any]) -> Callable:
    """A ``tf.function`` ``steps(xs, ys, ws, total)`` that runs ``one_step(x, y, w)`` (which
    returns a batch's statistics) on each of a few batches stacked on a new first axis and
    returns ``total`` plus their statistics: ``xs``/``ys`` are lists of ``(k, batch, ...)``
    tensors, ``ws`` one ``(k, batch)`` tensor or ``None``.

    Several steps in one call, as Keras' ``steps_per_execution`` does: on CPU one call of a
    distributed step function costs more than a small model's step, and a graph loop
    (``tf.range``, a ``while_loop``) is traced once for any ``k``.

    Example::

        steps = stacked_steps(tf, lambda x, y, w: forward(x, y, w, False)[1])
        total = steps(*stack_batches(tf, [([x0], [y0], None), ([x1], [y1], None)]),
                      tf.zeros([2]))
    """
    @tf.function(reduce_retracing=True)
    def steps(xs: Any, ys: Any, ws: Any, total: Any) -> Any:
        for i in tf.range(tf.shape(xs[0])[0]):
            total += one_step([x[i] for x in xs], [y[i] for y in ys],
                              None if ws is None else ws[i])
        return total
    return steps


def stack_batches(tf: Any, batches: Sequence[Tuple[List[Any], List[Any], Any]]
                  ) -> Tuple[List[Any], List[Any], Any]:
    """``(xs, ys, ws)`` for :func:`stacked_steps`: batches' ``(x, y, w)`` tensors of one shape
    stacked on a new first axis."""
    xs = [tf.stack(column) for column in zip(*(x for x, _, _ in batches), strict=True)]
    ys = [tf.stack(column) for column in zip(*(y for _, y, _ in batches), strict=True)]
    ws = None if batches[0][2] is None else tf.stack([w for _, _, w in batches])
    return xs, ys, ws


def _strategies_taking(param: str) -> Tuple[List[str], str]:
    """The registered strategies (``repr`` of their names) that take ``param``, and what it
    sets up."""
    from sparktrain.strategies import KERAS_STRATEGIES, load_strategy

    takers, what = [], param
    for name in KERAS_STRATEGIES:
        # registered strategies subclass KerasStrategy (register_keras_strategy)
        strategy = cast(Type[KerasStrategy], load_strategy(KERAS_STRATEGIES, name))
        if param in getattr(strategy, "params", {}):
            takers.append(repr(name))
            what = strategy.params[param]
    return takers or ["(none registered)"], what
