"""GPUs on YARN as Hadoop and Spark test them without devices, run by tests/test_yarn.py in a
process of its own. The mini YARN cluster's NodeManagers offer ``yarn.io/gpu`` (a resource type
counted by the scheduler: tests/support/hadoop.py); Spark asks YARN for one per executor
(``spark.executor.resource.gpu.amount=1``, which Spark on YARN requests as ``yarn.io/gpu``) and
its discovery script (conf/getGpusResources.sh) announces the container's GPU from
``SPARKTRAIN_FAKE_GPUS``, as a container's isolated device shows as GPU 0.

GPUs shared with ETL (``spark.task.resource.gpu.amount=0.5``, 2 cores per executor): ordinary
tasks share a GPU two by two, and the training stage asks for a whole GPU per rank through a
task resource profile (stage-level scheduling: Spark >= 3.5.1 on YARN); the ranks train on the
CPU with their GPU in ``CUDA_VISIBLE_DEVICES``. While the application runs, the
ResourceManager's REST API says how many GPUs YARN allocated to it.

    python tests/support/yarn_gpus.py CONF_DIR HDFS_URL CONF_JSON  # "RESULT {json}" last
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]


class Lines(logging.Handler):
    """sparktrain's log lines in the driver (the ranks' lines come through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def allocated_gpus(conf_dir: str) -> list:
    """``yarn.io/gpu`` in use on each NodeManager, from the ResourceManager's REST API."""
    tree = ElementTree.parse(os.path.join(conf_dir, "yarn-site.xml"))
    conf = {p.findtext("name"): p.findtext("value") for p in tree.getroot().iter("property")}
    url = f"http://{conf['yarn.resourcemanager.webapp.address']}/ws/v1/cluster/nodes"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        nodes = json.load(response)["nodes"]["node"]
    used = []
    for node in nodes:
        resources = node["usedResource"].get("resourceInformations", {})
        used += [int(r["value"]) for r in resources.get("resourceInformation", [])
                 if r["name"] == "yarn.io/gpu"]
    return used


def main(conf_dir: str, hdfs: str, conf: dict) -> dict:
    from pyspark import TaskContext
    from pyspark.sql import SparkSession

    from support.helpers import linear_estimator

    lines = Lines()
    logging.getLogger("sparktrain").addHandler(lines)
    logging.getLogger("sparktrain").setLevel(logging.INFO)
    builder = SparkSession.builder.master("yarn").appName("sparktrain-gpus")
    discovery = os.path.join(os.path.dirname(os.path.dirname(HERE)), "conf",
                             "getGpusResources.sh")
    for key, value in {**conf, "spark.executor.cores": "2",
                       "spark.executor.resource.gpu.amount": "1",
                       "spark.executor.resource.gpu.discoveryScript": discovery,
                       "spark.executorEnv.SPARKTRAIN_FAKE_GPUS": "0",
                       "spark.task.resource.gpu.amount": "0.5"}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    found: dict = {"allocated": allocated_gpus(conf_dir)}

    def hold(rows):  # an ordinary stage: which GPU each task holds, and when
        started = time.time()
        time.sleep(2.5)
        yield (TaskContext.get().resources()["gpu"].addresses, started, time.time())

    found["etl"] = spark.sparkContext.parallelize(range(4), 4).mapPartitions(hold).collect()
    df = spark.createDataFrame([([float(i % 7), float(i % 5), float(i % 3), 1.0],
                                 float(i % 7) - 2.0 * (i % 5) + 0.5) for i in range(400)],
                               "features array<double>, label double")
    model = linear_estimator(f"{hdfs}/user/sparktrain/gpu-store", num_proc=2, epochs=3,
                             batch_size=20, lr=0.01, verbose=2).fit(df)
    found.update(loss=model.getHistory()["loss"],
                 lines=[line for line in lines.seen if "GPU" in line])
    spark.stop()
    return found


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
