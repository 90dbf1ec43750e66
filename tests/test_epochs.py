"""The framework-neutral epoch driver, without Spark or any framework: a scripted
``EpochTraining`` on one rank, real checkpoint files under a temp directory."""
import json
import math
import time

import pytest

from sparktrain.faults import is_user_error
from sparktrain.loop.checkpoint import Checkpoints
from sparktrain.loop.epochs import EpochBoard, EpochDriver, StepReporter
from sparktrain.options.spec import LoopSpec, RowsPlan


class Scripted:
    """One rank's training whose loss is ``1 / (epoch + 1)``; records what the driver asked."""

    def __init__(self, stop_after=None, loss=None, steps=3):
        self.calls, self.stop_after, self.loss, self.steps = [], stop_after, loss, steps

    def all_reduce_sum(self, values):
        self.calls.append(("all_reduce", list(values)))
        return list(values)

    def train_epoch(self, epoch, reporter):
        self.calls.append(("train", epoch))
        for step in range(self.steps):
            if reporter is not None and reporter.due(step):
                reporter.send(step, 0.5)
        return {"loss": self.loss if self.loss is not None else 1.0 / (epoch + 1)}

    def evaluate(self, epoch):
        return {"val_loss": 2.0 / (epoch + 1)}

    def epoch_end(self, epoch, logs):
        self.calls.append(("end", epoch, dict(logs)))
        return self.stop_after is not None and epoch + 1 >= self.stop_after

    def checkpoint(self, epoch, logs):
        return f"state-{epoch + 1}".encode(), {"framework": "scripted-override", "epoch": epoch}


def driver(tmp_path, **kwargs):
    events, lines = [], []
    options = dict(rank=0, world_size=1, epochs=4, run_path=str(tmp_path / "run"), log=lines.append,
                   progress=lambda **e: events.append(e), meta={"framework": "scripted"})
    options.update(kwargs)
    made = EpochDriver(**options)
    return made, events, lines


def test_runs_every_epoch_checkpoints_and_reports(tmp_path):
    run, events, lines = driver(tmp_path)
    training = Scripted()
    assert run.resume_bytes() is None
    run.agree(training.all_reduce_sum)
    run.start(3, "1 rank(s) of a scripted training")
    assert run.run(training) is None
    assert run.history == {"loss": [1.0, 0.5, 1 / 3, 0.25], "val_loss": [2.0, 1.0, 2 / 3, 0.5]}
    assert [e["event"] for e in events].count("epoch") == 4
    assert events[0] == {"event": "start", "epochs": 4, "steps": 3, "first": 0}
    assert any(e["event"] == "step" and e["step"] == 3 for e in events)  # the last step always
    assert lines[0] == "1 rank(s) of a scripted training"
    assert lines[-1].startswith("epoch 4/4  loss=0.25  val_loss=0.5")
    latest = Checkpoints(str(tmp_path / "run")).latest()
    assert latest.epochs_done == 4 and latest.meta["history"] == run.history
    # the framework's metadata wins over the driver's defaults
    assert latest.meta["framework"] == "scripted-override" and latest.meta["epoch"] == 3
    assert latest.meta["attempts"] == [{"attempt": 0, "start_epoch": 0}]


def test_a_second_attempt_resumes_after_the_last_checkpoint(tmp_path):
    first, _, _ = driver(tmp_path, epochs=2)
    first.run(Scripted())
    again, events, lines = driver(tmp_path, epochs=4, attempt=1)
    assert again.first == 2 and again.resume_bytes() == b"state-2"
    again.start(3, "resumed")
    training = Scripted()
    again.run(training)
    assert [c[1] for c in training.calls if c[0] == "train"] == [2, 3]
    assert again.history["loss"] == [1.0, 0.5, 1 / 3, 0.25]
    assert "resuming from the checkpoint after epoch 2 (attempt 2)" in lines
    assert again.attempts == [{"attempt": 0, "start_epoch": 0}, {"attempt": 1, "start_epoch": 2}]


def test_ranks_that_disagree_on_the_checkpoint_fail_the_attempt(tmp_path):
    first, _, _ = driver(tmp_path, epochs=1)
    first.run(Scripted())
    two_ranks, _, _ = driver(tmp_path, world_size=2)
    with pytest.raises(RuntimeError, match="different latest checkpoints"):
        two_ranks.agree(lambda values: [values[0]])  # the other rank found none


def test_a_callback_stops_training_after_its_epoch(tmp_path):
    run, _, lines = driver(tmp_path)
    training = Scripted(stop_after=2)
    assert run.run(training) == "callback"
    assert len(run.history["loss"]) == 2
    assert lines[-1] == "training stopped after epoch 2: a callback asked to stop"
    # the vote is a sum over ranks of 0/1 flags (stop, regroup), after the epoch's checkpoint
    assert ("all_reduce", [1.0, 0.0]) in training.calls
    assert Checkpoints(str(tmp_path / "run")).latest().epochs_done == 2


def test_the_deadline_stops_training_at_an_epoch_end(tmp_path):
    run, _, lines = driver(tmp_path, deadline=time.time() - 1)
    assert run.run(Scripted()) == "max_time"
    assert len(run.history["loss"]) == 1 and lines[-1].endswith("max_time reached")


def test_non_finite_metrics_are_the_users_error_when_required(tmp_path):
    run, _, _ = driver(tmp_path, require_finite=True)
    with pytest.raises(FloatingPointError, match="non-finite metrics at epoch 1") as caught:
        run.run(Scripted(loss=math.nan))
    assert is_user_error(caught.value)  # not retried as a fault
    lenient, _, _ = driver(tmp_path / "other", epochs=1)
    lenient.run(Scripted(loss=math.nan))
    assert math.isnan(lenient.history["loss"][0])


def test_tensorboard_writer_is_made_on_rank_0_and_closed(tmp_path):
    made = []

    class Board:
        def __init__(self):
            self.written, self.closed = [], False
            made.append(self)

        def write(self, epoch, logs):
            self.written.append(epoch)

        def close(self):
            self.closed = True

    run, _, _ = driver(tmp_path, board=Board, epochs=2)
    run.run(Scripted())
    assert len(made) == 1 and made[0].written == [0, 1] and made[0].closed
    other_rank, _, _ = driver(tmp_path / "r1", board=Board, rank=1)
    other_rank.run(Scripted())
    assert len(made) == 1


def test_epoch_board_splits_validation_metrics_and_flushes_every_epoch(tmp_path):
    class Writer:
        def __init__(self, directory):
            self.directory, self.scalars, self.flushes, self.closed = directory, [], 0, False

        def flush(self):
            self.flushes += 1

        def close(self):
            self.closed = True

    class Board(EpochBoard):
        def _open(self, directory):
            return Writer(directory)

        def _scalar(self, writer, tag, value, step):
            writer.scalars.append((tag, value, step))

    board = Board(str(tmp_path / "run"), {})
    board.write(0, {"loss": 1.0, "val_loss": 2.0})
    board.close()
    train, validation = board.writers["train"], board.writers["validation"]
    assert board.remote is None and train.directory == f"{tmp_path}/run/tensorboard/train"
    assert train.scalars == [("epoch/loss", 1.0, 1)]
    assert validation.scalars == [("epoch/loss", 2.0, 1)]
    assert train.flushes == validation.flushes == 1 and train.closed and validation.closed


def test_loop_spec_round_trips_and_makes_its_driver(tmp_path):
    spec = LoopSpec(rows=RowsPlan(root="/d", layouts={"train": [["a.parquet", 10]]}), columns=[],
                    feature_cols=["x"], label_cols=["y"], sample_weight_col="w", batch_size=8,
                    val_batch_size=8, epochs=3, shuffle=False, seed=None, verbose=0,
                    backend="torch", strategy="ddp", run_path=str(tmp_path / "run"),
                    deadline=12.5, fit_id="f1")
    assert LoopSpec.from_json(spec.to_json()) == spec
    assert spec.model_columns() == ["x", "y", "w"]
    made = EpochDriver.for_spec(spec, rank=1, world_size=2, attempt=3, log=print)
    assert (made.epochs, made.verbose, made.deadline, made.fit_id, made.attempt) == \
        (3, 0, 12.5, "f1", 3)
    assert made.checkpoints is not None and made.rank == 1 and made.world_size == 2


def test_without_a_run_directory_nothing_is_written(tmp_path):
    run, _, _ = driver(tmp_path, run_path="")
    training = Scripted()
    run.run(training)
    assert run.resume_bytes() is None and not list(tmp_path.iterdir())


def test_step_reporter_throttles_but_sends_the_last_step():
    sent = []
    reporter = StepReporter(lambda **e: sent.append(e), epoch=0, steps=1000, per_second=1.0)
    for step in range(1000):
        if reporter.due(step):
            reporter.send(step, 0.1)
    assert sent[0]["step"] == 1 and sent[-1]["step"] == 1000 and len(sent) <= 3
    assert json.dumps(sent)  # plain values: they travel as JSON events


def test_an_early_stop_holds_for_the_fits_retries_but_not_for_a_new_fit(tmp_path):
    run, _, _ = driver(tmp_path, fit_id="fit-1")
    assert run.run(Scripted(stop_after=2)) == "callback"
    retry, _, lines = driver(tmp_path, fit_id="fit-1", attempt=1)
    training = Scripted()
    assert retry.run(training) == "callback"
    assert not [c for c in training.calls if c[0] == "train"]
    assert lines[-1].startswith("this fit stopped after epoch 2 (callback)")
    assert retry.history["loss"] == [1.0, 0.5]
    next_fit, _, _ = driver(tmp_path, fit_id="fit-2")
    assert next_fit.run(Scripted()) is None
    assert next_fit.history["loss"] == [1.0, 0.5, 1 / 3, 0.25]


def test_a_resume_inside_an_epoch_joins_every_ranks_position_whatever_the_world_size(tmp_path):
    """3 ranks wrote the rows they trained beside a checkpoint inside epoch 2; a driver of 2
    ranks resumes with their union (what its reader then leaves out) and skips by it, not by
    a share of steps."""
    import numpy as np

    from sparktrain.data.sources.trained_rows import TrainedRows

    run = str(tmp_path / "run")
    checkpoints = Checkpoints(run)
    parts = []
    for rank in range(3):
        done = TrainedRows(90)
        done.add(np.arange(rank * 30, rank * 30 + 8))
        parts.append(done.mask.copy())
        checkpoints.write_rows(1, 4, rank, done.to_bytes())
    checkpoints.write(1, b"state", {"history": {"loss": [1.0]}, "steps": 10, "world_size": 3,
                                    "positions": True}, step=4)
    resumed, _, lines = driver(tmp_path, world_size=2)
    assert resumed.first == 1 and resumed.resume_step == 4
    joined = TrainedRows.from_bytes(resumed.resume_rows)
    assert (joined.mask == np.logical_or.reduce(parts)).all() and joined.count() == 24
    resumed.start(steps=14, description="2 ranks")
    assert resumed.skip == 4 and not any("same share" in line for line in lines)
    # a checkpoint without positions (store rows): the same share of the epoch, as before
    checkpoints.write(1, b"state", {"history": {}, "steps": 10, "world_size": 3}, step=6)
    later, _, lines = driver(tmp_path, world_size=2)
    later.start(steps=14, description="2 ranks")
    assert later.resume_rows is None and later.skip == 8 and any("same share" in x for x in lines)


def test_positions_go_with_their_checkpoint_inside_an_epoch(tmp_path):
    checkpoints = Checkpoints(str(tmp_path / "run"))
    for step in (4, 8):
        for rank in range(2):
            checkpoints.write_rows(1, step, rank, b"rows")
        checkpoints.write(1, b"state", {"positions": True}, step=step)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert [n for n in names if ".rows-" in n] == ["epoch-000001-step-00000008.rows-0",
                                                   "epoch-000001-step-00000008.rows-1"]
    checkpoints.write(2, b"state", {})  # the epoch's end: the last positions go too
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if ".rows-" in p.name]
