"""What a torch rank writes to the run's checkpoints and resumes from.

A checkpoint is ``torch.save`` of ``{"model": state_dict, "optimizer": state_dict,
"scheduler": state_dict or None, "frozen_omitted": bool}``. When most of the model's
parameters are frozen (``requires_grad=False``: a pretrained body under LoRA adapters or a new
head), the frozen ones are left out (``frozen_omitted``): they cannot change during the fit, and
a resumed rank already has them from the model it was given. Buffers and trainable parameters
are always in. The fitted model (rank 0's final weights) is always complete.

Example (rank side)::

    data = checkpoint_bytes(model, weights, optimizer_state, schedule_state)
    state = restore(data, model, optimizer)      # raises a user error if it does not fit
"""
from __future__ import annotations

import io
from typing import Any, Dict, Optional, Set

import torch

from sparktrain.faults import mark_user_error

#: below this share of trainable parameters (by count of values), checkpoints omit frozen ones
TRAINABLE_SHARE = 0.5


def frozen_names(model: torch.nn.Module) -> Set[str]:
    """The state_dict names of the model's frozen parameters (tied ones under every name)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def mostly_frozen(model: torch.nn.Module) -> bool:
    """True when fewer than :data:`TRAINABLE_SHARE` of the parameters' values train."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total > 0 and trainable < TRAINABLE_SHARE * total


def checkpoint_bytes(model: torch.nn.Module, weights: Dict[str, torch.Tensor],
                     optimizer_state: Any, scheduler_state: Optional[Dict[str, Any]] = None
                     ) -> bytes:
    """The checkpoint file of ``model``'s full ``weights`` (frozen ones dropped when
    :func:`mostly_frozen`), its optimizer's and scheduler's state."""
    omitted = mostly_frozen(model)
    if omitted:
        frozen = frozen_names(model)
        weights = {k: v for k, v in weights.items() if k not in frozen}
    buffer = io.BytesIO()
    torch.save({"model": weights, "optimizer": optimizer_state, "scheduler": scheduler_state,
                "frozen_omitted": omitted}, buffer)
    return buffer.getvalue()


def restore(data: bytes, model: torch.nn.Module, optimizer: Any,
            source: str = "the run's checkpoint") -> Dict[str, Any]:
    """Load a checkpoint (read from ``source``) into ``model`` and ``optimizer``; returns the
    whole checkpoint (its ``scheduler`` state is restored once the scheduler exists)."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged file written before checkpoints had fingerprints
        raise mark_user_error(RuntimeError(
            f"{source} cannot be loaded ({type(exc).__name__}: {exc}): the file is damaged; "
            f"remove it to resume from the checkpoint before it, or fit with a new run_id"),
            "resuming from the run's checkpoint") from None
    try:
        if state.get("frozen_omitted"):
            missing, unexpected = model.load_state_dict(state["model"], strict=False)
            strays = sorted(set(missing) - frozen_names(model)) + sorted(unexpected)
            if strays:
                raise RuntimeError(f"entries that do not match: {strays[:5]}")
        else:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise mark_user_error(RuntimeError(
            f"the run's checkpoint does not fit this model/optimizer ({exc}); pass a new run_id "
            f"to start a fresh run"), "resuming from the run's checkpoint") from None
    return state
