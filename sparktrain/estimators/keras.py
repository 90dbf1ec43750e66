"""``KerasEstimator`` and ``KerasModel``: Keras 3 (TensorFlow backend) training on DataFrames.

Importing this module does not import TensorFlow or Keras; fitting, predicting and loading do.

Example::

    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                            keras.layers.Dense(10)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(1e-3),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                         batch_size=64, epochs=10)
    model = est.fit(train_df)          # MultiWorkerMirroredStrategy over 2 barrier tasks
    model.transform(test_df)           # adds "label__output"
"""
from __future__ import annotations

import functools
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional

import cloudpickle
from pyspark import keyword_only
from pyspark.ml.param import Param, Params
from pyspark.sql import SparkSession

from sparktrain.data.materialize import MaterializedDataset
from sparktrain.estimators.base import EstimatorBase, FitRun, ModelBase
from sparktrain.launch import KERAS_BACKENDS, load_backend
from sparktrain.launch.barrier import RankContext, run_barrier
from sparktrain.pickling import dumps
from sparktrain.spark_api import classic_only


def _keras() -> Any:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO/WARNING lines
    import keras

    return keras


def _model_bytes(model: Any) -> bytes:
    """The native ``.keras`` file of ``model``, as bytes."""
    with tempfile.TemporaryDirectory(prefix="sparktrain-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def loading_objects(keras: Any, custom_objects: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``custom_objects`` keyed by name *and* by Keras' registered name (``package>Name``):
    a class registered with ``register_keras_serializable`` is saved under the latter, and its
    registration does not survive pickling to another process, so this runs on the driver."""
    objects = dict(custom_objects or {})
    for obj in list(objects.values()):
        try:
            objects.setdefault(keras.saving.get_registered_name(obj), obj)
        except Exception:  # not a class or function Keras can name
            pass
    return objects


def _load_model(data: bytes, custom_objects: Optional[Dict[str, Any]]) -> Any:
    keras = _keras()
    custom_objects = loading_objects(keras, custom_objects)
    with tempfile.TemporaryDirectory(prefix="sparktrain-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects or {}, compile=False)


class KerasEstimator(EstimatorBase):
    """Spark ML estimator training a Keras 3 model in ``num_proc`` barrier tasks.

    Params follow Horovod's ``horovod.spark.keras.KerasEstimator`` (``batch_size`` per worker,
    learning rate as given). ``optimizer``: a Keras optimizer or its name; ``loss``: a Keras
    loss, its name, or a function ``(y_true, y_pred) -> per-row values``; ``metrics``: names or
    functions ``(y_true, y_pred)``; ``custom_objects``: as for ``keras.saving.load_model``.
    ``backend="tensorflow"``: ``tf.distribute.MultiWorkerMirroredStrategy`` with a distributed
    train step of sparktrain's own (Keras 3's ``model.fit`` fails under it,
    keras-team/keras#20585), so any Keras 3 model trains unchanged. ``backend="tfos"``: the same
    loop on a TensorFlowOnSpark cluster (:mod:`sparktrain.launch.tfos`).
    """

    backends = KERAS_BACKENDS
    framework = "keras"
    custom_objects = Param(Params._dummy(), "custom_objects",
                           "custom layers/functions by name, for loading the model")

    @keyword_only
    def __init__(self, *, num_proc: Optional[int] = None, model: Any = None,
                 optimizer: Any = None, loss: Any = None, metrics: Optional[List[Any]] = None,
                 feature_cols: Optional[List[str]] = None, label_cols: Optional[List[str]] = None,
                 sample_weight_col: Optional[str] = None, validation: Any = None,
                 batch_size: Optional[int] = None, val_batch_size: Optional[int] = None,
                 epochs: Optional[int] = None, shuffle: Optional[bool] = None,
                 random_seed: Optional[int] = None, store: Any = None,
                 run_id: Optional[str] = None, verbose: Optional[int] = None,
                 callbacks: Optional[List[Any]] = None, custom_objects: Optional[Dict] = None,
                 backend: Optional[str] = None, use_gpu: Optional[bool] = None,
                 train_steps_per_epoch: Optional[int] = None,
                 validation_steps_per_epoch: Optional[int] = None,
                 transformation_fn: Optional[Callable] = None,
                 inmemory_cache_all: Optional[bool] = None,
                 backward_passes_per_step: Optional[int] = None,
                 scale_learning_rate: Optional[bool] = None,
                 mixed_precision: Optional[str] = None, max_time: Optional[float] = None,
                 max_attempts: Optional[int] = None) -> None:
        super().__init__()
        self._setDefault(backend="tensorflow", custom_objects={})
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    @keyword_only
    def setParams(self, **kwargs: Any) -> "KerasEstimator":
        """Set any of the constructor's params by keyword."""
        return self._set(**self._input_kwargs)

    def getCustomObjects(self) -> Dict[str, Any]:
        return self.getOrDefault(self.custom_objects)

    def _check_framework(self) -> None:
        keras = _keras()
        if not isinstance(self.getModel(), keras.Model):
            raise TypeError(f"model must be a keras.Model (Keras {keras.__version__}), got "
                            f"{type(self.getModel()).__name__}")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise TypeError(f"optimizer must be a keras optimizer or its name, got "
                            f"{type(optimizer).__name__}")
        loss = self.getLoss()
        if not (isinstance(loss, str) or callable(loss)):
            raise TypeError(f"loss must be a Keras loss, its name or a function, got {loss!r}")
        for callback in self.getCallbacks() or []:
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"callbacks must be keras.callbacks.Callback objects, got "
                                f"{type(callback).__name__}")
        if self.getBackwardPassesPerStep() != 1:
            raise ValueError("backward_passes_per_step is not supported by KerasEstimator; "
                             "Keras 3 optimizers accumulate gradients themselves: pass "
                             "gradient_accumulation_steps=N to the optimizer")
        if self.getMixedPrecision() is not None:
            raise ValueError("mixed_precision is not a KerasEstimator param: a Keras model "
                             "carries its dtype policy; build it under "
                             "keras.mixed_precision.set_dtype_policy('mixed_bfloat16')")

    def _payload(self) -> bytes:
        keras = _keras()
        optimizer, loss = self.getOptimizer(), self.getLoss()
        if isinstance(optimizer, keras.optimizers.Optimizer):
            optimizer = keras.optimizers.serialize(optimizer)
        if isinstance(loss, keras.losses.Loss):
            loss = keras.losses.serialize(loss)
        try:
            return dumps({"model": _model_bytes(self.getModel()), "optimizer": optimizer,
                          "loss": loss, "metrics": list(self.getMetrics() or []),
                          "custom_objects": loading_objects(keras, self.getCustomObjects()),
                          "callbacks": list(self.getCallbacks() or []),
                          "transformation_fn": self.getTransformationFn()})
        except Exception as exc:
            raise TypeError(f"model, loss, metrics, custom_objects, callbacks and "
                            f"transformation_fn must be saveable (.keras) and picklable to "
                            f"reach the executors: {exc}") from exc

    def _train(self, run: FitRun) -> Dict[str, Any]:
        data = run.data
        spec = {"dataset_root": data.root, "layouts": data.files,
                "columns": [c.to_json() for c in data.columns],
                "feature_cols": self.getFeatureCols(), "label_cols": self.getLabelCols(),
                "sample_weight_col": self.getSampleWeightCol(), "batch_size": self.getBatchSize(),
                "val_batch_size": self.getValBatchSize(), "epochs": self.getEpochs(),
                "shuffle": self.getShuffle(), "seed": self.getRandomSeed(),
                "verbose": self.getVerbose(), "backend": self.getBackend(),
                "storage_options": run.store.storage_options, **self._loop_options(run)}
        launch = dict(description=f"sparktrain KerasEstimator {self.uid}",
                      echo_logs=self.getVerbose() >= 1, on_progress=run.progress.update,
                      max_attempts=self.getMaxAttempts())
        backend = load_backend(KERAS_BACKENDS, self.getBackend())
        with run.shipped(self._payload()) as (payload, where):
            if getattr(backend, "launches_itself", False):  # tfos: starts its own cluster
                return backend.launch(run.spark, self.getNumProc(), spec, payload, run.use_gpu,
                                      **launch, **where)
            results = run_barrier(run.spark, self.getNumProc(),
                                  functools.partial(_keras_rank, spec, payload, run.use_gpu),
                                  **launch, **where)
        return results[0]

    def _check_session(self, spark: SparkSession) -> None:
        if self.getBackend() == "tfos":
            classic_only(spark, "backend='tfos' (TensorFlowOnSpark starts its reservation "
                         "server through the SparkContext)", "Use backend='tensorflow': the "
                         "same MultiWorkerMirroredStrategy training, launched through the "
                         "DataFrame API.")

    def _create_model(self, result: Dict[str, Any], data: MaterializedDataset) -> "KerasModel":
        model = KerasModel(result["model"], loading_objects(_keras(), self.getCustomObjects()))
        model._history = result["history"]
        model._columns = [c for c in data.columns if c.name in self.getFeatureCols()]
        model._output_shapes = result["output_shapes"]
        return model


def _keras_rank(spec: Dict[str, Any], payload: Any, use_gpu: bool, ctx: RankContext) -> Any:
    backend = load_backend(KERAS_BACKENDS, spec["backend"])
    return backend.run(ctx, spec, payload.value, use_gpu)


class KerasModel(ModelBase):
    """A trained Keras model as a Spark ML Model (see :class:`~.torch.TorchModel` for columns).

    Saved as Spark ML metadata + the native ``model.keras`` file + ``custom_objects.pkl``
    (cloudpickle: loading runs code, load only trusted models); ``custom_objects`` are used
    when the model is loaded, on the driver and on the executors.
    """

    def __init__(self, model_bytes: bytes = b"", custom_objects: Optional[Dict] = None) -> None:
        super().__init__()
        self._model_bytes = model_bytes
        self._custom_objects = dict(custom_objects or {})
        self._model: Any = None

    def getModel(self) -> Any:
        """The trained ``keras.Model`` (loaded on first use)."""
        if self._model is None:
            self._model = _load_model(self._model_bytes, self._custom_objects)
        return self._model

    def _framework_files(self) -> Dict[str, bytes]:
        return {"model.keras": self._model_bytes, "custom_objects.pkl": dumps(self._custom_objects)}

    @classmethod
    def _from_framework_files(cls, files: Dict[str, bytes]) -> "KerasModel":
        return cls(files["model.keras"], cloudpickle.loads(files["custom_objects.pkl"]))

    def _predict_fn_factory(self) -> Callable[[], Callable]:
        return functools.partial(_make_predictor, self._framework_files())


def _make_predictor(files: Dict[str, bytes]) -> Callable:
    """Executor side, once per Python worker: load the model and return ``predict``."""
    import numpy as np

    model = _load_model(files["model.keras"], cloudpickle.loads(files["custom_objects.pkl"]))

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        result = model(features if len(features) > 1 else features[0], training=False)
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    return predict
