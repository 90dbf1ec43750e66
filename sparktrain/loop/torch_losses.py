"""The user's losses and metrics as a rank uses them (no framework import: the estimator
checks them on the driver with the same functions).

Example::

    loss = build_losses(lambda **kw: torch.nn.MSELoss(), n_labels=1, rank=0)
    names = [name for name, fn in named_metrics([accuracy, ("f1", f1)])]   # accuracy, f1
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Collection, List, Tuple


def build_losses(constructors: Any, n_labels: int, **context: Any) -> Any:
    """Call Horovod-style ``loss_constructors`` on a rank: each gets the keyword arguments of
    ``context`` it accepts (all of them with ``**kwargs``; Horovod passes its own locals), so
    ``lambda **kw: nn.CrossEntropyLoss()`` and a plain class such as ``nn.MSELoss`` both work.
    Returns one loss (for every label column) or one per label column."""
    items = list(constructors) if isinstance(constructors, (list, tuple)) else [constructors]
    losses = []
    for make in items:
        try:
            parameters: Collection[inspect.Parameter] = \
                inspect.signature(make).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        if any(p.kind == p.VAR_KEYWORD for p in parameters):
            kwargs = dict(context)
        else:
            names = {p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            kwargs = {k: v for k, v in context.items() if k in names}
        losses.append(make(**kwargs))
    if len(losses) not in (1, n_labels):
        raise ValueError(f"loss_constructors built {len(losses)} losses for {n_labels} label "
                         f"columns; give one, or one per label column")
    return losses[0] if len(losses) == 1 else losses


def named_metrics(metrics: Any) -> List[Tuple[str, Callable]]:
    """``[(name, fn)]`` from a list of functions, ``(name, fn)`` pairs or a dict."""
    if not metrics:
        return []
    items = metrics.items() if isinstance(metrics, dict) else metrics
    named = []
    for item in items:
        if isinstance(item, tuple):
            named.append((str(item[0]), item[1]))
        else:
            named.append((getattr(item, "__name__", type(item).__name__), item))
    return named
