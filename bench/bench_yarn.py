#!/usr/bin/env python
"""The same streamed fit on YARN and on a standalone cluster: what YARN costs.

Hadoop's mini clusters (a MiniDFSCluster and a MiniYARNCluster with 2 NodeManagers,
tests/support/hadoop.py) and a standalone Master with 2 one-core Workers
(tests/support/standalone.py) run on this machine, side by side. Each repeat starts a fresh
notebook-style client (tests/support/yarn_client.py: ``SparkSession.builder`` on the master,
2 executors of 1 core and 640 MiB, a 2-rank ``input_mode="stream"`` fit of 4 epochs on 2000
rows with its store on the same HDFS, then a prediction) and reports:

- ``session_s``: from the builder to a session whose executors ran a first job (YARN starts an
  ApplicationMaster container and the executor containers; standalone asks its Workers);
- ``fit_s``: the fit alone (executors already up), which is what the cluster manager should
  not change: the ratio yarn / standalone is the figure.

    .venv/bin/python bench/bench_yarn.py [--repeats 2]

Needs ``./scripts/setup.sh --hadoop`` (the mini clusters' jars and hdfs-native).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from support.hadoop import MiniHadoop, available, yarn_conf  # noqa: E402 - after the path
from support.standalone import StandaloneCluster  # noqa: E402 - after the path

CLIENT = os.path.join(REPO, "tests", "support", "yarn_client.py")


def run_client(workdir: str, hdfs: str, conf: Dict[str, str], env: Dict[str, str]) -> Dict:
    """One notebook-style client, the stream fit alone (no faults: they stop a NodeManager)."""
    done = subprocess.run([sys.executable, CLIENT, workdir, hdfs, json.dumps(conf), "--no-faults"],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-4000:])
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    why = available()
    if why:
        sys.exit(why)
    tmp = tempfile.mkdtemp(prefix="sparktrain-bench-yarn-")
    os.makedirs(os.path.join(tmp, "standalone"))
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    found: Dict[str, List[Dict]] = {"yarn": [], "standalone": []}
    with MiniHadoop(os.path.join(tmp, "hadoop"), node_managers=2) as hadoop, \
            StandaloneCluster(os.path.join(tmp, "standalone")) as standalone:
        for _ in range(2):
            standalone.add_worker()
        yarn_env = dict(env, **hadoop.env(), PYSPARK_PYTHON=sys.executable)
        on_yarn = yarn_conf(hadoop)
        on_standalone = {"spark.master": standalone.url, "spark.executor.cores": "1",
                         "spark.cores.max": "2", "spark.executor.memory": "640m",
                         "spark.driver.host": "127.0.0.1", "spark.ui.enabled": "false"}
        for repeat in range(args.repeats):
            for name, conf in (("yarn", on_yarn), ("standalone", on_standalone)):
                result = run_client(hadoop.workdir, hadoop.hdfs, conf, yarn_env)
                found[name].append(result)
                print(f"repeat {repeat + 1} {name}: session {result['session_seconds']} s, "
                      f"fit {result['fit_seconds']} s", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in runs)
                      for key in ("session_seconds", "fit_seconds")}
               for name, runs in found.items()}
    print(json.dumps({"medians": medians,
                      "fit_ratio_yarn_over_standalone": round(
                          medians["yarn"]["fit_seconds"] / medians["standalone"]["fit_seconds"], 2),
                      "session_ratio_yarn_over_standalone": round(
                          medians["yarn"]["session_seconds"]
                          / medians["standalone"]["session_seconds"], 2)}, indent=1))


if __name__ == "__main__":
    main()
