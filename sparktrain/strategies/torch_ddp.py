"""``strategy="ddp"``: the whole model on every rank, gradients averaged every step.

The engine wraps the model (``torch``: ``DistributedDataParallel``; ``horovod``: Horovod's
``DistributedOptimizer``, see :mod:`sparktrain.launch`); rank 0's copy is the state that is
checkpointed and returned.

Example (executor side)::

    replicated = DataParallel(dist, device, StrategyConfig())
    model, optimizer = replicated.setup(model, optimizer)
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Optional, Tuple

import torch

from sparktrain.strategies.torch_strategy import TorchStrategy


class DataParallel(TorchStrategy):
    """Replicated data parallel training on either engine."""

    def setup(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        model.to(self.device)
        for state in optimizer.state.values():  # optimizer state (e.g. Adam moments) follows
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(self.device)
        compression = self.config.gradient_compression
        return self.dist.wrap(model, optimizer,
                              backward_passes_per_step=self.config.backward_passes_per_step,
                              broadcast=not self.config.same_weights_everywhere,
                              **({"compression": compression} if compression else {}))

    def accumulating(self, module: torch.nn.Module) -> ContextManager:
        """DDP all-reduces gradients in backward: skip that until the group's last batch
        (``DistributedDataParallel.no_sync``). Horovod's optimizer counts the passes itself."""
        no_sync = getattr(module, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def full_state(self, module: torch.nn.Module, optimizer: Any = None
                   ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
        if self.rank != 0:
            return {}, None
        # ``module`` is the model as the user built it (never the engine's wrapper), so the
        # state_dict keys are the user's
        weights = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        return weights, optimizer.state_dict() if optimizer is not None else None
