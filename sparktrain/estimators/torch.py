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
"""
from __future__ import annotations

import copy
import functools
import io
from typing import Any, Callable, Dict, List, Optional

import cloudpickle
from pyspark import keyword_only

from sparktrain.data.materialize import MaterializedDataset
from sparktrain.estimators.base import EstimatorBase, FitRun, ModelBase
from sparktrain.launch import TORCH_BACKENDS
from sparktrain.launch.barrier import RankContext, run_barrier
from sparktrain.pickling import dumps


class TorchEstimator(EstimatorBase):
    """Spark ML estimator training a ``torch.nn.Module`` in ``num_proc`` barrier tasks.

    Params follow Horovod's ``horovod.spark.torch.TorchEstimator``: ``batch_size`` is per
    process (the global batch is ``num_proc * batch_size``); the learning rate is used as given
    (no scaling by ``num_proc``). ``model`` is called as ``model(*features)`` with one tensor per
    feature column; ``metrics`` are functions ``(output, label) -> tensor``; ``callbacks`` are
    objects with ``on_epoch_end(epoch, logs) -> bool | None`` (``True`` stops training).
    ``backend`` is ``"torch"`` (``torch.distributed`` DDP: gloo on CPU, NCCL on GPU) or
    ``"horovod"`` (Horovod over Gloo, ``hvd.DistributedOptimizer``; see
    :mod:`sparktrain.launch.horovod_torch`).
    """

    backends = TORCH_BACKENDS
    framework = "torch"

    @keyword_only
    def __init__(self, *, num_proc: Optional[int] = None, model: Any = None,
                 optimizer: Any = None, loss: Any = None, metrics: Optional[List[Any]] = None,
                 feature_cols: Optional[List[str]] = None, label_cols: Optional[List[str]] = None,
                 sample_weight_col: Optional[str] = None, validation: Any = None,
                 batch_size: Optional[int] = None, val_batch_size: Optional[int] = None,
                 epochs: Optional[int] = None, shuffle: Optional[bool] = None,
                 random_seed: Optional[int] = None, store: Any = None,
                 run_id: Optional[str] = None, verbose: Optional[int] = None,
                 callbacks: Optional[List[Any]] = None, backend: Optional[str] = None,
                 use_gpu: Optional[bool] = None, train_steps_per_epoch: Optional[int] = None,
                 validation_steps_per_epoch: Optional[int] = None,
                 transformation_fn: Optional[Callable] = None,
                 inmemory_cache_all: Optional[bool] = None,
                 backward_passes_per_step: Optional[int] = None,
                 scale_learning_rate: Optional[bool] = None,
                 mixed_precision: Optional[str] = None, max_time: Optional[float] = None,
                 max_attempts: Optional[int] = None) -> None:
        super().__init__()
        self._setDefault(backend="torch")
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

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
        losses = self.getLoss() if isinstance(self.getLoss(), (list, tuple)) else [self.getLoss()]
        for fn in losses:
            if not callable(fn):
                raise TypeError(f"loss must be callable (e.g. torch.nn.MSELoss()), got {fn!r}")
        if len(losses) not in (1, len(self.getLabelCols())):
            raise ValueError(f"loss has {len(losses)} functions for {len(self.getLabelCols())} "
                             f"label columns; pass one, or one per label column")
        from sparktrain.estimators.torch_worker import named_metrics

        for name, fn in named_metrics(self.getMetrics()):
            if not callable(fn):
                raise TypeError(f"metric {name!r} is not callable; metrics are functions "
                                f"(output, label) -> tensor")
        for callback in self.getCallbacks() or []:
            if not any(hasattr(callback, hook) for hook in
                       ("on_train_begin", "on_epoch_end", "on_train_end")):
                raise TypeError(f"callback {callback!r} has none of on_train_begin, "
                                f"on_epoch_end, on_train_end (see sparktrain.callbacks)")
        if self.getMixedPrecision() == "fp16" and self.getBackend() == "horovod":
            raise ValueError("mixed_precision='fp16' is not supported with backend='horovod' "
                             "(its gradient all-reduce would need unscaling first); use 'bf16'")

    def _payload(self) -> bytes:
        try:
            return dumps((self.getModel(), self.getOptimizer(), self.getLoss(),
                          self.getMetrics(), self.getCallbacks(), self.getTransformationFn()))
        except Exception as exc:
            raise TypeError(f"model, optimizer, loss, metrics, callbacks and transformation_fn "
                            f"must be picklable with cloudpickle to reach the executors: "
                            f"{exc}") from exc

    def _train(self, run: FitRun) -> Dict[str, Any]:
        from sparktrain.estimators.torch_worker import TorchTrainSpec

        data = run.data
        spec = TorchTrainSpec(
            dataset_root=data.root, layouts=data.files,
            columns=[c.to_json() for c in data.columns], feature_cols=self.getFeatureCols(),
            label_cols=self.getLabelCols(), sample_weight_col=self.getSampleWeightCol(),
            batch_size=self.getBatchSize(), val_batch_size=self.getValBatchSize(),
            epochs=self.getEpochs(), shuffle=self.getShuffle(), seed=self.getRandomSeed(),
            backend=self.getBackend(), use_gpu=run.use_gpu, verbose=self.getVerbose(),
            storage_options=run.store.storage_options, **self._loop_options(run))
        with run.shipped(self._payload()) as (payload, where):
            results = run_barrier(run.spark, self.getNumProc(),
                                  functools.partial(_train_rank, spec, payload),
                                  description=f"sparktrain TorchEstimator {self.uid}",
                                  echo_logs=self.getVerbose() >= 1,
                                  on_progress=run.progress.update,
                                  max_attempts=self.getMaxAttempts(), **where)
        return results[0]

    def _create_model(self, result: Dict[str, Any], data: MaterializedDataset) -> "TorchModel":
        import torch

        module = copy.deepcopy(self.getModel())
        module.load_state_dict(torch.load(io.BytesIO(result["weights"]), weights_only=True))
        module.eval()
        model = TorchModel(module)
        model._history = result["history"]
        model._columns = [c for c in data.columns if c.name in self.getFeatureCols()]
        model._output_shapes = result["output_shapes"]
        return model


def _train_rank(spec: Any, payload: Any, ctx: RankContext) -> Any:
    from sparktrain.estimators.torch_worker import train

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


class TorchModel(ModelBase):
    """A trained torch module as a Spark ML Model.

    ``transform`` appends one column per label (``<label>__output`` unless ``setOutputCols``):
    a double for single-value outputs, an array of doubles otherwise. Saved as Spark ML
    metadata + ``architecture.pkl`` (cloudpickle: loading runs code, load only trusted models)
    + ``weights.pt`` (``torch.save`` of the state_dict, loaded with ``weights_only=True``).
    """

    def __init__(self, model: Any = None) -> None:
        super().__init__()
        self._model = model

    def getModel(self) -> Any:
        """The trained ``torch.nn.Module`` (in eval mode, on the CPU)."""
        return self._model

    def _framework_files(self) -> Dict[str, bytes]:
        return {"architecture.pkl": _architecture_bytes(self._model),
                "weights.pt": _weights_bytes(self._model)}

    @classmethod
    def _from_framework_files(cls, files: Dict[str, bytes]) -> "TorchModel":
        return cls(_load_module(files["architecture.pkl"], files["weights.pt"]))

    def _predict_fn_factory(self) -> Callable[[], Callable]:
        return functools.partial(_make_predictor, self._framework_files())


def _make_predictor(files: Dict[str, bytes]) -> Callable:
    """Executor side, once per Python worker: load the module and return ``predict``."""
    import numpy as np
    import torch
    from pyspark import TaskContext

    module = _load_module(files["architecture.pkl"], files["weights.pt"])
    context = TaskContext.get()
    if context is not None:
        torch.set_num_threads(max(1, context.cpus()))

    def predict(features: List[np.ndarray]) -> List[np.ndarray]:
        with torch.inference_mode():
            result = module(*[torch.from_numpy(f) for f in features])
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        return [o.detach().cpu().float().numpy() for o in outputs]

    return predict
