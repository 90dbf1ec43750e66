"""``strategy="fsdp"``: parameters, gradients and optimizer state sharded across the ranks.

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, torch >= 2.6): each rank keeps
``1/world_size`` of every parameter and of its optimizer state, all-gathers a block's
parameters just before the block runs and frees them after (forward and backward), and
reduce-scatters gradients so each rank gets its shard's. The blocks (``fsdp_wrap``, see
:mod:`sparktrain.strategies.torch_blocks`) are what is all-gathered at once: peak memory is
about the shards plus one block's full parameters.

Example (executor side)::

    sharded = FullySharded(dist, device, StrategyConfig(torch.bfloat16))
    model, optimizer = sharded.setup(model, optimizer)   # the same module, now sharded
    ...
    state = sharded.full_state(model, optimizer)         # collective: rank 0 gets full tensors
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, cast

import torch

from sparktrain.strategies.torch_blocks import blocks
from sparktrain.strategies.torch_strategy import StrategyConfig, TorchStrategy


def _parameter_names(model: torch.nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


class FullySharded(TorchStrategy):
    """FSDP2 for one rank: shards the model in place and rebuilds its optimizer.

    ``mixed_precision`` (``torch.bfloat16``/``float16``) becomes FSDP's own policy: parameters
    are all-gathered and computed in that dtype, gradients reduced in float32 (or float16 with
    ``gradient_compression='fp16'``); the shards and the optimizer state stay float32.
    ``fsdp_cpu_offload`` keeps shards and optimizer state in CPU memory (GPU ranks only; FSDP2
    copies each block to the GPU when it runs).
    """

    engine_needs = ("torch_distributed",)
    engine_note = ("torch.distributed's FSDP2 shards over the engine's process group, which "
                   "this engine does not form; or use strategy='ddp'")
    params = ("fsdp_wrap", "fsdp_cpu_offload")

    @classmethod
    def check(cls, name: str, backend: str, model: torch.nn.Module,
              options: Dict[str, Any]) -> None:
        super().check(name, backend, model, options)
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401 - only whether it imports
        except ImportError:
            raise ValueError(f"strategy={name!r} needs torch >= 2.6 "
                             f"(torch.distributed.fsdp.fully_shard); this is torch "
                             f"{torch.__version__}") from None
        wrap = options.get("fsdp_wrap")
        if isinstance(wrap, list):
            missing = [c.__name__ for c in wrap
                       if not any(isinstance(m, c) for m in model.modules())]
            if missing:
                raise ValueError(f"fsdp_wrap: the model has no submodule of class "
                                 f"{', '.join(missing)}")

    def __init__(self, dist: Any, device: torch.device, config: StrategyConfig) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        super().__init__(dist, device, config)
        world_size = torch.distributed.get_world_size()
        self.mesh = init_device_mesh(device.type, (world_size,))
        self.wrap_rule = config.options.get("fsdp_wrap")
        precision = config.mixed_precision
        reduce = torch.float16 if config.gradient_compression == "fp16" else \
            (torch.float32 if precision else None)
        self.fsdp_options: Dict[str, Any] = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=reduce)}
        if config.options.get("fsdp_cpu_offload") and device.type == "cuda":
            # FSDP2 pins the offloaded shards' memory, which needs an accelerator.
            self.fsdp_options["offload_policy"] = CPUOffloadPolicy()

    def setup(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        from sparktrain.faults import user_code

        with user_code("rebuilding the optimizer over the sharded parameters"):
            return self.wrap(model, optimizer)

    def grad_scaler(self) -> Any:
        """Sharded gradients need every rank to agree on whether to skip a step: FSDP's
        ``ShardedGradScaler`` all-reduces the inf/NaN check, ``GradScaler`` does not."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device.type)

    # accumulating(): the default (no context). An FSDP2 module reduce-scatters every pass and
    # accumulates sharded gradients (more traffic, but no full-size gradients held between
    # passes); set_requires_gradient_sync(False) would hold them unsharded instead.

    def after_evaluation(self, module: torch.nn.Module) -> None:
        self.reshard(module)

    def wrap(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        """Shard ``model`` in place (its blocks, then the root) and return it with a new
        optimizer of the same class and param groups over the sharded parameters, holding
        ``optimizer``'s state (e.g. a resumed run's Adam moments), sharded."""
        from torch.distributed.fsdp import fully_shard

        names = _parameter_names(model)
        groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        state = optimizer.state_dict()
        for block in blocks(model, self.wrap_rule):
            fully_shard(block, mesh=self.mesh, **self.fsdp_options)
        fully_shard(model, mesh=self.mesh, **self.fsdp_options)
        sharded = dict(model.named_parameters())
        rebuilt = [dict({k: v for k, v in group.items() if k != "params"},
                        params=[sharded[name] for name in names_])
                   for group, names_ in zip(optimizer.param_groups, groups, strict=True)]
        try:
            new_optimizer = type(optimizer)(rebuilt, **_constructor_defaults(optimizer))
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            raise TypeError(f"strategy='fsdp' rebuilds the optimizer over the sharded "
                            f"parameters as {type(optimizer).__name__}(param_groups, "
                            f"**optimizer.defaults), which failed: {exc}") from exc
        if state["state"]:
            self._load_optimizer(model, new_optimizer, state, groups)
        return model, new_optimizer

    @staticmethod
    def _load_optimizer(model: torch.nn.Module, optimizer: Any, state: Dict[str, Any],
                        groups: List[List[str]]) -> None:
        """Shard a full, index-keyed ``optimizer.state_dict()`` into ``optimizer``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        flat = [name for names in groups for name in names]
        by_name: Dict[str, Any] = {
            "state": {flat[index]: value for index, value in state["state"].items()},
            "param_groups": [dict(group, params=names) for group, names
                             in zip(state["param_groups"], groups, strict=True)]}
        set_optimizer_state_dict(model, optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))

    @staticmethod
    def reshard(model: torch.nn.Module) -> None:
        """Free gathered parameters a forward pass without backward left (FSDP2 keeps the
        root's gathered after forward, expecting backward): after validation, callbacks and
        the next epoch see shards only."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_state(self, model: torch.nn.Module, optimizer: Any = None
                   ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
        """Collective (every rank calls it): the full model state_dict and, with
        ``optimizer``, its state_dict in the usual index-keyed form, on rank 0's CPU (empty
        on the other ranks). The same form a DDP run checkpoints, so either strategy resumes
        from the other's checkpoints and the fitted model loads them as usual."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # torch types both as the union of every form a state dict takes; the full form these
        # options ask for is tensors by name, and the optimizer's usual "state"/"param_groups"
        weights = cast(Dict[str, torch.Tensor], get_model_state_dict(model, options=options))
        if optimizer is None:
            return weights, None
        by_name = cast(Dict[str, Any], get_optimizer_state_dict(model, optimizer, options=options))
        if not by_name:
            return weights, {}
        names = _parameter_names(model)
        order = {names[id(p)]: index for index, p in
                 enumerate(p for group in optimizer.param_groups for p in group["params"])}
        return weights, {
            "state": {order[name]: value for name, value in by_name["state"].items()},
            "param_groups": [dict(group, params=[order[name] for name in group["params"]])
                             for group in by_name["param_groups"]]}


def _constructor_defaults(optimizer: Any) -> Dict[str, Any]:
    """The optimizer's ``defaults`` its constructor takes: some keep more there than they
    take (torch 2.13's ``AdamW`` stores ``decoupled_weight_decay``, which only ``Adam``'s
    constructor accepts); the groups passed with them carry every value anyway."""
    import inspect

    parameters = inspect.signature(type(optimizer).__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(optimizer.defaults)
    names = {p.name for p in parameters}
    return {k: v for k, v in optimizer.defaults.items() if k in names}
