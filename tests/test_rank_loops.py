"""The two rank training loops, run without Spark.

``torch_loop.train`` and the ``keras_loop`` child process are what every barrier task runs;
the estimator tests reach them only through a SparkSession, barrier stages and a materialized
dataset, which costs seconds per fit and hides a loop's failure behind Spark's. Here each loop
gets exactly what a barrier task would hand it, built by hand: a Parquet dataset in the layout
materialization writes (``split=train/...``, ``{split: [[file, [rows per row group]]]}``), the
spec the estimator builds, the cloudpickled payload and a one-rank context (torch: a
``RankContext`` whose barrier answers ``allGather`` itself; Keras: the workdir files and the
one-worker ``TF_CONFIG`` the launcher writes). Real torch, TensorFlow, Parquet and checkpoint
files; nothing of sparktrain is mocked.

Full tier: test_keras_worker_process_trains_checkpoints_and_resumes. Only it runs the Keras
worker process more than once on one run, so only it catches a Keras loop that does not resume
from its own checkpoint, write its .keras model into the run's directory, or checkpoint and
answer REGROUP when an elastic generation asks. The quick tier's Keras fits
(test_keras_estimator.py, test_stream.py) are single uninterrupted fits, and its regroup tests
(test_elastic.py) drive the epoch driver with a scripted training.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from typing import Any, Dict, List

import numpy as np
import pytest

ROWS, VAL_ROWS = 256, 64
WEIGHTS = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)


def _write_split(root: str, split: str, rows: int, seed: int, group_rows: int) -> List:
    """One Parquet file of ``split`` as Spark writes it (``features`` array<float>, ``label``
    float); its entry in ``MaterializedDataset.files``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x @ WEIGHTS + 0.5 + 0.01 * rng.normal(size=rows)).astype(np.float32)
    table = pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())),
                      "label": pa.array(y, type=pa.float32())})
    name = f"split={split}/part-00000.parquet"
    os.makedirs(os.path.join(root, f"split={split}"))
    pq.write_table(table, os.path.join(root, name), row_group_size=group_rows)
    groups = [min(group_rows, rows - start) for start in range(0, rows, group_rows)]
    assert [pq.ParquetFile(os.path.join(root, name)).metadata.row_group(i).num_rows
            for i in range(len(groups))] == groups
    return [name, groups]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Dict[str, Any]:
    """Root, layouts and columns (as JSON) of a 256 + 64 row regression dataset."""
    from sparktrain.data.columns import SCALAR, VECTOR, ColumnSpec

    root = str(tmp_path_factory.mktemp("dataset"))
    layouts = {"train": [_write_split(root, "train", ROWS, 0, group_rows=100)],
               "val": [_write_split(root, "val", VAL_ROWS, 1, group_rows=64)]}
    columns = [ColumnSpec("features", VECTOR, "float32", 4).to_json(),
               ColumnSpec("label", SCALAR, "float32", 1).to_json()]
    return {"root": root, "layouts": layouts, "columns": columns}


# -- torch ------------------------------------------------------------------------------------

class _OneRank:
    """The barrier (``allGather``) and the event client (``log``, ``progress``) of a job of
    one rank: what it says is kept."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.events: List[Dict[str, Any]] = []

    def allGather(self, message: str) -> List[str]:  # noqa: N802 - pyspark's name
        return [message]

    def log(self, text: str) -> None:
        self.lines.append(text)

    def progress(self, event: Dict[str, Any]) -> None:
        self.events.append(event)


class StopAfter:
    """A callback asking to stop once ``epochs`` epochs are done."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> bool:
        return epoch + 1 >= self.epochs


@pytest.fixture
def torch_threads():
    """``train`` sets torch's thread count to the task's CPUs: restored for later tests."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def torch_spec(dataset: Dict[str, Any], **changes: Any):
    """The spec ``TorchEstimator._train_spec`` builds for a fit of ``Linear(4, 1)`` with the
    params' defaults (reader options of ``options.horovod.reader_options``, loop options of
    ``EstimatorBase._spec_fields``), plus ``changes``."""
    from sparktrain.options.spec import RowsPlan, TorchTrainSpec

    fields = dict(
        feature_cols=["features"], label_cols=["label"], sample_weight_col=None,
        batch_size=32, val_batch_size=32, epochs=5, shuffle=True, seed=0, backend="torch",
        verbose=1, input_shapes=None, label_shapes=None, loss_weights=None,
        gradient_compression=None, backend_env={}, strategy="ddp",
        train_prefetch=2, val_prefetch=2, reader_pool="thread", train_decode_workers=2,
        val_decode_workers=2, mp_start_method=None,
        rows=RowsPlan(root=dataset["root"], layouts=dataset["layouts"]), columns=dataset["columns"],
        use_gpu=False, storage_options={},
        train_steps=None, val_steps=None, inmemory_cache_all=False, backward_passes_per_step=1,
        scale_learning_rate=False, mixed_precision=None, deadline=None,
        run_path=tempfile.mkdtemp(prefix="sparktrain-run-"))
    fields.update(changes)
    return TorchTrainSpec(**fields)


def initial_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def torch_payload(callbacks: List[Any] = ()) -> bytes:
    """What ``TorchEstimator._payload`` ships: a ``TorchPayload`` with the model and optimizer
    (their weights in a file), the loss, the callbacks and the strategy class."""
    import torch

    from sparktrain.loop.torch_files import ShippedModule, save_weights
    from sparktrain.options.payload import TorchPayload
    from sparktrain.strategies import TORCH_STRATEGIES, load_strategy

    net = initial_net()
    weights = save_weights(net.state_dict(), os.path.join(tempfile.mkdtemp(), "weights.pt"))
    shipped = ShippedModule.of(net, torch.optim.SGD(net.parameters(), lr=0.05), weights)
    return TorchPayload(model=shipped, loss=torch.nn.MSELoss(), callbacks=list(callbacks),
                        strategy=load_strategy(TORCH_STRATEGIES, "ddp")).dumps()


def train_torch(spec: Any, payload: bytes):
    """``torch_loop.train`` as rank 0 of 1; ``(its result, the rank's log/progress)``."""
    from sparktrain.launch.rank_context import RankContext
    from sparktrain.loop.torch_loop import train

    job = _OneRank()
    ctx = RankContext(rank=0, world_size=1, hosts=["127.0.0.1"], cpus=1, resources={},
                      barrier=job, client=job, attempt=0)
    return train(spec, payload, ctx), job


def test_torch_loop_trains_validates_and_reports(dataset, torch_threads):

    import torch

    result, job = train_torch(torch_spec(dataset), torch_payload())

    losses = result["history"]["loss"]
    assert len(losses) == 5 and len(result["history"]["val_loss"]) == 5
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert result["history"]["val_loss"][-1] < 0.5 * result["history"]["val_loss"][0]
    assert result["stop_reason"] is None and result["output_shapes"] == [[1]]
    net = initial_net()

    def distance(m):
        return float((m.weight.detach().ravel() - torch.from_numpy(WEIGHTS)).abs().sum())

    before = distance(net)
    net.load_state_dict(torch.load(result["weights_file"].local_path(), weights_only=True))
    assert distance(net) < 0.5 * before  # the weights moved toward the data's

    kinds = [e["event"] for e in job.events]
    assert kinds[0] == "start" and kinds.count("epoch") == 5 and "step" in kinds
    assert job.events[0] == {"event": "start", "epochs": 5, "steps": 8, "first": 0}
    steps = [e for e in job.events if e["event"] == "step"]
    assert {e["epoch"] for e in steps if e["step"] == 8} == set(range(5))  # each epoch's last
    assert any("8 steps/epoch" in line for line in job.lines)
    assert sum(line.startswith("epoch ") for line in job.lines) == 5


def test_torch_loop_checkpoints_and_a_second_fit_resumes(dataset, tmp_path, torch_threads):
    from sparktrain.loop.checkpoint import Checkpoints

    run = str(tmp_path / "run")
    first, _ = train_torch(torch_spec(dataset, epochs=3, run_path=run), torch_payload())
    latest = Checkpoints(run).latest()
    assert latest is not None and latest.epochs_done == 3
    assert latest.meta["history"]["loss"] == first["history"]["loss"]
    assert os.listdir(os.path.join(run, "tensorboard"))  # rank 0's event files

    # the same run with more epochs: a fresh model, which the checkpoint's state replaces
    second, job = train_torch(torch_spec(dataset, epochs=5, run_path=run), torch_payload())
    assert any("resuming from the checkpoint after epoch 3" in line for line in job.lines)
    assert job.events[0]["first"] == 3
    assert second["history"]["loss"][:3] == first["history"]["loss"]
    # epoch 4 starts from epoch 3's weights: its loss is below epoch 3's, not a fresh start's
    assert second["history"]["loss"][3] < first["history"]["loss"][2]
    assert [a["start_epoch"] for a in second["attempts"]] == [0, 3]
    assert Checkpoints(run).latest().epochs_done == 5


def test_a_torch_callback_stops_training_early(dataset, tmp_path, torch_threads):
    from sparktrain.loop.checkpoint import Checkpoints

    run = str(tmp_path / "run")
    result, job = train_torch(torch_spec(dataset, epochs=5, run_path=run),
                              torch_payload([StopAfter(2)]))
    assert result["stop_reason"] == "callback"
    assert len(result["history"]["loss"]) == 2
    assert Checkpoints(run).latest().epochs_done == 2
    assert any("training stopped after epoch 2" in line for line in job.lines)


# -- Keras --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_keras_worker_process_trains_checkpoints_and_resumes(dataset, tmp_path):
    from sparktrain.launch.tf_multiworker import child_environment, tf_config
    from sparktrain.launch.tf_protocol import (
        ERROR_FILE,
        PROGRESS_PREFIX,
        RESULT_FILE,
        WORKER_MODULE,
        write_inputs,
    )
    from sparktrain.loop.checkpoint import Checkpoints
    from sparktrain.loop.keras_saving import keras_module, model_bytes
    from sparktrain.options.payload import KerasPayload
    from sparktrain.options.spec import KerasTrainSpec, RowsPlan
    from sparktrain.strategies import KERAS_STRATEGIES, load_strategy

    keras = keras_module()
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    strategy = load_strategy(KERAS_STRATEGIES, "multi_worker_mirrored")
    # what KerasEstimator._payload ships
    payload = KerasPayload(model=model_bytes(net),
                           optimizer=keras.optimizers.serialize(keras.optimizers.SGD(0.05)),
                           loss="mse", metrics=["mae"], strategy=strategy).dumps()
    run = str(tmp_path / "run")
    spec = KerasTrainSpec(
        rows=RowsPlan(root=dataset["root"], layouts=dataset["layouts"]), columns=dataset["columns"],
        feature_cols=["features"], label_cols=["label"], sample_weight_col=None, batch_size=32,
        val_batch_size=32, epochs=2, shuffle=True, seed=0, verbose=1, backend="tensorflow",
        strategy="multi_worker_mirrored", storage_options={}, input_shapes=[[-1, 4]],
        backend_env={}, strategy_options=strategy.check("multi_worker_mirrored", "tensorflow",
                                                        1, {}),
        run_path=run, rank=0, world_size=1)

    def fit(epochs: int, workdir: str, **changes):
        """The child process as ``spawn_keras_worker`` starts it (one-worker TF_CONFIG)."""
        os.makedirs(workdir)
        write_inputs(workdir, replace(spec, epochs=epochs, **changes), payload)
        env = child_environment(tf_config([f"127.0.0.1:{_free_port()}"], 0), None)
        done = subprocess.run([sys.executable, "-m", WORKER_MODULE, workdir], env=env,
                              capture_output=True, text=True, timeout=150)
        error = os.path.join(workdir, ERROR_FILE)
        assert done.returncode == 0, open(error).read() if os.path.exists(error) else \
            done.stdout[-3000:] + done.stderr[-3000:]
        with open(os.path.join(workdir, RESULT_FILE), "rb") as f:
            return pickle.load(f), done.stdout

    first, out = fit(2, str(tmp_path / "first"))
    history = first["history"]
    assert sorted(history) == ["loss", "mae", "val_loss", "val_mae"]
    assert len(history["loss"]) == 2 and history["loss"][1] < history["loss"][0]
    assert first["stop_reason"] is None and first["output_shapes"] == [[1]]
    # split on "\n" as the launcher reads lines: str.splitlines() also splits at the prefix's \x1e
    events = [line for line in out.split("\n") if line.startswith(PROGRESS_PREFIX)]
    assert '"event": "start"' in events[0] and sum('"event": "epoch"' in e for e in events) == 2
    assert Checkpoints(run).latest().epochs_done == 2
    assert os.listdir(os.path.join(run, "tensorboard"))  # rank 0's event files

    second, out = fit(3, str(tmp_path / "second"))
    assert "resuming from the checkpoint after epoch 2" in out
    assert second["history"]["loss"][:2] == history["loss"]
    assert second["history"]["loss"][2] < history["loss"][1]
    assert [a["start_epoch"] for a in second["attempts"]] == [0, 2]
    assert Checkpoints(run).latest().epochs_done == 3

    path = second["model"].local_path()  # rank 0 wrote it into the run's directory
    assert path.startswith(run) and path.endswith(".keras")
    fitted = keras.saving.load_model(path, compile=False)
    x = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)

    def mean_error(model):
        return np.abs(model(x).numpy().ravel() - (x @ WEIGHTS + 0.5)).mean()

    assert mean_error(fitted) < 0.5 * mean_error(net)

    # an elastic generation asked to regroup: the child checkpoints its epoch and says so
    from sparktrain.launch.elastic import REGROUP, Generation

    flag = tmp_path / "regroup-1"
    flag.write_text("regroup")
    generation = Generation(1, 2, 1, "global", str(flag)).to_json()
    third, out = fit(5, str(tmp_path / "third"), generation=generation)
    assert third == REGROUP and "regrouping after epoch 4" in out
    latest = Checkpoints(run).latest()
    assert latest.epochs_done == 4 and latest.meta["history"]["num_proc"] == [1.0]
