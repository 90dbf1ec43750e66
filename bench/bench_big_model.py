"""Models of any size (issue #28): memory, closure sizes and prediction throughput of a model
of ``--model-mib`` (default 1 GiB: a frozen embedding table beside a small trained head), fitted
on 2 ranks and predicting on a DataFrame, against Spark's own recipe for batch inference.

    .venv/bin/python bench/bench_big_model.py                  # 1 GiB model (~4 min, ~8 GiB RAM)
    .venv/bin/python bench/bench_big_model.py --model-mib 230  # the issue's 230 MiB example

Figures (see bench/README.md):

* ``transform``: rows/s of ``TorchModel.transform`` (the UDF references the weights file; each
  Python worker maps it once) against a hand-written ``pyspark.ml.functions.predict_batch_udf``
  whose ``make_predict_fn`` builds the module on the meta device and maps the same file
  (``torch.load(mmap=True)``, ``load_state_dict(assign=True)``): the best a user writes by hand.
  Time to the first prediction (a cold worker) is an extra line.
* ``fit memory`` / ``transform memory``: the peak proportional set size (PSS) of the whole
  process tree (this driver, its JVM, the Python workers and ranks) above the tree's PSS before
  the model was built, in model copies (target: fit <= ranks + 1, transform <= executors + 1).
* ``closures``: the pickled bytes of the fit's payload (what each rank reads besides the
  weights file) and of the prediction UDF's factory (what the plan carries), < 1 MiB.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    add_common_args,
    bench_session,
    figure,
    parse_common,
    progress,
    remove_tmp,  # noqa: E402 - after sys.path is set
    report,
    versions,
)

FIGURES = ["transform", "memory", "closures"]


def frozen_table_class():
    """The model class (tests/support/big_models.py's twin): made here, in ``__main__``, so that
    ``predict_batch_udf``'s cloudpickle sends it by value to executors that cannot import
    this directory (see common.py)."""
    import torch

    class FrozenTable(torch.nn.Module):
        """A frozen ``rows`` x 64 table (the pretrained part) and a trained linear head."""

        def __init__(self, rows: int) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(rows, 64)
            self.table.weight.requires_grad_(False)
            self.head = torch.nn.Linear(4 + 64, 1)

        def forward(self, x):
            ids = (x[:, 0].abs() * 1000).long() % self.table.num_embeddings
            return self.head(torch.cat([x, self.table(ids)], dim=1))

    return FrozenTable


class TreePss:
    """Samples the PSS of this process and all its descendants every ``interval`` seconds;
    ``peak()`` since the last ``reset()``."""

    def __init__(self, interval: float = 0.1) -> None:
        import psutil

        self._root = psutil.Process()
        self._interval = interval
        self._samples: List[tuple] = []  # (time, PSS): peak() looks at those since reset()
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        import psutil

        total = 0
        for proc in [self._root] + self._root.children(recursive=True):
            try:
                total += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()  # a sample counts for the phase it started in
            self._samples.append((started, self.now()))
            time.sleep(self._interval)

    def reset(self) -> None:
        self._since = time.monotonic()

    def peak(self) -> int:
        return max([v for t, v in self._samples if t >= self._since] + [self.now()])

    def stop(self) -> None:
        self._stop.set()


def frame(spark, rows: int, partitions: int):
    from pyspark.sql import functions as F

    df = spark.range(0, rows, 1, partitions).select(
        F.array(*[F.randn(i).cast("float") for i in range(4)]).alias("features"))
    df = df.withColumn("label", F.col("features")[0] * 2.0 - F.col("features")[1] + 0.5)
    df = df.cache()
    df.count()
    return df


def noop_write(df) -> None:
    df.write.format("noop").mode("overwrite").save()


def hand_written_udf(weights_path: str, rows: int):
    """Spark's recipe (``predict_batch_udf``), written as well as a user can: the module built
    on the meta device, the file memory-mapped and assigned."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import DoubleType

    def make_predict_fn():
        import torch

        with torch.device("meta"):
            net = frozen_table_class()(rows)
        net.load_state_dict(torch.load(weights_path, mmap=True, weights_only=True), assign=True)
        net.eval()

        def predict(x):
            with torch.inference_mode():
                return net(torch.from_numpy(x)).numpy().ravel().astype("float64")

        return predict

    return predict_batch_udf(make_predict_fn, return_type=DoubleType(), batch_size=1024,
                             input_tensor_shapes=[[4]])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=1024.0)
    parser.add_argument("--rows", type=int, default=200_000, help="rows to predict on")
    parser.add_argument("--fit-rows", type=int, default=20_000)
    add_common_args(parser, FIGURES, "bench_big_model.json", fit_timeout=900, connect=True)
    args = parse_common(parser, argv, FIGURES)
    import cloudpickle
    import torch

    from sparktrain import TorchEstimator, TorchModel

    table_rows = int(args.model_mib * 2 ** 20 / (64 * 4))
    size = table_rows * 64 * 4
    tmp = tempfile.mkdtemp(prefix="bench-big-model-")
    results: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {"model_bytes": size, "table_rows": table_rows, **versions()}
    pss = TreePss()
    conf = {"spark.driver.memory": "2g", "spark.sql.shuffle.partitions": "2"}
    with bench_session(args, "bench-big-model", conf) as spark:
        train = frame(spark, args.fit_rows, 2)
        test = frame(spark, args.rows, 4)
        noop_write(test)  # Python workers started, page cache warm for the data
        base = pss.now()
        progress(f"tree PSS before the model: {base / 2**20:.0f} MiB; building "
                 f"{size / 2**20:.0f} MiB model")
        torch.manual_seed(args.seed)
        net = frozen_table_class()(table_rows)
        est = TorchEstimator(num_proc=2, model=net, store=os.path.join(tmp, "store"),
                             optimizer=torch.optim.Adam(net.head.parameters(), lr=0.05),
                             loss=torch.nn.MSELoss(), feature_cols=["features"],
                             label_cols=["label"], batch_size=256, epochs=1, verbose=0)
        pss.reset()
        started = time.perf_counter()
        model = est.fit(train)
        fit_s = time.perf_counter() - started
        fit_peak = pss.peak() - base
        progress(f"fit {fit_s:.1f} s, peak {fit_peak / 2**20:.0f} MiB above the baseline")

        path = os.path.join(tmp, "saved")
        model.write().save(path)
        weights = os.path.join(path, "model", "weights.pt")
        factory = model._predict_fn_factory()
        udf_bytes = len(cloudpickle.dumps(factory))
        payload_bytes = len(est._payload())
        del net, est  # the driver's copy: transform needs none

        loaded = TorchModel.load(path)
        pss.reset()
        before = pss.now()
        started = time.perf_counter()
        loaded.transform(test.limit(1)).collect()
        first_s = time.perf_counter() - started
        runs, udf_runs = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            noop_write(loaded.transform(test))
            runs.append(time.perf_counter() - started)
        transform_peak = pss.peak() - base
        progress(f"transform: first prediction {first_s:.1f} s, runs {runs}, peak "
                 f"{transform_peak / 2**20:.0f} MiB above the baseline (before it "
                 f"{(before - base) / 2**20:.0f} MiB)")

        udf = hand_written_udf(weights, table_rows)
        pss.reset()
        started = time.perf_counter()
        test.limit(1).select(udf("features")).collect()
        udf_first_s = time.perf_counter() - started
        for _ in range(args.repeats):
            started = time.perf_counter()
            noop_write(test.withColumn("prediction", udf("features")))
            udf_runs.append(time.perf_counter() - started)
        udf_peak = pss.peak() - base
        progress(f"predict_batch_udf: first {udf_first_s:.1f} s, runs {udf_runs}, peak "
                 f"{udf_peak / 2**20:.0f} MiB")

        # the same fit with model= a callable: each rank builds the module itself (as with
        # from_pretrained on a path every executor reads); the driver builds it on the meta
        # device only, so no copy of the weights is ever in the driver
        del loaded, udf
        model_class = frozen_table_class()
        built = TorchEstimator(
            num_proc=2, model=lambda: model_class(table_rows), store=os.path.join(tmp, "built"),
            optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
            loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
            batch_size=256, epochs=1, verbose=0)
        callable_base = pss.now()
        pss.reset()
        started = time.perf_counter()
        built.fit(train)
        callable_fit_s = time.perf_counter() - started
        callable_peak = pss.peak() - callable_base
        progress(f"fit with a model callable {callable_fit_s:.1f} s, peak "
                 f"{callable_peak / 2**20:.0f} MiB above the tree before it")
    pss.stop()

    from statistics import median

    ours, theirs = args.rows / median(runs), args.rows / median(udf_runs)
    results.append(figure(
        "transform", "rows/s of model.transform (weights by file, mapped once per worker)",
        "rows/s", ours, theirs, "predict_batch_udf mapping the same file", ours / theirs, 1.0,
        ">=", {"time to the first prediction": {
            "value": first_s, "unit": "s", "note": f"predict_batch_udf: {udf_first_s:.1f} s"}}))
    copies = lambda peak: peak / size  # noqa: E731
    results.append(figure(
        "fit memory", "peak PSS of the process tree during fit, in model copies", "copies",
        copies(fit_peak), 3.0, "2 ranks + 1 driver", copies(fit_peak) / 3.0, 1.0, "<=",
        {"fit seconds": {"value": fit_s, "unit": "s"}}))
    results.append(figure(
        "fit memory, model callable", "the same, model= a callable building it on each rank",
        "copies", copies(callable_peak), 2.0, "2 ranks + 0 driver", copies(callable_peak) / 2.0,
        1.0, "<=", {"fit seconds": {"value": callable_fit_s, "unit": "s"}}))
    results.append(figure(
        "transform memory", "peak PSS of the process tree during transform, in model copies",
        "copies", copies(transform_peak), 2.0, "1 executor + 1 driver",
        copies(transform_peak) / 2.0, 1.0, "<=",
        {"predict_batch_udf's peak": {"value": f"{copies(udf_peak):.2f} copies"}}))
    results.append(figure(
        "closures", "bytes of the prediction UDF's factory (in the plan)", "bytes",
        udf_bytes, 2 ** 20, "1 MiB", udf_bytes / 2 ** 20, 1.0, "<=",
        {"fit payload (read by each rank; the weights are a file beside it)":
         {"value": f"{payload_bytes:,} bytes"}}))
    report(results, args.json_out, lambda: meta)
    remove_tmp(tmp, args.keep_tmp)


if __name__ == "__main__":
    main()
