"""``TorchModel``: a trained torch module as a Spark ML Model, predicting from its weights file.

Importing this module does not import torch; predicting and loading do. Split from
:mod:`sparktrain.estimators.torch` (the estimator), which re-exports ``TorchModel``.

Example::

    model = TorchModel.load("/models/digits")     # a reference to model/weights.pt
    model.transform(test_df)                       # each Python worker maps the file once
"""
from __future__ import annotations

import copy
import functools
import io
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from sparktrain.data.store import Store
from sparktrain.estimators.model import ModelBase
from sparktrain.model_files import ModelFile
from sparktrain.options.params import TorchModelParams
from sparktrain.session.spark_api import master

# -- weights by reference (see torch_files) ---------------------------------------------------
#: a module built in the driver up to this size travels inside the prediction UDF; a larger
#: one is written to a file first (a fitted or loaded model is always read from its file)
INLINE_WEIGHTS_BYTES = 32 << 20


def _module_bytes(module: Any) -> Tuple[bytes, bytes]:
    """``(architecture pickle, torch.save bytes of the weights)`` of an in-memory module."""
    import torch

    from sparktrain.loop.torch_files import cpu_state, dumps_without_weights

    buffer = io.BytesIO()
    torch.save(cpu_state(module.state_dict()), buffer)
    return dumps_without_weights(module, module), buffer.getvalue()


class TorchModel(ModelBase, TorchModelParams):
    """A trained torch module as a Spark ML Model.

    ``transform`` appends one column per label (``<label>__output`` unless ``setOutputCols``):
    a double for single-value outputs, an array of doubles otherwise. Saved as Spark ML
    metadata (``input_shapes`` included) + ``architecture.pkl`` (cloudpickle, its tensors
    referring to the weights: loading runs code, load only trusted models) + ``weights.pt``
    (``torch.save`` of the state_dict, loaded with ``weights_only=True``).

    Weights travel by file (:mod:`sparktrain.loop.torch_files`): a fitted model's are in its
    store, a loaded one's in the saved directory; ``transform`` ships their path, and each
    Python worker maps the file once and keeps the module (re-fitted or re-saved files are never
    served stale).

    Horovod's constructor works too, e.g. to predict with a module trained elsewhere::

        TorchModel(model=net, feature_columns=["features"], label_columns=["label"],
                   input_shapes=[[-1, 1, 8, 8]]).setOutputCols(["label_prob"]).transform(df)

    ``getOptimizer()`` is the optimizer with its state after the last epoch (from the run's
    last checkpoint); ``optimizer``, ``loss`` and ``loss_constructors`` are not saved with the
    model. ``history``: a dict of per-epoch lists (or Horovod's list of per-epoch dicts).
    """

    def __init__(self, model: Any = None, *, history: Any = None,
                 feature_columns: Optional[List[str]] = None,
                 input_shapes: Optional[List[List[int]]] = None,
                 label_columns: Optional[List[str]] = None, optimizer: Any = None,
                 run_id: Optional[str] = None, _metadata: Any = None, loss: Any = None,
                 loss_constructors: Any = None,
                 predict_transformation_fn: Optional[Callable] = None,
                 output_key: Optional[str] = None) -> None:
        super().__init__()
        self._model = model
        self._files: Any = None  # ModuleFiles: the module as files in a store or saved directory
        self._spill_to: Optional[Tuple[str, Dict[str, Any]]] = None  # (directory, options)
        self._metadata = _metadata  # Horovod's column metadata: kept, not used
        given = dict(feature_cols=feature_columns, label_cols=label_columns, run_id=run_id,
                     input_shapes=input_shapes, optimizer=optimizer, loss=loss,
                     loss_constructors=loss_constructors,
                     predict_transformation_fn=predict_transformation_fn, output_key=output_key)
        self._set(**{k: v for k, v in given.items() if v is not None})
        if history is not None:
            self.setHistory(history)

    def getModel(self) -> Any:
        """The trained ``torch.nn.Module`` (in eval mode, on the CPU). A fitted or loaded model
        is read from its weights file on first use (memory-mapped), not before."""
        if self._model is None and self._files is not None:
            self._model, optimizer = self._files.load()
            if optimizer is not None and not self.isSet("optimizer"):
                self._set(optimizer=optimizer)
        return self._model

    def setModel(self, value: Any) -> "TorchModel":
        """Predict with another ``torch.nn.Module`` (same inputs and outputs)."""
        self._model = value
        self._files = None
        return self

    def getOptimizer(self) -> Any:
        """The optimizer bound to :meth:`getModel`'s module, with its state after the last
        epoch (from the run's last checkpoint); ``None`` for a model loaded from a save."""
        if not self.isSet("optimizer") and self._files is not None and \
                self._files.trainer is not None:
            self.getModel()
        return self.getOrDefault(self.optimizer)

    def _current_files(self) -> Any:
        """The :class:`~sparktrain.loop.torch_files.ModuleFiles` the module still equals, else
        ``None``."""
        if self._files is None or (self._model is not None
                                   and not self._files.unchanged(self._model)):
            return None
        return self._files

    def _framework_files(self) -> Dict[str, Any]:
        files = self._current_files()
        if files is not None:  # the weights file is streamed into the saved directory
            return {"architecture.pkl": files.architecture, "weights.pt": files.weights}
        architecture, weights = _module_bytes(self.getModel())
        return {"architecture.pkl": architecture, "weights.pt": weights}

    @classmethod
    def _from_framework_files(cls, files: Dict[str, ModelFile]) -> "TorchModel":
        from sparktrain.loop.torch_files import ModuleFiles

        model = cls()
        model._files = ModuleFiles(files["architecture.pkl"].read_bytes(), files["weights.pt"])
        return model

    def _transform(self, dataset: Any) -> Any:
        self._keep_in_file(dataset.sparkSession)
        return super()._transform(dataset)

    def _keep_in_file(self, spark: Any) -> None:
        """A module changed or built in the driver and larger than
        :data:`INLINE_WEIGHTS_BYTES` is written to a file for the executors to read: next to
        the fit's weights in its store, or in the default local store on a local master."""
        from sparktrain.loop.torch_files import ModuleFiles, tensor_bytes

        if self._current_files() is not None:
            return
        module = self.getModel()
        if module is None or tensor_bytes(module) <= INLINE_WEIGHTS_BYTES:
            return
        directory, options = self._spill_to or (None, None)
        if directory is None:
            if not master(spark).startswith("local"):
                raise ValueError(
                    f"this TorchModel's module ({tensor_bytes(module) >> 20} MiB) was built or "
                    f"changed in the driver, and the executors of master {master(spark)!r} "
                    f"cannot read the driver's disk: save it where they can read "
                    f"(model.write().save('hdfs:///...')) and predict with TorchModel.load of "
                    f"that path")
            directory = f"{Store.create(None).prefix}/models"
        self._files = ModuleFiles.written(module, f"{directory}/weights-{uuid.uuid4().hex[:12]}.pt",
                                          options)

    def _predict_fn_factory(self, portable: bool = False) -> Callable[[], Callable]:
        """The predictor factory: the weights by file reference (a few KiB) when the module
        still equals its file, else inside it (``portable``: always inside, e.g. an MLflow
        pyfunc that must not depend on the store)."""
        return functools.partial(_make_predictor, self.module_source(portable),
                                 self.getInputShapes(),
                                 self.getUseGpu(), list(self.getFeatureCols()),
                                 self.getOutputKey())

    def module_source(self, portable: bool = False) -> Tuple[Any, ...]:
        """What an executor loads the module from (:func:`load_source`): the weights by file
        reference (a few KiB) when the module still equals its file, else inside the tuple
        (``portable``: always inside)."""
        files = None if portable else self._current_files()
        if files is not None:
            return ("file", files.architecture, files.weights)
        return ("inline",) + _module_bytes(self.getModel())


def load_source(source: Tuple[Any, ...]) -> Any:
    """Executor side: the module from :meth:`TorchModel.module_source`'s tuple (a file's
    weights memory-mapped: Python workers on one host share its pages)."""
    import torch

    from sparktrain.loop.torch_files import load_module, load_weights

    kind, architecture, weights = source
    if kind == "file":
        state = load_weights(weights.local_path())
    else:
        state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    return load_module(architecture, state)


def use_task_cores() -> None:
    """torch's CPU threads in a Python worker: the task's cores. torch's default, every core
    of the machine, makes the tasks of one executor fight over them."""
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is not None:
        torch.set_num_threads(max(1, context.cpus()))


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


def _make_predictor(source: Tuple[Any, ...],
                    input_shapes: Optional[List[List[int]]] = None,
                    use_gpu: Optional[bool] = None, feature_names: Optional[List[str]] = None,
                    output_key: Optional[str] = None) -> Callable:
    """Executor side, once per Python worker: load the module (``source``: ``("file",
    architecture, ModelFile)`` or ``("inline", architecture, weights bytes)``) and return
    ``predict`` (features reshaped to ``input_shapes`` when given, as in training; the model
    called and its output picked by :class:`~sparktrain.loop.torch_forward.ForwardRule`) on the
    GPU Spark gave the task (see ``use_gpu``), chosen per call: a reused worker's later task may
    hold another."""
    import contextlib

    import numpy as np
    import torch

    from sparktrain.launch.gpus import task_gpu
    from sparktrain.loop.torch_forward import ForwardRule

    module = load_source(source)
    forward = ForwardRule.for_model(module, feature_names or [], output_key=output_key)
    placed = {torch.device("cpu"): module}  # the module on each device used so far
    use_task_cores()

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        device = predict_device(task_gpu(use_gpu))
        if device not in placed:
            placed[device] = copy.deepcopy(module).to(device)
        # Arrow's zero-copy arrays are read-only; torch warns on them and a module writing into
        # its input in place would write into Arrow's buffer: such an array is copied
        tensors = [torch.from_numpy(f if f.flags.writeable else f.copy()).to(device)
                   for f in features]
        if input_shapes:
            tensors = [t.reshape(shape) for t, shape in zip(tensors, input_shapes, strict=True)]
        # the current CUDA device too, for modules that make tensors on "cuda" themselves
        current = torch.cuda.device(device) if device.type == "cuda" \
            else contextlib.nullcontext()
        with torch.inference_mode(), current:
            result = forward.call(placed[device], tensors)
        return [o.detach().cpu().float().numpy() for o in forward.outputs(result)]

    return predict
