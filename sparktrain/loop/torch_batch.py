"""A batch's tensors and its loss in the torch loop's conventions (the rank loop's module
docstring, :mod:`.torch_loop`): the rank's device, the features and labels as tensors, labels
matched to their outputs, the (weighted) total loss.

Shared by the rank loop and the driver's preflight (``TorchEstimator``), which builds the
tensors of one batch on the CPU.

Example::

    features, labels, weights = Batches(spec, torch.device("cpu"))(batch)
    outputs = [model(*features)]
    labels = [match_label(o, l) for o, l in zip(outputs, labels)]
    loss = LossComputer(torch.nn.MSELoss(), 1, weighted=False)(outputs, labels, weights)
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sparktrain.faults import mark_user_error
from sparktrain.launch.gpus import GpuUnavailableError, cuda_ordinal, fake_gpus, rank_gpu
from sparktrain.launch.rank_context import RankContext
from sparktrain.options.spec import TorchTrainSpec


def select_device(ctx: RankContext, use_gpu: bool) -> torch.device:
    """The GPU Spark assigned to this rank (by its ordinal, which stays right in a reused
    Python worker where CUDA is already initialised; ``cuda:0`` in a local rank's process,
    which sees only its own GPU), or the CPU; the CPU too for a rank given GPUs announced by
    tests (``SPARKTRAIN_FAKE_GPUS``). A GPU torch cannot use fails the fit at once
    (:class:`~sparktrain.launch.gpus.GpuUnavailableError`: a retry runs in the same
    environment)."""
    address = rank_gpu(ctx.resources, use_gpu)
    if address is None:
        return torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if fake_gpus():
        ctx.log(f"GPU {address} (CUDA_VISIBLE_DEVICES={visible}; SPARKTRAIN_FAKE_GPUS: "
                f"training on the CPU)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise mark_user_error(GpuUnavailableError(
            f"Spark assigned GPU {address} to rank {ctx.rank}, but torch {torch.__version__} "
            f"cannot use CUDA here; install a CUDA build of torch on the executors or pass "
            f"use_gpu=False"), "the executors' environment (the same on every attempt)")
    device = torch.device("cuda", cuda_ordinal(address, torch.cuda.device_count(),
                                               f"torch {torch.__version__}"))
    torch.cuda.set_device(device)
    ctx.log(f"GPU {address} as {device} (CUDA_VISIBLE_DEVICES={visible})")
    return device


def match_label(output: torch.Tensor, label: torch.Tensor, reshape: bool = True) -> torch.Tensor:
    """Bring ``label`` to the shape/dtype ``output``'s loss expects (see module docstring);
    ``reshape=False`` (``label_shapes`` given) keeps the label's shape."""
    if output.dim() >= 2 and output.shape[-1] > 1 and label.dim() == 1 \
            and label.shape[0] == output.shape[0]:
        return label.long()  # class indices for a (batch, classes) output
    if reshape and label.numel() == output.numel() and label.shape != output.shape:
        label = label.reshape(output.shape)
    if output.is_floating_point() and not label.is_floating_point() \
            and label.shape == output.shape:
        label = label.to(output.dtype)
    return label


class LossComputer:
    """Total loss over outputs/labels, optionally weighted per row."""

    def __init__(self, loss: Any, n_labels: int, weighted: bool,
                 loss_weights: Optional[Sequence[float]] = None) -> None:
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss] * n_labels
        if len(losses) != n_labels:
            raise ValueError(f"got {len(losses)} losses for {n_labels} label columns")
        if weighted:
            losses = [self._per_row(fn) for fn in losses]
        self.losses, self.weighted = losses, weighted
        self.loss_weights = list(loss_weights) if loss_weights else None  # Horovod's loss_weights

    @staticmethod
    def _per_row(fn: Any) -> Any:
        if isinstance(fn, torch.nn.Module) and hasattr(fn, "reduction"):
            fn = copy.copy(fn)
            fn.reduction = "none"
        return fn

    def __call__(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                 weights: Optional[torch.Tensor]) -> torch.Tensor:
        total: Any = 0  # a tensor once the first loss is added
        terms = zip(self.losses, outputs, labels, strict=True)
        for index, (fn, output, label) in enumerate(terms):
            value = fn(output, label)
            if self.weighted:
                if value.dim() == 0:
                    raise ValueError("with sample_weight_col the loss must return one value per "
                                     "row: use a torch.nn loss (its reduction is set to 'none') "
                                     "or a function returning shape (batch,)")
                per_row = value.reshape(value.shape[0], -1).mean(dim=1)
                # Keras' convention, mean over rows of w * loss (not / sum(w)): each rank's
                # gradient then adds up to the globally weighted one under DDP averaging.
                value = (per_row * weights).mean()
            if self.loss_weights is not None:
                value = value * self.loss_weights[index]
            total = total + value
        return total


class Batches:
    """Turns reader batches (numpy) into device tensors in the model's calling convention:
    features reshaped to ``spec.input_shapes`` (Horovod's param) when given, else 2-D; labels
    reshaped to ``spec.label_shapes`` when given."""

    def __init__(self, spec: TorchTrainSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def __call__(self, batch: Dict[str, np.ndarray]
                 ) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[torch.Tensor]]:
        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(batch[name]).to(self.device, non_blocking=True)

        spec = self.spec
        if spec.input_shapes:
            features = [_reshaped("input_shapes", c, tensor(c), shape)
                        for c, shape in zip(spec.feature_cols, spec.input_shapes, strict=True)]
        else:
            features = [as_2d(tensor(c)) for c in spec.feature_cols]
        labels = [tensor(c) for c in spec.label_cols]
        if spec.label_shapes:
            labels = [_reshaped("label_shapes", c, label, shape)
                      for c, label, shape in zip(spec.label_cols, labels, spec.label_shapes,
                                                 strict=True)]
        weights = tensor(self.spec.sample_weight_col) if self.spec.sample_weight_col else None
        return features, labels, weights


def _reshaped(param: str, column: str, t: torch.Tensor, shape: List[int]) -> torch.Tensor:
    """``t.reshape(shape)``, or an error naming the param, the column and the sizes."""
    try:
        return t.reshape(shape)
    except RuntimeError:
        per_row = t[0].numel() if t.dim() and t.shape[0] else 0
        raise ValueError(f"{param}: column {column!r} has {per_row} value(s) per row (a batch "
                         f"of {tuple(t.shape)}), which do not fit the shape {list(shape)}; "
                         f"change {param} or the column") from None


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """Scalar feature columns as ``(batch, 1)``."""
    return t if t.dim() > 1 else t.unsqueeze(1)


def as_outputs(result: Any) -> List[torch.Tensor]:
    """A model's result as a list of outputs."""
    return list(result) if isinstance(result, (list, tuple)) else [result]
