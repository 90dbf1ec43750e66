#!/usr/bin/env python
"""Rows fed to ranks on several hosts: dealt by host (this checkout) against every feeder
feeding every rank (sparktrain before issue #52, commit ``8fb84a3^``), in the many-hosts test
bed: a Master and four 2-core Workers, each in a Linux network namespace with its own address
(``tests/support/host_net.py``; root needed).

Each variant runs in a driver process of its own on the bridge, against the same cluster: a
streamed fit (``input_mode="stream"``: rows fed beside the ranks) of ``--rows`` rows in 8
cached partitions, 4 ranks on the 4 hosts, a first (cold: the application's executors and
Python workers start) fit and ``--repeats`` warm ones. The older code is the same checkout's
``sparktrain/`` at that commit (``git archive``), put first on the path of the driver and of the
executors' Python (``spark.executorEnv.PYTHONPATH``).

Figures per variant:

- first step: ``fit()`` called -> the last of the 4 ranks' first loss computation (the loss
  marks its first call in each rank process), cold and warm (median);
- fit: the whole ``fit()`` (2 epochs);
- feeder connections a rank held (the most of any rank) and rows that crossed hosts, summed
  over the variant's fits: from each rank's ``row feed:`` line (both versions log it).

    .venv/bin/python bench/bench_many_hosts.py [--rows 400K] [--repeats 3]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]

from support.host_net import HostNet, available  # noqa: E402 - after sys.path is set
from support.standalone import StandaloneCluster  # noqa: E402 - after sys.path is set

ALL_TO_ALL = "8fb84a3^"  # the last commit whose feeders fed every rank
HOSTS = (1, 2, 3, 4)
PARTITIONS = 8

# The driver of one variant; prints "RESULT {json}" last. Its loss marks each rank's first
# call in MARKS (the hosts share this machine's filesystem).
FITS = textwrap.dedent('''
    import json, logging, os, statistics, sys, time
    import torch
    from pyspark.sql import functions as F
    from sparktrain import TorchEstimator, local_spark

    MARKS, STORE = {marks!r}, {store!r}
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    spark = local_spark(None, conf={{
        "spark.master": {url!r}, "spark.driver.host": {driver!r},
        "spark.pyspark.python": sys.executable, "spark.executor.memory": "768m",
        "spark.executor.cores": "2", "spark.sparktrain.slotWaitSeconds": "120",
        **{executor_env}}})

    class MarkedLoss(torch.nn.MSELoss):
        def forward(self, output, target):
            if getattr(self, "seen", None) != os.getpid():
                self.seen = os.getpid()
                with open(MARKS, "a") as f:
                    f.write(json.dumps({{"pid": os.getpid(), "t": time.time()}}) + "\\n")
            return super().forward(output, target)

    features = F.array(*[F.randn(seed=i) for i in range(4)]).alias("features")
    df = spark.range(0, {rows}, 1, {partitions}).select(features)
    df = df.withColumn("label", F.expr(
        "features[0] - 2 * features[1] + 0.5 * features[2] + 3 * features[3] + 0.5"))
    df = df.cache()
    df.count()
    runs = []
    for run in range({repeats} + 1):
        open(MARKS, "w").close()
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        est = TorchEstimator(num_proc=4, model=net, loss=MarkedLoss(), input_mode="stream",
                             optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                             feature_cols=["features"], label_cols=["label"], batch_size=256,
                             epochs=2, random_seed=0, store=STORE + str(run), verbose=1)
        called = time.time()
        model = est.fit(df)
        done = time.time()
        marks = [json.loads(line) for line in open(MARKS)]
        runs.append({{"first_step": max(m["t"] for m in marks) - called if marks else None,
                     "fit": done - called, "ranks_marked": len(marks),
                     "loss": model.getHistory()["loss"]}})
        print("FIT DONE", run, file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(runs), flush=True)
''')

TRAFFIC = re.compile(r"row feed: (\d+) feeder connection\(s\) from (\d+) host\(s\); (\d+) rows, "
                     r"(\d+) of them from another host")


def old_tree(revision: str, folder: str) -> str:
    """``sparktrain/`` as it was at ``revision``, unpacked under ``folder``: its path entry."""
    archive = subprocess.run(["git", "archive", revision, "sparktrain"], cwd=REPO, check=True,
                             capture_output=True).stdout
    path = os.path.join(folder, "all-to-all")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(path, filter="data")
    return path


def run_variant(net: HostNet, cluster: StandaloneCluster, workdir: str, name: str,
                path: str, rows: int, repeats: int) -> Dict[str, Any]:
    """One driver process of the variant; its fits' figures and its ranks' feed lines."""
    executor_env = {"spark.executorEnv.PYTHONPATH": path} if path else {}
    code = FITS.format(marks=os.path.join(workdir, f"{name}.marks"), url=cluster.url,
                       store=os.path.join(workdir, f"{name}-store-"), driver=net.driver,
                       executor_env=repr(executor_env), rows=rows, partitions=PARTITIONS,
                       repeats=repeats)
    env = dict(os.environ, SPARK_LOCAL_IP=net.driver)
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = path
    log_path = os.path.join(workdir, f"{name}.log")
    started = time.time()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log,
                              text=True, cwd=workdir, env=env, timeout=1800)
    text = open(log_path).read()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed:\n{text[-6000:]}")
    runs = json.loads(lines[0][len("RESULT "):])
    traffic = [tuple(map(int, found)) for found in TRAFFIC.findall(text)]
    warm = runs[1:]
    return {"variant": name, "seconds": time.time() - started,
            "cold_first_step": runs[0]["first_step"],
            "warm_first_step": statistics.median(r["first_step"] for r in warm),
            "warm_first_steps": [r["first_step"] for r in warm],
            "cold_fit": runs[0]["fit"], "warm_fit": statistics.median(r["fit"] for r in warm),
            "final_loss": [r["loss"][-1] for r in runs],
            "connections_per_rank": max((t[0] for t in traffic), default=None),
            "rows_crossed": sum(t[3] for t in traffic) if traffic else None,
            "rows_fed": sum(t[2] for t in traffic) if traffic else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--repeats", type=int, default=3, help="warm fits per variant")
    parser.add_argument("--json-out", default=os.path.join(HERE, "results", "many_hosts.json"))
    args = parser.parse_args()
    why = available()
    if why:
        sys.exit(f"the many-hosts bed cannot be made here: {why}")
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="many-hosts-") as workdir, \
            HostNet(hosts=len(HOSTS) + 1) as net:
        cluster = StandaloneCluster(workdir, host=(net.address(0), net.enter(0))).start()
        try:
            for host in HOSTS:
                cluster.add_worker(cores=2, memory="2g", host=(net.address(host), net.enter(host)))
            old = old_tree(ALL_TO_ALL, workdir)
            for name, path in (("all to all", old), ("by host", "")):
                result = run_variant(net, cluster, workdir, name.replace(" ", "-"), path,
                                     args.rows, args.repeats)
                result["variant"] = name
                results.append(result)
                print(json.dumps(result), flush=True)
                cluster.wait_idle(len(HOSTS))
        finally:
            cluster.stop()
    print(f"\n{args.rows:,} rows in {PARTITIONS} cached partitions, 4 ranks on 4 hosts, 2 epochs; "
          f"warm: median of {args.repeats}")
    print("| variant | first step cold | first step warm | fit warm | connections a rank held "
          "| rows that crossed hosts |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['cold_first_step']:.2f} s | {r['warm_first_step']:.2f} s "
              f"| {r['warm_fit']:.2f} s | {r['connections_per_rank']} "
              f"| {r['rows_crossed']:,} of {r['rows_fed']:,} |")
    os.makedirs(os.path.dirname(args.json_out), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"rows": args.rows, "repeats": args.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
