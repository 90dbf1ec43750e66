"""strategy="fsdp": 2 real gloo ranks shard an MLP with FSDP2 on the digits data; what a fit
promises (validation, metrics, callbacks, checkpoints, resume after a killed rank, transform,
save/load) holds, and activation checkpointing really recomputes.

Full tier: test_fsdp_resumes_after_a_killed_rank. Only it kills an FSDP rank (SIGKILL mid-epoch),
so only it catches a retried attempt that cannot re-shard the model and load the checkpoint
FSDP itself gathered and wrote. The quick tier resumes under FSDP only in a new fit, from a DDP
run's checkpoint (test_a_ddp_run_resumes_under_fsdp)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sparktrain import TorchEstimator, TorchModel
from sparktrain.data.store import Store
from sparktrain.loop.checkpoint import Checkpoints
from support.helpers import KillRankOnce


@pytest.fixture(scope="module")
def digits(spark):
    """The 1797 digits as ``features`` (array of 64 floats in [0, 1]) and ``label``; 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [((x / 16.0).tolist(), int(y)) for x, y in zip(data.data, data.target, strict=True)]
    df = spark.createDataFrame(rows, "features array<double>, label int")
    train, test = df.randomSplit([0.8, 0.2], seed=3)
    return train.cache(), test.cache()


def _mlp(seed: int = 0):
    import torch

    class Residual(torch.nn.Module):
        """A block counting how often its forward runs (recomputation included)."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + torch.relu(self.linear(x))

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), Residual(96),
                              Residual(96), torch.nn.Linear(96, 10))
    return net, Residual


def _estimator(store, **overrides):
    import torch

    net, _ = _mlp()
    params = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                  label_cols=["label"], batch_size=32, epochs=6, random_seed=1, store=store,
                  verbose=0, strategy="fsdp")
    params.update(overrides)
    return TorchEstimator(**params)


def _accuracy(model, df) -> float:
    out = model.transform(df).select("label", "label__output").toPandas()
    return float((np.stack(out["label__output"]).argmax(axis=1) == out["label"]).mean())


class RecordShards:
    """Writes, on each rank, how many parameters it holds while training and how often the
    Residual blocks ran, to ``<folder>/rank-<r>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.model = None

    def on_train_begin(self, model, history):
        self.model = model

    def on_epoch_end(self, epoch, logs):
        from pyspark import BarrierTaskContext

        from sparktrain.strategies.torch_blocks import local_parameter_count

        held, total = local_parameter_count(self.model)
        kinds = sorted({type(p).__name__ for p in self.model.parameters()})
        calls = [m.calls for m in self.model.modules() if hasattr(m, "calls")]
        rank = BarrierTaskContext.get().partitionId()
        with open(os.path.join(self.folder, f"rank-{rank}.json"), "w") as f:
            json.dump({"held": held, "total": total, "kinds": kinds, "calls": calls,
                       "epoch": epoch}, f)


def test_fsdp_fit_shards_parameters_and_matches_ddp(spark, digits, store, tmp_path):
    train, test = digits
    record = RecordShards(str(tmp_path))
    est = _estimator(store, callbacks=[record], validation=0.1,
                     metrics=[("acc", lambda out, y: (out.argmax(1) == y).float().mean())],
                     backward_passes_per_step=2, fsdp_wrap=2000)
    model = est.fit(train)
    history = model.getHistory()
    assert len(history["loss"]) == 6 and history["loss"][-1] < history["loss"][0]
    assert history["val_acc"][-1] > 0.85
    for rank in (0, 1):
        seen = json.load(open(tmp_path / f"rank-{rank}.json"))
        assert seen["kinds"] == ["DTensor"]  # every parameter is sharded
        assert abs(seen["held"] - seen["total"] / 2) <= 64, seen  # half, up to row padding
    fsdp_accuracy = _accuracy(model, test)
    assert fsdp_accuracy >= 0.9

    ddp = _estimator(store, strategy="ddp", backward_passes_per_step=2).fit(train)
    assert abs(_accuracy(ddp, test) - fsdp_accuracy) < 0.05

    # the fitted model holds an ordinary module: it saves, loads and predicts the same
    assert type(model.getModel()).__name__ == "Sequential"
    assert all(type(p).__name__ == "Parameter" for p in model.getModel().parameters())
    path = str(tmp_path / "fsdp model")
    model.write().overwrite().save(path)
    assert _accuracy(TorchModel.load(path), test) == fsdp_accuracy
    # the optimizer state of the last epoch is there, in torch's usual index-keyed form
    state = model.getOptimizer().state_dict()["state"]
    assert sorted(state) == list(range(len(list(model.getModel().parameters()))))


def test_activation_checkpointing_recomputes_blocks(spark, digits, store, tmp_path):
    train, _ = digits
    import torch

    counts = {}
    for strategy in ("fsdp", "ddp"):
        folder = tmp_path / strategy
        folder.mkdir()
        net, residual = _mlp()
        est = _estimator(store, strategy=strategy, epochs=1, train_steps_per_epoch=5,
                         model=net, optimizer=torch.optim.Adam(net.parameters()),
                         callbacks=[RecordShards(str(folder))],
                         activation_checkpointing=[residual])
        est.fit(train)
        counts[strategy] = json.load(open(folder / "rank-0.json"))["calls"]
    # 5 training steps: each block runs forward, then again in backward
    assert counts == {"fsdp": [10, 10], "ddp": [10, 10]}


@pytest.mark.parametrize("precision", [dict(mixed_precision="bf16"),
                                       dict(gradient_compression="fp16")])
def test_fsdp_reduced_precision_trains(spark, digits, store, precision):
    # bf16: blocks gathered and computed in bf16 (FSDP's policy + autocast); fp16 compression:
    # gradients reduce-scattered in float16
    train, test = digits
    model = _estimator(store, epochs=4, **precision).fit(train)
    assert _accuracy(model, test) >= 0.85


def test_cpu_offload_on_cpu_ranks_warns_and_trains(spark, digits, store):
    train, _ = digits
    with pytest.warns(UserWarning, match="fsdp_cpu_offload"):
        model = _estimator(store, epochs=1, fsdp_cpu_offload=True).fit(train)
    assert len(model.getHistory()["loss"]) == 1


@pytest.mark.full
def test_fsdp_resumes_after_a_killed_rank(spark, digits, store, tmp_path):
    train, test = digits
    # about 22 steps per epoch per rank: the 60th batch is in epoch 3
    est = _estimator(store, run_id="fsdp-kill", epochs=4, verbose=1,
                     transformation_fn=KillRankOnce(str(tmp_path / "killed"), 60))
    model = est.fit(train)
    assert os.path.exists(tmp_path / "killed"), "the fault was not injected"
    latest = Checkpoints(Store.create(store).run_path("fsdp-kill")).latest()
    assert latest.epochs_done == 4 and latest.meta["strategy"] == "fsdp"
    assert [(a["attempt"], a["start_epoch"]) for a in latest.meta["attempts"]] == [(0, 0), (1, 2)]
    assert _accuracy(model, test) >= 0.9


def test_bad_strategy_configurations_fail_before_launch(spark, digits, store):
    import torch

    train, _ = digits
    cases = [
        (dict(backend="horovod"), "strategy='fsdp' needs backend='torch'"),
        (dict(strategy="ddp", fsdp_wrap=[torch.nn.Linear]), "fsdp_wrap is for strategy='fsdp'"),
        (dict(fsdp_wrap=[torch.nn.Conv2d]), "no submodule of class Conv2d"),
        (dict(activation_checkpointing=True), "activation_checkpointing=True"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            _estimator(store, **overrides).fit(train)
    with pytest.raises(ValueError, match="strategy must be one of"):
        _estimator(store, strategy="zero3")


def test_a_ddp_run_resumes_under_fsdp(spark, digits, store):
    train, test = digits
    _estimator(store, strategy="ddp", run_id="ddp-then-fsdp", epochs=2).fit(train)
    model = _estimator(store, run_id="ddp-then-fsdp", epochs=4).fit(train)
    latest = Checkpoints(Store.create(store).run_path("ddp-then-fsdp")).latest()
    assert [(a["attempt"], a["start_epoch"]) for a in latest.meta["attempts"]] == [(0, 0), (0, 2)]
    assert len(model.getHistory()["loss"]) == 4 and _accuracy(model, test) >= 0.9


def test_estimator_with_strategy_params_saves_and_loads(spark, store, tmp_path):
    import torch

    est = _estimator(store, fsdp_wrap=[torch.nn.Linear], activation_checkpointing=True)
    est.write().overwrite().save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.getStrategy() == "fsdp" and loaded.getFsdpWrap() == [torch.nn.Linear]
    assert loaded.getActivationCheckpointing() is True
