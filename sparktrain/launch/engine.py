"""What an engine (``backend=``) is: one small interface per framework.

An engine says how the ranks are launched and how they talk; a strategy
(:mod:`sparktrain.strategies`) says how they hold the model. Each engine is one class,
registered by name in :data:`sparktrain.launch.TORCH_BACKENDS` or
:data:`sparktrain.launch.KERAS_BACKENDS` (``register_torch_backend``,
``register_keras_backend``). What the estimators and strategies must know about an engine is a
class attribute (a *capability*) they read; nobody compares engine names.

- :class:`TorchEngine`: one object per rank, built inside the barrier task by the torch loop
  (``Engine(ctx, device)``): the communicator the strategies train with (``wrap``,
  ``all_reduce_sum``, ``close``). Its class travels to the executors in the training payload.
- :class:`KerasEngine`: a launcher, used as a class. Either every barrier task runs
  :meth:`KerasEngine.run` (which starts the TensorFlow child process), or, with
  ``launches_itself``, the driver calls :meth:`KerasEngine.launch`, which starts its own
  cluster around the Spark job.

This module imports no framework (the torch engines import torch in their own files).

Example (an engine of your own, see docs/engines-and-strategies.md)::

    from sparktrain.launch import register_torch_backend
    from sparktrain.launch.torch_ddp import TorchDDP

    class LoggedDDP(TorchDDP):
        def wrap(self, model, optimizer, *args, **kwargs):
            print(f"rank {self.rank} of {self.world_size} wraps {type(model).__name__}")
            return super().wrap(model, optimizer, *args, **kwargs)

    register_torch_backend("logged_ddp", LoggedDDP)
    TorchEstimator(..., backend="logged_ddp").fit(df)
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Tuple


class TorchEngine:
    """Base class of the torch engines: one rank's communicator.

    Capabilities (class attributes, read on the driver and by the strategies):

    - ``fp16_loss_scaling``: ``mixed_precision='fp16'`` works (the loop's ``GradScaler`` scales
      the loss, and the engine's all-reduce takes the scaled gradients);
    - ``torch_distributed``: it forms ``torch.distributed``'s default process group, which
      strategies that shard the model over the ranks (FSDP) need.
    """

    fp16_loss_scaling: ClassVar[bool] = True
    torch_distributed: ClassVar[bool] = False

    #: set by ``__init__``: this rank, the number of ranks, the rank's ``torch.device``
    rank: int
    world_size: int
    device: Any

    def __init__(self, ctx: Any, device: Any) -> None:
        """Join the other ranks: ``ctx`` is the task's
        :class:`~sparktrain.launch.barrier.RankContext` (``rank``, ``world_size``, ``hosts``,
        ``all_gather``), ``device`` the ``torch.device`` this rank trains on."""
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, device

    def wrap(self, model: Any, optimizer: Any, backward_passes_per_step: int = 1,
             compression: Optional[str] = None, broadcast: bool = True) -> Tuple[Any, Any]:
        """The module and optimizer to train with: gradients averaged over the ranks (once
        every ``backward_passes_per_step`` backward passes, compressed to float16 with
        ``compression="fp16"``); rank 0's parameters broadcast first unless ``broadcast=False``
        (every rank loaded the same weights)."""
        raise NotImplementedError

    def all_reduce_sum(self, tensor: Any) -> Any:
        """``tensor`` summed over the ranks (every rank calls it; returned, maybe in place)."""
        raise NotImplementedError

    def close(self) -> None:
        """Leave the group and release what ``__init__`` opened (called once, last)."""


class KerasEngine:
    """Base class of the Keras engines: how a Keras fit's barrier tasks start TensorFlow.

    Used as a class (its methods are class or static methods). Capabilities:

    - ``launches_itself``: the driver calls :meth:`launch`, which starts the engine's own
      cluster around the Spark job (TensorFlowOnSpark); else each barrier task calls
      :meth:`run`;
    - ``streams_rows``: takes ``input_mode='stream'`` (each task hands the rows Spark streams
      to it to its training process);
    - ``elastic``: trains with another number of ranks from one generation to the next
      (``min_num_proc < num_proc``); ``not_elastic_note`` says why not;
    - ``runs_strategy_roles``: gives each task the TensorFlow job the strategy's ``roles`` name
      and runs it through the strategy's ``run_task`` (parameter servers need it);
    - ``needs_classic_session``: needs the ``SparkContext`` (no Spark Connect);
      ``classic_session_note`` says what for.
    """

    launches_itself: ClassVar[bool] = False
    streams_rows: ClassVar[bool] = True
    elastic: ClassVar[bool] = True
    not_elastic_note: ClassVar[str] = ""
    runs_strategy_roles: ClassVar[bool] = True
    needs_classic_session: ClassVar[bool] = False
    classic_session_note: ClassVar[str] = ""

    @classmethod
    def run(cls, ctx: Any, spec: Any, payload: bytes, use_gpu: bool, strategy: type) -> Any:
        """Executor side, one barrier task (when not ``launches_itself``): train this task's
        part of the fit and return its result (rank 0's is the fit's). ``spec``: the task's
        ``KerasTrainSpec``; ``payload``: the pickled
        :class:`~sparktrain.options.payload.KerasPayload`; ``strategy``: the
        ``KerasStrategy`` class."""
        raise NotImplementedError(f"{cls.__name__} runs no barrier task of its own")

    @classmethod
    def launch(cls, spark: Any, num_proc: int, spec: Any, payload: Any, use_gpu: bool,
               **options: Any) -> Any:
        """Driver side (``launches_itself``): train on ``num_proc`` ranks and return rank 0's
        result. ``payload``: the stored payload (``.value``: its bytes); ``options``: the
        launch's ``description``, ``echo_logs``, ``on_progress``, ``max_attempts`` and where
        the barrier job keeps its files."""
        raise NotImplementedError(f"{cls.__name__} does not launch itself")
