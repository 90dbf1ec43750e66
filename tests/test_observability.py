"""What a user sees during and after a fit: live rank logs carried through the store,
progress events, TensorBoard event files in the run directory, and history plots."""
from __future__ import annotations

import io
import time

import pytest
import torch

from sparktrain import TorchEstimator
from sparktrain.estimators.progress import FitProgress
from sparktrain.launch.events import EventWatcher, RankEvents


def _wait_for(predicate, seconds=5.0):
    deadline = time.time() + seconds
    while time.time() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def test_rank_events_reach_the_client_through_the_store(tmp_path):
    """Ranks write segments to a directory; the client reads them in order and deletes them.
    No socket is involved: executors never connect to the client."""
    url = str(tmp_path / "events")
    progress, errors = [], []
    with EventWatcher(url, echo=False, on_progress=progress.append,
                      on_error=lambda *e: errors.append(e)) as watcher:
        rank1 = RankEvents(url, rank=1)
        assert rank1.start() == 0
        rank1.log("hello")
        rank1.progress({"event": "start", "epochs": 1, "steps": 2})
        rank1.error("Traceback: boom")  # errors are written at once
        assert _wait_for(lambda: watcher.lines and progress and errors)
        rank1.log("after the error")
        rank1.close()  # the last lines are flushed on close
        again = RankEvents(url, rank=1)
        assert again.start() == 1  # its second start: attempt 1
        assert not again.stopped()
        again.error("Traceback: a bug", fatal=True)  # retrying cannot fix it: stop the rest
        again.close()
        rank0 = RankEvents(url, rank=0)
        rank0.start()
        assert rank0.stopped()
    assert list(watcher.lines) == [(1, "hello"), (1, "after the error")]
    assert progress == [{"event": "start", "epochs": 1, "steps": 2}]
    assert errors == [(1, 0, "Traceback: boom", False), (1, 1, "Traceback: a bug", True)]
    assert watcher.first_error() == (1, "Traceback: boom") and watcher.failed_attempts() == 2
    leftover = sorted(p.name for p in (tmp_path / "events").iterdir())
    assert leftover == ["starts", "stop"], leftover  # every segment was consumed


def test_rank_events_never_fail_the_rank(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the events directory should be")
    events = RankEvents(str(blocked / "events"), rank=0)
    assert events.start() == 0
    events.log("lost, silently")
    events.error("also lost")
    events.close()


class _Terminal(io.StringIO):
    """What the bar draws on: a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_follows_rank_events(capsys):
    terminal = _Terminal()
    progress = FitProgress(verbose=1, stream=terminal)
    assert not progress.lines  # a terminal gets the live bar
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
    assert "\r" in terminal.getvalue() and "epoch 2/2" in terminal.getvalue()  # redrawn live
    quiet = FitProgress(verbose=0, stream=terminal)
    quiet.update({"event": "start", "epochs": 2, "steps": 3})
    assert quiet._bar is None


def test_fit_writes_tensorboard_events_and_plots_history(spark, store, regression_df, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(num_proc=2, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
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
