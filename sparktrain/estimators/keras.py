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

Horovod's ``horovod.spark.keras`` API works unchanged (``import sparktrain.estimators.keras as
hvd``); see "Coming from Horovod" in the README.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type, cast

import cloudpickle
from pyspark import keyword_only
from pyspark.sql import SparkSession

from sparktrain.data.sources.choose import check_streamable
from sparktrain.data.sources.contract import RowSource
from sparktrain.data.transform_stage import BatchFeed
from sparktrain.estimators.base import EstimatorBase
from sparktrain.estimators.fit_run import FitRun
from sparktrain.estimators.model import ModelBase
from sparktrain.launch import KERAS_BACKENDS, backends_with, load_backend
from sparktrain.launch.elastic import for_rank
from sparktrain.launch.environment import rank_environment
from sparktrain.launch.rank_context import RankContext
from sparktrain.loop.keras_inputs import in_feature_order, keras_inputs
from sparktrain.loop.keras_saving import keras_module as _keras
from sparktrain.loop.keras_saving import load_model as _load_model
from sparktrain.loop.keras_saving import loading_objects, model_shapes
from sparktrain.loop.keras_saving import model_bytes as _model_bytes
from sparktrain.model_files import ModelFile
from sparktrain.options import horovod as horovod_params
from sparktrain.options.declarations import COMMON, KERAS
from sparktrain.options.keywords import keyword_params
from sparktrain.options.params import KerasParams
from sparktrain.options.payload import KerasPayload
from sparktrain.options.spec import KerasTrainSpec
from sparktrain.pickling import dumps
from sparktrain.session.spark_api import classic_only
from sparktrain.strategies import KERAS_STRATEGIES, load_strategy

if TYPE_CHECKING:
    from sparktrain.launch.engine import KerasEngine
    from sparktrain.strategies.keras_strategy import KerasStrategy

__all__ = ["KerasEstimator", "KerasModel", "loading_objects", "model_shapes", "predict_device"]

#: KerasEstimator params that belong to a strategy (KerasStrategy.params says which takes them)
STRATEGY_PARAMS = ("num_ps",)


class KerasEstimator(EstimatorBase, KerasParams):
    """Spark ML estimator training a Keras 3 model in ``num_proc`` barrier tasks.

    Params follow Horovod's ``horovod.spark.keras.KerasEstimator`` (``batch_size`` per worker;
    learning rate as given, where Horovod multiplies it by ``num_proc``:
    ``scale_learning_rate=True``). ``optimizer``: a Keras optimizer or its name; ``loss``: a Keras
    loss, its name, or a function ``(y_true, y_pred) -> per-row values``; ``metrics``: names or
    functions ``(y_true, y_pred)``; ``custom_objects``: as for ``keras.saving.load_model``.
    ``backend``: a registered :class:`~sparktrain.launch.engine.KerasEngine`;
    ``'tensorflow'``: ``tf.distribute.MultiWorkerMirroredStrategy`` with a distributed
    train step of sparktrain's own (Keras 3's ``model.fit`` fails under it,
    keras-team/keras#20585), so any Keras 3 model trains unchanged; ``'tfos'``: the same
    loop on a TensorFlowOnSpark cluster (:mod:`sparktrain.launch.tfos`).
    ``strategy``: a registered :class:`~sparktrain.strategies.keras_strategy.KerasStrategy`;
    ``'parameter_server'`` with ``num_ps`` (``backend='tensorflow'``):
    ``tf.distribute.ParameterServerStrategy``, ``num_ps`` tasks hold the variables, task 0
    coordinates, the others train asynchronously (:mod:`sparktrain.strategies.keras_ps`).

    Horovod's params (all of ``horovod.spark.keras.KerasEstimator``'s are taken): each feature
    is reshaped to the model's input shape (as Horovod does), and each label to
    ``label_shapes`` when given; ``loss_weights`` weight each output's loss; ``optimizer`` may
    be left out for a compiled model (its optimizer is used); ``checkpoint_callback`` (a
    ``keras.callbacks.ModelCheckpoint``): with ``save_best_only=True`` the fitted model is the
    best epoch's by its ``monitor`` and ``mode`` (see
    :mod:`sparktrain.loop.keras_checkpoint`); ``backend_env`` is set in every worker
    process; ``gradient_compression`` has no equivalent under MultiWorkerMirroredStrategy
    (warned); Petastorm's reader params: :mod:`sparktrain.options.horovod`.
    """

    backends = KERAS_BACKENDS
    framework = "keras"
    options = COMMON + KERAS

    @keyword_params(options)
    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(backend="tensorflow")
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    @keyword_only
    def setParams(self, **kwargs: Any) -> "KerasEstimator":
        """Set any of the constructor's params by keyword."""
        return self._set(**self._input_kwargs)

    def get_model_class(self) -> type:
        """The class of the model ``fit`` returns (Horovod's ``get_model_class``)."""
        return KerasModel

    def get_model_shapes(self) -> Tuple[Optional[List[List[int]]], Optional[List[List[int]]]]:
        """``(input shapes, output shapes)`` of ``model``, ``-1`` for unknown dimensions."""
        return model_shapes(self.getModel())

    def _built_elsewhere(self, name: str) -> bool:
        return name == "optimizer" and getattr(self.getModel(), "optimizer", None) is not None

    def _input_shapes(self) -> Optional[List[List[int]]]:
        """The shapes features are fed in, one per feature column: the model's input shapes (as
        Horovod feeds them; matched by name for inputs named as the columns,
        :mod:`.keras_inputs`), ``None`` when the model's inputs are unknown or of variable size."""
        input_shapes, _ = self.get_model_shapes()
        if input_shapes is not None:
            input_shapes = in_feature_order(self.getModel(), self.getFeatureCols(), input_shapes)
        if input_shapes is not None and len(input_shapes) != len(self.getFeatureCols()):
            raise ValueError(f"the model has {len(input_shapes)} input(s) for "
                             f"{len(self.getFeatureCols())} feature column(s) "
                             f"{self.getFeatureCols()}; give one feature column per input")
        if input_shapes is None or any(-1 in shape[1:] for shape in input_shapes):
            return None
        return [[-1] + shape[1:] for shape in input_shapes]  # any batch size

    def _optimizer(self) -> Any:
        """``optimizer``, or the compiled model's (Horovod's fallback)."""
        optimizer = self.getOptimizer()
        return optimizer if optimizer is not None else getattr(self.getModel(), "optimizer", None)

    def _check_framework(self) -> None:
        keras = _keras()
        if not isinstance(self.getModel(), keras.Model):
            raise TypeError(f"model must be a keras.Model (Keras {keras.__version__}), got "
                            f"{type(self.getModel()).__name__}")
        horovod_params.check_common(self)
        check_streamable(self.getInputMode(), self._engine().streams_rows and
                         self._strategy_class().trains_on_own_rows,
                         f"backend={self.getBackend()!r} and strategy={self.getStrategy()!r}")
        from sparktrain.loop.keras_checkpoint import checkpoint_settings

        checkpoint_settings(self.getCheckpointCallback(), self.getValidation())
        optimizer = self._optimizer()
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
        self._check_strategy()

    def _strategy_class(self) -> Type[KerasStrategy]:
        # registered strategies subclass KerasStrategy (register_keras_strategy)
        return cast("Type[KerasStrategy]", load_strategy(KERAS_STRATEGIES, self.getStrategy()))

    def _engine(self) -> Type[KerasEngine]:
        """The class of the engine registered as ``backend`` (a
        :class:`~sparktrain.launch.engine.KerasEngine`)."""
        return load_backend(KERAS_BACKENDS, self.getBackend())

    def _check_strategy(self) -> Dict[str, Any]:
        """``strategy``, its params, ``num_proc``, ``min_num_proc`` and ``backend`` fit
        together (the strategy class says); the options the ranks get."""
        strategy, engine = self._strategy_class(), self._engine()
        if self.elastic_plan().elastic:
            if not engine.elastic:
                wanted = " or ".join(repr(b) for b in backends_with(KERAS_BACKENDS, "elastic"))
                raise ValueError(f"min_num_proc < num_proc (elastic training) needs "
                                 f"backend={wanted}: {engine.not_elastic_note}")
            if not strategy.elastic:
                raise ValueError(f"min_num_proc < num_proc (elastic training) is not "
                                 f"available with strategy={self.getStrategy()!r}: "
                                 f"{strategy.not_elastic_note}")
        return strategy.check(
            self.getStrategy(), self.getBackend(), self.getNumProc(),
            {name: self.getOrDefault(name) for name in STRATEGY_PARAMS})

    def _payload(self) -> bytes:
        keras = _keras()
        optimizer, loss = self._optimizer(), self.getLoss()
        if isinstance(optimizer, keras.optimizers.Optimizer):
            optimizer = keras.optimizers.serialize(optimizer)
        if isinstance(loss, keras.losses.Loss):
            loss = keras.losses.serialize(loss)
        try:
            return KerasPayload(
                model=_model_bytes(self.getModel()), optimizer=optimizer, loss=loss,
                metrics=list(self.getMetrics() or []),
                custom_objects=loading_objects(keras, self.getCustomObjects()),
                callbacks=list(self.getCallbacks() or []),
                transformation_fn=self.getTransformationFn(),
                strategy=self._strategy_class()).dumps()
        except Exception as exc:
            raise TypeError(f"model, loss, metrics, custom_objects, callbacks and "
                            f"transformation_fn must be saveable (.keras) and picklable to "
                            f"reach the executors: {exc}") from exc

    def _train(self, run: FitRun) -> Dict[str, Any]:
        from sparktrain.loop.keras_checkpoint import checkpoint_settings

        input_shapes = self._input_shapes()
        horovod_params.check_data_shapes(self, run.data.columns, input_shapes,
                                         "the model's input shapes")
        ignored = []
        if horovod_params.compression_name(self.getGradientCompression()) is not None:
            ignored.append("gradient_compression: tf.distribute.MultiWorkerMirroredStrategy's "
                           "all-reduce takes no compression; gradients travel in their own "
                           "dtype")
        callback = self.getCheckpointCallback()
        if callback is not None and getattr(callback, "save_freq", "epoch") != "epoch":
            ignored.append("checkpoint_callback.save_freq: the best model is chosen at epoch "
                           "ends")
        spec = KerasTrainSpec(
            **self._spec_fields(run), input_shapes=input_shapes,
            best_model=checkpoint_settings(callback, self.getValidation()),
            strategy_options=self._check_strategy())
        horovod_params.warn_ignored(self, ignored)
        launch = dict(description=f"sparktrain KerasEstimator {self.uid}",
                      echo_logs=self.getVerbose() >= 1, max_attempts=self.getMaxAttempts())
        engine = self._engine()
        with run.shipped(self._payload()) as (payload, where):
            if engine.launches_itself:  # starts its own cluster around the Spark job
                return engine.launch(run.spark, self.getNumProc(), spec, payload, run.use_gpu,
                                     on_progress=run.progress.update, **launch, **where,
                                     **run.stage())
            # the classes travel pickled: an engine or strategy registered only here works
            task = functools.partial(_keras_rank, spec, dumps((engine, self._strategy_class())),
                                     payload, run.use_gpu)
            results = run.launch(task, **launch, **where)
        return results[0]

    def _check_session(self, spark: SparkSession) -> None:
        engine = self._engine()
        if engine.needs_classic_session:
            classic_only(spark, f"backend={self.getBackend()!r} "
                         f"({engine.classic_session_note})", "Use backend='tensorflow': the "
                         "same MultiWorkerMirroredStrategy training, launched through the "
                         "DataFrame API.")

    def _check_on_batch(self, batch: Dict[str, Any]) -> None:
        """Preflight (see :mod:`.preflight`): the user's model in inference mode, the loss and
        the metrics on ``batch``, as the train step computes them."""
        import tensorflow as tf

        from sparktrain.estimators import preflight
        from sparktrain.faults import user_code
        from sparktrain.loop.keras_batch import (
            batch_tensors,
            forward_stats,
            per_row_loss,
            resolve_metrics,
        )

        keras, model = _keras(), self.getModel()
        features, labels = self.getFeatureCols(), self.getLabelCols()
        columns = preflight.describe_columns(batch, features, labels)
        tensors = ""
        try:
            transform = preflight.detached(self.getTransformationFn())
            names = list(features) + list(labels) + \
                ([self.getSampleWeightCol()] if self.getSampleWeightCol() else [])
            batch = next(BatchFeed(transform, names)([dict(batch)]))
            loss = self.getLoss()
            with user_code("the loss"):
                loss_fn = per_row_loss(keras, keras.losses.serialize(loss)
                                       if isinstance(loss, keras.losses.Loss) else loss)
            with user_code("the metrics"):
                metrics = resolve_metrics(keras, list(self.getMetrics() or []),
                                           loading_objects(keras, self.getCustomObjects()))
            x, y, w = batch_tensors(tf, batch, features, labels, self.getSampleWeightCol(),
                                    self._input_shapes(), self.getLabelShapes())
            tensors = ", ".join(str(tuple(t.shape)) for t in x)
            with user_code("the model, the loss or the metrics"):
                forward_stats(tf, model, loss_fn, metrics, x, y, w, False, self.getLossWeights(),
                              bool(self.getLabelShapes()), features)
        except Exception as exc:
            raise preflight.failure(exc, "the model (inference mode), the loss and the metrics",
                                    columns, tensors, preflight.keras_expectation(model)) from exc

    def _create_model(self, result: Dict[str, Any], data: RowSource) -> "KerasModel":
        model = KerasModel(result["model"], loading_objects(_keras(), self.getCustomObjects()))
        model._history = result["history"]
        model._columns = self._prediction_columns(data)
        model._output_shapes = result["output_shapes"]
        return model


def _keras_rank(spec: KerasTrainSpec, classes: bytes, payload: Any, use_gpu: bool,
                ctx: RankContext) -> Any:
    """Executor side: this barrier task's part of the fit. ``classes``: the pickled
    ``(KerasEngine, KerasStrategy)`` classes (the strategy decides the task's role in the
    TensorFlow cluster); ``payload``: the stored :class:`KerasPayload`, handed unread to the
    engine (its objects are unpickled in the TensorFlow process)."""
    engine, strategy = cloudpickle.loads(classes)
    with rank_environment(spec.backend_env):  # the Keras worker process inherits it
        return engine.run(ctx, for_rank(spec, ctx), payload.value, use_gpu, strategy)


class KerasModel(ModelBase):
    """A trained Keras model as a Spark ML Model (see :class:`~.torch.TorchModel` for columns).

    Saved as Spark ML metadata + the native ``model.keras`` file + ``custom_objects.pkl``
    (cloudpickle: loading runs code, load only trusted models); ``custom_objects`` are used
    when the model is loaded, on the driver and on the executors. Features are reshaped to
    the model's input shapes, as in training.

    Horovod's constructor works too: ``KerasModel(model=keras_model, feature_columns=[...],
    label_columns=[...], custom_objects={...})`` (``_floatx`` and ``_metadata`` are accepted
    and not used: a Keras 3 model carries its dtype policy).
    """

    def __init__(self, model_bytes: Any = b"", custom_objects: Optional[Dict] = None, *,
                 model: Any = None, history: Any = None,
                 feature_columns: Optional[List[str]] = None,
                 label_columns: Optional[List[str]] = None, run_id: Optional[str] = None,
                 _metadata: Any = None, _floatx: Optional[str] = None,
                 predict_transformation_fn: Optional[Callable] = None) -> None:
        super().__init__()
        if model is None and not isinstance(model_bytes, (bytes, bytearray, ModelFile)):
            model, model_bytes = model_bytes, b""  # KerasModel(keras_model)
        # the .keras file: bytes of a model built in the driver, or a reference to the file
        # a fit wrote into its store or a save into its directory (read where it is used)
        self._model_file: Any = _model_bytes(model) if model is not None else \
            model_bytes if isinstance(model_bytes, ModelFile) else bytes(model_bytes)
        self._custom_objects = dict(custom_objects or {})
        self._model: Any = model
        self._metadata, self._floatx = _metadata, _floatx  # Horovod's: kept, not used
        given = dict(feature_cols=feature_columns, label_cols=label_columns, run_id=run_id,
                     predict_transformation_fn=predict_transformation_fn)
        self._set(**{k: v for k, v in given.items() if v is not None})
        if history is not None:
            self.setHistory(history)

    def getModel(self) -> Any:
        """The trained ``keras.Model`` (loaded on first use)."""
        if self._model is None:
            self._model = _load_model(self._model_file, self._custom_objects)
        return self._model

    def setModel(self, value: Any) -> "KerasModel":
        """Predict with another ``keras.Model`` (same inputs and outputs)."""
        self._model_file, self._model = _model_bytes(value), value
        return self

    def getCustomObjects(self) -> Dict[str, Any]:
        return dict(self._custom_objects)

    def setCustomObjects(self, value: Optional[Dict[str, Any]]) -> "KerasModel":
        self._custom_objects = dict(value or {})
        return self

    def _framework_files(self) -> Dict[str, Any]:
        return {"model.keras": self._model_file, "custom_objects.pkl": dumps(self._custom_objects)}

    @classmethod
    def _from_framework_files(cls, files: Dict[str, ModelFile]) -> "KerasModel":
        return cls(files["model.keras"],
                   cloudpickle.loads(files["custom_objects.pkl"].read_bytes()))

    def _predict_fn_factory(self, portable: bool = False) -> Callable[[], Callable]:
        """The predictor factory; the ``.keras`` file by reference (a few KiB) unless
        ``portable`` (then its bytes: e.g. an MLflow pyfunc independent of the store)."""
        features = self.getFeatureCols() if self.isDefined(self.feature_cols) else []
        files = self._framework_files()
        if portable and isinstance(files["model.keras"], ModelFile):
            files["model.keras"] = files["model.keras"].read_bytes()
        return functools.partial(_make_predictor, files, self.getUseGpu(), list(features))


def predict_device(tf: Any, address: Optional[str]) -> str:
    """The TensorFlow device name to predict on for the task's GPU ``address`` (``None``:
    ``/CPU:0``); a ``RuntimeError`` when TensorFlow cannot use that GPU.

    TensorFlow names the GPUs it sees ``/GPU:0``, ``/GPU:1``, ... in CUDA's order, so the
    address (a CUDA ordinal, as torch's ``cuda:<address>``) is the index. Training runs in a
    child process that sees only its GPU (``CUDA_VISIBLE_DEVICES``); prediction runs in the
    Python worker, which may already have started TensorFlow, so it picks the device instead.
    """
    from sparktrain.launch.gpus import cuda_ordinal

    if address is None:
        return "/CPU:0"
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise RuntimeError(f"Spark assigned GPU {address} to this prediction task, but "
                           f"TensorFlow {tf.__version__} sees no GPU here; install TensorFlow "
                           f"with CUDA on the executors (pip install 'tensorflow[and-cuda]'), "
                           f"or call setUseGpu(False) on the model to predict on the CPU")
    return f"/GPU:{cuda_ordinal(address, len(gpus), 'TensorFlow')}"


def _grow_gpu_memory(tf: Any) -> None:
    """Let TensorFlow take GPU memory as needed instead of nearly all of every visible GPU
    when it starts (its default; tensorflow.org/guide/gpu, "Limiting GPU memory growth"): the
    Python workers of an executor share its GPUs. Only possible before TensorFlow has
    initialised its GPUs in this process."""
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except (RuntimeError, ValueError):  # already initialised: leave it as it is
            pass


def _make_predictor(files: Dict[str, bytes], use_gpu: Optional[bool] = None,
                    feature_cols: Optional[List[str]] = None) -> Callable:
    """Executor side, once per Python worker: return ``predict``, which runs the model on the
    GPU Spark gave the task (see ``use_gpu``), chosen per call (a reused worker's later task
    may hold another GPU); the model is loaded once per device, its weights placed there.
    ``feature_cols``: the columns of the features ``predict`` gets, fed by name to a model whose
    inputs bear their names (:mod:`.keras_inputs`), as in training."""
    import numpy as np

    from sparktrain.launch.gpus import task_gpu

    _keras()
    import tensorflow as tf

    _grow_gpu_memory(tf)
    custom_objects = cloudpickle.loads(files["custom_objects.pkl"])
    loaded: Dict[str, Any] = {}  # device name -> the model with its variables there

    def model_on(device: str) -> Any:
        if device not in loaded:
            with tf.device(device):  # variables are created on the scope's device
                loaded[device] = _load_model(files["model.keras"], custom_objects)
        return loaded[device]

    first = model_on(predict_device(tf, task_gpu(use_gpu)))
    columns = list(feature_cols or [])
    shapes, _ = model_shapes(first)
    if shapes is not None:
        shapes = in_feature_order(first, columns, shapes)
    if shapes is not None and any(-1 in shape[1:] for shape in shapes):
        shapes = None  # inputs of variable size: fed as they come

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        device = predict_device(tf, task_gpu(use_gpu))
        if shapes is not None:  # as in training: each feature in its input's shape
            features = [f.reshape([-1] + s[1:]) for f, s in zip(features, shapes, strict=True)]
        with tf.device(device):
            model = model_on(device)
            result = model(keras_inputs(model, columns, features), training=False)
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    return predict
