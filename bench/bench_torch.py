#!/usr/bin/env python
"""Benchmark sparktrain's PyTorch path against the alternatives, in one process and one Spark
session, on one generated DataFrame.

    .venv/bin/python bench/bench_torch.py                      # 1,000,000 rows, every figure
    .venv/bin/python bench/bench_torch.py --rows 100000 --skip inference,fit

Figures (bench/README.md: method and figures; bench/HISTORY.md: the full write-up):

  read         rows/s from the materialized store to torch tensors, one rank, batch 1024:
               sparktrain ShardReader vs Petastorm's converter + BatchedDataLoader (classic
               stack only: Petastorm cannot import with pyarrow >= 15)
               (extra: sparktrain shuffle=True, in-memory tensor slice+clone ceiling)
  read:pyarrow the same sparktrain figure vs plain pyarrow.parquet batches turned into
               tensors, what a user writes without a loader library (every stack)
  read:cached  rows/s of epochs after the first, from the rank-local cache, vs the in-memory
               ceiling (extra: shuffled over the whole shard)
  materialize  seconds to materialize the frame into a fresh store vs df.write.parquet
               (extra: second materialize call = reuse, Petastorm converter creation)
  fit          wall time of a warm 1-step 2-rank TorchEstimator.fit vs TorchDistributor.run
  stream       seconds of a 2-epoch fit with input_mode='stream' vs 'store' (a new store each
               time: the dataset is written), and the dataset bytes each leaves in the store
  inference    TorchModel.transform rows/s vs a hand-written iterator pandas_udf
               (extra: vs pyspark.ml.functions.predict_batch_udf)

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_torch.json).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
from common import (
    add_common_args,
    add_frame_args,
    arg_meta,
    bench_session,
    cached,
    figure,
    guarded,
    guarded_runs,
    hang_extras,
    load_meta,
    load_note,
    make_frame,
    new_parser,
    parse_common,
    progress,
    quiet_warnings,
    remove_tmp,
    report,
    session_kind,
    spark_conf,
    timed,
    versions,
)

FIGURES = ("read", "materialize", "fit", "stream", "inference")
READ_BATCH = 1024
HIDDEN, CLASSES = 64, 2
FIT_BATCH = 64  # rows per rank per step in the fit-overhead figure


# -- model shared by every figure --------------------------------------------------------------
def make_mlp(features: int, hidden: int = HIDDEN, classes: int = CLASSES):
    """The benchmark model: ``features -> hidden -> classes`` MLP (same architecture for
    sparktrain, TorchDistributor and the hand-written UDF)."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


def make_estimator(features: int, batch_size: int, store: str, num_proc: int = 2):
    import torch

    from sparktrain import TorchEstimator

    torch.manual_seed(0)
    net = make_mlp(features)
    return TorchEstimator(num_proc=num_proc, model=net,
                          optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                          loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                          label_cols=["label"], batch_size=batch_size, epochs=1, shuffle=False,
                          random_seed=0, verbose=0, store=store)


# -- figure 2: materialize ----------------------------------------------------------------------
def bench_materialize(spark, df, tmp: str, repeats: int, state: Dict[str, Any]) -> Dict[str, Any]:
    from sparktrain.data.materialize import materialize
    from sparktrain.data.schema import training_columns
    from sparktrain.data.store import Store

    columns = training_columns(df, ["features"], ["label"])
    plain_dir = os.path.join(tmp, "plain-parquet")

    def plain_write() -> None:
        df.write.mode("overwrite").parquet("file://" + plain_dir)

    progress("materialize: warm-up (one materialize into a throwaway store, one plain write)")
    warm_store = os.path.join(tmp, "store-materialize-warmup")
    materialize(df, Store.create(warm_store), columns)
    shutil.rmtree(warm_store, ignore_errors=True)
    plain_write()
    st_times, plain_times = [], []
    dataset = store = None
    for i in range(repeats):  # alternate so that load from other processes hits both alike
        store_dir = os.path.join(tmp, f"store-materialize-{i}")
        shutil.rmtree(store_dir, ignore_errors=True)
        store = Store.create(store_dir)
        seconds, dataset = timed(lambda store=store: materialize(df, store, columns))
        assert not dataset.reused, "a fresh store must not reuse anything"
        st_times.append(seconds)
        progress(f"materialize: sparktrain run {i + 1}/{repeats}: {seconds:.2f}s "
                 f"({dataset.train_rows} rows, {sum(len(g) for _, g in dataset.files['train'])} "
                 f"row groups in {len(dataset.files['train'])} files)")
        seconds, _ = timed(plain_write)
        plain_times.append(seconds)
        progress(f"materialize: plain write run {i + 1}/{repeats}: {seconds:.2f}s")
        if i < repeats - 1:
            shutil.rmtree(store_dir, ignore_errors=True)
    reuse_seconds, again = timed(lambda: materialize(df, store, columns))
    assert again.reused and again.root == dataset.root, "second materialize call did not reuse"
    progress(f"materialize: second call (reuse) {reuse_seconds:.3f}s")
    state["dataset"] = dataset
    shutil.rmtree(plain_dir, ignore_errors=True)

    st, plain = statistics.median(st_times), statistics.median(plain_times)
    extras = {
        "second materialize call (reused)": {"value": reuse_seconds, "unit": "s",
                                              "note": f"reused={again.reused}"},
        "runs": {"sparktrain_s": st_times, "plain_write_s": plain_times},
    }
    return figure("materialize", f"seconds to write {df_rows(state)} rows into a fresh store, "
                  f"median of {repeats}; ratio = plain_s / sparktrain_s", "s", st, plain,
                  "df.write.parquet", plain / st, 0.8, ">=", extras)


def df_rows(state: Dict[str, Any]) -> str:
    return f"{state['rows']:,}"


def ensure_dataset(spark, df, tmp: str, state: Dict[str, Any]):
    if state.get("dataset") is None:
        from sparktrain.data.materialize import materialize
        from sparktrain.data.schema import training_columns
        from sparktrain.data.store import Store

        progress("materializing the frame (untimed: the materialize figure was skipped)")
        state["dataset"] = materialize(df, Store.create(os.path.join(tmp, "store-read")),
                                       training_columns(df, ["features"], ["label"]))
    return state["dataset"]


# -- figure 1: read path ------------------------------------------------------------------------
def sparktrain_pass(dataset, shuffle: bool, epoch: int) -> int:
    from sparktrain.data.reader import ShardReader

    reader = ShardReader(dataset.root, dataset.files["train"], dataset.columns, rank=0,
                         world_size=1, batch_size=READ_BATCH, shuffle=shuffle, seed=0)
    rows = reader_pass(reader, epoch)
    reader.close()
    return rows


def reader_pass(reader, epoch: int) -> int:
    """One epoch of ``reader`` into torch tensors; the rows read."""
    import torch

    rows = 0
    for batch in reader.epoch(epoch):
        features = torch.from_numpy(batch["features"])
        label = torch.from_numpy(batch["label"])
        rows += features.shape[0]
        assert label.shape[0] == features.shape[0]
    return rows


def petastorm_pass(converter, loader_fn) -> int:
    rows = 0
    with converter.make_torch_dataloader(batch_size=READ_BATCH, num_epochs=1,
                                         data_loader_fn=loader_fn) as loader:
        for batch in loader:
            rows += batch["label"].shape[0]
            assert batch["features"].shape[0] == batch["label"].shape[0]
    return rows


def pyarrow_pass(dataset) -> int:
    """The hand-written loader: each file's ``iter_batches`` -> numpy -> ``torch.from_numpy``."""
    import pyarrow.parquet as pq
    import torch

    rows = 0
    for name, _ in dataset.files["train"]:
        for batch in pq.ParquetFile(f"{dataset.root}/{name}").iter_batches(
                batch_size=READ_BATCH, columns=["features", "label"]):
            values = batch.column(0).flatten().to_numpy()
            features = torch.from_numpy(values.reshape(batch.num_rows, -1))
            label = torch.from_numpy(batch.column(1).to_numpy())
            rows += features.shape[0]
            assert label.shape[0] == features.shape[0]
    return rows


def ceiling_pass(features, label) -> int:
    rows, n = 0, features.shape[0]
    for start in range(0, n, READ_BATCH):
        f = features[start:start + READ_BATCH].clone()
        y = label[start:start + READ_BATCH].clone()
        rows += f.shape[0]
        assert y.shape[0] == f.shape[0]
    return rows


def petastorm_rate(spark, df, tmp: str, rate: Callable, state: Dict[str, Any]) -> tuple:
    """Rows/s of Petastorm's converter + BatchedDataLoader (its converter creation time goes to
    the materialize figure)."""
    import torch
    from petastorm.pytorch import BatchedDataLoader
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    cache_dir = os.path.join(tmp, "petastorm-cache")
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + cache_dir)
    progress("read: creating the Petastorm converter (timed, reported under materialize)")
    convert_seconds, converter = timed(lambda: make_spark_converter(df))
    state["petastorm_convert_seconds"] = convert_seconds
    progress(f"read: Petastorm converter created in {convert_seconds:.2f}s")
    try:
        with converter.make_torch_dataloader(batch_size=READ_BATCH, num_epochs=1,
                                             data_loader_fn=BatchedDataLoader) as loader:
            batch = next(iter(loader))
            assert tuple(batch["features"].shape) == (READ_BATCH, state["features"]), \
                batch["features"].shape
            assert isinstance(batch["features"], torch.Tensor)
        return rate(lambda: petastorm_pass(converter, BatchedDataLoader),
                    "petastorm BatchedDataLoader")
    finally:
        converter.delete()


def petastorm_importable() -> bool:
    try:
        import petastorm.spark  # noqa: F401  (fails with pyarrow >= 15: pyarrow.filesystem)
        return True
    except ImportError as exc:
        progress(f"read: no Petastorm baseline on this stack ({exc})")
        return False


def bench_read(spark, df, tmp: str, repeats: int, state: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch

    from sparktrain.data.reader import ShardReader

    n = state["rows"]
    dataset = ensure_dataset(spark, df, tmp, state)

    def rate(fn: Callable[[], int], label: str) -> tuple:
        fn()  # warm-up: page cache, imports, thread pools
        rates = []
        for i in range(repeats):
            seconds, rows = timed(fn)
            if rows != n:
                raise AssertionError(f"{label} read {rows} rows, expected {n}")
            rates.append(rows / seconds)
            progress(f"read: {label} run {i + 1}/{repeats}: {seconds:.3f}s "
                     f"= {rows / seconds:,.0f} rows/s")
        return statistics.median(rates), rates

    # first batch shape check
    first = next(iter(ShardReader(dataset.root, dataset.files["train"], dataset.columns, 0, 1,
                                  READ_BATCH).epoch(0)))
    assert first["features"].shape == (READ_BATCH, state["features"]), first["features"].shape

    st, st_runs = rate(lambda: sparktrain_pass(dataset, False, 0), "sparktrain shuffle=False")
    epoch = iter(range(1, 1 << 30))
    st_shuffled, st_shuffled_runs = rate(lambda: sparktrain_pass(dataset, True, next(epoch)),
                                         "sparktrain shuffle=True")
    pa, pa_runs = rate(lambda: pyarrow_pass(dataset), "pyarrow iter_batches")
    cached_readers = {shuffle: ShardReader(
        dataset.root, dataset.files["train"], dataset.columns, 0, 1, READ_BATCH, shuffle, seed=0,
        local_cache=True, cache_root=os.path.join(tmp, "rank-cache")) for shuffle in (False, True)}
    for reader in cached_readers.values():  # the first pass fills the cache (untimed)
        sum(len(b["label"]) for b in reader.epoch(0))
        assert reader.local_cache_complete, "the local cache was not made (disk space?)"
    cached, cached_runs = rate(lambda: reader_pass(cached_readers[False], next(epoch)),
                               "sparktrain local cache, epochs after the first")
    cached_sh, cached_sh_runs = rate(lambda: reader_pass(cached_readers[True], next(epoch)),
                                     "sparktrain local cache shuffled over the shard")
    for reader in cached_readers.values():
        reader.close()
    ps, ps_runs = (petastorm_rate(spark, df, tmp, rate, state) if petastorm_importable()
                   else (None, []))

    progress("read: loading the data into memory for the ceiling")
    parts = list(ShardReader(dataset.root, dataset.files["train"], dataset.columns, 0, 1,
                             1 << 16).epoch(0))
    features = torch.from_numpy(
        np.ascontiguousarray(np.concatenate([p["features"] for p in parts])))
    label = torch.from_numpy(np.ascontiguousarray(np.concatenate([p["label"] for p in parts])))
    del parts
    ceiling, ceiling_runs = rate(lambda f=features, y=label: ceiling_pass(f, y),
                                 "ceiling in-memory slice+clone")
    del features, label

    measure = (f"rows/s store -> torch tensors, batch {READ_BATCH}, rank 0 of 1, shuffle=False, "
               f"median of {repeats}")
    extras = {
        "sparktrain shuffle=True": {"value": st_shuffled, "unit": "rows/s",
                                    "note": f"{st_shuffled / pa:.2f}x pyarrow"},
        "ceiling: in-memory tensor t[i:i+1024].clone()": {
            "value": ceiling, "unit": "rows/s",
            "note": f"sparktrain reaches {st / ceiling:.0%} of it"},
        "runs": {"sparktrain": st_runs, "sparktrain_shuffle": st_shuffled_runs,
                 "pyarrow": pa_runs, "petastorm": ps_runs, "ceiling": ceiling_runs,
                 "cached": cached_runs, "cached_shuffle": cached_sh_runs},
    }
    cache_measure = (f"rows/s of epochs after the first from the rank-local cache -> torch "
                     f"tensors, batch {READ_BATCH}, shuffle=False, median of {repeats}")
    cache_extras = {"shuffled over the whole shard": {
        "value": cached_sh, "unit": "rows/s", "note": f"{cached_sh / ceiling:.0%} of the ceiling"},
        "store path (no cache)": {"value": st, "unit": "rows/s",
                                  "note": f"cache {cached / st:.2f}x"}}
    figures = [figure("read:pyarrow", measure, "rows/s", st, pa,
                      "pyarrow.parquet ParquetFile.iter_batches(1024) -> torch.from_numpy",
                      st / pa, 0.7, ">=", extras),
               figure("read:cached", cache_measure, "rows/s", cached, ceiling,
                      "in-memory tensor t[i:i+1024].clone() (the ceiling)", cached / ceiling,
                      0.5, ">=", cache_extras)]
    if ps is not None:
        figures.append(figure(
            "read", measure, "rows/s", st, ps,
            "petastorm make_spark_converter + make_torch_dataloader(BatchedDataLoader)",
            st / ps, 2.0, ">=", {"runs": {"sparktrain": st_runs, "petastorm": ps_runs}}))
    return figures


# -- figure 3: fit overhead ---------------------------------------------------------------------
def td_one_step(features: int, batch_size: int) -> float:
    """TorchDistributor's function: the same single DDP step sparktrain's 1-step fit takes."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # TorchDistributor/torchrun set MASTER_ADDR, RANK, ...
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = torch.nn.parallel.DistributedDataParallel(make_mlp(features))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.rand(batch_size, features)
        y = torch.randint(0, CLASSES, (batch_size,))
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach().item()
    finally:
        dist.destroy_process_group()


def bench_fit(spark, tmp: str, repeats: int, state: Dict[str, Any]) -> Dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    features = state["features"]
    tiny = cached(make_frame(spark, 2 * FIT_BATCH, features, 2, state["seed"] + 1000))
    estimator = make_estimator(features, FIT_BATCH, os.path.join(tmp, "store-fit"))

    def st_fit():
        model = estimator.fit(tiny)
        assert len(model.getHistory()["loss"]) == 1
        return model

    def td_run():
        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        return distributor.run(td_one_step, features, FIT_BATCH)

    limit, hangs = state["fit_timeout"], state["hangs"]
    # Each in its own block, warm-up first: sparktrain's ranks run as SQL (mapInPandas) tasks,
    # TorchDistributor's as RDD tasks; Spark keeps separate Python worker pools for the two, and
    # a TorchDistributor run leaves sparktrain's pool without warm workers (measured: a fit
    # right after one takes 7.7 s instead of 2.6 s), so interleaving would time a cold start.
    progress("fit: warm-up sparktrain fit (materializes the tiny frame)")
    guarded(spark, st_fit, limit, "fit: sparktrain warm-up fit", hangs)
    st_times = guarded_runs(spark, st_fit, repeats, limit, "fit: sparktrain fit", hangs)
    from sparktrain.estimators.preflight import run_preflight

    specs = estimator._check_params(tiny)
    preflight_times = [timed(lambda: run_preflight(estimator, tiny, specs))[0]
                       for _ in range(repeats)]
    progress(f"fit: preflight alone {statistics.median(preflight_times):.3f}s (median)")
    progress("fit: warm-up TorchDistributor run")
    guarded(spark, td_run, limit, "fit: TorchDistributor warm-up run", hangs)
    td_times = guarded_runs(spark, td_run, repeats, limit, "fit: TorchDistributor run", hangs)
    progress("fit: one more sparktrain fit right after TorchDistributor (not in the ratio)")
    after_td, _ = guarded(spark, st_fit, limit, "fit: sparktrain fit after TorchDistributor",
                          hangs)
    tiny.unpersist()
    st, td = statistics.median(st_times), statistics.median(td_times)
    extras = {"runs": {"sparktrain_s": st_times, "torch_distributor_s": td_times},
              "sparktrain fit right after a TorchDistributor run": {
                  "value": after_td, "unit": "s",
                  "note": "its Python workers start cold (separate worker pools)"},
              "preflight (inside every fit: 8 rows sampled, forward + loss + metrics)": {
                  "value": statistics.median(preflight_times), "unit": "s",
                  "note": f"{statistics.median(preflight_times) / st:.2f}x of the fit"},
              **hang_extras(hangs, "fit:")}
    return figure("fit", f"wall s of a warm 1-step 2-rank fit ({2 * FIT_BATCH} rows, batch "
                  f"{FIT_BATCH}/rank, data already materialized), median of {repeats}", "s",
                  st, td, "TorchDistributor(num_processes=2, local_mode=False).run",
                  st / td, 0.5, "<=", extras)


# -- figure 5: a whole fit, the rows streamed or through the store -----------------------------
STREAM_EPOCHS = 2
STREAM_BATCH = 1024


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def bench_stream(spark, df, tmp: str, repeats: int, state: Dict[str, Any]) -> Dict[str, Any]:
    """End to end, DataFrame to fitted model: input_mode='stream' against 'store' with a new
    store each time (so the store path writes its dataset, as a first fit of a DataFrame does)."""
    runs: Dict[str, List[float]] = {"store": [], "stream": []}
    written: Dict[str, int] = {}

    def fit(mode: str, index: int) -> None:
        store = os.path.join(tmp, f"store-{mode}-{index}")
        est = make_estimator(state["features"], STREAM_BATCH, store)
        est.setParams(epochs=STREAM_EPOCHS, shuffle=True, input_mode=mode)
        seconds, model = timed(lambda: est.fit(df))
        assert len(model.getHistory()["loss"]) == STREAM_EPOCHS
        if index >= 0:
            runs[mode].append(seconds)
        written[mode] = _bytes_under(os.path.join(store, "datasets"))
        shutil.rmtree(store, ignore_errors=True)
        progress(f"stream: {mode} fit {index + 1}/{repeats}: {seconds:.2f}s "
                 f"({written[mode] / 2**20:.0f} MiB of dataset in the store)")

    for mode in ("store", "stream"):  # warm-up: Python workers, imports
        fit(mode, -1)
    for i in range(repeats):
        for mode in ("store", "stream"):
            fit(mode, i)
    stream, store = statistics.median(runs["stream"]), statistics.median(runs["store"])
    extras = {"dataset bytes in the store": {
        "value": written["stream"], "unit": "bytes",
        "note": f"store mode wrote {written['store'] / 2**20:.0f} MiB"},
        "runs": {"stream_s": runs["stream"], "store_s": runs["store"]}}
    return figure("stream", f"seconds of a fit, {state['rows']:,} rows, {STREAM_EPOCHS} epochs, "
                  f"2 ranks, batch {STREAM_BATCH}, new store each fit, median of {repeats}", "s",
                  stream, store, "input_mode='store' (dataset written to a new store)",
                  stream / store, 1.0, "<=", extras)


# -- figure 4: inference ------------------------------------------------------------------------
class _Closure:
    """The broadcast interface (``value``, ``destroy``) for values carried in a closure."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def destroy(self) -> None:
        self.value = None


def handwritten_udf(spark, module, features: int, chunk: int):
    """What a user would write without sparktrain: an iterator pandas_udf that rebuilds the
    model from a broadcast state_dict once per call and predicts Arrow batches in chunks."""
    import pandas as pd
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparktrain.session.spark_api import is_remote

    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    # a broadcast where there is one; over Spark Connect the weights travel in the closure
    weights = _Closure(state) if is_remote(spark) else spark.sparkContext.broadcast(state)

    def predict(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        import torch

        torch.set_num_threads(1)  # one Spark task per core, as sparktrain does (task cpus)
        model = make_mlp(features)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.value.items()})
        model.eval()
        for series in batches:
            x = np.stack(series.to_numpy()).astype(np.float32, copy=False) if len(series) \
                else np.zeros((0, features), np.float32)
            outs = []
            with torch.inference_mode():
                for start in range(0, len(x), chunk):
                    outs.append(model(torch.from_numpy(x[start:start + chunk])).numpy())
            out = np.concatenate(outs) if outs else np.zeros((0, CLASSES), np.float32)
            yield pd.Series(list(out.astype(np.float64)))

    # real types, not the strings ``from __future__ import annotations`` leaves: Spark reads
    # them to pick the iterator flavour (SCALAR_ITER)
    predict.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.Series]}
    return F.pandas_udf(predict, T.ArrayType(T.DoubleType())), weights


def pyspark_predict_udf(module, features: int, chunk: int):
    """Spark ML's own way: ``pyspark.ml.functions.predict_batch_udf`` with a ``make_predict_fn``
    that rebuilds the model from its weights (carried in the closure) once per Python worker."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}

    def make_predict_fn():
        import torch

        torch.set_num_threads(1)
        model = make_mlp(features)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        model.eval()

        def predict(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return model(torch.from_numpy(x.astype(np.float32, copy=False))).numpy() \
                    .astype(np.float64)
        return predict

    return predict_batch_udf(make_predict_fn, return_type=T.ArrayType(T.DoubleType()),
                             batch_size=chunk, input_tensor_shapes=[[features]])


def bench_inference(spark, df, tmp: str, repeats: int, state: Dict[str, Any]) -> Dict[str, Any]:
    from pyspark.sql import functions as F

    n, features = state["rows"], state["features"]
    progress("inference: fitting the model to predict with (2 ranks, 4096 rows, 1 epoch)")
    small = cached(make_frame(spark, 4096, features, 2, state["seed"] + 2000))
    estimator = make_estimator(features, 256, os.path.join(tmp, "store-inference"))
    _, model = guarded(spark, lambda: estimator.fit(small), state["fit_timeout"],
                       "inference: sparktrain fit of the model", state["hangs"])
    small.unpersist()
    udf, weights = handwritten_udf(spark, model.getModel(), features, model.getBatchSize())

    st_df = model.transform(df)
    others = {"hand-written pandas_udf": df.withColumn("label__output", udf(F.col("features")))}
    try:  # Spark ML's predict_batch_udf (pyspark >= 3.4)
        predict_udf = pyspark_predict_udf(model.getModel(), features, model.getBatchSize())
        others["predict_batch_udf"] = df.withColumn("label__output", predict_udf("features"))
    except ImportError:
        pass

    def run(frame) -> None:
        frame.write.format("noop").mode("overwrite").save()

    # they must agree (same weights, same model)
    a = st_df.select("label__output").limit(5).collect()
    for name, frame in others.items():
        b = frame.select("label__output").limit(5).collect()
        assert np.allclose([r[0] for r in a], [r[0] for r in b], atol=1e-5), (name, a, b)

    progress("inference: warm-up sparktrain transform")
    run(st_df)
    for name, frame in others.items():
        progress(f"inference: warm-up {name}")
        run(frame)
    times: Dict[str, List[float]] = {"sparktrain transform": [], **{k: [] for k in others}}
    frames = {"sparktrain transform": st_df, **others}
    for i in range(repeats):
        for name, frame in frames.items():
            seconds, _ = timed(lambda frame=frame: run(frame))
            times[name].append(seconds)
            progress(f"inference: {name} {i + 1}/{repeats}: {seconds:.2f}s "
                     f"= {n / seconds:,.0f} rows/s")
    weights.destroy()
    rates = {name: n / statistics.median(runs) for name, runs in times.items()}
    st, hw = rates["sparktrain transform"], rates["hand-written pandas_udf"]
    extras = {"runs": {name.replace(" ", "_") + "_s": runs for name, runs in times.items()}}
    if "predict_batch_udf" in rates:
        extras["pyspark.ml.functions.predict_batch_udf"] = {
            "value": rates["predict_batch_udf"], "unit": "rows/s",
            "note": f"sparktrain {st / rates['predict_batch_udf']:.2f}x"}
    fit_hangs = [h for h in state["hangs"] if h["what"].startswith("inference:")]
    if fit_hangs:
        extras["HANGS (cancelled and retried, not timed)"] = {
            "value": None, "note": f"{len(fit_hangs)} in the fit that made the model"}
        extras["hangs"] = fit_hangs
    return figure("inference", f"rows/s of transform over {n:,} rows (MLP {features}->{HIDDEN}->"
                  f"{CLASSES}, noop write), median of {repeats}", "rows/s", st, hw,
                  "hand-written iterator pandas_udf", st / hw, 1.5, ">=", extras)


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the main frame")
    add_frame_args(parser, "partitions of the main frame")
    add_common_args(parser, FIGURES, "bench_torch.json", fit_timeout=120.0, connect=True)
    args = parse_common(parser, argv, FIGURES)
    if args.rows < 2 * READ_BATCH:
        parser.error(f"--rows must be at least {2 * READ_BATCH}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    quiet_warnings()

    tmp = tempfile.mkdtemp(prefix="sparktrain-bench-")
    progress(f"temp dir {tmp}; starting Spark {args.master} ({session_kind(args)})")
    try:
        with bench_session(args, "sparktrain-bench", spark_conf(tmp)) as spark:
            state: Dict[str, Any] = {"rows": args.rows, "features": args.features,
                                     "seed": args.seed, "fit_timeout": args.fit_timeout,
                                     "hangs": []}
            results: List[Dict[str, Any]] = []
            load_before = os.getloadavg()
            progress(f"generating {args.rows:,} rows x {args.features} features "
                     f"({args.partitions} partitions), cached and counted")
            seconds, df = timed(lambda: cached(make_frame(spark, args.rows, args.features,
                                                          args.partitions, args.seed)))
            progress(f"frame ready in {seconds:.1f}s")

            repeats = args.repeats
            order = [("materialize", lambda: bench_materialize(spark, df, tmp, repeats, state)),
                     ("read", lambda: bench_read(spark, df, tmp, repeats, state)),
                     ("fit", lambda: bench_fit(spark, tmp, repeats, state)),
                     ("stream", lambda: bench_stream(spark, df, tmp, repeats, state)),
                     ("inference", lambda: bench_inference(spark, df, tmp, repeats, state))]
            for name, run in order:
                if name in args.skip:
                    progress(f"skipping {name}")
                    continue
                progress(f"== {name} ==")
                result = run()
                results.extend(result if isinstance(result, list) else [result])
            for r in results:  # Petastorm's converter is created in the read figure
                if r["figure"] == "materialize" and "petastorm_convert_seconds" in state:
                    r["extras"]["petastorm make_spark_converter(df) (first time)"] = {
                        "value": state["petastorm_convert_seconds"], "unit": "s",
                        "note": f"{state['petastorm_convert_seconds'] / r['sparktrain']:.2f}x "
                                f"sparktrain's time"}
            df.unpersist()
    finally:
        remove_tmp(tmp, args.keep_tmp)

    order = {name: i for i, name in enumerate(("read", "read:pyarrow", "read:cached",
                                               "materialize", "fit", "stream", "inference"))}
    results.sort(key=lambda r: order[r["figure"]])
    title = (f"sparktrain torch benchmark: {args.rows:,} rows x {args.features} features, "
             f"{args.master}, {session_kind(args)}, {load_note(load_before)}")
    report(results, args.json_out, lambda: {
        **arg_meta(args, "rows", "features", "partitions", "repeats", "master"),
        "session": session_kind(args), "skipped": sorted(args.skip), **load_meta(load_before),
        **versions()}, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
