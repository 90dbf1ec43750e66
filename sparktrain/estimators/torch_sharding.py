"""How a rank holds the model with ``strategy="fsdp"``, and activation checkpointing.

``strategy="fsdp"`` shards parameters, gradients and optimizer state across the ranks with
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, torch >= 2.6): each rank keeps
``1/world_size`` of every parameter and of its optimizer state, all-gathers a block's
parameters just before the block runs and frees them after (forward and backward), and
reduce-scatters gradients so each rank gets its shard's.

*Blocks* are the submodules that become their own sharding unit (what is all-gathered at
once); the root module is the last unit and holds every parameter not in a block:

* ``fsdp_wrap=[Block, ...]``: every submodule of those classes;
* ``fsdp_wrap=N`` (default ``DEFAULT_MIN_PARAMS``): bottom-up, each submodule whose parameters
  not yet in a block number at least ``N`` (the rule of FSDP1's ``size_based_auto_wrap_policy``).

Peak memory is then about the shards plus one block's full parameters. The same blocks are
what ``activation_checkpointing=True`` recomputes in backward instead of keeping their
activations (``torch.utils.checkpoint`` in its non-reentrant form).

Example (executor side)::

    sharded = FullySharded(device, mixed_precision=torch.bfloat16)
    model, optimizer = sharded.wrap(model, optimizer)   # the same module, now sharded
    ...
    state = sharded.full_state(model, optimizer)       # collective: rank 0 gets full tensors
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

DEFAULT_MIN_PARAMS = 1_000_000

Wrap = Union[None, int, Sequence[type]]


def blocks(model: torch.nn.Module, wrap: Wrap = None) -> List[torch.nn.Module]:
    """The submodules (never ``model`` itself) that form their own unit, children before
    parents; see the module docstring for ``wrap``."""
    if wrap is not None and not isinstance(wrap, int):
        classes = tuple(wrap)
        return [m for m in _bottom_up(model) if m is not model and isinstance(m, classes)]
    min_params = DEFAULT_MIN_PARAMS if wrap is None else wrap
    taken: set = set()
    chosen = []
    for module in _bottom_up(model):
        if module is model:
            continue
        free = [p for p in module.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= min_params:
            chosen.append(module)
            taken.update(id(p) for p in free)
    return chosen


def _bottom_up(module: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module under ``module`` (itself last), each after its children."""
    order = []
    for child in module.children():
        order.extend(_bottom_up(child))
    order.append(module)
    return order


def checkpoint_activations(modules: Sequence[torch.nn.Module]) -> None:
    """Make each module recompute its forward pass in backward instead of storing its
    activations: its ``forward`` runs inside ``torch.utils.checkpoint.checkpoint`` (the
    non-reentrant form torch recommends; it works under DDP and FSDP2). The module's
    structure and state_dict names stay as they were."""
    from torch.utils.checkpoint import checkpoint

    for module in modules:
        forward = module.forward

        @functools.wraps(forward)
        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)  # validation: nothing to recompute
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = recomputed


def _parameter_names(model: torch.nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


class FullySharded:
    """FSDP2 for one rank: shards the model in place and rebuilds its optimizer.

    ``mixed_precision`` (``torch.bfloat16``/``float16``) becomes FSDP's own policy: parameters
    are all-gathered and computed in that dtype, gradients reduced in float32 (or float16 with
    ``reduce_fp16``, what ``gradient_compression='fp16'`` asks for); the shards and the
    optimizer state stay float32. ``cpu_offload`` keeps shards and optimizer state in CPU
    memory (GPU ranks only; FSDP2 copies each block to the GPU when it runs).
    """

    def __init__(self, device: torch.device, wrap: Wrap = None,
                 mixed_precision: Optional[torch.dtype] = None, reduce_fp16: bool = False,
                 cpu_offload: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        world_size = torch.distributed.get_world_size()
        self.mesh = init_device_mesh(device.type, (world_size,))
        self.wrap_rule = wrap
        reduce = torch.float16 if reduce_fp16 else (torch.float32 if mixed_precision else None)
        self.options: Dict[str, Any] = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=reduce)}
        if cpu_offload:
            # FSDP2 pins the offloaded shards' memory, which needs an accelerator.
            self.options["offload_policy"] = CPUOffloadPolicy()

    def wrap(self, model: torch.nn.Module, optimizer: Any) -> Tuple[torch.nn.Module, Any]:
        """Shard ``model`` in place (its blocks, then the root) and return it with a new
        optimizer of the same class and param groups over the sharded parameters, holding
        ``optimizer``'s state (e.g. a resumed run's Adam moments), sharded."""
        from torch.distributed.fsdp import fully_shard

        names = _parameter_names(model)
        groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        state = optimizer.state_dict()
        for block in blocks(model, self.wrap_rule):
            fully_shard(block, mesh=self.mesh, **self.options)
        fully_shard(model, mesh=self.mesh, **self.options)
        sharded = dict(model.named_parameters())
        rebuilt = [dict({k: v for k, v in group.items() if k != "params"},
                        params=[sharded[name] for name in names_])
                   for group, names_ in zip(optimizer.param_groups, groups)]
        try:
            new_optimizer = type(optimizer)(rebuilt, **optimizer.defaults)
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
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        flat = [name for names in groups for name in names]
        by_name = {"state": {flat[index]: value for index, value in state["state"].items()},
                   "param_groups": [dict(group, params=names) for group, names
                                    in zip(state["param_groups"], groups)]}
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

    @staticmethod
    def full_state(model: torch.nn.Module, optimizer: Any = None
                   ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
        """Collective (every rank calls it): the full model state_dict and, with
        ``optimizer``, its state_dict in the usual index-keyed form, on rank 0's CPU (empty
        on the other ranks). The same form a DDP run checkpoints, so either strategy resumes
        from the other's checkpoints and the fitted model loads them as usual."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        if optimizer is None:
            return weights, None
        by_name = get_optimizer_state_dict(model, optimizer, options=options)
        if not by_name:
            return weights, {}
        names = _parameter_names(model)
        order = {names[id(p)]: index for index, p in
                 enumerate(p for group in optimizer.param_groups for p in group["params"])}
        return weights, {
            "state": {order[name]: value for name, value in by_name["state"].items()},
            "param_groups": [dict(group, params=[order[name] for name in group["params"]])
                             for group in by_name["param_groups"]]}


def local_parameter_count(model: torch.nn.Module) -> Tuple[int, int]:
    """``(held on this rank, total)`` parameter counts: a sharded parameter (``DTensor``)
    counts its local shard. E.g. from a callback's ``on_train_begin(model, history)``."""
    held = total = 0
    for parameter in model.parameters():
        total += parameter.numel()
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        held += local.numel()
    return held, total
