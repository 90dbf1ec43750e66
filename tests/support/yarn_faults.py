"""Faults on YARN, in the client-mode session of tests/support/yarn_client.py on the mini
clusters (tests/support/hadoop.py, 2 NodeManagers), every store on their HDFS.

* ``interrupted``: Ctrl-C (SIGINT to this process, the driver) once the fit has a checkpoint on
  HDFS; the same fit run again resumes from that checkpoint.
* ``container``: a fit of 2 ranks whose executor is SIGKILLed after epoch 1 (a container lost:
  YARN reports it, Spark asks for another); the fit resumes from its checkpoint on 2 ranks.
* ``node_manager``: ``num_proc=2, min_num_proc=1``; after epoch 1 the NodeManager running a
  rank's executor and not the ApplicationMaster stops for good (its container dies with it, and
  the other NodeManager has no room for a new executor); the fit goes on with 1 rank.

The executors are sized (2240 MiB with their overhead, rounded up by YARN; NodeManagers of 4096
MiB, the ApplicationMaster 640) so that a NodeManager holds one executor at most: the
ApplicationMaster shares one with an executor, the other executor is alone on the other, and a
replacement fits only where an executor was lost. Every run places them alike.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from support.elastic_cluster import Changes, act_when, estimator, latest
from support.hadoop import stop_node_manager, yarn_containers


def _fit(store: str, run_id: str, df, paced_until: str, epochs: int = 4, **params) -> dict:
    started = time.time()
    model = estimator(store, run_id, epochs=epochs, paced_until=paced_until, **params).fit(df)
    checkpoint = latest(store, run_id)
    return {"seconds": round(time.time() - started, 1), "history": model.getHistory(),
            "attempts": checkpoint.meta["attempts"], "predicted": model.transform(df).count()}


def interrupted(store: str, df, paced_until: str) -> dict:
    """Ctrl-C after the first checkpoint; the second fit resumes from the last one."""
    marks: dict = {}

    def interrupt():
        marks["at"] = time.time()
        os.kill(os.getpid(), signal.SIGINT)

    act_when(store, "interrupted", lambda c: c.epochs_done >= 1, interrupt)
    try:
        estimator(store, "interrupted", epochs=4, paced_until=paced_until, num_proc=2,
                  min_num_proc=None).fit(df)
        return {"error": "the fit ended without the interrupt"}
    except KeyboardInterrupt:
        found = {"to_caller_s": round(time.time() - marks["at"], 1)}
    found["checkpoint_epochs"] = latest(store, "interrupted").epochs_done
    return {**found, **_fit(store, "interrupted", df, paced_until, num_proc=2,
                            min_num_proc=None)}


def container(store: str, df, paced_until: str, app_id: str, workdir: str) -> dict:
    """An executor's container SIGKILLed after epoch 1; YARN gives Spark another."""
    marks: dict = {}

    def kill():
        victim = [c for c in yarn_containers(workdir, app_id) if c["role"] == "executor"][0]
        marks.update(at=time.time(), victim=victim)
        os.kill(victim["pid"], signal.SIGKILL)

    act_when(store, "container", lambda c: c.epochs_done >= 1, kill)
    found = _fit(store, "container", df, paced_until, num_proc=2, min_num_proc=None)
    return {**found, "killed": marks.get("victim"),
            "after_kill_s": round(time.time() - marks.get("at", time.time()), 1)}


def node_manager(store: str, df, paced_until: str, app_id: str, workdir: str) -> dict:
    """The NodeManager of a rank's executor, not the ApplicationMaster's, stopped for good."""
    marks: dict = {}

    def stop():
        running = yarn_containers(workdir, app_id)
        am = {c["node_manager"] for c in running if c["role"] == "am"}
        victim = next(c["node_manager"] for c in running
                      if c["role"] == "executor" and c["node_manager"] not in am)
        marks.update(at=time.time(), node_manager=victim, containers=running)
        stop_node_manager(workdir, victim)
        marks["stopped_s"] = round(time.time() - marks["at"], 1)

    act_when(store, "node_manager", lambda c: c.epochs_done >= 1, stop)
    found = _fit(store, "node_manager", df, paced_until, epochs=5, num_proc=2, min_num_proc=1)
    return {**found, **{k: v for k, v in marks.items() if k != "at"}}


CONF = {"spark.executor.memory": "1800m",  # the sizes of the module's docstring
        "spark.sparktrain.slotWaitSeconds": "120",  # a new container starts in ~30 s here
        "spark.sparktrain.elastic.growAfterSeconds": "600"}


def main(spark, workdir: str, hdfs: str) -> dict:
    """The three faults, one after the other, in ``spark`` (a session with :data:`CONF`)."""
    from pyspark.sql import functions as F

    app_id = spark.sparkContext.applicationId
    done = os.path.join(workdir, "faults-paced-until")  # never written: every epoch paced
    changes = Changes(done)
    logging.getLogger("sparktrain").addHandler(changes)
    logging.getLogger("sparktrain").setLevel(logging.INFO)
    features = F.array(*[F.randn(seed=i) for i in range(4)]).alias("features")
    df = spark.range(0, 1000, 1, 2).select("id", features)
    df = df.withColumn("label", F.expr(
        "features[0] - 2 * features[1] + 0.5 * features[2] + 3 * features[3] + 0.5")).cache()
    df.count()
    store = f"{hdfs}/user/sparktrain/faults-store"
    found = {"interrupted": interrupted(store, df, done),
             "container": container(store, df, done, app_id, workdir),
             "node_manager": node_manager(store, df, done, app_id, workdir)}
    found["log"] = [line for _, line in changes.seen
                    if "elastic" in line or "attempt" in line or "lost" in line][:40]
    return found
