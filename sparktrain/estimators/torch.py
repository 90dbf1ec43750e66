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

import functools
import io
import logging
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Type, cast

from pyspark import keyword_only

from sparktrain.data.sources.contract import RowSource
from sparktrain.estimators.base import EstimatorBase
from sparktrain.estimators.fit_run import FitRun
from sparktrain.estimators.torch_model import TorchModel
from sparktrain.launch import TORCH_BACKENDS, load_backend
from sparktrain.launch.environment import rank_environment
from sparktrain.launch.rank_context import RankContext
from sparktrain.loop.checkpoint import Checkpoints
from sparktrain.loop.torch_forward import takes_labels
from sparktrain.loop.torch_losses import named_metrics
from sparktrain.loop.torch_schedule import check_scheduler
from sparktrain.model_files import ModelFile
from sparktrain.options import horovod as horovod_params
from sparktrain.options.declarations import COMMON, TORCH
from sparktrain.options.keywords import keyword_params
from sparktrain.options.params import TorchParams
from sparktrain.options.payload import TorchPayload

if TYPE_CHECKING:
    from sparktrain.launch.engine import TorchEngine
    from sparktrain.strategies.torch_strategy import TorchStrategy

#: Horovod's ``horovod.spark.torch`` names (``import sparktrain.estimators.torch as hvd``)
__all__ = ["TorchEstimator", "TorchModel"]

log = logging.getLogger("sparktrain")


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


class TorchEstimator(EstimatorBase, TorchParams):
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
    * Petastorm's reader params: see :mod:`sparktrain.options.horovod` (mapped, or one warning).
    * ``backend`` is the engine's name; a Horovod ``Backend`` object is refused (use
      ``num_proc``).
    """

    backends = TORCH_BACKENDS
    framework = "torch"
    fed_streams = True  # the torch rank loop reads its rows in the barrier task itself
    ranks_per_gpu = True  # a task with N GPUs runs N ranks (launch.local_ranks)
    options = COMMON + TORCH

    @keyword_params(options)
    def __init__(self, **params: Any) -> None:
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

    def _module_for_checks(self) -> Any:
        """The module to check on the driver: the ``model`` param, or what a model callable
        builds on the ``meta`` device (no weights in memory; ``None`` where it cannot build
        there, e.g. ``from_pretrained``); built once per callable."""
        from sparktrain.loop.torch_files import build_on_meta, is_builder

        model = self.getModel()
        if not is_builder(model):
            return model
        cached = getattr(self, "_meta_module", None)
        if cached is None or cached[0] is not model:
            self._meta_module = cached = (model, build_on_meta(model))
        return cached[1]

    def _check_framework(self) -> None:
        import torch

        from sparktrain.loop.torch_files import check_builder, is_builder

        given, optimizer = self.getModel(), self.getOptimizer()
        if not isinstance(given, torch.nn.Module) and not callable(given):
            raise TypeError(f"model must be a torch.nn.Module or a zero-argument callable "
                            f"building one, got {type(given).__name__}")
        if is_builder(given):
            check_builder(given)
        model = self._module_for_checks()
        if is_builder(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            pass  # params -> Optimizer, called on each rank with the trainable parameters
        elif is_builder(given):
            raise TypeError("with a model callable, optimizer must be a callable params -> "
                            "Optimizer (e.g. lambda params: torch.optim.AdamW(params, "
                            f"lr=1e-4)): the ranks build the parameters; got "
                            f"{type(optimizer).__name__}")
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer bound to "
                            f"model.parameters() (or a callable params -> Optimizer), got "
                            f"{type(optimizer).__name__}")
        else:
            own = {id(p) for p in given.parameters()}
            bound = [p for group in optimizer.param_groups for p in group["params"]]
            if not bound or any(id(p) not in own for p in bound):
                raise ValueError("optimizer is not bound to this model's parameters; create "
                                 "it as torch.optim.X(model.parameters(), ...) for the same "
                                 "model object")
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
        horovod_params.check_shapes("input_shapes", self.getInputShapes(), self.getFeatureCols(),
                            "feature")
        horovod_params.check_common(self)
        minibatch = self.getTrainMinibatchFn()
        check_scheduler(self.getLrScheduler(), minibatch is not None)
        if model is not None:
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
                                f"on_epoch_end, on_train_end (see sparktrain.loop.callbacks)")
        engine = self._engine()  # its framework imports
        if self.getMixedPrecision() == "fp16" and not engine.fp16_loss_scaling:
            raise ValueError(f"mixed_precision='fp16' is not supported with "
                             f"backend={self.getBackend()!r} (its gradient all-reduce would "
                             f"need unscaling first); use 'bf16'")
        if model is not None:
            self._check_strategy(model)

    def _executor_modules(self) -> List[str]:
        # both engines find the network interface of rank 0's address with psutil
        return super()._executor_modules() + ["psutil"]

    def _engine(self) -> Type[TorchEngine]:
        """The class of the engine registered as ``backend`` (a
        :class:`~sparktrain.launch.engine.TorchEngine`)."""
        return load_backend(TORCH_BACKENDS, self.getBackend())

    def _strategy_options(self) -> Tuple[Type[TorchStrategy], Dict[str, Any]]:
        """The registered class of ``strategy`` and the values of the params only some
        strategy takes (``fsdp_wrap``...); a param set for another strategy is an error."""
        from sparktrain.strategies import TORCH_STRATEGIES, load_strategy

        name = self.getStrategy()
        # registered strategies subclass TorchStrategy (register_torch_strategy)
        registered = {n: cast("Type[TorchStrategy]", load_strategy(TORCH_STRATEGIES, n))
                      for n in TORCH_STRATEGIES}
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
        ``forward`` taking ``labels``, see :mod:`sparktrain.loop.torch_forward`)."""
        module = self._module_for_checks()
        return name == "loss" and (self.getLossConstructors() is not None or module is None
                                   or takes_labels(module))

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

    def _payload(self, weights: Optional[ModelFile] = None) -> bytes:
        """The pickled objects a rank trains with; the model's weights are not in it, but in
        the file ``weights`` (see :class:`~sparktrain.loop.torch_files.ShippedModule`)."""
        from sparktrain.loop.torch_files import BuiltModule, ShippedModule, is_builder

        strategy, options = self._strategy_options()
        try:
            model, optimizer = self.getModel(), self.getOptimizer()
            shipped = BuiltModule(model, optimizer) if is_builder(model) else \
                ShippedModule.of(model, optimizer, weights)
            return TorchPayload(
                model=shipped, loss=self.getLoss(), metrics=flat_metrics(self.getMetrics()),
                callbacks=list(self.getCallbacks() or []),
                transformation_fn=self.getTransformationFn(),
                loss_constructors=self.getLossConstructors(),
                train_minibatch_fn=self.getTrainMinibatchFn(), strategy=strategy,
                strategy_options=options, engine=self._engine(), fsdp_wrap=self.getFsdpWrap(),
                activation_checkpointing=self.getActivationCheckpointing(),
                lr_scheduler=self.getLrScheduler()).dumps()
        except Exception as exc:
            raise TypeError(f"model, optimizer, loss, loss_constructors, metrics, callbacks, "
                            f"transformation_fn and train_minibatch_fn must be picklable with "
                            f"cloudpickle to reach the executors: {exc}") from exc

    def _train_spec(self, run: Optional[FitRun] = None) -> Any:
        """The plain-valued ``TorchTrainSpec`` every rank trains by; without ``run``, the
        preflight's (no dataset, the CPU)."""
        from sparktrain.options.spec import TorchTrainSpec

        return TorchTrainSpec(
            **self._spec_fields(run), input_shapes=self.getInputShapes(),
            use_gpu=run is not None and run.use_gpu,
            gradient_compression=horovod_params.compression_name(self.getGradientCompression()))

    def _check_on_batch(self, batch: Dict[str, Any]) -> None:
        """Preflight (see :mod:`.preflight`): one validation step on ``batch`` on the CPU."""
        import torch

        from sparktrain.estimators import preflight
        from sparktrain.loop.torch_batch import Batches
        from sparktrain.loop.torch_files import is_builder
        from sparktrain.loop.torch_loop import check_batch

        spec = self._train_spec()
        model = self._module_for_checks()
        if model is None:
            log.warning("the model callable %r cannot build on the meta device, so its "
                        "forward pass is first checked on the ranks", self.getModel())
            return
        try:
            # a model callable's module is on the meta device: shapes only, no weights
            check_batch(spec, self._payload(), batch,
                        "meta" if is_builder(self.getModel()) else model.state_dict())
        except Exception as exc:
            if is_builder(self.getModel()) and "meta" in str(exc).lower():
                log.warning("the model callable's forward pass cannot run on the meta device "
                            "(%s); the ranks run it first", exc)
                return
            try:
                transform = preflight.detached(self.getTransformationFn())
                shaped = transform(dict(batch)) if transform is not None else batch
                tensors = preflight.tensor_shapes(Batches(spec, torch.device("cpu"))(shaped)[0])
            except Exception:  # noqa: BLE001 - the description is a courtesy
                tensors = ""
            raise preflight.failure(
                exc, "the model's forward pass (eval mode, no gradients), the loss and the "
                "metrics", preflight.describe_columns(batch, spec.feature_cols, spec.label_cols),
                tensors, preflight.torch_expectation(model)) from exc

    def _train(self, run: FitRun) -> Dict[str, Any]:
        horovod_params.check_data_shapes(self, run.data.columns, self.getInputShapes())
        horovod_params.warn_ignored(self)  # once per fit: Horovod params without an equivalent
        if self.getFsdpCpuOffload() and not run.use_gpu:
            warnings.warn("fsdp_cpu_offload=True is ignored: the ranks train on CPUs, where "
                          "parameter shards already live in CPU memory", UserWarning,
                          stacklevel=3)
        from sparktrain.loop.torch_files import is_builder, save_weights

        spec = self._train_spec(run)
        # the weights go to the store once, as a file the ranks map; the payload is KiB (a
        # model callable has no weights on the driver: the ranks build it)
        weights = None if is_builder(self.getModel()) else save_weights(
            self.getModel().state_dict(),
            f"{run.run_path}/_launch/weights-{uuid.uuid4().hex[:8]}.pt", run.store.storage_options)
        try:
            with run.shipped(self._payload(weights)) as (payload, where):
                results = run.launch(functools.partial(_train_rank, spec, payload),
                                     description=f"sparktrain TorchEstimator {self.uid}",
                                     echo_logs=self.getVerbose() >= 1,
                                     max_attempts=self.getMaxAttempts(), **where)
        finally:
            if weights is not None:
                weights.delete()
        result = dict(results[0])
        result["run"] = (run.run_path, run.store.storage_options)
        return result

    def _create_model(self, result: Dict[str, Any], data: RowSource) -> "TorchModel":
        from sparktrain.loop.torch_files import ModuleFiles, dumps_without_weights

        # The trained weights stay in the store (rank 0 wrote them): the model maps them when
        # first used, its optimizer bound to the module it maps (state from the last checkpoint).
        module, optimizer = self.getModel(), self.getOptimizer()
        run_path, options = result["run"]
        model = TorchModel(None, loss=self.getLoss(),
                           loss_constructors=self.getLossConstructors(),
                           input_shapes=self.getInputShapes(), output_key=self.getOutputKey())
        if "architecture" in result:  # a model callable: rank 0 pickled what it built
            model._files = ModuleFiles(result["architecture"], result["weights_file"])
        else:
            model._files = ModuleFiles(
                dumps_without_weights(module, module), result["weights_file"],
                trainer=dumps_without_weights((module, optimizer), module),
                optimizer_state=functools.partial(_last_optimizer_state, run_path, options))
        model._spill_to = (f"{run_path}/model", options)
        model._history = result["history"]
        model._columns = self._prediction_columns(data)
        model._output_shapes = result["output_shapes"]
        return model


def _last_optimizer_state(run_path: str, storage_options: Dict[str, Any]) -> Any:
    """The optimizer's state_dict in the run's last checkpoint (rank 0 writes one after every
    epoch), for ``TorchModel.getOptimizer()``; ``None`` if there is none."""
    import torch

    try:
        latest, data = Checkpoints(run_path, storage_options).latest_intact()
        if latest is None or data is None:  # both or neither
            return None
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return state.get("optimizer")
    except Exception:  # noqa: BLE001 - the model is complete without it
        return None


def _train_rank(spec: Any, payload: Any, ctx: RankContext) -> Any:
    from sparktrain.loop.torch_loop import train

    with rank_environment(getattr(spec, "backend_env", None)):
        return train(spec, payload, ctx)
