"""A torch strategy written outside sparktrain, in this one file, registered and fitted with:
DDP whose gradient all-reduce is a communication hook of our own. Nothing in sparktrain is
edited to add it; its class reaches the executors inside the training payload."""
from __future__ import annotations

import os

import numpy as np
import pytest

from sparktrain.strategies import TORCH_STRATEGIES, register_torch_strategy
from sparktrain.strategies.torch_ddp import DataParallel
from support.helpers import linear_estimator


def averaging_hook(marker_dir, bucket):
    """A DDP communication hook: all-reduce the bucket's sum, then divide by the world size
    (what DDP's default does), leaving a file behind so the test knows each rank ran it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    open(os.path.join(marker_dir, f"hook-rank-{rank}"), "a").close()
    tensor = bucket.buffer()
    future = dist.all_reduce(tensor, async_op=True).get_future()
    return future.then(lambda done: done.value()[0].div_(dist.get_world_size()))


class HookedDataParallel(DataParallel):
    """``strategy="ddp"`` with the gradient all-reduce done by :func:`averaging_hook`."""

    marker_dir = ""  # set by the test before fitting; travels with the class

    def setup(self, model, optimizer):
        trained, optimizer = super().setup(model, optimizer)
        trained.register_comm_hook(state=self.marker_dir, hook=averaging_hook)
        return trained, optimizer


@pytest.fixture
def hooked(tmp_path):
    HookedDataParallel.marker_dir = str(tmp_path)
    register_torch_strategy("ddp_hooked", HookedDataParallel)
    yield tmp_path
    TORCH_STRATEGIES.pop("ddp_hooked")


def test_a_strategy_registered_from_outside_fits(hooked, regression_df, store):
    estimator = linear_estimator(store, epochs=4, batch_size=32, strategy="ddp_hooked",
                                 run_id="plugin-strategy")
    model = estimator.fit(regression_df)
    assert sorted(os.listdir(hooked)) == ["hook-rank-0", "hook-rank-1"]
    history = model.getHistory()["loss"]
    assert history[-1] < history[0] * 0.5, history
    predictions = model.transform(regression_df.limit(50)).toPandas()
    error = np.abs(predictions["label__output"] - predictions["label"]).mean()
    assert error < 1.0, error


def test_unregistered_strategy_names_the_registry():
    with pytest.raises(ValueError, match="register your own with sparktrain.strategies"):
        linear_estimator("/tmp/unused", strategy="ddp_hooked")


def test_strategy_registration_is_checked():
    with pytest.raises(ValueError, match="a torch strategy's name must be a non-empty string"):
        register_torch_strategy("", HookedDataParallel)
    with pytest.raises(TypeError, match="as a class or a 'module:Class' string, "
                                        "got HookedDataParallel"):
        register_torch_strategy("instance", HookedDataParallel.__new__(HookedDataParallel))
    assert "" not in TORCH_STRATEGIES and "instance" not in TORCH_STRATEGIES
