"""Checkpoints inside an epoch (``checkpoint_steps``, ``checkpoint_seconds``) and the exact
mid-epoch resume: the reader's ``skip``, the trigger the ranks agree on, the checkpoints' names
and pruning, and the torch rank loop interrupted at 40% of an epoch and resumed (no Spark).
Real fits through Spark (Ctrl-C, a killed rank, Keras): tests/test_mid_epoch_fits.py.

Full tier: test_a_keras_fit_interrupted_inside_an_epoch_resumes_there_exactly. Only it cuts and
resumes the Keras worker process inside an epoch, so only it catches Keras mid-epoch checkpoints
(taken between calls of several steps, steps_per_execution=3) or a Keras resume that does not
train exactly the rest of the epoch to the uncut fit's losses; the quick tier's exact resume is
the torch loop's."""
from __future__ import annotations

import os
from typing import Any, Dict, List

import numpy as np
import pytest
from test_reader import COLUMNS, write_dataset

from sparktrain.data.epoch_steps import take_steps
from sparktrain.data.reader import ShardReader
from sparktrain.loop.checkpoint import Checkpoints
from sparktrain.loop.epochs import CheckpointTrigger

# -- the reader's skip ------------------------------------------------------------------------


def _ids(batches) -> List[List[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("skip", [1, 3, 4, 9])
def test_an_epoch_resumed_after_skip_batches_is_the_rest_of_the_whole_epoch(tmp_path, shuffle,
                                                                             skip):
    layout = write_dataset(tmp_path, [23, 17, 31], row_group_size=7)  # 71 rows, uneven groups

    def reader(**options):
        return ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 7, shuffle, seed=5, **options)

    whole = _ids(reader().epoch(2))
    assert len(whole) == 11
    assert _ids(reader().epoch(2, skip=skip)) == whole[skip:]
    assert _ids(take_steps(reader(), 2, None, skip)) == whole[skip:]

    # the local cache: epochs after the first shuffle over the whole shard; a fresh reader
    # resuming such an epoch ("cache") fills its cache first and gives the same batches
    cached = reader(local_cache=True)
    list(cached.epoch(0))
    assert cached.local_cache_complete
    full = _ids(cached.epoch(1))
    assert cached.order == "cache"
    assert _ids(cached.epoch(1, skip=skip)) == full[skip:]
    fresh = reader(local_cache=True)
    assert _ids(fresh.epoch(1, skip=skip, order="cache")) == full[skip:]
    assert fresh.order == "cache"
    # an epoch that read the files, resumed by a reader whose cache is complete
    assert _ids(cached.epoch(2, skip=skip, order="files")) == whole[skip:]
    for r in (cached, fresh):
        r.close()


def test_take_steps_skips_across_passes(tmp_path):
    layout = write_dataset(tmp_path, [40], row_group_size=8)
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 8, True, seed=1)
    whole = _ids(take_steps(reader, 0, 12))  # 5 batches a pass: 2 passes and 2 batches
    assert len(whole) == 12
    for skip in (2, 5, 7, 11):
        assert _ids(take_steps(reader, 0, 12, skip)) == whole[skip:]
    assert _ids(take_steps(reader, 0, 12, 12)) == []


def test_skipped_row_groups_are_not_read(tmp_path, monkeypatch):
    layout = write_dataset(tmp_path, [64], row_group_size=8)
    reader = ShardReader(str(tmp_path), layout, COLUMNS, 0, 1, 8, False)
    read: List[Any] = []
    original = reader._read
    monkeypatch.setattr(reader, "_read", lambda piece: read.append(piece) or original(piece))
    assert len(list(reader.epoch(0, skip=6))) == 2
    assert len(read) == 2  # the 6 groups of the skipped batches stayed unread


# -- when the ranks checkpoint -----------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(world: int, step_seconds: List[float], count: int, **options):
    """``world`` ranks (threads) of ``count`` optimizer steps each, rank r's taking
    ``step_seconds[r]`` on its own fake clock, with a real all-reduce between them; the steps
    where each rank checkpoints, the collectives made, and the triggers."""
    import threading

    barrier = threading.Barrier(world)
    sent: Dict[int, List[float]] = {}
    collectives = [0]

    def all_reduce(rank: int, values) -> List[float]:
        sent[rank] = list(values)
        barrier.wait()
        summed = list(np.sum([sent[r] for r in range(world)], axis=0))
        if rank == 0:
            collectives[0] += 1
        barrier.wait()
        return summed

    clocks = [_Clock() for _ in range(world)]
    triggers = [CheckpointTrigger(rank=r, world_size=world, clock=clocks[r], probe=4, **options)
                for r in range(world)]
    due: List[List[int]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        reduce = lambda values: all_reduce(r, values)  # noqa: E731
        for step in range(1, count + 1):
            clocks[r].now += step_seconds[r]
            if triggers[r].advance(1, reduce):
                due[r].append(step)
                summed = reduce([0.0] + triggers[r].timing())  # the checkpoint's collective
                triggers[r].saved(triggers[r].agree_values(summed))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return due, collectives[0], triggers


def test_checkpoint_steps_fire_every_n_steps_on_every_rank():
    due, collectives, _ = _run(2, [0.1, 0.1], 23, steps=5, seconds=None)
    assert due[0] == due[1] == [5, 10, 15, 20]
    assert collectives == 4  # the checkpoints' own; no agreement needed between them


def test_checkpoint_seconds_become_a_step_interval_of_the_slowest_rank():
    # a checkpoint a second; rank 1 takes 0.1 s a step: every 10 steps, agreed after 4 timed
    due, collectives, triggers = _run(2, [0.05, 0.1], 40, steps=None, seconds=1.0)
    assert due[0] == due[1] == [10, 20, 30, 40]
    assert triggers[0].every == triggers[1].every == 10
    assert collectives == 1 + 4  # one probe, then only the checkpoints' collectives


def test_the_trigger_is_off_without_steps_or_seconds():
    trigger = CheckpointTrigger(None, None, 0, 1)
    assert not trigger.active
    assert not any(trigger.advance(1, lambda v: 1 / 0) for _ in range(100))


def test_the_first_step_is_not_timed():
    clock = _Clock()
    trigger = CheckpointTrigger(None, 10.0, 0, 1, clock=clock, probe=2)
    clock.now = 100.0  # a first step that compiled for 100 s
    assert not trigger.advance(1, lambda v: v)
    for _ in range(2):
        clock.now += 1.0
        trigger.advance(1, lambda v: v)
    assert trigger.every == 10  # 1 s a step, not (100 + 2) / 3


# -- names and pruning ----------------------------------------------------------------------

def test_checkpoints_inside_epochs_are_the_latest_and_pruned_when_a_newer_one_is_written(
        tmp_path):
    ckpts = Checkpoints(str(tmp_path / "run"))
    ckpts.write(1, b"end1", {"history": {}})
    ckpts.write(1, b"mid3", {"history": {}}, step=3)
    latest = ckpts.latest()
    assert (latest.epochs_done, latest.step) == (1, 3)
    assert ckpts.latest_intact()[1] == b"mid3"
    ckpts.write(1, b"mid6", {"history": {}}, step=6)
    names = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert names == ["epoch-000001-step-00000006.ckpt", "epoch-000001-step-00000006.json",
                     "epoch-000001.ckpt", "epoch-000001.json"]
    ckpts.write(2, b"end2", {"history": {}})
    ckpts.write(3, b"end3", {"history": {}})
    names = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert names == ["epoch-000002.ckpt", "epoch-000002.json", "epoch-000003.ckpt",
                     "epoch-000003.json"]
    assert ckpts.latest().step == 0 and ckpts.latest().epochs_done == 3
    # a damaged newest checkpoint inside an epoch: the epoch end before it is taken
    ckpts.write(3, b"mid2", {"history": {}}, step=2)
    with open(tmp_path / "run" / "checkpoints" / "epoch-000003-step-00000002.ckpt", "wb") as f:
        f.write(b"xx")
    warned: List[str] = []
    latest, data = ckpts.latest_intact(warn=warned.append)
    assert (latest.epochs_done, latest.step, data) == (3, 0, b"end3") and warned


# -- the torch rank loop, interrupted inside an epoch and resumed ------------------------------

class CountAndFail:
    """transformation_fn: appends a line per batch to ``path``; raises at batch ``fail_at``
    (counted over the whole fit; 0: never)."""

    def __init__(self, path: str, fail_at: int = 0) -> None:
        self.path, self.fail_at = path, fail_at

    def __call__(self, batch):
        with open(self.path, "a") as f:
            f.write("b\n")
        if self.fail_at and _lines(self.path) == self.fail_at:
            raise RuntimeError("the rank dies here")
        return batch


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def test_a_torch_fit_interrupted_inside_an_epoch_resumes_there_exactly(tmp_path):
    import torch
    from test_rank_loops import dataset as _  # noqa: F401 - the fixture's module
    from test_rank_loops import torch_payload, torch_spec, train_torch

    from sparktrain.options.payload import TorchPayload

    data = _rank_loop_dataset(tmp_path)
    threads = torch.get_num_threads()

    def payload(transformation):
        shipped = TorchPayload.loads(torch_payload())
        shipped.transformation_fn = transformation
        return shipped.dumps()

    def spec(run, **changes):  # 256 rows in batches of 8: 32 steps an epoch, checkpoints
        # every 3 (about a tenth of an epoch); no prefetch: batches counted as trained
        return torch_spec(data, epochs=3, batch_size=8, run_path=str(run), checkpoint_steps=3,
                          train_prefetch=0, **changes)

    try:
        whole, _ = train_torch(spec(tmp_path / "whole"), payload(None))
        count = str(tmp_path / "count")
        with pytest.raises(Exception, match="the rank dies here"):  # 40% into epoch 2
            train_torch(spec(tmp_path / "cut"), payload(CountAndFail(count, 32 + 13)))
        latest = Checkpoints(str(tmp_path / "cut")).latest()
        # the feed transforms a batch or two ahead of the step that trains it
        at = latest.step
        assert latest.epochs_done == 1 and at in (9, 12), (latest.epochs_done, at)
        again = str(tmp_path / "again")
        resumed, job = train_torch(spec(tmp_path / "cut"), payload(CountAndFail(again)))
    finally:
        torch.set_num_threads(threads)
    assert any(f"resuming from the checkpoint after epoch 1 and step {at} of epoch 2" in line
               for line in job.lines)
    assert _lines(again) == (32 - at) + 32  # the rest of epoch 2, then epoch 3
    assert resumed["attempts"][-1] == {"attempt": 0, "start_epoch": 1, "start_step": at}
    # the same batches, the same updates: the same model and history as the uncut fit
    np.testing.assert_allclose(resumed["history"]["loss"], whole["history"]["loss"], rtol=1e-5)
    steps = [e for e in job.events if e["event"] == "step"]
    assert steps[0]["epoch"] == 1 and steps[0]["step"] > at  # progress goes on from there
    first = torch.load(whole["weights_file"].local_path(), weights_only=True)
    second = torch.load(resumed["weights_file"].local_path(), weights_only=True)
    for key in first:
        torch.testing.assert_close(first[key], second[key])


def _rank_loop_dataset(tmp_path) -> Dict[str, Any]:
    """test_rank_loops' training split (256 rows, no validation: every batch counted is a
    training batch), written here."""
    from test_rank_loops import _write_split

    from sparktrain.data.columns import SCALAR, VECTOR, ColumnSpec

    root = str(tmp_path / "dataset")
    os.makedirs(root)
    return {"root": root,
            "layouts": {"train": [_write_split(root, "train", 256, 0, group_rows=40)]},
            "columns": [ColumnSpec("features", VECTOR, "float32", 4).to_json(),
                        ColumnSpec("label", SCALAR, "float32", 1).to_json()]}


@pytest.mark.timeout(240)
@pytest.mark.full  # Keras: TensorFlow worker processes of their own
def test_a_keras_fit_interrupted_inside_an_epoch_resumes_there_exactly(tmp_path):
    import pickle
    import socket
    import subprocess
    import sys
    from dataclasses import replace

    from sparktrain.launch.tf_multiworker import child_environment, tf_config
    from sparktrain.launch.tf_protocol import ERROR_FILE, RESULT_FILE, WORKER_MODULE, write_inputs
    from sparktrain.loop.keras_saving import keras_module, model_bytes
    from sparktrain.options.payload import KerasPayload
    from sparktrain.options.spec import KerasTrainSpec, RowsPlan
    from sparktrain.strategies import KERAS_STRATEGIES, load_strategy

    data = _rank_loop_dataset(tmp_path)
    keras = keras_module()
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    strategy = load_strategy(KERAS_STRATEGIES, "multi_worker_mirrored")

    def payload(transformation) -> bytes:
        return KerasPayload(model=model_bytes(net),
                            optimizer=keras.optimizers.serialize(keras.optimizers.SGD(0.05)),
                            loss="mse", metrics=["mae"], strategy=strategy,
                            transformation_fn=transformation).dumps()

    # 32 steps an epoch, 3 a call and a checkpoint every 3 (about a tenth of an epoch)
    spec = KerasTrainSpec(
        rows=RowsPlan(root=data["root"], layouts=data["layouts"]), columns=data["columns"],
        feature_cols=["features"], label_cols=["label"], sample_weight_col=None, batch_size=8,
        epochs=3, shuffle=True, seed=0, verbose=1, backend="tensorflow",
        strategy="multi_worker_mirrored", storage_options={}, input_shapes=[[-1, 4]],
        backend_env={}, strategy_options=strategy.check("multi_worker_mirrored", "tensorflow",
                                                        1, {}),
        steps_per_execution=3, checkpoint_steps=3, train_prefetch=0, rank=0, world_size=1)

    def fit(name: str, run: str, transformation=None):
        workdir = str(tmp_path / name)
        os.makedirs(workdir)
        write_inputs(workdir, replace(spec, run_path=run), payload(transformation))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = child_environment(tf_config([f"127.0.0.1:{port}"], 0), None)
        done = subprocess.run([sys.executable, "-m", WORKER_MODULE, workdir], env=env,
                              capture_output=True, text=True, timeout=200)
        error = os.path.join(workdir, ERROR_FILE)
        if done.returncode:
            return open(error).read() if os.path.exists(error) else done.stderr[-3000:], \
                done.stdout
        with open(os.path.join(workdir, RESULT_FILE), "rb") as f:
            return pickle.load(f), done.stdout

    whole, _ = fit("whole", str(tmp_path / "whole-run"))
    cut = str(tmp_path / "cut-run")
    failed, _ = fit("cut", cut, CountAndFail(str(tmp_path / "count"), 32 + 13))
    assert "the rank dies here" in failed
    latest = Checkpoints(cut).latest()
    at = latest.step
    assert latest.epochs_done == 1 and at in (9, 12), (latest.epochs_done, at)
    again = str(tmp_path / "again")
    resumed, out = fit("resumed", cut, CountAndFail(again))
    assert f"resuming from the checkpoint after epoch 1 and step {at} of epoch 2" in out
    # the rest of epoch 2 and epoch 3 (and the one row output_shapes reads after training)
    assert _lines(again) - 1 == (32 - at) + 32
    assert resumed["attempts"][-1]["start_step"] == at
    np.testing.assert_allclose(resumed["history"]["loss"], whole["history"]["loss"], rtol=1e-4)
