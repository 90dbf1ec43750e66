#!/usr/bin/env python
"""Process start-up: sparktrain's worker daemon, Keras fork templates, JVM class archive and
installed bytecode vs what a user gets without them.

Figures (each variant in a process of its own with a local[2] session; medians; ratios are
the alternative's seconds / sparktrain's, so above 1 is faster):

- ``worker_start``: a 2-task job on fresh Python workers (``spark.python.worker.reuse=false``)
  whose tasks import torch, pandas and pyarrow, with ``spark.python.daemon.module`` =
  ``sparktrain.session.worker_daemon`` vs PySpark's own ``pyspark.daemon``.
- ``keras_refit``: a 2-rank ``KerasEstimator`` fit (1 epoch, 400 rows) after a first fit in the
  same session, ranks forked from a TensorFlow template (:mod:`sparktrain.launch.zygote`) vs
  fresh ``python -m`` processes (``SPARKTRAIN_FORK_TEMPLATE=0``).
- ``jvm_start``: a fresh process starting ``local_spark("local[2]")``, running a small job and
  stopping, its JVM mapping the class archive (:mod:`sparktrain.session.jvm_archive`) vs not
  (``SPARKTRAIN_JVM_ARCHIVE_DIR`` empty); the JVMs with the user's default options.
- ``python_start``: a fresh Python importing what a rank imports (torch, pandas, pyarrow,
  pyspark, the torch rank loop) from installed bytecode (what ``scripts/setup.sh`` installs)
  vs compiling it from source (no bytecode and ``PYTHONDONTWRITEBYTECODE=1``, as after a
  ``uv pip install`` without ``--compile-bytecode`` in such a container).

    .venv/bin/python bench/bench_starts.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

VARIANTS = {
    "worker_start": {"sparktrain": {}, "baseline": {"daemon": "pyspark.daemon"}},
    "keras_refit": {"sparktrain": {}, "baseline": {"SPARKTRAIN_FORK_TEMPLATE": "0"}},
    "jvm_start": {"sparktrain": {}, "baseline": {"SPARKTRAIN_JVM_ARCHIVE_DIR": "<empty>"}},
    "python_start": {"sparktrain": {}, "baseline": {"PYTHONPYCACHEPREFIX": "<empty>",
                                                    "PYTHONDONTWRITEBYTECODE": "1"}},
}
# What each fresh process of jvm_start / python_start runs.
FRESH = {
    "jvm_start": "from sparktrain import local_spark\n"
                 "spark = local_spark('local[2]', conf={'spark.ui.enabled': 'false'})\n"
                 "assert spark.range(1000).selectExpr('sum(id)').first()[0] == 499500\n"
                 "spark.stop()",
    "python_start": "import torch, pandas, pyarrow, pyspark.sql\n"
                    "import sparktrain.loop.torch_loop",
}


def _imports(batches):  # runs on the executors
    import pandas as pd
    import pyarrow  # noqa: F401
    import torch  # noqa: F401

    for _ in batches:
        yield pd.DataFrame({"n": [1]})


def worker_start(repeats: int, daemon: Optional[str]) -> List[float]:
    from sparktrain import local_spark

    conf = {"spark.python.worker.reuse": "false"}
    if daemon:
        conf["spark.python.daemon.module"] = daemon
    spark = local_spark("local[2]", app_name="bench-starts", conf=conf)
    df = spark.range(0, 2, 1, 2)  # one row in each of 2 partitions: 2 tasks
    times = []
    for _ in range(repeats + 1):  # the first starts the daemon: not counted
        start = time.perf_counter()
        assert df.mapInPandas(_imports, "n long").count() == 2
        times.append(time.perf_counter() - start)
    return times[1:]


def keras_refit(repeats: int) -> List[float]:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    from sparktrain import KerasEstimator, local_spark

    spark = local_spark("local[2]", app_name="bench-starts")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4))
    df = spark.createDataFrame([(a.tolist(), float(a.sum())) for a in x],
                               "features array<double>, label double").cache()
    df.count()
    store = tempfile.mkdtemp(prefix="bench-starts-")
    times = []
    for _ in range(repeats + 1):  # the first writes the data and starts the templates
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        estimator = KerasEstimator(model=model, optimizer="sgd", loss="mse", num_proc=2,
                                   feature_cols=["features"], label_cols=["label"], epochs=1,
                                   batch_size=32, store=store, verbose=0)
        start = time.perf_counter()
        estimator.fit(df)
        times.append(time.perf_counter() - start)
    return times[1:]


def fresh_processes(figure: str, repeats: int) -> List[float]:
    """Seconds of ``repeats`` fresh processes running ``FRESH[figure]`` (the tests' JVM
    options left out: the user's defaults)."""
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", FRESH[figure]], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        times.append(time.perf_counter() - start)
    return times


def run_variant(figure: str, variant: str, repeats: int) -> List[float]:
    """One variant in a fresh process; its timed runs."""
    settings = VARIANTS[figure][variant]
    empty = tempfile.mkdtemp(prefix="bench-starts-empty-")
    env = dict(os.environ, **{k: v.replace("<empty>", empty) for k, v in settings.items()
                              if k.isupper()})
    command = [sys.executable, __file__, "--child", figure, "--repeats", str(repeats)]
    if "daemon" in settings:
        command += ["--daemon", settings["daemon"]]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{figure}/{variant} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], choices=sorted(VARIANTS))
    parser.add_argument("--json-out", default=os.path.join(HERE, "results", "starts.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--daemon", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child in FRESH:
            times = fresh_processes(args.child, args.repeats)
        elif args.child == "worker_start":
            times = worker_start(args.repeats, args.daemon)
        else:
            times = keras_refit(args.repeats)
        print(json.dumps(times))
        return 0
    results: Dict[str, Dict[str, object]] = {}
    for figure in VARIANTS:
        if figure in args.skip:
            continue
        medians = {}
        for variant in ("sparktrain", "baseline"):
            times = run_variant(figure, variant, args.repeats)
            medians[variant] = statistics.median(times)
            print(f"{figure:13s} {variant:10s} median {medians[variant]:6.2f} s  "
                  f"runs {', '.join(f'{t:.2f}' for t in times)}", flush=True)
        ratio = medians["baseline"] / medians["sparktrain"]
        results[figure] = {**{f"{k}_s": round(v, 3) for k, v in medians.items()},
                           "ratio": round(ratio, 2)}
        print(f"{figure:13s} ratio (baseline s / sparktrain s): {ratio:.2f}x", flush=True)
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
                   "figures": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
