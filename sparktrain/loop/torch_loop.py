"""The PyTorch training loop that runs inside each barrier task (executor side).

Everything it needs arrives as a :class:`TorchTrainSpec` of plain values plus one cloudpickled
:class:`~sparktrain.options.payload.TorchPayload` (the model and optimizer, pickled together so
the optimizer keeps pointing at the model's own parameters after unpickling, the loss, metrics,
callbacks, and the strategy and engine classes).

Conventions (shared with :class:`~sparktrain.estimators.torch.TorchModel`):

* the model is called as ``model(*features)``, or by keyword when the feature columns are
  named like ``forward``'s parameters (:mod:`.torch_forward`, also for dict/``ModelOutput``
  results and a model's own loss), one 2-D tensor per feature column: ``(batch, 1)``
  for scalar columns (unlike Horovod's ``(batch,)``: what ``nn.Linear`` and ``torch.cat``
  expect), ``(batch, n)`` for vectors/arrays; float columns arrive as float32, integers as int64;
* a label is reshaped to its output's shape when they hold the same number of values; a label
  of class indices (output ``(batch, classes)``, label ``(batch,)``) is cast to int64;
* with ``sample_weight_col`` the loss is computed per row and weighted as Keras does:
  ``mean(w * loss_i)`` over the batch.
"""
from __future__ import annotations

import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sparktrain.data.epoch_steps import take_steps
from sparktrain.data.sources import rank_readers
from sparktrain.data.sources.contract import RowReader
from sparktrain.data.transform_stage import BatchFeed
from sparktrain.faults import user_code
from sparktrain.launch import TORCH_BACKENDS, load_backend
from sparktrain.launch.elastic import for_rank, scaling_ranks
from sparktrain.launch.rank_context import RankContext
from sparktrain.loop.epochs import EpochDriver, Logs, StepReporter
from sparktrain.loop.torch_batch import (
    Batches,
    LossComputer,
    select_device,
)
from sparktrain.loop.torch_board import TorchBoard
from sparktrain.loop.torch_checkpoint import checkpoint_bytes, restore
from sparktrain.loop.torch_files import BuiltModule, dumps_without_weights, save_weights
from sparktrain.loop.torch_forward import ForwardRule
from sparktrain.loop.torch_losses import build_losses, named_metrics
from sparktrain.loop.torch_schedule import Schedule
from sparktrain.loop.torch_steps import StepRule, averaged, run_epoch
from sparktrain.options.payload import TorchPayload
from sparktrain.options.spec import TorchTrainSpec
from sparktrain.strategies import TORCH_STRATEGIES, load_strategy
from sparktrain.strategies.torch_blocks import blocks, checkpoint_activations
from sparktrain.strategies.torch_strategy import StrategyConfig, TorchStrategy


def _autocast_dtype(spec: TorchTrainSpec) -> Optional[torch.dtype]:
    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.mixed_precision]


class _TorchEpochs:
    """This rank's part of the epoch protocol (:class:`sparktrain.loop.epochs.EpochTraining`)."""

    def __init__(self, spec: TorchTrainSpec, ctx: RankContext, dist: Any, device: torch.device,
                 strategy: TorchStrategy, model: torch.nn.Module, trained: torch.nn.Module,
                 forward: ForwardRule, step_rule: StepRule, compute_loss: LossComputer,
                 metrics: List[Tuple[str, Callable]], callbacks: List[Any], feed: BatchFeed,
                 readers: Dict[str, RowReader], shapes: List,
                 driver: Optional[EpochDriver] = None) -> None:
        self.spec, self.ctx, self.dist, self.device = spec, ctx, dist, device
        self.strategy, self.model, self.trained = strategy, model, trained
        self.step_rule = step_rule
        self.forward = forward
        self.compute_loss, self.metrics, self.callbacks = compute_loss, metrics, callbacks
        self.feed, self.readers, self.shapes = feed, readers, shapes
        self.to_tensors = Batches(spec, device)
        self.autocast = _autocast_dtype(spec)
        self.driver = driver

    def batches(self, split: str, epoch: int, steps: Optional[int], skip: int = 0,
                order: Optional[str] = None, trained: Optional[bytes] = None
                ) -> Iterator[Dict]:
        """The epoch's batches of ``split`` (``steps`` of them when given; the first ``skip``
        left out, in the reader's ``order``, or the rows not in ``trained``), transformed."""
        return self.feed(take_steps(self.readers[split], epoch, steps, skip, order, trained),
                         split, epoch)

    def train_begin(self, history: Dict[str, List[float]]) -> None:
        """The callbacks' ``on_train_begin`` (a resumed run's history so far)."""
        for callback in self.callbacks:
            if hasattr(callback, "on_train_begin"):
                with user_code(f"callback {type(callback).__name__}.on_train_begin"):
                    callback.on_train_begin(self.model, {k: list(v) for k, v in history.items()})

    def train_end(self) -> None:
        """The callbacks' ``on_train_end``."""
        for callback in self.callbacks:
            if hasattr(callback, "on_train_end"):
                with user_code(f"callback {type(callback).__name__}.on_train_end"):
                    callback.on_train_end(self.model)

    def all_reduce_sum(self, values: Sequence[float]) -> List[float]:
        return _all_reduce(self.dist, self.device, values)

    def position(self, batches_done: int) -> Optional[bytes]:
        return self.readers["train"].position(batches_done)

    def train_epoch(self, epoch: int, reporter: Optional[StepReporter]) -> Logs:
        reader = self.readers["train"]
        steps = self.spec.train_steps or len(reader)
        within = self.driver.within if self.driver is not None else None
        skip, order = (within.skip, within.order) if within is not None else (0, None)
        trained = within.trained if within is not None and not self.spec.train_steps else None
        if trained is not None:  # exactly the rows left: as many batches as they fill
            steps = skip + reader.resumed_steps(trained)
        sums, names, self.shapes = run_epoch(
            self.trained, self.forward,
            self.batches("train", epoch, self.spec.train_steps, skip, order, trained),
            steps, self.to_tensors, self.compute_loss, self.metrics, self.spec.label_cols,
            self.step_rule, self.autocast, reporter, within,
            lambda: getattr(reader, "order", None))
        if self.step_rule.schedule is not None:
            with user_code("lr_scheduler's step"):
                self.step_rule.schedule.after_epoch()
        return averaged(self.dist, sums, names, "")

    def evaluate(self, epoch: int) -> Logs:
        reader = self.readers.get("val")
        if reader is None:
            return {}
        sums, names, _ = run_epoch(
            self.trained, self.forward, self.batches("val", 0, self.spec.val_steps),
            self.spec.val_steps or len(reader), self.to_tensors, self.compute_loss, self.metrics,
            self.spec.label_cols, autocast=self.autocast)
        self.strategy.after_evaluation(self.model)
        return averaged(self.dist, sums, names, "val_")

    def epoch_end(self, epoch: int, logs: Logs) -> bool:
        asked = []
        for callback in self.callbacks:
            if hasattr(callback, "on_epoch_end"):
                with user_code(f"callback {type(callback).__name__}.on_epoch_end"):
                    asked.append(bool(callback.on_epoch_end(epoch, dict(logs))))
        return any(asked)

    def checkpoint(self, epoch: int, logs: Logs, mid_epoch: bool = False
                   ) -> Optional[Tuple[bytes, Dict[str, Any]]]:
        # a collective under a sharding strategy: the full copy is rank 0's only until written
        weights, optimizer_state = self.strategy.full_state(self.model, self.step_rule.optimizer)
        if self.ctx.rank != 0:
            return None
        schedule = self.step_rule.schedule
        return checkpoint_bytes(self.model, weights, optimizer_state,
                                schedule.state_dict() if schedule is not None else None), \
            {"output_shapes": self.shapes}


def _strategy(spec: TorchTrainSpec, dist: Any, device: torch.device,
              payload: TorchPayload, built_on_rank: bool) -> TorchStrategy:
    """The strategy the estimator resolved on the driver (its class travels in the payload,
    so a strategy registered only there works), else the one registered here by name.
    ``built_on_rank``: a model callable built the model here (its weights may differ by rank)."""
    cls = payload.strategy or load_strategy(TORCH_STRATEGIES, spec.strategy)
    config = StrategyConfig(mixed_precision=_autocast_dtype(spec),
                            gradient_compression=spec.gradient_compression,
                            backward_passes_per_step=spec.backward_passes_per_step,
                            same_weights_everywhere=not built_on_rank,
                            options=dict(payload.strategy_options or {}))
    return cls(dist, device, config)


@dataclass
class _Loaded:
    """The training payload, unpickled, with its model and optimizer loaded."""

    payload: TorchPayload
    model: torch.nn.Module
    optimizer: Any

    @classmethod
    def loads(cls, blob: bytes, state: Any = None) -> "_Loaded":
        """``state``: what ``ShippedModule.load`` builds the model around (the driver's tensors,
        ``"meta"``), else the shipped weights."""
        payload = TorchPayload.loads(blob)
        # weights memory-mapped from the store's file (copied to this host once if remote)
        model, optimizer = payload.model.load(state)
        return cls(payload, model, optimizer)

    @property
    def built_here(self) -> bool:
        """Whether a model callable built the model on this rank (no shipped weights)."""
        return isinstance(self.payload.model, BuiltModule)

    def loss_and_forward(self, spec: TorchTrainSpec, optimizer: Any, device: torch.device,
                         rank: int, world_size: int) -> Tuple[LossComputer, ForwardRule]:
        """The loss computer and how the model is called; ``optimizer``: the one training (a
        strategy's), which Horovod's ``loss_constructors`` receive."""
        loss, n_labels = self.payload.loss, len(spec.label_cols)
        if self.payload.loss_constructors is not None:
            with user_code("loss_constructors"):
                loss = build_losses(self.payload.loss_constructors, n_labels, model=self.model,
                                    optimizer=optimizer, device=device, rank=rank,
                                    world_size=world_size)
        compute_loss = LossComputer(loss, n_labels, bool(spec.sample_weight_col),
                                    spec.loss_weights)
        forward = ForwardRule.for_model(self.model, spec.feature_cols, n_labels, loss is not None,
                                        spec.output_key)
        return compute_loss, forward


def train(spec: TorchTrainSpec, payload: Any, ctx: RankContext) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns weights (``torch.save`` bytes), history, the model's
    output shapes and why training stopped, the other ranks ``None``.

    Resumes from the run's latest checkpoint when there is one (a retried attempt, or a fit
    with the ``run_id`` of an earlier run); rank 0 writes a checkpoint after every epoch.
    """
    spec = for_rank(spec, ctx)  # an elastic generation's batch size
    _prepare_process(spec, ctx)
    blob = payload.value if hasattr(payload, "value") else payload
    with user_code("unpickling the model, optimizer, loss, metrics and callbacks on the "
                   "executor (its Python needs the modules and versions they were made with)"):
        shipped = _Loaded.loads(blob)
    del blob
    # a model the rank built: its pickle (weights by key) for the fitted model, taken before
    # a strategy wraps it
    architecture = dumps_without_weights(shipped.model, shipped.model) \
        if ctx.rank == 0 and shipped.built_here else None
    driver = EpochDriver.for_spec(
        spec, rank=ctx.rank, world_size=ctx.world_size, attempt=ctx.attempt, log=ctx.log,
        progress=ctx.progress, board=lambda: TorchBoard(spec.run_path, spec.storage_options),
        require_finite=True, meta={"framework": "torch", "strategy": spec.strategy})
    device = select_device(ctx, spec.use_gpu)

    readers = rank_readers(spec, ctx.rank, ctx.world_size, ctx.task_input, ctx.all_gather,
                           ctx.log, ctx.hosts)
    if driver.resume_rows is not None and not spec.train_steps:
        # before the collective below: no rank's rows of the epoch arrive before it knows
        # which were trained (rank 0 asks for every rank's)
        readers["train"].resume_at(driver.first, driver.resume_rows)
    train_steps = spec.train_steps or len(readers["train"])
    feed = BatchFeed.for_spec(spec, shipped.payload.transformation_fn)
    # the engine the estimator resolved (so one registered only on the driver works)
    engine = shipped.payload.engine or load_backend(TORCH_BACKENDS, spec.backend)
    dist = engine(ctx, device)
    trained: Optional[torch.nn.Module]
    epochs: Optional[_TorchEpochs]
    try:
        driver.agree(lambda values: _all_reduce(dist, device, values))
        strategy, trained, step_rule = _set_up(spec, ctx, shipped, driver, dist, device)
        compute_loss, forward = shipped.loss_and_forward(spec, step_rule.optimizer, device,
                                                         ctx.rank, ctx.world_size)
        epochs = _TorchEpochs(spec, ctx, dist, device, strategy, shipped.model, trained, forward,
                              step_rule, compute_loss, named_metrics(shipped.payload.metrics),
                              list(shipped.payload.callbacks or []), feed, readers,
                              driver.meta.get("output_shapes", []), driver)
        driver.start(train_steps, f"{ctx.world_size} rank(s), backend {spec.backend!r}, "
                                  f"strategy {spec.strategy!r}, this rank on "
                                  f"{ctx.hosts[ctx.rank]} {device}: {train_steps} steps/epoch "
                                  f"of {spec.batch_size} rows per rank")
        return _fit(spec, driver, epochs, architecture)
    finally:
        trained = epochs = None  # a DDP reducer holds the process group: release it first
        feed.close()
        for reader in readers.values():  # removes the local caches
            reader.close()
        dist.close()


def _prepare_process(spec: TorchTrainSpec, ctx: RankContext) -> None:
    """Seed the RNGs, size torch's thread pool to the task's CPUs."""
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
        np.random.seed(spec.seed)
    torch.set_num_threads(max(1, ctx.cpus))
    # Batches are zero-copy views of Arrow buffers read for this epoch only; nothing reads them
    # again, so torch's warning about read-only arrays does not apply.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _set_up(spec: TorchTrainSpec, ctx: RankContext, shipped: _Loaded, driver: EpochDriver,
            dist: Any, device: torch.device) -> Tuple[TorchStrategy, torch.nn.Module, StepRule]:
    """The model and optimizer resumed from the run's checkpoint (or with the learning rate
    scaled) and set up by the strategy: the strategy, the module training and the step rule."""
    model, optimizer, payload = shipped.model, shipped.optimizer, shipped.payload
    resumed = driver.resume_bytes()
    state: Dict[str, Any] = {}
    if resumed is not None:
        assert driver.resume is not None  # resume_bytes() read driver.resume's bytes
        state = restore(resumed, model, optimizer, driver.resume.payload_path)
    if resumed is None and spec.scale_learning_rate:
        factor = scaling_ranks(spec, ctx.world_size) * spec.backward_passes_per_step
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
    recompute = payload.activation_checkpointing
    if recompute:
        wrap = payload.fsdp_wrap
        checkpoint_activations(blocks(model, wrap if recompute is True else recompute))
    # resumed or shipped weights come from one file, the same on every rank
    strategy = _strategy(spec, dist, device, payload,
                         built_on_rank=resumed is None and shipped.built_here)
    trained, optimizer = strategy.setup(model, optimizer)
    scaler = strategy.grad_scaler() if _autocast_dtype(spec) == torch.float16 else None
    schedule = Schedule.build(payload.lr_scheduler, optimizer, spec.lr_scheduler_interval)
    if schedule is not None and state.get("scheduler") is not None:
        schedule.restore(state["scheduler"])
    step_rule = StepRule(optimizer, strategy, spec.backward_passes_per_step, scaler,
                      minibatch_fn=payload.train_minibatch_fn,
                      keep_label_shapes=bool(spec.label_shapes), schedule=schedule)
    return strategy, trained, step_rule


def _fit(spec: TorchTrainSpec, driver: EpochDriver, epochs: _TorchEpochs,
         architecture: Optional[bytes]) -> Optional[Dict[str, Any]]:
    """Run the epochs between the callbacks' ``on_train_begin`` and ``on_train_end``; rank 0
    writes the fitted weights to the store and returns :func:`train`'s result."""
    epochs.train_begin(driver.history)
    stop_reason = driver.run(epochs)
    epochs.train_end()
    weights, _ = epochs.strategy.full_state(epochs.model)
    if epochs.ctx.rank != 0:
        return None
    # to the store, not through Spark's task result and the driver's heap
    url = f"{spec.run_path}/model/weights-{uuid.uuid4().hex[:12]}.pt"
    result = {"architecture": architecture} if architecture is not None else {}
    return {**result, "weights_file": save_weights(weights, url, spec.storage_options),
            "history": driver.history, "output_shapes": epochs.shapes,
            "stop_reason": stop_reason, "attempts": driver.attempts}


def _all_reduce(dist: Any, device: torch.device, values: Sequence[float]) -> List[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    return dist.all_reduce_sum(tensor).cpu().tolist()


def check_batch(spec: TorchTrainSpec, blob: bytes, batch: Dict[str, np.ndarray],
                state: Union[Dict[str, torch.Tensor], Literal["meta"]]) -> None:
    """Driver-side preflight (see :mod:`sparktrain.estimators.preflight`): what one validation
    step of training runs (``transformation_fn``, the batch's tensors, the forward pass, the
    loss and the metrics) on ``batch``, on the CPU without gradients, with the model unpickled
    from the training payload ``blob`` around the driver's tensors ``state`` (no copy of the
    weights; nothing writes them without gradients), or built on the meta device for a model
    callable (``state="meta"``).

    Raises what training would raise; ``PreflightError`` is built from it by the caller.
    """
    shipped = _Loaded.loads(blob, state)
    model, metrics = shipped.model, shipped.payload.metrics
    on_meta = any(p.is_meta for p in model.parameters())
    device = torch.device("meta" if on_meta else "cpu")
    if on_meta:
        metrics = []  # metrics may read values (.item(), numpy), which meta tensors do not have
    compute_loss, forward = shipped.loss_and_forward(spec, shipped.optimizer, device, 0, 1)
    batches = BatchFeed(shipped.payload.transformation_fn, spec.model_columns())([batch])
    run_epoch(model, forward, batches, 1, Batches(spec, device), compute_loss,
               named_metrics(metrics),
               spec.label_cols, autocast=_autocast_dtype(spec) if spec.mixed_precision == "bf16"
               else None)
