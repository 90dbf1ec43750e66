"""Spark ML Params shared by every sparktrain estimator and model.

Names and meanings follow Horovod's Spark estimators (``horovod.spark.common.params``) where the
concept is the same, so ``TorchEstimator(num_proc=2, feature_cols=[...], ...)`` reads the same.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from pyspark.ml.param import Param, Params, TypeConverters

# Params whose values are Python objects (modules, optimizers, callables): they are pickled with
# cloudpickle on save, never written into the JSON metadata.
OBJECT_PARAMS = ("model", "optimizer", "loss", "metrics", "callbacks", "store", "custom_objects",
                 "transformation_fn")

MIXED_PRECISION = ("bf16", "fp16")


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


def _to_mixed_precision(value: Any) -> Optional[str]:
    if value is None:
        return None
    if value not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={value!r}; expected None, 'bf16' or 'fp16'")
    return value


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
    backend = Param(Params._dummy(), "backend", "distributed engine", TypeConverters.toString)
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
                         "attempts of the training stage before a fit fails (default and upper "
                         "bound: spark.stage.maxConsecutiveAttempts)", _to_optional_int)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(num_proc=1, metrics=[], label_cols=["label"], sample_weight_col=None,
                         validation=None, batch_size=32, val_batch_size=None, epochs=1,
                         shuffle=True, random_seed=None, store=None, run_id=None, verbose=1,
                         callbacks=[], use_gpu=None, train_steps_per_epoch=None,
                         validation_steps_per_epoch=None, transformation_fn=None,
                         inmemory_cache_all=False, backward_passes_per_step=1,
                         scale_learning_rate=False, mixed_precision=None, max_time=None,
                         max_attempts=None)

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

    def getMaxAttempts(self) -> Optional[int]:
        return self.getOrDefault(self.max_attempts)


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

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(output_cols=None, batch_size=1024, run_id=None)

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


def json_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` that belong in JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}


def object_params(instance: Params) -> Dict[str, Any]:
    """The explicitly set params of ``instance`` holding Python objects (pickled on save)."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name in OBJECT_PARAMS}
