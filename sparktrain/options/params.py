"""Spark ML Params shared by every sparktrain estimator and model.

Names and meanings follow Horovod's Spark estimators (``horovod.spark.common.params``) where the
concept is the same, so ``TorchEstimator(num_proc=2, feature_cols=[...], ...)`` reads the same.
Every param of Horovod 0.28.1's ``TorchEstimator``/``KerasEstimator``/``TorchModel``/
``KerasModel`` is declared here, with Horovod's ``getX``/``setX`` accessors (generated from the
Param declarations by :func:`with_accessors`, Horovod's own spellings included, e.g.
``getShufflingBufferSize``, ``setTrainReaderNumWorker``). What the Petastorm-specific ones do
here: :mod:`sparktrain.options.horovod`.

Example::

    est = TorchEstimator(num_proc=2, input_shapes=[[-1, 1, 8, 8]], ...)
    est.setEpochs(5).getInputShapes()     # [[-1, 1, 8, 8]]
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from pyspark.ml.param import Param, Params, TypeConverters

# Value converters and accessor generation have modules of their own (issue #26); the constants,
# EnvVars and with_accessors stay importable from here.
from sparktrain.options.accessors import HOROVOD_ACCESSOR_NAMES, with_accessors  # noqa: F401
from sparktrain.options.converters import (  # noqa: F401 - the constants are re-exported
    MIXED_PRECISION, MP_START_METHODS, READER_POOL_TYPES, EnvVars, to_backend_name, to_choice,
    to_count, to_env, to_keras_strategy, to_loss_weights, to_mixed_precision, to_module_classes,
    to_num_ps, to_optional_bool, to_optional_float, to_optional_int, to_resource_profile,
    to_shapes, to_strategy, to_validation)

# Params whose values are Python objects (modules, optimizers, callables): they are pickled with
# cloudpickle on save, never written into the JSON metadata.
OBJECT_PARAMS = ("model", "optimizer", "loss", "metrics", "callbacks", "store", "custom_objects",
                 "transformation_fn", "predict_transformation_fn", "loss_constructors",
                 "train_minibatch_fn",
                 "gradient_compression", "checkpoint_callback", "data_module",
                 "transformation_edit_fields", "transformation_removed_fields",
                 "resource_profile", "fsdp_wrap", "activation_checkpointing", "lr_scheduler")


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
                       to_validation)
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
                    to_backend_name)
    use_gpu = Param(Params._dummy(), "use_gpu",
                    "train on the GPU Spark assigned to each task (default: when tasks have GPUs)",
                    to_optional_bool)
    train_steps_per_epoch = Param(Params._dummy(), "train_steps_per_epoch",
                                  "training batches per epoch and rank (default: one pass over "
                                  "the rank's rows)", to_optional_int)
    validation_steps_per_epoch = Param(Params._dummy(), "validation_steps_per_epoch",
                                       "validation batches per epoch and rank (default: all)",
                                       to_optional_int)
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
                            to_mixed_precision)
    max_time = Param(Params._dummy(), "max_time",
                     "seconds after which training stops at the end of an epoch",
                     to_optional_float)
    max_attempts = Param(Params._dummy(), "max_attempts",
                         "attempts of the training stage before a fit fails on a fault (a lost "
                         "process or executor, a store error: retried from the checkpoint); an "
                         "error raised by user code fails the fit at once (default and upper "
                         "bound: spark.stage.maxConsecutiveAttempts)", to_optional_int)

    # -- Horovod's params (horovod.spark.common.params.EstimatorParams, 0.28.1) ---------------
    loss_weights = Param(Params._dummy(), "loss_weights",
                         "weight of each label column's loss in the total loss (default: 1 each)",
                         to_loss_weights)
    label_shapes = Param(Params._dummy(), "label_shapes",
                         "shape of each label column's batch tensor, -1 for the batch dimension",
                         to_shapes("label_shapes"))
    gradient_compression = Param(Params._dummy(), "gradient_compression",
                                 "gradient compression for the all-reduce: Horovod's "
                                 "Compression.fp16 (or 'fp16'), Compression.none (or None)")
    mlflow_logging = Param(Params._dummy(), "mlflow_logging",
                           "log this fit to MLflow: None follows sparktrain.mlflow.autolog() "
                           "(or mlflow.autolog()), True logs it, False never "
                           "(docs/mlflow.md)", to_optional_bool)
    backend_env = Param(Params._dummy(), "backend_env",
                        "environment variables set in every rank's process while it trains",
                        to_env)
    train_reader_num_workers = Param(Params._dummy(), "train_reader_num_workers",
                                     "row groups the training reader decodes ahead (Petastorm: "
                                     "reader worker count)", to_count("train_reader_num_workers"))
    val_reader_num_workers = Param(Params._dummy(), "val_reader_num_workers",
                                   "row groups the validation reader decodes ahead (Petastorm: "
                                   "reader worker count)", to_count("val_reader_num_workers"))
    reader_pool_type = Param(Params._dummy(), "reader_pool_type",
                             "'thread' (read ahead in a thread, transformation_fn in the "
                             "training thread), 'process' (transformation_fn in "
                             "train_reader_num_workers worker processes: the default when a "
                             "column holds bytes, text, images or variable-length arrays), "
                             "'dummy' (read in the training thread)",
                             to_choice("reader_pool_type", READER_POOL_TYPES))
    shuffle_buffer_size = Param(Params._dummy(), "shuffle_buffer_size",
                                "(Horovod: deprecated, unused) accepted and ignored with a "
                                "warning; use shuffle", to_count("shuffle_buffer_size"))
    partitions_per_process = Param(Params._dummy(), "partitions_per_process",
                                   "(Horovod: Parquet files per process) accepted and ignored "
                                   "with a warning: ranks read row ranges, not files",
                                   to_count("partitions_per_process"))
    mp_start_method = Param(Params._dummy(), "mp_start_method",
                            "start method of the decode worker processes: 'forkserver' "
                            "(default on Linux) or 'spawn'; 'fork' is refused with a warning "
                            "(forking a process holding Spark's and torch's threads can hang)",
                            to_choice("mp_start_method", MP_START_METHODS))
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
                         "(batch, 1))", to_shapes("input_shapes"))
    loss_constructors = Param(Params._dummy(), "loss_constructors",
                              "functions returning the loss (one, or one per label column), "
                              "called on every rank instead of shipping loss")
    train_minibatch_fn = Param(Params._dummy(), "train_minibatch_fn",
                               "function running one training minibatch (Horovod's contract), "
                               "replacing the built-in forward/backward/step")
    strategy = Param(Params._dummy(), "strategy",
                     "'ddp' (every rank holds the whole model, DistributedDataParallel) or "
                     "'fsdp' (parameters, gradients and optimizer state sharded across ranks, "
                     "FSDP2; backend='torch' only)", to_strategy)
    fsdp_wrap = Param(Params._dummy(), "fsdp_wrap",
                      "with strategy='fsdp', the blocks sharded as one unit: module classes "
                      "(e.g. [TransformerBlock]) or a minimum parameter count (default 1e6)",
                      to_module_classes("fsdp_wrap", int))
    fsdp_cpu_offload = Param(Params._dummy(), "fsdp_cpu_offload",
                             "with strategy='fsdp' on GPUs, keep parameter shards and optimizer "
                             "state in CPU memory", TypeConverters.toBoolean)
    activation_checkpointing = Param(Params._dummy(), "activation_checkpointing",
                                     "recompute blocks' activations in backward instead of "
                                     "storing them: True (the blocks fsdp_wrap picks) or "
                                     "module classes", to_module_classes(
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
                     "ParameterServerStrategy, backend='tensorflow' only)", to_keras_strategy)
    num_ps = Param(Params._dummy(), "num_ps",
                   "with strategy='parameter_server', how many of the num_proc tasks are "
                   "parameter servers (default 1; TensorFlowOnSpark's name)", to_num_ps)

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
                    to_optional_bool)
    resource_profile = Param(Params._dummy(), "resource_profile",
                             "a pyspark.resource.ResourceProfile for the prediction stage (e.g. "
                             "a GPU per task; stage-level scheduling), not saved with the model",
                             to_resource_profile)

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


for _cls in (EstimatorParams, TorchParams, KerasParams, ModelParams):
    with_accessors(_cls)


def json_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` that belong in JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}


def object_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` holding Python objects (pickled on save)."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name in OBJECT_PARAMS}
