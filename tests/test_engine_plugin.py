"""A torch engine written outside sparktrain, in this one file, registered and fitted with: the
DDP engine, leaving a file behind on each rank when it forms the group, wraps the model and
sums over the ranks. Nothing in sparktrain is edited to add it; its class reaches the executors
inside the training payload (their registries never hear of it)."""
from __future__ import annotations

import os

import pytest

from sparktrain.launch import TORCH_BACKENDS, register_keras_backend, register_torch_backend
from sparktrain.launch.torch_ddp import TorchDDP
from support.helpers import linear_estimator


class RecordingDDP(TorchDDP):
    """``backend="torch"`` that records what each rank asked of it."""

    marker_dir = ""  # set by the test before fitting; travels with the class

    def __init__(self, ctx, device):
        super().__init__(ctx, device)
        self._mark("joined")

    def wrap(self, model, optimizer, *args, **kwargs):
        self._mark("wrapped")
        return super().wrap(model, optimizer, *args, **kwargs)

    def all_reduce_sum(self, tensor):
        self._mark("summed")
        return super().all_reduce_sum(tensor)

    def _mark(self, what):
        open(os.path.join(self.marker_dir, f"{what}-rank-{self.rank}"), "a").close()


@pytest.fixture
def recording(tmp_path):
    RecordingDDP.marker_dir = str(tmp_path)
    register_torch_backend("recording_ddp", RecordingDDP)
    yield tmp_path
    TORCH_BACKENDS.pop("recording_ddp")


def test_an_engine_registered_from_outside_fits(recording, regression_df, store):
    estimator = linear_estimator(store, epochs=2, batch_size=64, backend="recording_ddp",
                                 run_id="plugin-engine")
    model = estimator.fit(regression_df)
    assert sorted(os.listdir(recording)) == [f"{what}-rank-{rank}" for what in
                                             ("joined", "summed", "wrapped") for rank in (0, 1)]
    history = model.getHistory()["loss"]
    assert history[-1] < history[0], history


def test_registration_is_checked():
    with pytest.raises(ValueError, match="a torch engine's name must be a non-empty string"):
        register_torch_backend("", RecordingDDP)
    with pytest.raises(TypeError, match="must subclass sparktrain.launch.engine.TorchEngine"):
        register_torch_backend("not_an_engine", dict)
    with pytest.raises(TypeError, match="must subclass sparktrain.launch.engine.KerasEngine"):
        register_keras_backend("ddp_for_keras", RecordingDDP)
    with pytest.raises(TypeError, match="as a class or a 'module:Class' string"):
        register_torch_backend("instance", RecordingDDP.__new__(RecordingDDP))
    assert "not_an_engine" not in TORCH_BACKENDS
