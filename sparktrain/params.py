"""Spark ML Params shared by every sparktrain estimator and model.

Names and meanings follow Horovod's Spark estimators (``horovod.spark.common.params``) where the
concept is the same, so ``TorchEstimator(num_proc=2, feature_cols=[...], ...)`` reads the same.
Every param of Horovod 0.28.1's ``TorchEstimator``/``KerasEstimator``/``TorchModel``/
``KerasModel`` is declared here, with Horovod's ``getX``/``setX`` accessors (generated from the
Param declarations by :func:`with_accessors`, Horovod's own spellings included, e.g.
``getShufflingBufferSize``, ``setTrainReaderNumWorker``). What the Petastorm-specific ones do
here: :mod:`sparktrain.compat`.

Example::

    est = TorchEstimator(num_proc=2, input_shapes=[[-1, 1, 8, 8]], ...)
    est.setEpochs(5).getInputShapes()     # [[-1, 1, 8, 8]]
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Type

from pyspark.ml.param import Param, Params, TypeConverters

# Params whose values are Python objects (modules, optimizers, callables): they are pickled with
# cloudpickle on save, never written into the JSON metadata.
OBJECT_PARAMS = ("model", "optimizer", "loss", "metrics", "callbacks", "store", "custom_objects",
                 "transformation_fn", "predict_transformation_fn", "loss_constructors",
                 "train_minibatch_fn",
                 "gradient_compression", "checkpoint_callback", "data_module",
                 "transformation_edit_fields", "transformation_removed_fields",
                 "resource_profile", "fsdp_wrap", "activation_checkpointing")

MIXED_PRECISION = ("bf16", "fp16")


def _to_strategy(value: Any) -> str:
    """A registered torch strategy (see :mod:`sparktrain.strategies`)."""
    from sparktrain.strategies import KERAS_STRATEGIES, TORCH_STRATEGIES

    value = TypeConverters.toString(value)
    if value not in TORCH_STRATEGIES:
        hint = f" ({value!r} is a KerasEstimator strategy; TorchEstimator replicates the " \
               f"model with 'ddp' or shards parameters and optimizer state across ranks " \
               f"with 'fsdp')" if value in KERAS_STRATEGIES else ""
        raise ValueError(f"strategy must be one of {sorted(TORCH_STRATEGIES)}, found "
                         f"{value!r}{hint}; register your own with "
                         f"sparktrain.strategies.register_torch_strategy")
    return value


def _to_module_classes(name: str, allow: type) -> Callable[[Any], Any]:
    """Converter for params taking module classes (or one ``allow``-typed value instead)."""
    def convert(value: Any) -> Any:
        if value is None or (isinstance(value, allow)
                             and (allow is bool or not isinstance(value, bool))):
            if allow is int and value < 1:
                raise ValueError(f"{name}: a minimum parameter count must be >= 1, found "
                                 f"{value}")
            return value
        items = list(value) if isinstance(value, (list, tuple, set)) else [value]
        if not items or not all(isinstance(c, type) for c in items):
            kinds = "True, " if allow is bool else "a minimum parameter count, "
            raise TypeError(f"{name} takes {kinds}or a list of torch.nn.Module subclasses "
                            f"(e.g. [TransformerBlock]); found {value!r}")
        return items
    return convert


def _to_validation(value: Any) -> Any:
    """``validation`` is a fraction in [0, 1) or the name of a boolean column."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError("validation must be a fraction in [0, 1) or a boolean column name, not a bool")
    return TypeConverters.toFloat(value)


def _to_optional_bool(value: Any) -> Optional[bool]:
    return None if value is None else TypeConverters.toBoolean(value)


def _to_optional_int(value: Any) -> Optional[int]:
    return None if value is None else TypeConverters.toInt(value)


def _to_optional_float(value: Any) -> Optional[float]:
    return None if value is None else TypeConverters.toFloat(value)


def _to_resource_profile(value: Any) -> Any:
    from pyspark.resource import ResourceProfile

    if value is not None and not isinstance(value, ResourceProfile):
        raise TypeError(f"resource_profile must be a pyspark.resource.ResourceProfile (from "
                        f"ResourceProfileBuilder().require(...).build), found "
                        f"{type(value).__name__}")
    return value


def _to_mixed_precision(value: Any) -> Optional[str]:
    if value is None:
        return None
    if value not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={value!r}; expected None, 'bf16' or 'fp16'")
    return value


READER_POOL_TYPES = ("thread", "process", "dummy")
MP_START_METHODS = ("fork", "spawn", "forkserver")


def _to_backend_name(value: Any) -> str:
    """``backend`` names the engine; Horovod's ``Backend`` objects have no place here."""
    if isinstance(value, str):
        return value
    ranks = getattr(value, "num_processes", None)
    hint = ""
    if callable(ranks):
        try:
            hint = f" (num_proc={int(ranks())} for this one)"
        except Exception:  # noqa: BLE001 - only a hint
            hint = ""
    raise TypeError(f"backend={type(value).__name__} object; sparktrain's backend is the name "
                    f"of the distributed engine: 'torch' or 'horovod' for TorchEstimator, "
                    f"'tensorflow' or 'tfos' for KerasEstimator. Horovod's Backend objects are "
                    f"not used: ranks are Spark barrier tasks, set their number with "
                    f"num_proc=N{hint}")


def _to_shapes(name: str) -> Any:
    def convert(value: Any) -> List[List[int]]:
        example = "[[-1, 1, 8, 8]]" if name == "input_shapes" else "[[-1]]"
        expected = (f"{name} must be a list with one shape per column, each a list of ints "
                    f"(-1 for the batch dimension), e.g. {example}")
        if not isinstance(value, (list, tuple)) or not value:
            raise TypeError(f"{expected}; found {value!r}")
        if all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            raise TypeError(f"{expected}; found the single shape {list(value)!r}: wrap it as "
                            f"[{list(value)!r}]")
        shapes = []
        for shape in value:
            if not isinstance(shape, (list, tuple)) or not shape or \
                    not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise TypeError(f"{expected}; found {value!r}")
            if any(d == 0 or d < -1 for d in shape) or list(shape).count(-1) > 1:
                raise TypeError(f"{expected}; found {list(shape)!r} (dimensions are >= 1, and at "
                                f"most one is -1)")
            shapes.append([int(d) for d in shape])
        return shapes
    return convert


def _to_loss_weights(value: Any) -> List[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise TypeError(f"loss_weights must be a list with one number per label column, e.g. "
                        f"[1.0, 0.5]; found the single number {value!r}")
    try:
        weights = TypeConverters.toListFloat(value)
    except TypeError:
        raise TypeError(f"loss_weights must be a list with one number per label column, e.g. "
                        f"[1.0, 0.5]; found {value!r}") from None
    return weights


class EnvVars(dict):
    """``backend_env``'s value: a plain dict whose ``repr`` hides the values (they may be
    tokens), so that param dumps (``explainParams``, MLflow's ``pyspark.ml`` autologging, which
    logs ``str(value)`` of every param) never show them."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: '***'" for k in self) + "}"

    __str__ = __repr__


def _to_env(value: Any) -> Dict[str, str]:
    if not isinstance(value, dict):
        raise TypeError(f"backend_env must be a dict of environment variables (name -> value), "
                        f"found {type(value).__name__}")
    env = EnvVars()
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or \
                not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise TypeError(f"backend_env must map variable names (str, no '=') to str or "
                            f"number values; found {key!r}: {item!r}")
        env[key] = str(item)
    return env


def _to_choice(name: str, choices: Sequence[str]) -> Any:
    def convert(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{name}={value!r}; expected one of {list(choices)}")
        return value
    return convert


def _to_count(name: str) -> Any:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must be an integer >= 0, found {value!r}")
        return value
    return convert


class EstimatorParams(Params):
    """Params of a training estimator (the Horovod-compatible set plus ``backend``/``use_gpu``)."""

    num_proc = Param(Params._dummy(), "num_proc", "number of training processes (Spark barrier tasks)",
                     TypeConverters.toInt)
    model = Param(Params._dummy(), "model", "the model to train (framework object)")
    optimizer = Param(Params._dummy(), "optimizer", "optimizer bound to the model's parameters")
    loss = Param(Params._dummy(), "loss", "loss function or module")
    metrics = Param(Params._dummy(), "metrics", "metric functions (output, label) -> tensor")
    feature_cols = Param(Params._dummy(), "feature_cols", "feature column names",
                         TypeConverters.toListString)
    label_cols = Param(Params._dummy(), "label_cols", "label column names", TypeConverters.toListString)
    sample_weight_col = Param(Params._dummy(), "sample_weight_col", "column of per-row loss weights",
                              TypeConverters.toString)
    validation = Param(Params._dummy(), "validation",
                       "fraction of rows held out for validation, or a boolean column marking them",
                       _to_validation)
    batch_size = Param(Params._dummy(), "batch_size", "rows per batch on each process",
                       TypeConverters.toInt)
    val_batch_size = Param(Params._dummy(), "val_batch_size",
                           "rows per validation batch (default: batch_size)", TypeConverters.toInt)
    epochs = Param(Params._dummy(), "epochs", "number of passes over the training data",
                   TypeConverters.toInt)
    shuffle = Param(Params._dummy(), "shuffle", "shuffle training rows every epoch",
                    TypeConverters.toBoolean)
    random_seed = Param(Params._dummy(), "random_seed", "seed for shuffling, splits and the framework",
                        TypeConverters.toInt)
    store = Param(Params._dummy(), "store", "where datasets and runs live: a path/URL or a Store")
    run_id = Param(Params._dummy(), "run_id", "name of this training run in the store",
                   TypeConverters.toString)
    verbose = Param(Params._dummy(), "verbose", "0 quiet, 1 one line per epoch, 2 also per-rank detail",
                    TypeConverters.toInt)
    callbacks = Param(Params._dummy(), "callbacks", "objects called at the end of every epoch")
    backend = Param(Params._dummy(), "backend", "distributed engine (a name, e.g. 'torch')",
                    _to_backend_name)
    use_gpu = Param(Params._dummy(), "use_gpu",
                    "train on the GPU Spark assigned to each task (default: when tasks have GPUs)",
                    _to_optional_bool)
    train_steps_per_epoch = Param(Params._dummy(), "train_steps_per_epoch",
                                  "training batches per epoch and rank (default: one pass over "
                                  "the rank's rows)", _to_optional_int)
    validation_steps_per_epoch = Param(Params._dummy(), "validation_steps_per_epoch",
                                       "validation batches per epoch and rank (default: all)",
                                       _to_optional_int)
    transformation_fn = Param(Params._dummy(), "transformation_fn",
                              "function applied on the worker to every batch, a dict of numpy "
                              "arrays by column name, before training and validation steps")
    predict_transformation_fn = Param(
        Params._dummy(), "predict_transformation_fn",
        "function applied to every prediction batch (a dict of numpy arrays of the feature "
        "columns, no labels) before the model: decoding without training's augmentation. "
        "Default: transformation_fn when a feature column is binary, string, an image or of "
        "variable length, else none")
    inmemory_cache_all = Param(Params._dummy(), "inmemory_cache_all",
                               "keep each rank's whole shard in memory after the first epoch",
                               TypeConverters.toBoolean)
    backward_passes_per_step = Param(Params._dummy(), "backward_passes_per_step",
                                     "batches whose gradients are accumulated before each "
                                     "optimizer step", TypeConverters.toInt)
    scale_learning_rate = Param(Params._dummy(), "scale_learning_rate",
                                "multiply the learning rate by num_proc * "
                                "backward_passes_per_step (linear scaling rule)",
                                TypeConverters.toBoolean)
    mixed_precision = Param(Params._dummy(), "mixed_precision",
                            "autocast precision: None (off), 'bf16' (CPU or GPU) or 'fp16' (GPU)",
                            _to_mixed_precision)
    max_time = Param(Params._dummy(), "max_time",
                     "seconds after which training stops at the end of an epoch",
                     _to_optional_float)
    max_attempts = Param(Params._dummy(), "max_attempts",
                         "attempts of the training stage before a fit fails on a fault (a lost "
                         "process or executor, a store error: retried from the checkpoint); an "
                         "error raised by user code fails the fit at once (default and upper "
                         "bound: spark.stage.maxConsecutiveAttempts)", _to_optional_int)

    # -- Horovod's params (horovod.spark.common.params.EstimatorParams, 0.28.1) ---------------
    loss_weights = Param(Params._dummy(), "loss_weights",
                         "weight of each label column's loss in the total loss (default: 1 each)",
                         _to_loss_weights)
    label_shapes = Param(Params._dummy(), "label_shapes",
                         "shape of each label column's batch tensor, -1 for the batch dimension",
                         _to_shapes("label_shapes"))
    gradient_compression = Param(Params._dummy(), "gradient_compression",
                                 "gradient compression for the all-reduce: Horovod's "
                                 "Compression.fp16 (or 'fp16'), Compression.none (or None)")
    mlflow_logging = Param(Params._dummy(), "mlflow_logging",
                           "log this fit to MLflow: None follows sparktrain.mlflow.autolog() "
                           "(or mlflow.autolog()), True logs it, False never "
                           "(docs/mlflow.md)", _to_optional_bool)
    backend_env = Param(Params._dummy(), "backend_env",
                        "environment variables set in every rank's process while it trains",
                        _to_env)
    train_reader_num_workers = Param(Params._dummy(), "train_reader_num_workers",
                                     "row groups the training reader decodes ahead (Petastorm: "
                                     "reader worker count)", _to_count("train_reader_num_workers"))
    val_reader_num_workers = Param(Params._dummy(), "val_reader_num_workers",
                                   "row groups the validation reader decodes ahead (Petastorm: "
                                   "reader worker count)", _to_count("val_reader_num_workers"))
    reader_pool_type = Param(Params._dummy(), "reader_pool_type",
                             "'thread' (read ahead in a thread, transformation_fn in the "
                             "training thread), 'process' (transformation_fn in "
                             "train_reader_num_workers worker processes: the default when a "
                             "column holds bytes, text, images or variable-length arrays), "
                             "'dummy' (read in the training thread)",
                             _to_choice("reader_pool_type", READER_POOL_TYPES))
    shuffle_buffer_size = Param(Params._dummy(), "shuffle_buffer_size",
                                "(Horovod: deprecated, unused) accepted and ignored with a "
                                "warning; use shuffle", _to_count("shuffle_buffer_size"))
    partitions_per_process = Param(Params._dummy(), "partitions_per_process",
                                   "(Horovod: Parquet files per process) accepted and ignored "
                                   "with a warning: ranks read row ranges, not files",
                                   _to_count("partitions_per_process"))
    mp_start_method = Param(Params._dummy(), "mp_start_method",
                            "start method of the decode worker processes: 'forkserver' "
                            "(default on Linux) or 'spawn'; 'fork' is refused with a warning "
                            "(forking a process holding Spark's and torch's threads can hang)",
                            _to_choice("mp_start_method", MP_START_METHODS))
    data_module = Param(Params._dummy(), "data_module",
                        "(Horovod: Petastorm/NVTabular data module class) accepted and ignored "
                        "with a warning: sparktrain reads with its own shard reader")
    continuous_cols = Param(Params._dummy(), "continuous_cols",
                            "(Horovod: NVTabular data module only) accepted and ignored with "
                            "a warning", TypeConverters.toListString)
    categorical_cols = Param(Params._dummy(), "categorical_cols",
                             "(Horovod: NVTabular data module only) accepted and ignored with "
                             "a warning", TypeConverters.toListString)
    compress_sparse_cols = Param(Params._dummy(), "compress_sparse_cols",
                                 "(Horovod: store SparseVectors compressed) accepted; vectors "
                                 "are stored dense, True warns", TypeConverters.toBoolean)
    transformation_edit_fields = Param(Params._dummy(), "transformation_edit_fields",
                                       "(Horovod: Petastorm TransformSpec edit fields) accepted "
                                       "and ignored with a warning: transformation_fn may "
                                       "return any columns")
    transformation_removed_fields = Param(Params._dummy(), "transformation_removed_fields",
                                          "(Horovod: Petastorm TransformSpec removed fields) "
                                          "accepted and ignored with a warning")

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(num_proc=1, metrics=[], label_cols=["label"], sample_weight_col=None,
                         validation=None, batch_size=32, val_batch_size=None, epochs=1,
                         shuffle=True, random_seed=None, store=None, run_id=None, verbose=1,
                         callbacks=[], use_gpu=None, train_steps_per_epoch=None,
                         validation_steps_per_epoch=None, transformation_fn=None,
                         predict_transformation_fn=None,
                         inmemory_cache_all=False, backward_passes_per_step=1,
                         scale_learning_rate=False, mixed_precision=None, max_time=None,
                         max_attempts=None, loss_weights=None, label_shapes=None,
                         gradient_compression=None, backend_env=EnvVars(),
                         mlflow_logging=None,
                         train_reader_num_workers=None, val_reader_num_workers=None,
                         reader_pool_type="thread", shuffle_buffer_size=None,
                         partitions_per_process=None, mp_start_method=None, data_module=None,
                         continuous_cols=None, categorical_cols=None,
                         compress_sparse_cols=False, transformation_edit_fields=None,
                         transformation_removed_fields=None)

    def getNumProc(self) -> int:
        return self.getOrDefault(self.num_proc)

    def getModel(self) -> Any:
        return self.getOrDefault(self.model)

    def getOptimizer(self) -> Any:
        return self.getOrDefault(self.optimizer)

    def getLoss(self) -> Any:
        return self.getOrDefault(self.loss)

    def getMetrics(self) -> List[Any]:
        return self.getOrDefault(self.metrics)

    def getFeatureCols(self) -> List[str]:
        return self.getOrDefault(self.feature_cols)

    def getLabelCols(self) -> List[str]:
        return self.getOrDefault(self.label_cols)

    def getSampleWeightCol(self) -> Optional[str]:
        return self.getOrDefault(self.sample_weight_col)

    def getValidation(self) -> Any:
        return self.getOrDefault(self.validation)

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batch_size)

    def getValBatchSize(self) -> int:
        return self.getOrDefault(self.val_batch_size) or self.getBatchSize()

    def getEpochs(self) -> int:
        return self.getOrDefault(self.epochs)

    def getShuffle(self) -> bool:
        return self.getOrDefault(self.shuffle)

    def getRandomSeed(self) -> Optional[int]:
        return self.getOrDefault(self.random_seed)

    def getStore(self) -> Any:
        return self.getOrDefault(self.store)

    def getRunId(self) -> Optional[str]:
        return self.getOrDefault(self.run_id)

    def getVerbose(self) -> int:
        return self.getOrDefault(self.verbose)

    def getCallbacks(self) -> List[Any]:
        return self.getOrDefault(self.callbacks)

    def getBackend(self) -> str:
        return self.getOrDefault(self.backend)

    def getUseGpu(self) -> Optional[bool]:
        return self.getOrDefault(self.use_gpu)

    def getTrainStepsPerEpoch(self) -> Optional[int]:
        return self.getOrDefault(self.train_steps_per_epoch)

    def getValidationStepsPerEpoch(self) -> Optional[int]:
        return self.getOrDefault(self.validation_steps_per_epoch)

    def getTransformationFn(self) -> Any:
        return self.getOrDefault(self.transformation_fn)

    def getPredictTransformationFn(self) -> Optional[Callable]:
        return self.getOrDefault(self.predict_transformation_fn)

    def getInmemoryCacheAll(self) -> bool:
        return self.getOrDefault(self.inmemory_cache_all)

    def getBackwardPassesPerStep(self) -> int:
        return self.getOrDefault(self.backward_passes_per_step)

    def getScaleLearningRate(self) -> bool:
        return self.getOrDefault(self.scale_learning_rate)

    def getMixedPrecision(self) -> Optional[str]:
        return self.getOrDefault(self.mixed_precision)

    def getMaxTime(self) -> Optional[float]:
        return self.getOrDefault(self.max_time)

    def getMlflowLogging(self) -> Optional[bool]:
        return self.getOrDefault(self.mlflow_logging)

    def setMlflowLogging(self, value: Optional[bool]) -> "EstimatorParams":
        """``True``/``False``: log this estimator's fits to MLflow or never; ``None``: follow
        :func:`sparktrain.mlflow.autolog`."""
        return self._set(mlflow_logging=value)

    def getMaxAttempts(self) -> Optional[int]:
        return self.getOrDefault(self.max_attempts)

    def getLossWeights(self) -> Optional[List[float]]:
        return self.getOrDefault(self.loss_weights)

    def getLabelShapes(self) -> Optional[List[List[int]]]:
        return self.getOrDefault(self.label_shapes)

    def getBackendEnv(self) -> Dict[str, str]:
        return dict(self.getOrDefault(self.backend_env) or {})


class TorchParams(Params):
    """Params only ``TorchEstimator`` has (Horovod's ``horovod.spark.torch.TorchEstimator``)."""

    input_shapes = Param(Params._dummy(), "input_shapes",
                         "shape of each feature column's batch tensor, -1 for the batch "
                         "dimension, e.g. [[-1, 1, 8, 8]] (default: (batch, n), scalars "
                         "(batch, 1))", _to_shapes("input_shapes"))
    loss_constructors = Param(Params._dummy(), "loss_constructors",
                              "functions returning the loss (one, or one per label column), "
                              "called on every rank instead of shipping loss")
    train_minibatch_fn = Param(Params._dummy(), "train_minibatch_fn",
                               "function running one training minibatch (Horovod's contract), "
                               "replacing the built-in forward/backward/step")
    strategy = Param(Params._dummy(), "strategy",
                     "'ddp' (every rank holds the whole model, DistributedDataParallel) or "
                     "'fsdp' (parameters, gradients and optimizer state sharded across ranks, "
                     "FSDP2; backend='torch' only)", _to_strategy)
    fsdp_wrap = Param(Params._dummy(), "fsdp_wrap",
                      "with strategy='fsdp', the blocks sharded as one unit: module classes "
                      "(e.g. [TransformerBlock]) or a minimum parameter count (default 1e6)",
                      _to_module_classes("fsdp_wrap", int))
    fsdp_cpu_offload = Param(Params._dummy(), "fsdp_cpu_offload",
                             "with strategy='fsdp' on GPUs, keep parameter shards and optimizer "
                             "state in CPU memory", TypeConverters.toBoolean)
    activation_checkpointing = Param(Params._dummy(), "activation_checkpointing",
                                     "recompute blocks' activations in backward instead of "
                                     "storing them: True (the blocks fsdp_wrap picks) or "
                                     "module classes", _to_module_classes(
                                         "activation_checkpointing", bool))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(input_shapes=None, loss_constructors=None, train_minibatch_fn=None,
                         strategy="ddp", fsdp_wrap=None, fsdp_cpu_offload=False,
                         activation_checkpointing=False)

    def getInputShapes(self) -> Optional[List[List[int]]]:
        return self.getOrDefault(self.input_shapes)

    def getLossConstructors(self) -> Any:
        return self.getOrDefault(self.loss_constructors)

    def getTrainMinibatchFn(self) -> Optional[Callable]:
        return self.getOrDefault(self.train_minibatch_fn)


def _to_keras_strategy(value: Any) -> str:
    """A registered Keras strategy (see :mod:`sparktrain.strategies`)."""
    from sparktrain.strategies import KERAS_STRATEGIES, TORCH_STRATEGIES

    value = TypeConverters.toString(value)
    if value not in KERAS_STRATEGIES:
        hint = " (TorchEstimator's strategies; Keras trains data parallel with " \
               "'multi_worker_mirrored')" if value in TORCH_STRATEGIES else ""
        raise ValueError(f"strategy must be one of {sorted(KERAS_STRATEGIES)}, found "
                         f"{value!r}{hint}")
    return value


def _to_num_ps(value: Any) -> int:
    value = TypeConverters.toInt(value)
    if value < 1:
        raise ValueError(f"num_ps must be at least 1 (parameter servers), found {value}")
    return value


class KerasParams(Params):
    """Params only ``KerasEstimator`` has (Horovod's ``horovod.spark.keras.KerasEstimator``)."""

    custom_objects = Param(Params._dummy(), "custom_objects",
                           "custom layers/functions by name, for loading the model")
    checkpoint_callback = Param(Params._dummy(), "checkpoint_callback",
                                "a keras.callbacks.ModelCheckpoint: with save_best_only=True "
                                "the fitted model is the best epoch's by its monitor and mode")
    strategy = Param(Params._dummy(), "strategy",
                     "'multi_worker_mirrored' (every task a synchronous replica, "
                     "MultiWorkerMirroredStrategy) or 'parameter_server' (num_ps tasks hold "
                     "the variables, one coordinates, the rest train asynchronously; "
                     "ParameterServerStrategy, backend='tensorflow' only)", _to_keras_strategy)
    num_ps = Param(Params._dummy(), "num_ps",
                   "with strategy='parameter_server', how many of the num_proc tasks are "
                   "parameter servers (default 1; TensorFlowOnSpark's name)", _to_num_ps)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(custom_objects={}, checkpoint_callback=None,
                         strategy="multi_worker_mirrored", num_ps=None)

    def getStrategy(self) -> str:
        return self.getOrDefault(self.strategy)

    def getNumPs(self) -> Optional[int]:
        return self.getOrDefault(self.num_ps)

    def getCustomObjects(self) -> Dict[str, Any]:
        return self.getOrDefault(self.custom_objects)

    def getCheckpointCallback(self) -> Any:
        return self.getOrDefault(self.checkpoint_callback)


class ModelParams(Params):
    """Params of a fitted model: which columns go in and which prediction columns come out."""

    feature_cols = EstimatorParams.feature_cols
    label_cols = EstimatorParams.label_cols
    output_cols = Param(Params._dummy(), "output_cols",
                        "prediction column names (default: <label>__output per label column)",
                        TypeConverters.toListString)
    batch_size = Param(Params._dummy(), "batch_size", "rows per inference batch",
                       TypeConverters.toInt)
    run_id = EstimatorParams.run_id
    predict_transformation_fn = EstimatorParams.predict_transformation_fn
    use_gpu = Param(Params._dummy(), "use_gpu",
                    "predict on the first GPU Spark assigned to each task: None (default) when "
                    "the task has one, True require one, False always on the CPU",
                    _to_optional_bool)
    resource_profile = Param(Params._dummy(), "resource_profile",
                             "a pyspark.resource.ResourceProfile for the prediction stage (e.g. "
                             "a GPU per task; stage-level scheduling), not saved with the model",
                             _to_resource_profile)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(output_cols=None, batch_size=1024, run_id=None, use_gpu=None,
                         resource_profile=None, predict_transformation_fn=None)

    def getPredictTransformationFn(self) -> Optional[Callable]:
        return self.getOrDefault(self.predict_transformation_fn)

    def setPredictTransformationFn(self, value: Optional[Callable]) -> "ModelParams":
        """The function ``transform`` applies to every batch (a dict of numpy arrays of the
        feature columns) before the model; saved with the model, pickled by value."""
        return self._set(predict_transformation_fn=value)

    def getFeatureCols(self) -> List[str]:
        return self.getOrDefault(self.feature_cols)

    def getLabelCols(self) -> List[str]:
        return self.getOrDefault(self.label_cols)

    def getOutputCols(self) -> List[str]:
        cols = self.getOrDefault(self.output_cols)
        return list(cols) if cols else [f"{label}__output" for label in self.getLabelCols()]

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batch_size)

    def setOutputCols(self, value: List[str]) -> "ModelParams":
        return self._set(output_cols=value)

    def setFeatureCols(self, value: List[str]) -> "ModelParams":
        return self._set(feature_cols=value)

    def setBatchSize(self, value: int) -> "ModelParams":
        return self._set(batch_size=value)

    # Horovod's ModelParams names (horovod.spark.common.params, 0.28.1), ``setLabelColoumns``
    # spelled as there too.
    def getFeatureColumns(self) -> List[str]:
        return self.getFeatureCols()

    def setFeatureColumns(self, value: List[str]) -> "ModelParams":
        return self.setFeatureCols(value)

    def getLabelColumns(self) -> List[str]:
        return self.getLabelCols()

    def setLabelColumns(self, value: List[str]) -> "ModelParams":
        return self._set(label_cols=value)

    setLabelColoumns = setLabelColumns

    def setParams(self, **kwargs: Any) -> "ModelParams":
        """Set params by keyword (Horovod's ``feature_columns``/``label_columns`` too)."""
        aliases = {"feature_columns": "feature_cols", "label_columns": "label_cols"}
        return self._set(**{aliases.get(k, k): v for k, v in kwargs.items()})


# Horovod's accessor names where they are not get/set + the param's name in CamelCase
# (horovod/spark/common/params.py, 0.28.1); both spellings exist here.
HOROVOD_ACCESSOR_NAMES = {"shuffle_buffer_size": "ShufflingBufferSize",
                          "train_reader_num_workers": "TrainReaderNumWorker",
                          "val_reader_num_workers": "ValReaderNumWorker",
                          "inmemory_cache_all": "InMemoryCacheAll"}


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _getter(name: str, doc: str) -> Callable:
    def get(self: Params) -> Any:
        return self.getOrDefault(name)
    get.__doc__ = f"The value of ``{name}``: {doc}."
    return get


def _setter(name: str, doc: str) -> Callable:
    def set_(self: Params, value: Any) -> Params:
        return self._set(**{name: value})
    set_.__doc__ = f"Set ``{name}`` ({doc}); returns this object."
    return set_


def with_accessors(cls: Type[Params]) -> Type[Params]:
    """Add ``getX``/``setX`` for every Param declared on ``cls`` that has no hand-written one
    (``X``: the param's name in CamelCase, plus Horovod's spelling where it differs).

    Example: ``EstimatorParams.num_proc`` gives ``getNumProc()`` and ``setNumProc(4)``.
    """
    for param in [v for v in vars(cls).values() if isinstance(v, Param)]:
        for suffix in dict.fromkeys([_camel(param.name),
                                     HOROVOD_ACCESSOR_NAMES.get(param.name, "")]):
            for prefix, make in (("get", _getter), ("set", _setter)):
                method = f"{prefix}{suffix}"
                if suffix and not hasattr(cls, method):
                    function = make(param.name, param.doc)
                    function.__name__ = method
                    function.__qualname__ = f"{cls.__name__}.{method}"
                    setattr(cls, method, function)
    return cls


for _cls in (EstimatorParams, TorchParams, KerasParams, ModelParams):
    with_accessors(_cls)


def json_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` that belong in JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}


def object_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` holding Python objects (pickled on save)."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name in OBJECT_PARAMS}
