"""Params of fine-tuning pretrained torch models (docs/huggingface.md): ``output_key`` (which
entry of a dict or ``ModelOutput`` result is the output, :mod:`sparktrain.loop.torch_forward`),
``lr_scheduler`` and ``lr_scheduler_interval`` (:mod:`sparktrain.loop.torch_schedule`).

Example::

    TorchEstimator(..., loss=None, output_key="logits",
                   lr_scheduler=lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, 500))
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from pyspark.ml.param import Param, Params, TypeConverters

#: when ``lr_scheduler`` steps
INTERVALS = ("step", "epoch")


class ForwardParams(Params):
    """``output_key``: the entry of a dict/``ModelOutput`` result that is the model's output."""

    output_key = Param(Params._dummy(), "output_key",
                       "when the model returns a dict or a Hugging Face ModelOutput, the entry "
                       "the loss, metrics and transform use (default 'logits')",
                       TypeConverters.toString)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(output_key=None)

    def getOutputKey(self) -> Optional[str]:
        return self.getOrDefault(self.output_key)


def _to_interval(value: Any) -> str:
    if value not in INTERVALS:
        raise TypeError(f"lr_scheduler_interval must be one of {list(INTERVALS)}, got {value!r}")
    return value


class SchedulerParams(Params):
    """``lr_scheduler`` and ``lr_scheduler_interval`` (see the module)."""

    lr_scheduler = Param(Params._dummy(), "lr_scheduler",
                         "a function optimizer -> torch.optim.lr_scheduler.LRScheduler, called "
                         "on every rank; stepped per optimizer step or per epoch "
                         "(lr_scheduler_interval) and kept in checkpoints")
    lr_scheduler_interval = Param(Params._dummy(), "lr_scheduler_interval",
                                  "'step' (default): step the scheduler after every optimizer "
                                  "step; 'epoch': after every epoch", _to_interval)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(lr_scheduler=None, lr_scheduler_interval="step")

    def getLrScheduler(self) -> Optional[Callable[[Any], Any]]:
        return self.getOrDefault(self.lr_scheduler)

    def getLrSchedulerInterval(self) -> str:
        return self.getOrDefault(self.lr_scheduler_interval)
