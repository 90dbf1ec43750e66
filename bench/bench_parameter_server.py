#!/usr/bin/env python
"""Benchmark KerasEstimator(strategy="parameter_server") against "multi_worker_mirrored" on the
same data, model and Spark slots.

    .venv/bin/python bench/bench_parameter_server.py                  # digits, 10 epochs, 1 run
    .venv/bin/python bench/bench_parameter_server.py --epochs 20 --repeats 3

Figures (one Spark session on --master, default local[4]):

  throughput:parameter_server  training samples/s of an MLP 64->64->10 (Adam 3e-3, batch 32 per
                               step) on scikit-learn's digits (1,437 training rows), 1 ps +
                               1 coordinator + 2 workers (num_proc=4), against
                               multi_worker_mirrored with the same 2 training tasks
                               (num_proc=2). An epoch's seconds: the median gap between the
                               coordinator's (rank 0's) epoch ends, epochs 2..E, recorded by a
                               Keras callback; samples/s = training rows / that.
  accuracy:parameter_server    final accuracy on the held-out digits (360 rows) after E epochs,
                               against multi_worker_mirrored; the gap is parameter_server minus
                               multi_worker_mirrored (asynchronous updates from stale
                               variables against synchronous all-reduce).

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_parameter_server.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402 - after sys.path is set

FIGURES = ["throughput", "accuracy"]


def _callback_class():
    import keras

    class EpochClock(keras.callbacks.Callback):
        """On rank 0 / the coordinator: append each epoch end's wall time to ``path``."""

        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        def on_epoch_end(self, epoch, logs=None):
            import time

            with open(self.path, "a") as f:
                f.write(f"{time.time()}\n")

    return EpochClock


def digits(spark):
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = (data.data / 16.0).astype("float32")[order], data.target[order]
    rows = [(x[i].tolist(), int(y[i]), bool(i >= 1437)) for i in range(len(y))]
    df = spark.createDataFrame(rows, "features array<float>, label long, is_test boolean")
    return (common.cached(df.filter("not is_test").drop("is_test")),
            common.cached(df.filter("is_test").drop("is_test")))


def one_fit(spark, strategy: str, train, test, args, tmp: str, run: str) -> Dict[str, Any]:
    import keras
    import numpy as np

    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(args.seed)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(10)])
    clock = os.path.join(tmp, f"{run}.clock")
    extra = dict(num_proc=2 + 2 * 1, num_ps=1) if strategy == "parameter_server" \
        else dict(num_proc=2)
    est = KerasEstimator(strategy=strategy, model=net, optimizer=keras.optimizers.Adam(3e-3),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=["accuracy"], feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=args.epochs,
                         random_seed=args.seed, store=os.path.join(tmp, "store"), run_id=run,
                         verbose=0, callbacks=[_callback_class()(clock)], **extra)
    seconds, model = common.timed(lambda: est.fit(train))
    ends = [float(line) for line in open(clock)]
    epoch_seconds = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
    out = model.transform(test).select("label", "label__output").toPandas()
    accuracy = float(np.mean(np.stack(out["label__output"]).argmax(-1) == out["label"]))
    return {"fit_seconds": seconds, "epoch_seconds": epoch_seconds, "accuracy": accuracy}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    common.add_common_args(parser, FIGURES, "bench_parameter_server.json", fit_timeout=900,
                           connect=False)
    parser.set_defaults(remote=None, connect=False)
    parser.set_defaults(master="local[4]", repeats=1)
    parser.add_argument("--epochs", type=int, default=10)
    args = common.parse_common(parser, argv, FIGURES)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    tmp = tempfile.mkdtemp(prefix="bench-ps-")
    runs: Dict[str, List[Dict[str, Any]]] = {"parameter_server": [], "multi_worker_mirrored": []}
    try:
        with common.bench_session(args, "bench-parameter-server",
                                  {"spark.sparktrain.slotWaitSeconds": "5"}) as spark:
            train, test = digits(spark)
            rows = train.count()
            for repeat in range(args.repeats):
                for strategy in runs:
                    common.progress(f"{strategy}: fit {repeat + 1}/{args.repeats}")
                    runs[strategy].append(one_fit(spark, strategy, train, test, args, tmp,
                                                  f"{strategy}-{repeat}"))
                    common.progress(f"{strategy}: {runs[strategy][-1]}")
    finally:
        common.remove_tmp(tmp, args.keep_tmp)

    def median(strategy: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[strategy])

    ps_rate = rows / median("parameter_server", "epoch_seconds")
    mw_rate = rows / median("multi_worker_mirrored", "epoch_seconds")
    ps_acc, mw_acc = median("parameter_server", "accuracy"), median("multi_worker_mirrored",
                                                                    "accuracy")
    results = []
    if "throughput" not in args.skip:
        results.append(common.figure(
            "throughput:parameter_server", f"training samples/s, digits, {args.epochs} epochs, "
            "1 ps + 2 workers vs 2 mirrored workers", "samples/s", ps_rate, mw_rate,
            "multi_worker_mirrored", ps_rate / mw_rate, 0.5, ">=",
            {"fit seconds (ps)": {"value": median("parameter_server", "fit_seconds"),
                                  "unit": "s"},
             "fit seconds (mirrored)": {"value": median("multi_worker_mirrored", "fit_seconds"),
                                        "unit": "s"}}))
    if "accuracy" not in args.skip:
        results.append(common.figure(
            "accuracy:parameter_server", f"held-out accuracy after {args.epochs} epochs",
            "accuracy", ps_acc, mw_acc, "multi_worker_mirrored", ps_acc / mw_acc, 0.97, ">=",
            {"gap (ps - mirrored)": {"value": f"{ps_acc - mw_acc:+.4f}"}}))
    common.report(results, args.json_out, lambda: {
        "master": args.master, "epochs": args.epochs, "repeats": args.repeats, "runs": runs,
        **common.versions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
