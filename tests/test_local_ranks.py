"""Several ranks in one task (launch.local_ranks), without Spark: real processes, one per
(fake) GPU, joined into one torch.distributed group; a failing rank stops its peers; a task's
streamed rows dealt to its ranks. The Spark side is tests/test_gpu_clusters.py."""
from __future__ import annotations

import os
import time

import pytest

from sparktrain.launch.local_ranks import run_places
from sparktrain.launch.rank_context import Place
from sparktrain.launch.rank_run import FAILURE_TAG


def places(gpus, host="127.0.0.1"):
    return [Place(i, len(gpus), [host] * len(gpus), 1, {"gpu": [gpu]}, 0, i, len(gpus))
            for i, gpu in enumerate(gpus)]


def where(tmp_path):
    return (str(tmp_path / "launch"), None, False, 2)


def ddp_rank(ctx):
    """A rank that joins the fit's process group on its device and sums the ranks."""
    import torch

    from sparktrain.launch.torch_ddp import TorchDDP
    from sparktrain.loop.torch_batch import select_device

    device = select_device(ctx, True)
    engine = TorchDDP(ctx, device)
    total = engine.all_reduce_sum(torch.tensor([ctx.rank + 1.0]))
    engine.close()
    return {"device": str(device), "sum": float(total),
            "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE",
                                                   "LOCAL_RANK", "LOCAL_WORLD_SIZE")}}


def failing_rank(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1's bug")
    time.sleep(120)  # its peer's failure stops it


def spooled_rows(ctx):
    import pyarrow as pa

    return {split: [pa.ipc.open_file(path).read_all().column("x").to_pylist(), most]
            for split, (path, most, *_) in ctx.task_input.files.items()}


@pytest.mark.stack  # the classic stack's torch and pyspark too
def test_each_local_rank_sees_its_own_gpu_in_one_group(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKTRAIN_FAKE_GPUS", "5,6")  # ranks given GPUs train on the CPU
    results = dict(run_places(ddp_rank, where(tmp_path), places(["5", "6"])))
    assert sorted(results) == [0, 1]
    for rank, gpu in ((0, "5"), (1, "6")):
        assert results[rank]["env"] == {"CUDA_VISIBLE_DEVICES": gpu, "RANK": str(rank),
                                        "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                        "LOCAL_WORLD_SIZE": "2"}
        assert results[rank]["device"] == "cpu" and results[rank]["sum"] == 3.0


def test_a_failing_rank_stops_its_peers(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        run_places(failing_rank, where(tmp_path), places(["0", "1"]))
    assert time.monotonic() - started < 60  # not the peer's 120 s sleep
    text = str(error.value)
    assert text.startswith(f"{FAILURE_TAG} rank=1\n") and "ValueError: rank 1's bug" in text


def test_a_tasks_streamed_rows_are_dealt_to_its_ranks(tmp_path):
    import pyarrow as pa

    from sparktrain.data.columns import SPLIT_COL
    from sparktrain.data.sources.shuffled import ShuffledRows

    def batch(start, rows):
        return pa.RecordBatch.from_pydict({
            "x": list(range(start, start + rows)),
            SPLIT_COL: ["val" if i % 4 == 0 else "train" for i in range(start, start + rows)]})

    gathered = []

    def all_gather(text):  # this task's counts and another task's, one rank more rows
        import json

        gathered.append(json.loads(text))
        return [text, json.dumps([{"train": 16, "val": 4}, {"train": 16, "val": 4}])]

    rows = ShuffledRows(iter([batch(0, 10), batch(10, 6)]))
    results = dict(run_places(spooled_rows, where(tmp_path), places(["0", "1"]), rows,
                              all_gather))
    # each local rank's rows; the rows' ids' extents (none here: no ids came with them)
    assert gathered == [[{"train": 5, "val": 3, "extents": {}},
                         {"train": 7, "val": 1, "extents": {}}]]
    train = results[0]["train"][0] + results[1]["train"][0]
    assert sorted(train) == [i for i in range(16) if i % 4]  # every row once
    assert results[0]["train"][1] == results[1]["train"][1] == 16  # the most any rank got
    assert sorted(results[0]["val"][0] + results[1]["val"][0]) == [0, 4, 8, 12]


class ShardProbe:
    """A training callback noting, per rank, whether the model's parameters are FSDP2 shards
    (DTensors) and the process group's size."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_begin(self, model, history):
        import json

        import torch.distributed as dist

        param = next(model.parameters())
        with open(os.path.join(self.folder, f"rank-{dist.get_rank()}.json"), "w") as out:
            json.dump({"sharded": hasattr(param, "to_local"),
                       "world_size": dist.get_world_size()}, out)

    def on_epoch_end(self, epoch, logs):
        return False


def rank_loop(spec, payload, ctx):
    from sparktrain.loop.torch_loop import train

    return train(spec, payload, ctx)


def test_local_ranks_train_fsdp_shards_in_one_group(tmp_path, monkeypatch):
    """The rank loop with strategy="fsdp" in two local-rank processes (fake GPUs: gloo)."""
    import functools
    import json

    import torch
    from test_rank_loops import ROWS, VAL_ROWS, _write_split, torch_spec

    from sparktrain.data.columns import SCALAR, VECTOR, ColumnSpec
    from sparktrain.loop.torch_files import ShippedModule, save_weights
    from sparktrain.options.payload import TorchPayload
    from sparktrain.strategies import TORCH_STRATEGIES, load_strategy

    root = str(tmp_path / "data")
    data = {"root": root,
            "layouts": {"train": [_write_split(root, "train", ROWS, 0, group_rows=100)],
                        "val": [_write_split(root, "val", VAL_ROWS, 1, group_rows=64)]},
            "columns": [ColumnSpec("features", VECTOR, "float32", 4).to_json(),
                        ColumnSpec("label", SCALAR, "float32", 1).to_json()]}
    run = tmp_path / "run"
    run.mkdir()
    spec = torch_spec(data, strategy="fsdp", use_gpu=True, run_path=str(run), epochs=4)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    weights = save_weights(net.state_dict(), str(tmp_path / "weights.pt"))
    payload = TorchPayload(
        model=ShippedModule.of(net, torch.optim.SGD(net.parameters(), lr=0.02), weights),
        loss=torch.nn.MSELoss(), callbacks=[ShardProbe(str(tmp_path))],
        strategy=load_strategy(TORCH_STRATEGIES, "fsdp"), fsdp_wrap=[torch.nn.Linear],
        strategy_options={"fsdp_wrap": [torch.nn.Linear]}).dumps()
    monkeypatch.setenv("SPARKTRAIN_FAKE_GPUS", "0,1")
    results = dict(run_places(functools.partial(rank_loop, spec, payload), where(tmp_path),
                              places(["0", "1"])))
    losses = results[0]["history"]["loss"]
    assert losses[-1] < losses[0] / 2
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen == {"sharded": True, "world_size": 2}
