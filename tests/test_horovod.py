"""backend="horovod": Horovod over Gloo in the same barrier tasks, rendezvous by Horovod itself."""
from __future__ import annotations

import pytest
import torch

from sparktrain import TrainingError
from sparktrain.launch import TORCH_BACKENDS, check_backend
from sparktrain.launch.horovod_torch import slot_for
from support.helpers import linear_estimator


def estimator(store, backend, **overrides):
    params = dict(batch_size=32, epochs=4, shuffle=False, backend=backend)
    return linear_estimator(store, seed=5, **dict(params, **overrides))


def test_horovod_matches_torch_backend(spark, store, regression_df):
    """Same init (seeded, and broadcast from rank 0), same shards in the same order
    (shuffle=False), gradients averaged over the same 2 ranks: the two engines compute the
    same steps; only the float32 summation order inside allreduce may differ, so the losses
    agree to ~1e-6 relative. 1e-4 leaves room for that and nothing else."""
    horovod = estimator(store, "horovod").fit(regression_df).getHistory()["loss"]
    ddp = estimator(store, "torch").fit(regression_df).getHistory()["loss"]
    assert horovod[-1] < 0.02  # converged to the noise floor (0.01)
    for a, b in zip(horovod, ddp, strict=True):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1e-8), (horovod, ddp)


class FailsOnRankOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        import horovod.torch as hvd

        if hvd.rank() == 1:
            raise RuntimeError("horovod rank one gives up")
        return self.linear(x)


def test_horovod_failing_rank_surfaces_its_traceback(spark, store, regression_df):
    net = FailsOnRankOne()
    est = estimator(store, "horovod", model=net,
                    optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TrainingError, match="horovod rank one gives up") as info:
        est.fit(regression_df)
    assert info.value.rank == 1 and "in forward" in info.value.remote_traceback
    assert estimator(store, "horovod", epochs=1).fit(regression_df).getHistory()["loss"]


def test_slot_plan_groups_ranks_by_host():
    hosts = ["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"]
    slots = [slot_for(hosts, r)[0] for r in range(4)]
    assert sorted(s.rank for s in slots) == [0, 1, 2, 3]
    assert [(s.hostname, s.local_rank) for s in slots] == [
        ("10.0.0.2", 0), ("10.0.0.1", 0), ("10.0.0.2", 1), ("10.0.0.1", 1)]
    assert all(s.local_size == 2 and s.cross_size == 2 for s in slots)


def test_missing_framework_fails_before_launch_with_install_hint():
    registry = dict(TORCH_BACKENDS, fake=("nowhere:Nothing", "horovod_not_installed_here"))
    with pytest.raises(ValueError, match="backend='fake' needs 'horovod_not_installed_here'.*"
                                         "Install pip install horovod_not_installed_here"):
        check_backend(registry, "fake")
