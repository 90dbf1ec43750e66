"""``TorchEstimator`` and ``TorchModel``: PyTorch training on Spark DataFrames.

Importing this module does not import torch; fitting, predicting and loading do.

Example::

    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters()),
                         loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=64, epochs=5)
    model = est.fit(train_df)                 # DDP training in 2 Spark barrier tasks
    model.transform(test_df)                  # adds "label__output" (array of 10 logits)
    model.write().overwrite().save("/models/digits")

Horovod's ``horovod.spark.torch`` API works unchanged (``import sparktrain.estimators.torch as
hvd``): ``hvd.TorchEstimator(..., input_shapes=[[-1, 1, 8, 8]], loss=lambda out, y: ...)``,
``hvd.TorchModel``; see docs/horovod-migration.md.
"""
from __future__ import annotations

import copy
import functools
import io
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import cloudpickle
from pyspark import keyword_only

from sparktrain import compat
from sparktrain.checkpoint import Checkpoints
from sparktrain.data.materialize import MaterializedDataset
from sparktrain.estimators.base import EstimatorBase, FitRun, ModelBase
from sparktrain.estimators.keywords import EstimatorKeywords, keyword_params
from sparktrain.estimators.torch_forward import takes_labels
from sparktrain.estimators.torch_schedule import check_scheduler
from sparktrain.fine_tuning_params import ForwardParams, SchedulerParams
from sparktrain.launch import TORCH_BACKENDS, load_backend
from sparktrain.launch.barrier import RankContext, run_barrier
from sparktrain.launch.environment import rank_environment
from sparktrain.params import EstimatorParams, TorchParams, with_accessors
# build_losses: importable from here as before (rank code imports it from torch_losses)
from sparktrain.estimators.torch_losses import build_losses, named_metrics  # noqa: F401
from sparktrain.pickling import dumps

if TYPE_CHECKING:  # PEP 692: typing.Unpack from Python 3.11, typing_extensions before
    from typing_extensions import Unpack


def flat_metrics(metrics: Any) -> Any:
    """sparktrain's metric list from Horovod's metric groups too: ``[[fn]]`` (one function
    applied to every output, Horovod's usual form) becomes ``[fn]``."""
    if not isinstance(metrics, (list, tuple)):
        return metrics
    flat = []
    for item in metrics:
        if isinstance(item, list):
            if len(item) != 1:
                raise ValueError(f"metrics: the group {item!r} has {len(item)} functions (one "
                                 f"per output, in Horovod); sparktrain applies every metric to "
                                 f"every output: pass [fn] or (name, fn) items")
            item = item[0]
        flat.append(item)
    return flat


class TorchKeywords(EstimatorKeywords, total=False):
    """``TorchEstimator``'s own constructor keywords (see its docstring)."""

    input_shapes: Optional[List[List[int]]]
    loss_constructors: Any
    train_minibatch_fn: Optional[Callable]
    fsdp_wrap: Any
    fsdp_cpu_offload: Optional[bool]
    activation_checkpointing: Any
    output_key: Optional[str]
    lr_scheduler: Optional[Callable[[Any], Any]]
    lr_scheduler_interval: Optional[str]


class TorchEstimator(EstimatorBase, TorchParams, ForwardParams, SchedulerParams):
    """Spark ML estimator training a ``torch.nn.Module`` in ``num_proc`` barrier tasks.

    Params follow Horovod's ``horovod.spark.torch.TorchEstimator``: ``batch_size`` is per
    process (the global batch is ``num_proc * batch_size``); the learning rate is used as given
    (Horovod multiplies it by ``num_proc``: ``scale_learning_rate=True``). ``model`` is called
    as ``model(*features)`` with one tensor per feature column, or by keyword when the feature
    columns are named like ``forward``'s parameters; with ``loss=None`` a model whose
    ``forward`` takes ``labels`` computes its own loss, and ``output_key`` picks the output of a
    dict or ``ModelOutput`` result (Hugging Face models as they are: docs/huggingface.md);
    ``lr_scheduler`` builds a learning-rate schedule on every rank; ``metrics`` are functions
    ``(output, label) -> tensor``; ``callbacks`` are objects with ``on_epoch_end(epoch, logs)
    -> bool | None`` (``True`` stops training).
    ``backend`` is ``"torch"`` (``torch.distributed`` DDP: gloo on CPU, NCCL on GPU) or
    ``"horovod"`` (Horovod over Gloo, ``hvd.DistributedOptimizer``; see
    :mod:`sparktrain.launch.horovod_torch`). ``strategy="fsdp"`` (``backend="torch"``) shards
    parameters, gradients and optimizer state across ranks with FSDP2 (``fsdp_wrap``,
    ``fsdp_cpu_offload``; see :mod:`sparktrain.strategies.torch_fsdp`);
    ``activation_checkpointing`` recomputes blocks' activations in backward, with either
    strategy.

    Horovod's params (all of ``horovod.spark.torch.TorchEstimator``'s are taken):

    * ``input_shapes``: each feature tensor is reshaped to its shape (``-1`` for the batch),
      in training and in ``TorchModel.transform``; ``label_shapes`` likewise for labels (then
      labels are no longer reshaped to the output's shape).
    * ``loss_weights``: the total loss is ``sum(w_i * loss_i)`` over label columns.
    * ``loss_constructors``: functions called on every rank to build the loss(es) instead of
      pickling ``loss`` (one, or one per label column; give ``loss`` or these, not both).
    * ``train_minibatch_fn``: ``fn(model, optimizer, transform_outputs, loss_fn, inputs,
      labels, sample_weights, backward_passes_per_step, batch_idx) -> (outputs, loss)``,
      Horovod's contract: it runs the forward pass, ``transform_outputs(outputs, labels) ->
      (outputs, labels)``, ``loss_fn(outputs, labels, sample_weights)`` and ``backward``, and
      calls ``optimizer.zero_grad()`` (and, after the first group, ``optimizer.step()``) when
      ``batch_idx % backward_passes_per_step == 0``; sparktrain calls ``optimizer.step()`` once
      more after each epoch's last batch, as Horovod does. The function owns gradient
      accumulation, so DDP all-reduces on every backward pass (the built-in step skips the
      all-reduce on all but the last pass of a group). With ``mixed_precision='bf16'`` the
      call runs inside ``torch.autocast``; ``'fp16'`` is refused (its ``GradScaler`` would have
      to scale your backward pass and step).
    * ``gradient_compression``: ``horovod.torch.Compression.fp16`` (or ``'fp16'``):
      ``hvd.DistributedOptimizer(compression=...)`` on ``backend="horovod"``, DDP's
      ``fp16_compress_hook`` on ``backend="torch"``.
    * ``backend_env``: environment variables set in every rank's process while it trains.
    * Petastorm's reader params: see :mod:`sparktrain.compat` (mapped, or one warning).
    * ``backend`` is the engine's name; a Horovod ``Backend`` object is refused (use
      ``num_proc``).
    """

    backends = TORCH_BACKENDS
    framework = "torch"

    @keyword_params(TorchKeywords)
    def __init__(self, **params: Unpack[TorchKeywords]) -> None:
        super().__init__()
        self._setDefault(backend="torch", loss=None)  # None: loss_constructors may build it
        kwargs = self._input_kwargs
        if kwargs.get("loss") is not None and kwargs.get("loss_constructors") is not None:
            raise ValueError("give loss or loss_constructors, not both (as in Horovod)")
        self._set(**{k: v for k, v in kwargs.items() if v is not None})

    @keyword_only
    def setParams(self, **kwargs: Any) -> "TorchEstimator":
        """Set any of the constructor's params by keyword."""
        return self._set(**self._input_kwargs)

    def _check_framework(self) -> None:
        import torch

        model, optimizer = self.getModel(), self.getOptimizer()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer bound to "
                            f"model.parameters(), got {type(optimizer).__name__}")
        own = {id(p) for p in model.parameters()}
        bound = [p for group in optimizer.param_groups for p in group["params"]]
        if not bound or any(id(p) not in own for p in bound):
            raise ValueError("optimizer is not bound to this model's parameters; create it as "
                             "torch.optim.X(model.parameters(), ...) for the same model object")
        constructors = self.getLossConstructors()
        if constructors is not None and self.getLoss() is not None:
            raise ValueError("give loss or loss_constructors, not both (as in Horovod)")
        name, value = ("loss_constructors", constructors) if constructors is not None \
            else ("loss", self.getLoss())
        losses = [] if value is None else list(value) if isinstance(value, (list, tuple)) \
            else [value]  # None: the model's own loss (checked below)
        for fn in losses:
            if not callable(fn):
                expected = "torch.nn.MSELoss()" if name == "loss" else \
                    "lambda **kwargs: torch.nn.MSELoss()"
                raise TypeError(f"{name} must be callable (e.g. {expected}), got {fn!r}")
        if losses and len(losses) not in (1, len(self.getLabelCols())):
            raise ValueError(f"{name} has {len(losses)} functions for "
                             f"{len(self.getLabelCols())} label columns; pass one, or one per "
                             f"label column")
        compat.check_shapes("input_shapes", self.getInputShapes(), self.getFeatureCols(),
                            "feature")
        compat.check_common(self)
        minibatch = self.getTrainMinibatchFn()
        if minibatch is not None and not callable(minibatch):
            raise TypeError(f"train_minibatch_fn must be a function (model, optimizer, "
                            f"transform_outputs, loss_fn, inputs, labels, sample_weights, "
                            f"backward_passes_per_step, batch_idx) -> (outputs, loss), got "
                            f"{type(minibatch).__name__}")
        check_scheduler(self.getLrScheduler(), minibatch is not None)
        self._check_model_loss(model)
        if minibatch is not None and self.getMixedPrecision() == "fp16":
            raise ValueError("mixed_precision='fp16' cannot be combined with train_minibatch_fn: "
                             "the function runs backward and the optimizer step itself, so "
                             "sparktrain's GradScaler cannot scale them; use 'bf16'")
        for name, fn in named_metrics(flat_metrics(self.getMetrics())):
            if not callable(fn):
                raise TypeError(f"metric {name!r} is not callable; metrics are functions "
                                f"(output, label) -> tensor")
        for callback in self.getCallbacks() or []:
            if not any(hasattr(callback, hook) for hook in
                       ("on_train_begin", "on_epoch_end", "on_train_end")):
                raise TypeError(f"callback {callback!r} has none of on_train_begin, "
                                f"on_epoch_end, on_train_end (see sparktrain.callbacks)")
        engine = load_backend(TORCH_BACKENDS, self.getBackend())  # its framework imports
        if self.getMixedPrecision() == "fp16" and not engine.fp16_loss_scaling:
            raise ValueError(f"mixed_precision='fp16' is not supported with "
                             f"backend={self.getBackend()!r} (its gradient all-reduce would "
                             f"need unscaling first); use 'bf16'")
        self._check_strategy(model)

    def _strategy_options(self) -> Tuple[type, Dict[str, Any]]:
        """The registered class of ``strategy`` and the values of the params only some
        strategy takes (``fsdp_wrap``...); a param set for another strategy is an error."""
        from sparktrain.strategies import TORCH_STRATEGIES, load_strategy

        name = self.getStrategy()
        registered = {n: load_strategy(TORCH_STRATEGIES, n) for n in TORCH_STRATEGIES}
        declared = {p for cls in registered.values() for p in cls.params if self.hasParam(p)}
        options = {p: self.getOrDefault(p) for p in sorted(declared)
                   if self.getOrDefault(p) not in (None, False)}
        for param in options:
            if param not in registered[name].params:
                owners = [n for n, cls in registered.items() if param in cls.params]
                raise ValueError(f"{param} is for strategy={owners[0]!r}; strategy is {name!r}")
        return registered[name], options

    def _check_strategy(self, model: Any) -> None:
        """``strategy`` and its params fit the backend, the torch version and the model."""
        from sparktrain.strategies import torch_blocks

        strategy, options = self._strategy_options()
        strategy.check(self.getStrategy(), self.getBackend(), model, options)
        wrap, recompute = self.getFsdpWrap(), self.getActivationCheckpointing()
        if isinstance(recompute, list):
            missing = [c.__name__ for c in recompute
                       if not any(isinstance(m, c) for m in model.modules())]
            if missing:
                raise ValueError(f"activation_checkpointing: the model has no submodule of "
                                 f"class {', '.join(missing)}")
        if recompute is True and not torch_blocks.blocks(model, wrap):
            size = wrap if isinstance(wrap, int) else torch_blocks.DEFAULT_MIN_PARAMS
            raise ValueError(f"activation_checkpointing=True recomputes the blocks fsdp_wrap "
                             f"picks, and this model has none (no submodule with >= {size:,} "
                             f"parameters); pass the classes to recompute, e.g. "
                             f"activation_checkpointing=[torch.nn.Linear]")

    def _built_elsewhere(self, name: str) -> bool:
        """The loss may come from ``loss_constructors``, or from the model itself (a
        ``forward`` taking ``labels``, see :mod:`.torch_forward`)."""
        return name == "loss" and (self.getLossConstructors() is not None or
                                   takes_labels(self.getModel()))

    def _check_model_loss(self, model: Any) -> None:
        """``loss=None`` (the model's own loss) fits the label and weight params."""
        if self.getLoss() is not None or self.getLossConstructors() is not None:
            return
        labels = self.getLabelCols()
        if len(labels) != 1:
            raise ValueError(f"loss=None passes the label as labels= to the model, so it needs "
                             f"one label column; label_cols is {labels}: pass loss=...")
        if self.getSampleWeightCol():
            raise ValueError("sample_weight_col needs a loss computed per row; the model's own "
                             "loss (loss=None) is already averaged: pass loss=...")

    def get_model_class(self) -> type:
        """The class of the model ``fit`` returns (Horovod's ``get_model_class``)."""
        return TorchModel

    def _payload(self) -> bytes:
        metrics = flat_metrics(self.getMetrics())
        # The 7th item holds the objects Horovod's params add (read with .get on the worker).
        strategy, options = self._strategy_options()
        extras = {"loss_constructors": self.getLossConstructors(),
                  "train_minibatch_fn": self.getTrainMinibatchFn(),
                  "fsdp_wrap": self.getFsdpWrap(),
                  "activation_checkpointing": self.getActivationCheckpointing(),
                  "strategy": strategy, "strategy_options": options,
                  "lr_scheduler": self.getLrScheduler()}
        try:
            return dumps((self.getModel(), self.getOptimizer(), self.getLoss(),
                          metrics, self.getCallbacks(), self.getTransformationFn(), extras))
        except Exception as exc:
            raise TypeError(f"model, optimizer, loss, loss_constructors, metrics, callbacks, "
                            f"transformation_fn and train_minibatch_fn must be picklable with "
                            f"cloudpickle to reach the executors: {exc}") from exc

    def _train_spec(self, run: Optional[FitRun] = None) -> Any:
        """The plain-valued ``TorchTrainSpec`` every rank trains by; without ``run``, the
        preflight's (no dataset, the CPU)."""
        from sparktrain.estimators.torch_worker import TorchTrainSpec

        return TorchTrainSpec(
            **self._spec_fields(run), strategy=self.getStrategy(),
            input_shapes=self.getInputShapes(), use_gpu=run is not None and run.use_gpu,
            gradient_compression=compat.compression_name(self.getGradientCompression()),
            output_key=self.getOutputKey(), lr_scheduler_interval=self.getLrSchedulerInterval())

    def _check_on_batch(self, batch: Dict[str, Any]) -> None:
        """Preflight (see :mod:`.preflight`): one validation step on ``batch`` on the CPU."""
        import torch

        from sparktrain.estimators import preflight
        from sparktrain.estimators.torch_worker import _Batches, check_batch

        spec = self._train_spec()
        try:
            check_batch(spec, self._payload(), batch)
        except Exception as exc:
            try:
                transform = preflight.detached(self.getTransformationFn())
                shaped = transform(dict(batch)) if transform is not None else batch
                tensors = preflight.tensor_shapes(_Batches(spec, torch.device("cpu"))(shaped)[0])
            except Exception:  # noqa: BLE001 - the description is a courtesy
                tensors = ""
            raise preflight.failure(
                exc, "the model's forward pass (eval mode, no gradients), the loss and the "
                "metrics", preflight.describe_columns(batch, spec.feature_cols, spec.label_cols),
                tensors, preflight.torch_expectation(self.getModel())) from exc

    def _train(self, run: FitRun) -> Dict[str, Any]:
        compat.check_data_shapes(self, run.data.columns, self.getInputShapes())
        compat.warn_ignored(self)  # once per fit: Horovod params without an equivalent
        if self.getFsdpCpuOffload() and not run.use_gpu:
            warnings.warn("fsdp_cpu_offload=True is ignored: the ranks train on CPUs, where "
                          "parameter shards already live in CPU memory", UserWarning,
                          stacklevel=3)
        spec = self._train_spec(run)
        with run.shipped(self._payload()) as (payload, where):
            results = run_barrier(run.spark, self.getNumProc(),
                                  functools.partial(_train_rank, spec, payload),
                                  description=f"sparktrain TorchEstimator {self.uid}",
                                  echo_logs=self.getVerbose() >= 1,
                                  on_progress=run.progress.update,
                                  max_attempts=self.getMaxAttempts(), **where)
        result = dict(results[0])
        result["optimizer_state"] = _last_optimizer_state(run)
        return result

    def _create_model(self, result: Dict[str, Any], data: MaterializedDataset) -> "TorchModel":
        import torch

        # copied together, the optimizer stays bound to the copied module's parameters
        module, optimizer = copy.deepcopy((self.getModel(), self.getOptimizer()))
        module.load_state_dict(torch.load(io.BytesIO(result["weights"]), weights_only=True))
        module.eval()
        if result.get("optimizer_state") is not None:
            try:
                optimizer.load_state_dict(result["optimizer_state"])
            except (ValueError, KeyError, RuntimeError):
                pass  # getOptimizer() then has the state the fit started from
        model = TorchModel(module, optimizer=optimizer, loss=self.getLoss(),
                           loss_constructors=self.getLossConstructors(),
                           input_shapes=self.getInputShapes(), output_key=self.getOutputKey())
        model._history = result["history"]
        model._columns = self._prediction_columns(data)
        model._output_shapes = result["output_shapes"]
        return model


def _last_optimizer_state(run: FitRun) -> Any:
    """The optimizer's state_dict in the run's last checkpoint (rank 0 writes one after every
    epoch), for ``TorchModel.getOptimizer()``; ``None`` if there is none."""
    import torch

    try:
        checkpoints = Checkpoints(run.run_path, run.store.storage_options)
        latest = checkpoints.latest()
        if latest is None:
            return None
        state = torch.load(io.BytesIO(checkpoints.read(latest)), map_location="cpu",
                           weights_only=True)
        return state.get("optimizer")
    except Exception:  # noqa: BLE001 - the model is complete without it
        return None


def _train_rank(spec: Any, payload: Any, ctx: RankContext) -> Any:
    from sparktrain.estimators.torch_worker import train

    with rank_environment(getattr(spec, "backend_env", None)):
        return train(spec, payload, ctx)


# -- architecture without weights --------------------------------------------------------------
def _architecture_bytes(module: Any) -> bytes:
    """cloudpickle of ``module`` with every state_dict tensor moved to the ``meta`` device:
    the architecture without a copy of the weights (non-persistent buffers stay real)."""
    import torch

    skeleton = copy.deepcopy(module)
    for sub in skeleton.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(param.detach().to("meta"),
                                                           requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                sub._buffers[name] = buffer.to("meta")
    return dumps(skeleton)


def _load_module(architecture: bytes, weights: bytes) -> Any:
    """Rebuild a module from :func:`_architecture_bytes` and ``torch.save(state_dict)`` bytes
    (read with ``weights_only=True``: the weights file cannot run code)."""
    import torch

    module = cloudpickle.loads(architecture)
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                sub._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                           requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device="cpu")
    module.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    return module.eval()


def _weights_bytes(module: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buffer)
    return buffer.getvalue()


@with_accessors
class TorchModel(ModelBase, ForwardParams):
    """A trained torch module as a Spark ML Model.

    ``transform`` appends one column per label (``<label>__output`` unless ``setOutputCols``):
    a double for single-value outputs, an array of doubles otherwise. Saved as Spark ML
    metadata (``input_shapes`` included) + ``architecture.pkl`` (cloudpickle: loading runs
    code, load only trusted models) + ``weights.pt`` (``torch.save`` of the state_dict, loaded
    with ``weights_only=True``).

    Horovod's constructor works too, e.g. to predict with a module trained elsewhere::

        TorchModel(model=net, feature_columns=["features"], label_columns=["label"],
                   input_shapes=[[-1, 1, 8, 8]]).setOutputCols(["label_prob"]).transform(df)

    ``getOptimizer()`` is the optimizer with its state after the last epoch (from the run's
    last checkpoint); ``optimizer``, ``loss`` and ``loss_constructors`` are not saved with the
    model. ``history``: a dict of per-epoch lists (or Horovod's list of per-epoch dicts).
    """

    input_shapes = TorchParams.input_shapes
    optimizer = EstimatorParams.optimizer
    loss = EstimatorParams.loss
    loss_constructors = TorchParams.loss_constructors

    def __init__(self, model: Any = None, *, history: Any = None,
                 feature_columns: Optional[List[str]] = None,
                 input_shapes: Optional[List[List[int]]] = None,
                 label_columns: Optional[List[str]] = None, optimizer: Any = None,
                 run_id: Optional[str] = None, _metadata: Any = None, loss: Any = None,
                 loss_constructors: Any = None,
                 predict_transformation_fn: Optional[Callable] = None,
                 output_key: Optional[str] = None) -> None:
        super().__init__()
        self._setDefault(input_shapes=None, optimizer=None, loss=None, loss_constructors=None)
        self._model = model
        self._metadata = _metadata  # Horovod's column metadata: kept, not used
        given = dict(feature_cols=feature_columns, label_cols=label_columns, run_id=run_id,
                     input_shapes=input_shapes, optimizer=optimizer, loss=loss,
                     loss_constructors=loss_constructors,
                     predict_transformation_fn=predict_transformation_fn, output_key=output_key)
        self._set(**{k: v for k, v in given.items() if v is not None})
        if history is not None:
            self.setHistory(history)

    def getModel(self) -> Any:
        """The trained ``torch.nn.Module`` (in eval mode, on the CPU)."""
        return self._model

    def setModel(self, value: Any) -> "TorchModel":
        """Predict with another ``torch.nn.Module`` (same inputs and outputs)."""
        self._model = value
        return self


    def _framework_files(self) -> Dict[str, bytes]:
        return {"architecture.pkl": _architecture_bytes(self._model),
                "weights.pt": _weights_bytes(self._model)}

    @classmethod
    def _from_framework_files(cls, files: Dict[str, bytes]) -> "TorchModel":
        return cls(_load_module(files["architecture.pkl"], files["weights.pt"]))

    def _predict_fn_factory(self) -> Callable[[], Callable]:
        return functools.partial(_make_predictor, self._framework_files(),
                                 self.getInputShapes(), self.getUseGpu(),
                                 list(self.getFeatureCols()), self.getOutputKey())


def predict_device(address: Optional[str]) -> Any:
    """The ``torch.device`` to predict on for the task's GPU ``address`` (``None``: CPU); a
    ``RuntimeError`` when torch cannot use that GPU (as training's ``select_device``)."""
    import torch

    from sparktrain.launch.gpus import cuda_ordinal

    if address is None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Spark assigned GPU {address} to this prediction task, but torch "
                           f"{torch.__version__} cannot use CUDA here; install a CUDA build of "
                           f"torch on the executors, or call setUseGpu(False) on the model to "
                           f"predict on the CPU")
    # by ordinal, not CUDA_VISIBLE_DEVICES: CUDA may already be initialised in this reused worker
    return torch.device("cuda", cuda_ordinal(address, torch.cuda.device_count(), "torch"))


def _make_predictor(files: Dict[str, bytes],
                    input_shapes: Optional[List[List[int]]] = None,
                    use_gpu: Optional[bool] = None, feature_names: Optional[List[str]] = None,
                    output_key: Optional[str] = None) -> Callable:
    """Executor side, once per Python worker: load the module and return ``predict``
    (features reshaped to ``input_shapes`` when given, as in training; the model called and its
    output picked by :class:`~.torch_forward.ForwardRule`) on the GPU Spark gave the task (see
    ``use_gpu``), chosen per call: a reused worker's later task may hold another."""
    import contextlib

    import numpy as np
    import torch
    from pyspark import TaskContext

    from sparktrain.estimators.torch_forward import ForwardRule
    from sparktrain.launch.gpus import task_gpu

    module = _load_module(files["architecture.pkl"], files["weights.pt"])
    forward = ForwardRule.for_model(module, feature_names or [], output_key=output_key)
    placed = {torch.device("cpu"): module}  # the module on each device used so far
    context = TaskContext.get()
    if context is not None:
        torch.set_num_threads(max(1, context.cpus()))

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        device = predict_device(task_gpu(use_gpu))
        if device not in placed:
            placed[device] = copy.deepcopy(module).to(device)
        tensors = [torch.from_numpy(f).to(device) for f in features]
        if input_shapes:
            tensors = [t.reshape(shape) for t, shape in zip(tensors, input_shapes)]
        # the current CUDA device too, for modules that make tensors on "cuda" themselves
        current = torch.cuda.device(device) if device.type == "cuda" \
            else contextlib.nullcontext()
        with torch.inference_mode(), current:
            result = forward.call(placed[device], tensors)
        return [o.detach().cpu().float().numpy() for o in forward.outputs(result)]

    return predict
