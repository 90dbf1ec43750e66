#!/usr/bin/env python
"""Predict with a saved model over a Parquet table (spark-submit entry point): the second job of
a train-then-score pipeline, e.g. on YARN with everything on HDFS.

    spark-submit --master yarn jobs/predict.py --model hdfs:///models/digits \\
        --input hdfs:///data/digits.parquet --output hdfs:///predictions/digits

    python jobs/predict.py --model /tmp/model --input data.parquet --output preds.parquet

The model is what jobs/train_torch.py or jobs/train_keras.py saved (a ``PipelineModel`` whose last
stage is sparktrain's model). The predictions (the input's columns and the model's output
column) are written as Parquet to --output; with --label-col and a classification model the job
prints the accuracy too, and one JSON line with what it did.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.common import evaluate, get_spark  # noqa: E402


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the saved PipelineModel (any Hadoop path)")
    p.add_argument("--input", required=True, help="Parquet path to predict on")
    p.add_argument("--output", default=None, help="where to write the predictions (Parquet)")
    p.add_argument("--label-col", default=None,
                   help="with a classification model: report the accuracy against this column")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="fail (exit 1) below this accuracy")
    p.add_argument("--master", default=None, help="Spark master when run as a plain script")
    p.add_argument("--remote", default=None, metavar="sc://HOST:PORT", help="Spark Connect")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyspark.ml import PipelineModel

    args = parse(sys.argv[1:] if argv is None else argv)
    spark = get_spark(args.master, "sparktrain-predict", args.remote)
    started = time.perf_counter()
    model = PipelineModel.load(args.model)
    output_col = model.stages[-1].getOutputCols()[0]
    predictions = model.transform(spark.read.parquet(args.input))
    found = {"model": args.model, "output_col": output_col}
    if args.output:
        predictions.write.mode("overwrite").parquet(args.output)
        found["rows"] = spark.read.parquet(args.output).count()
        found["output"] = args.output
    if args.label_col:
        found["accuracy"] = evaluate(predictions, args.label_col, output_col, "classification")
    found["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(found))
    if args.min_accuracy is not None and found.get("accuracy", 0.0) < args.min_accuracy:
        print(f"error: accuracy {found.get('accuracy')} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
