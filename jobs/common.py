"""What jobs/train_torch.py and jobs/train_keras.py share: flags, data, the Pipeline, the report.

Each job only builds its estimator; :func:`run` does the rest: read the data (or scikit-learn's
bundled digits with ``--demo``), split it, fit ``VectorAssembler -> StandardScaler -> estimator``,
print the history and the test score, save the PipelineModel, reload it and check it predicts
the same.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence

from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F


def parse_args(argv: Sequence[str], doc: str, backends: Sequence[str],
               strategies: Sequence[str] = ()) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n")[1], epilog=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--demo", action="store_true",
                        help="train on scikit-learn's bundled digits (needs scikit-learn)")
    source.add_argument("--input", help="Parquet path (any Hadoop filesystem) to train on")
    source.add_argument("--table", help="table name to train on")
    p.add_argument("--feature-cols", default=None,
                   help="comma-separated feature columns (numeric, vector or array)")
    p.add_argument("--label-col", default="label", help="label column (default: label)")
    p.add_argument("--task", choices=["classification", "regression"], default="classification")
    p.add_argument("--hidden", default="128", help="hidden layer sizes, e.g. 128,64")
    p.add_argument("--num-proc", type=int, default=2,
                   help="training processes (one per task, or per GPU of a task with several)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch per process")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--validation", type=float, default=0.1,
                   help="fraction of training rows held out for per-epoch validation")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--store", default=None, help="sparktrain store (default: a local temp dir)")
    p.add_argument("--output", default=None, help="where to save the fitted PipelineModel")
    p.add_argument("--run-id", default=None,
                   help="name of the run in the store; run again with the same id to resume "
                        "from its last checkpoint (e.g. after the job was pre-empted)")
    p.add_argument("--max-time", type=float, default=None,
                   help="stop training at the end of the epoch after this many seconds")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="attempts of the training stage "
                        "(default: spark.stage.maxConsecutiveAttempts)")
    p.add_argument("--use-gpu", choices=["auto", "yes", "no"], default="auto",
                   help="train on the GPUs Spark assigns to tasks (auto: when tasks have GPUs)")
    p.add_argument("--backend", choices=list(backends), default=backends[0],
                   help=f"distributed engine (default: {backends[0]})")
    if strategies:
        p.add_argument("--strategy", choices=list(strategies), default=strategies[0],
                       help=f"how ranks hold the model (default: {strategies[0]}; fsdp: "
                            f"sharded across ranks)")
    session = p.add_mutually_exclusive_group()
    session.add_argument("--master", default=None,
                         help="Spark master when not set by spark-submit (default: local[*])")
    session.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                         help="use a Spark Connect server instead of embedded Spark, e.g. "
                              "sc://localhost:15002 (Databricks: sc://<workspace>:443/;"
                              "token=...;x-databricks-cluster-id=...)")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="fail if test accuracy is lower (the demo uses 0.95)")
    args = p.parse_args(argv)
    if not (args.demo or args.input or args.table):
        p.error("one of --demo, --input or --table is required")
    if (args.input or args.table) and not args.feature_cols:
        p.error("--feature-cols is required with --input/--table")
    return args


def run_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The estimator params for checkpointed runs, from ``--run-id/--max-time/--max-attempts``."""
    return {"run_id": args.run_id, "max_time": args.max_time, "max_attempts": args.max_attempts}


def require(modules: Sequence[str], setup_flag: str, extra: str) -> None:
    """Exit with a message naming the set-up step if one of ``modules`` is not installed; checked
    before Spark starts, without importing them.

    Example: ``require(["tensorflow", "keras"], "--keras", "tf-cpu")`` in a venv without
    TensorFlow exits with "... run ./scripts/setup.sh --keras ...".
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        command = f"./scripts/setup.sh {setup_flag}".rstrip()
        sys.exit(f"error: {', '.join(missing)} not installed in this Python ({sys.executable}).\n"
                 f"In a clone of sparktrain run {command} (it adds them to .venv), or\n"
                 f"pip install 'sparktrain[{extra}]' where you installed sparktrain.")


def get_spark(master: str | None, app_name: str, remote: str | None = None) -> SparkSession:
    """A Spark Connect session on ``remote`` if given; under spark-submit (which starts the JVM
    and sets PYSPARK_GATEWAY_PORT) its master; run as a plain script, embedded Spark on
    ``master`` (default ``local[*]``)."""
    from sparktrain import local_spark, remote_spark

    if remote:
        require(["grpc", "zstandard"], "--connect", "connect")
        return remote_spark(remote, app_name=app_name)
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[*]"
    return local_spark(master, app_name=app_name)


def digits_frame(spark: SparkSession) -> DataFrame:
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    frame = pd.DataFrame(digits.data.astype("float64"),
                         columns=[f"pixel_{i}" for i in range(digits.data.shape[1])])
    frame["label"] = digits.target.astype("int64")
    # from pandas, Spark takes the columns as Arrow batches: ~6x faster than from Python rows
    return spark.createDataFrame(frame)


def feature_width(df: DataFrame, cols: List[str]) -> int:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    width = 0
    first = None
    for name in cols:
        dtype = df.schema[name].dataType
        if isinstance(dtype, (VectorUDT, T.ArrayType)):
            first = first or df.select(*cols).first()
            width += len(first[name])
        else:
            width += 1
    return width


def run(args: argparse.Namespace, build_estimator: Callable, app_name: str) -> int:
    """The job: ``build_estimator(args, n_in, n_out, store)`` makes the estimator, fed the
    standardized ``features`` column; returns the process exit code."""
    if args.demo and args.min_accuracy is None:
        args.min_accuracy = 0.95
    spark = get_spark(args.master, app_name, args.remote)
    if args.demo:
        df = digits_frame(spark)
        feature_cols = [c for c in df.columns if c != "label"]
    else:
        df = spark.read.parquet(args.input) if args.input else spark.table(args.table)
        feature_cols = args.feature_cols.split(",")
    label = args.label_col
    train_df, test_df = df.randomSplit([1 - args.test_fraction, args.test_fraction], args.seed)
    train_df, test_df = train_df.cache(), test_df.cache()

    n_in = feature_width(df, feature_cols)
    n_out = int(train_df.agg(F.max(label)).first()[0]) + 1 if args.task == "classification" else 1
    store = args.store or os.path.join(tempfile.gettempdir(), "sparktrain-store")
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=feature_cols, outputCol="assembled"),
        StandardScaler(inputCol="assembled", outputCol="features", withMean=True, withStd=True),
        build_estimator(args, n_in, n_out, store)])

    started = time.perf_counter()
    fitted = pipeline.fit(train_df)
    fit_seconds = time.perf_counter() - started
    history = fitted.stages[-1].getHistory()
    print("\nhistory (per epoch):")
    for key, values in history.items():
        print(f"  {key:>14}: " + " ".join(f"{v:.4f}" for v in values))

    output_col = f"{label}__output"
    score = evaluate(fitted.transform(test_df), label, output_col, args.task)
    name = "accuracy" if args.task == "classification" else "rmse"
    print(f"\ntest {name}: {score:.4f} on {test_df.count()} rows (fit {fit_seconds:.1f}s, "
          f"{args.num_proc} ranks, backend {args.backend})")

    output = args.output or os.path.join(tempfile.mkdtemp(prefix="sparktrain-model-"), "model")
    fitted.write().overwrite().save(output)
    reloaded = PipelineModel.load(output)
    again = evaluate(reloaded.transform(test_df), label, output_col, args.task)
    print(f"saved to {output}; reloaded model's test {name}: {again:.4f}")
    for row in reloaded.transform(test_df).select(label, output_col).limit(3).collect():
        print(f"  {label}={row[label]}  prediction={_prediction(row[output_col], args.task)}")
    print(json.dumps({"test_" + name: score, "reloaded_test_" + name: again,
                      "fit_seconds": round(fit_seconds, 2), "model_path": output,
                      # where the driver's Python and sparktrain came from (on YARN: the
                      # shipped environment's, in the container's folder)
                      "python": sys.executable,
                      "sparktrain": os.path.dirname(importlib.util.find_spec("sparktrain")
                                                    .origin or "")}))

    if abs(again - score) > 1e-6:
        print("error: the reloaded model predicts differently", file=sys.stderr)
        return 1
    classification = args.task == "classification"
    if args.min_accuracy is not None and classification and score < args.min_accuracy:
        print(f"error: test accuracy {score:.4f} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


def use_gpu(args: argparse.Namespace):
    return {"auto": None, "yes": True, "no": False}[args.use_gpu]


def evaluate(predictions: DataFrame, label: str, output_col: str, task: str) -> float:
    if task == "classification":
        predicted = F.expr(f"array_position(`{output_col}`, array_max(`{output_col}`)) - 1")
        return predictions.select(F.avg((predicted == F.col(label)).cast("double"))).first()[0]
    return predictions.select(F.sqrt(F.avg((F.col(output_col) - F.col(label)) ** 2))).first()[0]


def _prediction(value, task: str):
    if task == "classification":
        return max(range(len(value)), key=value.__getitem__)
    return round(value, 4)
