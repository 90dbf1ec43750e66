"""One pass of a torch rank over its batches: how a training step runs (:class:`StepRule`:
gradient accumulation, fp16 loss scaling, the strategy's hooks) and the epoch's loop
(:func:`run_epoch`: forward, loss, backward, the statistics summed, the checkpoint hook
inside the epoch), the statistics averaged over the ranks (:func:`averaged`). The rank's
set-up and its epochs: :mod:`sparktrain.loop.torch_loop`.

Example::

    sums, names, shapes = run_epoch(model, forward, batches, steps, to_tensors, compute_loss,
                                    metrics, label_cols, step_rule)
    averaged(dist, sums, names, "")          # {"loss": ..., "accuracy": ...}
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from sparktrain.faults import mark_user_error, user_code
from sparktrain.loop.epochs import InEpoch, StepReporter
from sparktrain.loop.torch_batch import Batches, LossComputer, as_outputs, match_label
from sparktrain.loop.torch_forward import ForwardRule
from sparktrain.loop.torch_schedule import Schedule
from sparktrain.strategies.torch_strategy import TorchStrategy


@dataclass
class StepRule:
    """How one training step runs: gradient accumulation and (fp16) loss scaling."""

    optimizer: Any
    strategy: Optional[TorchStrategy] = None  # controls gradient sync while accumulating
    passes: int = 1  # backward_passes_per_step
    scaler: Any = None  # torch.amp.GradScaler for fp16
    minibatch_fn: Any = None  # Horovod's train_minibatch_fn: owns backward and the steps
    keep_label_shapes: bool = False  # label_shapes given: transform_outputs keeps them
    schedule: Optional[Schedule] = None  # lr_scheduler, stepped after each optimizer step

    def minibatch(self, model: Any, features: List[torch.Tensor], labels: List[torch.Tensor],
                  weights: Optional[torch.Tensor], step: int, compute_loss: Any
                  ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """One training batch by the user's ``train_minibatch_fn`` (Horovod's signature and
        contract, see ``TorchEstimator``): forward, loss, backward and the optimizer's
        ``zero_grad``/``step`` at group boundaries are the function's."""
        def transform_outputs(outputs: Any, labels: List[torch.Tensor]) -> Tuple[List, List]:
            outputs = as_outputs(outputs)
            return outputs, [match_label(o, label, not self.keep_label_shapes)
                             for o, label in zip(outputs, labels, strict=True)]

        outputs, loss = self.minibatch_fn(model, self.optimizer, transform_outputs, compute_loss,
                                          features, labels, weights, self.passes, step)
        return as_outputs(outputs), loss

    def end_epoch(self) -> None:
        """With a ``train_minibatch_fn``, one more ``optimizer.step()`` after the epoch's last
        batch applies its last group's gradients (what Horovod's loop does)."""
        if self.minibatch_fn is not None:
            self.optimizer.step()

    def backward(self, model: Any, loss: torch.Tensor, step: int, steps: int) -> None:
        """Backward pass of ``step``; the optimizer steps after every ``passes`` batches (and
        after the last). Each group's gradient is the mean of its batches' gradients."""
        if self.minibatch_fn is not None:
            return  # the user's train_minibatch_fn ran backward already
        group_start = step - step % self.passes
        group = min(self.passes, steps - group_start)
        last = step + 1 == group_start + group
        scaled = loss / group if group > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        sync = contextlib.nullcontext() if last or self.strategy is None \
            else self.strategy.accumulating(model)
        with sync:
            scaled.backward()
        if last:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()  # set_to_none by default in torch 2; Horovod takes no args
            if self.schedule is not None:
                with user_code("lr_scheduler's step"):
                    self.schedule.after_step()


def run_epoch(model: torch.nn.Module, forward: ForwardRule, batches: Iterator[Dict], steps: int,
               to_tensors: Batches, compute_loss: LossComputer,
               metrics: List[Tuple[str, Callable]], label_cols: List[str],
               step_rule: Optional[StepRule] = None, autocast: Optional[torch.dtype] = None,
               reporter: Optional[StepReporter] = None, within: Optional[InEpoch] = None,
               order: Callable[[], Optional[str]] = lambda: None
               ) -> Tuple[torch.Tensor, List[str], List]:
    """One pass over ``steps`` batches (training when ``step_rule`` is given); returns summed
    ``[rows, loss*rows, metric*rows...]`` and the output shapes. ``within``: the epoch's
    position (``batches`` then start after ``within.skip`` of them) and its checkpoint hook,
    called after every optimizer step; ``order``: how the reader orders the epoch's rows."""
    training = step_rule is not None
    model.train(training)
    names = [f"{name}" if len(label_cols) == 1 else f"{label}_{name}"
             for label in label_cols for name, _ in metrics]
    sums = torch.zeros(2 + len(names), dtype=torch.float64, device=to_tensors.device)
    skip = within.skip if within is not None else 0
    if within is not None and within.partial and len(within.partial) == len(sums):
        sums += torch.tensor(within.partial, dtype=sums.dtype, device=sums.device)
    passes = step_rule.passes if step_rule is not None else 1
    shapes: List = []
    device = to_tensors.device
    casting = contextlib.nullcontext() if autocast is None \
        else torch.autocast(device_type=device.type, dtype=autocast)
    with torch.set_grad_enabled(training):
        for step, batch in enumerate(batches, start=skip):
            features, labels, weights = to_tensors(batch)
            loss = None
            with casting:
                if step_rule is not None and step_rule.minibatch_fn is not None:  # training
                    with user_code("train_minibatch_fn"):
                        outputs, loss = step_rule.minibatch(model, features, labels, weights,
                                                            step, compute_loss)
                else:
                    with user_code("the model's forward pass"):
                        result = forward.call(model, features, labels)
                    outputs = forward.outputs(result)
                    if forward.model_loss:
                        loss = forward.loss(result)
                if len(outputs) != len(labels):
                    raise mark_user_error(ValueError(
                        f"the model returned {len(outputs)} outputs for {len(labels)} label "
                        f"columns {label_cols}"), "the model's outputs")
                with user_code("the loss"):
                    labels = [match_label(o, label, not to_tensors.spec.label_shapes)
                              for o, label in zip(outputs, labels, strict=True)]
                    if loss is None:
                        loss = compute_loss(outputs, labels, weights)
            if step_rule is not None:  # training
                with user_code("the backward pass or the optimizer step"):
                    step_rule.backward(model, loss, step, steps)
            rows = features[0].shape[0]
            values = [loss.detach().float()]
            with torch.no_grad():
                for output, label in zip(outputs, labels, strict=True):
                    for name, fn in metrics:
                        with user_code(f"metric {name!r}"):
                            values.append(torch.as_tensor(fn(output.float(), label))
                                          .detach().float().mean())
            sums[0] += rows
            sums[1:] += torch.stack([v.to(sums.dtype) for v in values]) * rows
            shapes = [list(o.shape[1:]) for o in outputs]
            if reporter is not None and reporter.due(step):
                reporter.send(step, float(loss.detach()))
            if training and within is not None and (step + 1) % passes == 0 \
                    and step + 1 < steps:
                within.after_steps(step + 1, 1, lambda: sums.cpu().tolist(), order())
    if step_rule is not None:  # training
        with user_code("the optimizer step"):
            step_rule.end_epoch()
    return sums, names, shapes


def averaged(dist: Any, sums: torch.Tensor, names: List[str], prefix: str) -> Dict[str, float]:
    total = dist.all_reduce_sum(sums.clone()).cpu().tolist()
    rows = max(total[0], 1.0)
    result = {f"{prefix}loss": total[1] / rows}
    result.update({f"{prefix}{name}": value / rows
                   for name, value in zip(names, total[2:], strict=True)})
    return result
