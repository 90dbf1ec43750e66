"""Blocks of a torch model: the units FSDP shards and activation checkpointing recomputes.

*Blocks* are the submodules that become their own unit; the root module is the last unit and
holds every parameter not in a block:

* ``wrap=[Block, ...]``: every submodule of those classes;
* ``wrap=N`` (default ``DEFAULT_MIN_PARAMS``): bottom-up, each submodule whose parameters
  not yet in a block number at least ``N`` (the rule of FSDP1's ``size_based_auto_wrap_policy``).

Example::

    checkpoint_activations(blocks(model, [TransformerBlock]))
"""
from __future__ import annotations

import functools
from typing import Any, List, Sequence, Tuple, Union

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


def local_parameter_count(model: torch.nn.Module) -> Tuple[int, int]:
    """``(held on this rank, total)`` parameter counts: a sharded parameter (``DTensor``)
    counts its local shard. E.g. from a callback's ``on_train_begin(model, history)``."""
    held = total = 0
    for parameter in model.parameters():
        total += parameter.numel()
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        held += local.numel()
    return held, total
