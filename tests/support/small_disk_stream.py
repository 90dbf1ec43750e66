"""Stream fits on a session whose local disk (SPARK_LOCAL_DIRS, set by the caller: a small
tmpfs) is smaller than a rank's rows, in a process of its own (run by
tests/test_stream_disk.py)::

    python tests/support/small_disk_stream.py STORE

local[3]: 2 ranks leave a task slot to feed them, so the rows that do not fit the local disk
are read again every epoch; 3 ranks take every slot, so each must keep its whole shard there
before its first step, which cannot fit: a named error, not retried. Prints one JSON line last.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

FEATURES = 64
ROWS = 60_000  # 60k rows x 65 float32: 15 MiB decoded, 7.5 MiB a rank


def main(store: str) -> None:
    import torch
    from pyspark.sql import functions as F

    from sparktrain import LocalDiskFullError, TorchEstimator, TrainingError, local_spark

    spark = local_spark("local[3]", conf={"spark.ui.enabled": "false"})
    weights = [((i % 7) - 3) / 3 for i in range(FEATURES)]
    df = spark.range(ROWS, numPartitions=4).select(
        F.array(*[F.rand(i).cast("float") for i in range(FEATURES)]).alias("features"))
    df = df.withColumn("label", sum(F.col("features")[i] * w for i, w in enumerate(weights))
                       .cast("float"))
    result = {}

    def fit(num_proc: int):
        torch.manual_seed(0)
        net = torch.nn.Linear(FEATURES, 1)
        return TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), 0.05),
                              loss=torch.nn.MSELoss(), feature_cols=["features"],
                              label_cols=["label"], batch_size=256, epochs=2,
                              num_proc=num_proc, input_mode="stream", store=store, verbose=0,
                              random_seed=1).fit(df)

    started = time.time()
    result["history"] = fit(2).getHistory()
    result["seconds"] = time.time() - started
    try:
        fit(3)
        result["every_slot"] = "trained"
    except (LocalDiskFullError, TrainingError) as exc:
        result["every_slot"] = f"{type(exc).__name__}: {exc}"
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
