"""Every option of sparktrain's estimators and models, declared once.

An :class:`Option` holds a knob's name, doc, default, value converter, keyword type and whether
(and under which name) it reaches the rank loops. From these tables come the Spark ML
``Param`` classes with ``get``/``set`` accessors (:mod:`.params`), the estimators' constructor
keywords (:mod:`.keywords`), the fields of the rank loops' specs (:mod:`.spec`)
and the parameter table of docs/usage.md (:mod:`.docs`). Adding an option is one row here plus
the code that uses it.

Names and meanings follow Horovod's Spark estimators (``horovod.spark.common.params``, 0.28.1)
where the concept is the same; every param of Horovod's ``TorchEstimator``/``KerasEstimator``/
``TorchModel``/``KerasModel`` is here. Plain Python: the ranks read these tables without
``pyspark.ml``.

Example (a new option that the torch loop reads as ``spec.warmup_steps``)::

    TORCH = (...,
             Option("warmup_steps", "optimizer steps of linear learning-rate warm-up",
                    default=0, convert=to_count("warmup_steps"), hint=Optional[int],
                    rank=True))
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from sparktrain.options.converters import (
    BATCH_RULES,
    INPUT_MODES,
    INTERVALS,
    MP_START_METHODS,
    READER_POOL_TYPES,
    EnvVars,
    to_backend_name,
    to_bool,
    to_cache_limit,
    to_choice,
    to_compression,
    to_count,
    to_env,
    to_function,
    to_int,
    to_keras_strategy,
    to_list_string,
    to_loss_weights,
    to_mixed_precision,
    to_module_classes,
    to_optional_bool,
    to_resource_profile,
    to_seconds,
    to_shapes,
    to_strategy,
    to_string,
    to_validation,
)


class _Unset:
    """The default of an option that stays undefined until set (``isDefined`` is False)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Option:
    """One knob. ``rank``: ``True`` when the rank loops read it (a spec field of the same
    name), a string to name that field otherwise (``random_seed`` -> ``seed``), ``False`` when
    only the driver reads it. ``python_object``: its value is a Python object (a module, a
    function), pickled when saved and never written into JSON metadata. ``horovod_accessor``:
    Horovod's spelling of ``get``/``set`` where it is not the name in CamelCase."""

    name: str
    doc: str
    default: Any = None
    convert: Optional[Callable[[Any], Any]] = None
    hint: Any = Any
    rank: Union[bool, str] = False
    python_object: bool = False
    horovod_accessor: str = ""
    hidden: bool = False  # its value may hold secrets: kept out of reprs

    @property
    def spec_name(self) -> Optional[str]:
        """The rank loops' spec field of this option, or ``None``."""
        if not self.rank:
            return None
        return self.name if self.rank is True else str(self.rank)


_INTS = Optional[int]
_STRS = Optional[List[str]]
_SHAPES = Optional[List[List[int]]]

#: what every estimator takes (Horovod's ``EstimatorParams`` plus sparktrain's own)
COMMON = (
    Option("num_proc", "number of training processes (Spark barrier tasks)", 1,
           to_count("num_proc", 1), _INTS),
    Option("model", "the model to train (framework object)", UNSET, python_object=True),
    Option("optimizer", "optimizer bound to the model's parameters", UNSET, python_object=True),
    Option("loss", "loss function or module", UNSET, python_object=True),
    Option("metrics", "metric functions (output, label) -> tensor", [],
           hint=Optional[List[Any]], python_object=True),
    Option("feature_cols", "feature column names", UNSET, to_list_string, _STRS, rank=True),
    Option("label_cols", "label column names", ["label"], to_list_string, _STRS, rank=True),
    Option("sample_weight_col", "column of per-row loss weights", None, to_string,
           Optional[str], rank=True),
    Option("validation", "fraction of rows held out for validation, or a boolean column "
           "marking them", None, to_validation),
    Option("input_mode", "how the rows reach the ranks: 'store' (written to the store as "
           "Parquet once, reused by later fits of the same DataFrame) or 'stream' (the ranks "
           "train while the DataFrame's rows arrive, nothing written to the store; "
           "docs/data.md)",
           "store", to_choice("input_mode", INPUT_MODES), Optional[str], rank=True),
    Option("cache_limit", "input_mode='stream': the most local disk each rank's cache of its "
           "rows may take, as a fraction of the free space (0.5) or bytes (2e9, '20g'); rows "
           "that do not fit are read again from the DataFrame every epoch (default: the free "
           "space less 256 MiB)", None, to_cache_limit, Optional[Union[float, str]]),
    Option("batch_size", "rows per batch on each process", 32, to_count("batch_size", 1), _INTS,
           rank=True),
    Option("val_batch_size", "rows per validation batch (default: batch_size)", None,
           to_count("val_batch_size", 1, optional=True), _INTS, rank=True),
    Option("epochs", "number of passes over the training data", 1, to_count("epochs", 1), _INTS,
           rank=True),
    Option("shuffle", "shuffle training rows every epoch", True, to_bool, Optional[bool],
           rank=True),
    Option("random_seed", "seed for shuffling, splits and the framework", None, to_int, _INTS,
           rank="seed"),
    Option("store", "where datasets and runs live: a path/URL or a Store", None,
           python_object=True),
    Option("run_id", "name of this training run in the store", None, to_string, Optional[str]),
    Option("verbose", "0 quiet, 1 one line per epoch, 2 also per-rank detail", 1, to_int,
           _INTS, rank=True),
    Option("callbacks", "objects called at the end of every epoch", [],
           hint=Optional[List[Any]], python_object=True),
    Option("backend", "distributed engine (a name, e.g. 'torch'; default: 'torch' for "
           "TorchEstimator, 'tensorflow' for KerasEstimator)", UNSET, to_backend_name,
           Optional[str], rank=True),
    Option("use_gpu", "train on the GPUs Spark assigns to the tasks (default: when the "
           "executors have GPUs)", None, to_optional_bool, Optional[bool]),
    Option("resource_profile", "a pyspark.resource.ResourceProfile for the training stage "
           "(stage-level scheduling: its task GPUs and CPUs; default: one GPU per rank when "
           "the application shares GPUs between tasks), not saved with the estimator", None,
           to_resource_profile, python_object=True),
    Option("train_steps_per_epoch", "training batches per epoch and rank (default: one pass "
           "over the rank's rows)", None, to_count("train_steps_per_epoch", 1, optional=True),
           _INTS, rank="train_steps"),
    Option("validation_steps_per_epoch", "validation batches per epoch and rank (default: "
           "all)", None, to_count("validation_steps_per_epoch", 1, optional=True), _INTS,
           rank="val_steps"),
    Option("transformation_fn", "function applied on the worker to every batch, a dict of "
           "numpy arrays by column name, before training and validation steps", None,
           to_function("transformation_fn", "taking and returning a dict of numpy arrays by "
                       "column name"), hint=Optional[Callable], python_object=True),
    Option("predict_transformation_fn", "function applied to every prediction batch (a dict "
           "of numpy arrays of the feature columns, no labels) before the model: decoding "
           "without training's augmentation. Default: transformation_fn when a feature column "
           "is binary, string, an image or of variable length, else none", None,
           to_function("predict_transformation_fn", "taking and returning a dict of numpy "
                       "arrays by column name"), hint=Optional[Callable], python_object=True),
    Option("inmemory_cache_all", "keep each rank's whole shard in memory after the first "
           "epoch", False, to_bool, Optional[bool], rank=True,
           horovod_accessor="InMemoryCacheAll"),
    Option("backward_passes_per_step", "batches whose gradients are accumulated before each "
           "optimizer step", 1, to_count("backward_passes_per_step", 1), _INTS, rank=True),
    Option("scale_learning_rate", "multiply the learning rate by num_proc * "
           "backward_passes_per_step (linear scaling rule)", False, to_bool, Optional[bool],
           rank=True),
    Option("mixed_precision", "autocast precision: None (off), 'bf16' (CPU or GPU) or 'fp16' "
           "(GPU)", None, to_mixed_precision, Optional[str], rank=True),
    Option("max_time", "seconds after which training stops at the end of an epoch", None,
           to_seconds("max_time"), Optional[float]),
    Option("checkpoint_steps", "also write a checkpoint every this many optimizer steps "
           "inside an epoch (Hugging Face's save_steps; None: off); a resumed fit continues "
           "inside the epoch, after the rows already trained", None,
           to_count("checkpoint_steps", 1, optional=True), _INTS, rank=True),
    Option("checkpoint_seconds", "also write a checkpoint inside an epoch after about this "
           "many seconds of training since the last one (None: off). Default 1800: an epoch "
           "longer than 30 minutes loses at most about 30 minutes to a fault, while a fit of "
           "short epochs writes only its epoch-end checkpoints", 1800.0,
           to_seconds("checkpoint_seconds"), Optional[float], rank=True),
    Option("max_attempts", "attempts of the training stage before a fit fails on a fault (a "
           "lost process or executor, a store error: retried from the checkpoint); an error "
           "raised by user code fails the fit at once (default and upper bound: "
           "spark.stage.maxConsecutiveAttempts)", None,
           to_count("max_attempts", 1, optional=True), _INTS),
    Option("min_num_proc", "the fewest training processes of an elastic fit (default: "
           "num_proc, not elastic): the fit starts with the free task slots up to num_proc, "
           "continues with fewer ranks when a machine is lost and grows back", None,
           to_count("min_num_proc", 1, optional=True), _INTS),
    Option("elastic_batch", "'global' (default): a generation with fewer ranks keeps the "
           "global batch batch_size * num_proc (larger batches per rank); 'rank': it keeps "
           "batch_size per rank", "global", to_choice("elastic_batch", BATCH_RULES),
           Optional[str]),
    Option("mlflow_logging", "log this fit to MLflow: None follows sparktrain.mlflow."
           "autolog() (or mlflow.autolog()), True logs it, False never (docs/mlflow.md)",
           None, to_optional_bool, Optional[bool]),
    # -- Horovod's params (horovod.spark.common.params.EstimatorParams, 0.28.1) -------------
    Option("label_shapes", "shape of each label column's batch tensor, -1 for the batch "
           "dimension", None, to_shapes("label_shapes"), _SHAPES, rank=True),
    Option("loss_weights", "weight of each label column's loss in the total loss (default: 1 "
           "each)", None, to_loss_weights, Optional[List[float]], rank=True),
    Option("gradient_compression", "gradient compression for the all-reduce: Horovod's "
           "Compression.fp16 (or 'fp16'), Compression.none (or None)", None, to_compression,
           python_object=True),
    Option("backend_env", "environment variables set in every rank's process while it trains",
           EnvVars(), to_env, Optional[Dict[str, str]], rank=True, hidden=True),
    Option("train_reader_num_workers", "row groups the training reader decodes ahead "
           "(Petastorm: reader worker count)", None,
           to_count("train_reader_num_workers", optional=True), _INTS,
           horovod_accessor="TrainReaderNumWorker"),
    Option("val_reader_num_workers", "row groups the validation reader decodes ahead "
           "(Petastorm: reader worker count)", None,
           to_count("val_reader_num_workers", optional=True), _INTS,
           horovod_accessor="ValReaderNumWorker"),
    Option("reader_pool_type", "'thread' (read ahead in a thread, transformation_fn in the "
           "training thread), 'process' (transformation_fn in train_reader_num_workers worker "
           "processes: the default when a column holds bytes, text, images or variable-length "
           "arrays), 'dummy' (read in the training thread)", "thread",
           to_choice("reader_pool_type", READER_POOL_TYPES), Optional[str]),
    Option("shuffle_buffer_size", "(Horovod: deprecated, unused) accepted and ignored with a "
           "warning; use shuffle", None, to_count("shuffle_buffer_size", optional=True), _INTS,
           horovod_accessor="ShufflingBufferSize"),
    Option("partitions_per_process", "(Horovod: Parquet files per process) accepted and "
           "ignored with a warning: ranks read row ranges, not files", None,
           to_count("partitions_per_process", optional=True), _INTS),
    Option("mp_start_method", "start method of the decode worker processes: 'forkserver' "
           "(default on Linux) or 'spawn'; 'fork' is refused with a warning (forking a process "
           "holding Spark's and torch's threads can hang)", None,
           to_choice("mp_start_method", MP_START_METHODS), Optional[str]),
    Option("data_module", "(Horovod: Petastorm/NVTabular data module class) accepted and "
           "ignored with a warning: sparktrain reads with its own shard reader", None,
           python_object=True),
    Option("continuous_cols", "(Horovod: NVTabular data module only) accepted and ignored "
           "with a warning", None, to_list_string, _STRS),
    Option("categorical_cols", "(Horovod: NVTabular data module only) accepted and ignored "
           "with a warning", None, to_list_string, _STRS),
    Option("compress_sparse_cols", "(Horovod: store SparseVectors compressed) accepted; "
           "vectors are stored dense, True warns", False, to_bool, Optional[bool]),
    Option("transformation_edit_fields", "(Horovod: Petastorm TransformSpec edit fields) "
           "accepted and ignored with a warning: transformation_fn may return any columns",
           None, python_object=True),
    Option("transformation_removed_fields", "(Horovod: Petastorm TransformSpec removed "
           "fields) accepted and ignored with a warning", None, python_object=True),
)

#: the options only ``TorchEstimator`` has (Horovod's ``horovod.spark.torch.TorchEstimator``,
#: FSDP, fine-tuning)
TORCH = (
    Option("input_shapes", "shape of each feature column's batch tensor, -1 for the batch "
           "dimension, e.g. [[-1, 1, 8, 8]] (default: (batch, n), scalars (batch, 1))", None,
           to_shapes("input_shapes"), _SHAPES),
    Option("loss_constructors", "functions returning the loss (one, or one per label column), "
           "called on every rank instead of shipping loss", None, python_object=True),
    Option("train_minibatch_fn", "function running one training minibatch (Horovod's "
           "contract), replacing the built-in forward/backward/step", None,
           to_function("train_minibatch_fn", "(model, optimizer, transform_outputs, loss_fn, "
                       "inputs, labels, sample_weights, backward_passes_per_step, batch_idx) -> "
                       "(outputs, loss)"), hint=Optional[Callable], python_object=True),
    Option("strategy", "'ddp' (every rank holds the whole model, DistributedDataParallel) or "
           "'fsdp' (parameters, gradients and optimizer state sharded across ranks, FSDP2; "
           "backend='torch' only)", "ddp", to_strategy, Optional[str], rank=True),
    Option("fsdp_wrap", "with strategy='fsdp', the blocks sharded as one unit: module classes "
           "(e.g. [TransformerBlock]) or a minimum parameter count (default 1e6)", None,
           to_module_classes("fsdp_wrap", int), python_object=True),
    Option("fsdp_cpu_offload", "with strategy='fsdp' on GPUs, keep parameter shards and "
           "optimizer state in CPU memory", False, to_bool, Optional[bool]),
    Option("activation_checkpointing", "recompute blocks' activations in backward instead of "
           "storing them: True (the blocks fsdp_wrap picks) or module classes", False,
           to_module_classes("activation_checkpointing", bool), python_object=True),
    Option("output_key", "when the model returns a dict or a Hugging Face ModelOutput, the "
           "entry the loss, metrics and transform use (default 'logits')", None, to_string,
           Optional[str], rank=True),
    Option("lr_scheduler", "a function optimizer -> torch.optim.lr_scheduler.LRScheduler, "
           "called on every rank; stepped per optimizer step or per epoch "
           "(lr_scheduler_interval) and kept in checkpoints", None,
           hint=Optional[Callable[[Any], Any]], python_object=True),
    Option("lr_scheduler_interval", "'step' (default): step the scheduler after every "
           "optimizer step; 'epoch': after every epoch", "step",
           to_choice("lr_scheduler_interval", INTERVALS), Optional[str], rank=True),
)

#: the options only ``KerasEstimator`` has (Horovod's ``horovod.spark.keras.KerasEstimator``,
#: parameter servers)
KERAS = (
    Option("custom_objects", "custom layers/functions by name, for loading the model", {},
           hint=Optional[Dict], python_object=True),
    Option("checkpoint_callback", "a keras.callbacks.ModelCheckpoint: with "
           "save_best_only=True the fitted model is the best epoch's by its monitor and mode",
           None, python_object=True),
    Option("strategy", "'multi_worker_mirrored' (every task a synchronous replica, "
           "MultiWorkerMirroredStrategy) or 'parameter_server' (num_ps tasks hold the "
           "variables, one coordinates, the rest train asynchronously; ParameterServerStrategy, "
           "backend='tensorflow' only)", "multi_worker_mirrored", to_keras_strategy,
           Optional[str], rank=True),
    Option("num_ps", "with strategy='parameter_server', how many of the num_proc tasks are "
           "parameter servers (default 1; TensorFlowOnSpark's name)", None,
           to_count("num_ps", 1, optional=True), _INTS),
    Option("steps_per_execution", "training (and validation) steps per call of the compiled "
           "step function, their batches stacked (Keras' compile() param of that name): the "
           "same steps and updates in fewer calls, progress between calls. Default: up to 16, "
           "as many as fit in 64 MiB of batches", None,
           to_count("steps_per_execution", 1, optional=True), Optional[int], rank=True),
)


def _named(options: Sequence[Option]) -> Dict[str, Option]:
    return {option.name: option for option in options}


_COMMON = _named(COMMON)

#: the options of every fitted model: which columns go in and which prediction columns come
#: out (a model built by hand names its columns: they have no default here)
MODEL = (
    replace(_COMMON["feature_cols"], rank=False),
    replace(_COMMON["label_cols"], default=UNSET, rank=False),
    Option("output_cols", "prediction column names (default: <label>__output per label "
           "column)", None, to_list_string, _STRS),
    Option("batch_size", "rows per inference batch", 1024, to_count("batch_size", 1), _INTS),
    _COMMON["run_id"],
    _COMMON["predict_transformation_fn"],
    Option("use_gpu", "predict on the first GPU Spark assigned to each task: None (default) "
           "when the task has one, True require one, False always on the CPU", None,
           to_optional_bool, Optional[bool]),
    Option("resource_profile", "a pyspark.resource.ResourceProfile for the prediction stage "
           "(e.g. a GPU per task; stage-level scheduling), not saved with the model", None,
           to_resource_profile, python_object=True),
)

#: the options a ``TorchModel`` adds: what it predicts with and how it reads the output
TORCH_MODEL = tuple(replace(option, default=None, rank=False) for option in
                    (_COMMON["optimizer"], _COMMON["loss"], *[
                        o for o in TORCH if o.name in ("input_shapes", "loss_constructors",
                                                       "output_key")]))
