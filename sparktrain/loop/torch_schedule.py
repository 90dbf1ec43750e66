"""Learning-rate schedules: ``lr_scheduler`` built on every rank, stepped, checkpointed, resumed.

``lr_scheduler`` is a function ``optimizer -> torch.optim.lr_scheduler.LRScheduler``, called on
each rank with the optimizer that trains there (after ``scale_learning_rate`` multiplied the
learning rate by ``num_proc * backward_passes_per_step``: the schedule then shapes the scaled
rate, as Horovod's examples warm up towards it). ``lr_scheduler_interval``:

* ``"step"`` (default, what fine-tuning recipes and ``transformers.Trainer`` do):
  ``scheduler.step()`` after every optimizer step, i.e. every ``backward_passes_per_step``
  batches; a schedule's length is then ``epochs * steps_per_epoch / backward_passes_per_step``.
* ``"epoch"``: after every epoch (``StepLR``, ``CosineAnnealingLR(T_max=epochs)``...).

The scheduler's state is in every checkpoint, and a resumed fit (a retried attempt, or the same
``run_id``) goes on from the step it had reached, at the learning rate it had reached.

Importing this module does not import torch.

Example::

    def warm_up_then_decay(optimizer):
        total = epochs * steps_per_epoch
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / 100, max(0.0, (total - step) / total)))

    TorchEstimator(..., lr_scheduler=warm_up_then_decay)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from sparktrain.faults import mark_user_error, user_code


def check_scheduler(factory: Any, has_minibatch_fn: bool) -> None:
    """Driver-side checks of ``lr_scheduler`` (before any job)."""
    if factory is None:
        return
    if not callable(factory):
        raise TypeError(f"lr_scheduler must be a function optimizer -> LRScheduler (e.g. "
                        f"lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)), got "
                        f"{type(factory).__name__}")
    if has_minibatch_fn:
        raise ValueError("lr_scheduler cannot step with train_minibatch_fn (the function "
                         "makes the optimizer steps): step a scheduler in it instead")


class Schedule:
    """One rank's scheduler: :meth:`after_step` / :meth:`after_epoch` step it by its
    interval; :meth:`state_dict` / :meth:`restore` carry it through checkpoints."""

    def __init__(self, scheduler: Any, interval: str) -> None:
        self.scheduler, self.interval = scheduler, interval

    @classmethod
    def build(cls, factory: Optional[Callable], optimizer: Any, interval: str
              ) -> Optional["Schedule"]:
        """The rank's schedule, or ``None`` without ``lr_scheduler``."""
        if factory is None:
            return None
        import torch

        with user_code("lr_scheduler"):
            scheduler = factory(optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise mark_user_error(TypeError(
                f"lr_scheduler returned a {type(scheduler).__name__}; expected a "
                f"torch.optim.lr_scheduler.LRScheduler built on the optimizer it was given"),
                "lr_scheduler")
        return cls(scheduler, interval)

    def after_step(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def after_epoch(self) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def restore(self, state: Dict[str, Any]) -> None:
        """Go on from a checkpoint's scheduler state, at the learning rate it had reached (a
        new scheduler has just set its step-0 rate, e.g. the start of a warm-up)."""
        self.scheduler.load_state_dict(state)
        groups = self.scheduler.optimizer.param_groups
        for group, lr in zip(groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
