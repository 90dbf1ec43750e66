"""Builders shared by test modules."""
from __future__ import annotations

import os
import signal
from typing import Any


def linear_estimator(store: str, seed: int = 0, lr: float = 0.05, **overrides: Any):
    """A 2-rank ``TorchEstimator`` fitting ``Linear(4, 1)`` with SGD on the ``features`` /
    ``label`` columns of the ``regression_df`` fixture; any param can be overridden."""
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 1)
    params = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  random_seed=seed, store=store, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


class KillRankOnce:
    """A transformation_fn that SIGKILLs rank 1's Python worker at its ``at``-th batch, once
    per marker file (so the retried attempt runs through)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at, self.seen = marker, at, 0

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        self.seen += 1
        if BarrierTaskContext.get().partitionId() == 1 and self.seen == self.at \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch
