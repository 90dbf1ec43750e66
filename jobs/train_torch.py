#!/usr/bin/env python
"""Train an MLP on a Spark DataFrame with sparktrain's TorchEstimator (spark-submit entry point).

    # the demo: scikit-learn's bundled digits, 2 ranks on embedded Spark, no download
    python jobs/train_torch.py --demo [--backend horovod | --strategy fsdp]

    # your data: a Parquet path or a table, feature and label columns
    spark-submit --master yarn jobs/train_torch.py --input hdfs:///data/train.parquet \\
        --feature-cols f1,f2,f3 --label-col label --task classification \\
        --num-proc 4 --epochs 10 --store hdfs:///user/me/sparktrain --output hdfs:///models/mlp

    # over Spark Connect (Databricks, a Connect server): no local Spark, the same job
    python jobs/train_torch.py --demo --remote sc://localhost:15002 --store /shared/sparktrain

Features are assembled (VectorAssembler) and standardized (StandardScaler) in a Pipeline
before the TorchEstimator; the whole PipelineModel is saved to --output, reloaded and used to
predict, and the job fails if the reloaded model predicts differently.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.common import (  # noqa: E402,F401
    digits_frame,
    parse_args,
    require,
    run,
    run_options,
    use_gpu,
)


def accuracy(output, label):
    """Fraction of rows whose highest logit is the label (a sparktrain metric function)."""
    return (output.argmax(dim=1) == label).float().mean()


def build_estimator(args, n_in: int, n_out: int, store: str):
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(args.seed)
    layers, width = [], n_in
    for size in [int(h) for h in args.hidden.split(",") if h]:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    net = torch.nn.Sequential(*layers, torch.nn.Linear(width, n_out))
    classification = args.task == "classification"
    return TorchEstimator(
        num_proc=args.num_proc, model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=args.lr),
        loss=torch.nn.CrossEntropyLoss() if classification else torch.nn.MSELoss(),
        metrics=[accuracy] if classification else [], feature_cols=["features"],
        label_cols=[args.label_col], batch_size=args.batch_size, epochs=args.epochs,
        validation=args.validation or None, random_seed=args.seed, store=store, verbose=1,
        backend=args.backend, strategy=args.strategy, use_gpu=use_gpu(args),
        **run_options(args))


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(list(argv), __doc__, backends=["torch", "horovod"],
                      strategies=["ddp", "fsdp"])
    require(["torch"], "", "torch")
    return run(args, build_estimator, "sparktrain-train-torch")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
