"""Fits on a ``local[4]`` session of their own (the shared test session has 2 slots), run as a
script by tests/test_stream_concurrency.py; prints one ``RESULT {json}`` line per scenario.

* ``threads``: two threads each fitting a streamed ``num_proc=2`` at once.
* ``regrouped``: a streamed 3-rank fit whose rows are read again every epoch (``cache_limit``
  below the shard), Ctrl-C'd inside its epoch, resumed with 2 ranks: the ids each trained.

    python tests/support/local4_fits.py STORE_FOLDER
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, EVERY = 25, 4


class RecordIds:
    """transformation_fn: each batch's ids, a line per batch, in ``folder/rank-N``; while
    ``folder/stop`` exists the ranks train nothing further (a Ctrl-C is on its way)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        if context is None:  # the driver's preflight
            return batch
        while os.path.exists(os.path.join(self.folder, "stop")):
            time.sleep(0.5)
        with open(os.path.join(self.folder, f"rank-{context.partitionId()}"), "a") as f:
            f.write(" ".join(str(int(i)) for i in batch["id"].ravel()) + "\n")
        time.sleep(0.02)
        return batch


def lines(folder: str):
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank-"):
            with open(os.path.join(folder, name)) as f:
                found[name] = [[int(v) for v in line.split()] for line in f if line.strip()]
    return found


def frame(spark):
    import numpy as np
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    rows = [(i, Vectors.dense(a.tolist()), float(b))
            for i, (a, b) in enumerate(zip(x, y, strict=True))]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(3).cache()


def threads(df, store: str) -> dict:
    from support.helpers import linear_estimator

    results, errors = {}, []

    def fit(name):
        try:
            est = linear_estimator(store + name, num_proc=2, epochs=4, batch_size=50,
                                   input_mode="stream", lr=0.05)
            results[name] = est.fit(df.select("features", "label")).getHistory()["loss"]
        except BaseException as exc:  # noqa: BLE001 - reported
            errors.append(repr(exc))

    started = [threading.Thread(target=fit, args=(n,)) for n in ("a", "b")]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(240)
    return {"errors": errors, "losses": results}


def regrouped(df, store: str) -> dict:
    import torch

    from sparktrain import TorchEstimator
    from sparktrain.loop.checkpoint import Checkpoints
    from support.helpers import id_net

    def estimator(num_proc, folder):
        os.makedirs(folder, exist_ok=True)
        net = id_net()
        return TorchEstimator(
            num_proc=num_proc, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.01),
            loss=torch.nn.MSELoss(), feature_cols=["id", "features"], label_cols=["label"],
            batch_size=BATCH, epochs=1, input_mode="stream", cache_limit=4096,
            checkpoint_steps=EVERY, run_id="regrouped", store=store + "r", random_seed=1,
            verbose=1, transformation_fn=RecordIds(folder))

    first, second = store + "first", store + "second"

    def interrupt():  # rank 0 about 40% into the epoch: stop the ranks, then Ctrl-C
        path = os.path.join(first, "rank-0")
        deadline = time.time() + 120
        while time.time() < deadline:
            if os.path.exists(path) and sum(1 for _ in open(path)) >= 11:
                break
            time.sleep(0.02)
        open(os.path.join(first, "stop"), "w").close()
        os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=interrupt, daemon=True)
    interrupted = False
    try:
        watcher.start()
        estimator(3, first).fit(df)
    except KeyboardInterrupt:
        interrupted = True
    time.sleep(3)  # the ranks' processes stop
    latest = Checkpoints(os.path.join(store + "r", "runs", "regrouped")).latest()
    estimator(2, second).fit(df)
    step = latest.step if latest is not None else 0
    before = [ids for rank in lines(first).values() for ids in rank[:step]]
    after = [ids for rank in lines(second).values() for ids in rank]
    return {"interrupted": interrupted, "step": step,
            "world_size": latest.meta.get("world_size") if latest else None,
            "positions": bool(latest and latest.meta.get("positions")),
            "before": [i for ids in before for i in ids],
            "after": [i for ids in after for i in ids],
            "ids": [r["id"] for r in df.select("id").collect()]}


def main() -> None:
    from sparktrain import local_spark

    store = sys.argv[1]
    spark = local_spark("local[4]", conf={"spark.ui.enabled": "false"})
    df = frame(spark)
    for name, scenario in (("threads", threads), ("regrouped", regrouped)):
        print("RESULT " + json.dumps({"scenario": name, **scenario(df, store)}), flush=True)


if __name__ == "__main__":
    main()
