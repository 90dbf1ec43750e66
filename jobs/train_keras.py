#!/usr/bin/env python
"""Train an MLP on a Spark DataFrame with sparktrain's KerasEstimator (spark-submit entry point).

    # the demo: scikit-learn's bundled digits, 2 workers on embedded Spark, no download
    python jobs/train_keras.py --demo --backend tensorflow
    python jobs/train_keras.py --demo --backend tfos     # the same on a TensorFlowOnSpark cluster
    python jobs/train_keras.py --demo --remote sc://localhost:15002   # over Spark Connect

    # your data (same flags as jobs/train_torch.py)
    spark-submit --master yarn jobs/train_keras.py --input hdfs:///data/train.parquet \\
        --feature-cols f1,f2,f3 --num-proc 4 --epochs 10 --output hdfs:///models/keras-mlp

The model is a plain Keras 3 Sequential; the Pipeline, report and reload check are the same as
in jobs/train_torch.py.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.common import parse_args, require, run, run_options, use_gpu  # noqa: E402 - after sys.path is set


def build_estimator(args, n_in: int, n_out: int, store: str):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(args.seed)
    hidden = [keras.layers.Dense(int(h), activation="relu") for h in args.hidden.split(",") if h]
    net = keras.Sequential([keras.Input((n_in,)), *hidden, keras.layers.Dense(n_out)])
    classification = args.task == "classification"
    return KerasEstimator(
        num_proc=args.num_proc, model=net, optimizer=keras.optimizers.Adam(args.lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True) if classification
        else "mse", metrics=["accuracy"] if classification else [],
        feature_cols=["features"], label_cols=[args.label_col], batch_size=args.batch_size,
        epochs=args.epochs, validation=args.validation or None, random_seed=args.seed,
        store=store, verbose=1, backend=args.backend, use_gpu=use_gpu(args), **run_options(args))


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(list(argv), __doc__, backends=["tensorflow", "tfos"])
    frameworks = ["tensorflow", "keras"] + (["tensorflowonspark"] if args.backend == "tfos" else [])
    require(frameworks, "--keras", "tf-cpu,tfos")
    return run(args, build_estimator, "sparktrain-train-keras")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
