"""What a torch strategy is: how every rank holds the model and applies its gradients.

A strategy is a subclass of :class:`TorchStrategy`, registered by name in
:data:`sparktrain.strategies.TORCH_STRATEGIES`. The estimator calls :meth:`TorchStrategy.check`
on the driver before anything launches; each rank builds one instance and the training loop
calls the rest (it never asks which strategy it runs). Modelled on Lightning Fabric's
``Strategy`` (``setup_module``/``setup_optimizer``, its backward-sync control and the
precision plug-in owning the gradient scaler), reduced to what sparktrain's loop needs.

Example (a strategy of your own; ``tests/test_strategy_plugin.py`` fits with one)::

    class CompressedDataParallel(DataParallel):
        def setup(self, model, optimizer):
            model, optimizer = super().setup(model, optimizer)
            model.register_comm_hook(None, my_hook)   # a DDP module with 2+ ranks
            return model, optimizer

    register_torch_strategy("ddp_compressed", CompressedDataParallel)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Dict, Optional, Tuple

import torch

from sparktrain.launch import TORCH_BACKENDS
from sparktrain.strategies import check_engine


@dataclass
class StrategyConfig:
    """What a rank's strategy is given besides the engine and the device."""

    mixed_precision: Optional[torch.dtype] = None  # autocast dtype: bfloat16/float16 or None
    gradient_compression: Optional[str] = None  # "fp16" (Horovod's Compression.fp16) or None
    backward_passes_per_step: int = 1
    # Every rank loaded the same weights (one file in the store, or one checkpoint): the
    # engine's initial broadcast of rank 0's parameters can be skipped. The broadcast writes
    # every parameter on the other ranks, frozen ones included, which turns their memory-mapped
    # pages private: one more copy of the model per rank. False for a model callable (it may
    # initialise differently on each rank).
    same_weights_everywhere: bool = False
    options: Dict[str, Any] = field(default_factory=dict)  # values of the strategy's own params


class TorchStrategy:
    """Base class of the torch strategies; subclasses override what differs.

    Class attributes, read on the driver: ``engine_needs`` (the capabilities its engine must
    have, class attributes of :class:`sparktrain.launch.engine.TorchEngine` such as
    ``"torch_distributed"``; ``engine_note`` says why) and ``params`` (estimator params only
    this strategy accepts, e.g. ``fsdp_wrap``).
    """

    engine_needs: ClassVar[Tuple[str, ...]] = ()
    engine_note: ClassVar[str] = ""
    params: ClassVar[Tuple[str, ...]] = ()

    # -- driver side, before launch -----------------------------------------------------------
    @classmethod
    def check(cls, name: str, backend: str, model: torch.nn.Module,
              options: Dict[str, Any]) -> None:
        """Raise ``ValueError`` naming what to change if this strategy cannot train ``model``
        on the engine registered as ``backend`` with ``options`` (its own params' values).
        Default: the engine has the capabilities in ``engine_needs``."""
        check_engine(cls, name, TORCH_BACKENDS, backend)

    # -- rank side ----------------------------------------------------------------------------
    def __init__(self, dist: Any, device: torch.device, config: StrategyConfig) -> None:
        """``dist``: the engine's rank object (``rank``, ``world_size``,
        ``wrap(model, optimizer, backward_passes_per_step, compression, broadcast)``,
        ``all_reduce_sum``: a :class:`~sparktrain.launch.engine.TorchEngine`)."""
        self.dist, self.device, self.config = dist, device, config

    @property
    def rank(self) -> int:
        return self.dist.rank

    def setup(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        """Place ``model`` and ``optimizer`` (state included) for training; returns the module
        to train and the optimizer to step (either may be new objects)."""
        raise NotImplementedError

    def grad_scaler(self) -> Any:
        """fp16's loss scaler (``mixed_precision='fp16'`` only)."""
        return torch.amp.GradScaler(self.device.type)

    def accumulating(self, module: torch.nn.Module) -> ContextManager:
        """Context for the backward pass of a batch that is not its accumulation group's last
        (``backward_passes_per_step`` > 1): where gradient synchronisation can wait."""
        return contextlib.nullcontext()

    def after_evaluation(self, module: torch.nn.Module) -> None:
        """Called after every validation pass (a forward without backward)."""

    def full_state(self, module: torch.nn.Module, optimizer: Any = None
                   ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
        """Collective (every rank calls it): the full model ``state_dict`` on rank 0's CPU and,
        with ``optimizer``, its usual index-keyed ``state_dict``; empty on the other ranks.
        ``module`` is the model the user built (what :meth:`setup` was given), not a wrapper.
        One form for every strategy, so a run resumes from any strategy's checkpoints."""
        raise NotImplementedError
