"""The PyTorch training loop that runs inside each barrier task (executor side).

Everything it needs arrives as a :class:`TorchTrainSpec` of plain values plus one cloudpickled
payload ``(model, optimizer, loss, metrics, callbacks)``: pickled together, the optimizer keeps
pointing at the model's own parameters after unpickling.

Conventions (shared with :class:`~sparktrain.estimators.torch.TorchModel`):

* the model is called as ``model(*features)``, one 2-D tensor per feature column: ``(batch, 1)``
  for scalar columns (unlike Horovod's ``(batch,)``: what ``nn.Linear`` and ``torch.cat``
  expect), ``(batch, n)`` for vectors/arrays; float columns arrive as float32, integers as int64;
* a label is reshaped to its output's shape when they hold the same number of values; a label
  of class indices (output ``(batch, classes)``, label ``(batch,)``) is cast to int64;
* with ``sample_weight_col`` the loss is computed per row and weighted as Keras does:
  ``mean(w * loss_i)`` over the batch.
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np
import torch

from sparktrain.checkpoint import Checkpoint, Checkpoints
from sparktrain.data.feed import BatchFeed
from sparktrain.data.reader import ShardReader, take_steps
from sparktrain.data.schema import ColumnSpec
from sparktrain.launch import TORCH_BACKENDS, load_backend
from sparktrain.launch.barrier import RankContext
from sparktrain.launch.faults import mark_user_error, user_code
from sparktrain.launch.gpus import rank_gpu


@dataclass
class TorchTrainSpec:
    """Plain-valued description of one fit, shipped to every rank."""

    dataset_root: str
    layouts: Dict[str, List]
    columns: List[Dict]
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: Optional[int]
    backend: str
    use_gpu: bool
    verbose: int
    run_path: str = ""
    storage_options: Dict[str, Any] = field(default_factory=dict, repr=False)
    train_steps: Optional[int] = None
    val_steps: Optional[int] = None
    inmemory_cache_all: bool = False
    backward_passes_per_step: int = 1
    scale_learning_rate: bool = False
    mixed_precision: Optional[str] = None
    deadline: Optional[float] = None  # time.time() after which training stops at an epoch end
    # Horovod's params (see TorchEstimator)
    input_shapes: Optional[List[List[int]]] = None
    label_shapes: Optional[List[List[int]]] = None
    loss_weights: Optional[List[float]] = None
    gradient_compression: Optional[str] = None  # "fp16"
    backend_env: Dict[str, str] = field(default_factory=dict, repr=False)
    train_prefetch: int = 2  # row groups the readers decode ahead
    val_prefetch: int = 2
    reader_pool: str = "thread"  # "process": transformation_fn in decode worker processes
    train_decode_workers: int = 2
    val_decode_workers: int = 2
    mp_start_method: Optional[str] = None
    strategy: str = "ddp"  # or "fsdp": see sparktrain.estimators.torch_sharding
    fsdp_cpu_offload: bool = False


def select_device(ctx: RankContext, use_gpu: bool) -> torch.device:
    """The first GPU Spark assigned to this task (by its ordinal, which stays right in a
    reused Python worker where CUDA is already initialised), or the CPU."""
    address = rank_gpu(ctx.resources, use_gpu)
    if address is None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Spark assigned GPU {address} to rank {ctx.rank}, but torch "
                           f"{torch.__version__} cannot use CUDA here; install a CUDA build of "
                           f"torch or pass use_gpu=False")
    device = torch.device("cuda", int(address))
    torch.cuda.set_device(device)
    return device


def named_metrics(metrics: Any) -> List[Tuple[str, Callable]]:
    """``[(name, fn)]`` from a list of functions, ``(name, fn)`` pairs or a dict."""
    if not metrics:
        return []
    items = metrics.items() if isinstance(metrics, dict) else metrics
    named = []
    for item in items:
        if isinstance(item, tuple):
            named.append((str(item[0]), item[1]))
        else:
            named.append((getattr(item, "__name__", type(item).__name__), item))
    return named


def match_label(output: torch.Tensor, label: torch.Tensor, reshape: bool = True) -> torch.Tensor:
    """Bring ``label`` to the shape/dtype ``output``'s loss expects (see module docstring);
    ``reshape=False`` (``label_shapes`` given) keeps the label's shape."""
    if output.dim() >= 2 and output.shape[-1] > 1 and label.dim() == 1 \
            and label.shape[0] == output.shape[0]:
        return label.long()  # class indices for a (batch, classes) output
    if reshape and label.numel() == output.numel() and label.shape != output.shape:
        label = label.reshape(output.shape)
    if output.is_floating_point() and not label.is_floating_point() \
            and label.shape == output.shape:
        label = label.to(output.dtype)
    return label


class _LossComputer:
    """Total loss over outputs/labels, optionally weighted per row."""

    def __init__(self, loss: Any, n_labels: int, weighted: bool,
                 loss_weights: Optional[Sequence[float]] = None) -> None:
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * n_labels
        if len(losses) != n_labels:
            raise ValueError(f"got {len(losses)} losses for {n_labels} label columns")
        if weighted:
            losses = [self._per_row(fn) for fn in losses]
        self.losses, self.weighted = losses, weighted
        self.loss_weights = list(loss_weights) if loss_weights else None  # Horovod's loss_weights

    @staticmethod
    def _per_row(fn: Any) -> Any:
        if isinstance(fn, torch.nn.Module) and hasattr(fn, "reduction"):
            fn = copy.copy(fn)
            fn.reduction = "none"
        return fn

    def __call__(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                 weights: Optional[torch.Tensor]) -> torch.Tensor:
        total = 0
        for index, (fn, output, label) in enumerate(zip(self.losses, outputs, labels)):
            value = fn(output, label)
            if self.weighted:
                if value.dim() == 0:
                    raise ValueError("with sample_weight_col the loss must return one value per "
                                     "row: use a torch.nn loss (its reduction is set to 'none') "
                                     "or a function returning shape (batch,)")
                per_row = value.reshape(value.shape[0], -1).mean(dim=1)
                # Keras' convention, mean over rows of w * loss (not / sum(w)): each rank's
                # gradient then adds up to the globally weighted one under DDP averaging.
                value = (per_row * weights).mean()
            if self.loss_weights is not None:
                value = value * self.loss_weights[index]
            total = total + value
        return total


class _Batches:
    """Turns reader batches (numpy) into device tensors in the model's calling convention:
    features reshaped to ``spec.input_shapes`` (Horovod's param) when given, else 2-D; labels
    reshaped to ``spec.label_shapes`` when given."""

    def __init__(self, spec: TorchTrainSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def __call__(self, batch: Dict[str, np.ndarray]):
        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(batch[name]).to(self.device, non_blocking=True)

        spec = self.spec
        if spec.input_shapes:
            features = [_reshaped("input_shapes", c, tensor(c), shape)
                        for c, shape in zip(spec.feature_cols, spec.input_shapes)]
        else:
            features = [as_2d(tensor(c)) for c in spec.feature_cols]
        labels = [tensor(c) for c in spec.label_cols]
        if spec.label_shapes:
            labels = [_reshaped("label_shapes", c, label, shape)
                      for c, label, shape in zip(spec.label_cols, labels, spec.label_shapes)]
        weights = tensor(self.spec.sample_weight_col) if self.spec.sample_weight_col else None
        return features, labels, weights


def _reshaped(param: str, column: str, t: torch.Tensor, shape: List[int]) -> torch.Tensor:
    """``t.reshape(shape)``, or an error naming the param, the column and the sizes."""
    try:
        return t.reshape(shape)
    except RuntimeError:
        per_row = t[0].numel() if t.dim() and t.shape[0] else 0
        raise ValueError(f"{param}: column {column!r} has {per_row} value(s) per row (a batch "
                         f"of {tuple(t.shape)}), which do not fit the shape {list(shape)}; "
                         f"change {param} or the column") from None


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """Scalar feature columns as ``(batch, 1)``."""
    return t if t.dim() > 1 else t.unsqueeze(1)


def _as_outputs(result: Any) -> List[torch.Tensor]:
    return list(result) if isinstance(result, (list, tuple)) else [result]


@dataclass
class _Step:
    """How one training step runs: gradient accumulation and (fp16) loss scaling."""

    optimizer: Any
    passes: int = 1  # backward_passes_per_step
    scaler: Any = None  # torch.amp.GradScaler for fp16
    minibatch_fn: Any = None  # Horovod's train_minibatch_fn: owns backward and the steps
    keep_label_shapes: bool = False  # label_shapes given: transform_outputs keeps them

    def minibatch(self, model: Any, features: List[torch.Tensor], labels: List[torch.Tensor],
                  weights: Optional[torch.Tensor], step: int, compute_loss: Any
                  ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """One training batch by the user's ``train_minibatch_fn`` (Horovod's signature and
        contract, see ``TorchEstimator``): forward, loss, backward and the optimizer's
        ``zero_grad``/``step`` at group boundaries are the function's."""
        def transform_outputs(outputs: Any, labels: List[torch.Tensor]) -> Tuple[List, List]:
            outputs = _as_outputs(outputs)
            return outputs, [match_label(o, l, not self.keep_label_shapes)
                             for o, l in zip(outputs, labels)]

        outputs, loss = self.minibatch_fn(model, self.optimizer, transform_outputs, compute_loss,
                                          features, labels, weights, self.passes, step)
        return _as_outputs(outputs), loss

    def end_epoch(self) -> None:
        """With a ``train_minibatch_fn``, one more ``optimizer.step()`` after the epoch's last
        batch applies its last group's gradients (what Horovod's loop does)."""
        if self.minibatch_fn is not None:
            self.optimizer.step()

    def backward(self, model: Any, loss: torch.Tensor, step: int, steps: int) -> None:
        """Backward pass of ``step``; the optimizer steps after every ``passes`` batches (and
        after the last). Each group's gradient is the mean of its batches' gradients."""
        if self.minibatch_fn is not None:
            return  # the user's train_minibatch_fn ran backward already
        group_start = step - step % self.passes
        group = min(self.passes, steps - group_start)
        last = step + 1 == group_start + group
        scaled = loss / group if group > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        # DDP all-reduces gradients in backward: skip that until the group's last batch. An
        # FSDP2 module has no no_sync: it reduce-scatters every pass and accumulates sharded
        # gradients (more traffic, but no full-size gradients held between passes).
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") \
            else model.no_sync()
        with sync:
            scaled.backward()
        if last:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()  # set_to_none by default in torch 2; Horovod takes no args


def model_columns(spec: TorchTrainSpec) -> List[str]:
    """The batch columns the model, the loss and the sample weighting read."""
    return list(spec.feature_cols) + list(spec.label_cols) + \
        ([spec.sample_weight_col] if spec.sample_weight_col else [])


def _run_epoch(model: torch.nn.Module, batches: Iterator[Dict], steps: int,
               to_tensors: _Batches, compute_loss: _LossComputer,
               metrics: List[Tuple[str, Callable]], label_cols: List[str],
               step_rule: Optional[_Step] = None, autocast: Optional[torch.dtype] = None,
               on_step: Optional[Callable[[int, torch.Tensor], None]] = None
               ) -> Tuple[torch.Tensor, List[str], List]:
    """One pass over ``steps`` batches (training when ``step_rule`` is given); returns summed
    ``[rows, loss*rows, metric*rows...]`` and the output shapes."""
    training = step_rule is not None
    model.train(training)
    names = [f"{name}" if len(label_cols) == 1 else f"{label}_{name}"
             for label in label_cols for name, _ in metrics]
    sums = torch.zeros(2 + len(names), dtype=torch.float64, device=to_tensors.device)
    shapes: List = []
    device = to_tensors.device
    casting = contextlib.nullcontext() if autocast is None \
        else torch.autocast(device_type=device.type, dtype=autocast)
    with torch.set_grad_enabled(training):
        for step, batch in enumerate(batches):
            features, labels, weights = to_tensors(batch)
            loss = None
            with casting:
                if training and step_rule.minibatch_fn is not None:
                    with user_code("train_minibatch_fn"):
                        outputs, loss = step_rule.minibatch(model, features, labels, weights,
                                                            step, compute_loss)
                else:
                    with user_code("the model's forward pass"):
                        outputs = _as_outputs(model(*features))
                if len(outputs) != len(labels):
                    raise mark_user_error(ValueError(
                        f"the model returned {len(outputs)} outputs for {len(labels)} label "
                        f"columns {label_cols}"), "the model's outputs")
                with user_code("the loss"):
                    labels = [match_label(o, l, not to_tensors.spec.label_shapes)
                              for o, l in zip(outputs, labels)]
                    if loss is None:
                        loss = compute_loss(outputs, labels, weights)
            if training:
                with user_code("the backward pass or the optimizer step"):
                    step_rule.backward(model, loss, step, steps)
            rows = features[0].shape[0]
            values = [loss.detach().float()]
            with torch.no_grad():
                for output, label in zip(outputs, labels):
                    for name, fn in metrics:
                        with user_code(f"metric {name!r}"):
                            values.append(torch.as_tensor(fn(output.float(), label))
                                          .detach().float().mean())
            sums[0] += rows
            sums[1:] += torch.stack([v.to(sums.dtype) for v in values]) * rows
            shapes = [list(o.shape[1:]) for o in outputs]
            if on_step is not None:
                on_step(step, loss)
    if training:
        with user_code("the optimizer step"):
            step_rule.end_epoch()
    return sums, names, shapes


def _averaged(dist: Any, sums: torch.Tensor, names: List[str], prefix: str) -> Dict[str, float]:
    total = dist.all_reduce_sum(sums.clone()).cpu().tolist()
    rows = max(total[0], 1.0)
    result = {f"{prefix}loss": total[1] / rows}
    result.update({f"{prefix}{name}": value / rows for name, value in zip(names, total[2:])})
    return result


class _StepReporter:
    """Rank 0's step events for the driver's progress bar, at most ``per_second`` a second."""

    def __init__(self, ctx: RankContext, epoch: int, steps: int, per_second: float = 4.0) -> None:
        self.ctx, self.epoch, self.steps = ctx, epoch, steps
        self.interval, self.last = 1.0 / per_second, 0.0

    def __call__(self, step: int, loss: torch.Tensor) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval or step + 1 == self.steps:
            self.last = now
            self.ctx.progress(event="step", epoch=self.epoch, step=step + 1,
                              loss=float(loss.detach()))


class _TensorBoard:
    """Rank 0's TensorBoard event files under ``<run>/tensorboard/{train,validation}``.

    Written locally (straight into the store when it is a local directory, else into a temp
    directory copied to the store after every epoch); ``tensorboard --logdir <run>/tensorboard``.
    """

    def __init__(self, run_path: str, storage_options: Dict[str, Any]) -> None:
        import sys
        import tempfile
        import types

        # tensorboard.compat imports all of TensorFlow when it is installed (8 s here) unless
        # the module tensorboard.compat.notf exists: its own switch to the TF-free stub.
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from torch.utils.tensorboard import SummaryWriter

        from sparktrain.data.store import filesystem

        self.fs, remote = filesystem(run_path + "/tensorboard", storage_options)
        self.remote = None if "://" not in run_path else remote
        local = tempfile.mkdtemp(prefix="sparktrain-tb-") if self.remote else remote
        self.local = local
        self.writers = {split: SummaryWriter(f"{local}/{split}") for split in ("train", "validation")}

    def write(self, epoch: int, logs: Dict[str, float]) -> None:
        for key, value in logs.items():
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self.writers[split].add_scalar(f"epoch/{name}", value, epoch + 1)
        for writer in self.writers.values():
            writer.flush()
        if self.remote:
            self.fs.put(self.local + "/", self.remote, recursive=True)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def _format_epoch(epoch: int, epochs: int, logs: Dict[str, float], seconds: float) -> str:
    values = "  ".join(f"{k}={v:.4g}" for k, v in logs.items())
    return f"epoch {epoch + 1}/{epochs}  {values}  ({seconds:.1f}s)"


def _checkpoint_bytes(weights: Dict[str, torch.Tensor], optimizer_state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": weights, "optimizer": optimizer_state}, buffer)
    return buffer.getvalue()


class _Replicated:
    """The model whole on every rank (``strategy="ddp"``, and Horovod): rank 0's copy is
    the state."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @staticmethod
    def reshard(model: torch.nn.Module) -> None:
        """Nothing to free: the model is whole everywhere."""

    def full_state(self, model: torch.nn.Module, optimizer: Any = None
                   ) -> Tuple[Dict[str, torch.Tensor], Any]:
        if self.rank != 0:
            return {}, None
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return weights, optimizer.state_dict() if optimizer is not None else None


def _hold(spec: TorchTrainSpec, dist: Any, model: torch.nn.Module, optimizer: Any,
          device: torch.device, extras: Dict[str, Any]) -> Tuple[Any, torch.nn.Module, Any]:
    """Place the model for training by ``spec.strategy``: ``(holder, module to train,
    optimizer)``; ``holder.full_state`` gives the checkpointed state."""
    from sparktrain.estimators import torch_sharding

    wrap = extras.get("fsdp_wrap")
    recompute = extras.get("activation_checkpointing")
    if recompute:
        chosen = torch_sharding.blocks(model, wrap if recompute is True else recompute)
        torch_sharding.checkpoint_activations(chosen)
    if spec.strategy == "fsdp":
        holder = torch_sharding.FullySharded(
            device, wrap, mixed_precision=_autocast_dtype(spec),
            reduce_fp16=spec.gradient_compression == "fp16",
            cpu_offload=spec.fsdp_cpu_offload and device.type == "cuda")
        with user_code("rebuilding the optimizer over the sharded parameters"):
            model, optimizer = holder.wrap(model, optimizer)
        return holder, model, optimizer
    model.to(device)
    for state in optimizer.state.values():  # optimizer state (e.g. Adam moments) follows
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)
    compression = {"compression": spec.gradient_compression} if spec.gradient_compression else {}
    trained, optimizer = dist.wrap(model, optimizer,
                                   backward_passes_per_step=spec.backward_passes_per_step,
                                   **compression)
    return _Replicated(dist.rank), trained, optimizer


def _agree_on(dist: Any, device: torch.device, resume: Optional[Checkpoint]) -> None:
    """Fail the attempt (Spark retries it) unless every rank found the same latest checkpoint:
    one could appear meanwhile, written by a rank 0 of an attempt being torn down. One small
    all-reduce, not a Spark ``allGather`` (about 0.5 s each here)."""
    mine = resume.epochs_done if resume is not None else 0
    total = dist.all_reduce_sum(torch.tensor([float(mine)], dtype=torch.float64, device=device))
    if total.item() != mine * dist.world_size:
        raise RuntimeError("ranks found different latest checkpoints of the run; the attempt "
                           "is retried")


def _restore(checkpoint: bytes, model: torch.nn.Module, optimizer: Any) -> None:
    state = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise mark_user_error(RuntimeError(
            f"the run's checkpoint does not fit this model/optimizer ({exc}); pass a new run_id "
            f"to start a fresh run"), "resuming from the run's checkpoint") from None


def _autocast_dtype(spec: TorchTrainSpec) -> Optional[torch.dtype]:
    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.mixed_precision]


def _grad_scaler(spec: TorchTrainSpec, device: torch.device) -> Any:
    """fp16's loss scaler. Sharded gradients need every rank to agree on whether to skip a
    step: FSDP's ``ShardedGradScaler`` all-reduces the inf/NaN check, ``GradScaler`` does not."""
    if spec.strategy == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def _stop_votes(dist: Any, device: torch.device, vote: bool) -> bool:
    """True when any rank votes to stop (callbacks or the time limit): all ranks stop alike."""
    flag = torch.tensor([1.0 if vote else 0.0], dtype=torch.float64, device=device)
    return bool(dist.all_reduce_sum(flag).item() > 0)


def train(spec: TorchTrainSpec, payload: Any, ctx: RankContext) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns weights (``torch.save`` bytes), history, the model's
    output shapes and why training stopped, the other ranks ``None``.

    Resumes from the run's latest checkpoint when there is one (a retried attempt, or a fit
    with the ``run_id`` of an earlier run); rank 0 writes a checkpoint after every epoch.
    """
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
        np.random.seed(spec.seed)
    torch.set_num_threads(max(1, ctx.cpus))
    # Batches are zero-copy views of Arrow buffers read for this epoch only; nothing reads them
    # again, so torch's warning about read-only arrays does not apply.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    blob = payload.value if hasattr(payload, "value") else payload
    with user_code("unpickling the model, optimizer, loss, metrics and callbacks on the "
                   "executor (its Python needs the modules and versions they were made with)"):
        model, optimizer, loss, metrics, callbacks, transform, *more = cloudpickle.loads(blob)
    del blob  # as large as the model: not kept through the fit
    extras: Dict[str, Any] = more[0] if more else {}  # Horovod's loss_constructors, minibatch fn
    callbacks = list(callbacks or [])
    checkpoints = Checkpoints(spec.run_path, spec.storage_options) if spec.run_path else None
    resume = checkpoints.latest() if checkpoints is not None else None
    meta: Dict[str, Any] = resume.meta if resume is not None else {}
    device = select_device(ctx, spec.use_gpu)

    columns = [ColumnSpec.from_json(c) for c in spec.columns]
    make_reader = lambda split, batch, shuffle: ShardReader(  # noqa: E731
        spec.dataset_root, spec.layouts[split], columns, ctx.rank, ctx.world_size, batch,
        shuffle, spec.seed, spec.storage_options, inmemory_cache_all=spec.inmemory_cache_all,
        prefetch=spec.train_prefetch if split == "train" else spec.val_prefetch)
    train_reader = make_reader("train", spec.batch_size, spec.shuffle)
    val_reader = make_reader("val", spec.val_batch_size, False) if spec.layouts.get("val") else None
    train_steps = spec.train_steps or len(train_reader)
    val_steps = spec.val_steps or (len(val_reader) if val_reader is not None else 0)

    feed = BatchFeed(transform, model_columns(spec), spec.reader_pool,
                     {"train": spec.train_decode_workers, "val": spec.val_decode_workers},
                     spec.seed, spec.mp_start_method)

    def batches(reader: ShardReader, epoch: int, steps: Optional[int]) -> Iterator[Dict]:
        return feed(take_steps(reader, epoch, steps),
                    "train" if reader is train_reader else "val", epoch)

    dist = load_backend(TORCH_BACKENDS, spec.backend)(ctx, device)
    trained = board = None
    try:
        _agree_on(dist, device, resume)
        if resume is not None:
            _restore(checkpoints.read(resume), model, optimizer)
        elif spec.scale_learning_rate:
            factor = ctx.world_size * spec.backward_passes_per_step
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
        holder, trained, optimizer = _hold(spec, dist, model, optimizer, device, extras)
        autocast = _autocast_dtype(spec)
        scaler = _grad_scaler(spec, device) if autocast == torch.float16 else None
        step_rule = _Step(optimizer, spec.backward_passes_per_step, scaler,
                          minibatch_fn=extras.get("train_minibatch_fn"),
                          keep_label_shapes=bool(spec.label_shapes))
        if extras.get("loss_constructors") is not None:
            from sparktrain.estimators.torch import build_losses

            with user_code("loss_constructors"):
                loss = build_losses(extras["loss_constructors"], len(spec.label_cols),
                                    model=model, optimizer=optimizer, device=device,
                                    rank=ctx.rank, world_size=ctx.world_size)
        compute_loss = _LossComputer(loss, len(spec.label_cols), bool(spec.sample_weight_col),
                                     spec.loss_weights)
        metric_fns = named_metrics(metrics)
        to_tensors = _Batches(spec, device)
        history: Dict[str, List[float]] = {k: list(v) for k, v in meta.get("history", {}).items()}
        shapes: List = meta.get("output_shapes", [])
        first = meta.get("epochs_done", 0)
        attempts = meta.get("attempts", []) + [{"attempt": ctx.attempt, "start_epoch": first}]
        lead = ctx.rank == 0 and spec.verbose >= 1
        if spec.verbose >= 2 or lead:
            ctx.log(f"{ctx.world_size} rank(s), backend {spec.backend!r}, this rank on "
                    f"{ctx.hosts[ctx.rank]} {device}: {train_steps} steps/epoch of "
                    f"{spec.batch_size} rows per rank")
        if ctx.rank == 0 and resume is not None:
            ctx.log(f"resuming from the checkpoint after epoch {first} (attempt "
                    f"{ctx.attempt + 1})")
        if lead:
            ctx.progress(event="start", epochs=spec.epochs, steps=train_steps, first=first)
        if ctx.rank == 0 and spec.run_path:
            board = _TensorBoard(spec.run_path, spec.storage_options)
        for callback in callbacks:
            if hasattr(callback, "on_train_begin"):
                with user_code(f"callback {type(callback).__name__}.on_train_begin"):
                    callback.on_train_begin(model, {k: list(v) for k, v in history.items()})
        stop_reason = None
        for epoch in range(first, spec.epochs):
            started = time.perf_counter()
            reporter = _StepReporter(ctx, epoch, train_steps) if lead else None
            sums, names, shapes = _run_epoch(
                trained, batches(train_reader, epoch, spec.train_steps), train_steps,
                to_tensors, compute_loss, metric_fns, spec.label_cols, step_rule, autocast,
                reporter)
            logs = _averaged(dist, sums, names, "")
            if val_reader is not None:
                val_sums, names, _ = _run_epoch(
                    trained, batches(val_reader, 0, spec.val_steps), val_steps, to_tensors,
                    compute_loss, metric_fns, spec.label_cols, autocast=autocast)
                logs.update(_averaged(dist, val_sums, names, "val_"))
                holder.reshard(model)
            if not all(math.isfinite(v) for v in logs.values()):
                raise mark_user_error(FloatingPointError(
                    f"non-finite metrics at epoch {epoch + 1}: {logs}; lower the learning "
                    f"rate or check the data"), "the loss or metrics")
            for key, value in logs.items():
                history.setdefault(key, []).append(value)
            if board is not None:
                board.write(epoch, logs)
            if lead:
                ctx.progress(event="epoch", epoch=epoch, logs=logs)
                ctx.log(_format_epoch(epoch, spec.epochs, logs, time.perf_counter() - started))
            asked = []
            for callback in callbacks:
                if hasattr(callback, "on_epoch_end"):
                    with user_code(f"callback {type(callback).__name__}.on_epoch_end"):
                        asked.append(bool(callback.on_epoch_end(epoch, dict(logs))))
            late = spec.deadline is not None and time.time() >= spec.deadline
            if checkpoints is not None:
                # with fsdp every rank gathers; the full copy is rank 0's only until written
                checkpoint = _checkpoint_bytes(*holder.full_state(model, optimizer))
                if ctx.rank == 0:
                    checkpoints.write(epoch + 1, checkpoint,
                                      {"history": history, "output_shapes": shapes,
                                       "attempts": attempts, "framework": "torch",
                                       "strategy": spec.strategy})
                del checkpoint
            if epoch + 1 < spec.epochs and _stop_votes(dist, device, any(asked) or late):
                stop_reason = "callback" if any(asked) else "max_time"
                if ctx.rank == 0:
                    ctx.log(f"training stopped after epoch {epoch + 1}: "
                            + ("a callback asked to stop" if stop_reason == "callback"
                               else "max_time reached"))
                break
        for callback in callbacks:
            if hasattr(callback, "on_train_end"):
                with user_code(f"callback {type(callback).__name__}.on_train_end"):
                    callback.on_train_end(model)
        weights, _ = holder.full_state(model)
        if ctx.rank != 0:
            return None
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        return {"weights": buffer.getvalue(), "history": history, "output_shapes": shapes,
                "stop_reason": stop_reason, "attempts": attempts}
    finally:
        if board is not None:
            board.close()
        trained = None  # a DDP reducer holds the process group: release it first
        feed.close()
        dist.close()


def check_batch(spec: TorchTrainSpec, blob: bytes, batch: Dict[str, np.ndarray]) -> None:
    """Driver-side preflight (see :mod:`.preflight`): what one validation step of training
    runs (``transformation_fn``, the batch's tensors, the forward pass, the loss and the
    metrics) on ``batch``, on the CPU without gradients, with a copy of the model unpickled
    from the training payload ``blob``: nothing of the user's objects changes.

    Raises what training would raise; ``PreflightError`` is built from it by the caller.
    """
    device = torch.device("cpu")
    model, optimizer, loss, metrics, _, transform, *more = cloudpickle.loads(blob)
    extras: Dict[str, Any] = more[0] if more else {}
    if extras.get("loss_constructors") is not None:
        from sparktrain.estimators.torch import build_losses

        with user_code("loss_constructors"):
            loss = build_losses(extras["loss_constructors"], len(spec.label_cols), model=model,
                                optimizer=optimizer, device=device, rank=0, world_size=1)
    compute_loss = _LossComputer(loss, len(spec.label_cols), bool(spec.sample_weight_col),
                                 spec.loss_weights)
    batches = BatchFeed(transform, model_columns(spec))([batch])
    _run_epoch(model, batches, 1, _Batches(spec, device), compute_loss, named_metrics(metrics),
               spec.label_cols, autocast=_autocast_dtype(spec) if spec.mixed_precision == "bf16"
               else None)
