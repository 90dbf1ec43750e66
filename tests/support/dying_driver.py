"""A driver fitting on a standalone cluster, run by tests/test_driver_death.py, which SIGKILLs
it mid-fit and then runs it again with the same run_id:

    python tests/support/dying_driver.py MASTER_URL WORKDIR RUN_ID EPOCHS

Each batch of a rank appends a line to WORKDIR/beats (the test watches when they stop);
prints "RESULT {json}" when its fit ends.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support.*, sparktrain


class Beats:
    """transformation_fn: a line per batch in ``path`` (ranks only), 0.1 s a batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, batch):
        try:
            from pyspark import BarrierTaskContext

            BarrierTaskContext.get().partitionId()
        except Exception:  # noqa: BLE001 - the driver's preflight
            return batch
        with open(self.path, "a") as f:
            f.write(f"{time.time()} {os.getpid()}\n")
        time.sleep(0.1)
        return batch


def main(master: str, workdir: str, run_id: str, epochs: str) -> None:
    from pyspark.sql import functions as F

    from sparktrain import local_spark
    from sparktrain.session.worker_daemon import DAEMON_CONF
    from support.helpers import linear_estimator

    spark = local_spark(master, "sparktrain-dying-driver", conf={
        "spark.driver.host": "127.0.0.1", "spark.executor.memory": "640m",
        "spark.sparktrain.slotWaitSeconds": "60", **DAEMON_CONF})
    features = F.array(*[F.randn(seed=i) for i in range(4)]).alias("features")
    df = spark.range(0, 2000, 1, 2).select(features)
    df = df.withColumn("label", F.expr("features[0] - 2 * features[1] + 0.5"))
    model = linear_estimator(os.path.join(workdir, "store"), epochs=int(epochs), batch_size=100,
                             run_id=run_id, verbose=1,
                             transformation_fn=Beats(os.path.join(workdir, "beats"))).fit(df)
    print("RESULT " + json.dumps({"history": model.getHistory()["loss"]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
