#!/usr/bin/env python
"""Peak memory of one rank reading its shard: sparktrain's ShardReader at 1M and 4M rows (is it
bounded?), and Petastorm's make_batch_reader on the same files.

    .venv/bin/python bench/bench_reader_memory.py                   # 1M and 4M rows x 32 floats
    .venv/bin/python bench/bench_reader_memory.py --sizes 100000,400000 --repeats 1
    .venv/bin/python bench/bench_reader_memory.py --skip petastorm

Both datasets are written by sparktrain's own ``materialize`` (local Spark, the layout a fit
reads). Every read then runs in a fresh Python process that imports what a rank imports (torch,
pyarrow, sparktrain's reader), notes its RSS (the baseline), reads one full epoch as rank 0 of
1 (batch 1024, shuffle on, each batch turned into torch tensors as the training loop does) and
reports its peak RSS (the kernel's high-water mark, ``VmHWM``). Figures (see bench/README.md):

  rss:1M           sparktrain's peak RSS at the smaller size against a 1 GiB budget
  rss:4M/1M        sparktrain's peak RSS at the larger size / at the smaller (target <= 1.10x)
  rss:petastorm    sparktrain's peak RSS / Petastorm make_batch_reader's, larger size
  rss:local-cache 4M/1M  peak anonymous RSS over two epochs with ``local_cache=True`` (the
                   second read from the rank's disk cache), larger / smaller (target <= 1.10x)

Extra lines: baseline RSS, increment, Arrow pool peak, epoch time, and the opt-in
``inmemory_cache_all=True`` (two epochs, the second from memory), which grows with the shard.

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_reader_memory.json).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from common import (
    add_common_args,
    add_frame_args,
    arg_meta,
    child_entry,
    figure,
    load_meta,
    load_note,
    new_parser,
    parse_common,
    progress,
    remove_tmp,
    report,
    run_child,
    spark_conf,
    versions,
)

FIGURES = ("petastorm",)
BATCH = 1024
BUDGET_MIB = 1024.0
GROWTH_TARGET = 1.10


# -- the measured process -----------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Runs in a fresh process: one epoch of one reader, RSS before and at the peak."""
    import numpy as np
    import pyarrow as pa
    import torch

    from sparktrain.data.reader import ShardReader
    from sparktrain.data.schema import ColumnSpec

    if spec["reader"] == "petastorm":
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader
    baseline = _status_kib("VmRSS")
    anon_peak = _status_kib("RssAnon")  # sampled after every batch: VmHWM counts mapped files
    rows = batches = 0
    start = time.perf_counter()
    if spec["reader"].startswith("sparktrain"):
        # "-cached": two epochs, the second from memory; "-local": two epochs, the second from
        # the local disk cache (memory-mapped files: their pages count in VmHWM, not RssAnon)
        cache, local = spec["reader"] == "sparktrain-cached", spec["reader"] == "sparktrain-local"
        columns = [ColumnSpec.from_json(c) for c in spec["columns"]]
        reader = ShardReader(spec["root"], spec["layout"], columns, rank=0, world_size=1,
                             batch_size=BATCH, shuffle=True, seed=spec["seed"],
                             inmemory_cache_all=cache, local_cache=local,
                             **({"cache_root": spec["cache_root"]} if local else {}))
        for epoch in range(2 if cache or local else 1):
            if local and epoch == 1 and not reader.local_cache_complete:
                raise AssertionError("the local cache is not complete after the first epoch")
            rows = 0
            for batch in reader.epoch(epoch):
                features = torch.from_numpy(batch["features"])
                label = torch.from_numpy(batch["label"])
                assert features.shape == (len(label), spec["features"])
                rows += len(label)
                batches += 1
                anon_peak = max(anon_peak, _status_kib("RssAnon"))
        reader.close()
    else:  # Petastorm's defaults, shuffled like sparktrain (row groups, then rows in them)
        with make_batch_reader("file://" + spec["path"], num_epochs=1, shuffle_row_groups=True,
                               shuffle_rows=True, seed=spec["seed"]) as reader:
            for batch in BatchedDataLoader(reader, batch_size=BATCH):
                assert tuple(batch["features"].shape) == (len(batch["label"]), spec["features"])
                rows += len(batch["label"])
                batches += 1
    seconds = time.perf_counter() - start
    return {"reader": spec["reader"], "rows": rows, "batches": batches, "seconds": seconds,
            "baseline_mib": baseline / 1024, "peak_mib": _status_kib("VmHWM") / 1024,
            "anon_peak_mib": anon_peak / 1024,
            "end_mib": _status_kib("VmRSS") / 1024,
            "arrow_pool_max_mib": pa.default_memory_pool().max_memory() / 2 ** 20,
            "arrow_backend": pa.default_memory_pool().backend_name, "numpy": np.__version__}


def measure(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """``child(spec)`` in a fresh interpreter (nothing of this process's memory counts)."""
    return run_child(os.path.abspath(__file__), spec, timeout, f"{spec['reader']} read")


# -- datasets -----------------------------------------------------------------------------------
def materialize_sizes(args, tmp: str) -> Dict[int, Any]:
    """One materialized dataset per size, written by sparktrain's materialize in local Spark."""
    from common import make_frame

    from sparktrain import local_spark
    from sparktrain.data.materialize import materialize
    from sparktrain.data.schema import training_columns
    from sparktrain.data.store import Store

    progress(f"starting Spark {args.master}")
    spark = local_spark(args.master, "sparktrain-bench-reader-memory",
                        conf=spark_conf(tmp, "2g"))
    datasets = {}
    try:
        for rows in args.sizes:
            df = make_frame(spark, rows, args.features, args.partitions, args.seed)
            start = time.perf_counter()
            ds = materialize(df, Store.create(os.path.join(tmp, f"store-{rows}")),
                             training_columns(df, ["features"], ["label"]))
            groups = [g for _, gs in ds.files["train"] for g in gs]
            progress(f"materialized {rows:,} rows in {time.perf_counter() - start:.1f}s: "
                     f"{len(ds.files['train'])} files, {len(groups)} row groups of "
                     f"{min(groups):,}-{max(groups):,} rows")
            assert ds.train_rows == rows
            datasets[rows] = ds
    finally:
        spark.stop()
    return datasets


def label(rows: int) -> str:
    return f"{rows // 1_000_000}M" if rows % 1_000_000 == 0 else f"{rows:,}"


# -- results ------------------------------------------------------------------------------------
def summary(runs: List[Dict[str, Any]]) -> Dict[str, float]:
    """Medians over the repeats of one (reader, size)."""
    keys = ("peak_mib", "anon_peak_mib", "baseline_mib", "end_mib", "arrow_pool_max_mib",
            "seconds")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["increment_mib"] = statistics.median(r["peak_mib"] - r["baseline_mib"] for r in runs)
    out["rows_per_s"] = statistics.median(r["rows"] / r["seconds"] for r in runs)
    return out


def build_figures(args, stats: Dict[str, Dict[int, Dict[str, float]]],
                  runs: Dict[str, Dict[int, List[Dict[str, Any]]]]) -> List[Dict[str, Any]]:
    small, large = args.sizes
    shard_mib = {n: n * (4 * args.features + 8) / 2 ** 20 for n in args.sizes}
    st_small, st_large = stats["sparktrain"][small], stats["sparktrain"][large]

    def detail(s: Dict[str, float], prefix: str = "") -> Dict[str, Any]:
        return {
            f"{prefix}baseline RSS (interpreter + torch, pyarrow, reader imports)":
                {"value": s["baseline_mib"]},
            f"{prefix}increment while reading (peak - baseline)": {"value": s["increment_mib"]},
            f"{prefix}Arrow memory pool peak": {"value": s["arrow_pool_max_mib"]},
            f"{prefix}epoch time": {"value": f"{s['seconds']:.2f} s",
                                    "note": f"{s['rows_per_s'] / 1e6:.2f}M rows/s"},
        }

    def cached_line(rows: int) -> Dict[str, Any]:
        """The opt-in: the whole shard kept in memory grows with it, as it should."""
        c = stats["sparktrain-cached"][rows]
        return {"inmemory_cache_all=True, 2 epochs (the 2nd from memory)": {
            "value": c["peak_mib"], "note": f"+{c['increment_mib']:.0f} MiB over its baseline; "
                                            f"the shard itself is {shard_mib[rows]:.0f} MiB"}}

    what = (f"peak RSS (VmHWM) of a fresh process reading {{rows}} rows x {args.features} "
            f"float32 + int64 label, one epoch, batch {BATCH}, shuffle on, rank 0 of 1, "
            f"median of {args.repeats}")
    results = [
        figure(f"rss:{label(small)}", what.format(rows=f"{small:,}") + "; ratio = peak / budget",
               "MiB", st_small["peak_mib"], BUDGET_MIB, "budget (1 GiB)",
               st_small["peak_mib"] / BUDGET_MIB, 1.0, "<=",
               {**detail(st_small), **cached_line(small), "runs": runs["sparktrain"][small]}),
        figure(f"rss:{label(large)}/{label(small)}",
               what.format(rows=f"{large:,}") + f"; ratio = peak at {label(large)} / peak at "
               f"{label(small)}", "MiB", st_large["peak_mib"], st_small["peak_mib"],
               f"sparktrain at {label(small)} rows", st_large["peak_mib"] / st_small["peak_mib"],
               GROWTH_TARGET, "<=",
               {**detail(st_large),
                "increment ratio (without the baseline)": {
                    "value": f"{st_large['increment_mib'] / st_small['increment_mib']:.2f}x",
                    "note": f"{st_large['increment_mib']:.0f} / "
                            f"{st_small['increment_mib']:.0f} MiB"},
                **cached_line(large), "runs": runs["sparktrain"][large]}),
    ]
    if "sparktrain-local" in stats:
        lo_small, lo_large = stats["sparktrain-local"][small], stats["sparktrain-local"][large]
        results.append(figure(
            f"rss:local-cache {label(large)}/{label(small)}",
            f"peak anonymous RSS (RssAnon, sampled after every batch: the cache's memory-mapped "
            f"pages are page cache, not the process's) of a fresh process reading two epochs "
            f"with local_cache=True (the first fills the rank cache from the store, the second "
            f"reads only it), shuffled, batch {BATCH}; ratio = at {label(large)} / at "
            f"{label(small)}", "MiB", lo_large["anon_peak_mib"], lo_small["anon_peak_mib"],
            f"the same at {label(small)} rows", lo_large["anon_peak_mib"] /
            lo_small["anon_peak_mib"], GROWTH_TARGET, "<=",
            {f"VmHWM at {label(small)} / {label(large)} (mapped cache pages included)": {
                "value": f"{lo_small['peak_mib']:.0f} / {lo_large['peak_mib']:.0f} MiB",
                "note": f"the shard is {shard_mib[small]:.0f} / {shard_mib[large]:.0f} MiB"},
             f"two epochs at {label(large)}": {
                 "value": f"{lo_large['seconds']:.2f} s",
                 "note": f"one epoch from the store: {st_large['seconds']:.2f} s"},
             "runs": runs["sparktrain-local"]}))
    if "petastorm" in stats:
        ps_small, ps_large = stats["petastorm"][small], stats["petastorm"][large]
        results.append(figure(
            "rss:petastorm", what.format(rows=f"{large:,}") + "; ratio = sparktrain / Petastorm",
            "MiB", st_large["peak_mib"], ps_large["peak_mib"],
            "petastorm make_batch_reader(defaults, shuffled) + BatchedDataLoader",
            st_large["peak_mib"] / ps_large["peak_mib"], 1.0, "<=",
            {**detail(ps_large, "petastorm "),
             f"petastorm peak RSS at {label(small)}": {
                 "value": ps_small["peak_mib"],
                 "note": f"sparktrain {st_small['peak_mib']:.0f} MiB; petastorm grows "
                         f"{ps_large['peak_mib'] / ps_small['peak_mib']:.2f}x from "
                         f"{label(small)} to {label(large)}"},
             "runs": runs["petastorm"]}))
    return results


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--sizes", default="1000000,4000000",
                        help="two row counts: the small and the large dataset")
    add_frame_args(parser, "partitions of each frame (= files written)")
    parser.add_argument("--read-timeout", type=float, default=600.0,
                        help="seconds one measured read may take")
    add_common_args(parser, list(FIGURES), "bench_reader_memory.json", fit_timeout=0.0)
    args = parse_common(parser, argv, list(FIGURES))
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if len(args.sizes) != 2 or not 2 * BATCH <= args.sizes[0] < args.sizes[1]:
        parser.error(f"--sizes: two increasing row counts, the first at least {2 * BATCH}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sparktrain-bench-memory-")
    progress(f"temp dir {tmp}")
    readers = ["sparktrain", "sparktrain-cached", "sparktrain-local"] + (
        [] if "petastorm" in args.skip
                                                     else ["petastorm"])
    runs: Dict[str, Dict[int, List[Dict[str, Any]]]] = {r: {} for r in readers}
    load_before = os.getloadavg()
    try:
        datasets = materialize_sizes(args, tmp)
        for i in range(args.repeats):  # sizes and readers interleaved: load hits all alike
            for rows in args.sizes:
                ds = datasets[rows]
                for reader in readers:
                    spec = {"reader": reader, "root": ds.root, "path": ds.path("train"),
                            "layout": ds.files["train"], "features": args.features,
                            "columns": [c.to_json() for c in ds.columns], "seed": args.seed,
                            "cache_root": os.path.join(tmp, "rank-cache")}
                    run = measure(spec, args.read_timeout)
                    if run["rows"] != rows:
                        raise AssertionError(f"{reader} read {run['rows']} rows, expected {rows}")
                    runs[reader].setdefault(rows, []).append(run)
                    progress(f"{reader} {rows:,} rows, run {i + 1}/{args.repeats}: peak "
                             f"{run['peak_mib']:.0f} MiB (baseline {run['baseline_mib']:.0f}, "
                             f"+{run['peak_mib'] - run['baseline_mib']:.0f}), "
                             f"{run['seconds']:.2f}s")
    finally:
        remove_tmp(tmp, args.keep_tmp)

    stats = {reader: {rows: summary(r) for rows, r in by_size.items()}
             for reader, by_size in runs.items()}
    results = build_figures(args, stats, runs)
    title = (f"sparktrain reader memory benchmark: {', '.join(f'{n:,}' for n in args.sizes)} "
             f"rows x {args.features} features, {load_note(load_before)}")
    report(results, args.json_out, lambda: {
        **arg_meta(args, "sizes", "features", "partitions"), "batch": BATCH,
        "repeats": args.repeats, "skipped": sorted(args.skip), **load_meta(load_before),
        **versions()}, title)
    return 0


if __name__ == "__main__":
    child_entry(child)
    sys.exit(main())
