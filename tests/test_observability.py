"""What a user sees during and after a fit: live rank logs over an authenticated channel,
progress events, TensorBoard event files in the run directory, and history plots."""
from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from sparktrain import TorchEstimator
from sparktrain.launch.channel import RankChannel, RankClient
from sparktrain.progress import FitProgress


def _wait_for(predicate, seconds=5.0):
    deadline = time.time() + seconds
    while time.time() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def test_channel_accepts_only_the_fits_own_token():
    events = []
    with RankChannel("127.0.0.1", echo=False, on_progress=events.append) as channel:
        host, port, token = channel.address
        assert host == "127.0.0.1"  # bound to the driver's address, not 0.0.0.0
        intruder = socket.create_connection((host, port))
        intruder.sendall(b"not-the-token\n" + json.dumps(
            {"rank": 0, "kind": "log", "text": "forged"}).encode() + b"\n")
        client = RankClient(host, port, token, rank=1)
        client.log("hello")
        client.progress({"event": "start", "epochs": 1, "steps": 2})
        client.error("Traceback: boom")
        assert _wait_for(lambda: channel.lines and events and channel.errors)
        client.close()
        intruder.close()
    assert list(channel.lines) == [(1, "hello")]
    assert events == [{"event": "start", "epochs": 1, "steps": 2}]
    assert channel.first_error() == (1, "Traceback: boom")


def test_progress_bar_follows_rank_events(capsys):
    progress = FitProgress(verbose=1)
    progress.update({"event": "start", "epochs": 2, "steps": 3})
    progress.update({"event": "step", "epoch": 0, "step": 2, "loss": 0.5})
    progress.update({"event": "epoch", "epoch": 0, "logs": {"loss": 0.4}})
    assert progress._bar.n == 3
    progress.update({"event": "epoch", "epoch": 1, "logs": {"loss": 0.2}})
    assert progress._bar.n == 6 and progress._bar.total == 6
    # a retried attempt resumes after epoch 1: the bar restarts there
    progress.update({"event": "start", "epochs": 2, "steps": 3, "first": 1})
    assert progress._bar.n == 3 and progress._bar.desc.startswith("epoch 2/2")
    progress.close()
    quiet = FitProgress(verbose=0)
    quiet.update({"event": "start", "epochs": 2, "steps": 3})
    assert quiet._bar is None


def test_fit_writes_tensorboard_events_and_plots_history(spark, store, regression_df, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                         validation="is_val", batch_size=64, epochs=3, store=store,
                         run_id="observability-run", verbose=1)
    model = est.fit(regression_df)
    assert model.getOrDefault("run_id") == "observability-run"
    for split, key in (("train", "loss"), ("validation", "val_loss")):
        events = EventAccumulator(f"{store}/runs/observability-run/tensorboard/{split}")
        events.Reload()
        scalars = events.Scalars("epoch/loss")
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx(model.getHistory()[key], rel=1e-5)

    figure = model.plot_history()
    assert [ax.get_title() for ax in figure.axes] == ["loss"]
    assert [line.get_label() for line in figure.axes[0].lines] == ["train", "validation"]
    figure.savefig(tmp_path / "history.png")
    assert (tmp_path / "history.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no history for \\['accuracy'\\]"):
        model.plot_history(["accuracy"])
